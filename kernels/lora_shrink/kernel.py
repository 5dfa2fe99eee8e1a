"""Segmented LoRA shrink: s[j, t, :rank] = x[t] · A[j, slot(t), :rank]ᵀ for up to 4 slices j at once.

One program owns BLOCK_M consecutive tokens and loops over the segments that touch them (usually one),
so the grid is cdiv(num_tokens, BLOCK_M) whatever the mix of request lengths. Rows of other segments are
masked to zero on load, which moves no bytes, so every segment's contribution lands in one accumulator
per slice and the tile is stored once. x is read once for all slices (the x tile stays in registers while
each slice's A tile is multiplied into its own accumulator).

`_lora_shrink_tma_kernel` does the same with x and A read through TMA descriptors (the default for the
scaled output at rank 64, where it measured faster on an H200); the two share the scale-and-store epilogue.
"""

import triton
import triton.language as tl


@triton.jit
def _segment(seg, seg_slot_ptr, slot_rank_ptr, seg_start_ptr, seg_len_ptr):
    """Segment seg's adapter slot (-1: none), its rank (0 without a slot) and its rows [start, end)."""
    slot = tl.load(seg_slot_ptr + seg)
    rank = tl.load(slot_rank_ptr + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    start = tl.load(seg_start_ptr + seg)
    return slot, rank, start, start + tl.load(seg_len_ptr + seg)


@triton.jit
def _scale_and_store(acc0, acc1, acc2, acc3, offs_m, offs_r, s_ptr, token_seg_ptr, seg_scale_ptr, num_tokens,
                     rank_dim, stride_ss, stride_st, stride_sr, NUM_SLICES: tl.constexpr,
                     SCALED: tl.constexpr):  # fmt: skip
    """Each slice's accumulator (× its row's segment scale when SCALED) into s; every row of the tile is
    written: zeros where no LoRA applies or r >= rank."""
    if SCALED:
        row_seg = tl.load(token_seg_ptr + tl.minimum(offs_m, num_tokens - 1))
        row_scale = tl.load(seg_scale_ptr + row_seg)[:, None]
        acc0 *= row_scale
        if NUM_SLICES > 1:
            acc1 *= row_scale
        if NUM_SLICES > 2:
            acc2 *= row_scale
        if NUM_SLICES > 3:
            acc3 *= row_scale
    s_ptrs = s_ptr + offs_m.to(tl.int64)[:, None] * stride_st + offs_r[None, :] * stride_sr
    s_mask = (offs_m < num_tokens)[:, None] & (offs_r < rank_dim)[None, :]
    out_ty = s_ptr.dtype.element_ty
    tl.store(s_ptrs, acc0.to(out_ty), mask=s_mask)
    if NUM_SLICES > 1:
        tl.store(s_ptrs + stride_ss, acc1.to(out_ty), mask=s_mask)
    if NUM_SLICES > 2:
        tl.store(s_ptrs + 2 * stride_ss, acc2.to(out_ty), mask=s_mask)
    if NUM_SLICES > 3:
        tl.store(s_ptrs + 3 * stride_ss, acc3.to(out_ty), mask=s_mask)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, hidden]
    a_ptr,  # [num_slices, max_loras, max_rank, hidden]
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32, or x's dtype when SCALED
    token_seg_ptr,  # [num_tokens] int32
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,  # [num_segments] int32
    seg_slot_ptr,  # [num_segments] int32
    seg_scale_ptr,  # [num_segments] fp32 (read only when SCALED)
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    hidden,
    rank_dim,
    stride_xt,
    stride_xh,
    stride_as,
    stride_al,
    stride_ar,
    stride_ah,
    stride_ss,
    stride_st,
    stride_sr,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SCALED: tl.constexpr,
    SPLIT: tl.constexpr,  # > 1: SPLIT programs per row block, one slice each (NUM_SLICES = 1); more programs
    # for small batches, x read SPLIT times (from L2: the programs of one row block run side by side)
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if SPLIT > 1:
        j = pid_m % SPLIT
        pid_m = pid_m // SPLIT
        a_ptr += j * stride_as
        s_ptr += j * stride_ss
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    seg_lo = tl.load(token_seg_ptr + m0)
    seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, num_tokens) - 1)

    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for seg in range(seg_lo, seg_hi + 1):
        slot, rank, start, end = _segment(seg, seg_slot_ptr, slot_rank_ptr, seg_start_ptr, seg_len_ptr)
        row_mask = (offs_m >= start) & (offs_m < end)
        r_mask = offs_r < rank
        # rank 0 / no LoRA: zero trips, nothing is loaded
        k_iters = tl.where(rank > 0, tl.cdiv(hidden, BLOCK_K), 0)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt + offs_k[None, :] * stride_xh
        # A tile is [BLOCK_K, BLOCK_R]: the transpose of A[slot]'s [rank, hidden] rows
        a_ptrs = (
            a_ptr
            + tl.maximum(slot, 0).to(tl.int64) * stride_al
            + offs_r[None, :] * stride_ar
            + offs_k[:, None] * stride_ah
        )
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

    _scale_and_store(acc0, acc1, acc2, acc3, offs_m, offs_r, s_ptr, token_seg_ptr, seg_scale_ptr, num_tokens,
                     rank_dim, stride_ss, stride_st, stride_sr, NUM_SLICES, SCALED)  # fmt: skip


@triton.jit
def _lora_shrink_tma_kernel(
    x_desc,  # [num_tokens, hidden] TensorDescriptor, block [BLOCK_M, BLOCK_K]
    a_desc,  # A [num_slices, max_loras, max_rank, hidden] viewed as [num_slices·max_loras·max_rank, hidden],
    # block [BLOCK_R, BLOCK_K]
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32, or x's dtype when SCALED
    token_seg_ptr,  # [num_tokens] int32
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,  # [num_segments] int32
    seg_slot_ptr,  # [num_segments] int32
    seg_scale_ptr,  # [num_segments] fp32 (read only when SCALED)
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    hidden,
    rank_dim,
    max_loras,
    max_rank,
    stride_ss,
    stride_st,
    stride_sr,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SCALED: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The shrink with x and A read through TMA descriptors (no address arithmetic or masks per element):
    rows past num_tokens and columns past hidden come back as zeros. Instead of masking x rows of other
    segments, each segment touching the row block runs the K loop on the whole tile and keeps only its own
    rows (a tile straddling two segments reads x twice; most tiles lie in one). A rows past the slot's rank
    (the next slot's, where BLOCK_R > max_rank) land in columns that are zeroed before the store."""
    pid_m = tl.program_id(0)
    j0 = 0
    if SPLIT > 1:
        j0 = pid_m % SPLIT
        pid_m = pid_m // SPLIT
        s_ptr += j0 * stride_ss
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    seg_lo = tl.load(token_seg_ptr + m0)
    seg_hi = tl.load(token_seg_ptr + tl.minimum(m0 + BLOCK_M, num_tokens) - 1)
    slice_rows = max_loras * max_rank

    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for seg in range(seg_lo, seg_hi + 1):
        slot, rank, start, end = _segment(seg, seg_slot_ptr, slot_rank_ptr, seg_start_ptr, seg_len_ptr)
        a_row = (j0 * max_loras + tl.maximum(slot, 0)) * max_rank
        p0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        p1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        p3 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        # rank 0 / no LoRA: zero trips, nothing is loaded
        for ki in range(tl.where(rank > 0, tl.cdiv(hidden, BLOCK_K), 0)):
            k0 = ki * BLOCK_K
            x = x_desc.load([m0, k0])
            p0 = tl.dot(x, a_desc.load([a_row, k0]).T, p0, input_precision=PRECISION)
            if NUM_SLICES > 1:
                p1 = tl.dot(x, a_desc.load([a_row + slice_rows, k0]).T, p1, input_precision=PRECISION)
            if NUM_SLICES > 2:
                p2 = tl.dot(x, a_desc.load([a_row + 2 * slice_rows, k0]).T, p2, input_precision=PRECISION)
            if NUM_SLICES > 3:
                p3 = tl.dot(x, a_desc.load([a_row + 3 * slice_rows, k0]).T, p3, input_precision=PRECISION)
        keep = ((offs_m >= start) & (offs_m < end))[:, None] & (offs_r < rank)[None, :]
        acc0 = tl.where(keep, p0, acc0)
        if NUM_SLICES > 1:
            acc1 = tl.where(keep, p1, acc1)
        if NUM_SLICES > 2:
            acc2 = tl.where(keep, p2, acc2)
        if NUM_SLICES > 3:
            acc3 = tl.where(keep, p3, acc3)

    _scale_and_store(acc0, acc1, acc2, acc3, offs_m, offs_r, s_ptr, token_seg_ptr, seg_scale_ptr, num_tokens,
                     rank_dim, stride_ss, stride_st, stride_sr, NUM_SLICES, SCALED)  # fmt: skip
