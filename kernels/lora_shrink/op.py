"""Launcher and torch custom op for the segmented LoRA shrink (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import (
    block_rank,
    next_pow2,
    num_programs_limit,
    tma_ok,
    use_triton,
    zeroed_scratch,
)
from ditserve.kernels._hopper import gluon_available
from ditserve.kernels.lora_shrink import gluon_op
from ditserve.kernels.lora_shrink.gluon_op import GLUON_FORMS, gluon_shrink_choice
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref, lora_shrink_scaled_ref
from ditserve.kernels.policy import KernelPolicy, active_policy

MAX_SLICES = 4
# (num_slices, BLOCK_R) -> tiles measured best on an H200 (hidden 3072, 4608 and 4x4608 tokens; sweep in
# benchmarks/lora_kernels.py --sweep, which overrides this table while it runs)
TUNED: dict[tuple[int, int], dict[str, int]] = {
    (3, 16): dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4),
    (3, 32): dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4),
    (3, 64): dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=3),
    (3, 128): dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=3),
    (4, 16): dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4),
    (4, 32): dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4),
    (4, 64): dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=3),
    (4, 128): dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=3),
}

# the TMA kernel, one program per 128-row block and slice, 4 stages (SEGMENTED_TUNED below)
_TMA_SPLIT = dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, SPLIT=1, TMA=1)

# stream-K tiles that won somewhere (SEGMENTED_TUNED below)
_SK_64 = dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, TMA=1, STREAMK=2)
_WIDE_64 = dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, TMA=1, STREAMK=2, WIDE=1)
_WIDE_128 = dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=1, STREAMK=1, WIDE=1)

# Candidates for the scaled (x's dtype) output the fused GEMM reads, swept by benchmarks/lora_kernels.py
# --qkv-only --sweep-gemm (the GPU tests run each once). SPLIT=1: one program per (row block, slice).
SCALED_SWEEP: dict[str, dict[str, int]] = {
    "64/64/4/4": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4),
    "128/64/8/3": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "64/64/4/4 split": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT=1),
    "128/64/8/3 split": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT=1),
    # wider K steps (more bytes in flight per program: the shrink is bound by reading x) and 32-row tiles
    # (4x4608 tokens in 64-row tiles are 288 programs on 132 SMs: some SMs run 3, most 2)
    "64/128/4/3": dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "32/64/4/4": dict(BLOCK_M=32, BLOCK_K=64, num_warps=4, num_stages=4),
    # one request of 4608 tokens is 72 row blocks of 64 for 132 SMs: 32-row tiles, one slice per program
    "32/64/4/4 split": dict(BLOCK_M=32, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT=1),
    "32/128/4/3 split": dict(BLOCK_M=32, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT=1),
    "32/128/4/4": dict(BLOCK_M=32, BLOCK_K=128, num_warps=4, num_stages=4),
    "128/128/8/3 split": dict(BLOCK_M=128, BLOCK_K=128, num_warps=8, num_stages=3, SPLIT=1),
    # 3 stages with one slice per program; 6 stages (best for one request of 4608 tokens at rank 16, 18.5 µs)
    "64/64/4/3 split": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=3, SPLIT=1),
    "64/64/4/6": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=6),
    # x and A through TMA descriptors (TMA=1): no per-element address arithmetic or masks in the K loop
    "tma 64/64/4/4": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, TMA=1),
    "tma 64/64/4/6": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=6, TMA=1),
    "tma 128/64/8/4": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=1),
    "tma 64/128/4/3": dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=3, TMA=1),
    "tma 128/64/8/3 split": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=3, SPLIT=1, TMA=1),
    "tma 128/64/8/4 split": _TMA_SPLIT,
    "tma 64/64/4/4 split": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT=1, TMA=1),
    # fewer stages, more programs per SM: the split kernel's programs (one per row block and slice: 432 of 128
    # rows at 4x4608 tokens, 3 slices) fill the SMs in fewer, fuller waves (4 stages of 128 rows: 2 per SM,
    # 1.6 waves; 2 stages: 4 per SM, one wave; 64 rows and 2 stages: 7 per SM)
    "tma 128/64/8/2 split": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=2, SPLIT=1, TMA=1),
    "tma 64/64/4/2 split": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=2, SPLIT=1, TMA=1),
    "tma 64/64/4/3 split": dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=3, SPLIT=1, TMA=1),
    "tma 128/64/4/2 split": dict(BLOCK_M=128, BLOCK_K=64, num_warps=4, num_stages=2, SPLIT=1, TMA=1),
    # stream-K (STREAMK=n programs per SM: whole row blocks round-robin, then the last partial wave's K steps
    # shared out evenly; every slice in one program, x read once); WIDE=1: every slice's A tile in one load
    # and one wide dot per K step
    "sk 64/64/4/4 x2": _SK_64,
    # the same on 3 programs per SM, and on one of 128 rows; for batches of fewer row blocks than programs
    # (one request of 4608 tokens: 72 row blocks of 64) every SM still gets K steps
    "sk 64/64/4/4 x3": dict(_SK_64, STREAMK=3),
    "sk 128/64/8/4 x1": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=1, STREAMK=1),
    "wide 128/64/8/4": _WIDE_128,
    "wide 64/64/4/4 x2": _WIDE_64,
    # wider K steps on 64-row blocks (one request of 4608 tokens and the skewed mix, rank 16: 15.0 and 21.9 µs
    # against 15.7 and 25.0 for the defaults, H200, read flush)
    "tma 64/128/4/4": dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=4, TMA=1),
    # the Gluon kernel for Hopper (gluon_op.GLUON_FORMS)
    **GLUON_FORMS,
}

# The segmented kernel's defaults (fp32 and scaled outputs) where H200 sweeps (hidden 3072; 4x4608 tokens,
# a skewed mix 4608/1024/4608/256 and one request of 4608; BENCHMARKS.md) found something faster than TUNED
# (which the chunked SGMV shrink reads too, so it keeps pointer tiles). Each entry lists configs in order of
# preference; a stream-K one (STREAMK=n) is taken only when the batch has n row blocks per SM, so every
# program gets at least one (`segmented_config`), else the next. bf16 scaled s, 4x4608 / skew / 1x4608, µs:
# - 3 slices, rank 32: stream-K, 64-row units, two programs per SM: 47.8 / 32.9 / 24.4 (TUNED 56.3 / 33.2 /
#   24.5).
# - 4 slices, rank 32: the same, every slice in one wide dot: 49.7 / 32.2 / 23.3 (TUNED 61.5 / 35.4 / 25.2).
# - 4 slices, rank 64: wide stream-K on 128-row units: 64.1-64.5 / 39.7 (split TMA 72.7-73.7 / 47.1); fp32
#   60.4-60.9 (80.7-81.7); for fewer than 132 row blocks of 128 the split TMA kernel (1x4608: 25.1 µs, the
#   wide one 35.4).
# - 3 slices at ranks 64 and 128, 4 slices at rank 128: the TMA kernel, one program per 128-row block and
#   slice, 4 stages (96 KB: two per SM): 3 slices rank 64 55.0 µs, rank 128 89.6; no stream-K or wide
#   variant measured faster (rank 64: 65.8-110 µs).
# Rank 16 stays on TUNED (41 µs at 4x4608, 3 slices; nothing measured faster there).
# Batches of fewer 64-row blocks than SMs take SMALL_TUNED instead (below).
SEGMENTED_TUNED: dict[tuple[int, int], tuple[dict[str, int], ...]] = {
    (3, 32): (_SK_64, TUNED[3, 32]),
    (4, 32): (_WIDE_64, TUNED[4, 32]),
    (3, 64): (_TMA_SPLIT,),
    (4, 64): (_WIDE_128, _TMA_SPLIT),
    (3, 128): (_TMA_SPLIT,),
    (4, 128): (_TMA_SPLIT,),
}


# Batches of fewer 64-row blocks than SMs (one request of 4608 tokens: 72 on 132 SMs): the TMA kernel with one
# program per 64-row block and slice (216-288 programs), except 6 pointer stages at rank 16 with 3 slices.
# H200, 1x4608, L2 flushed by a read, bf16 scaled s (fp32 s alike), µs, against the large-batch defaults:
# 3 slices 16.3 / 17.7 / 18.5 / 22.3 at ranks 16 / 32 / 64 / 128 (18.4 / 20.9 / 19.8 / 21.9), 4 slices 17.4 /
# 17.5 / 20.7 / 36.5 (19.8 / 23.4 / 22.2 / 39.5); stream-K over all SMs was no faster (17.8-60.2).
_TMA_SPLIT_64 = dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT=1, TMA=1)
SMALL_TUNED: dict[tuple[int, int], dict[str, int]] = {
    (3, 16): dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=6),
}


def segmented_config(num_slices: int, block_r: int, num_tokens: int, device: torch.device) -> dict[str, int]:
    """The segmented shrink's tiles for this batch: for fewer 64-row blocks than SMs SMALL_TUNED (else the
    split TMA kernel on 64-row blocks), otherwise the first SEGMENTED_TUNED entry whose stream-K programs (if
    any) all get a row block, else TUNED / shrink_config."""
    if num_tokens < 64 * num_programs_limit(device):
        return SMALL_TUNED.get((num_slices, block_r), _TMA_SPLIT_64)
    for cfg in SEGMENTED_TUNED.get((num_slices, block_r), ()):
        rows_needed = cfg.get("STREAMK", 0) * num_programs_limit(device) * cfg["BLOCK_M"]
        if num_tokens >= rows_needed:
            return cfg
    return shrink_config(num_slices, block_r)


def default_config(
    num_slices: int,
    block_r: int,
    num_tokens: int,
    device: torch.device,
    seg_align: int = 1,
    policy: KernelPolicy | None = None,
) -> dict[str, int]:
    """The shrink's tiles when none are given: on Hopper with the Gluon kernels the Gluon shrink where H200 runs
    found it faster (`gluon_op.gluon_shrink_choice`; the launch falls back to the Triton tiles where its
    contract does not hold; DITSERVE_GLUON_GEMM=0 turns it off with the Gluon GEMM), else `segmented_config`."""
    policy = policy or active_policy()
    if device.type == "cuda" and policy.gluon and gluon_available(device.index or 0):
        name = gluon_shrink_choice(num_slices, block_r, num_tokens, num_programs_limit(device), seg_align)
        if name is not None:
            return GLUON_FORMS[name]
    return segmented_config(num_slices, block_r, num_tokens, device)


def shrink_config(num_slices: int, block_r: int) -> dict[str, int]:
    """Tile sizes by (slices, rank tile): the measured table, else 64-row tiles with 8 warps once the
    fp32 accumulators (num_slices × BLOCK_M × BLOCK_R) pass 8K elements. Larger tiles ran out of
    shared memory at rank 128 or were slower in the sweep."""
    if (num_slices, block_r) in TUNED:
        return TUNED[num_slices, block_r]
    if num_slices * block_r <= 128:
        return dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=3)


def _check(x, a_stacked, token_seg, seg_start, seg_len, seg_slot, slot_rank, rank_dim):
    assert x.dim() == 2 and a_stacked.dim() == 4, (x.shape, a_stacked.shape)
    assert x.dtype == a_stacked.dtype, (x.dtype, a_stacked.dtype)
    assert x.shape[1] == a_stacked.shape[3], f"hidden {x.shape[1]} != A hidden {a_stacked.shape[3]}"
    assert 1 <= a_stacked.shape[0] <= MAX_SLICES, f"{a_stacked.shape[0]} slices; split into groups of 4"
    assert 0 <= rank_dim <= a_stacked.shape[2] and rank_dim <= 128, (rank_dim, a_stacked.shape)
    assert a_stacked.stride(3) == 1 and x.stride(1) == 1, "hidden dim must be contiguous"
    for t in (token_seg, seg_start, seg_len, seg_slot, slot_rank):
        assert t.dtype == torch.int32 and t.device == x.device, (t.dtype, t.device)
    assert token_seg.shape[0] == x.shape[0], (token_seg.shape, x.shape)
    assert seg_start.shape == seg_len.shape == seg_slot.shape
    assert slot_rank.shape[0] == a_stacked.shape[1], (slot_rank.shape, a_stacked.shape)


def scaled_cols(rank_dim: int) -> int:
    """Columns of a scaled s: rank_dim rounded up to 16 (TMA rows are 16-byte aligned; the fused GEMM
    reads whole 16-column groups), the extra columns zero."""
    return -(-rank_dim // 16) * 16


def launch_lora_shrink(
    x: torch.Tensor,  # [num_tokens, hidden] fp16/bf16/fp32, hidden contiguous
    a_stacked: torch.Tensor,  # [num_slices ≤ 4, max_loras, max_rank, hidden], same dtype as x
    token_seg: torch.Tensor,  # [num_tokens] int32
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    slot_rank: torch.Tensor,  # [max_loras] int32
    rank_dim: int,  # columns of the output = largest rank in the batch
    config: dict[str, int] | None = None,  # tile override (benchmarks); SPLIT=1: one program per slice,
    # TMA=1: x and A through TMA descriptors (where their layouts allow), and with STREAMK=n (not SPLIT)
    # the stream-K kernel on n programs per SM (WIDE=1: its one-dot form)
    seg_scale: torch.Tensor | None = None,  # [num_segments] fp32: write scale(t) · s in x's dtype instead
    seg_align: int = 1,  # LoRABatchMeta.seg_align: the Gluon kernel's forms are the default only where
    # segments lie on their row blocks (`default_config`)
    policy: KernelPolicy | None = None,  # which variants the default may take (None: active_policy())
) -> torch.Tensor:  # [num_slices, num_tokens, rank_dim] fp32, or [.., scaled_cols(rank_dim)] x's dtype
    from ditserve.kernels.lora_shrink.kernel import _lora_shrink_kernel

    _check(x, a_stacked, token_seg, seg_start, seg_len, seg_slot, slot_rank, rank_dim)
    num_slices, num_tokens = a_stacked.shape[0], x.shape[0]
    scaled = seg_scale is not None
    if scaled:
        assert seg_scale.dtype == torch.float32 and seg_scale.shape == seg_start.shape, seg_scale.shape
        s = torch.empty(num_slices, num_tokens, scaled_cols(rank_dim), dtype=x.dtype, device=x.device)
    else:
        s = torch.empty(num_slices, num_tokens, rank_dim, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or rank_dim == 0:
        return s.zero_()
    block_r = block_rank(s.shape[2])
    cfg = dict(config or default_config(num_slices, block_r, num_tokens, x.device, seg_align, policy))
    if cfg.pop("GLUON", 0):  # the Gluon kernel where its contract holds, else the Triton kernel's tiles
        if gluon_op.gluon_shrink_ok(x, a_stacked, s.shape[2], cfg):
            seg = (token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank)
            gluon_op.launch_gluon_lora_shrink(x, a_stacked, s, *seg, cfg)
            return s
        cfg = dict(segmented_config(num_slices, block_r, num_tokens, x.device))
    split = num_slices if cfg.pop("SPLIT", 0) else 1
    streamk = cfg.pop("STREAMK", 0)
    wide = cfg.pop("WIDE", 0)
    grid = (triton_cdiv(num_tokens, cfg["BLOCK_M"]) * split,)
    common = dict(NUM_SLICES=num_slices // split, BLOCK_R=block_r, SCALED=scaled,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32")  # fmt: skip
    _, max_loras, max_rank, hidden = a_stacked.shape
    a_rows = a_stacked.view(-1, hidden) if a_stacked.is_contiguous() else None  # [slices·loras·rank, hidden]
    if cfg.pop("TMA", 0) and a_rows is not None and tma_ok(x, a_rows):
        from triton.tools.tensor_descriptor import TensorDescriptor

        from ditserve.kernels.lora_shrink.kernel import (
            _lora_shrink_streamk_kernel,
            _lora_shrink_tma_kernel,
            _lora_shrink_wide_kernel,
        )

        descs = (
            TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]]),
            TensorDescriptor.from_tensor(a_rows, [block_r, cfg["BLOCK_K"]]),
        )
        seg = (token_seg, seg_start, seg_len, seg_slot, seg_scale if scaled else s, slot_rank)
        sizes = (num_tokens, hidden, s.shape[2], max_loras, max_rank, s.stride(0), s.stride(1), s.stride(2))
        # stream-K: the wide kernel cuts a row block between at most two programs, so it gets at most one
        # program per row block; the narrow one sums any number of pieces of a row block, so a batch of fewer
        # row blocks than programs still spreads its K steps over every SM
        programs = streamk * num_programs_limit(x.device)
        if streamk and split == 1 and wide:
            programs = min(grid[0], programs)
            # all slices' A tiles in one [SL, BLOCK_R, BLOCK_K] load, one dot per K step
            sl = next_pow2(num_slices)
            n_cols = sl * block_r
            ws = torch.empty(programs, cfg["BLOCK_M"], n_cols, dtype=torch.float32, device=x.device)
            a3 = a_stacked.view(num_slices, max_loras * max_rank, hidden)
            _lora_shrink_wide_kernel[(programs,)](
                descs[0], TensorDescriptor.from_tensor(a3, [sl, block_r, cfg["BLOCK_K"]]), s, *seg, ws,
                _sync_counters(x.device, 2 * programs), num_tokens, hidden, s.shape[2], max_rank,
                s.stride(0), s.stride(1), s.stride(2), programs, SL=sl, **common, **cfg,
            )  # fmt: skip
        elif streamk and split == 1:
            ws, cnt = _tail_buffers(x.device, programs * num_slices * cfg["BLOCK_M"] * block_r, programs)
            _lora_shrink_streamk_kernel[(programs,)](
                *descs, s, *seg, ws, cnt, *sizes, programs, **common, **cfg
            )
        else:
            _lora_shrink_tma_kernel[grid](*descs, s, *seg, *sizes, SPLIT=split, **common, **cfg)
        return s
    _lora_shrink_kernel[grid](
        x, a_stacked, s, token_seg, seg_start, seg_len, seg_slot, seg_scale if scaled else s, slot_rank,
        num_tokens, x.shape[1], s.shape[2],
        x.stride(0), x.stride(1),
        a_stacked.stride(0), a_stacked.stride(1), a_stacked.stride(2), a_stacked.stride(3),
        s.stride(0), s.stride(1), s.stride(2),
        SPLIT=split, **common, **cfg,
    )  # fmt: skip
    return s


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# the stream-K shrinks' scratch (`zeroed_scratch`): the wide kernel's per-boundary counters, which every launch
# leaves consistent (never reset); the narrow kernel's tail sums and step counts, which every launch leaves at
# zero.
def _sync_counters(device: torch.device, n: int) -> torch.Tensor:
    return zeroed_scratch("shrink boundaries", device, n, torch.int32, 4096)


def _tail_buffers(device: torch.device, n_ws: int, n_cnt: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        zeroed_scratch("shrink tail sums", device, n_ws, torch.float32),
        zeroed_scratch("shrink tail counts", device, n_cnt, torch.int32, 4096),
    )


@torch.library.custom_op("ditserve::lora_shrink", mutates_args=())
def lora_shrink_op(
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    token_seg: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    slot_rank: torch.Tensor,
    rank_dim: int,
    seg_align: int = 1,
) -> torch.Tensor:
    """Segmented shrink; Triton on CUDA (or TRITON_INTERPRET=1), else the torch reference."""
    if use_triton(x):
        return launch_lora_shrink(x, a_stacked, token_seg, seg_start, seg_len, seg_slot, slot_rank, rank_dim,
                                  seg_align=seg_align)  # fmt: skip
    return lora_shrink_ref(x, a_stacked, seg_start, seg_len, seg_slot, slot_rank, rank_dim)


@lora_shrink_op.register_fake
def _(x, a_stacked, token_seg, seg_start, seg_len, seg_slot, slot_rank, rank_dim, seg_align=1):
    return x.new_empty((a_stacked.shape[0], x.shape[0], rank_dim), dtype=torch.float32)


@torch.library.custom_op("ditserve::lora_shrink_scaled", mutates_args=())
def lora_shrink_scaled_op(
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    token_seg: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor,
    slot_rank: torch.Tensor,
    rank_dim: int,
    seg_align: int = 1,
) -> torch.Tensor:
    """scale(t) · x · Aᵀ in x's dtype, [num_slices, num_tokens, scaled_cols(rank_dim)] (what the fused GEMM
    reads); Triton on CUDA (or TRITON_INTERPRET=1), else the torch reference."""
    if use_triton(x):
        return launch_lora_shrink(
            x, a_stacked, token_seg, seg_start, seg_len, seg_slot, slot_rank, rank_dim, seg_scale=seg_scale,
            seg_align=seg_align,
        )  # fmt: skip
    return lora_shrink_scaled_ref(x, a_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
                                  rank_dim)  # fmt: skip


@lora_shrink_scaled_op.register_fake
def _(x, a_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank, rank_dim, seg_align=1):
    return x.new_empty((a_stacked.shape[0], x.shape[0], scaled_cols(rank_dim)))
