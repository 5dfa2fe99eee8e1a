"""Adaptive LayerNorm modulation (DiT adaLN-Zero) in one pass over the activations:

    y[t] = LayerNorm(x[t]) · (1 + scale[b(t)]) + shift[b(t)]          (no affine; b(t) = t // tokens_per_row)

Eagerly, diffusers computes this as a LayerNorm, a multiplication and an addition: three kernels, each
reading and writing tokens × hidden. Here one program owns BLOCK_M rows of one batch element (grid: row
blocks × batch), so shift and scale are one vector per K step; offsets are 32-bit (x holds < 2³¹ elements)
and x and y share them. Pass 1 reads the rows for their statistics (sums shifted by each row's first value,
so a large mean does not cancel the variance away); pass 2 reads them again — from L2, they were just read —
and writes y.
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
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
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

    # pass 2: y
    shift_row = shift_ptr + bi * stride_shb
    scale_row = scale_ptr + bi * stride_scb
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = (k0 + offs_k) < hidden
        mask = m_mask[:, None] & k_mask[None, :]
        v = tl.load(x_ptr + k0 + offs_2d, mask=mask, other=0.0).to(tl.float32)
        sc = tl.load(scale_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        sh = tl.load(shift_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        y = (v - mean[:, None]) * rstd[:, None] * (1.0 + sc[None, :]) + sh[None, :]
        tl.store(y_ptr + k0 + offs_2d, y.to(y_ptr.dtype.element_ty), mask=mask)
