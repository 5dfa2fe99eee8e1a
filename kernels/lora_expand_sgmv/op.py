"""Launcher and torch custom op for the chunked SGMV LoRA expand (see kernel.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from ditserve.kernels._checks import check_chunks, check_expand
from ditserve.kernels._configs import tables
from ditserve.kernels._dispatch import block_rank, dot_precision, use_triton
from ditserve.kernels._tiling import b_descriptor, chunk_block_m, column_blocks, column_chunks
from ditserve.kernels.lora_expand.configs import triton_tiles
from ditserve.kernels.lora_expand_sgmv.reference import lora_expand_sgmv_ref

# The row-stationary walk over gathered rows (ROWS=1): a chunk's rows (BLOCK_M: the chunk size, capped) keep
# their scaled s across CHUNK column blocks, B through TMA. Candidates for benchmarks/kernels/lora_sgmv_tiles.py; the
# default takes one per rank tile (tuned_<gpu>.json).
SGMV_ROWS_SWEEP: dict[str, dict[str, int]] = {
    "rows 64x128 c8 s3 w4 B tma": dict(
        ROWS=1, BLOCK_M=64, BLOCK_N=128, CHUNK=8, STAGES=3, num_warps=4, B_TMA=1
    ),
    "rows 64x128 c24 s3 w4 B tma": dict(
        ROWS=1, BLOCK_M=64, BLOCK_N=128, CHUNK=24, STAGES=3, num_warps=4, B_TMA=1
    ),
    "rows 128x128 c12 s3 w8 B tma": dict(
        ROWS=1, BLOCK_M=128, BLOCK_N=128, CHUNK=12, STAGES=3, num_warps=8, B_TMA=1
    ),
    "rows 32x128 c4 s3 w4 B tma": dict(
        ROWS=1, BLOCK_M=32, BLOCK_N=128, CHUNK=4, STAGES=3, num_warps=4, B_TMA=1
    ),
}

_DIR = Path(__file__).parent


def expand_sgmv_config(block_r: int, device: torch.device = torch.device("cpu")) -> dict[str, int]:
    """The SGMV expand's tiles by rank tile (`tuned_<gpu>.json`): the row-stationary walk (the launch caps
    BLOCK_M at the chunk size), else the segmented expand's tiles of one y tile per program."""
    cfg = tables(_DIR, device)["triton_rows"].get(str(block_r))
    return dict(cfg if cfg is not None else triton_tiles(block_r, device=device))


def launch_lora_expand_sgmv(
    y: torch.Tensor,  # [num_tokens, sum(out_slice_sizes)] fp16/bf16/fp32, updated in place
    s: torch.Tensor,  # [num_slices, num_tokens, rank_dim] fp32
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank], y's dtype
    sorted_token_ids: torch.Tensor,  # [num_tokens] int32
    token_scale: torch.Tensor,  # [num_tokens] fp32, alpha/rank × strength of each token's request
    chunk_slot: torch.Tensor,  # [num_chunks] int32, -1 = no LoRA
    chunk_start: torch.Tensor,  # [num_chunks] int32, into sorted_token_ids
    chunk_len: torch.Tensor,  # [num_chunks] int32, 1..chunk_size
    slot_rank: torch.Tensor,  # [max_loras] int32
    out_slice_sizes: list[int],  # 1..4 output slices, slice j pairs with s[j]
    chunk_size: int,  # longest chunk
    config: dict[str, int] | None = None,  # tile override (benchmarks)
) -> None:
    from ditserve.kernels.lora_expand_sgmv.kernel import (
        _lora_expand_sgmv_kernel,
        _lora_expand_sgmv_rows_kernel,
    )

    check_expand(y, s, b_stacked, out_slice_sizes)
    ids = (sorted_token_ids, chunk_slot, chunk_start, chunk_len, slot_rank)
    check_chunks(y, b_stacked.shape[0], *ids, chunk_size)
    assert token_scale.dtype == torch.float32 and token_scale.shape[0] == y.shape[0]
    num_chunks, rank_dim = chunk_slot.shape[0], s.shape[2]
    if y.shape[0] == 0 or rank_dim == 0 or num_chunks == 0:
        return
    block_r = block_rank(rank_dim)
    cfg = dict(config or expand_sgmv_config(block_r, y.device))
    cfg["BLOCK_M"] = chunk_block_m(cfg["BLOCK_M"], chunk_size)
    cols, blks, num_col_blocks = column_blocks(out_slice_sizes, cfg["BLOCK_N"])
    precision = dot_precision(y.dtype)
    if cfg.pop("ROWS", 0):
        chunk, stages = cfg.pop("CHUNK"), cfg.pop("STAGES")
        chks = column_chunks(blks, num_col_blocks, chunk)
        b_desc, b_tma = b_descriptor(b_stacked, bool(cfg.pop("B_TMA", 0)), cfg["BLOCK_N"], block_r)
        _lora_expand_sgmv_rows_kernel[(chks[-1], num_chunks)](
            y, s, b_stacked, sorted_token_ids, token_scale, chunk_slot, chunk_start, chunk_len, slot_rank,
            *cols, y.shape[1], *blks, *chks[:3],
            *y.stride(), *s.stride(), *b_stacked.stride(), b_desc,
            BLOCK_R=block_r, CHUNK=chunk, STAGES=stages, B_TMA=b_tma, PRECISION=precision, **cfg,
        )  # fmt: skip
        return
    _lora_expand_sgmv_kernel[(num_col_blocks, num_chunks)](
        y, s, b_stacked, sorted_token_ids, token_scale, chunk_slot, chunk_start, chunk_len, slot_rank,
        *cols, y.shape[1], *blks,
        *y.stride(), *s.stride(), *b_stacked.stride(),
        BLOCK_R=block_r, PRECISION=precision, **cfg,
    )  # fmt: skip


@torch.library.custom_op("ditserve::lora_expand_sgmv", mutates_args=("y",))
def lora_expand_sgmv_op(
    y: torch.Tensor,
    s: torch.Tensor,
    b_stacked: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    token_scale: torch.Tensor,
    chunk_slot: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_len: torch.Tensor,
    slot_rank: torch.Tensor,
    out_slice_sizes: list[int],
    chunk_size: int,
) -> None:
    """Chunked SGMV expand into y (in place); Triton on CUDA (or TRITON_INTERPRET=1), else the reference."""
    args = (y, s, b_stacked, sorted_token_ids, token_scale, chunk_slot, chunk_start, chunk_len, slot_rank)
    if use_triton(y):
        launch_lora_expand_sgmv(*args, out_slice_sizes, chunk_size)
    else:
        lora_expand_sgmv_ref(*args, out_slice_sizes)


@lora_expand_sgmv_op.register_fake
def _(y, s, b_stacked, sorted_token_ids, token_scale, chunk_slot, chunk_start, chunk_len, slot_rank,
      out_slice_sizes, chunk_size):  # fmt: skip
    return None
