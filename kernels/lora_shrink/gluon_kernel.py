"""The segmented LoRA shrink in Gluon for Hopper (sm_90): s[g, t, :] = (scale(t) ·) x[t] · A[g, slot(t)]ᵀ.

The shrink streams x (113 MB for 4 requests of 4608 tokens at hidden 3072) and does little arithmetic at ranks
up to 32, so it is as fast as the bytes in flight on each SM allow. It runs as one wave: program p owns
`blocks` consecutive row blocks of WG · BLOCK_M rows (cdiv(row blocks, SMs), give or take one, so no program
waits for a second round: 288 blocks of 64 rows are 96 programs of 3 blocks, as cuBLAS cuts the same dense
shape).

A program walks its rows in pieces: up to WG · BLOCK_M rows, never across the end of a segment (one adapter a
piece), so segments may start anywhere. Each piece's K steps go through one deep ring of STAGES shared-memory
slots, each holding a step's x box [BLOCK_M, BLOCK_K] per MMA partition and every slice's A box [R, BLOCK_K]
(the piece's adapter slot; slices at rows g·R of the step's A buffer, the third of 3 slices in a buffer of its
own, so no slot holds a padding slice); a partition's rows that the piece does not fill come as boxes of 16
rows up to the piece's end. The warps are specialised: a loader warp issues each step's TMA loads as soon as
its slot is free (`empty`), completing the slot's `ready` barrier; the MMA warps (one warpgroup per 64 rows)
wait for `ready`, issue the step's warpgroup MMAs (every slice's columns at once; 3 slices as MMAs of 2 and 1
slices' columns) and free the step before's slot once its MMAs are done. The ring runs across pieces: the next
piece's loads are in flight while this piece's s is stored. With WG > 1 the WG MMA partitions share each
slot's A box, each its own BLOCK_M rows with its own accumulators (`empty` counts WG arrivals): more warpgroups
issuing MMAs per SM (4 × 4608 tokens: 96 programs of 192 rows, the cut cuBLAS takes), where one warpgroup
cannot keep the tensor cores busy at rank 32 and above.

Contract (the launcher checks it): bf16/fp16 x and A; slices (rounded up to a power of two) × rank tile ≤ 256;
x and A laid out for TMA. A piece without an adapter loads nothing and stores zeros.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ditserve.kernels._gluon import SOut, _segment_adapter, _tma_load


@gluon.jit
def _program_rows(num_tokens, num_blocks, ROWS: gl.constexpr):
    """This program's rows [lo, hi): its share of the batch's row blocks of ROWS rows (blocks floor(p · blocks /
    programs) on), so the programs' shares differ by at most one block."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    lo = gl.minimum(pid * num_blocks // programs * ROWS, num_tokens)
    hi = gl.minimum((pid + 1) * num_blocks // programs * ROWS, num_tokens)
    return lo, hi


@gluon.jit
def _piece(r, hi, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr,
           ROWS: gl.constexpr):  # fmt: skip
    """The piece of rows starting at r: [r, end) with end at most ROWS rows on, the program's end hi or the end
    of r's segment, whichever comes first; with its segment's adapter slot (-1: none), that slot's rank (0 without
    one) and the segment's scale."""
    seg = gl.load(token_seg_ptr + r)
    end = gl.minimum(gl.minimum(gl.load(seg_start_ptr + seg) + gl.load(seg_len_ptr + seg), hi), r + ROWS)
    slot, rank, scale = _segment_adapter(seg, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr)
    return end, slot, rank, scale


@gluon.jit
def _shrink_loader(x_desc, x16_desc, a_desc, x_bufs, a_bufs, b_bufs, ready, empty, token_seg_ptr, seg_start_ptr,
                   seg_len_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr, max_rank, a_slice_rows, num_tokens,
                   num_blocks, G: gl.constexpr, R: gl.constexpr, ROWS: gl.constexpr,
                   BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The loader warp: every K step of this program's pieces with an adapter, in the MMA warps' order; step j
    into ring slot j % STAGES once the MMAs of step j - STAGES have freed it. An MMA partition's rows of a piece
    come as one x box where the piece fills them, else as boxes of 16 rows up to the piece's end; a box the piece
    does not reach is placed wholly past x's last row (TMA fills it with zeros and reads nothing), so every step
    brings the same bytes."""
    lo, hi = _program_rows(num_tokens, num_blocks, ROWS)
    k_tiles = gl.cdiv(x_desc.shape[1], BLOCK_K)
    XM: gl.constexpr = x_desc.block_type.shape[0]  # rows of an x box: one per MMA partition
    XS: gl.constexpr = x16_desc.block_type.shape[0]  # rows of a box of a piece's last rows
    WG: gl.constexpr = ROWS // XM
    step_bytes: gl.constexpr = WG * x_desc.block_type.nbytes + G * a_desc.block_type.nbytes
    j = 0
    r = lo
    while r < hi:
        end, slot, rank, _ = _piece(r, hi, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr,
                                    seg_scale_ptr, ROWS)  # fmt: skip
        a_row = gl.maximum(slot, 0) * max_rank
        for ki in range(gl.where(rank > 0, k_tiles, 0)):
            i = j % STAGES
            mbarrier.wait(empty.index(i), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(i)
            mbarrier.expect(bar, step_bytes)
            for w in gl.static_range(WG):
                m = r + w * XM
                dst = x_bufs.index(i * WG + w)
                if (end - m >= XM) | (end <= m):
                    _tma_load(x_desc, [gl.where(end > m, m, num_tokens), ki * BLOCK_K], bar, dst)
                else:
                    for q in gl.static_range(XM // XS):
                        row = gl.where(m + q * XS < end, m + q * XS, num_tokens)
                        _tma_load(x16_desc, [row, ki * BLOCK_K], bar, dst.slice(q * XS, XS, dim=0))
            for g in gl.static_range(G):
                if G == 3 and g == 2:
                    dst_a = b_bufs.index(i)
                else:
                    dst_a = a_bufs.index(i).slice(g * R, R, dim=0)
                _tma_load(a_desc, [g * a_slice_rows + a_row, ki * BLOCK_K], bar, dst_a)
            j += 1
        r = end


@gluon.jit
def _shrink_mmas(x_bufs, a_bufs, b_bufs, ready, empty, s_ptr, token_seg_ptr, seg_start_ptr, seg_len_ptr,
                 seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st, num_blocks,
                 k_tiles, G: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr,
                 STAGES: gl.constexpr, SCALED: gl.constexpr, WG: gl.constexpr, wg: gl.constexpr,
                 num_warps: gl.constexpr):  # fmt: skip
    """MMA partition wg (of WG): per step wait for its slot, issue its MMAs on its BLOCK_M rows of the slot's x
    box, free the step before's slot once those MMAs are done; per piece store its rows of s up to the piece's
    end (scaled; rows of the box past the end hold other rows or zeros and are dropped), zeros for a piece without
    an adapter. Nothing but MMAs writes the accumulators: any other write makes ptxas serialize every MMA of the
    kernel (C7515)."""
    ROWS: gl.constexpr = WG * BLOCK_M
    SPLIT: gl.constexpr = G == 3
    N_A: gl.constexpr = 2 * R if SPLIT else G * R
    N_B: gl.constexpr = R if SPLIT else 16
    GROUPS: gl.constexpr = 2 if SPLIT else 1  # MMAs a step commits
    layout_a: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N_A, 16]
    )
    layout_b: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N_B, 16]
    )
    lo, hi = _program_rows(num_tokens, num_blocks, ROWS)
    acc_a = gl.zeros((BLOCK_M, N_A), dtype=gl.float32, layout=layout_a)
    acc_b = gl.zeros((BLOCK_M, N_B), dtype=gl.float32, layout=layout_b)
    j = 0
    r = lo
    while r < hi:
        end, slot, rank, scale = _piece(r, hi, token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                                        slot_rank_ptr, seg_scale_ptr, ROWS)  # fmt: skip
        m0 = r + wg * BLOCK_M
        for ki in range(gl.where(rank > 0, k_tiles, 0)):
            i = j % STAGES
            x_buf = x_bufs.index(i * WG + wg)
            a_buf = a_bufs.index(i)
            b_buf = b_bufs.index(i)
            mbarrier.wait(ready.index(i), (j // STAGES) & 1)
            tok_a = warpgroup_mma(x_buf, a_buf.permute((1, 0)), acc_a, use_acc=ki > 0, is_async=True)
            tok_b = acc_b
            if SPLIT:
                tok_b = warpgroup_mma(x_buf, b_buf.permute((1, 0)), acc_b, use_acc=ki > 0, is_async=True)
            acc_a, acc_b, _, _, _ = warpgroup_mma_wait(GROUPS, deps=(tok_a, tok_b, x_buf, a_buf, b_buf))
            if j > 0:
                mbarrier.arrive(empty.index((j - 1) % STAGES))
            j += 1
        out_a, out_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
        if SCALED:
            out_a = out_a * scale
            out_b = out_b * scale
        # rank 0 (no adapter, nothing loaded): SOut.store drops every column, so the piece's s is zeros
        so = SOut(s_ptr, s_cols, stride_ss, stride_st, G, R, BLOCK_M, num_warps)
        so.store(out_a, 0, m0, end, rank, N_A)
        if SPLIT:
            so.store(out_b, 2, m0, end, rank, N_B)
        r = end


@gluon.jit
def _gluon_lora_shrink_kernel(
    x_desc,  # x [num_tokens, hidden], box [BLOCK_M, BLOCK_K] (WG of them a step)
    x16_desc,  # x, box [16, BLOCK_K]: a piece's last rows where they do not fill an MMA partition
    a_desc,  # A viewed as [slices · max_loras · max_rank, hidden], box [R, BLOCK_K]
    s_ptr,  # [slices, num_tokens, s_cols]: fp32 (unscaled) or x's dtype (SCALED)
    token_seg_ptr,  # [num_tokens] int32
    seg_start_ptr,  # [num_segments] int32
    seg_len_ptr,  # [num_segments] int32
    seg_slot_ptr,  # [num_segments] int32, -1 = no LoRA
    seg_scale_ptr,  # [num_segments] fp32
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    s_cols,  # columns of s written (the rest of the rank tile is dropped)
    max_rank,  # A rows per slot
    a_slice_rows,  # A rows per slice: max_loras · max_rank
    stride_ss,
    stride_st,
    num_blocks,  # cdiv(num_tokens, WG · BLOCK_M): the programs share them out
    G: gl.constexpr,  # slices
    R: gl.constexpr,  # rank tile (power of two ≥ 16)
    BLOCK_M: gl.constexpr,  # rows of an MMA partition: 64 per warpgroup (num_warps / 4)
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,  # ring slots
    SCALED: gl.constexpr,  # s · scale(t) in s's dtype, else unscaled fp32
    WG: gl.constexpr,  # 1-3 MMA partitions, each of num_warps warps: a piece is up to WG · BLOCK_M rows
    MMA_REGS: gl.constexpr,  # registers of each MMA partition past the first (WG > 1): those it starts with
    num_warps: gl.constexpr,
):
    k_tiles = gl.cdiv(x_desc.shape[1], BLOCK_K)
    # a slot's x box per MMA partition: slot i, partition w at x_bufs[i · WG + w]
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES * WG, BLOCK_M, BLOCK_K], x_desc.layout)
    # every slice's A rows of a step in one buffer; 3 slices as 2 + 1 (no padding slice)
    a_bufs = gl.allocate_shared_memory(
        a_desc.dtype, [STAGES, (2 if G == 3 else G) * R, BLOCK_K], a_desc.layout
    )
    if G == 3:
        b_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, R, BLOCK_K], a_desc.layout)
    else:
        b_bufs = a_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=WG)
    # MMA partition 0 (the default partition, num_warps warps), MMA partitions 1..WG-1, the loader warp; written
    # out per WG (a partition is a literal (function, arguments) pair)
    if WG == 1:
        gl.warp_specialize(
            [
            (_shrink_mmas, (x_bufs, a_bufs, b_bufs, ready, empty, s_ptr, token_seg_ptr, seg_start_ptr, seg_len_ptr,
                            seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st,
                            num_blocks, k_tiles, G, R, BLOCK_M, STAGES, SCALED, WG, 0, num_warps)),
            (_shrink_loader, (x_desc, x16_desc, a_desc, x_bufs, a_bufs, b_bufs, ready, empty, token_seg_ptr,
                              seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr, max_rank,
                              a_slice_rows, num_tokens, num_blocks, G, R, WG * BLOCK_M, BLOCK_K, STAGES)),
            ],
            [1],
            [40],
        )  # fmt: skip
    elif WG == 2:
        gl.warp_specialize(
            [
            (_shrink_mmas, (x_bufs, a_bufs, b_bufs, ready, empty, s_ptr, token_seg_ptr, seg_start_ptr, seg_len_ptr,
                            seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st,
                            num_blocks, k_tiles, G, R, BLOCK_M, STAGES, SCALED, WG, 0, num_warps)),
            (_shrink_mmas, (x_bufs, a_bufs, b_bufs, ready, empty, s_ptr, token_seg_ptr, seg_start_ptr, seg_len_ptr,
                            seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st,
                            num_blocks, k_tiles, G, R, BLOCK_M, STAGES, SCALED, WG, 1, num_warps)),
            (_shrink_loader, (x_desc, x16_desc, a_desc, x_bufs, a_bufs, b_bufs, ready, empty, token_seg_ptr,
                              seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr, max_rank,
                              a_slice_rows, num_tokens, num_blocks, G, R, WG * BLOCK_M, BLOCK_K, STAGES)),
            ],
            [num_warps, 1],
            [MMA_REGS, 40],
        )  # fmt: skip
    else:
        gl.static_assert(WG == 3, "1-3 MMA partitions")
        gl.warp_specialize(
            [
            (_shrink_mmas, (x_bufs, a_bufs, b_bufs, ready, empty, s_ptr, token_seg_ptr, seg_start_ptr, seg_len_ptr,
                            seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st,
                            num_blocks, k_tiles, G, R, BLOCK_M, STAGES, SCALED, WG, 0, num_warps)),
            (_shrink_mmas, (x_bufs, a_bufs, b_bufs, ready, empty, s_ptr, token_seg_ptr, seg_start_ptr, seg_len_ptr,
                            seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st,
                            num_blocks, k_tiles, G, R, BLOCK_M, STAGES, SCALED, WG, 1, num_warps)),
            (_shrink_mmas, (x_bufs, a_bufs, b_bufs, ready, empty, s_ptr, token_seg_ptr, seg_start_ptr, seg_len_ptr,
                            seg_slot_ptr, seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st,
                            num_blocks, k_tiles, G, R, BLOCK_M, STAGES, SCALED, WG, 2, num_warps)),
            (_shrink_loader, (x_desc, x16_desc, a_desc, x_bufs, a_bufs, b_bufs, ready, empty, token_seg_ptr,
                              seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr, max_rank,
                              a_slice_rows, num_tokens, num_blocks, G, R, WG * BLOCK_M, BLOCK_K, STAGES)),
            ],
            [num_warps, num_warps, 1],
            [MMA_REGS, MMA_REGS, 40],
        )  # fmt: skip
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
