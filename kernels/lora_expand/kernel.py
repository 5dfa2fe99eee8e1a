"""Segmented LoRA expand: y[t, cols_j] (+)= scale(t) · s[j, t, :rank] · B[slot(t), cols_j, :rank]ᵀ.

Grid: (column blocks over all output slices, token blocks). A column block never straddles two output
slices (each slice is cut into its own blocks), so each program knows its slice j from the block index
and the cumulative block counts. Like the shrink, a program loops over the segments touching its
BLOCK_M tokens; s rows of other segments load as zero. The scale is applied to s before the dot (one
multiply per s element instead of per output), and y is read and written once per tile.
"""

import triton
import triton.language as tl


@triton.jit
def slice_columns(pid_n, col1, col2, col3, n_total, blk1, blk2, blk3, BLOCK_N: tl.constexpr):
    """Column block pid_n → (its output slice j, its first column, the end of slice j).

    Every slice is cut into its own column blocks (`op.column_blocks`), so a block never mixes slices;
    col1..col3 / blk1..blk3 are the first column / first block of slices 1..3 (the end when absent)."""
    j = (pid_n >= blk1).to(tl.int32) + (pid_n >= blk2).to(tl.int32) + (pid_n >= blk3).to(tl.int32)
    col_lo = tl.where(j == 0, 0, tl.where(j == 1, col1, tl.where(j == 2, col2, col3)))
    col_hi = tl.where(j == 0, col1, tl.where(j == 1, col2, tl.where(j == 2, col3, n_total)))
    blk_lo = tl.where(j == 0, 0, tl.where(j == 1, blk1, tl.where(j == 2, blk2, blk3)))
    return j, col_lo + (pid_n - blk_lo) * BLOCK_N, col_hi


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [num_tokens, n_total]
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32
    b_ptr,  # [max_loras, n_total, max_rank]
    bias_ptr,  # [n_total] (read only when HAS_BIAS)
    token_seg_ptr,  # [num_tokens] int32
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,  # [num_segments] int32
    seg_slot_ptr,  # [num_segments] int32
    seg_scale_ptr,  # [num_segments] fp32
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    rank_dim,
    col1,  # first column of slice 1 (= n_total when absent), likewise col2, col3
    col2,
    col3,
    n_total,
    blk1,  # first column block of slice 1 (= number of blocks when absent), likewise blk2, blk3
    blk2,
    blk3,
    stride_yt,
    stride_yn,
    stride_ss,
    stride_st,
    stride_sr,
    stride_bl,
    stride_bn,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # y += delta; else y = delta (+ bias): every tile is written
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    j, n0, col_hi = slice_columns(pid_n, col1, col2, col3, n_total, blk1, blk2, blk3, BLOCK_N)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_hi

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    seg_lo = tl.load(token_seg_ptr + m0)
    seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, num_tokens) - 1)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    any_lora = pid_n * 0  # int32 scalar, loop-carried
    for seg in range(seg_lo, seg_hi + 1):
        slot = tl.load(seg_slot_ptr + seg)
        rank = tl.load(slot_rank_ptr + tl.maximum(slot, 0))
        rank = tl.where(slot >= 0, rank, 0)
        any_lora = tl.maximum(any_lora, rank)
        if rank > 0:
            start = tl.load(seg_start_ptr + seg)
            end = start + tl.load(seg_len_ptr + seg)
            scale = tl.load(seg_scale_ptr + seg)
            row_mask = (offs_m >= start) & (offs_m < end)
            r_mask = offs_r < rank
            s_ptrs = (
                s_ptr + j * stride_ss + offs_m.to(tl.int64)[:, None] * stride_st + offs_r[None, :] * stride_sr
            )
            s = tl.load(s_ptrs, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
            b_ptrs = (
                b_ptr
                + slot.to(tl.int64) * stride_bl
                + offs_n[None, :] * stride_bn
                + offs_r[:, None] * stride_br
            )
            b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot((s * scale).to(b.dtype), b, acc, input_precision=PRECISION)

    if ACCUMULATE:
        # no LoRA row in this tile: leave y untouched
        if any_lora == 0:
            return
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :] * stride_yn
    y_mask = (offs_m < num_tokens)[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
