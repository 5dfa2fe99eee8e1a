"""The one-pass RMSNorm + rotary kernel (see __init__.py). One program per token row; the row's hidden
(heads · head_dim) is one tile of PAIRS (a power of two ≥ hidden / 2) channel pairs, masked past the end."""

import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(
    x_ptr,  # [num_tokens, hidden], contiguous
    w_ptr,  # [hidden]
    cos_ptr,  # [tokens_per_row, head_dim] fp32: pair i of a head turns by cos[s, 2i] ...
    sin_ptr,  # [tokens_per_row, head_dim] fp32: ... and sin[s, 2i + 1] (Wan's tables repeat each pair)
    y_ptr,  # [num_tokens, hidden], x's dtype
    hidden,
    tokens_per_row,  # rows of x per batch element: the table's rows
    eps,
    HALF_HEAD: tl.constexpr,  # head_dim / 2: pairs per head
    PAIRS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = row % tokens_per_row
    offs = tl.arange(0, 2 * PAIRS)
    mask = offs < hidden
    x = tl.load(x_ptr + row * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    # RMSNorm's output is rounded to x's dtype before the rotation, as the unfused modules do
    y = (x * rstd * w).to(y_ptr.dtype.element_ty).to(tl.float32)
    even, odd = tl.split(tl.reshape(y, (PAIRS, 2)))

    pair = tl.arange(0, PAIRS)
    in_head = 2 * (pair % HALF_HEAD)
    pair_mask = pair < hidden // 2
    c = tl.load(cos_ptr + pos * (2 * HALF_HEAD) + in_head, mask=pair_mask, other=0.0)
    s = tl.load(sin_ptr + pos * (2 * HALF_HEAD) + in_head + 1, mask=pair_mask, other=0.0)
    out = tl.reshape(tl.join(even * c - odd * s, even * s + odd * c), (2 * PAIRS,))
    tl.store(y_ptr + row * hidden + offs, out.to(y_ptr.dtype.element_ty), mask=mask)
