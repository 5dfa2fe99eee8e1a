"""Base GEMM with the segmented LoRA expand fused in:

    y[t, n] = Σ_k x[t, k] · W[n, k] (+ bias[n]) + scale(t) · Σ_r s[j(n), t, r] · B[slot(t), n, r]

One program per SM (persistent) walks output tiles in grouped order: GROUP_M row blocks share each column
block, so the W columns a group needs stay in L2 while its x rows stream through. Column blocks are cut
per output slice (as in lora_expand), so a tile knows its slice j and never mixes two.

Where the LoRA term is added (LORA_IN_LOOP, needs s pre-scaled in W's dtype, as `lora_shrink(...,
scaled=True)` writes it): the K loop runs k_tiles + r_tiles iterations, the last r_tiles of which take the
A operand from s[j] (rows m0.., columns (ki - k_tiles)·BLOCK_K..) and the B operand from B[slot] instead of
x and W. The LoRA tiles are then loaded by the same pipeline as the base GEMM's (no exposed latency per
tile) and the LoRA FLOPs ride the same tensor-core loop. r_tiles is the same for every tile, so the tile
and K loops still flatten into one loop (FLATTEN: the next tile's loads overlap this tile's epilogue); a
tile that lies in one segment without LoRA reads nothing there (TMA coordinates past the end come back as
zeros; pointer loads are masked off). Tiles whose rows straddle segments (at most one row block per
request boundary) add their LoRA terms after the K loop, segment by segment (`_lora_epilogue`, rows of
other segments masked). That epilogue has loops of its own, which keep Triton from flattening the tile
loop; with STRADDLE=False (every segment starts at a multiple of BLOCK_M, `LoRABatchMeta.seg_align`) it is
compiled out, and the launcher's tuned config flattens only such batches. Columns of s past a slot's rank
must be zero (the shrink writes them so) and B finite there (slot buffers are zero past the rank).

TMA_STORE: y leaves through a TMA store (in one or two column pieces), which needs slices that are whole
multiples of BLOCK_N; rows past num_tokens are clipped by the descriptor.

LORA_AFTER (TMA, a pre-scaled s): the K loop reads only x and W, exactly as without LoRA, and a second
short loop of cdiv(lora_k, LORA_BK) iterations reads s[j] and B[slot] for tiles inside one segment with an
adapter. The main loop keeps its operands fixed (choosing between two descriptors inside the loop may cost
the pipelining of every iteration), and the LoRA loop is LORA_BK (≥ 16) wide, not BLOCK_K: a rank-16 adapter
costs one 16-wide dot per tile, not a 64-wide one. Its loads are not overlapped with the main loop's.

Otherwise (s in fp32, not scaled) every tile adds the LoRA term after the K loop in `_lora_epilogue`.

The K loop reads x and W (and s, B) through pointers (runs in the interpreter and everywhere) or through
TMA tensor descriptors (USE_TMA: host-built `TensorDescriptor`s, out-of-range rows come back as zeros).

SHRINK_IN (TMA, LORA_IN_LOOP, no straddling row blocks): the launch computes s itself, s[g, rows of row
block rb] = scale · x · A[g, slot]ᵀ for every slice g of a_desc (≥ the output slices: a group of linears
on one input shares it), instead of reading one a separate shrink kernel wrote. A persistent grid of P
programs over T tiles gives T mod P of them one tile more than the others; those start their first tile
at once (its K loop needs no s) and wait for that tile's shrink units only before its LoRA iteration. All
the other programs first shrink: units (SHRINK_M rows of every slice in one dot where slices × rank ≤ 256,
else of one slice; 128-column K steps where they fit) are claimed in order from an atomic counter, so
a program only ever waits for a unit another running program has claimed (no deadlock, whatever the
number of resident programs, and the interpreter's one-after-another programs shrink everything the
first one needs). Each unit raises its flag (release) after its stores; before its tile loop every
program claims what is left and waits until every unit is done (acquire), then fences the async proxy (s
was stored through the generic proxy and is read through TMA). The tile loop itself is the one above. So
the shrink's HBM-bound work goes into the slots the last round of tiles leaves idle (how much of it fits
there: docs/notes/benchmarks-log.md).
"""

import triton
import triton.language as tl

from ditserve.kernels._tiles import row_segments, segment_slot, segment_span, slice_columns


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
def _tile_geometry(tile_id, num_pid_m, num_col_blocks, num_tokens, col1, col2, col3, n_total, blk1, blk2, blk3,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                   COL_ALIGN: tl.constexpr):  # fmt: skip
    """Output tile tile_id: its row block pid_m, slice j, first row m0 and column n0, row and column offsets,
    the column mask (the tile never leaves slice j), and rows/columns clamped to valid ones instead of
    masked (masked out at the store)."""
    pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_col_blocks, GROUP_M)
    j, n0, col_hi = slice_columns(pid_n, col1, col2, col3, n_total, blk1, blk2, blk3, BLOCK_N)
    m0 = pid_m * BLOCK_M
    if COL_ALIGN > 1:
        n0 = tl.multiple_of(n0, COL_ALIGN)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_hi
    rows = tl.where(offs_m < num_tokens, offs_m, 0).to(tl.int64)
    cols = tl.where(n_mask, offs_n, 0).to(tl.int64)
    return pid_m, j, m0, n0, offs_m, offs_n, n_mask, rows, cols


@triton.jit
def _tma_k_tiles(ki, k_tiles, x, w, s_desc, b_desc, m0, n0, s_row, b_row, BLOCK_K: tl.constexpr,
                 LORA_IN_LOOP: tl.constexpr):  # fmt: skip
    """The two operand tiles of iteration ki of a TMA K loop: x and W for the first k_tiles iterations, then
    (LORA_IN_LOOP) s[j] rows s_row.. and B[slot] rows b_row.. for the LoRA iterations."""
    if LORA_IN_LOOP:
        if ki < k_tiles:
            a_desc = x
            w_desc = w
            a_row = m0
            w_row = n0
            kk = ki * BLOCK_K
        else:
            a_desc = s_desc
            w_desc = b_desc
            a_row = s_row
            w_row = b_row
            kk = (ki - k_tiles) * BLOCK_K
        a = a_desc.load([a_row, kk])
        wt = w_desc.load([w_row, kk])
    else:
        a = x.load([m0, ki * BLOCK_K])
        wt = w.load([n0, ki * BLOCK_K])
    return a, wt


@triton.jit
def _lora_loop(acc, s_desc, b_desc, s_row, b_row, lora_k, LORA_BK: tl.constexpr, PRECISION: tl.constexpr):
    """acc += s[s_row.., :lora_k] · B[b_row.., :lora_k]ᵀ through TMA, LORA_BK rank columns per dot (a loop of
    its own after a tile's K loop)."""
    for ri in tl.range(0, tl.cdiv(lora_k, LORA_BK), num_stages=1):
        a = s_desc.load([s_row, ri * LORA_BK])
        wt = b_desc.load([b_row, ri * LORA_BK])
        acc = tl.dot(a, wt.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _lora_epilogue(acc, seg_lo, seg_hi, j, offs_m, offs_n, n_mask, s_ptr, b_ptr, seg_start_ptr, seg_len_ptr,
                   seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, rank_dim, stride_ss, stride_st, stride_sr,
                   stride_bl, stride_bn, stride_br, R_CHUNK: tl.constexpr, S_SCALED: tl.constexpr,
                   PRECISION: tl.constexpr):  # fmt: skip
    """acc += scale · s[j, rows of seg, :rank] · B[slot, offs_n, :rank]ᵀ for every segment seg_lo..seg_hi;
    rows of other segments load as 0. R_CHUNK rank columns per dot keep the s and B tiles small (few
    registers next to the accumulator)."""
    offs_c = tl.arange(0, R_CHUNK)
    for seg in range(seg_lo, seg_hi + 1):
        slot, rank = segment_slot(seg, seg_slot_ptr, slot_rank_ptr)
        rank = tl.minimum(rank, rank_dim)
        start, end = segment_span(seg, seg_start_ptr, seg_len_ptr)
        scale = tl.load(seg_scale_ptr + seg)
        row_mask = (offs_m >= start) & (offs_m < end)
        s_rows = s_ptr + j * stride_ss + offs_m.to(tl.int64)[:, None] * stride_st
        b_cols = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn
        # rank 0 / no LoRA: zero trips, nothing is loaded
        for r0 in range(0, rank, R_CHUNK):
            offs_r = r0 + offs_c
            r_mask = offs_r < rank
            s = tl.load(
                s_rows + offs_r[None, :] * stride_sr, mask=row_mask[:, None] & r_mask[None, :], other=0.0
            )
            b = tl.load(
                b_cols + offs_r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0
            )
            if S_SCALED:
                a = s.to(b.dtype)
            else:
                a = (s.to(tl.float32) * scale).to(b.dtype)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _store_tile(acc, y_ptr, y_desc, bias_ptr, m0, n0, offs_m, offs_n, n_mask, num_tokens, stride_yt, stride_yn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, TMA_STORE: tl.constexpr,
                EPI_SUBTILE: tl.constexpr):  # fmt: skip
    """y tile = acc (+ bias), in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = acc.to(y_ptr.dtype.element_ty)
    if TMA_STORE:
        # rows past num_tokens are clipped by the descriptor; the tile never crosses a slice
        if EPI_SUBTILE == 2:
            lo, hi = tl.split(tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            y_desc.store([m0, n0], lo)
            y_desc.store([m0, n0 + BLOCK_N // 2], hi)
        else:
            y_desc.store([m0, n0], out)
    else:
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, out, mask=(offs_m < num_tokens)[:, None] & n_mask[None, :])


@triton.jit
def _shrink_unit(u, xs, a_desc, s_ptr, token_seg_ptr, seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, num_tokens,
                 hidden, shrink_slices, max_loras, a_rows, s_cols, stride_ss, stride_st, stride_sr,
                 SHRINK_M: tl.constexpr, SHRINK_K: tl.constexpr, SHRINK_R: tl.constexpr, WIDE_G: tl.constexpr,
                 SHRINK_STAGES: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Shrink unit u: s[g, rows, :s_cols] = scale · x[rows] · A[g, slot, :rank]ᵀ for SHRINK_M rows (one
    segment's), zeros past the rank and for rows without an adapter. WIDE_G > 1: u is a row block and one
    dot per K step covers every slice (A through a 3-D box [WIDE_G, SHRINK_R, SHRINK_K], slices past the last
    read as zeros); WIDE_G == 1: u = (row block, slice)."""
    if WIDE_G > 1:
        rb = u
        g0 = 0
    else:
        rb = u // shrink_slices
        g0 = u - rb * shrink_slices
    m0 = rb * SHRINK_M
    seg = tl.load(token_seg_ptr + m0)
    slot, rank = segment_slot(seg, seg_slot_ptr, slot_rank_ptr)
    offs_m = m0 + tl.arange(0, SHRINK_M)
    offs_c = tl.arange(0, WIDE_G * SHRINK_R)
    acc = tl.zeros((SHRINK_M, WIDE_G * SHRINK_R), dtype=tl.float32)
    if rank > 0:
        for ki in tl.range(0, tl.cdiv(hidden, SHRINK_K), num_stages=SHRINK_STAGES):
            xt = xs.load([m0, ki * SHRINK_K])
            if WIDE_G > 1:
                at = tl.reshape(a_desc.load([0, slot * a_rows, ki * SHRINK_K]), (WIDE_G * SHRINK_R, SHRINK_K))
            else:
                at = a_desc.load([(g0 * max_loras + slot) * a_rows, ki * SHRINK_K])
            acc = tl.dot(xt, at.T, acc, input_precision=PRECISION)
        acc = acc * tl.load(seg_scale_ptr + seg)
    g = g0 + offs_c // SHRINK_R
    r = offs_c % SHRINK_R
    # A rows past the rank belong to the next slot (or are zeros): drop them
    acc = tl.where(r[None, :] < rank, acc, 0.0)
    s_ptrs = s_ptr + g.to(tl.int64)[None, :] * stride_ss + offs_m.to(tl.int64)[:, None] * stride_st
    s_ptrs += r[None, :] * stride_sr
    tl.store(s_ptrs, acc.to(s_ptr.dtype.element_ty),
             mask=(offs_m < num_tokens)[:, None] & ((r < s_cols) & (g < shrink_slices))[None, :])  # fmt: skip


@triton.jit
def _shrink_claimed(need, num_units, sync_ptr, xs, a_desc, s_ptr, token_seg_ptr, seg_slot_ptr, seg_scale_ptr,
                    slot_rank_ptr, num_tokens, hidden, shrink_slices, max_loras, a_rows, s_cols, stride_ss,
                    stride_st, stride_sr, SHRINK_M: tl.constexpr, SHRINK_K: tl.constexpr, SHRINK_R: tl.constexpr,
                    WIDE_G: tl.constexpr, SHRINK_STAGES: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Claim shrink units in order and run them until one at or past `need` is claimed (need = num_units - 1:
    until none is left). sync_ptr: a flag per unit, then the claim counter, then the done counter."""
    claim_ptr = sync_ptr + num_units
    go = tl.atomic_add(claim_ptr, 0, sem="relaxed", scope="gpu") <= need
    while go:
        u = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
        if u < num_units:
            _shrink_unit(u, xs, a_desc, s_ptr, token_seg_ptr, seg_slot_ptr, seg_scale_ptr, slot_rank_ptr,
                         num_tokens, hidden, shrink_slices, max_loras, a_rows, s_cols, stride_ss, stride_st,
                         stride_sr, SHRINK_M, SHRINK_K, SHRINK_R, WIDE_G, SHRINK_STAGES, PRECISION)  # fmt: skip
            tl.debug_barrier()  # every thread's s stores precede the release
            tl.atomic_xchg(sync_ptr + u, 1, sem="release", scope="gpu")
            tl.atomic_add(claim_ptr + 1, 1, sem="release", scope="gpu")
        go = u < need


@triton.jit
def _fence_proxy_async(dummy, FENCE: tl.constexpr):
    """Generic-proxy writes seen through an acquire become visible to this thread's TMA (async-proxy) reads
    (FENCE False: the interpreter, which has no proxies)."""
    if FENCE:
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.b32 $0, $1;",
            "=r,r",
            [dummy],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


# index arguments that only steer the tile walk are not specialised on (divisibility by 16 would compile
# another variant for every slice layout / grid size)
@triton.jit(do_not_specialize=["rank_dim", "blk1", "blk2", "blk3", "num_col_blocks", "num_programs"])
def _lora_gemm_kernel(
    x,  # [num_tokens, hidden]: a pointer, or a TensorDescriptor with block [BLOCK_M, BLOCK_K] (USE_TMA)
    w,  # [n_total, hidden]: a pointer, or a TensorDescriptor with block [BLOCK_N, BLOCK_K] (USE_TMA)
    s_desc,  # USE_TMA and LORA_IN_LOOP: s viewed as [num_slices·num_tokens, s_cols], block [BLOCK_M, BLOCK_K]
    b_desc,  # USE_TMA and LORA_IN_LOOP: B viewed as [max_loras·n_total, lora_k], block [BLOCK_N, BLOCK_K]
    y_ptr,  # [num_tokens, n_total], written once
    y_desc,  # TMA_STORE: y as a TensorDescriptor with block [BLOCK_M, BLOCK_N // EPI_SUBTILE]
    bias_ptr,  # [n_total] (read only when HAS_BIAS)
    s_ptr,  # [num_slices, num_tokens, s_cols] fp32 or W's dtype (read only when HAS_LORA)
    b_ptr,  # [max_loras, n_total, max_rank]
    token_seg_ptr,  # [num_tokens] int32
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,  # [num_segments] int32
    seg_slot_ptr,  # [num_segments] int32
    seg_scale_ptr,  # [num_segments] fp32
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    hidden,
    rank_dim,  # rank columns the epilogue reads (≤ s_cols)
    lora_k,  # rank columns the LoRA iterations of the K loop read: min(s_cols, max_rank)
    col1,  # first column of slice 1 (= n_total when absent), likewise col2, col3
    col2,
    col3,
    n_total,
    blk1,  # first column block of slice 1 (= num_col_blocks when absent), likewise blk2, blk3
    blk2,
    blk3,
    num_col_blocks,
    num_programs,  # grid size: number of SMs (persistent) or number of tiles
    s_rows_total,  # rows of s_desc (num_slices · num_tokens): a row coordinate past every row
    b_rows_total,  # rows of b_desc (max_loras · n_total)
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
    xs,  # SHRINK_IN: x as a TensorDescriptor with block [SHRINK_M, SHRINK_K]
    a_desc,  # SHRINK_IN: A as [shrink_slices, max_loras · a_rows, hidden], block [WIDE_G, SHRINK_R, SHRINK_K]
    # (WIDE_G > 1), or as [shrink_slices · max_loras · a_rows, hidden], block [SHRINK_R, SHRINK_K]
    sync_ptr,  # SHRINK_IN: int32 [shrink units + 2], zero at launch (see _shrink_claimed)
    shrink_slices,  # SHRINK_IN: slices of s the launch computes (≥ the output slices)
    max_loras,
    a_rows,  # rows of A per (slice, slot): its max rank
    s_cols,  # columns of s
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R_CHUNK: tl.constexpr,  # rank columns per dot in the epilogue
    GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,  # flatten the tile and K loops into one pipelined loop (epilogue overlaps loads)
    EVEN_K: tl.constexpr,  # hidden % BLOCK_K == 0: no K masks (pointer path without LORA_IN_LOOP)
    COL_ALIGN: tl.constexpr,  # every slice boundary is a multiple of this (vectorised y/bias access)
    HAS_LORA: tl.constexpr,
    LORA_IN_LOOP: tl.constexpr,  # LoRA iterations in the K loop (s pre-scaled in W's dtype)
    STRADDLE: tl.constexpr,  # some row block may hold two segments (False: every segment starts at a
    # multiple of BLOCK_M, the pass over straddling tiles is left out)
    LORA_AFTER: tl.constexpr,  # USE_TMA: LoRA iterations in a loop of their own after the K loop (s pre-scaled)
    LORA_BK: tl.constexpr,  # rank columns per LoRA iteration with LORA_AFTER
    S_SCALED: tl.constexpr,  # s already holds scale · x · Aᵀ
    HAS_BIAS: tl.constexpr,
    TMA_STORE: tl.constexpr,  # y through a TMA store (every slice a multiple of BLOCK_N wide)
    EPI_SUBTILE: tl.constexpr,  # TMA_STORE in this many column pieces (less shared memory for the store)
    SHRINK_IN: tl.constexpr,  # the launch computes s itself (see the module docstring)
    SHRINK_R: tl.constexpr,  # SHRINK_IN: rank columns per slice of a shrink unit (a power of two ≥ s_cols)
    SHRINK_M: tl.constexpr,  # SHRINK_IN: rows per shrink unit (divides BLOCK_M)
    SHRINK_K: tl.constexpr,  # SHRINK_IN: hidden columns per step of the shrink's K loop
    WIDE_G: tl.constexpr,  # SHRINK_IN: slices per shrink unit (1, or every slice rounded up to a power of two)
    SHRINK_STAGES: tl.constexpr,  # SHRINK_IN: pipeline stages of the shrink's K loop
    FENCE: tl.constexpr,  # SHRINK_IN on a GPU: fence the async proxy before TMA reads of s
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_tokens, BLOCK_M)
    num_tiles = num_pid_m * num_col_blocks
    k_tiles = tl.cdiv(hidden, BLOCK_K)
    n_iters = k_tiles
    if LORA_IN_LOOP:
        n_iters += tl.cdiv(lora_k, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    # the per-segment LoRA epilogue after the K loop: for every tile (s unscaled), or only for tiles whose rows
    # straddle segments (LoRA iterations in or after the K loop, rows that may hold two segments)
    EPILOGUE_ALL: tl.constexpr = HAS_LORA and not LORA_IN_LOOP and not LORA_AFTER
    EPILOGUE_STRADDLE: tl.constexpr = LORA_AFTER or (LORA_IN_LOOP and STRADDLE)
    tile_start = pid
    if SHRINK_IN:
        UNITS_PER_BLOCK: tl.constexpr = BLOCK_M // SHRINK_M  # shrink row blocks per tile row block
        num_units = tl.cdiv(num_tokens, SHRINK_M)
        if WIDE_G == 1:
            num_units *= shrink_slices
        if pid < num_tiles % num_programs:
            # one tile more than the others: the first one starts at once, s is needed only at its end
            pid_m, j, m0, n0, offs_m, offs_n, n_mask, rows, cols = _tile_geometry(
                pid, num_pid_m, num_col_blocks, num_tokens, col1, col2, col3, n_total, blk1, blk2, blk3,
                BLOCK_M, BLOCK_N, GROUP_M, COL_ALIGN,
            )  # fmt: skip
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                a = x.load([m0, ki * BLOCK_K])
                wt = w.load([n0, ki * BLOCK_K])
                acc = tl.dot(a, wt.T, acc, input_precision=PRECISION)
            slot = tl.load(seg_slot_ptr + tl.load(token_seg_ptr + m0))
            if slot >= 0:
                # the units of this tile's rows (and slice): claim up to the last of them, then wait for each
                rb0 = pid_m * UNITS_PER_BLOCK
                last = tl.minimum(rb0 + UNITS_PER_BLOCK, tl.cdiv(num_tokens, SHRINK_M)) - 1
                if WIDE_G == 1:
                    last = last * shrink_slices + j
                _shrink_claimed(last, num_units, sync_ptr, xs, a_desc, s_ptr, token_seg_ptr, seg_slot_ptr,
                                seg_scale_ptr, slot_rank_ptr, num_tokens, hidden, shrink_slices, max_loras, a_rows,
                                s_cols, stride_ss, stride_st, stride_sr, SHRINK_M, SHRINK_K, SHRINK_R, WIDE_G,
                                SHRINK_STAGES, PRECISION)  # fmt: skip
                for i in tl.static_range(UNITS_PER_BLOCK):
                    unit = tl.minimum(rb0 + i, tl.cdiv(num_tokens, SHRINK_M) - 1)
                    if WIDE_G == 1:
                        unit = unit * shrink_slices + j
                    while tl.atomic_add(sync_ptr + unit, 0, sem="acquire", scope="gpu") == 0:
                        pass
                _fence_proxy_async(pid, FENCE)
                acc = _lora_loop(acc, s_desc, b_desc, j * num_tokens + m0, slot * n_total + n0, lora_k, BLOCK_K,
                                 PRECISION)  # fmt: skip
            _store_tile(acc, y_ptr, y_desc, bias_ptr, m0, n0, offs_m, offs_n, n_mask, num_tokens, stride_yt,
                        stride_yn, BLOCK_M, BLOCK_N, HAS_BIAS, TMA_STORE, EPI_SUBTILE)  # fmt: skip
            tile_start = pid + num_programs
        # what is left of the shrink, then wait for the units other programs claimed
        _shrink_claimed(num_units - 1, num_units, sync_ptr, xs, a_desc, s_ptr, token_seg_ptr, seg_slot_ptr,
                        seg_scale_ptr, slot_rank_ptr, num_tokens, hidden, shrink_slices, max_loras, a_rows, s_cols,
                        stride_ss, stride_st, stride_sr, SHRINK_M, SHRINK_K, SHRINK_R, WIDE_G, SHRINK_STAGES,
                        PRECISION)  # fmt: skip
        while tl.atomic_add(sync_ptr + num_units + 1, 0, sem="acquire", scope="gpu") < num_units:
            pass
        _fence_proxy_async(pid, FENCE)
    for tile_id in tl.range(tile_start, num_tiles, num_programs, flatten=FLATTEN):
        _, j, m0, n0, offs_m, offs_n, n_mask, rows, cols = _tile_geometry(
            tile_id, num_pid_m, num_col_blocks, num_tokens, col1, col2, col3, n_total, blk1, blk2, blk3,
            BLOCK_M, BLOCK_N, GROUP_M, COL_ALIGN,
        )  # fmt: skip

        seg_lo = 0
        seg_hi = 0
        if HAS_LORA:
            # the segments touching this tile's rows: one on the common path (no row straddles)
            if LORA_IN_LOOP and not STRADDLE:
                seg_lo = tl.load(token_seg_ptr + m0)
                seg_hi = seg_lo  # no row block holds two segments
            else:
                seg_lo, seg_hi = row_segments(token_seg_ptr, m0, num_tokens, BLOCK_M)
        # LoRA iterations of the K loop: only for a tile inside one segment with an adapter
        slot = 0
        lora_here = False
        if LORA_IN_LOOP or LORA_AFTER:
            slot = tl.load(seg_slot_ptr + seg_lo)
            lora_here = (seg_lo == seg_hi) & (slot >= 0)
            slot = tl.maximum(slot, 0)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if USE_TMA:
            # LoRA iterations of other tiles point past the last row: TMA fills zeros, moves no bytes
            s_row = tl.where(lora_here, j * num_tokens + m0, s_rows_total)
            b_row = tl.where(lora_here, slot * n_total + n0, b_rows_total)
            for ki in range(n_iters):
                a, wt = _tma_k_tiles(
                    ki, k_tiles, x, w, s_desc, b_desc, m0, n0, s_row, b_row, BLOCK_K, LORA_IN_LOOP
                )
                acc = tl.dot(a, wt.T, acc, input_precision=PRECISION)
            if LORA_AFTER:
                if lora_here:
                    acc = _lora_loop(acc, s_desc, b_desc, j * num_tokens + m0, slot * n_total + n0, lora_k,
                                     LORA_BK, PRECISION)  # fmt: skip
        else:
            x_off = rows[:, None] * stride_xt
            w_off = cols[None, :] * stride_wn
            if LORA_IN_LOOP:
                s_base = s_ptr + j * stride_ss
                b_base = b_ptr + slot.to(tl.int64) * stride_bl
                s_off = rows[:, None] * stride_st
                b_off = cols[None, :] * stride_bn
                lora_lim = tl.where(lora_here, lora_k, 0)
            for ki in range(n_iters):
                if LORA_IN_LOOP:
                    in_k = ki < k_tiles
                    kk = tl.where(in_k, ki, ki - k_tiles) * BLOCK_K
                    a_step = tl.where(in_k, stride_xh, stride_sr)
                    w_step = tl.where(in_k, stride_wh, stride_br)
                    a_ptrs = tl.where(in_k, x + x_off, s_base + s_off) + (kk + offs_k)[None, :] * a_step
                    w_ptrs = tl.where(in_k, w + w_off, b_base + b_off) + (kk + offs_k)[:, None] * w_step
                    k_lim = tl.where(in_k, hidden, lora_lim)
                else:
                    kk = ki * BLOCK_K
                    a_ptrs = x + x_off + (kk + offs_k)[None, :] * stride_xh
                    w_ptrs = w + w_off + (kk + offs_k)[:, None] * stride_wh
                    k_lim = hidden
                if EVEN_K and not LORA_IN_LOOP:
                    a = tl.load(a_ptrs)
                    wt = tl.load(w_ptrs)
                else:
                    a = tl.load(a_ptrs, mask=(kk + offs_k)[None, :] < k_lim, other=0.0)
                    wt = tl.load(w_ptrs, mask=(kk + offs_k)[:, None] < k_lim, other=0.0)
                acc = tl.dot(a, wt, acc, input_precision=PRECISION)

        if EPILOGUE_ALL or EPILOGUE_STRADDLE:
            # EPILOGUE_STRADDLE: rare, the tile's rows straddle segments; their LoRA terms one by one here
            if EPILOGUE_ALL or seg_lo != seg_hi:
                acc = _lora_epilogue(
                    acc, seg_lo, seg_hi, j, offs_m, offs_n, n_mask, s_ptr, b_ptr,
                    seg_start_ptr, seg_len_ptr, seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, rank_dim,
                    stride_ss, stride_st, stride_sr, stride_bl, stride_bn, stride_br,
                    R_CHUNK, S_SCALED, PRECISION,
                )  # fmt: skip
        _store_tile(acc, y_ptr, y_desc, bias_ptr, m0, n0, offs_m, offs_n, n_mask, num_tokens, stride_yt,
                    stride_yn, BLOCK_M, BLOCK_N, HAS_BIAS, TMA_STORE, EPI_SUBTILE)  # fmt: skip
