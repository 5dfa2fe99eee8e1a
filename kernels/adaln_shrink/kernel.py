"""Adaptive LayerNorm modulation with the segmented LoRA shrink of its output in the same pass:

    y[t] = LayerNorm(x[t]) · (1 + scale[b(t)]) + shift[b(t)]          (no affine; b(t) = t // tokens_per_row)
    s[j, t, :rank] = scale(t) · y[t] · A[j, slot(t), :rank]ᵀ          (HAS_LORA; up to 4 slices j)

The projections after a DiT's adaLN-Zero norm (Flux: q, k, v of each stream; proj_mlp, q, k, v of a single
block) read y; their LoRA shrink would read y once more (tokens × hidden, as much as the norm writes). Here
the shrink multiplies each y tile while it is still in registers, so with LoRA the pair (norm, shrink) moves
the bytes of the norm alone.

One program owns BLOCK_M rows of one batch element (grid: row blocks × batch), so shift and scale are one
vector per K step; offsets are 32-bit (x holds < 2³¹ elements) and x and y share them, which keeps the
register count of the pointer tiles down. Pass 1 reads the rows for the row statistics (sums shifted by each row's first
value, so a large mean does not cancel the variance away); pass 2 reads them again — from L2, they were just
read — writes y and feeds the rounded y tile (exactly what the GEMM will read) to one dot per slice,
segment by segment over the segments touching the rows (usually one; each loads only its own rows). s is stored as
`lora_shrink` stores it (`_scale_and_store`), so `lora_gemm` takes it unchanged.
"""

import triton
import triton.language as tl

from ditserve.kernels.lora_shrink.kernel import _scale_and_store, _segment


@triton.jit
def _modulate(x_ptr, y_ptr, offs_2d, shift_row, scale_row, row_mask, mean, rstd, hidden, a_ptr, a_off, r_mask,
              stride_as, acc0, acc1, acc2, acc3, BLOCK_K: tl.constexpr, NUM_SLICES: tl.constexpr,
              DOT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """y = (x - mean) · rstd · (1 + scale) + shift for the rows of row_mask (x and y at offs_2d), stored;
    with DOT, y (other rows as 0) times each slice's A tile ([BLOCK_K, BLOCK_R] at a_ptr + a_off, rows past
    r_mask as 0) into acc0..3."""
    offs_k = tl.arange(0, BLOCK_K)
    out_ty = y_ptr.dtype.element_ty
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = (k0 + offs_k) < hidden
        mask = row_mask[:, None] & k_mask[None, :]
        v = tl.load(x_ptr + k0 + offs_2d, mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(scale_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        sh = tl.load(shift_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        y = ((v - mean[:, None]) * rstd[:, None] * (1.0 + sc[None, :]) + sh[None, :]).to(out_ty)
        tl.store(y_ptr + k0 + offs_2d, y, mask=mask)
        if DOT:
            ya = tl.where(row_mask[:, None], y, 0.0).to(out_ty)
            a_tile = a_ptr + k0 + a_off
            a_mask = k_mask[:, None] & r_mask[None, :]
            acc0 = tl.dot(ya, tl.load(a_tile, mask=a_mask, other=0.0), acc0, input_precision=PRECISION)
            if NUM_SLICES > 1:
                a = tl.load(a_tile + stride_as, mask=a_mask, other=0.0)
                acc1 = tl.dot(ya, a, acc1, input_precision=PRECISION)
            if NUM_SLICES > 2:
                a = tl.load(a_tile + 2 * stride_as, mask=a_mask, other=0.0)
                acc2 = tl.dot(ya, a, acc2, input_precision=PRECISION)
            if NUM_SLICES > 3:
                a = tl.load(a_tile + 3 * stride_as, mask=a_mask, other=0.0)
                acc3 = tl.dot(ya, a, acc3, input_precision=PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def _adaln_shrink_kernel(
    x_ptr,  # [num_tokens, hidden], contiguous
    shift_ptr,  # [batch, hidden]
    scale_ptr,  # [batch, hidden]
    y_ptr,  # [num_tokens, hidden], x's dtype and layout
    a_ptr,  # [num_slices, max_loras, max_rank, hidden] (read only when HAS_LORA), hidden contiguous
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
    stride_shb,
    stride_scb,
    stride_as,
    stride_al,
    stride_ar,
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
    bi = tl.program_id(1)
    local = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m0 = bi * tokens_per_row + tl.program_id(0) * BLOCK_M
    offs_m = bi * tokens_per_row + local
    m_mask = local < tokens_per_row
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(m_mask, offs_m, 0)
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

    shift_row = shift_ptr + bi * stride_shb
    scale_row = scale_ptr + bi * stride_scb
    offs_r = tl.arange(0, BLOCK_R)
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # pass 2: y, and its shrink, segment by segment (usually one per row block), each reading only its rows
    if HAS_LORA:
        seg_lo = tl.load(token_seg_ptr + m0)
        seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, (bi + 1) * tokens_per_row) - 1)
        # A tile [BLOCK_K, BLOCK_R]: the transpose of A[slot]'s rows, offsets past the slot
        a_off = offs_r[None, :] * stride_ar + offs_k[:, None]
        for seg in range(seg_lo, seg_hi + 1):
            slot, rank, start, end = _segment(seg, seg_slot_ptr, slot_rank_ptr, seg_start_ptr, seg_len_ptr)
            row_mask = m_mask & (offs_m >= start) & (offs_m < end)
            a_slot = a_ptr + slot.to(tl.int64) * stride_al
            if rank > 0:
                acc0, acc1, acc2, acc3 = _modulate(
                    x_ptr, y_ptr, offs_2d, shift_row, scale_row, row_mask, mean, rstd, hidden, a_slot, a_off,
                    offs_r < rank, stride_as, acc0, acc1, acc2, acc3, BLOCK_K, NUM_SLICES, True, PRECISION,
                )  # fmt: skip
            else:
                _modulate(x_ptr, y_ptr, offs_2d, shift_row, scale_row, row_mask, mean, rstd, hidden, a_slot, a_off,
                          offs_r < rank, stride_as, acc0, acc1, acc2, acc3, BLOCK_K, NUM_SLICES, False,
                          PRECISION)  # fmt: skip
        # rows past this batch element's last one belong to the next element's programs: not stored
        _scale_and_store(acc0, acc1, acc2, acc3, tl.where(m_mask, offs_m, num_tokens), offs_r, s_ptr, token_seg_ptr, seg_scale_ptr,
                         num_tokens, rank_dim, stride_ss, stride_st, stride_sr, NUM_SLICES,
                         SCALED)  # fmt: skip
    else:
        _modulate(x_ptr, y_ptr, offs_2d, shift_row, scale_row, m_mask, mean, rstd, hidden, a_ptr, offs_2d, m_mask,
                  stride_as, acc0, acc1, acc2, acc3, BLOCK_K, NUM_SLICES, False, PRECISION)  # fmt: skip
