"""Base GEMM with the segmented LoRA expand in its epilogue:

    y[t, n] = Σ_k x[t, k] · W[n, k] (+ bias[n]) + scale(t) · Σ_r s[j(n), t, r] · B[slot(t), n, r]

One program per SM (persistent) walks output tiles in grouped order: GROUP_M row blocks share each column
block, so the W columns a group needs stay in L2 while its x rows stream through. Column blocks are cut
per output slice (as in lora_expand), so a tile knows its slice j and never mixes two. After the K loop,
the LoRA term is one more tl.dot per segment touching the tile (usually one: a 4608-token request covers
36 whole 128-row tiles) with K = BLOCK_R, on the same fp32 accumulator; s · scale is cast to W's dtype
first so it runs on the tensor cores like the main loop. y is written once: no read-modify-write pass.

The K loop reads x and W through pointers (runs in the interpreter and everywhere) or through TMA tensor
descriptors (USE_TMA: host-built `TensorDescriptor`s, out-of-range rows come back as zeros).
"""

import triton
import triton.language as tl


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive row blocks per column block, then the next column block."""
    num_in_group = GROUP_M * num_pid_n
    group = tile_id // num_in_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    local = tile_id - group * num_in_group
    return first_m + local % group_size, local // group_size


@triton.jit
def _lora_segment(
    acc,
    seg,
    j,
    offs_m,
    offs_n,
    n_mask,
    s_ptr,
    b_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    seg_scale_ptr,
    slot_rank_ptr,
    rank_dim,
    stride_ss,
    stride_st,
    stride_sr,
    stride_bl,
    stride_bn,
    stride_br,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc += scale · s[j, rows of seg, :rank] · B[slot, offs_n, :rank]ᵀ; rows of other segments load as 0."""
    slot = tl.load(seg_slot_ptr + seg)
    rank = tl.load(slot_rank_ptr + tl.maximum(slot, 0))
    rank = tl.minimum(tl.where(slot >= 0, rank, 0), rank_dim)
    if rank > 0:
        start = tl.load(seg_start_ptr + seg)
        end = start + tl.load(seg_len_ptr + seg)
        scale = tl.load(seg_scale_ptr + seg)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        row_mask = (offs_m >= start) & (offs_m < end)
        s_ptrs = (
            s_ptr + j * stride_ss + offs_m.to(tl.int64)[:, None] * stride_st + offs_r[None, :] * stride_sr
        )
        s = tl.load(s_ptrs, mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        b_ptrs = (
            b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br
        )
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot((s.to(tl.float32) * scale).to(b.dtype), b, acc, input_precision=PRECISION)
    return acc


# index arguments that only steer the tile walk are not specialised on (divisibility by 16 would compile
# another variant for every slice layout / grid size)
@triton.jit(do_not_specialize=["rank_dim", "blk1", "blk2", "blk3", "num_col_blocks", "num_programs"])
def _lora_gemm_kernel(
    x,  # [num_tokens, hidden]: a pointer, or a TensorDescriptor with block [BLOCK_M, BLOCK_K] (USE_TMA)
    w,  # [n_total, hidden]: a pointer, or a TensorDescriptor with block [BLOCK_N, BLOCK_K] (USE_TMA)
    y_ptr,  # [num_tokens, n_total], written once
    bias_ptr,  # [n_total] (read only when HAS_BIAS)
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32 or W's dtype (read only when HAS_LORA)
    b_ptr,  # [max_loras, n_total, max_rank]
    token_seg_ptr,  # [num_tokens] int32
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,  # [num_segments] int32
    seg_slot_ptr,  # [num_segments] int32
    seg_scale_ptr,  # [num_segments] fp32
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    hidden,
    rank_dim,
    col1,  # first column of slice 1 (= n_total when absent), likewise col2, col3
    col2,
    col3,
    n_total,
    blk1,  # first column block of slice 1 (= num_col_blocks when absent), likewise blk2, blk3
    blk2,
    blk3,
    num_col_blocks,
    num_programs,  # grid size: number of SMs (persistent) or number of tiles
    stride_xt,
    stride_xh,
    stride_wn,
    stride_wh,
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
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,  # flatten the tile and K loops into one pipelined loop (epilogue overlaps loads)
    WARP_SPECIALIZE: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no K masks
    COL_ALIGN: tl.constexpr,  # every slice boundary is a multiple of this (vectorised y/bias access)
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_tokens, BLOCK_M)
    num_tiles = num_pid_m * num_col_blocks
    k_tiles = tl.cdiv(hidden, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(pid, num_tiles, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_col_blocks, GROUP_M)
        # output slice j of this column block and its column range
        j = (pid_n >= blk1).to(tl.int32) + (pid_n >= blk2).to(tl.int32) + (pid_n >= blk3).to(tl.int32)
        col_lo = tl.where(j == 0, 0, tl.where(j == 1, col1, tl.where(j == 2, col2, col3)))
        col_hi = tl.where(j == 0, col1, tl.where(j == 1, col2, tl.where(j == 2, col3, n_total)))
        blk_lo = tl.where(j == 0, 0, tl.where(j == 1, blk1, tl.where(j == 2, blk2, blk3)))
        m0 = pid_m * BLOCK_M
        n0 = col_lo + (pid_n - blk_lo) * BLOCK_N
        if COL_ALIGN > 1:
            n0 = tl.multiple_of(n0, COL_ALIGN)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_hi

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            for ki in range(k_tiles):
                a = x.load([m0, ki * BLOCK_K])
                wt = w.load([n0, ki * BLOCK_K])
                acc = tl.dot(a, wt.T, acc, input_precision=PRECISION)
        else:
            # clamp out-of-range rows/columns to a valid one instead of masking (masked out at the store)
            rows = tl.where(offs_m < num_tokens, offs_m, 0)
            cols = tl.where(n_mask, offs_n, 0)
            x_ptrs = x + rows.to(tl.int64)[:, None] * stride_xt + offs_k[None, :] * stride_xh
            w_ptrs = w + cols.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wh
            for ki in range(k_tiles):
                if EVEN_K:
                    a = tl.load(x_ptrs)
                    wt = tl.load(w_ptrs)
                else:
                    k_left = hidden - ki * BLOCK_K
                    a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                    wt = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
                acc = tl.dot(a, wt, acc, input_precision=PRECISION)
                x_ptrs += BLOCK_K * stride_xh
                w_ptrs += BLOCK_K * stride_wh

        if HAS_LORA:
            # the segments touching this tile's rows: one trip on the common path (no row straddles)
            seg_lo = tl.load(token_seg_ptr + m0)
            seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, num_tokens) - 1)
            for seg in range(seg_lo, seg_hi + 1):
                acc = _lora_segment(
                    acc, seg, j, offs_m, offs_n, n_mask, s_ptr, b_ptr,
                    seg_start_ptr, seg_len_ptr, seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, rank_dim,
                    stride_ss, stride_st, stride_sr, stride_bl, stride_bn, stride_br, BLOCK_R, PRECISION,
                )  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :] * stride_yn
        tl.store(
            y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < num_tokens)[:, None] & n_mask[None, :]
        )
