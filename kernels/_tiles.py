"""Triton tile helpers shared by the segmented kernels (a program's rows are a row block, its adapters from the
segments touching it) and the chunked SGMV ones (a program's rows are a chunk of one adapter's tokens, gathered
by token id): a slot's rank, a row block's segments, the shrink's A tile and K steps over up to 4 slices, the
expand's column blocks cut per output slice and its B tiles. Triton inlines them: a kernel compiles as if
they were written out in it."""

import triton
import triton.language as tl


@triton.jit
def slot_rank(slot, slot_rank_ptr):
    """Adapter slot slot's rank; 0 for slot -1 (no adapter)."""
    rank = tl.load(slot_rank_ptr + tl.maximum(slot, 0))
    return tl.where(slot >= 0, rank, 0)


@triton.jit
def chunk_adapter(chunk, chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr, slot_rank_ptr):
    """SGMV chunk → (its slot, that slot's rank (0 without one), its first position in the sorted order, its
    length)."""
    slot = tl.load(chunk_slot_ptr + chunk)
    rank = slot_rank(slot, slot_rank_ptr)
    return slot, rank, tl.load(chunk_start_ptr + chunk), tl.load(chunk_len_ptr + chunk)


@triton.jit
def row_segments(token_seg_ptr, m0, num_tokens, BLOCK_M: tl.constexpr):
    """The first and the last segment touching rows m0 .. m0 + BLOCK_M (those before num_tokens)."""
    seg_lo = tl.load(token_seg_ptr + m0)
    seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, num_tokens) - 1)
    return seg_lo, seg_hi


@triton.jit
def segment_slot(seg, seg_slot_ptr, slot_rank_ptr):
    """Segment seg's adapter slot (-1: none) and that slot's rank (0 without one)."""
    slot = tl.load(seg_slot_ptr + seg)
    return slot, slot_rank(slot, slot_rank_ptr)


@triton.jit
def segment_span(seg, seg_start_ptr, seg_len_ptr):
    """Segment seg's rows: start .. end."""
    start = tl.load(seg_start_ptr + seg)
    return start, start + tl.load(seg_len_ptr + seg)


@triton.jit
def segment_rows(seg, seg_start_ptr, seg_len_ptr, offs_m):
    """Which of the rows offs_m segment seg holds."""
    start, end = segment_span(seg, seg_start_ptr, seg_len_ptr)
    return (offs_m >= start) & (offs_m < end)


@triton.jit
def zero_slices(BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """The shrink's four fp32 accumulators, one per slice (those past NUM_SLICES are never touched)."""
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    return acc0, acc1, acc2, acc3


@triton.jit
def a_tile_ptrs(a_ptr, slot, offs_r, offs_k, stride_al, stride_ar, stride_ah):
    """Slice 0's first A tile [BLOCK_K, BLOCK_R] of slot (slot 0 for -1): the transpose of A[slot]'s [rank,
    hidden] rows."""
    return (
        a_ptr
        + tl.maximum(slot, 0).to(tl.int64) * stride_al
        + offs_r[None, :] * stride_ar
        + offs_k[:, None] * stride_ah
    )


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


@triton.jit
def b_tile(b_ptr, slot, offs_n, offs_r, n_mask, r_mask, stride_bl, stride_bn, stride_br):
    """B[slot] as the expand's [BLOCK_R, BLOCK_N] operand: columns offs_n, rank rows offs_r, zero where
    masked."""
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br
    return tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)


@triton.jit
def b_block(b_desc, b_row, b_rows, cols, c_mask, r_mask, stride_bn, B_TMA: tl.constexpr):
    """The [BLOCK_R, BLOCK_N] B tile of a column walk: B_TMA, row b_row of b_desc (B viewed as [max_loras ·
    n_total, max_rank]: rows past the slice or the slot only reach masked-off columns, columns past the rank
    meet zeros in s); else columns cols of b_rows (B[slot]'s rank rows), zero where masked."""
    if B_TMA:
        b = b_desc.load([b_row, 0]).T
    else:
        b = tl.load(b_rows + cols[None, :] * stride_bn, mask=r_mask[:, None] & c_mask[None, :], other=0.0)
    return b
