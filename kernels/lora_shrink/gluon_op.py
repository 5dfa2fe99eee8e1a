"""Launcher of the Gluon shrink for Hopper (gluon_kernel.py), and when it applies (`gluon_shrink_ok`)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import block_rank, next_pow2, num_programs_limit, tma_ok
from ditserve.kernels._hopper import SMEM_LIMIT, gluon_available, partition_regs
from ditserve.kernels._hopper import tma_desc as _tma_desc

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


# Where the Gluon shrink is the default (lora_shrink/op.py SCALED_SWEEP names), by (slices, rank tile), for
# batches of at least half as many 128-row blocks as SMs (4 × 4608 tokens, the skewed mix 4608/1024/4608/256)
# and for smaller ones of at least half as many 64-row blocks (one request of 4608). H200, L2 flushed by a
# read, µs fp32 / bf16 scaled s, three calls (BENCHMARKS.md), against the Triton defaults:
# - 4x4608: 3 slices rank 32 37.9-38.0 / 36.1-36.9 in two calls (41.8-42.8 / 41.2-42.6); 4 slices rank 16 34.0-35.0 /
#   34.1-34.5 (38.6-42.5 / 37.3-37.8), rank 32 40.7-41.5 / 40.4-41.3 (55.0-57.7 / 48.0-48.5); 3 slices rank 16
#   34.1 / 34.0, equal to the Triton kernel (34.1 / 34.0) in the same call.
# - skew: 20.7-27.3 against 24.2-33.6 at ranks 16-32. One request: 11.4-14.0 against 15.6-18.0.
# Rank 64 and above keep the Triton kernels here (their A boxes are three times x's bytes per 64 rows; 55.6-61.6
# µs against 47.4-51.1 on 4x4608, 3 slices), as do 1 and 2 slices (not measured), except on 192-row blocks below.
GLUON_TUNED_LARGE: dict[tuple[int, int], str] = {
    (3, 16): "gluon 128 k128",
    (4, 16): "gluon 128",
    # 4 x 4608 tokens take 3 MMA partitions here (below); the skewed mix 22.4-23.3 µs against 24.6-27.3 for
    # "gluon k128" (two calls)
    (3, 32): "gluon 128",
    (4, 32): "gluon 128",
}
GLUON_TUNED_SMALL: dict[tuple[int, int], str] = {
    (3, 16): "gluon k128",
    (4, 16): "gluon k128",
    (3, 32): "gluon",
    (4, 32): "gluon",
}


# Batches whose segments lie on 192-row blocks filling at least 70 % of the SMs in one wave (4 × 4608 tokens:
# 96 programs of one block) take 3 MMA partitions where that was faster (H200, read flush, µs fp32 / bf16 scaled
# s, two calls, against the forms above in the same calls): 4 slices rank 32 38.6-38.9 / 37.8-37.9 (41.0-41.5 /
# 40.7-41.1), 3 slices rank 32 36.9-37.0 / 36.9-37.0 (38.3-38.7 / 37.3-37.6), 3 slices rank 64 47.5-47.7 / 49.0-49.3
# (the Triton kernel 50.9 / 49.0, one call). At rank 16 they tie; 4 slices at rank 64 do not fit the registers.
GLUON_TUNED_W3: dict[tuple[int, int], str] = {
    (3, 32): "gluon w3",
    (4, 32): "gluon w3",
    (3, 64): "gluon w3",
}


# Batches of at least half as many 64-row blocks as SMs whose segments are off 128-row blocks (image sizes that
# are not multiples of 256 px): the 64-row forms, whose pieces end at segment ends; the Triton kernels' blocks
# straddle segments there. H200, read flush, µs fp32 s, 4x4600 / 4x4544 / skew 4600/1000/4544/300 against the
# Triton defaults in the same call (BENCHMARKS.md): 3 slices rank 16 40.6 / 35.4 / 27.1 (45.5 / 34.4 / 37.1),
# rank 32 45.3 / 38.8 / 32.7 (116.7 / 45.8 / 42.8), rank 64 60.5 / 48.9 / 44.1 (111.6 / 108.4 / 93.2); 4 slices
# rank 16 38.8 / 35.0 / 27.7 (48.9 / 38.3 / 43.4), rank 32 48.9 / 40.6 / 34.3 (116.4 / 51.1 / 54.2), rank 64
# 77.0 / 62.5 / 55.7 (185.1 / 118.2 / 106.0).
GLUON_TUNED_OFF_BLOCKS: dict[tuple[int, int], str] = {
    (3, 16): "gluon k128",
    (4, 16): "gluon k128",
    (3, 32): "gluon",
    (4, 32): "gluon",
    (3, 64): "gluon",
    (4, 64): "gluon",
}


def wave_programs(num_blocks: int, num_sms: int) -> int:
    """Programs of the one-wave launch (`launch_gluon_lora_shrink`): each takes cdiv(blocks, SMs) consecutive
    blocks."""
    return -(-num_blocks // -(-num_blocks // num_sms)) if num_blocks else 0


def gluon_shrink_choice(
    num_slices: int, rank_tile: int, num_tokens: int, num_sms: int, seg_align: int = 1
) -> str | None:
    """The SCALED_SWEEP name of the Gluon shrink this batch takes by default, or None (the Triton kernels). The
    tuned forms were measured on batches whose segments lie on their row blocks, and are taken only there;
    batches whose segments are off 128-row blocks take GLUON_TUNED_OFF_BLOCKS."""
    if seg_align % 192 == 0 and wave_programs(-(-num_tokens // 192), num_sms) >= 0.7 * num_sms:
        name = GLUON_TUNED_W3.get((num_slices, rank_tile))
        if name is not None:
            return name
    name = None
    if -(-num_tokens // 128) >= num_sms // 2:
        name = GLUON_TUNED_LARGE.get((num_slices, rank_tile))
    elif -(-num_tokens // 64) >= num_sms // 2:
        name = GLUON_TUNED_SMALL.get((num_slices, rank_tile))
    if name is not None and seg_align % block_rows(name) == 0:
        return name
    if seg_align % 128 and -(-num_tokens // 64) >= num_sms // 2:
        return GLUON_TUNED_OFF_BLOCKS.get((num_slices, rank_tile))
    return None


def block_rows(name: str) -> int:
    """Rows of a row block of the SCALED_SWEEP form `name` (WG · BLOCK_M)."""
    cfg = GLUON_FORMS[name]
    return cfg.get("WG", 1) * cfg["BLOCK_M"]


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
    # one); sharing the rows out over every SM in 16-row units instead was slower (BENCHMARKS.md)
    num_blocks = -(-num_tokens // (wg * bm))
    _gluon_lora_shrink_kernel[(wave_programs(num_blocks, num_programs_limit(x.device)),)](
        _tma_desc(x, [bm, bk]), _tma_desc(x, [TAIL_ROWS, bk]), _tma_desc(a_stacked.view(-1, hidden), [rank_tile, bk]),
        s, token_seg, seg_start, seg_len, seg_slot, seg_slot if seg_scale is None else seg_scale, slot_rank,
        num_tokens, s_cols, max_rank, max_loras * max_rank, s.stride(0), s.stride(1), num_blocks,
        G=num_slices, R=rank_tile, BLOCK_M=bm, BLOCK_K=bk, STAGES=stages, SCALED=seg_scale is not None, WG=wg,
        MMA_REGS=partition_regs(wg, warps), num_warps=warps,
    )  # fmt: skip
