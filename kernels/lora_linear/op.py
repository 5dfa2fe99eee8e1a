"""Launcher and torch custom op for the one-kernel LoRA linear (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import block_rank, next_pow2, triton_interpret, use_triton
from ditserve.kernels.lora_expand.op import column_align, column_blocks
from ditserve.kernels.lora_gemm.op import _lora_descriptors, num_programs_limit, tma_ok
from ditserve.kernels.lora_linear.reference import lora_linear_ref

MAX_SLICES = 4
MAX_SHRINK_N = 256  # widest shrink tile (NUM_SLICES · BLOCK_R columns beyond that take several passes over x)
# Tiles: the Hopper GEMM shape (128×256×64, 8 warps); the sweep in benchmarks/lora_kernels.py
# (--qkv-only --sweep-fused) tries the others below.
DEFAULT: dict[str, int] = dict(
    BLOCK_M=128,
    BLOCK_N=256,
    BLOCK_K=64,
    GROUP_M=8,
    num_warps=8,
    num_stages=3,
    TMA=1,
    FLATTEN=0,
    WS=0,
    SPLIT=0,
    LORA_LOOP=1,
)


def _cfg(flatten=0, ws=0, split=0, stages=3, group_m=8, lora_loop=1):
    return {**DEFAULT, "FLATTEN": flatten, "WS": ws, "SPLIT": split,
            "num_stages": stages, "GROUP_M": group_m, "LORA_LOOP": lora_loop}  # fmt: skip


# H200 sweep (4x4608 tokens, QKV, ranks 16 and 64; BENCHMARKS.md): the LoRA iterations in the K loop
# (default) beat the LoRA dot after it (its s and B loads are not pipelined); flattened tile loops were
# 1.3-3.9x cuBLAS and are not candidates. SPLIT=1: two launches (shrink, then GEMM) instead of one with
# flags: what the interpreter runs.
SWEEP: dict[str, dict[str, int]] = {
    "fused in-loop s4": _cfg(stages=4),
    "split in-loop": _cfg(split=1),
    "fused epilogue": _cfg(lora_loop=0),
}
# warp-specialised tile loop: tried only on request (a failing lowering may take the process down)
SWEEP_WS: dict[str, dict[str, int]] = {"fused ws": _cfg(ws=1), "fused ws epilogue": _cfg(ws=1, lora_loop=0)}


def _check(x, weight, bias, a_stacked, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale,
           slot_rank, max_rank, sizes):  # fmt: skip
    assert x.dim() == 2 and weight.dim() == 2 and a_stacked.dim() == 4 and b_stacked.dim() == 3
    assert x.dtype == weight.dtype == a_stacked.dtype == b_stacked.dtype, (x.dtype, weight.dtype)
    assert x.shape[1] == weight.shape[1] == a_stacked.shape[3], (x.shape, weight.shape, a_stacked.shape)
    assert 1 <= len(sizes) <= MAX_SLICES and all(n > 0 for n in sizes), sizes
    assert a_stacked.shape[0] == len(sizes), (a_stacked.shape, sizes)
    assert weight.shape[0] == sum(sizes) == b_stacked.shape[1], (weight.shape, sizes, b_stacked.shape)
    assert a_stacked.shape[1] == b_stacked.shape[0] == slot_rank.shape[0], (a_stacked.shape, b_stacked.shape)
    assert 0 <= max_rank <= min(a_stacked.shape[2], b_stacked.shape[2]) and max_rank <= 128, max_rank
    assert a_stacked.stride(3) == 1 and x.stride(1) == 1, "hidden dim must be contiguous"
    for t in (token_seg, seg_start, seg_len, seg_slot, slot_rank):
        assert t.dtype == torch.int32 and t.device == x.device, (t.dtype, t.device)
    assert seg_scale.dtype == torch.float32 and seg_scale.shape == seg_start.shape
    assert token_seg.shape[0] == x.shape[0] and seg_start.shape == seg_len.shape == seg_slot.shape
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.is_contiguous() and bias.dtype == x.dtype, bias.shape


def launch_lora_linear(
    x: torch.Tensor,  # [num_tokens, hidden] fp16/bf16/fp32
    weight: torch.Tensor,  # [sum(out_slice_sizes), hidden]
    bias: torch.Tensor | None,  # [sum(out_slice_sizes)]
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden]
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    token_seg: torch.Tensor,  # [num_tokens] int32
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    seg_scale: torch.Tensor,  # [num_segments] fp32, alpha/rank × strength
    slot_rank: torch.Tensor,  # [max_loras] int32
    max_rank: int,  # largest rank in use (1..128)
    out_slice_sizes: list[int],  # 1..4 output slices, slice j pairs with a_stacked[j]
    config: dict[str, int] | None = None,  # tile override (benchmarks, tests); missing keys from DEFAULT
) -> torch.Tensor:  # [num_tokens, sum(out_slice_sizes)], x's dtype
    from ditserve.kernels.lora_linear.kernel import _lora_linear_kernel

    args = (
        x,
        weight,
        bias,
        a_stacked,
        b_stacked,
        token_seg,
        seg_start,
        seg_len,
        seg_slot,
        seg_scale,
        slot_rank,
    )
    _check(*args, max_rank, out_slice_sizes)
    num_tokens, hidden = x.shape
    n_total = weight.shape[0]
    assert max_rank > 0 and hidden > 0, "no LoRA or an empty hidden dim: a plain linear"
    y = x.new_empty((num_tokens, n_total))
    if num_tokens == 0:
        return y
    cfg = {**DEFAULT, **(config or {})}
    # a flattened tile loop gave wrong results on an H200 (SPLIT) and was 1.3-3.9x slower
    assert not (cfg["FLATTEN"] and x.is_cuda), "FLATTEN is for the interpreter only in lora_linear"
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_slices = len(out_slice_sizes)
    block_r = block_rank(max_rank)
    shrink_n = min(next_pow2(num_slices * block_r), MAX_SHRINK_N)
    cols, blks, num_col_blocks = column_blocks(out_slice_sizes, bn)
    num_row_blocks = -(-num_tokens // bm)
    num_tiles = num_row_blocks * num_col_blocks
    grid = min(num_tiles, num_programs_limit(x.device))
    s = x.new_empty((num_slices, num_tokens, block_r))
    sync = torch.zeros(num_row_blocks + 1, dtype=torch.int32, device=x.device)
    use_tma = bool(cfg["TMA"]) and tma_ok(x, weight)
    lora_k = min(block_r, b_stacked.shape[2])
    s_desc = b_desc = s  # placeholders where the kernel reads no descriptor
    lora_in_loop = False
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(x, [bm, bk])
        w_arg = TensorDescriptor.from_tensor(weight, [bn, bk])
        if cfg["LORA_LOOP"]:
            descs = _lora_descriptors(s, b_stacked, bm, bn, bk, lora_k)
            if descs is not None:
                s_desc, b_desc = descs
                lora_in_loop = True
    else:
        x_arg, w_arg = x, weight
    col_align = column_align(cols)
    # one launch with flags on a GPU; shrink then GEMM where programs run one after another
    phases = [1, 2] if cfg["SPLIT"] or triton_interpret() or not x.is_cuda else [3]
    for ph in phases:
        _lora_linear_kernel[(grid,)](
            x_arg, w_arg, s_desc, b_desc, y, bias if bias is not None else y, a_stacked, b_stacked, s, sync,
            token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
            num_tokens, hidden, a_stacked.shape[2], b_stacked.shape[2], *cols, n_total, *blks, num_col_blocks,
            grid, lora_k, num_slices * num_tokens, b_stacked.shape[0] * n_total, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
            *a_stacked.stride(), *b_stacked.stride(), *s.stride(),
            NUM_SLICES=num_slices, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=block_r, SHRINK_N=shrink_n,
            SHRINK_CHUNKS=-(-num_slices * block_r // shrink_n), GROUP_M=cfg["GROUP_M"], PHASES=ph,
            LORA_IN_LOOP=lora_in_loop, USE_TMA=use_tma, FLATTEN=bool(cfg["FLATTEN"]),
            WARP_SPECIALIZE=bool(cfg["WS"]), EVEN_K=hidden % bk == 0, COL_ALIGN=col_align,
            HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
    return y


@torch.library.custom_op("ditserve::lora_linear", mutates_args=())
def lora_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    token_seg: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor,
    slot_rank: torch.Tensor,
    max_rank: int,
    out_slice_sizes: list[int],
) -> torch.Tensor:
    """x · Wᵀ + bias + the segmented LoRA term, shrink and expand inside one GEMM launch; Triton on CUDA
    (or TRITON_INTERPRET=1), else the reference."""
    args = (
        x,
        weight,
        bias,
        a_stacked,
        b_stacked,
        token_seg,
        seg_start,
        seg_len,
        seg_slot,
        seg_scale,
        slot_rank,
    )
    if use_triton(x):
        return launch_lora_linear(*args, max_rank, out_slice_sizes)
    return lora_linear_ref(x, weight, bias, a_stacked, b_stacked, seg_start, seg_len, seg_slot, seg_scale,
                           slot_rank, max_rank, out_slice_sizes)  # fmt: skip


@lora_linear_op.register_fake
def _(x, weight, bias, a_stacked, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
      max_rank, out_slice_sizes):  # fmt: skip
    return x.new_empty((x.shape[0], weight.shape[0]))
