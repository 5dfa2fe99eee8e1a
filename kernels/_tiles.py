"""Triton tile helpers shared by the segmented kernels (a program's rows are a row block, its adapters from the
segments touching it) and the chunked SGMV ones (a program's rows are a chunk of one adapter's tokens, gathered
by token id): a slot's rank, the shrink's K steps over up to 4 slices, the expand's column blocks cut per
output slice."""

import triton
import triton.language as tl


@triton.jit
def slot_rank(slot, slot_rank_ptr):
    """Adapter slot slot's rank; 0 for slot -1 (no adapter)."""
    rank = tl.load(slot_rank_ptr + tl.maximum(slot, 0))
    return tl.where(slot >= 0, rank, 0)


@triton.jit
def shrink_k_steps(acc0, acc1, acc2, acc3, x_ptrs, a_ptrs, row_mask, r_mask, k_iters, hidden, stride_xh,
                   stride_as, stride_ah, NUM_SLICES: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):  # fmt: skip
    """acc_j += x tile · A[j] tile over k_iters steps of BLOCK_K columns for the NUM_SLICES slices: x rows at
    x_ptrs (row_mask), the A tile [BLOCK_K, BLOCK_R] at a_ptrs (slice j stride_as on, r_mask: its rank columns);
    x read once per step for every slice."""
    offs_k = tl.arange(0, BLOCK_K)
    for ki in range(k_iters):
        k_mask = offs_k + ki * BLOCK_K < hidden
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_mask = k_mask[:, None] & r_mask[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        acc0 = tl.dot(x, a, acc0, input_precision=PRECISION)
        if NUM_SLICES > 1:
            a = tl.load(a_ptrs + stride_as, mask=a_mask, other=0.0)
            acc1 = tl.dot(x, a, acc1, input_precision=PRECISION)
        if NUM_SLICES > 2:
            a = tl.load(a_ptrs + 2 * stride_as, mask=a_mask, other=0.0)
            acc2 = tl.dot(x, a, acc2, input_precision=PRECISION)
        if NUM_SLICES > 3:
            a = tl.load(a_ptrs + 3 * stride_as, mask=a_mask, other=0.0)
            acc3 = tl.dot(x, a, acc3, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        a_ptrs += BLOCK_K * stride_ah
    return acc0, acc1, acc2, acc3


@triton.jit
def store_slices(s_ptrs, s_mask, stride_ss, acc0, acc1, acc2, acc3, NUM_SLICES: tl.constexpr):
    """acc_j into s[j] (s_ptrs: slice 0's tile, slice j stride_ss on), in s's dtype."""
    out_ty = s_ptrs.dtype.element_ty
    tl.store(s_ptrs, acc0.to(out_ty), mask=s_mask)
    if NUM_SLICES > 1:
        tl.store(s_ptrs + stride_ss, acc1.to(out_ty), mask=s_mask)
    if NUM_SLICES > 2:
        tl.store(s_ptrs + 2 * stride_ss, acc2.to(out_ty), mask=s_mask)
    if NUM_SLICES > 3:
        tl.store(s_ptrs + 3 * stride_ss, acc3.to(out_ty), mask=s_mask)


@triton.jit
def slice_columns(pid_n, col1, col2, col3, n_total, blk1, blk2, blk3, BLOCK_N: tl.constexpr):
    """Column block pid_n → (its output slice j, its first column, the end of slice j).

    Every slice is cut into its own column blocks (`_tiling.column_blocks`), so a block never mixes slices;
    col1..col3 / blk1..blk3 are the first column / first block of slices 1..3 (the end when absent)."""
    j = (pid_n >= blk1).to(tl.int32) + (pid_n >= blk2).to(tl.int32) + (pid_n >= blk3).to(tl.int32)
    col_lo = tl.where(j == 0, 0, tl.where(j == 1, col1, tl.where(j == 2, col2, col3)))
    col_hi = tl.where(j == 0, col1, tl.where(j == 1, col2, tl.where(j == 2, col3, n_total)))
    blk_lo = tl.where(j == 0, 0, tl.where(j == 1, blk1, tl.where(j == 2, blk2, blk3)))
    return j, col_lo + (pid_n - blk_lo) * BLOCK_N, col_hi


@triton.jit
def chunk_columns(pid_c, col1, col2, col3, n_total, blk1, blk2, blk3, chk1, chk2, chk3, CHUNK: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """Column chunk pid_c → (its slice j, its first column, the end of slice j, its column blocks): chunks of
    CHUNK column blocks cut per slice like the blocks (`_tiling.column_chunks`), chk1..chk3 the first chunk of
    slices 1..3 (the number of chunks when absent); a slice's last chunk may be shorter."""
    js = (pid_c >= chk1).to(tl.int32) + (pid_c >= chk2).to(tl.int32) + (pid_c >= chk3).to(tl.int32)
    chk_lo = tl.where(js == 0, 0, tl.where(js == 1, chk1, tl.where(js == 2, chk2, chk3)))
    blk_lo = tl.where(js == 0, 0, tl.where(js == 1, blk1, tl.where(js == 2, blk2, blk3)))
    j, n_first, col_hi = slice_columns(
        blk_lo + (pid_c - chk_lo) * CHUNK, col1, col2, col3, n_total, blk1, blk2, blk3, BLOCK_N
    )
    return j, n_first, col_hi, tl.minimum(CHUNK, tl.cdiv(col_hi - n_first, BLOCK_N))
