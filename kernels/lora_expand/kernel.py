"""Segmented LoRA expand: y[t, cols_j] (+)= scale(t) · s[j, t, :rank] · B[slot(t), cols_j, :rank]ᵀ.

`_lora_expand_kernel` — grid: (column blocks over all output slices, token blocks). A column block never
straddles two output slices (each slice is cut into its own blocks), so each program knows its slice j
from the block index and the cumulative block counts. Like the shrink, a program loops over the segments
touching its BLOCK_M tokens; s rows of other segments load as zero. The scale is applied to s before the
dot (one multiply per s element instead of per output), and y is read and written once per tile.

`_lora_expand_rows_kernel` (y += delta only) — grid: (column chunks, token blocks). A program keeps its
rows' scaled s in registers and walks a chunk of CHUNK column blocks of one slice: per block one B tile, one
dot onto the y tile, one store. B_TMA: the B tiles come through a TMA descriptor, which Triton pipelines
STAGES deep (as plain loads from L2 they were not pipelined, and at ranks 64-128 their latency set the time);
Y_TMA: in a row block that lies inside one segment the y tiles are loaded and stored through a descriptor
too, so the loop is a pipelined TMA stream; with S_EARLY that block's s tile is loaded (vectorised, masked
only by the batch and s's width) before the chain of segment-metadata loads rather than after it. Otherwise
(pointers, or a row block that straddles segments, handled one segment at a time, each pass reading and
writing only its own rows) the next block's y tile is loaded before this block's dot. The
one-tile-per-program kernel above reloads s for every y tile and waits for every load.
"""

import triton
import triton.language as tl

from ditserve.kernels._tiles import (
    b_block,
    b_tile,
    chunk_columns,
    row_segments,
    segment_slot,
    segment_span,
    slice_columns,
)


@triton.jit
def _s_tile_ptrs(s_ptr, j, offs_m, offs_r, stride_ss, stride_st, stride_sr):
    """s[j]'s [BLOCK_M, BLOCK_R] tile: rows offs_m, rank columns offs_r."""
    return s_ptr + j * stride_ss + offs_m.to(tl.int64)[:, None] * stride_st + offs_r[None, :] * stride_sr


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
    seg_lo, seg_hi = row_segments(token_seg_ptr, m0, num_tokens, BLOCK_M)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    any_lora = pid_n * 0  # int32 scalar, loop-carried
    for seg in range(seg_lo, seg_hi + 1):
        slot, rank = segment_slot(seg, seg_slot_ptr, slot_rank_ptr)
        any_lora = tl.maximum(any_lora, rank)
        if rank > 0:
            start, end = segment_span(seg, seg_start_ptr, seg_len_ptr)
            scale = tl.load(seg_scale_ptr + seg)
            row_mask = (offs_m >= start) & (offs_m < end)
            r_mask = offs_r < rank
            s_ptrs = _s_tile_ptrs(s_ptr, j, offs_m, offs_r, stride_ss, stride_st, stride_sr)
            s = tl.load(s_ptrs, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
            b = b_tile(b_ptr, slot, offs_n, offs_r, n_mask, r_mask, stride_bl, stride_bn, stride_br)
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


@triton.jit
def _lora_expand_rows_kernel(
    y_ptr,  # [num_tokens, n_total], updated in place
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32
    b_ptr,  # [max_loras, n_total, max_rank]
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
    chk1,  # first chunk of slice 1 (= number of chunks when absent), likewise chk2, chk3
    chk2,
    chk3,
    stride_yt,
    stride_yn,
    stride_ss,
    stride_st,
    stride_sr,
    stride_bl,
    stride_bn,
    stride_br,
    b_desc,  # B_TMA: B viewed as [max_loras · n_total, max_rank], a TensorDescriptor, block [BLOCK_N, BLOCK_R]
    y_desc,  # Y_TMA: y as a TensorDescriptor, block [BLOCK_M, BLOCK_N]
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr,  # column blocks per program (fewer at the end of a slice)
    STAGES: tl.constexpr,  # num_stages of the column loop
    B_TMA: tl.constexpr,  # B tiles through b_desc (pipelined TMA loads) instead of pointer loads
    Y_TMA: tl.constexpr,  # (with B_TMA, every slice a multiple of BLOCK_N) y tiles of one-segment row blocks
    # through y_desc
    S_EARLY: tl.constexpr,  # (with Y_TMA) s loaded for every row before the segment metadata
    PRECISION: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_m = tl.program_id(1)
    j, n_first, col_hi, num_blocks = chunk_columns(
        pid_c, col1, col2, col3, n_total, blk1, blk2, blk3, chk1, chk2, chk3, CHUNK, BLOCK_N
    )
    n_end = n_first + num_blocks * BLOCK_N  # past this chunk's last column

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    y_rows = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt
    s_rows = _s_tile_ptrs(s_ptr, j, offs_m, offs_r, stride_ss, stride_st, stride_sr)
    if S_EARLY:
        # every row's s, issued before the segment metadata: in a one-segment row block its latency overlaps the
        # chain of metadata loads (token -> segment -> slot -> rank) instead of following it
        s_early = tl.load(
            s_rows, mask=(offs_m < num_tokens)[:, None] & (offs_r < rank_dim)[None, :], other=0.0
        )
    seg_lo, seg_hi = row_segments(token_seg_ptr, m0, num_tokens, BLOCK_M)
    for seg in range(seg_lo, seg_hi + 1):
        slot, rank = segment_slot(seg, seg_slot_ptr, slot_rank_ptr)
        rank = tl.minimum(rank, rank_dim)
        if rank > 0:
            start, end = segment_span(seg, seg_start_ptr, seg_len_ptr)
            scale = tl.load(seg_scale_ptr + seg)
            row_mask = (offs_m >= start) & (offs_m < end)
            r_mask = offs_r < rank
            b_rows = b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br
            b_first = slot * n_total + n_first
            if S_EARLY and seg_lo == seg_hi:
                # every row is this segment's: the early s only needs the slot's rank
                a = tl.where(r_mask[None, :], s_early * scale, 0.0).to(b_ptr.dtype.element_ty)
            else:
                s = tl.load(s_rows, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
                a = (s * scale).to(b_ptr.dtype.element_ty)
            if Y_TMA and seg_lo == seg_hi:
                # one segment holds every row: y tiles through TMA too (rows past the end are clipped)
                for i in tl.range(0, num_blocks, num_stages=STAGES):
                    n0 = n_first + i * BLOCK_N
                    b = b_desc.load([b_first + i * BLOCK_N, 0]).T
                    y_t = y_desc.load([m0, n0])
                    acc = tl.dot(a, b, y_t.to(tl.float32), input_precision=PRECISION)
                    y_desc.store([m0, n0], acc.to(y_ptr.dtype.element_ty))
            else:
                cols = n_first + offs_n
                y_next = tl.load(
                    y_rows + cols[None, :] * stride_yn,
                    mask=row_mask[:, None] & (cols < col_hi)[None, :],
                    other=0.0,
                )
                for i in tl.range(0, num_blocks, num_stages=STAGES):
                    cols = n_first + i * BLOCK_N + offs_n
                    c_mask = cols < col_hi
                    b = b_block(b_desc, b_first + i * BLOCK_N, b_rows, cols, c_mask, r_mask, stride_bn, B_TMA)
                    y_cur = y_next
                    nxt = cols + BLOCK_N
                    y_next = tl.load(
                        y_rows + nxt[None, :] * stride_yn,
                        mask=row_mask[:, None] & ((nxt < col_hi) & (nxt < n_end))[None, :],
                        other=0.0,
                    )
                    acc = tl.dot(a, b, y_cur.to(tl.float32), input_precision=PRECISION)
                    tl.store(y_rows + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
                             mask=row_mask[:, None] & c_mask[None, :])  # fmt: skip
