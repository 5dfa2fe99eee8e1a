"""Adaptive LayerNorm modulation (DiT adaLN-Zero) in one pass over the activations:

    y[t] = LayerNorm(x[t]) · (1 + scale[b(t)]) + shift[b(t)]          (no affine; b(t) = t // tokens_per_row)

Eagerly, diffusers computes this as a LayerNorm, a multiplication and an addition: three kernels, each
reading and writing tokens × hidden. Here one program owns BLOCK_M rows of one batch element (grid: row
blocks × batch), so shift and scale are one vector per K step; offsets are 32-bit (x holds < 2³¹ elements)
and x and y share them. Pass 1 reads the rows for their statistics (sums shifted by each row's first value,
so a large mean does not cancel the variance away); pass 2 reads them again — from L2, they were just read —
and writes y.

With R_PAD > 0 the same pass also computes a LoRA shrink of y (the input of the linears after the norm: a
block's q, k, v, and a single block's proj_mlp): s[j, t, c] = row_scale[b] · y[t] · A[j, row_slot[b], c]ᵀ for
every slice j < num_slices and column c < R_COLS, zero past the slot's rank and for rows without an adapter
(row_slot -1). One batch element is one request, so a program's rows share one adapter: its A rows (slices ×
R_COLS of them, padded to the power of two R_PAD) come from L2 each step and meet y, already in registers
and rounded to its stored dtype, in one dot; the fused GEMM after it reads s instead of x · Aᵀ.
"""

import triton
import triton.language as tl


@triton.jit
def _adaln_kernel(
    x_ptr,  # [num_tokens, hidden], contiguous
    shift_ptr,  # [batch, hidden], hidden contiguous
    scale_ptr,  # [batch, hidden], hidden contiguous
    y_ptr,  # [num_tokens, hidden], x's dtype and layout
    hidden,
    tokens_per_row,  # rows of x per batch element (shift/scale row)
    eps,
    stride_shb,
    stride_scb,
    s_ptr,  # [num_slices, num_tokens, R_COLS], x's dtype (R_PAD > 0)
    a_ptr,  # [≥ num_slices, max_loras, ≥ R_COLS or the slot ranks, hidden], x's dtype
    row_slot_ptr,  # [batch] int32, -1 = no adapter
    row_scale_ptr,  # [batch] fp32
    slot_rank_ptr,  # [max_loras] int32
    num_slices,
    stride_sj,
    stride_st,
    stride_aj,
    stride_al,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R_COLS: tl.constexpr = 16,
    R_PAD: tl.constexpr = 0,
):
    bi = tl.program_id(1)
    local = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = local < tokens_per_row
    offs_k = tl.arange(0, BLOCK_K)
    rows = bi * tokens_per_row + tl.where(m_mask, local, 0)
    offs_2d = rows[:, None] * hidden + offs_k[None, :]

    # pass 1: row statistics
    c = tl.load(x_ptr + rows * hidden).to(tl.float32)
    sum1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sum2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = (k0 + offs_k) < hidden
        v = tl.load(x_ptr + k0 + offs_2d, mask=k_mask[None, :], other=0.0).to(tl.float32)
        d = tl.where(k_mask[None, :], v - c[:, None], 0.0)
        sum1 += tl.sum(d, axis=1)
        sum2 += tl.sum(d * d, axis=1)
    mean_d = sum1 / hidden
    var = tl.maximum(sum2 / hidden - mean_d * mean_d, 0.0)
    mean = c + mean_d
    rstd = 1.0 / tl.sqrt(var + eps)

    # pass 2: y (and y · Aᵀ)
    shift_row = shift_ptr + bi * stride_shb
    scale_row = scale_ptr + bi * stride_scb
    if R_PAD > 0:
        slot = tl.load(row_slot_ptr + bi)
        rank = tl.where(slot >= 0, tl.load(slot_rank_ptr + tl.maximum(slot, 0)), 0)
        offs_q = tl.arange(0, R_PAD)  # A row q: slice q // R_COLS, rank column q % R_COLS
        q_j = offs_q // R_COLS
        q_c = offs_q % R_COLS
        q_mask = (q_j < num_slices) & (q_c < rank)
        a_rows = a_ptr + q_j * stride_aj + tl.maximum(slot, 0) * stride_al + q_c * stride_ar
        acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = (k0 + offs_k) < hidden
        mask = m_mask[:, None] & k_mask[None, :]
        v = tl.load(x_ptr + k0 + offs_2d, mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(scale_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        sh = tl.load(shift_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        y = (v - mean[:, None]) * rstd[:, None] * (1.0 + sc[None, :]) + sh[None, :]
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + k0 + offs_2d, y, mask=mask)
        if R_PAD > 0:
            a = tl.load(
                a_rows[:, None] + (k0 + offs_k)[None, :], mask=q_mask[:, None] & k_mask[None, :], other=0.0
            )
            acc = tl.dot(y, tl.trans(a), acc)  # rows past the batch and columns past hidden: not stored / A 0
    if R_PAD > 0:
        out = acc * tl.load(row_scale_ptr + bi)
        s_ptrs = s_ptr + q_j[None, :] * stride_sj + rows[:, None] * stride_st + q_c[None, :]
        tl.store(s_ptrs, out.to(s_ptr.dtype.element_ty), mask=m_mask[:, None] & (q_j < num_slices)[None, :])
