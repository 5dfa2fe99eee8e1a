"""Launcher and torch custom op for the chunked SGMV LoRA shrink (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._checks import check_chunks, check_shrink
from ditserve.kernels._dispatch import block_rank, dot_precision, use_triton
from ditserve.kernels._tiling import chunk_block_m
from ditserve.kernels.lora_shrink.configs import triton_tiles
from ditserve.kernels.lora_shrink_sgmv.reference import lora_shrink_sgmv_ref


def shrink_sgmv_config(num_slices: int, block_r: int) -> dict[str, int]:
    """The segmented shrink's tiles (the launch caps BLOCK_M at the chunk size)."""
    return dict(triton_tiles(num_slices, block_r))


# Candidates (benchmarks/kernels/lora_sgmv_tiles.py --op shrink; not yet timed on a GPU, so not a default): one program
# per (chunk, slice) (SPLIT=1), as the segmented shrink's default at ranks 64-128 (BLOCK_M: capped at the chunk)
SGMV_SHRINK_SWEEP: dict[str, dict[str, int]] = {
    "split 64/64/4/4": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT=1),
    "split 128/64/8/4": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, SPLIT=1),
    "split 64/128/4/3": dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT=1),
}


def launch_lora_shrink_sgmv(
    x: torch.Tensor,  # [num_tokens, hidden] fp16/bf16/fp32, hidden contiguous
    a_stacked: torch.Tensor,  # [num_slices ≤ 4, max_loras, max_rank, hidden], same dtype as x
    sorted_token_ids: torch.Tensor,  # [num_tokens] int32, a permutation of range(num_tokens)
    chunk_slot: torch.Tensor,  # [num_chunks] int32, -1 = no LoRA
    chunk_start: torch.Tensor,  # [num_chunks] int32, into sorted_token_ids
    chunk_len: torch.Tensor,  # [num_chunks] int32, 1..chunk_size
    slot_rank: torch.Tensor,  # [max_loras] int32
    rank_dim: int,  # columns of the output = largest rank in the batch
    chunk_size: int,  # longest chunk
    config: dict[str, int] | None = None,  # tile override (benchmarks)
) -> torch.Tensor:  # [num_slices, num_tokens, rank_dim] fp32
    from ditserve.kernels.lora_shrink_sgmv.kernel import _lora_shrink_sgmv_kernel

    check_shrink(x, a_stacked, rank_dim)
    ids = (sorted_token_ids, chunk_slot, chunk_start, chunk_len, slot_rank)
    check_chunks(x, a_stacked.shape[1], *ids, chunk_size)
    num_slices, num_tokens, num_chunks = a_stacked.shape[0], x.shape[0], chunk_slot.shape[0]
    s = torch.empty(num_slices, num_tokens, rank_dim, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or rank_dim == 0 or num_chunks == 0:
        return s.zero_()
    block_r = block_rank(rank_dim)
    cfg = dict(config or shrink_sgmv_config(num_slices, block_r))
    split = bool(cfg.pop("SPLIT", 0))
    cfg["BLOCK_M"] = chunk_block_m(cfg["BLOCK_M"], chunk_size)
    _lora_shrink_sgmv_kernel[(num_chunks, num_slices if split else 1)](
        x, a_stacked, s, sorted_token_ids, chunk_slot, chunk_start, chunk_len, slot_rank,
        x.shape[1], rank_dim,
        *x.stride(), *a_stacked.stride(), *s.stride(),
        NUM_SLICES=1 if split else num_slices, SPLIT=split, BLOCK_R=block_r, PRECISION=dot_precision(x.dtype),
        **cfg,
    )  # fmt: skip
    return s


@torch.library.custom_op("ditserve::lora_shrink_sgmv", mutates_args=())
def lora_shrink_sgmv_op(
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    chunk_slot: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_len: torch.Tensor,
    slot_rank: torch.Tensor,
    rank_dim: int,
    chunk_size: int,
) -> torch.Tensor:
    """Chunked SGMV shrink; Triton on CUDA (or TRITON_INTERPRET=1), else the torch reference."""
    if use_triton(x):
        return launch_lora_shrink_sgmv(
            x,
            a_stacked,
            sorted_token_ids,
            chunk_slot,
            chunk_start,
            chunk_len,
            slot_rank,
            rank_dim,
            chunk_size,
        )
    return lora_shrink_sgmv_ref(
        x, a_stacked, sorted_token_ids, chunk_slot, chunk_start, chunk_len, slot_rank, rank_dim
    )


@lora_shrink_sgmv_op.register_fake
def _(x, a_stacked, sorted_token_ids, chunk_slot, chunk_start, chunk_len, slot_rank, rank_dim, chunk_size):
    return x.new_empty((a_stacked.shape[0], x.shape[0], rank_dim), dtype=torch.float32)
