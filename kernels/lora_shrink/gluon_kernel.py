"""The segmented LoRA shrink in Gluon for Hopper (sm_90): s[g, t, :] = (scale(t) ·) x[t] · A[g, slot(t)]ᵀ.

One program per SM walks whole row blocks (pid, pid + P, ... below `whole`), every slice of a block in one
program so x is read once: per 64-wide K step an x box [BLOCK_M, BLOCK_K] and every slice's A box [R,
BLOCK_K] (the slot's rows) land in two rings of their own, XB slots for x (read from HBM: many in flight) and
AB slots for A (read from L2). The program's warps are specialised: one loader warp walks the same steps and
issues the TMA loads as soon as a slot is free (its `empty` barrier), completing the slot's `ready` barrier;
the MMA warps (two warpgroups of 64 rows) wait for `ready`, issue the step's warpgroup MMAs (all slices'
columns at once; 3 slices as MMAs of 2 and 1 slices' columns), and once the step before has finished free
its slots. The rings run across block boundaries: the next block's first loads are in flight while this
block's s is stored.

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
def _load_step(j, slot, m0, kk, g_lo, max_rank, a_slice_rows, x_desc, a_desc, x_bufs, a_bufs, x_ready, x_empty,
               a_ready, a_empty, NG: gl.constexpr, R: gl.constexpr, XB: gl.constexpr, AB: gl.constexpr):  # fmt: skip
    """Step j's loads, each once its ring slot is free: x rows m0.. (columns kk..) into x slot j % XB, and the
    slot's A rows of slices g_lo.. g_lo + NG into A slot j % AB, slice i at rows i·R.. (rows past the slot's
    rank are the next slot's: the store drops their columns). A block without an adapter loads nothing and
    completes the slots' barriers at once."""
    xs = j % XB
    mbarrier.wait(x_empty.index(xs), ((j // XB) & 1) ^ 1)
    if slot >= 0:
        mbarrier.expect(x_ready.index(xs), x_desc.block_type.nbytes)
        _tma_load(x_desc, [m0, kk], x_ready.index(xs), x_bufs.index(xs))
    else:
        mbarrier.arrive(x_ready.index(xs))
    a_s = j % AB
    mbarrier.wait(a_empty.index(a_s), ((j // AB) & 1) ^ 1)
    if slot >= 0:
        bar = a_ready.index(a_s)
        mbarrier.expect(bar, NG * a_desc.block_type.nbytes)
        for i in gl.static_range(NG):
            _tma_load(a_desc, [(g_lo + i) * a_slice_rows + slot * max_rank, kk], bar,
                      a_bufs.index(a_s).slice(i * R, R, dim=0))  # fmt: skip
    else:
        mbarrier.arrive(a_ready.index(a_s))


@gluon.jit
def _shrink_loader(x_desc, a_desc, x_bufs, a_bufs, x_ready, x_empty, a_ready, a_empty, token_seg_ptr, seg_slot_ptr,
                   max_rank, a_slice_rows, num_blocks, whole, G: gl.constexpr, R: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, XB: gl.constexpr, AB: gl.constexpr):  # fmt: skip
    """The loader warp: every step of this program's whole blocks, then of its pieces, in the MMA warps' order."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    k_tiles = gl.cdiv(x_desc.shape[1], BLOCK_K)
    j = 0
    for rb in range(pid, whole, nprog):
        slot = gl.load(seg_slot_ptr + gl.load(token_seg_ptr + rb * BLOCK_M))
        for ki in range(k_tiles):
            _load_step(j, slot, rb * BLOCK_M, ki * BLOCK_K, 0, max_rank, a_slice_rows, x_desc, a_desc, x_bufs, a_bufs,
                       x_ready, x_empty, a_ready, a_empty, G, R, XB, AB)  # fmt: skip
            j += 1
    for p in range(pid, (num_blocks - whole) * G, nprog):
        rb = whole + p // G
        slot = gl.load(seg_slot_ptr + gl.load(token_seg_ptr + rb * BLOCK_M))
        for ki in range(k_tiles):
            _load_step(j, slot, rb * BLOCK_M, ki * BLOCK_K, p % G, max_rank, a_slice_rows, x_desc, a_desc, x_bufs,
                       a_bufs, x_ready, x_empty, a_ready, a_empty, 1, R, XB, AB)  # fmt: skip
            j += 1


@gluon.jit
def _release(j, x_empty, a_empty, XB: gl.constexpr, AB: gl.constexpr):
    """Step j's ring slots are free again (its MMAs have finished)."""
    mbarrier.arrive(x_empty.index(j % XB))
    mbarrier.arrive(a_empty.index(j % AB))


@gluon.jit
def _shrink_mmas(x_bufs, a_bufs, x_ready, x_empty, a_ready, a_empty, s_ptr, token_seg_ptr, seg_slot_ptr,
                 seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st, num_blocks, whole, k_tiles,
                 G: gl.constexpr, GP: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, XB: gl.constexpr,
                 AB: gl.constexpr, SCALED: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The MMA warps: per step wait for its slots, issue its MMAs, free the step before's slots once those
    MMAs are done; per block (or piece) store its s (scaled). Nothing but MMAs writes the accumulators: any
    other write makes ptxas serialize every MMA of the kernel (C7515)."""
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
    acc_a = gl.zeros((BLOCK_M, N_A), dtype=gl.float32, layout=layout_a)
    acc_b = gl.zeros((BLOCK_M, N_B), dtype=gl.float32, layout=layout_b)
    j = 0
    for rb in range(pid, whole, nprog):
        # the block's segment, first needed for its store: the loads overlap the block's MMAs
        slot, rank, scale = _block_segment(rb, num_blocks, token_seg_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr,
                                           BLOCK_M)  # fmt: skip
        for ki in range(k_tiles):
            x_buf = x_bufs.index(j % XB)
            a_buf = a_bufs.index(j % AB)
            mbarrier.wait(x_ready.index(j % XB), (j // XB) & 1)
            mbarrier.wait(a_ready.index(j % AB), (j // AB) & 1)
            tok_a, tok_b = _unit_mma(acc_a, acc_b, x_buf, a_buf, 0, ki > 0, N_A, N_B, SPLIT)
            acc_a, acc_b, _, _ = warpgroup_mma_wait(GROUPS, deps=(tok_a, tok_b, x_buf, a_buf))
            if j > 0:
                _release(j - 1, x_empty, a_empty, XB, AB)
            j += 1
        out_a, out_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
        if SCALED:
            out_a = out_a * scale
            out_b = out_b * scale
        _store_s(out_a, 0, rb * BLOCK_M, num_tokens, rank, s_cols, stride_ss, stride_st, s_ptr, N_A, G, R, BLOCK_M,
                 num_warps)  # fmt: skip
        if SPLIT:
            _store_s(out_b, 2, rb * BLOCK_M, num_tokens, rank, s_cols, stride_ss, stride_st, s_ptr, N_B, G, R, BLOCK_M,
                     num_warps)  # fmt: skip
    # no MMA in flight from here (ptxas cannot tell, and would serialize every MMA for the accumulator below)
    acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
    acc = gl.zeros((BLOCK_M, R), dtype=gl.float32, layout=layout_r)
    for p in range(pid, (num_blocks - whole) * G, nprog):
        rb = whole + p // G
        slot, rank, scale = _block_segment(rb, num_blocks, token_seg_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr,
                                           BLOCK_M)  # fmt: skip
        for ki in range(k_tiles):
            x_buf = x_bufs.index(j % XB)
            a_buf = a_bufs.index(j % AB)
            mbarrier.wait(x_ready.index(j % XB), (j // XB) & 1)
            mbarrier.wait(a_ready.index(j % AB), (j // AB) & 1)
            tok = warpgroup_mma(
                x_buf, a_buf.slice(0, R, dim=0).permute((1, 0)), acc, use_acc=ki > 0, is_async=True
            )
            acc, _, _ = warpgroup_mma_wait(1, deps=(tok, x_buf, a_buf))
            if j > 0:
                _release(j - 1, x_empty, a_empty, XB, AB)
            j += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        out = acc
        if SCALED:
            out = acc * scale
        _store_s(out, p % G, rb * BLOCK_M, num_tokens, rank, s_cols, stride_ss, stride_st, s_ptr, R, G, R, BLOCK_M,
                 num_warps)  # fmt: skip


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
    k_tiles = gl.cdiv(x_desc.shape[1], BLOCK_K)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [XB, BLOCK_M, BLOCK_K], x_desc.layout)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [AB, GP * R, BLOCK_K], a_desc.layout)
    x_ready = gl.allocate_shared_memory(gl.int64, [XB, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [XB, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [AB, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [AB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(XB):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=1)
    for i in gl.static_range(AB):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=1)
    gl.warp_specialize(
        [
            (_shrink_mmas, (x_bufs, a_bufs, x_ready, x_empty, a_ready, a_empty, s_ptr, token_seg_ptr, seg_slot_ptr,
                            seg_scale_ptr, slot_rank_ptr, num_tokens, s_cols, stride_ss, stride_st, num_blocks, whole,
                            k_tiles, G, GP, R, BLOCK_M, XB, AB, SCALED, num_warps)),
            (_shrink_loader, (x_desc, a_desc, x_bufs, a_bufs, x_ready, x_empty, a_ready, a_empty, token_seg_ptr,
                              seg_slot_ptr, max_rank, a_slice_rows, num_blocks, whole, G, R, BLOCK_M, BLOCK_K, XB,
                              AB)),
        ],
        [1],
        [40],
    )  # fmt: skip
    for i in gl.static_range(XB):
        mbarrier.invalidate(x_ready.index(i))
        mbarrier.invalidate(x_empty.index(i))
    for i in gl.static_range(AB):
        mbarrier.invalidate(a_ready.index(i))
        mbarrier.invalidate(a_empty.index(i))
