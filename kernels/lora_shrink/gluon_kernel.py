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

from ditserve.kernels._gluon import (
    Scalar,
    Slots,
    SOut,
    _mma_layout,
    _segment_adapter,
    _slots,
    _tma_load,
    aggregate,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@aggregate
class Pieces:
    """This program's rows and their pieces: its share of the batch's num_blocks row blocks of ROWS rows (blocks
    floor(p · blocks / programs) on, so the programs' shares differ by at most one block), cut at the ends of the
    segments (token_seg, seg_start, seg_len) and at most ROWS rows long; a piece's adapter from its segment."""

    token_seg_ptr: gl.tensor
    seg_start_ptr: gl.tensor
    seg_len_ptr: gl.tensor
    seg_slot_ptr: gl.tensor
    slot_rank_ptr: gl.tensor
    seg_scale_ptr: gl.tensor
    num_tokens: Scalar
    num_blocks: Scalar
    ROWS: gl.constexpr

    @gluon.jit
    def rows(self):
        """This program's rows [lo, hi)."""
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        lo = gl.minimum(pid * self.num_blocks // programs * self.ROWS, self.num_tokens)
        hi = gl.minimum((pid + 1) * self.num_blocks // programs * self.ROWS, self.num_tokens)
        return lo, hi

    @gluon.jit
    def piece(self, r, hi):
        """The piece starting at row r: its end (ROWS rows on, the program's end hi or the end of r's segment,
        whichever comes first), its segment's adapter slot (-1: none), that slot's rank (0 without one) and the
        segment's scale."""
        seg = gl.load(self.token_seg_ptr + r)
        end = gl.load(self.seg_start_ptr + seg) + gl.load(self.seg_len_ptr + seg)
        end = gl.minimum(gl.minimum(end, hi), r + self.ROWS)
        slot, rank, scale = _segment_adapter(seg, self.seg_slot_ptr, self.slot_rank_ptr, self.seg_scale_ptr)
        return end, slot, rank, scale


@aggregate
class Ring:
    """The ring's slots: per slot WG x boxes of BLOCK_M rows (slot i, partition w at x_bufs[i · WG + w]), every
    slice's A box in a_bufs (3 slices: the third in b_bufs of its own, so no slot holds a padding slice; else
    b_bufs is a_bufs), filled and freed through slots."""

    x_bufs: gl.shared_memory_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    slots: Slots
    WG: gl.constexpr

    @gluon.jit
    def wait(self, j, wg: gl.constexpr):
        """MMA partition wg's step j: its x box, the A box and the third slice's, once the slot's loads landed."""
        i = j % self.slots.STAGES
        x_buf = self.x_bufs.index(i * self.WG + wg)
        a_buf = self.a_bufs.index(i)
        b_buf = self.b_bufs.index(i)
        self.slots.wait(j)
        return x_buf, a_buf, b_buf


@gluon.jit
def _shrink_loader(ring, pieces, x_desc, x16_desc, a_desc, max_rank, a_slice_rows, G: gl.constexpr):
    """The loader warp: every K step of this program's pieces with an adapter, in the MMA warps' order; step j
    into ring slot j % STAGES once the MMAs of step j - STAGES have freed it. An MMA partition's rows of a piece
    come as one x box where the piece fills them, else as boxes of 16 rows up to the piece's end; a box the piece
    does not reach is placed wholly past x's last row (TMA fills it with zeros and reads nothing), so every step
    brings the same bytes. A: G slices of a_slice_rows rows, max_rank per adapter slot."""
    lo, hi = pieces.rows()
    num_tokens = pieces.num_tokens
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    R: gl.constexpr = a_desc.block_type.shape[0]
    k_tiles = gl.cdiv(x_desc.shape[1], BLOCK_K)
    XM: gl.constexpr = x_desc.block_type.shape[0]  # rows of an x box: one per MMA partition
    XS: gl.constexpr = x16_desc.block_type.shape[0]  # rows of a box of a piece's last rows
    WG: gl.constexpr = ring.WG
    step_bytes: gl.constexpr = WG * x_desc.block_type.nbytes + G * a_desc.block_type.nbytes
    j = 0
    r = lo
    while r < hi:
        end, slot, rank, _ = pieces.piece(r, hi)
        a_row = gl.maximum(slot, 0) * max_rank
        for ki in range(gl.where(rank > 0, k_tiles, 0)):
            i, bar = ring.slots.fill(j, step_bytes)
            for w in gl.static_range(WG):
                m = r + w * XM
                dst = ring.x_bufs.index(i * WG + w)
                if (end - m >= XM) | (end <= m):
                    _tma_load(x_desc, [gl.where(end > m, m, num_tokens), ki * BLOCK_K], bar, dst)
                else:
                    for q in gl.static_range(XM // XS):
                        row = gl.where(m + q * XS < end, m + q * XS, num_tokens)
                        _tma_load(x16_desc, [row, ki * BLOCK_K], bar, dst.slice(q * XS, XS, dim=0))
            for g in gl.static_range(G):
                if G == 3 and g == 2:
                    dst_a = ring.b_bufs.index(i)
                else:
                    dst_a = ring.a_bufs.index(i).slice(g * R, R, dim=0)
                _tma_load(a_desc, [g * a_slice_rows + a_row, ki * BLOCK_K], bar, dst_a)
            j += 1
        r = end


@gluon.jit
def _shrink_mmas(ring, pieces, so, k_tiles, wg: gl.constexpr, SCALED: gl.constexpr):
    """MMA partition wg (of WG): per step wait for its slot, issue its MMAs on its BLOCK_M rows of the slot's x
    box, free the step before's slot once those MMAs are done; per piece store its rows of s through so up to the
    piece's end (SCALED: times the segment's scale; rows of the box past the end hold other rows or zeros and are
    dropped), zeros for a piece without an adapter. Nothing but MMAs writes the accumulators: any other write
    makes ptxas serialize every MMA of the kernel (C7515)."""
    G: gl.constexpr = so.SHRINK_G
    R: gl.constexpr = so.SHRINK_R
    BLOCK_M: gl.constexpr = so.BLOCK_M
    SPLIT: gl.constexpr = G == 3
    N_A: gl.constexpr = 2 * R if SPLIT else G * R
    N_B: gl.constexpr = R if SPLIT else 16
    GROUPS: gl.constexpr = 2 if SPLIT else 1  # MMAs a step commits
    layout_a: gl.constexpr = _mma_layout(N_A, so.num_warps)
    layout_b: gl.constexpr = _mma_layout(N_B, so.num_warps)
    lo, hi = pieces.rows()
    acc_a = gl.zeros((BLOCK_M, N_A), dtype=gl.float32, layout=layout_a)
    acc_b = gl.zeros((BLOCK_M, N_B), dtype=gl.float32, layout=layout_b)
    j = 0
    r = lo
    while r < hi:
        end, slot, rank, scale = pieces.piece(r, hi)
        m0 = r + wg * BLOCK_M
        for ki in range(gl.where(rank > 0, k_tiles, 0)):
            x_buf, a_buf, b_buf = ring.wait(j, wg)
            tok_a = warpgroup_mma(x_buf, a_buf.permute((1, 0)), acc_a, use_acc=ki > 0, is_async=True)
            tok_b = acc_b
            if SPLIT:
                tok_b = warpgroup_mma(x_buf, b_buf.permute((1, 0)), acc_b, use_acc=ki > 0, is_async=True)
            acc_a, acc_b, _, _, _ = warpgroup_mma_wait(GROUPS, deps=(tok_a, tok_b, x_buf, a_buf, b_buf))
            if j > 0:
                ring.slots.free(j - 1)
            j += 1
        out_a, out_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
        if SCALED:
            out_a = out_a * scale
            out_b = out_b * scale
        # rank 0 (no adapter, nothing loaded): SOut.store drops every column, so the piece's s is zeros
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
    ring = Ring(x_bufs, a_bufs, b_bufs, _slots(STAGES, WG), WG)
    pieces = Pieces(token_seg_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr,
                    num_tokens, num_blocks, WG * BLOCK_M)  # fmt: skip
    so = SOut(s_ptr, s_cols, stride_ss, stride_st, G, R, BLOCK_M, num_warps)
    # MMA partition 0 (the default partition, num_warps warps), MMA partitions 1..WG-1, the loader warp; written
    # out per WG (a partition is a literal (function, arguments) pair)
    if WG == 1:
        gl.warp_specialize(
            [
                (_shrink_mmas, (ring, pieces, so, k_tiles, 0, SCALED)),
                (_shrink_loader, (ring, pieces, x_desc, x16_desc, a_desc, max_rank, a_slice_rows, G)),
            ],
            [1],
            [40],
        )
    elif WG == 2:
        gl.warp_specialize(
            [
                (_shrink_mmas, (ring, pieces, so, k_tiles, 0, SCALED)),
                (_shrink_mmas, (ring, pieces, so, k_tiles, 1, SCALED)),
                (_shrink_loader, (ring, pieces, x_desc, x16_desc, a_desc, max_rank, a_slice_rows, G)),
            ],
            [num_warps, 1],
            [MMA_REGS, 40],
        )
    else:
        gl.static_assert(WG == 3, "1-3 MMA partitions")
        gl.warp_specialize(
            [
                (_shrink_mmas, (ring, pieces, so, k_tiles, 0, SCALED)),
                (_shrink_mmas, (ring, pieces, so, k_tiles, 1, SCALED)),
                (_shrink_mmas, (ring, pieces, so, k_tiles, 2, SCALED)),
                (_shrink_loader, (ring, pieces, x_desc, x16_desc, a_desc, max_rank, a_slice_rows, G)),
            ],
            [num_warps, num_warps, 1],
            [MMA_REGS, MMA_REGS, 40],
        )
    ring.slots.invalidate()
