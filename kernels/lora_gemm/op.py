"""Launcher and torch custom op for the base GEMM with the LoRA expand in its epilogue (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._checks import MAX_SLICES, check_segments
from ditserve.kernels._dispatch import dot_precision, next_pow2, num_programs_limit, tma_ok, use_triton
from ditserve.kernels._tiling import column_align, column_blocks
from ditserve.kernels.lora_expand.reference import fill_bias
from ditserve.kernels.lora_gemm import configs, gluon_op
from ditserve.kernels.lora_gemm.reference import lora_gemm_ref

MAX_LORA_BK = 64  # LORA_LOOP=2: widest LoRA iteration (rank 128 takes two)
MAX_WIDE_SHRINK = 256  # SHRINK_IN: widest shrink dot (slices × rank columns); wider ones go slice by slice
SHRINK_SMEM = (
    160 * 1024
)  # SHRINK_IN: shared memory the shrink's pipeline may take (the GEMM loop's is reused)


def lora_block_k(rank_dim: int) -> int:
    """Rank columns per iteration of the separate LoRA loop: the rank rounded up to a power of two, 16..64."""
    bk = 16
    while bk < min(rank_dim, MAX_LORA_BK):
        bk *= 2
    return bk


def _cfg(bm, bn, bk, warps, stages, persistent=1, tma=0, flatten=0, group_m=8, lora_loop=1, store=0):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages,
                PERSISTENT=persistent, TMA=tma, FLATTEN=flatten, LORA_LOOP=lora_loop,
                TMA_STORE=store)  # fmt: skip


# Candidates of the GPU sweep (benchmarks/kernels/lora_kernels.py --sweep-gemm; the GPU tests run each once).
# Shared memory per stage is (BLOCK_M + BLOCK_N) × BLOCK_K × 2 bytes: 48 KB at 128×256×64, so 4 stages
# of a flattened loop (which keeps one more buffer for the epilogue) do not fit in 227 KB.
SWEEP: dict[str, dict[str, int]] = {
    "tma persist flat 128x256x64 w8 s3": _cfg(128, 256, 64, 8, 3, tma=1, flatten=1),
    "tma persist flat 128x256x64 w8 s3 g16": _cfg(128, 256, 64, 8, 3, tma=1, flatten=1, group_m=16),
    "tma persist 128x256x64 w8 s3": _cfg(128, 256, 64, 8, 3, tma=1),
    "tma persist 128x256x64 w8 s4": _cfg(128, 256, 64, 8, 4, tma=1),
    # the K loop as without LoRA, then a LoRA loop of its own (rank-wide iterations); 3 stages only: its
    # s and B tiles (48 KB at rank 64) come on top of the K loop's buffers
    "tma persist 128x256x64 w8 s3 after": _cfg(128, 256, 64, 8, 3, tma=1, lora_loop=2),
    "tma persist flat 128x256x64 w8 s3 after": _cfg(128, 256, 64, 8, 3, tma=1, flatten=1, lora_loop=2),
    "ptr persist flat 128x256x64 w8 s3": _cfg(128, 256, 64, 8, 3, flatten=1),
    # the LoRA term after the K loop instead (the first H200 sweep's kernel, with smaller epilogue tiles)
    "tma persist flat 128x256x64 w8 s3 epi": _cfg(128, 256, 64, 8, 3, tma=1, flatten=1, lora_loop=0),
    # y through a TMA store (TMA_STORE=1: one [128, 256] piece, 64 KB of shared memory; 2: two [128, 128]
    # pieces, 32 KB, room for a 4th stage): the store leaves the registers sooner and the next tile's
    # loads start earlier
    "tma persist 128x256x64 w8 s3 tstore": _cfg(128, 256, 64, 8, 3, tma=1, store=1),
    "tma persist 128x256x64 w8 s3 tstore2": _cfg(128, 256, 64, 8, 3, tma=1, store=2),
    "tma persist 128x256x64 w8 s4 tstore2": _cfg(128, 256, 64, 8, 4, tma=1, store=2),
    "tma persist flat 128x256x64 w8 s3 tstore2": _cfg(128, 256, 64, 8, 3, tma=1, flatten=1, store=2),
    "tma persist flat 128x256x64 w8 s3 tstore": _cfg(128, 256, 64, 8, 3, tma=1, flatten=1, store=1),
    "tma persist flat 128x256x64 w8 s4 tstore2": _cfg(128, 256, 64, 8, 4, tma=1, flatten=1, store=2),
    "tma persist flat 128x256x64 w8 s3 tstore g16": _cfg(
        128, 256, 64, 8, 3, tma=1, flatten=1, store=1, group_m=16
    ),
    # the Gluon kernel for Hopper (gluon_kernel.py: its own tiles, GLUON_CONFIG; elsewhere this config
    # runs the one above)
    "gluon": {**_cfg(128, 256, 64, 8, 3, tma=1, flatten=1, store=1, group_m=16), "GLUON": 1},
    # the LoRA step in the ring at rank 16 too (FOLD off)
    "gluon no fold": {
        **_cfg(128, 256, 64, 8, 3, tma=1, flatten=1, store=1, group_m=16),
        "GLUON": 1,
        "GLUON_FOLD": 0,
    },
    # the last partial round of tiles whole (SPLIT_TAIL off)
    "gluon no split": {
        **_cfg(128, 256, 64, 8, 3, tma=1, flatten=1, store=1, group_m=16),
        "GLUON": 1,
        "GLUON_SPLIT_TAIL": 0,
    },
    # y stored whole (the default before 4 chunks through 2 buffers), and a fourth ring slot paid for by
    # storing y in column chunks through a smaller staging buffer (with FOLD's boxes only 4 chunks and one
    # buffer fit)
    **{
        f"gluon nb{nb} e{e}b{b}": {
            **_cfg(128, 256, 64, 8, 3, tma=1, flatten=1, store=1, group_m=16),
            "GLUON": 1,
            "GLUON_NUM_BUFFERS": nb,
            "GLUON_EPI_SPLIT": e,
            "GLUON_EPI_BUFS": b,
        }
        for nb, e, b in ((3, 1, 1), (3, 2, 1), (4, 2, 1), (4, 4, 1), (4, 4, 2))
    },
    # every tile's y stored at its end (DEFER off: the default before its second half waited for the next
    # tile's first MMA)
    "gluon no defer": {
        **_cfg(128, 256, 64, 8, 3, tma=1, flatten=1, store=1, group_m=16),
        "GLUON": 1,
        "GLUON_DEFER": 0,
    },
}


def gemm_config(num_tokens: int, n_total: int) -> dict[str, int]:
    """The tuned tiles for the problem size (configs.tuned)."""
    return configs.tuned(num_tokens, n_total)


def resolve_config(
    config: dict[str, int] | None, num_tokens: int, n_total: int, lora_in_loop: bool, seg_align: int
) -> dict[str, int]:
    """The launch config: `config` over the defaults (benchmarks, tests), else `configs.choose`."""
    if config:
        return {**configs.defaults(), **config}
    return configs.choose(configs.GemmProblem(num_tokens, n_total, lora_in_loop, seg_align))


def shrink_in_ok(
    x: torch.Tensor,
    weight: torch.Tensor,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    seg_align: int,
    config: dict[str, int] | None = None,
) -> bool:
    """Whether `launch_lora_gemm(..., a_stacked=...)` can compute s inside its launch: Triton runs, the
    config reads x, W, s and B through TMA with the LoRA iterations in the K loop, and no row block holds two
    segments (a shrink unit is one row block of one segment)."""
    if not use_triton(x) or x.shape[0] == 0 or x.shape[1] == 0 or a_stacked.shape[0] > MAX_SLICES:
        return False
    cfg = resolve_config(config, x.shape[0], weight.shape[0], True, seg_align)
    if not (cfg["TMA"] and cfg["LORA_LOOP"] == 1 and cfg.get("SHRINK_IN", 1)) or seg_align % cfg["BLOCK_M"]:
        return False
    es = x.element_size()
    b_ok = b_stacked.is_contiguous() and b_stacked.shape[2] * es % 16 == 0 and b_stacked.data_ptr() % 16 == 0
    return tma_ok(x, weight, a_stacked.flatten(0, 2)) and a_stacked.is_contiguous() and b_ok


def _check(
    x,
    weight,
    bias,
    s,
    b_stacked,
    token_seg,
    seg_start,
    seg_len,
    seg_slot,
    seg_scale,
    slot_rank,
    sizes,
    s_scaled,
):
    assert x.dim() == 2 and weight.dim() == 2 and s.dim() == 3 and b_stacked.dim() == 3
    assert x.dtype == weight.dtype == b_stacked.dtype, (x.dtype, weight.dtype, b_stacked.dtype)
    assert x.shape[1] == weight.shape[1], f"hidden {x.shape[1]} != weight hidden {weight.shape[1]}"
    assert 1 <= len(sizes) <= MAX_SLICES and all(n > 0 for n in sizes), sizes
    assert weight.shape[0] == sum(sizes) == b_stacked.shape[1], (weight.shape, sizes, b_stacked.shape)
    assert s.shape[0] == len(sizes) and s.shape[1] == x.shape[0], (s.shape, x.shape, sizes)
    assert s.dtype in (torch.float32, x.dtype), s.dtype
    assert not s_scaled or s.dtype == x.dtype, "a pre-scaled s comes in x's dtype"
    # a scaled s may have zero columns past max_rank (padded to 16)
    assert s.shape[2] <= 128 and (s_scaled or s.shape[2] <= b_stacked.shape[2]), (s.shape, b_stacked.shape)
    check_segments(x, b_stacked.shape[0], token_seg, seg_start, seg_len, seg_slot, slot_rank, seg_scale)
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.is_contiguous() and bias.dtype == x.dtype, bias.shape


def _lora_descriptors(s, b_stacked, bm, bn, bk, lora_k):  # bk: rank columns per LoRA iteration
    """TMA descriptors of s viewed as [num_slices · num_tokens, s_cols] and of B viewed as
    [max_loras · n_total, lora_k], or None where the layouts do not allow it."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    ns, t, rc = s.shape
    es = s.element_size()
    s_ok = s.stride(2) == 1 and s.stride(0) == t * s.stride(1) and s.stride(1) * es % 16 == 0
    b_ok = (
        b_stacked.stride(2) == 1
        and b_stacked.stride(0) == b_stacked.shape[1] * b_stacked.stride(1)
        and b_stacked.stride(1) * es % 16 == 0
    )
    if not (s_ok and b_ok and s.data_ptr() % 16 == 0 and b_stacked.data_ptr() % 16 == 0):
        return None
    s_desc = TensorDescriptor(s, [ns * t, rc], [s.stride(1), 1], [bm, bk])
    rows_b = b_stacked.shape[0] * b_stacked.shape[1]
    b_desc = TensorDescriptor(b_stacked, [rows_b, lora_k], [b_stacked.stride(1), 1], [bn, bk])
    return s_desc, b_desc


def launch_lora_gemm(
    x: torch.Tensor,  # [num_tokens, hidden] fp16/bf16/fp32
    weight: torch.Tensor,  # [sum(out_slice_sizes), hidden], x's dtype (the fused base weight)
    bias: torch.Tensor | None,  # [sum(out_slice_sizes)], x's dtype
    s: torch.Tensor,  # [num_slices, num_tokens, rank_dim] fp32 or x's dtype (lora_shrink); rank_dim 0 = no LoRA
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank], x's dtype
    token_seg: torch.Tensor,  # [num_tokens] int32
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    seg_scale: torch.Tensor,  # [num_segments] fp32, alpha/rank × strength
    slot_rank: torch.Tensor,  # [max_loras] int32
    out_slice_sizes: list[int],  # 1..4 output slices, slice j pairs with s[j]
    config: dict[str, int] | None = None,  # tile override (benchmarks, tests); missing keys from DEFAULTS
    s_scaled: bool = False,  # s already holds scale(t) · x · Aᵀ in x's dtype (lora_shrink(..., scaled=True))
    seg_align: int = 1,  # every non-empty segment starts at a multiple of this (LoRABatchMeta.seg_align)
    a_stacked: torch.Tensor
    | None = None,  # shrink_in_ok: [groups, max_loras, max_rank, hidden]; s is written
) -> torch.Tensor:  # [num_tokens, sum(out_slice_sizes)], x's dtype
    """a_stacked given: the launch computes s = scale · x · Aᵀ (s_scaled, every slice of a_stacked, which may
    be more than the output slices) into the s passed, and reads it (SHRINK_IN; the caller checked
    `shrink_in_ok`)."""
    from ditserve.kernels.lora_gemm.kernel import _lora_gemm_kernel

    args = (x, weight, bias, s, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank)
    shrink_in = a_stacked is not None
    if shrink_in:
        assert s_scaled and a_stacked.shape[0] == s.shape[0] >= len(out_slice_sizes), (
            a_stacked.shape,
            s.shape,
        )
        assert a_stacked.is_contiguous() and a_stacked.shape[3] == x.shape[1], a_stacked.shape
        args = (x, weight, bias, s[: len(out_slice_sizes)], *args[4:])
    _check(*args, out_slice_sizes, s_scaled)
    num_tokens, hidden = x.shape
    n_total = weight.shape[0]
    y = x.new_empty((num_tokens, n_total))
    if num_tokens == 0:
        return y
    if hidden == 0:  # x · Aᵀ is 0 as well
        return fill_bias(y, bias)
    cfg = resolve_config(config, num_tokens, n_total, s.shape[2] > 0 and s_scaled, seg_align)
    if cfg["GLUON"] and not shrink_in and gluon_op.gluon_ok(x, weight, s, b_stacked, out_slice_sizes, s_scaled,
                                                              seg_align):  # fmt: skip
        # GLUON_<KEY> entries override GLUON_CONFIG's KEY (sweep candidates)
        over = {k.removeprefix("GLUON_"): v for k, v in cfg.items() if k.startswith("GLUON_")}
        gcfg = {**gluon_op.GLUON_CONFIG, "GROUP_M": cfg["GROUP_M"], **over}
        return gluon_op.launch_gluon_lora_gemm(
            x, weight, bias, s, b_stacked, token_seg, seg_slot, out_slice_sizes, cfg=gcfg
        )
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    cols, blks, num_col_blocks = column_blocks(out_slice_sizes, bn)
    num_tiles = -(-num_tokens // bm) * num_col_blocks
    grid = min(num_tiles, num_programs_limit(x.device)) if cfg["PERSISTENT"] else num_tiles
    rank_dim = min(s.shape[2], b_stacked.shape[2])  # columns past the largest slot rank are never needed
    has_lora = rank_dim > 0
    lora_in_loop = has_lora and s_scaled and cfg["LORA_LOOP"] == 1
    # LORA_LOOP=2 is a TMA loop; through pointers the epilogue does the same work (LORA_LOOP=0)
    lora_after = has_lora and s_scaled and cfg["LORA_LOOP"] == 2 and bool(cfg["TMA"])
    lora_bk = lora_block_k(rank_dim) if lora_after else bk
    use_tma = bool(cfg["TMA"]) and hidden > 0 and tma_ok(x, weight)
    s_desc = b_desc = s  # placeholders where the kernel reads no descriptor
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if lora_in_loop or lora_after:
            descs = _lora_descriptors(s, b_stacked, bm, bn, lora_bk, rank_dim)
            use_tma = descs is not None
            if use_tma:
                s_desc, b_desc = descs
    if use_tma:
        x_arg = TensorDescriptor.from_tensor(x, [bm, bk])
        w_arg = TensorDescriptor.from_tensor(weight, [bn, bk])
    else:
        x_arg, w_arg, s_desc, b_desc = x, weight, s, s
        lora_after = False  # no descriptors: the epilogue adds the LoRA term
    col_align = column_align(cols)
    # a TMA store needs whole tiles per slice (no column masks) and a descriptor-friendly y
    subtile = cfg["TMA_STORE"]
    tma_store = bool(use_tma and subtile and all(n % bn == 0 for n in out_slice_sizes) and tma_ok(y))
    y_desc = y
    if tma_store:
        y_desc = TensorDescriptor.from_tensor(y, [bm, bn // subtile])
    xs_desc, a_desc, sync, shrink_r, shrink_m, shrink_k, wide_g, shrink_stages = x_arg, s, s, 16, bm, bk, 1, 1
    if shrink_in:
        assert use_tma and lora_in_loop and seg_align % bm == 0, "SHRINK_IN: see shrink_in_ok"
        g, max_loras, a_rows, _ = a_stacked.shape
        shrink_r = max(16, next_pow2(s.shape[2]))
        shrink_m = min(cfg.get("SHRINK_M", 64), bm)
        # one unit per row block for every slice where the slices side by side fit one dot
        wide = cfg.get("SHRINK_WIDE", 1) and next_pow2(g) * shrink_r <= MAX_WIDE_SHRINK
        wide_g = next_pow2(g) if wide else 1
        # one program per SM shrinks (the shrink kernel runs two or three): it keeps more of x in flight
        # with 128-column steps where 5 stages of them fit SHRINK_SMEM
        wide_k = (shrink_m + wide_g * shrink_r) * 128 * x.element_size() * 5 <= SHRINK_SMEM
        shrink_k = cfg.get("SHRINK_K", 128 if wide_k else bk)
        shrink_stages = cfg.get("SHRINK_STAGES", 5 if shrink_k == 128 and wide_k else 4)
        xs_desc = TensorDescriptor.from_tensor(x, [shrink_m, shrink_k])
        if wide_g > 1:
            a_desc = TensorDescriptor(
                a_stacked, [g, max_loras * a_rows, hidden], [max_loras * a_rows * hidden, hidden, 1],
                [wide_g, shrink_r, shrink_k],
            )  # fmt: skip
        else:
            rows = g * max_loras * a_rows
            a_desc = TensorDescriptor(a_stacked, [rows, hidden], [hidden, 1], [shrink_r, shrink_k])
        units = -(-num_tokens // shrink_m) * (1 if wide_g > 1 else g)
        sync = torch.zeros(units + 2, dtype=torch.int32, device=x.device)
    _lora_gemm_kernel[(grid,)](
        x_arg, w_arg, s_desc, b_desc, y, y_desc, bias if bias is not None else y, s, b_stacked,
        token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
        num_tokens, hidden, rank_dim, rank_dim, *cols, n_total, *blks, num_col_blocks, grid,
        s.shape[0] * num_tokens, b_stacked.shape[0] * n_total,
        *x.stride(), *weight.stride(), *y.stride(), *s.stride(), *b_stacked.stride(),
        xs_desc, a_desc, sync, s.shape[0], b_stacked.shape[0], a_stacked.shape[2] if shrink_in else 0, s.shape[2],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, R_CHUNK=cfg["R_CHUNK"], GROUP_M=cfg["GROUP_M"],
        USE_TMA=use_tma, FLATTEN=bool(cfg["FLATTEN"]),
        EVEN_K=hidden % bk == 0, COL_ALIGN=col_align, HAS_LORA=has_lora, LORA_IN_LOOP=lora_in_loop,
        STRADDLE=seg_align % bm != 0,
        LORA_AFTER=lora_after, LORA_BK=lora_bk, S_SCALED=s_scaled, HAS_BIAS=bias is not None,
        TMA_STORE=tma_store, EPI_SUBTILE=subtile if tma_store else 1, SHRINK_IN=shrink_in, SHRINK_R=shrink_r,
        SHRINK_M=shrink_m, SHRINK_K=shrink_k, WIDE_G=wide_g, SHRINK_STAGES=shrink_stages,
        FENCE=x.is_cuda, PRECISION=dot_precision(x.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y


@torch.library.custom_op("ditserve::lora_gemm", mutates_args=())
def lora_gemm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    s: torch.Tensor,
    b_stacked: torch.Tensor,
    token_seg: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor,
    slot_rank: torch.Tensor,
    out_slice_sizes: list[int],
    s_scaled: bool = False,
    seg_align: int = 1,
) -> torch.Tensor:
    """x · Wᵀ + bias + segmented LoRA expand of s (s_scaled: s already holds scale · x · Aᵀ in x's dtype);
    Triton on CUDA (or TRITON_INTERPRET=1), else the reference. seg_align: LoRABatchMeta.seg_align (1 if
    unknown), lets the kernel skip its pass over tiles that straddle segments."""
    args = (x, weight, bias, s, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank)
    if use_triton(x):
        return launch_lora_gemm(*args, out_slice_sizes, s_scaled=s_scaled, seg_align=seg_align)
    return lora_gemm_ref(x, weight, bias, s, b_stacked, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
                         out_slice_sizes, s_scaled=s_scaled)  # fmt: skip


@lora_gemm_op.register_fake
def _(x, weight, bias, s, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
      out_slice_sizes, s_scaled=False, seg_align=1):  # fmt: skip
    return x.new_empty((x.shape[0], weight.shape[0]))
