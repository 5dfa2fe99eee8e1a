"""Adaptive LayerNorm modulation with the segmented LoRA shrink of its output in the same pass:

    y[t] = LayerNorm(x[t]) · (1 + scale[b(t)]) + shift[b(t)]          (no affine; b(t) = t // tokens_per_row)
    s[j, t, :rank] = scale(t) · y[t] · A[j, slot(t), :rank]ᵀ          (HAS_LORA; up to 4 slices j)

The projections after a DiT's adaLN-Zero norm (Flux: q, k, v of each stream; proj_mlp, q, k, v of a single
block) read y; their LoRA shrink would read y once more (tokens × hidden, as much as the norm writes). Here
the shrink multiplies each y tile while it is still in registers, so with LoRA the pair (norm, shrink) moves
the bytes of the norm alone.

One program owns BLOCK_M rows. Pass 1 reads them for the row statistics (sums shifted by each row's first
value, so a large mean does not cancel the variance away); pass 2 reads them again — from L2, they were just
read — writes y and feeds the rounded y tile (exactly what the GEMM will read) to one dot per slice of
each segment touching the rows (usually one; rows of other segments are zeroed). s is stored as
`lora_shrink` stores it (`_scale_and_store`), so `lora_gemm` takes it unchanged.
"""

import triton
import triton.language as tl

from ditserve.kernels.lora_shrink.kernel import _scale_and_store, _segment


@triton.jit
def _adaln_shrink_kernel(
    x_ptr,  # [num_tokens, hidden]
    shift_ptr,  # [batch, hidden]
    scale_ptr,  # [batch, hidden]
    y_ptr,  # [num_tokens, hidden], x's dtype
    a_ptr,  # [num_slices, max_loras, max_rank, hidden] (read only when HAS_LORA)
    s_ptr,  # [num_slices, num_tokens, s_cols] fp32, or x's dtype when SCALED
    token_seg_ptr,  # [num_tokens] int32
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,  # [num_segments] int32
    seg_slot_ptr,  # [num_segments] int32
    seg_scale_ptr,  # [num_segments] fp32 (read only when SCALED)
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    hidden,
    tokens_per_row,  # rows of x per batch element (shift/scale row)
    rank_dim,  # columns of s
    eps,
    stride_xt,
    stride_shb,
    stride_scb,
    stride_yt,
    stride_as,
    stride_al,
    stride_ar,
    stride_ah,
    stride_ss,
    stride_st,
    stride_sr,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_LORA: tl.constexpr,
    SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_tokens
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)
    x_rows = x_ptr + rows[:, None] * stride_xt

    # pass 1: row statistics
    c = tl.load(x_ptr + rows * stride_xt).to(tl.float32)
    sum1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sum2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = (k0 + offs_k) < hidden
        v = tl.load(x_rows + (k0 + offs_k)[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        d = tl.where(k_mask[None, :], v - c[:, None], 0.0)
        sum1 += tl.sum(d, axis=1)
        sum2 += tl.sum(d * d, axis=1)
    mean_d = sum1 / hidden
    var = tl.maximum(sum2 / hidden - mean_d * mean_d, 0.0)
    mean = c + mean_d
    rstd = 1.0 / tl.sqrt(var + eps)

    b = rows // tokens_per_row
    shift_rows = shift_ptr + b[:, None] * stride_shb
    scale_rows = scale_ptr + b[:, None] * stride_scb
    y_rows = y_ptr + rows[:, None] * stride_yt
    out_ty = y_ptr.dtype.element_ty

    offs_r = tl.arange(0, BLOCK_R)
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if HAS_LORA:
        seg_lo = tl.load(token_seg_ptr + m0)
        seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, num_tokens) - 1)

    # pass 2: y, and its shrink
    for k0 in range(0, hidden, BLOCK_K):
        offs = k0 + offs_k
        k_mask = offs < hidden
        v = tl.load(x_rows + offs[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        sc = tl.load(scale_rows + offs[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        sh = tl.load(shift_rows + offs[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        y = ((v - mean[:, None]) * rstd[:, None] * (1.0 + sc) + sh).to(out_ty)
        tl.store(y_rows + offs[None, :], y, mask=m_mask[:, None] & k_mask[None, :])
        if HAS_LORA:
            for seg in range(seg_lo, seg_hi + 1):
                slot, rank, start, end = _segment(
                    seg, seg_slot_ptr, slot_rank_ptr, seg_start_ptr, seg_len_ptr
                )
                if rank > 0:
                    # rows of other segments as 0; A rows past the rank and columns past hidden as 0
                    ya = tl.where(((offs_m >= start) & (offs_m < end))[:, None], y, 0.0).to(out_ty)
                    a_ptrs = (
                        a_ptr
                        + slot.to(tl.int64) * stride_al
                        + offs_r[None, :] * stride_ar
                        + offs[:, None] * stride_ah
                    )
                    a_mask = k_mask[:, None] & (offs_r < rank)[None, :]
                    acc0 = tl.dot(
                        ya, tl.load(a_ptrs, mask=a_mask, other=0.0), acc0, input_precision=PRECISION
                    )
                    if NUM_SLICES > 1:
                        a = tl.load(a_ptrs + stride_as, mask=a_mask, other=0.0)
                        acc1 = tl.dot(ya, a, acc1, input_precision=PRECISION)
                    if NUM_SLICES > 2:
                        a = tl.load(a_ptrs + 2 * stride_as, mask=a_mask, other=0.0)
                        acc2 = tl.dot(ya, a, acc2, input_precision=PRECISION)
                    if NUM_SLICES > 3:
                        a = tl.load(a_ptrs + 3 * stride_as, mask=a_mask, other=0.0)
                        acc3 = tl.dot(ya, a, acc3, input_precision=PRECISION)

    if HAS_LORA:
        _scale_and_store(acc0, acc1, acc2, acc3, offs_m, offs_r, s_ptr, token_seg_ptr, seg_scale_ptr,
                         num_tokens, rank_dim, stride_ss, stride_st, stride_sr, NUM_SLICES,
                         SCALED)  # fmt: skip
