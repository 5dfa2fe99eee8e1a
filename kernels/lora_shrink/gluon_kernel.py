"""The segmented LoRA shrink in Gluon for Hopper (sm_90): s[g, t, :] = (scale(t) ·) x[t] · A[g, slot(t)]ᵀ.

One program per SM walks whole row blocks (pid, pid + P, ... below `whole`), every slice of a block in one
program so x is read once: per 64-wide K step an x box [BLOCK_M, BLOCK_K] and every slice's A box [R,
BLOCK_K] (the slot's rows) land in two rings of their own, XB slots for x (read from HBM: many in flight) and
AB slots for A (read from L2: fewer), each completed on its own mbarriers. The warpgroup MMAs of a step (all
slices' columns at once; 3 slices as MMAs of 2 and 1 slices' columns) stay in flight while the next step's
are issued, and a ring slot is loaded again once the step that read it has finished. The rings run across
block boundaries: the loads of the next block's first steps are in flight while this block's s is stored.
A block's segment (slot, rank, scale) is looked up a block ahead, so no load waits on that chain of reads.

The row blocks past `whole` (those that would leave most programs idle in a last round) are cut by slice
into pieces of one slice each, one piece per program, so that round is a third (3 slices) of a block long.

Contract (the launcher checks it): bf16/fp16 x and A; every segment starts at a multiple of BLOCK_M (a row
block holds one segment); slices × rank tile ≤ 256; x and A laid out for TMA. Rows without an adapter
load nothing and get zeros.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ditserve.kernels.lora_gemm.gluon_kernel import _store_s, _tma_load, _unit_mma


@gluon.jit
def _block_segment(rb, num_blocks, token_seg_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr,
                   BLOCK_M: gl.constexpr):  # fmt: skip
    """Row block rb's (slot, rank, scale): its segment's adapter slot (-1: none), that slot's rank (0 without
    one) and the segment's scale; rb past the last block reads the last one's."""
    seg = gl.load(token_seg_ptr + gl.minimum(rb, num_blocks - 1) * BLOCK_M)
    slot = gl.load(seg_slot_ptr + seg)
    rank = gl.where(slot >= 0, gl.load(slot_rank_ptr + gl.maximum(slot, 0)), 0)
    scale = gl.load(seg_scale_ptr + seg)
    return slot, rank, scale


@gluon.jit
def _load_x(j, pred, slot, m0, kk, x_desc, x_bufs, x_bars, XB: gl.constexpr):
    """x rows m0.. (columns kk..) into x ring slot j % XB; a block without an adapter loads nothing and
    completes the slot's barrier at once."""
    bar = x_bars.index(j % XB)
    mbarrier.expect(bar, x_desc.block_type.nbytes, pred=pred & (slot >= 0))
    _tma_load(x_desc, [m0, kk], bar, x_bufs.index(j % XB), pred & (slot >= 0))
    mbarrier.arrive(bar, pred=pred & (slot < 0))


@gluon.jit
def _load_a(j, pred, slot, g_lo, kk, max_rank, a_slice_rows, a_desc, a_bufs, a_bars, NG: gl.constexpr,
            R: gl.constexpr, AB: gl.constexpr):  # fmt: skip
    """The slot's A rows of slices g_lo.. g_lo + NG (columns kk..) into A ring slot j % AB, slice i at rows
    i·R.. (rows past the slot's rank are the next slot's: the store drops their columns)."""
    bar = a_bars.index(j % AB)
    buf = a_bufs.index(j % AB)
    row = gl.maximum(slot, 0) * max_rank
    mbarrier.expect(bar, NG * a_desc.block_type.nbytes, pred=pred & (slot >= 0))
    for i in gl.static_range(NG):
        _tma_load(a_desc, [(g_lo + i) * a_slice_rows + row, kk], bar, buf.slice(i * R, R, dim=0),
                  pred & (slot >= 0))  # fmt: skip
    mbarrier.arrive(bar, pred=pred & (slot < 0))


@gluon.jit
def _gluon_lora_shrink_kernel(
    x_desc,  # x [num_tokens, hidden], box [BLOCK_M, BLOCK_K]
    a_desc,  # A viewed as [slices · max_loras · max_rank, hidden], box [R, BLOCK_K]
    s_ptr,  # [slices, num_tokens, s_cols]: fp32 (unscaled) or x's dtype (SCALED)
    token_seg_ptr,  # [num_tokens] int32
    seg_slot_ptr,  # [num_segments] int32, -1 = no LoRA
    seg_scale_ptr,  # [num_segments] fp32
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    s_cols,  # columns of s written (the rest of the rank tile is dropped)
    max_rank,  # A rows per slot
    a_slice_rows,  # A rows per slice: max_loras · max_rank
    stride_ss,
    stride_st,
    num_blocks,  # row blocks of BLOCK_M tokens
    whole,  # row blocks run whole (every slice in one program); the rest as pieces of one slice
    G: gl.constexpr,  # slices
    GP: gl.constexpr,  # slices rounded up to a power of two
    R: gl.constexpr,  # rank tile (power of two ≥ 16)
    BLOCK_M: gl.constexpr,
    BLOCK_K: gl.constexpr,
    XB: gl.constexpr,  # x ring slots
    AB: gl.constexpr,  # A ring slots
    SCALED: gl.constexpr,  # s · scale(t) in s's dtype, else unscaled fp32
    num_warps: gl.constexpr,
):
    SPLIT: gl.constexpr = G == 3
    N_A: gl.constexpr = 2 * R if SPLIT else GP * R
    N_B: gl.constexpr = R if SPLIT else 16
    GROUPS: gl.constexpr = 2 if SPLIT else 1  # MMA groups a block's step commits
    layout_a: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N_A, 16]
    )
    layout_b: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N_B, 16]
    )
    layout_r: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, R, 16]
    )
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    k_tiles = gl.cdiv(x_desc.shape[1], BLOCK_K)

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [XB, BLOCK_M, BLOCK_K], x_desc.layout)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [AB, GP * R, BLOCK_K], a_desc.layout)
    x_bars = gl.allocate_shared_memory(gl.int64, [XB, 1], mbarrier.MBarrierLayout())
    a_bars = gl.allocate_shared_memory(gl.int64, [AB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(XB):
        mbarrier.init(x_bars.index(i), count=1)
    for i in gl.static_range(AB):
        mbarrier.init(a_bars.index(i), count=1)

    # whole row blocks: pid, pid + nprog, ... below `whole`, one continuous ring of K steps
    my_blocks = gl.cdiv(gl.maximum(whole - pid, 0), nprog)
    total = my_blocks * k_tiles
    cur_slot, cur_rank, cur_scale = _block_segment(pid, num_blocks, token_seg_ptr, seg_slot_ptr, slot_rank_ptr,
                                                   seg_scale_ptr, BLOCK_M)  # fmt: skip
    nxt_slot, nxt_rank, nxt_scale = _block_segment(pid + nprog, num_blocks, token_seg_ptr, seg_slot_ptr,
                                                   slot_rank_ptr, seg_scale_ptr, BLOCK_M)  # fmt: skip
    for i in gl.static_range(XB - 1):  # the first block's first steps (XB, AB ≤ k_tiles)
        _load_x(i, i < total, cur_slot, pid * BLOCK_M, i * BLOCK_K, x_desc, x_bufs, x_bars, XB)
    for i in gl.static_range(AB - 1):
        _load_a(
            i, i < total, cur_slot, 0, i * BLOCK_K, max_rank, a_slice_rows, a_desc, a_bufs, a_bars, G, R, AB
        )
    acc_a = gl.zeros((BLOCK_M, N_A), dtype=gl.float32, layout=layout_a)
    acc_b = gl.zeros((BLOCK_M, N_B), dtype=gl.float32, layout=layout_b)
    for t in range(total):
        b = t // k_tiles
        ki = t - b * k_tiles
        if ki == 0:
            if t > 0:  # the next block is this one now; look up the one after it
                cur_slot, cur_rank, cur_scale = nxt_slot, nxt_rank, nxt_scale
                nxt_slot, nxt_rank, nxt_scale = _block_segment(pid + (b + 1) * nprog, num_blocks, token_seg_ptr,
                                                               seg_slot_ptr, slot_rank_ptr, seg_scale_ptr,
                                                               BLOCK_M)  # fmt: skip
        x_buf = x_bufs.index(t % XB)
        a_buf = a_bufs.index(t % AB)
        mbarrier.wait(x_bars.index(t % XB), (t // XB) & 1)
        mbarrier.wait(a_bars.index(t % AB), (t // AB) & 1)
        tok_a, tok_b = _unit_mma(acc_a, acc_b, x_buf, a_buf, 0, ki > 0, N_A, N_B, SPLIT)
        # this step's MMAs stay in flight; the step before it is done, so its slots can be loaded again
        acc_a, acc_b, _, _ = warpgroup_mma_wait(GROUPS, deps=(tok_a, tok_b, x_buf, a_buf))
        jx = t + XB - 1
        bx = jx // k_tiles
        _load_x(jx, jx < total, gl.where(bx == b, cur_slot, nxt_slot), (pid + bx * nprog) * BLOCK_M,
                (jx - bx * k_tiles) * BLOCK_K, x_desc, x_bufs, x_bars, XB)  # fmt: skip
        ja = t + AB - 1
        ba = ja // k_tiles
        _load_a(ja, ja < total, gl.where(ba == b, cur_slot, nxt_slot), 0, (ja - ba * k_tiles) * BLOCK_K,
                max_rank, a_slice_rows, a_desc, a_bufs, a_bars, G, R, AB)  # fmt: skip
        if ki == k_tiles - 1:
            # the block's sums, read once its MMAs are done; nothing but MMAs writes the accumulators (any other
            # write into them makes ptxas serialize every MMA of the kernel, C7515), the next block's first MMA
            # starts them afresh (use_acc false)
            out_a, out_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
            if SCALED:
                out_a = out_a * cur_scale
                out_b = out_b * cur_scale
            m0 = (pid + b * nprog) * BLOCK_M
            _store_s(out_a, 0, m0, num_tokens, cur_rank, s_cols, stride_ss, stride_st, s_ptr, N_A, G, R, BLOCK_M,
                     num_warps)  # fmt: skip
            if SPLIT:
                _store_s(out_b, 2, m0, num_tokens, cur_rank, s_cols, stride_ss, stride_st, s_ptr, N_B, G, R,
                         BLOCK_M, num_warps)  # fmt: skip

    # the other row blocks in pieces of one slice, each its own pipeline (the ring's steps go on counting)
    # no MMA in flight from here (the last block's epilogue waited for them, but ptxas cannot tell, and would
    # serialize every MMA for the pieces' accumulator set up below)
    acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
    step = total
    acc = gl.zeros((BLOCK_M, R), dtype=gl.float32, layout=layout_r)
    for p in range(pid, (num_blocks - whole) * G, nprog):
        rb = whole + p // G
        g = p % G
        m0 = rb * BLOCK_M
        slot, rank, scale = _block_segment(rb, num_blocks, token_seg_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr,
                                           BLOCK_M)  # fmt: skip
        for i in gl.static_range(XB - 1):
            _load_x(step + i, i < k_tiles, slot, m0, i * BLOCK_K, x_desc, x_bufs, x_bars, XB)
        for i in gl.static_range(AB - 1):
            _load_a(step + i, i < k_tiles, slot, g, i * BLOCK_K, max_rank, a_slice_rows, a_desc, a_bufs, a_bars, 1,
                    R, AB)  # fmt: skip
        for ki in range(k_tiles):
            x_buf = x_bufs.index(step % XB)
            a_buf = a_bufs.index(step % AB)
            mbarrier.wait(x_bars.index(step % XB), (step // XB) & 1)
            mbarrier.wait(a_bars.index(step % AB), (step // AB) & 1)
            tok = warpgroup_mma(
                x_buf, a_buf.slice(0, R, dim=0).permute((1, 0)), acc, use_acc=ki > 0, is_async=True
            )
            acc, _, _ = warpgroup_mma_wait(1, deps=(tok, x_buf, a_buf))
            _load_x(step + XB - 1, ki + XB - 1 < k_tiles, slot, m0, (ki + XB - 1) * BLOCK_K, x_desc, x_bufs, x_bars,
                    XB)  # fmt: skip
            _load_a(step + AB - 1, ki + AB - 1 < k_tiles, slot, g, (ki + AB - 1) * BLOCK_K, max_rank, a_slice_rows,
                    a_desc, a_bufs, a_bars, 1, R, AB)  # fmt: skip
            step += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        out = acc
        if SCALED:
            out = acc * scale
        _store_s(
            out, g, m0, num_tokens, rank, s_cols, stride_ss, stride_st, s_ptr, R, G, R, BLOCK_M, num_warps
        )

    for i in gl.static_range(XB):
        mbarrier.invalidate(x_bars.index(i))
    for i in gl.static_range(AB):
        mbarrier.invalidate(a_bars.index(i))
