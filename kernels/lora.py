"""Multi-LoRA entry points: a different adapter for each request in one forward pass.

Weights live in slots, stacked per layer:
    a_stacked [num_slices, max_loras, max_rank, hidden]      LoRA A of each slot, rows ≥ rank unused
    b_stacked [max_loras, sum(out_slice_sizes), max_rank]    LoRA B of each slot, output slices stacked
                                                             along dim 1 like the fused base weight
A layer with fused outputs (QKV: 3 slices; Flux single block q/k/v/mlp: 4) passes one A per output slice;
slice j of the low-rank activations feeds output columns out_slice_sizes[j].

Example (a fused QKV projection, two requests with adapters in slots 0 and 3, one without LoRA)::

    meta = LoRABatchMeta.build(
        [(4096, 0), (4096, 3), (1024, -1)],        # (num_tokens, slot) per request, in token order
        slot_ranks=[16, 0, 0, 64],                 # rank of every slot (0 = empty)
        scales=[alpha0 / 16 * 1.0, alpha3 / 64 * 0.8, 1.0],  # alpha/rank × strength per request
        device="cuda",
    )
    y = torch.nn.functional.linear(x, w_qkv)       # x [9216, 3072] → y [9216, 3 * 3072]
    s = lora_shrink(x, a_stacked, meta)            # [3, 9216, meta.max_rank] fp32
    lora_expand(y, s, b_stacked, meta, [3072, 3072, 3072])   # y += scale · s · Bᵀ, in place
    # or, same result, one call: apply_lora(y, x, a_stacked, b_stacked, meta, [3072] * 3)
    # or, bias and base GEMM included, the expand inside the GEMM's epilogue (one write of y):
    y = lora_linear(x, w_qkv, bias, a_stacked, b_stacked, meta, [3072] * 3)

`method="sgmv"` uses the chunked kernels instead (tokens grouped by slot through meta.sorted_token_ids):
the better choice when many requests share few adapters in non-contiguous ranges. Build `meta` once per
step (and per CFG branch layout) and reuse it in every layer. `lora_linear` runs the shrink, then one
Triton GEMM (`lora_gemm`) that adds scale · s · Bᵀ to each output tile before it is stored, so no pass reads
and rewrites y after the GEMM (on aligned batches the shrink runs inside that launch too). All ops are torch custom ops
(`torch.ops.ditserve.*`), so `torch.compile(fullgraph=True)` traces through them. On CPU tensors the
torch reference runs unless TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import Literal

import torch

from ditserve.kernels._dispatch import use_triton
from ditserve.kernels.lora_expand.op import lora_expand_op
from ditserve.kernels.lora_expand_sgmv.op import lora_expand_sgmv_op
from ditserve.kernels.lora_gemm.op import lora_gemm_op
from ditserve.kernels.lora_linear.op import lora_linear_op
from ditserve.kernels.lora_meta import LoRABatchMeta, choose_chunk_size
from ditserve.kernels.lora_shrink.op import lora_shrink_op
from ditserve.kernels.lora_shrink_sgmv.op import lora_shrink_sgmv_op

__all__ = [
    "LoRABatchMeta",
    "choose_chunk_size",
    "lora_shrink",
    "lora_expand",
    "apply_lora",
    "lora_linear",
]

Method = Literal["sgemm", "sgmv"]
# the kernels take up to 4 slices per launch; more are split into groups
_GROUP = 4


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, hidden]
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden], x's dtype
    meta: LoRABatchMeta,
    method: Method = "sgemm",
    scaled: bool = False,
) -> torch.Tensor:  # [num_slices, num_tokens, meta.max_rank] fp32 (scaled: see below)
    """s[j, t, :r] = x[t] · A[j, slot(t), :r]ᵀ; zero for tokens without LoRA and columns ≥ the slot's rank.

    scaled=True: scale(t) · s[j, t] in x's dtype, columns rounded up to 16 (zeros): what `lora_gemm_op`
    reads with s_scaled=True, without another pass over s."""
    if a_stacked.shape[0] > _GROUP:
        parts = [
            lora_shrink(x, a_stacked[g : g + _GROUP], meta, method, scaled)
            for g in range(0, a_stacked.shape[0], _GROUP)
        ]
        return torch.cat(parts)
    if scaled and method == "sgmv":
        s = lora_shrink(x, a_stacked, meta, method) * meta.token_scale[None, :, None]
        return torch.nn.functional.pad(s, (0, -meta.max_rank % 16)).to(x.dtype)
    if method == "sgmv":
        return lora_shrink_sgmv_op(
            x, a_stacked, meta.sorted_token_ids, meta.chunk_slot, meta.chunk_start, meta.chunk_len,
            meta.slot_rank, meta.max_rank, meta.chunk_size,
        )  # fmt: skip
    return lora_shrink_op(
        x, a_stacked, meta.token_seg, meta.seg_start, meta.seg_len, meta.seg_slot, meta.slot_rank, meta.max_rank,
        meta.seg_align, seg_scale=meta.seg_scale if scaled else None,
    )  # fmt: skip


def lora_expand(
    y: torch.Tensor,  # [num_tokens, sum(out_slice_sizes)], updated in place
    s: torch.Tensor,  # [num_slices, num_tokens, meta.max_rank] fp32, from lora_shrink
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank], y's dtype
    meta: LoRABatchMeta,
    out_slice_sizes: list[int],  # one output slice per s slice, any sizes
    method: Method = "sgemm",
) -> None:
    """y[t, slice j] += scale(t) · s[j, t, :r] · B[slot(t), slice j, :r]ᵀ in place; rows without LoRA untouched."""
    if not meta.has_lora or y.shape[0] == 0:
        return
    if len(out_slice_sizes) > _GROUP:
        col = 0
        for g in range(0, len(out_slice_sizes), _GROUP):
            sizes = out_slice_sizes[g : g + _GROUP]
            cols = slice(col, col + sum(sizes))
            lora_expand(y[:, cols], s[g : g + _GROUP], b_stacked[:, cols], meta, sizes, method)
            col += sum(sizes)
        return
    if method == "sgmv":
        lora_expand_sgmv_op(
            y, s, b_stacked, meta.sorted_token_ids, meta.token_scale, meta.chunk_slot, meta.chunk_start,
            meta.chunk_len, meta.slot_rank, list(out_slice_sizes), meta.chunk_size,
        )  # fmt: skip
    else:
        lora_expand_op(
            y, s, b_stacked, meta.token_seg, meta.seg_start, meta.seg_len, meta.seg_slot, meta.seg_scale,
            meta.slot_rank, list(out_slice_sizes), seg_align=meta.seg_align,
        )  # fmt: skip


def apply_lora(
    y: torch.Tensor,  # [num_tokens, sum(out_slice_sizes)], base output, updated in place
    x: torch.Tensor,  # [num_tokens, hidden], the base layer's input
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden]
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    meta: LoRABatchMeta,
    out_slice_sizes: list[int],
    method: Method = "sgemm",
) -> None:
    """Shrink then expand: y += LoRA(x) for every request's adapter. No launch when no request has LoRA."""
    if not meta.has_lora or x.shape[0] == 0:
        return
    lora_expand(y, lora_shrink(x, a_stacked, meta, method), b_stacked, meta, out_slice_sizes, method)


def lora_linear(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [sum(out_slice_sizes), hidden], the (fused) base weight
    bias: torch.Tensor | None,  # [sum(out_slice_sizes)]
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden]
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    meta: LoRABatchMeta,
    out_slice_sizes: list[int],
    s: torch.Tensor | None = None,  # lora_shrink(x, a_stacked, meta, scaled=True) when already computed
) -> torch.Tensor:  # [num_tokens, sum(out_slice_sizes)]
    """x · Wᵀ + bias + LoRA(x), with the LoRA term fused into the base GEMM's epilogue.

    Where Triton runs (CUDA, or the interpreter) and there are ≤ 4 slices: `lora_linear_op`, i.e. `lora_gemm`,
    whose K loop runs scale · s · Bᵀ as extra iterations on the same accumulator before the single store of
    y (tile config: `lora_gemm.op.gemm_config`, TMA on CUDA), with s = scale · x · Aᵀ computed in the same
    launch by the programs the last round of tiles leaves idle where the batch allows it (`shrink_in_ok`),
    else by the shrink kernel first. Elsewhere the expand writes delta + bias into a fresh buffer and cuBLAS
    accumulates onto it (`_lora_linear_addmm`). A batch without LoRA is a plain linear. `s` (Triton path
    only) skips the shrink: linears that read the same x (q, k, v) can share one multi-slice shrink, reading
    x once (`lora_linear_op` returns it).
    """
    if not meta.has_lora or len(out_slice_sizes) > _GROUP or x.shape[0] == 0:
        y = torch.nn.functional.linear(x, weight, bias)
        apply_lora(y, x, a_stacked, b_stacked, meta, out_slice_sizes)
        return y
    if not use_triton(x):
        return _lora_linear_addmm(x, weight, bias, a_stacked, b_stacked, meta, out_slice_sizes)
    if s is None:
        return lora_linear_op(
            x, weight, bias, a_stacked, b_stacked, meta.token_seg, meta.seg_start, meta.seg_len, meta.seg_slot,
            meta.seg_scale, meta.slot_rank, meta.max_rank, list(out_slice_sizes), meta.seg_align,
        )[0]  # fmt: skip
    return lora_gemm_op(
        x, weight, bias, s, b_stacked, meta.token_seg, meta.seg_start, meta.seg_len, meta.seg_slot,
        meta.seg_scale, meta.slot_rank, list(out_slice_sizes), True, meta.seg_align,
    )  # fmt: skip


def _lora_linear_addmm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    meta: LoRABatchMeta,
    out_slice_sizes: list[int],
) -> torch.Tensor:
    """The unfused path: the expand writes delta + bias into a fresh buffer (one write of y instead of a
    read and a write after the GEMM), and the GEMM accumulates onto it (`addmm_`, beta = 1)."""
    s = lora_shrink(x, a_stacked, meta)
    y = x.new_empty((x.shape[0], weight.shape[0]))
    lora_expand_op(
        y, s, b_stacked, meta.token_seg, meta.seg_start, meta.seg_len, meta.seg_slot, meta.seg_scale,
        meta.slot_rank, list(out_slice_sizes), accumulate=False, bias=bias,
    )  # fmt: skip
    return y.addmm_(x, weight.t())
