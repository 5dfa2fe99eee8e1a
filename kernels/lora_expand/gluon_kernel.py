"""The segmented in-place LoRA expand in Gluon for Hopper (sm_90): y[t, cols_g] += scale(t) · s[g, t, :rank] ·
B[slot(t), cols_g, :rank]ᵀ.

The expand reads and writes y (679 MB for QKV on 4 requests of 4608 tokens) and re-reads a B tile from L2 for
every y tile; at rank 128 its MMAs are a third of the time the bytes take, so a kernel that waits for them
between loads (the Triton row-stationary kernel: 74-80 % of the HBM floor at rank 128, 86-94 % at ranks 16-64)
loses what a kernel overlapping them keeps. Here the warps are specialised. The tiles (row block, column block)
of the batch, row-major, are cut into one equal span per program (one program per SM). A loader warp walks the
span's tiles with an adapter and puts each one's B box [BLOCK_N, R] (its slot's rows of B) and y box
[BLOCK_M, BLOCK_N] into a ring slot, as soon as that slot is free (`empty`); the compute warps, once per row
block and slice, load that slice's s rows (fp32), scale them and keep them in shared memory as the MMA's
first operand (x's dtype); per tile they wait for the slot (`ready`), load its y box into the accumulator,
issue y + s · Bᵀ as one warpgroup MMA, write the sum back into the slot's y box and store it with TMA, and free
the slot LAG tiles later, once the stores before have left it. With WG compute partitions (one warpgroup
each) partition p takes the span's tiles j ≡ p (mod WG), with its own scaled s: one partition's loads from and
stores into shared memory overlap another's MMAs, where one partition runs them one after the other. A slot
always serves the same partition (STAGES a multiple of WG), which frees it in order. Row blocks without an
adapter are skipped: their y is not touched.

Contract (the launcher checks it): bf16/fp16 y and B; y += delta only (no bias, accumulate); every segment
starts at a multiple of BLOCK_M (a row block holds one segment); every slice whole column blocks; y and B laid
out for TMA.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ditserve.kernels._gluon import (
    Scalar,
    Slots,
    _mma_layout,
    _segment_adapter,
    _slots,
    _tma_load,
    _tma_store,
    aggregate,
    fence_async_shared,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@aggregate
class Tiles:
    """The batch's num_tiles tiles (row block of BLOCK_M rows, column block), row-major over num_col_blocks
    column blocks, cut into one equal span per program (the first num_tiles % programs one tile more); a tile's
    adapter from its row block's segment. blk1..blk3: the first column block of slices 1..3 (num_col_blocks when
    absent)."""

    token_seg_ptr: gl.tensor
    seg_slot_ptr: gl.tensor
    slot_rank_ptr: gl.tensor
    seg_scale_ptr: gl.tensor
    num_col_blocks: Scalar
    num_tiles: Scalar
    blk1: Scalar
    blk2: Scalar
    blk3: Scalar
    BLOCK_M: gl.constexpr

    @gluon.jit
    def span(self):
        """This program's tiles [lo, hi)."""
        nprog = gl.num_programs(0)
        pid = gl.program_id(0)
        per = self.num_tiles // nprog
        rem = self.num_tiles % nprog
        lo = pid * per + gl.minimum(pid, rem)
        return lo, lo + per + (pid < rem).to(gl.int32)

    @gluon.jit
    def at(self, t, prev_rb, slot, rank, scale):
        """Tile t's (row block, column block) and its row block's (slot, rank, scale): loaded where the row block
        is not prev_rb, else the ones given."""
        rb = t // self.num_col_blocks
        cb = t - rb * self.num_col_blocks
        if rb != prev_rb:
            # a row block holds one segment: its first row's
            seg = gl.load(self.token_seg_ptr + rb * self.BLOCK_M)
            slot, rank, scale = _segment_adapter(
                seg, self.seg_slot_ptr, self.slot_rank_ptr, self.seg_scale_ptr
            )
        return rb, cb, slot, rank, scale

    @gluon.jit
    def slice(self, cb):
        """Column block cb's output slice."""
        return (cb >= self.blk1).to(gl.int32) + (cb >= self.blk2).to(gl.int32) + (cb >= self.blk3).to(gl.int32)  # fmt: skip


@aggregate
class Ring:
    """The ring's slots: a tile's y box in y_bufs and B box in b_bufs, filled and freed through slots."""

    y_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    slots: Slots

    @gluon.jit
    def wait(self, j):
        """Step j's y and B boxes, once the slot's loads have landed."""
        i = j % self.slots.STAGES
        y_buf = self.y_bufs.index(i)
        b_buf = self.b_bufs.index(i)
        self.slots.wait(j)
        return y_buf, b_buf


@aggregate
class ScaledS:
    """The MMAs' first operand: scale · s[g, rows, :R] of a row block and slice, loaded from s (fp32, rank_dim
    columns, strides stride_ss, stride_st) by num_warps warps, TPW_N threads of a warp along its columns, into
    compute partition p's s_smem[p] (x's dtype)."""

    s_ptr: gl.tensor
    s_smem: gl.shared_memory_descriptor
    num_tokens: Scalar
    rank_dim: Scalar
    stride_ss: Scalar
    stride_st: Scalar
    R: gl.constexpr
    TPW_N: gl.constexpr
    num_warps: gl.constexpr

    @gluon.jit
    def load(self, s_own, g, m0, rank, scale, BLOCK_M: gl.constexpr):
        """scale · s[g, m0:m0 + BLOCK_M, :R] into s_own (columns past the slot's rank and rows past the batch
        zero)."""
        layout: gl.constexpr = gl.BlockedLayout(
            [1, 4], [32 // self.TPW_N, self.TPW_N], [self.num_warps, 1], [1, 0]
        )
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, self.R, layout=gl.SliceLayout(0, layout))
        ptrs = (
            self.s_ptr
            + g.to(gl.int64) * self.stride_ss
            + rows.to(gl.int64)[:, None] * self.stride_st
            + cols[None, :]
        )
        mask = (rows < self.num_tokens)[:, None] & (cols < gl.minimum(rank, self.rank_dim))[None, :]
        sv = gl.load(ptrs, mask=mask, other=0.0) * scale
        s_own.store(sv.to(s_own.dtype))
        fence_async_shared()


@gluon.jit
def _expand_loader(ring, tiles, y_desc, b_desc, n_total):
    """The loader warp: the B and y boxes of every tile of this program's span with an adapter, in the compute
    warps' order; tile j into ring slot j % STAGES once the compute warps have freed it. B: n_total rows per
    adapter slot."""
    BLOCK_M: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    lo, hi = tiles.span()
    step_bytes: gl.constexpr = y_desc.block_type.nbytes + b_desc.block_type.nbytes
    j = 0
    rb = -1
    slot = 0
    rank = 0
    scale = 0.0
    for t in range(lo, hi):
        rb, cb, slot, rank, scale = tiles.at(t, rb, slot, rank, scale)
        if rank > 0:
            i, bar = ring.slots.fill(j, step_bytes)
            _tma_load(b_desc, [slot * n_total + cb * BLOCK_N, 0], bar, ring.b_bufs.index(i))
            _tma_load(y_desc, [rb * BLOCK_M, cb * BLOCK_N], bar, ring.y_bufs.index(i))
            j += 1


@gluon.jit
def _expand_compute(ring, tiles, s_in, y_desc, LAG: gl.constexpr, WG: gl.constexpr, PART: gl.constexpr):
    """Compute partition PART of WG: per row block and slice its scaled s into its s_smem; per tile of its
    own (the span's adapter tiles j ≡ PART mod WG) y + s · Bᵀ in the accumulator (y loaded into it from the
    slot), the sum back into the slot and out with TMA; the slot of its tile LAG before freed once at most LAG
    of its stores are still reading their slots."""
    BLOCK_M: gl.constexpr = y_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = y_desc.block_type.shape[1]
    mma_layout: gl.constexpr = _mma_layout(BLOCK_N, s_in.num_warps)
    lo, hi = tiles.span()
    s_own = s_in.s_smem.index(PART)
    j = 0  # the span's adapter tiles so far (every partition's)
    prev_rb = -1  # the row block of the tile before (for its segment)
    s_rb = -1  # the row block and slice s_own holds
    s_g = -1
    slot = 0
    rank = 0
    scale = 0.0
    for t in range(lo, hi):
        rb, cb, slot, rank, scale = tiles.at(t, prev_rb, slot, rank, scale)
        if rank > 0:
            if j % WG == PART:
                g = tiles.slice(cb)
                if (rb != s_rb) | (g != s_g):
                    # the MMAs that read s_own are done (each tile waits for its own)
                    s_in.load(s_own, g, rb * BLOCK_M, rank, scale, BLOCK_M)
                    s_rb = rb
                    s_g = g
                y_buf, b_buf = ring.wait(j)
                acc = y_buf.load(mma_layout).to(gl.float32)
                tok = warpgroup_mma(s_own, b_buf.permute((1, 0)), acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(0, deps=(tok, s_own, b_buf))
                y_buf.store(acc.to(y_desc.dtype))
                fence_async_shared()
                _tma_store(y_desc, [rb * BLOCK_M, cb * BLOCK_N], y_buf)
                # the stores of this partition's tiles up to j - LAG · WG have read their slots
                tma.store_wait(pendings=LAG)
                if j >= LAG * WG:
                    ring.slots.free(j - LAG * WG)
            j += 1
        prev_rb = rb
    tma.store_wait(pendings=0)


@gluon.jit
def _gluon_lora_expand_kernel(
    y_desc,  # y [num_tokens, n_total], box [BLOCK_M, BLOCK_N], read and written
    b_desc,  # B viewed as [max_loras · n_total, max_rank], box [BLOCK_N, R]
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32 (unscaled, from the shrink)
    token_seg_ptr,  # [num_tokens] int32
    seg_slot_ptr,  # [num_segments] int32, -1 = no LoRA
    seg_scale_ptr,  # [num_segments] fp32
    slot_rank_ptr,  # [max_loras] int32
    num_tokens,
    rank_dim,  # columns of s
    n_total,  # columns of y
    stride_ss,
    stride_st,
    num_col_blocks,
    num_tiles,  # row blocks × column blocks
    blk1,  # first column block of slices 1..3 (num_col_blocks when absent)
    blk2,
    blk3,
    R: gl.constexpr,  # rank tile (power of two ≥ 16)
    BLOCK_M: gl.constexpr,  # rows of a tile, a multiple of 16 · num_warps (a partition's MMA covers it)
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,  # ring slots, a multiple of WG
    LAG: gl.constexpr,  # TMA stores of y a partition has in flight before it frees a slot
    TPW_N: gl.constexpr,  # threads of a warp along s's columns when loading it
    WG: gl.constexpr,  # compute partitions (1-2) of num_warps warps
    MMA_REGS: gl.constexpr,  # registers per thread of the second partition (gluon_op.partition_regs)
    num_warps: gl.constexpr,
):
    y_bufs = gl.allocate_shared_memory(y_desc.dtype, [STAGES, BLOCK_M, BLOCK_N], y_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, R], b_desc.layout)
    # the MMA's first operand: B's box layout fits it (the swizzle follows the R columns alone)
    s_smem = gl.allocate_shared_memory(b_desc.dtype, [WG, BLOCK_M, R], b_desc.layout)
    ring = Ring(y_bufs, b_bufs, _slots(STAGES, 1))
    tiles = Tiles(token_seg_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr, num_col_blocks, num_tiles, blk1, blk2,
                  blk3, BLOCK_M)  # fmt: skip
    s_in = ScaledS(s_ptr, s_smem, num_tokens, rank_dim, stride_ss, stride_st, R, TPW_N, num_warps)
    if WG == 1:
        gl.warp_specialize(
            [
                (_expand_compute, (ring, tiles, s_in, y_desc, LAG, WG, 0)),
                (_expand_loader, (ring, tiles, y_desc, b_desc, n_total)),
            ],
            [1],
            [40],
        )
    else:
        gl.static_assert(WG == 2, "1-2 compute partitions")
        gl.warp_specialize(
            [
                (_expand_compute, (ring, tiles, s_in, y_desc, LAG, WG, 0)),
                (_expand_compute, (ring, tiles, s_in, y_desc, LAG, WG, 1)),
                (_expand_loader, (ring, tiles, y_desc, b_desc, n_total)),
            ],
            [num_warps, 1],
            [MMA_REGS, 40],
        )
    ring.slots.invalidate()
