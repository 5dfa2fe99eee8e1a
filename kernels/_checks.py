"""The launchers' input checks that more than one LoRA op shares: the batch tables (`LoRABatchMeta`), the
shrink's x and A, the expand's y, s and B. Asserts: a failure is a caller's bug, not user input."""

from __future__ import annotations

import torch

# slices per launch: the kernels keep one accumulator or column range per slice (more go in groups of 4)
MAX_SLICES = 4


def _int32_on(device: torch.device, *tables: torch.Tensor) -> None:
    for t in tables:
        assert t.dtype == torch.int32 and t.device == device, (t.dtype, t.device)


def check_segments(
    rows: torch.Tensor,  # [num_tokens, ...], the tensor whose rows the segments cut
    max_loras: int,
    token_seg: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    slot_rank: torch.Tensor,
    seg_scale: torch.Tensor | None = None,
) -> None:
    """The segment tables: int32 on rows' device, a segment per token, one entry per segment in each table,
    a rank per adapter slot; seg_scale (where given) fp32, one per segment."""
    _int32_on(rows.device, token_seg, seg_start, seg_len, seg_slot, slot_rank)
    if seg_scale is not None:
        assert seg_scale.dtype == torch.float32 and seg_scale.shape == seg_start.shape, seg_scale.shape
    assert token_seg.shape[0] == rows.shape[0], (token_seg.shape, rows.shape)
    assert seg_start.shape == seg_len.shape == seg_slot.shape
    assert slot_rank.shape[0] == max_loras, (slot_rank.shape, max_loras)


def check_chunks(
    rows: torch.Tensor,  # [num_tokens, ...], the tensor whose rows the chunks gather
    max_loras: int,
    sorted_token_ids: torch.Tensor,
    chunk_slot: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_len: torch.Tensor,
    slot_rank: torch.Tensor,
    chunk_size: int,
) -> None:
    """The SGMV tables: int32 on rows' device, a sorted position per token, one entry per chunk in each table,
    a rank per adapter slot."""
    _int32_on(rows.device, sorted_token_ids, chunk_slot, chunk_start, chunk_len, slot_rank)
    assert sorted_token_ids.shape[0] == rows.shape[0], (sorted_token_ids.shape, rows.shape)
    assert chunk_slot.shape == chunk_start.shape == chunk_len.shape and chunk_size >= 1
    assert slot_rank.shape[0] == max_loras, (slot_rank.shape, max_loras)


def check_shrink(x: torch.Tensor, a_stacked: torch.Tensor, rank_dim: int) -> None:
    """x [num_tokens, hidden] and A [1..4 slices, max_loras, max_rank, hidden] of one dtype, hidden contiguous;
    rank_dim output columns, at most max_rank and 128."""
    assert x.dim() == 2 and a_stacked.dim() == 4, (x.shape, a_stacked.shape)
    assert x.dtype == a_stacked.dtype, (x.dtype, a_stacked.dtype)
    assert x.shape[1] == a_stacked.shape[3], f"hidden {x.shape[1]} != A hidden {a_stacked.shape[3]}"
    assert 1 <= a_stacked.shape[0] <= MAX_SLICES, f"{a_stacked.shape[0]} slices; split into groups of 4"
    assert 0 <= rank_dim <= a_stacked.shape[2] and rank_dim <= 128, (rank_dim, a_stacked.shape)
    assert a_stacked.stride(3) == 1 and x.stride(1) == 1, "hidden dim must be contiguous"


def check_expand(y: torch.Tensor, s: torch.Tensor, b_stacked: torch.Tensor, sizes: list[int]) -> None:
    """y [num_tokens, sum(sizes)], fp32 s [len(sizes) ≤ 4, num_tokens, rank_dim ≤ 128] and B [max_loras,
    sum(sizes), ≥ rank_dim] in y's dtype."""
    assert y.dim() == 2 and s.dim() == 3 and b_stacked.dim() == 3, (y.shape, s.shape, b_stacked.shape)
    assert 1 <= len(sizes) <= MAX_SLICES and len(sizes) == s.shape[0], (sizes, s.shape)
    assert all(n > 0 for n in sizes), sizes
    assert y.shape[1] == sum(sizes) == b_stacked.shape[1], (y.shape, sizes, b_stacked.shape)
    assert s.shape[1] == y.shape[0] and s.dtype == torch.float32, (s.shape, s.dtype)
    assert s.shape[2] <= b_stacked.shape[2] and s.shape[2] <= 128, (s.shape, b_stacked.shape)
    assert b_stacked.dtype == y.dtype, (b_stacked.dtype, y.dtype)
