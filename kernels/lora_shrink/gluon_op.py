"""Launcher of the Gluon shrink for Hopper (gluon_kernel.py), and when it applies (`gluon_shrink_ok`)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import block_rank, next_pow2, num_programs_limit, tma_ok
from ditserve.kernels.lora_gemm.gluon_op import SMEM_LIMIT, _tma_desc, gluon_available

# 128-row blocks over 8 MMA warps (two warpgroups of 64 rows) and a loader warp, 64-wide K steps; XB x slots
# (0: as many as fit beside the A ring, at most MAX_XB), AB A slots.
GLUON_SHRINK_CONFIG = dict(BLOCK_M=128, BLOCK_K=64, XB=0, AB=4, num_warps=8)
MAX_XB = 8


def shrink_smem(cfg: dict[str, int], num_slices: int, rank_tile: int, itemsize: int = 2) -> tuple[int, int]:
    """(x slots, bytes of shared memory) of `_gluon_lora_shrink_kernel` (barriers aside)."""
    x_slot = cfg["BLOCK_M"] * cfg["BLOCK_K"] * itemsize
    a_ring = cfg["AB"] * next_pow2(num_slices) * rank_tile * cfg["BLOCK_K"] * itemsize
    xb = cfg["XB"] or min(MAX_XB, (SMEM_LIMIT - 1024 - a_ring) // x_slot)
    return xb, xb * x_slot + a_ring


def gluon_shrink_ok(
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    s_cols: int,
    seg_align: int,
    cfg: dict[str, int] = GLUON_SHRINK_CONFIG,
) -> bool:
    """The Gluon shrink's contract: Hopper, bf16/fp16 x and A (contiguous), every segment on a row-block
    boundary, all slices' rank tiles in one MMA (≤ 256 columns), TMA-friendly tensors, the rings in shared
    memory and no deeper than the K steps of a row block."""
    if (
        not x.is_cuda
        or x.dtype not in (torch.bfloat16, torch.float16)
        or not gluon_available(x.device.index or 0)
    ):
        return False
    if a_stacked.dtype != x.dtype or not a_stacked.is_contiguous() or seg_align % cfg["BLOCK_M"]:
        return False
    num_slices, hidden = a_stacked.shape[0], a_stacked.shape[3]
    rank_tile = block_rank(s_cols)
    xb, smem = shrink_smem(cfg, num_slices, rank_tile, x.element_size())
    k_tiles = -(-hidden // cfg["BLOCK_K"])
    return (
        next_pow2(num_slices) * rank_tile <= 256
        and smem <= SMEM_LIMIT - 1024
        and 2 <= xb <= k_tiles
        and 2 <= cfg["AB"] <= k_tiles
        and tma_ok(x, a_stacked.view(-1, hidden))
    )


def launch_gluon_lora_shrink(
    x: torch.Tensor,
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden], contiguous
    s: torch.Tensor,  # [num_slices, num_tokens, s_cols], written: fp32 unscaled, or x's dtype scaled
    token_seg: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor | None,  # None: unscaled fp32 s
    slot_rank: torch.Tensor,
    cfg: dict[str, int] = GLUON_SHRINK_CONFIG,
) -> None:
    """s = (scale ·) x · Aᵀ per row block's adapter (the caller checked `gluon_shrink_ok`)."""
    from ditserve.kernels.lora_shrink.gluon_kernel import _gluon_lora_shrink_kernel

    num_slices, max_loras, max_rank, hidden = a_stacked.shape
    num_tokens, s_cols = x.shape[0], s.shape[2]
    assert s.is_contiguous() and s.shape[:2] == (num_slices, num_tokens), s.shape
    assert (seg_scale is None) == (s.dtype == torch.float32), (s.dtype, seg_scale is None)
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    rank_tile = block_rank(s_cols)
    xb, _ = shrink_smem(cfg, num_slices, rank_tile, x.element_size())
    num_blocks = -(-num_tokens // bm)
    programs = num_programs_limit(x.device)
    # a last round of whole blocks that would leave programs idle goes as pieces of one slice each
    whole = num_blocks - num_blocks % programs if num_slices > 1 else num_blocks
    grid = min(programs, max(whole, (num_blocks - whole) * num_slices))
    _gluon_lora_shrink_kernel[(grid,)](
        _tma_desc(x, [bm, bk]), _tma_desc(a_stacked.view(-1, hidden), [rank_tile, bk]), s, token_seg, seg_slot,
        seg_slot if seg_scale is None else seg_scale, slot_rank, num_tokens, s_cols, max_rank, max_loras * max_rank,
        s.stride(0), s.stride(1), num_blocks, whole,
        G=num_slices, GP=next_pow2(num_slices), R=rank_tile, BLOCK_M=bm, BLOCK_K=bk, XB=xb, AB=cfg["AB"],
        SCALED=seg_scale is not None, num_warps=cfg["num_warps"],
    )  # fmt: skip
