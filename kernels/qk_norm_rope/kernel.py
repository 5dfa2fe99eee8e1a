"""The one-pass RMSNorm + rotary kernel (see __init__.py). One program per token row; the row is one tile
of [HEADS_PAD, HEAD_DIM] (HEADS_PAD a power of two ≥ heads), masked past the last head."""

import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,  # [num_tokens, heads · HEAD_DIM], rows stride_x apart (a slice of a wider projection's output)
    w_ptr,  # [heads · HEAD_DIM] (PER_HEAD=False) or [HEAD_DIM] (PER_HEAD=True)
    cos_ptr,  # [table_rows, tokens_per_row, HEAD_DIM] fp32: pair i of a head turns by cos[.., 2i] ...
    sin_ptr,  # ... and sin[.., 2i + 1] (Wan's two tables; a complex table's real view is both)
    y_ptr,  # [num_tokens, heads · HEAD_DIM], x's dtype, contiguous
    stride_x,
    heads,
    tokens_per_row,  # rows of x per batch element: the table's rows
    table_batch_stride,  # 0: one table for the whole batch
    eps,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    PER_HEAD: tl.constexpr,  # normalise each head (else the whole row)
    ROUND_BEFORE_WEIGHT: tl.constexpr,  # diffusers' RMSNorm: x · rstd rounded to x's dtype, then · w
):
    row = tl.program_id(0).to(tl.int64)
    batch = row // tokens_per_row
    pos = row % tokens_per_row
    hidden = heads * HEAD_DIM
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM)
    offs = h[:, None] * HEAD_DIM + d[None, :]
    mask = (h < heads)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)

    if PER_HEAD:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + d).to(tl.float32)[None, :]
    else:
        rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / hidden + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd
    if ROUND_BEFORE_WEIGHT:
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
    # the norm's output is rounded to x's dtype before the rotation, as the unfused modules do
    y = (y * w).to(y_ptr.dtype.element_ty).to(tl.float32)
    even, odd = tl.split(tl.reshape(y, (HEADS_PAD, HEAD_DIM // 2, 2)))

    pair = 2 * tl.arange(0, HEAD_DIM // 2)
    table = batch * table_batch_stride + pos * HEAD_DIM
    c = tl.load(cos_ptr + table + pair)[None, :]
    s = tl.load(sin_ptr + table + pair + 1)[None, :]
    out = tl.reshape(tl.join(even * c - odd * s, even * s + odd * c), (HEADS_PAD, HEAD_DIM))
    tl.store(y_ptr + row * hidden + offs, out.to(y_ptr.dtype.element_ty), mask=mask)
