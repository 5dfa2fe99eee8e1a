"""Segmented LoRA shrink: s[j, t, :rank] = x[t] · A[j, slot(t), :rank]ᵀ for up to 4 slices j at once.

One program owns BLOCK_M consecutive tokens and loops over the segments that touch them (usually one),
so the grid is cdiv(num_tokens, BLOCK_M) whatever the mix of request lengths. Rows of other segments are
masked to zero on load, which moves no bytes, so every segment's contribution lands in one accumulator
per slice and the tile is stored once. x is read once for all slices (the x tile stays in registers while
each slice's A tile is multiplied into its own accumulator).

`_lora_shrink_tma_kernel` does the same with x and A read through TMA descriptors (one program per row block,
or per row block and slice); `_lora_shrink_streamk_kernel` and `_lora_shrink_wide_kernel` share the row
blocks' K steps evenly between a fixed number of programs (stream-K), the wide one with every slice's A tile
in one load and one dot. Which one a batch gets is op.py's `segmented_config`, from H200 measurements.
"""

import triton
import triton.language as tl

from ditserve.kernels._tiles import (
    a_tile_ptrs,
    row_segments,
    segment_rows,
    segment_slot,
    shrink_k_steps,
    store_slices,
    zero_slices,
)


@triton.jit
def _row_scales(token_seg_ptr, seg_scale_ptr, offs_m, num_tokens):
    """The scale of each row's segment (rows past num_tokens take the last row's)."""
    row_seg = tl.load(token_seg_ptr + tl.minimum(offs_m, num_tokens - 1))
    return tl.load(seg_scale_ptr + row_seg)


@triton.jit
def _scale_and_store(acc0, acc1, acc2, acc3, offs_m, offs_r, s_ptr, token_seg_ptr, seg_scale_ptr, num_tokens,
                     rank_dim, stride_ss, stride_st, stride_sr, NUM_SLICES: tl.constexpr,
                     SCALED: tl.constexpr):  # fmt: skip
    """Each slice's accumulator (× its row's segment scale when SCALED) into s; every row of the tile is
    written: zeros where no LoRA applies or r >= rank."""
    if SCALED:
        row_scale = _row_scales(token_seg_ptr, seg_scale_ptr, offs_m, num_tokens)[:, None]
        acc0 *= row_scale
        if NUM_SLICES > 1:
            acc1 *= row_scale
        if NUM_SLICES > 2:
            acc2 *= row_scale
        if NUM_SLICES > 3:
            acc3 *= row_scale
    s_ptrs = s_ptr + offs_m.to(tl.int64)[:, None] * stride_st + offs_r[None, :] * stride_sr
    s_mask = (offs_m < num_tokens)[:, None] & (offs_r < rank_dim)[None, :]
    store_slices(s_ptrs, s_mask, stride_ss, acc0, acc1, acc2, acc3, NUM_SLICES)


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
    seg_lo, seg_hi = row_segments(token_seg_ptr, m0, num_tokens, BLOCK_M)

    acc0, acc1, acc2, acc3 = zero_slices(BLOCK_M, BLOCK_R)
    for seg in range(seg_lo, seg_hi + 1):
        slot, rank = segment_slot(seg, seg_slot_ptr, slot_rank_ptr)
        row_mask = segment_rows(seg, seg_start_ptr, seg_len_ptr, offs_m)
        r_mask = offs_r < rank
        # rank 0 / no LoRA: zero trips, nothing is loaded
        k_iters = tl.where(rank > 0, tl.cdiv(hidden, BLOCK_K), 0)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt + offs_k[None, :] * stride_xh
        a_ptrs = a_tile_ptrs(a_ptr, slot, offs_r, offs_k, stride_al, stride_ar, stride_ah)
        acc0, acc1, acc2, acc3 = shrink_k_steps(
            acc0, acc1, acc2, acc3, x_ptrs, a_ptrs, row_mask, r_mask, k_iters, hidden, stride_xh, stride_as,
            stride_ah, NUM_SLICES, BLOCK_K, PRECISION,
        )  # fmt: skip

    _scale_and_store(acc0, acc1, acc2, acc3, offs_m, offs_r, s_ptr, token_seg_ptr, seg_scale_ptr, num_tokens,
                     rank_dim, stride_ss, stride_st, stride_sr, NUM_SLICES, SCALED)  # fmt: skip


@triton.jit
def _tma_dot(x, a_desc, a_row, k0, acc, keep, MASK_A: tl.constexpr, PRECISION: tl.constexpr):
    """acc += x · Aᵀ for the A tile at (a_row, k0); MASK_A: its rows outside keep read as zero."""
    a = a_desc.load([a_row, k0])
    if MASK_A:
        a = tl.where(keep, a, 0.0)
    return tl.dot(x, a.T, acc, input_precision=PRECISION)


@triton.jit
def _tma_dots(x, a_desc, a_row, slice_rows, k0, acc0, acc1, acc2, acc3, rank, MASK_A: tl.constexpr,
              NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """acc_j += x · A[j]ᵀ for the K tile at k0 of every slice j; MASK_A: A rows past rank read as zero."""
    keep = (tl.arange(0, BLOCK_R) < rank)[:, None]
    acc0 = _tma_dot(x, a_desc, a_row, k0, acc0, keep, MASK_A, PRECISION)
    if NUM_SLICES > 1:
        acc1 = _tma_dot(x, a_desc, a_row + slice_rows, k0, acc1, keep, MASK_A, PRECISION)
    if NUM_SLICES > 2:
        acc2 = _tma_dot(x, a_desc, a_row + 2 * slice_rows, k0, acc2, keep, MASK_A, PRECISION)
    if NUM_SLICES > 3:
        acc3 = _tma_dot(x, a_desc, a_row + 3 * slice_rows, k0, acc3, keep, MASK_A, PRECISION)
    return acc0, acc1, acc2, acc3


@triton.jit
def _tma_partial(x_desc, a_desc, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, num_tokens,
                 m0, j0, k_lo, k_hi, max_loras, max_rank, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """x[m0 : m0 + BLOCK_M] · A[j0 + j, slot(row)]ᵀ over the K tiles [k_lo, k_hi), one fp32 accumulator per
    slice j; zero past a row's rank. A row block inside one segment (the common case) runs the plain K loop;
    one that straddles segments runs it once per segment with the x rows of other segments and the A rows
    past the segment's rank zeroed in registers (A rows past a rank belong to the next slot)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    seg_lo, seg_hi = row_segments(token_seg_ptr, m0, num_tokens, BLOCK_M)
    slice_rows = max_loras * max_rank
    acc0, acc1, acc2, acc3 = zero_slices(BLOCK_M, BLOCK_R)
    if seg_lo == seg_hi:
        slot, rank = segment_slot(seg_lo, seg_slot_ptr, slot_rank_ptr)
        a_row = (j0 * max_loras + tl.maximum(slot, 0)) * max_rank
        # rank 0 / no LoRA: zero trips, nothing is loaded
        for ki in range(k_lo, tl.where(rank > 0, k_hi, k_lo)):
            acc0, acc1, acc2, acc3 = _tma_dots(
                x_desc.load([m0, ki * BLOCK_K]), a_desc, a_row, slice_rows, ki * BLOCK_K, acc0, acc1, acc2, acc3,
                rank, False, NUM_SLICES, BLOCK_R, PRECISION,
            )  # fmt: skip
        keep = (offs_r < rank)[None, :]
        acc0 = tl.where(keep, acc0, 0.0)
        acc1 = tl.where(keep, acc1, 0.0)
        acc2 = tl.where(keep, acc2, 0.0)
        acc3 = tl.where(keep, acc3, 0.0)
    else:
        for seg in range(seg_lo, seg_hi + 1):
            slot, rank = segment_slot(seg, seg_slot_ptr, slot_rank_ptr)
            rows = segment_rows(seg, seg_start_ptr, seg_len_ptr, offs_m)[:, None]
            a_row = (j0 * max_loras + tl.maximum(slot, 0)) * max_rank
            for ki in range(k_lo, tl.where(rank > 0, k_hi, k_lo)):
                x = tl.where(rows, x_desc.load([m0, ki * BLOCK_K]), 0.0)
                acc0, acc1, acc2, acc3 = _tma_dots(
                    x, a_desc, a_row, slice_rows, ki * BLOCK_K, acc0, acc1, acc2, acc3, rank, True, NUM_SLICES,
                    BLOCK_R, PRECISION,
                )  # fmt: skip
    return acc0, acc1, acc2, acc3


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
    rows past num_tokens and columns past hidden come back as zeros; one program per row block (and slice,
    SPLIT). A rows past the slot's rank (the next slot's, where BLOCK_R > max_rank) land in columns that
    are zeroed before the store."""
    pid_m = tl.program_id(0)
    j0 = 0
    if SPLIT > 1:
        j0 = pid_m % SPLIT
        pid_m = pid_m // SPLIT
        s_ptr += j0 * stride_ss
    m0 = pid_m * BLOCK_M
    acc0, acc1, acc2, acc3 = _tma_partial(
        x_desc, a_desc, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, num_tokens,
        m0, j0, 0, tl.cdiv(hidden, BLOCK_K), max_loras, max_rank, NUM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R,
        PRECISION,
    )  # fmt: skip
    _scale_and_store(acc0, acc1, acc2, acc3, m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_R), s_ptr,
                     token_seg_ptr, seg_scale_ptr, num_tokens, rank_dim, stride_ss, stride_st, stride_sr,
                     NUM_SLICES, SCALED)  # fmt: skip


@triton.jit
def _tail_add(ws, acc):
    """ws += acc with fp32 atomics (a piece of a tail unit)."""
    tl.atomic_add(ws, acc, sem="relaxed")


@triton.jit
def _tail_take(ws):
    """The summed tile, read from L2 (not through L1, which other SMs' atomics do not reach); ws is left
    zeroed for the next launch."""
    tile = tl.load(ws, cache_modifier=".cg")
    tl.store(ws, tl.zeros_like(tile))
    return tile


@triton.jit
def _stream_piece(it, it_end, k_tiles, BLOCK_M: tl.constexpr):
    """A stream-K program at step it of its range [it, it_end): the row block u it is in, the K tiles [k_lo,
    k_hi) of u the program takes there, and u's first row."""
    u = it // k_tiles
    k_lo = it - u * k_tiles
    k_hi = tl.minimum(k_tiles, k_lo + it_end - it)
    return u, k_lo, k_hi, u * BLOCK_M


@triton.jit
def _lora_shrink_streamk_kernel(
    x_desc,  # as in _lora_shrink_tma_kernel
    a_desc,
    s_ptr,
    token_seg_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    seg_scale_ptr,
    slot_rank_ptr,
    ws_ptr,  # [≥ num_programs, NUM_SLICES, BLOCK_M, BLOCK_R] fp32, zero between launches: tail unit sums
    cnt_ptr,  # [≥ num_programs] int32, zero between launches: K steps summed into each tail unit so far
    num_tokens,
    hidden,
    rank_dim,
    max_loras,
    max_rank,
    stride_ss,
    stride_st,
    stride_sr,
    num_programs,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Data-parallel waves, then stream-K over the rest. A unit is a row block, every slice in one program (x
    read once). The first (units // num_programs) · num_programs units go round-robin, one whole unit per
    program at a time; the K steps of the remaining units are cut into num_programs equal contiguous
    ranges, so the last wave does not leave SMs idle (144 row blocks of 128 tokens on 132 programs would
    otherwise end in a wave of 12). A tail unit cut between programs is summed in ws with fp32 atomics; the program whose K steps complete the unit's count (cnt)
    reads the sum, stores s, and zeroes ws and cnt for the next launch, so nothing waits for anything."""
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(hidden, BLOCK_K)
    units = tl.cdiv(num_tokens, BLOCK_M)
    dp_units = (units // num_programs) * num_programs
    tail_its = (units - dp_units) * k_tiles
    offs_r = tl.arange(0, BLOCK_R)
    tile: tl.constexpr = BLOCK_M * BLOCK_R
    ws_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + offs_r[None, :]
    it = dp_units * k_tiles + (pid * tail_its) // num_programs
    it_end = dp_units * k_tiles + ((pid + 1) * tail_its) // num_programs
    for u in range(pid, dp_units, num_programs):
        m0 = u * BLOCK_M
        acc0, acc1, acc2, acc3 = _tma_partial(
            x_desc, a_desc, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, num_tokens,
            m0, 0, 0, k_tiles, max_loras, max_rank, NUM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, PRECISION,
        )  # fmt: skip
        _scale_and_store(acc0, acc1, acc2, acc3, m0 + tl.arange(0, BLOCK_M), offs_r, s_ptr,
                         token_seg_ptr, seg_scale_ptr, num_tokens, rank_dim, stride_ss, stride_st, stride_sr,
                         NUM_SLICES, SCALED)  # fmt: skip
    while it < it_end:
        u, k_lo, k_hi, m0 = _stream_piece(it, it_end, k_tiles, BLOCK_M)
        acc0, acc1, acc2, acc3 = _tma_partial(
            x_desc, a_desc, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, num_tokens,
            m0, 0, k_lo, k_hi, max_loras, max_rank, NUM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, PRECISION,
        )  # fmt: skip
        finish = True
        if (k_lo > 0) | (k_hi < k_tiles):
            t = u - dp_units
            ws = ws_ptr + t * (NUM_SLICES * tile) + ws_offs
            _tail_add(ws, acc0)
            if NUM_SLICES > 1:
                _tail_add(ws + tile, acc1)
            if NUM_SLICES > 2:
                _tail_add(ws + 2 * tile, acc2)
            if NUM_SLICES > 3:
                _tail_add(ws + 3 * tile, acc3)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + t, k_hi - k_lo, sem="acq_rel") + (k_hi - k_lo)
            finish = done == k_tiles
            if finish:  # the last piece: take the sum, leave zeros for the next launch
                acc0 = _tail_take(ws)
                if NUM_SLICES > 1:
                    acc1 = _tail_take(ws + tile)
                if NUM_SLICES > 2:
                    acc2 = _tail_take(ws + 2 * tile)
                if NUM_SLICES > 3:
                    acc3 = _tail_take(ws + 3 * tile)
                tl.atomic_xchg(cnt_ptr + t, 0)
        if finish:
            _scale_and_store(acc0, acc1, acc2, acc3, m0 + tl.arange(0, BLOCK_M), offs_r, s_ptr,
                             token_seg_ptr, seg_scale_ptr, num_tokens, rank_dim, stride_ss, stride_st, stride_sr,
                             NUM_SLICES, SCALED)  # fmt: skip
        it = u * k_tiles + k_hi


@triton.jit
def _wide_partial(x_desc, a_desc, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr,
                  num_tokens, m0, k_lo, k_hi, max_rank, SL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """x[m0 : m0 + BLOCK_M] · [A[0, slot]; A[1, slot]; ...]ᵀ over the K tiles [k_lo, k_hi) as one dot: the A
    tiles of all slices come in one [SL, BLOCK_R, BLOCK_K] load (slices past the last read as zeros), so x
    is read from shared memory once per K step and the tensor cores see one wide N. Column c of the
    result is slice c // BLOCK_R, rank c % BLOCK_R; zero past a row's rank (straddling row blocks as in
    _tma_partial, with x rows of other segments zeroed in registers)."""
    N: tl.constexpr = SL * BLOCK_R
    offs_m = m0 + tl.arange(0, BLOCK_M)
    r_of_c = tl.arange(0, N) % BLOCK_R
    seg_lo, seg_hi = row_segments(token_seg_ptr, m0, num_tokens, BLOCK_M)
    acc = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    if seg_lo == seg_hi:
        slot, rank = segment_slot(seg_lo, seg_slot_ptr, slot_rank_ptr)
        a_row = tl.maximum(slot, 0) * max_rank
        # rank 0 / no LoRA: zero trips, nothing is loaded
        for ki in range(k_lo, tl.where(rank > 0, k_hi, k_lo)):
            a = tl.reshape(a_desc.load([0, a_row, ki * BLOCK_K]), (N, BLOCK_K))
            acc = tl.dot(x_desc.load([m0, ki * BLOCK_K]), a.T, acc, input_precision=PRECISION)
        acc = tl.where((r_of_c < rank)[None, :], acc, 0.0)
    else:
        for seg in range(seg_lo, seg_hi + 1):
            slot, rank = segment_slot(seg, seg_slot_ptr, slot_rank_ptr)
            rows = segment_rows(seg, seg_start_ptr, seg_len_ptr, offs_m)[:, None]
            a_row = tl.maximum(slot, 0) * max_rank
            for ki in range(k_lo, tl.where(rank > 0, k_hi, k_lo)):
                a = tl.reshape(a_desc.load([0, a_row, ki * BLOCK_K]), (N, BLOCK_K))
                a = tl.where((r_of_c < rank)[:, None], a, 0.0)
                x = tl.where(rows, x_desc.load([m0, ki * BLOCK_K]), 0.0)
                acc = tl.dot(x, a.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _lora_shrink_wide_kernel(
    x_desc,  # [num_tokens, hidden] TensorDescriptor, block [BLOCK_M, BLOCK_K]
    a_desc,  # A [num_slices, max_loras·max_rank, hidden] TensorDescriptor, block [SL, BLOCK_R, BLOCK_K]
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32, or x's dtype when SCALED
    token_seg_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    seg_scale_ptr,
    slot_rank_ptr,
    ws_ptr,  # [num_programs, BLOCK_M, SL · BLOCK_R] fp32: one partial tile per boundary between programs
    sync_ptr,  # [≥ 2 · num_programs] int32, zero when first allocated: per boundary, pieces arrived (+2 a
    # launch) and partial tiles left in ws (+1 a launch)
    num_tokens,
    hidden,
    rank_dim,
    max_rank,
    stride_ss,
    stride_st,
    stride_sr,
    num_programs,
    NUM_SLICES: tl.constexpr,
    SL: tl.constexpr,  # NUM_SLICES rounded up to a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Stream-K over row blocks, every slice in one wide dot (_wide_partial): the K steps of all row blocks
    are cut into num_programs equal contiguous ranges. A row block cut between programs p and p + 1 is
    finished by whichever of the two gets there second: the first leaves its fp32 partial tile in ws and
    counts it in sync; the second (which waits only for a program already past its arrival, so it cannot
    deadlock) adds it to its own and stores. The counters grow by fixed amounts each launch (two arrivals,
    one tile), so they never need zeroing."""
    N: tl.constexpr = SL * BLOCK_R
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(hidden, BLOCK_K)
    total = tl.cdiv(num_tokens, BLOCK_M) * k_tiles
    it = (pid * total) // num_programs
    it_end = ((pid + 1) * total) // num_programs
    offs_c = tl.arange(0, N)
    ws_offs = tl.arange(0, BLOCK_M)[:, None] * N + offs_c[None, :]
    while it < it_end:
        u, k_lo, k_hi, m0 = _stream_piece(it, it_end, k_tiles, BLOCK_M)
        acc = _wide_partial(
            x_desc, a_desc, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, num_tokens,
            m0, k_lo, k_hi, max_rank, SL, BLOCK_M, BLOCK_K, BLOCK_R, PRECISION,
        )  # fmt: skip
        finish = True
        if (k_lo > 0) | (k_hi < k_tiles):
            b = tl.where(k_lo == 0, pid, pid - 1)
            ws = ws_ptr + b * (BLOCK_M * N) + ws_offs
            arrived = tl.atomic_add(sync_ptr + 2 * b, 1, sem="acq_rel")
            if arrived % 2 == 0:
                tl.store(ws, acc)
                tl.debug_barrier()
                tl.atomic_add(sync_ptr + 2 * b + 1, 1, sem="release")
                finish = False
            else:
                left = tl.atomic_add(sync_ptr + 2 * b + 1, 0, sem="acquire")
                while left <= arrived // 2:
                    left = tl.atomic_add(sync_ptr + 2 * b + 1, 0, sem="acquire")
                acc += tl.load(ws, cache_modifier=".cg")
        if finish:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            if SCALED:
                acc *= _row_scales(token_seg_ptr, seg_scale_ptr, offs_m, num_tokens)[:, None]
            j = offs_c // BLOCK_R
            r = offs_c % BLOCK_R
            s_ptrs = (
                s_ptr + offs_m.to(tl.int64)[:, None] * stride_st + (j * stride_ss + r * stride_sr)[None, :]
            )
            mask = (offs_m < num_tokens)[:, None] & ((j < NUM_SLICES) & (r < rank_dim))[None, :]
            tl.store(s_ptrs, acc.to(s_ptr.dtype.element_ty), mask=mask)
        it = u * k_tiles + k_hi
