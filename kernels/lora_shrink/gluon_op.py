"""Launcher of the Gluon shrink for Hopper (gluon_kernel.py), and when it applies (`gluon_shrink_ok`)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import block_rank, next_pow2, num_programs_limit, tma_ok
from ditserve.kernels._hopper import SMEM_LIMIT, gluon_available, partition_regs
from ditserve.kernels._hopper import tma_desc as _tma_desc
from ditserve.kernels.lora_shrink.configs import wave_programs

# 64-row blocks on one MMA warpgroup and a loader warp, 64-wide K steps, STAGES ring slots (0: as many as fit
# in shared memory, at most MAX_STAGES); WG MMA partitions of num_warps warps and BLOCK_M rows each make a row
# block of WG · BLOCK_M rows.
GLUON_SHRINK_CONFIG = dict(BLOCK_M=64, BLOCK_K=64, STAGES=0, num_warps=4, WG=1)
# the forms measured (sweep candidates; GLUON=1 selects this kernel in `launch_lora_shrink`): one wave of
# programs, each walking a few consecutive row blocks through one deep ring (STAGES 0: as many slots as fit)
# fed by a loader warp; WG MMA partitions of one warpgroup each make row blocks of 128 / 192 rows
GLUON_FORMS: dict[str, dict[str, int]] = {
    "gluon": dict(GLUON=1, BLOCK_M=64, BLOCK_K=64, STAGES=0, num_warps=4),
    "gluon k128": dict(GLUON=1, BLOCK_M=64, BLOCK_K=128, STAGES=0, num_warps=4),
    "gluon 128": dict(GLUON=1, BLOCK_M=128, BLOCK_K=64, STAGES=0, num_warps=8),
    "gluon 128 k128": dict(GLUON=1, BLOCK_M=128, BLOCK_K=128, STAGES=0, num_warps=8),
    "gluon w2": dict(GLUON=1, BLOCK_M=64, BLOCK_K=64, STAGES=0, num_warps=4, WG=2),
    "gluon w3": dict(GLUON=1, BLOCK_M=64, BLOCK_K=64, STAGES=0, num_warps=4, WG=3),
    "gluon w3 k128": dict(GLUON=1, BLOCK_M=64, BLOCK_K=128, STAGES=0, num_warps=4, WG=3),
    "gluon w3 k32": dict(GLUON=1, BLOCK_M=64, BLOCK_K=32, STAGES=0, num_warps=4, WG=3),
    "gluon 128 k32": dict(GLUON=1, BLOCK_M=128, BLOCK_K=32, STAGES=0, num_warps=8),
}
TAIL_ROWS = 16  # rows of the boxes that bring a piece's last rows where it does not fill an MMA partition
MAX_STAGES = 16


def shrink_smem(cfg: dict[str, int], num_slices: int, rank_tile: int, itemsize: int = 2) -> tuple[int, int]:
    """(ring slots, bytes of shared memory) of `_gluon_lora_shrink_kernel` (barriers aside)."""
    slot = (cfg.get("WG", 1) * cfg["BLOCK_M"] + num_slices * rank_tile) * cfg["BLOCK_K"] * itemsize
    stages = cfg["STAGES"] or min(MAX_STAGES, (SMEM_LIMIT - 1024) // slot)
    return stages, stages * slot


def gluon_shrink_ok(
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    s_cols: int,
    cfg: dict[str, int] = GLUON_SHRINK_CONFIG,
) -> bool:
    """The Gluon shrink's contract: Hopper, bf16/fp16 x and A (contiguous), all slices' rank tiles in one MMA
    (≤ 256 columns), TMA-friendly tensors, a ring of at least two slots in shared memory; 1-3 MMA
    partitions. Segments may start anywhere (a program cuts its rows at their ends)."""
    if (
        not x.is_cuda
        or x.dtype not in (torch.bfloat16, torch.float16)
        or not gluon_available(x.device.index or 0)
    ):
        return False
    wg = cfg.get("WG", 1)
    if a_stacked.dtype != x.dtype or not a_stacked.is_contiguous() or wg > 3:
        return False
    num_slices, hidden = a_stacked.shape[0], a_stacked.shape[3]
    stages, smem = shrink_smem(cfg, num_slices, block_rank(s_cols), x.element_size())
    # with WG > 1 every thread holds its fp32 accumulators (half the MMA columns) in fewer registers; past
    # this ptxas spills, then fails (4 slices at rank 64 on 3 partitions)
    acc_fits = wg == 1 or num_slices * block_rank(s_cols) // 2 <= partition_regs(wg, cfg["num_warps"]) - 32
    return (
        acc_fits
        and next_pow2(num_slices) * block_rank(s_cols) <= 256
        and smem <= SMEM_LIMIT - 1024
        and stages >= 2
        and tma_ok(x, a_stacked.view(-1, hidden))
    )


def launch_gluon_lora_shrink(
    x: torch.Tensor,  # [num_tokens, hidden]
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden], contiguous
    s: torch.Tensor,  # [num_slices, num_tokens, s_cols], written: fp32 unscaled, or x's dtype scaled
    token_seg: torch.Tensor,  # [num_tokens] int32
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32
    seg_scale: torch.Tensor | None,  # [num_segments] fp32; None: unscaled fp32 s
    slot_rank: torch.Tensor,  # [max_loras] int32
    cfg: dict[str, int] = GLUON_SHRINK_CONFIG,
) -> None:
    """s = (scale ·) x · Aᵀ per segment's adapter (the caller checked `gluon_shrink_ok`)."""
    from ditserve.kernels.lora_shrink.gluon_kernel import _gluon_lora_shrink_kernel

    num_slices, max_loras, max_rank, hidden = a_stacked.shape
    num_tokens, s_cols = x.shape[0], s.shape[2]
    assert s.is_contiguous() and s.shape[:2] == (num_slices, num_tokens), s.shape
    assert (seg_scale is None) == (s.dtype == torch.float32), (s.dtype, seg_scale is None)
    bm, bk, wg, warps = cfg["BLOCK_M"], cfg["BLOCK_K"], cfg.get("WG", 1), cfg["num_warps"]
    rank_tile = block_rank(s_cols)
    stages, _ = shrink_smem(cfg, num_slices, rank_tile, x.element_size())
    # one wave, every program resident at once, each with the same number of consecutive row blocks (give or take
    # one); sharing the rows out over every SM in 16-row units instead was slower (docs/notes/benchmarks-log.md)
    num_blocks = -(-num_tokens // (wg * bm))
    _gluon_lora_shrink_kernel[(wave_programs(num_blocks, num_programs_limit(x.device)),)](
        _tma_desc(x, [bm, bk]), _tma_desc(x, [TAIL_ROWS, bk]), _tma_desc(a_stacked.view(-1, hidden), [rank_tile, bk]),
        s, token_seg, seg_start, seg_len, seg_slot, seg_slot if seg_scale is None else seg_scale, slot_rank,
        num_tokens, s_cols, max_rank, max_loras * max_rank, s.stride(0), s.stride(1), num_blocks,
        G=num_slices, R=rank_tile, BLOCK_M=bm, BLOCK_K=bk, STAGES=stages, SCALED=seg_scale is not None, WG=wg,
        MMA_REGS=partition_regs(wg, warps), num_warps=warps,
    )  # fmt: skip
