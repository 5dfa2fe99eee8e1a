"""Launcher and torch custom op for the segmented LoRA shrink (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._checks import check_segments, check_shrink
from ditserve.kernels._dispatch import (
    block_rank,
    dot_precision,
    next_pow2,
    num_programs_limit,
    tma_ok,
    use_triton,
    zeroed_scratch,
)
from ditserve.kernels.lora_shrink import gluon_op
from ditserve.kernels.lora_shrink.configs import ShrinkProblem, choose, triton_choice
from ditserve.kernels.lora_shrink.gluon_op import GLUON_FORMS
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref, lora_shrink_scaled_ref
from ditserve.kernels.policy import KernelPolicy

# sweep candidates (benchmarks/kernels/lora_shrink_tiles.py, lora_kernels.py --sweep-gemm; the GPU tests run each once):
# the TMA kernel, one program per 128-row block and slice
_TMA_SPLIT = dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, SPLIT=1, TMA=1)

# stream-K tiles
_SK_64 = dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, TMA=1, STREAMK=2)
_WIDE_64 = dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4, TMA=1, STREAMK=2, WIDE=1)
_WIDE_128 = dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=4, TMA=1, STREAMK=1, WIDE=1)

# Candidates for the scaled (x's dtype) output the fused GEMM reads, swept by benchmarks/kernels/lora_kernels.py
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
    # 3 stages with one slice per program; 6 stages (best for one request of 4608 tokens at rank 16)
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
    # wider K steps on 64-row blocks (small batches and the skewed mix)
    "tma 64/128/4/4": dict(BLOCK_M=64, BLOCK_K=128, num_warps=4, num_stages=4, TMA=1),
    # the Gluon kernel for Hopper (gluon_op.GLUON_FORMS)
    **GLUON_FORMS,
}


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
    # segments lie on their row blocks (`configs.choose`)
    policy: KernelPolicy | None = None,  # which variants the default may take (None: active_policy())
) -> torch.Tensor:  # [num_slices, num_tokens, rank_dim] fp32, or [.., scaled_cols(rank_dim)] x's dtype
    from ditserve.kernels.lora_shrink.kernel import _lora_shrink_kernel

    check_shrink(x, a_stacked, rank_dim)
    check_segments(x, a_stacked.shape[1], token_seg, seg_start, seg_len, seg_slot, slot_rank, seg_scale)
    num_slices, num_tokens = a_stacked.shape[0], x.shape[0]
    scaled = seg_scale is not None
    if scaled:
        s = torch.empty(num_slices, num_tokens, scaled_cols(rank_dim), dtype=x.dtype, device=x.device)
    else:
        s = torch.empty(num_slices, num_tokens, rank_dim, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or rank_dim == 0:
        return s.zero_()
    block_r = block_rank(s.shape[2])
    cfg = dict(config or choose(ShrinkProblem(num_slices, block_r, num_tokens, seg_align), x.device, policy))
    if cfg.pop("GLUON", 0):  # the Gluon kernel where its contract holds, else the Triton kernel's tiles
        if gluon_op.gluon_shrink_ok(x, a_stacked, s.shape[2], cfg):
            seg = (token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank)
            gluon_op.launch_gluon_lora_shrink(x, a_stacked, s, *seg, cfg)
            return s
        cfg = dict(triton_choice(ShrinkProblem(num_slices, block_r, num_tokens, seg_align), x.device))
    split = num_slices if cfg.pop("SPLIT", 0) else 1
    streamk = cfg.pop("STREAMK", 0)
    wide = cfg.pop("WIDE", 0)
    grid = (triton_cdiv(num_tokens, cfg["BLOCK_M"]) * split,)
    common = dict(
        NUM_SLICES=num_slices // split, BLOCK_R=block_r, SCALED=scaled, PRECISION=dot_precision(x.dtype)
    )
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
        sizes = (num_tokens, hidden, s.shape[2], max_loras, max_rank, *s.stride())
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
                *s.stride(), programs, SL=sl, **common, **cfg,
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
        *x.stride(), *a_stacked.stride(), *s.stride(),
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
    seg_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Segmented shrink, [num_slices, num_tokens, rank_dim] fp32; with seg_scale scale(t) · x · Aᵀ in x's dtype,
    [num_slices, num_tokens, scaled_cols(rank_dim)] (what the fused GEMM reads). Triton on CUDA (or
    TRITON_INTERPRET=1), else the torch reference."""
    seg = (token_seg, seg_start, seg_len, seg_slot)
    if use_triton(x):
        return launch_lora_shrink(
            x, a_stacked, *seg, slot_rank, rank_dim, seg_scale=seg_scale, seg_align=seg_align
        )
    if seg_scale is not None:
        return lora_shrink_scaled_ref(x, a_stacked, *seg, seg_scale, slot_rank, rank_dim)
    return lora_shrink_ref(x, a_stacked, *seg[1:], slot_rank, rank_dim)


@lora_shrink_op.register_fake
def _(
    x, a_stacked, token_seg, seg_start, seg_len, seg_slot, slot_rank, rank_dim, seg_align=1, seg_scale=None
):
    if seg_scale is not None:
        return x.new_empty((a_stacked.shape[0], x.shape[0], scaled_cols(rank_dim)))
    return x.new_empty((a_stacked.shape[0], x.shape[0], rank_dim), dtype=torch.float32)
