"""Chunked SGMV LoRA expand: y[t, cols_j] += scale(t) · s[j, t, :rank] · B[slot, cols_j, :rank]ᵀ.

`_lora_expand_sgmv_kernel` — grid: (column blocks over all output slices, chunks). A chunk holds one slot, so
the program loads its B tile once and reuses it for every BLOCK_M sub-block of the chunk; y and s rows are
gathered and scattered by token id. Every column block reloads the chunk's s rows, so s is read once per column
block of its slice (at rank 128 as many bytes as y).

`_lora_expand_sgmv_rows_kernel` — grid: (column chunks, chunks), the segmented row-stationary kernel's walk
over gathered rows: a program keeps its chunk's scaled s rows in registers and walks CHUNK column blocks of one
slice, per block one B tile (B_TMA: through a TMA descriptor, pipelined STAGES deep), one gathered y tile,
one dot, one scattered store; s is read once per column chunk. Chunks without LoRA return at once.
"""

import triton
import triton.language as tl

from ditserve.kernels._tiles import b_block, b_tile, chunk_adapter, chunk_columns, slice_columns


@triton.jit
def _gathered_s(sorted_ids_ptr, token_scale_ptr, s_ptr, j, start, length, m0, rank, stride_ss, stride_st,
                stride_sr, dtype: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """The chunk's sorted positions m0.. m0 + BLOCK_M: (their tokens (int64), which are in the chunk, scale ·
    s[j] of those rows in dtype, zero past the rank)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    row_mask = offs_m < length
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=row_mask, other=0)
    scale = tl.load(token_scale_ptr + tok, mask=row_mask, other=0.0)
    tok = tok.to(tl.int64)
    s_ptrs = s_ptr + j * stride_ss + tok[:, None] * stride_st + offs_r[None, :] * stride_sr
    s = tl.load(s_ptrs, mask=row_mask[:, None] & (offs_r < rank)[None, :], other=0.0)
    return tok, row_mask, (s * scale[:, None]).to(dtype)


@triton.jit
def _lora_expand_sgmv_kernel(
    y_ptr,  # [num_tokens, n_total]
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32
    b_ptr,  # [max_loras, n_total, max_rank]
    sorted_ids_ptr,  # [num_tokens] int32
    token_scale_ptr,  # [num_tokens] fp32
    chunk_slot_ptr,  # [num_chunks] int32
    chunk_start_ptr,  # [num_chunks] int32
    chunk_len_ptr,  # [num_chunks] int32
    slot_rank_ptr,  # [max_loras] int32
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
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    slot, rank, start, length = chunk_adapter(
        tl.program_id(1), chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr, slot_rank_ptr
    )
    if rank == 0:
        return
    j, n0, col_hi = slice_columns(pid_n, col1, col2, col3, n_total, blk1, blk2, blk3, BLOCK_N)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_hi
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b = b_tile(b_ptr, slot, offs_n, offs_r, n_mask, r_mask, stride_bl, stride_bn, stride_br)

    for m0 in range(0, length, BLOCK_M):
        tok, row_mask, a = _gathered_s(sorted_ids_ptr, token_scale_ptr, s_ptr, j, start, length, m0, rank,
                                       stride_ss, stride_st, stride_sr, b_ptr.dtype.element_ty, BLOCK_M,
                                       BLOCK_R)  # fmt: skip
        acc = tl.dot(a, b, input_precision=PRECISION)
        y_ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :] * stride_yn
        y_mask = row_mask[:, None] & n_mask[None, :]
        acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _lora_expand_sgmv_rows_kernel(
    y_ptr,  # [num_tokens, n_total], updated in place
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32
    b_ptr,  # [max_loras, n_total, max_rank]
    sorted_ids_ptr,  # [num_tokens] int32
    token_scale_ptr,  # [num_tokens] fp32
    chunk_slot_ptr,  # [num_chunks] int32
    chunk_start_ptr,  # [num_chunks] int32
    chunk_len_ptr,  # [num_chunks] int32
    slot_rank_ptr,  # [max_loras] int32
    col1,  # first column of slice 1 (= n_total when absent), likewise col2, col3
    col2,
    col3,
    n_total,
    blk1,  # first column block of slice 1 (= number of blocks when absent), likewise blk2, blk3
    blk2,
    blk3,
    chk1,  # first column chunk of slice 1 (= number of column chunks when absent), likewise chk2, chk3
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr,  # column blocks per program (fewer at the end of a slice)
    STAGES: tl.constexpr,  # num_stages of the column loop
    B_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_c = tl.program_id(0)
    slot, rank, start, length = chunk_adapter(
        tl.program_id(1), chunk_slot_ptr, chunk_start_ptr, chunk_len_ptr, slot_rank_ptr
    )
    if rank == 0:
        return
    j, n_first, col_hi, num_blocks = chunk_columns(
        pid_c, col1, col2, col3, n_total, blk1, blk2, blk3, chk1, chk2, chk3, CHUNK, BLOCK_N
    )
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    b_rows = b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br
    for m0 in range(0, length, BLOCK_M):
        tok, row_mask, a = _gathered_s(sorted_ids_ptr, token_scale_ptr, s_ptr, j, start, length, m0, rank,
                                       stride_ss, stride_st, stride_sr, b_ptr.dtype.element_ty, BLOCK_M,
                                       BLOCK_R)  # fmt: skip
        y_rows = y_ptr + tok[:, None] * stride_yt
        for i in tl.range(0, num_blocks, num_stages=STAGES):
            cols = n_first + i * BLOCK_N + offs_n
            c_mask = cols < col_hi
            b_row = slot * n_total + n_first + i * BLOCK_N
            b = b_block(b_desc, b_row, b_rows, cols, c_mask, r_mask, stride_bn, B_TMA)
            y_mask = row_mask[:, None] & c_mask[None, :]
            y_t = tl.load(y_rows + cols[None, :] * stride_yn, mask=y_mask, other=0.0)
            acc = tl.dot(a, b, y_t.to(tl.float32), input_precision=PRECISION)
            tl.store(y_rows + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
