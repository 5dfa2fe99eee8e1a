"""The base GEMM with the segmented LoRA expand, written in Gluon for Hopper (sm_90):

    y[t, n] = Σ_k x[t, k] · W[n, k] (+ bias[n]) + Σ_r s[j(n), t, r] · B[slot(t), n, r]      (s pre-scaled)

The Triton kernel (kernel.py) adds the LoRA term as one more 64-wide step of its K loop, because every
step of a Triton loop has the same shape: a rank-16 adapter then costs a 64-wide tensor-core step on every
tile (1 of 49 steps at hidden 3072). Here the pipeline is written out by hand (TMA loads into a ring of
NUM_BUFFERS shared-memory slots completed on mbarriers, asynchronous warpgroup MMAs with one in flight), so
the LoRA step can load its s and B tiles through the same ring and multiply only LORA_K of their columns:
one 16-wide MMA for a rank-16 adapter, a quarter of a base step.

One program per SM walks its tiles (tile_id = pid, pid + P, ...) in grouped order (GROUP_M row blocks per
column block; column blocks are cut per output slice, so a tile lies in one slice j). Every tile runs
k_tiles base steps, then (HAS_LORA) lora_steps LoRA steps: s[j] rows m0.. and B[slot] rows n0.. (columns
ri·BLOCK_K..), both loaded as [rows, BLOCK_K] boxes; the columns past the tensors' widths and, for a tile
whose rows have no adapter, the whole box (its coordinates point past the last row) come back as zeros and
move no bytes. The ring runs across tile boundaries: the loads of the next tile's first steps are in flight
while this tile's epilogue (bias, bf16, a TMA store) runs, and with DEFER the second half of that store waits
in registers until the next tile's first MMA has started, so the tensor cores idle for half of it.

Contract (the launcher checks it): bf16/fp16 x, W, s, B; s pre-scaled in x's dtype; every segment starts
at a multiple of BLOCK_M (a tile's rows hold one segment); every output slice a multiple of BLOCK_N; x, W,
s, B, y laid out for TMA.

_gluon_lora_linear_kernel is the same GEMM with the shrink inside the launch (s = scale · x · Aᵀ, written
by shrink units of one row block each, see its docstring): `gluon_op.launch_gluon_lora_linear`, for ranks
up to 64.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ditserve.kernels._gluon import (
    Scalar,
    SOut,
    _cta_barrier,
    _mma_layout,
    _tma_load,
    _tma_store,
    aggregate,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@aggregate
class TileOrder:
    """The persistent grid's tiles in grouped order (GROUP_M row blocks per column block; column blocks cut per
    output slice, so a tile lies in one slice j): program pid takes tiles pid + idx · nprog. col1..col3 / blk1..blk3:
    the first column / column block of slices 1..3 (n_total / num_col_blocks when absent)."""

    pid: Scalar
    nprog: Scalar
    num_tiles: Scalar
    num_pid_m: Scalar
    num_col_blocks: Scalar
    col1: Scalar
    col2: Scalar
    col3: Scalar
    blk1: Scalar
    blk2: Scalar
    blk3: Scalar
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    GROUP_M: gl.constexpr

    @gluon.jit
    def origin(self, tile_id):
        """Tile tile_id → (its slice j, first row m0, first column n0)."""
        num_in_group = self.GROUP_M * self.num_col_blocks
        group = tile_id // num_in_group
        first_m = group * self.GROUP_M
        group_size = gl.minimum(self.num_pid_m - first_m, self.GROUP_M)
        local = tile_id - group * num_in_group
        pid_m = first_m + local % group_size
        pid_n = local // group_size
        blk1 = self.blk1
        blk2 = self.blk2
        blk3 = self.blk3
        j = (pid_n >= blk1).to(gl.int32) + (pid_n >= blk2).to(gl.int32) + (pid_n >= blk3).to(gl.int32)
        col_lo = gl.where(j == 0, 0, gl.where(j == 1, self.col1, gl.where(j == 2, self.col2, self.col3)))
        blk_lo = gl.where(j == 0, 0, gl.where(j == 1, blk1, gl.where(j == 2, blk2, blk3)))
        return j, pid_m * self.BLOCK_M, col_lo + (pid_n - blk_lo) * self.BLOCK_N

    @gluon.jit
    def at(self, idx):
        """This program's tile idx (the last tile past the end: loads for it are predicated off)."""
        return gl.minimum(self.pid + idx * self.nprog, self.num_tiles - 1)

    @gluon.jit
    def group_units(self, g):
        """The shrink units (row blocks) of group g: the count its tiles wait for."""
        return gl.minimum(self.num_pid_m - g * self.GROUP_M, self.GROUP_M)


@aggregate
class Ring:
    """What the pipeline loads and where: x and W boxes for the K steps (k_tiles of BLOCK_K), s[j] and B[slot]
    boxes for the LoRA steps (HAS_LORA; LORA_K of their columns multiplied), into NUM_BUFFERS slots of a_bufs /
    w_bufs completed on bars. The LoRA rows: s[j] rows j · num_tokens + m0 and B rows slot · n_total + n0, or
    s_rows_total / b_rows_total (past the last row: zeros, no bytes) where a tile's rows have no adapter."""

    x_desc: gl.base_value
    w_desc: gl.base_value
    s_desc: gl.base_value
    b_desc: gl.base_value
    a_bufs: gl.shared_memory_descriptor
    w_bufs: gl.shared_memory_descriptor
    bars: gl.shared_memory_descriptor
    k_tiles: Scalar
    num_tokens: Scalar
    n_total: Scalar
    s_rows_total: Scalar
    b_rows_total: Scalar
    token_seg_ptr: gl.tensor
    seg_slot_ptr: gl.tensor
    BLOCK_K: gl.constexpr
    LORA_K: gl.constexpr
    NUM_BUFFERS: gl.constexpr
    HAS_LORA: gl.constexpr

    @gluon.jit
    def origin(self, order, tile_id):
        """Where the loads of tile tile_id start: x/W rows m0 / n0, and the rows of s[j] and B[slot] for its LoRA
        steps. Computed once per tile (the steps in between only advance the K coordinate)."""
        j, m0, n0 = order.origin(tile_id)
        s_row = self.s_rows_total
        b_row = self.b_rows_total
        if self.HAS_LORA:
            slot = gl.load(self.seg_slot_ptr + gl.load(self.token_seg_ptr + m0))
            here = slot >= 0
            s_row = gl.where(here, j * self.num_tokens + m0, self.s_rows_total)
            b_row = gl.where(here, gl.maximum(slot, 0) * self.n_total + n0, self.b_rows_total)
        return m0, n0, s_row, b_row

    @gluon.jit
    def load(self, p_step, p_ki, pred, m0, n0, s_row, b_row):
        """The TMA loads of one pipeline step (K step p_ki of a tile; p_ki ≥ k_tiles: its LoRA steps) into slot
        p_step % NUM_BUFFERS (nothing where pred is false: past this program's last tile)."""
        slot_i = p_step % self.NUM_BUFFERS
        bar = self.bars.index(slot_i)
        mbarrier.expect(bar, self.x_desc.block_type.nbytes + self.w_desc.block_type.nbytes, pred=pred)
        if self.HAS_LORA:
            if p_ki < self.k_tiles:
                _tma_load(self.x_desc, [m0, p_ki * self.BLOCK_K], bar, self.a_bufs.index(slot_i), pred)
                _tma_load(self.w_desc, [n0, p_ki * self.BLOCK_K], bar, self.w_bufs.index(slot_i), pred)
            else:
                kk = (p_ki - self.k_tiles) * self.BLOCK_K
                _tma_load(self.s_desc, [s_row, kk], bar, self.a_bufs.index(slot_i), pred)
                _tma_load(self.b_desc, [b_row, kk], bar, self.w_bufs.index(slot_i), pred)
        else:
            _tma_load(self.x_desc, [m0, p_ki * self.BLOCK_K], bar, self.a_bufs.index(slot_i), pred)
            _tma_load(self.w_desc, [n0, p_ki * self.BLOCK_K], bar, self.w_bufs.index(slot_i), pred)

    @gluon.jit
    def lora_mma(self, a_buf, w_buf, acc):
        """A LoRA step's MMA (asynchronous): s · Bᵀ over the slot's boxes, only their first LORA_K columns where
        that is all the rank columns (a narrower MMA)."""
        if self.LORA_K == self.BLOCK_K:
            tok = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, is_async=True)
        else:
            a_l = a_buf.slice(0, self.LORA_K, dim=1)
            w_l = w_buf.slice(0, self.LORA_K, dim=1)
            tok = warpgroup_mma(a_l, w_l.permute((1, 0)), acc, is_async=True)
        return tok

    @gluon.jit
    def mma(self, acc, step, i, k_lo, k_hi):
        """Ring step `step`, the i-th of a run of the K steps k_lo..k_hi - 1 followed by the LoRA steps: wait for
        its slot, start its MMA, and wait for the MMA before it (so the slot that one read can be loaded again)."""
        slot_i = step % self.NUM_BUFFERS
        mbarrier.wait(self.bars.index(slot_i), (step // self.NUM_BUFFERS) & 1)
        a_buf = self.a_bufs.index(slot_i)
        w_buf = self.w_bufs.index(slot_i)
        if self.HAS_LORA:
            if _piece_ki(k_lo + i, k_hi, self.k_tiles) < self.k_tiles:
                tok = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, use_acc=i > 0, is_async=True)
            else:
                tok = self.lora_mma(a_buf, w_buf, acc)
        else:
            tok = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, use_acc=i > 0, is_async=True)
        acc, _, _ = warpgroup_mma_wait(1, deps=(tok, a_buf, w_buf))
        return acc


@aggregate
class Fold:
    """FOLD: a tile's s and B boxes (LORA_K columns) in buffers of their own (l_s, l_b, completed on lbar), its
    LoRA MMA after its last K step's; without FOLD the fields are placeholders, never used."""

    s_desc: gl.base_value
    b_desc: gl.base_value
    l_s: gl.shared_memory_descriptor
    l_b: gl.shared_memory_descriptor
    lbar: gl.shared_memory_descriptor
    FOLD: gl.constexpr

    @gluon.jit
    def load(self, s_row, b_row):
        """A tile's s and B boxes into their buffers, completed on lbar."""
        bar = self.lbar.index(0)
        mbarrier.expect(bar, self.s_desc.block_type.nbytes + self.b_desc.block_type.nbytes)
        _tma_load(self.s_desc, [s_row, 0], bar, self.l_s)
        _tma_load(self.b_desc, [b_row, 0], bar, self.l_b)

    @gluon.jit
    def mma(self, acc, phase):
        """acc + s · Bᵀ from the buffers, once their loads (barrier phase `phase`) are in."""
        mbarrier.wait(self.lbar.index(0), phase)
        tok = warpgroup_mma(self.l_s, self.l_b.permute((1, 0)), acc, is_async=True)
        acc, _ls, _lb = warpgroup_mma_wait(0, deps=(tok, self.l_s, self.l_b))
        return acc


@gluon.jit
def _fold(ring, FOLD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """FOLD's buffers and barrier (shared memory for a tile's s and B boxes), else the ring's as placeholders."""
    l_s, l_b, lbar = ring.a_bufs, ring.w_bufs, ring.bars
    if FOLD:
        s_desc = ring.s_desc
        l_s = gl.allocate_shared_memory(s_desc.dtype, [BLOCK_M, ring.LORA_K], s_desc.layout)
        l_b = gl.allocate_shared_memory(s_desc.dtype, [BLOCK_N, ring.LORA_K], ring.b_desc.layout)
        lbar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(lbar.index(0), count=1)
    return Fold(ring.s_desc, ring.b_desc, l_s, l_b, lbar, FOLD)


@aggregate
class Out:
    """The epilogue: y tiles (+ bias, HAS_BIAS) through c_smem and TMA stores to y_desc, whole (EPI_SPLIT 1) or
    in EPI_SPLIT column chunks through EPI_BUFS chunk buffers (c_smem [EPI_BUFS, BLOCK_M, BLOCK_N // EPI_SPLIT]):
    a smaller staging buffer than the tile, which leaves shared memory for one more ring slot."""

    y_desc: gl.base_value
    c_smem: gl.shared_memory_descriptor
    bias_ptr: Scalar
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    HAS_BIAS: gl.constexpr
    EPI_SPLIT: gl.constexpr
    EPI_BUFS: gl.constexpr
    num_warps: gl.constexpr

    @gluon.jit
    def with_bias(self, acc, n0):
        """acc (+ bias[n0:n0 + BLOCK_N] in each row)."""
        mma_layout: gl.constexpr = _mma_layout(self.BLOCK_N, self.num_warps)
        out = acc
        if self.HAS_BIAS:
            offs_n = n0 + gl.arange(0, self.BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            out = out + gl.load(self.bias_ptr + offs_n).to(gl.float32)[None, :]
        return out

    @gluon.jit
    def store_quarters(self, h, m0, n0):
        """A [BLOCK_M, BLOCK_N // 2] half of a tile of y as two chunks through the chunk buffers (EPI_SPLIT 4)."""
        H: gl.constexpr = self.BLOCK_N // 2
        Q: gl.constexpr = H // 2
        h0, h1 = _halves(h, self.BLOCK_M, H)
        _store_y(h0, self.c_smem.index(0), self.y_desc, m0, n0, self.EPI_BUFS - 1)
        _store_y(h1, self.c_smem.index(self.EPI_BUFS - 1), self.y_desc, m0, n0 + Q, self.EPI_BUFS - 1)

    @gluon.jit
    def store_chunks(self, out, m0, n0):
        """A tile of y as EPI_SPLIT column chunks (2 or 4)."""
        H: gl.constexpr = self.BLOCK_N // 2
        a, b = _halves(out, self.BLOCK_M, self.BLOCK_N)
        if self.EPI_SPLIT == 2:
            _store_y(a, self.c_smem.index(0), self.y_desc, m0, n0, 0)
            _store_y(b, self.c_smem.index(self.EPI_BUFS - 1), self.y_desc, m0, n0 + H, self.EPI_BUFS - 1)
        else:
            self.store_quarters(a, m0, n0)
            self.store_quarters(b, m0, n0 + H)

    @gluon.jit
    def epilogue(self, acc, m0, n0, STORE: gl.constexpr = True):
        """acc (+ bias) in y's dtype: stored (STORE), else kept in c_smem once its last store has left it."""
        out = self.with_bias(acc, n0)
        if STORE:
            if self.EPI_SPLIT == 1:
                _store_y(out.to(self.y_desc.dtype), self.c_smem, self.y_desc, m0, n0)
            else:
                self.store_chunks(out.to(self.y_desc.dtype), m0, n0)
        else:
            tma.store_wait(pendings=0)
            self.c_smem.store(out.to(self.y_desc.dtype))


@gluon.jit
def _advance(prod, steps_per_tile, order, ring):
    """The producer (p_step, its tile p_idx and K step p_ki, where that tile's loads start) one step on."""
    p_step, p_idx, p_ki, m0p, n0p, s_row, b_row = prod
    p_step += 1
    p_ki += 1
    if p_ki == steps_per_tile:
        p_ki = 0
        p_idx += 1
        m0p, n0p, s_row, b_row = ring.origin(order, order.at(p_idx))
    return p_step, p_idx, p_ki, m0p, n0p, s_row, b_row


@gluon.jit
def _step(acc, ki, step, prod, idx_hi, steps_per_tile, order, ring):
    """Pipeline step `step` (step ki of its tile): wait for its slot, start its MMA, wait for the MMA before it,
    and send the producer's loads (NUM_BUFFERS - 1 steps ahead) into the slot that MMA read; the producer moves
    on."""
    acc = ring.mma(acc, step, ki, 0, ring.k_tiles)
    p_step, p_idx, p_ki, m0p, n0p, s_row, b_row = prod
    ring.load(p_step, p_ki, p_idx < idx_hi, m0p, n0p, s_row, b_row)
    p_ki += 1
    if p_ki == steps_per_tile:
        p_ki = 0
        p_idx += 1
        m0p, n0p, s_row, b_row = ring.origin(order, order.at(p_idx))
    return acc, step + 1, (p_step + 1, p_idx, p_ki, m0p, n0p, s_row, b_row)


@gluon.jit
def _piece_ki(k, k_hi, k_tiles):
    """A tail piece's step k (from its first K step): the K step k below k_hi, then the LoRA steps."""
    return gl.where(k < k_hi, k, k_tiles + k - k_hi)


@gluon.jit
def _wait_at_least(ptr, value):
    """Spin until *ptr ≥ value (acquire), then fence the async proxy: what other programs stored through
    the generic proxy before raising *ptr is then visible to this program's TMA loads."""
    while gl.atomic_add(ptr, 0, sem="acquire", scope="gpu") < value:
        pass
    gl.inline_asm_elementwise(
        "fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [value], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _acquire_seen(ptr, value, seen):
    """`_wait_at_least(ptr, value)` after a relaxed read `seen` of *ptr: where that read already saw value,
    only the fences (acquire, then the async proxy's)."""
    if seen < value:
        _wait_at_least(ptr, value)
    else:
        gl.inline_asm_elementwise(
            "fence.acq_rel.gpu; fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [value], dtype=gl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@gluon.jit
def _store_y(out, c_smem, y_desc, m0, n0, PENDING: gl.constexpr = 0):
    """A tile of y through shared memory and a TMA store (once all but PENDING of the stores before it have
    left shared memory: 0 where c_smem is the buffer the last store read)."""
    tma.store_wait(pendings=PENDING)
    c_smem.store(out)
    fence_async_shared()
    _tma_store(y_desc, [m0, n0], c_smem)


@gluon.jit
def _halves(t, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr):
    """A [BLOCK_M, WIDTH] register tile as its two column halves (in the MMA layout a split of registers)."""
    return gl.split(gl.permute(gl.reshape(t, [BLOCK_M, 2, WIDTH // 2]), [0, 2, 1]))


@gluon.jit
def _ring_buffers(x_desc, w_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  NUM_BUFFERS: gl.constexpr):  # fmt: skip
    """The ring's NUM_BUFFERS slots (an x or s box and a W or B box each) and their barriers."""
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_BUFFERS, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(bars.index(i), count=1)
    return a_bufs, w_bufs, bars


@gluon.jit
def _staging(x_desc, y_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, EPI_SPLIT: gl.constexpr,
             EPI_BUFS: gl.constexpr):  # fmt: skip
    """y's staging buffer (y in x's dtype): the whole tile, or EPI_BUFS chunks of BLOCK_N // EPI_SPLIT columns."""
    if EPI_SPLIT == 1:
        c_smem = gl.allocate_shared_memory(x_desc.dtype, [BLOCK_M, BLOCK_N], y_desc.layout)
    else:
        c_smem = gl.allocate_shared_memory(
            x_desc.dtype, [EPI_BUFS, BLOCK_M, BLOCK_N // EPI_SPLIT], y_desc.layout
        )
    return c_smem


@gluon.jit
def _gluon_lora_gemm_kernel(
    x_desc,  # x [num_tokens, hidden], block [BLOCK_M, BLOCK_K]
    w_desc,  # W [n_total, hidden], block [BLOCK_N, BLOCK_K]
    s_desc,  # HAS_LORA: s viewed as [num_slices · num_tokens, s_cols], block [BLOCK_M, BLOCK_K]
    b_desc,  # HAS_LORA: B viewed as [max_loras · n_total, max_rank], block [BLOCK_N, BLOCK_K]
    y_desc,  # y [num_tokens, n_total], block [BLOCK_M, BLOCK_N]
    bias_ptr,  # [n_total] (read only when HAS_BIAS)
    token_seg_ptr,  # [num_tokens] int32
    seg_slot_ptr,  # [num_segments] int32, -1 = no adapter
    num_tokens,
    n_total,
    col1,  # first column of slice 1 (n_total when absent), likewise col2, col3
    col2,
    col3,
    blk1,  # first column block of slice 1 (num_col_blocks when absent), likewise blk2, blk3
    blk2,
    blk3,
    num_col_blocks,
    lora_steps,  # HAS_LORA: cdiv(rank columns, BLOCK_K)
    s_rows_total,  # rows of s_desc: a row coordinate past every row
    b_rows_total,  # rows of b_desc
    ws_ptr,  # SPLIT_TAIL: fp32 [≥ tail tiles, BLOCK_M, BLOCK_N], zero between launches (each launch leaves it so)
    cnt_ptr,  # SPLIT_TAIL: int32 [≥ tail tiles], zero between launches: pieces of each tail tile summed so far
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    LORA_K: gl.constexpr,  # columns of the LoRA boxes each LoRA step multiplies (16, 32 or BLOCK_K)
    GROUP_M: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    num_warps: gl.constexpr,
    FOLD: gl.constexpr = False,  # the LoRA MMA after the last K step, s and B in buffers of their own (`_tiles`)
    SPLIT_TAIL: gl.constexpr = False,  # the last partial round of tiles cut along K (`_tail_piece`)
    EPI_SPLIT: gl.constexpr = 1,  # y stored in this many column chunks (1, 2, 4; y_desc's block is one chunk)
    EPI_BUFS: gl.constexpr = 1,  # staging buffers for those chunks (EPI_SPLIT > 1)
    DEFER: gl.constexpr = False,  # (EPI_SPLIT 4) a tile's second half of y stored during the next tile's first MMA
):
    """SPLIT_TAIL: where the tiles leave a last round that fills at most half the programs, those tail tiles
    are cut into `parts` pieces of contiguous K steps (parts = programs // tail tiles, at most k_tiles // 4),
    one piece per program, so the last round takes about 1 / parts of a tile instead of a whole one. Each
    piece adds its fp32 partial tile into ws with relaxed atomics and counts itself in cnt (acq_rel); the
    piece that completes the count reads the sum, leaves ws and cnt zeroed for the next launch, and runs the
    epilogue. The piece with the last K steps also runs the tile's LoRA steps (or FOLD's MMA)."""
    hidden = x_desc.shape[1]
    k_tiles = gl.cdiv(hidden, BLOCK_K)
    steps_per_tile = k_tiles
    if HAS_LORA:
        steps_per_tile += lora_steps
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(num_tokens, BLOCK_M)
    num_tiles = num_pid_m * num_col_blocks
    my_tiles = gl.cdiv(num_tiles - pid, nprog)

    a_bufs, w_bufs, bars = _ring_buffers(x_desc, w_desc, BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUFFERS)
    out = Out(y_desc, _staging(x_desc, y_desc, BLOCK_M, BLOCK_N, EPI_SPLIT, EPI_BUFS), bias_ptr, BLOCK_M, BLOCK_N, HAS_BIAS,
              EPI_SPLIT, EPI_BUFS, num_warps)  # fmt: skip
    ring = Ring(x_desc, w_desc, s_desc, b_desc, a_bufs, w_bufs, bars, k_tiles, num_tokens, n_total, s_rows_total,
                b_rows_total, token_seg_ptr, seg_slot_ptr, BLOCK_K, LORA_K, NUM_BUFFERS, HAS_LORA)  # fmt: skip
    fold = _fold(ring, FOLD, BLOCK_M, BLOCK_N)
    order = TileOrder(pid, nprog, num_tiles, num_pid_m, num_col_blocks, col1, col2, col3, blk1, blk2, blk3, BLOCK_M,
                      BLOCK_N, GROUP_M)  # fmt: skip

    full = num_tiles // nprog
    tail = num_tiles - full * nprog
    parts = 1
    if SPLIT_TAIL:
        parts = gl.where(tail > 0, gl.minimum(nprog // gl.maximum(tail, 1), k_tiles // 4), 1)
    dp_hi = my_tiles
    if parts > 1:
        dp_hi = full
    # step: a tensor from the start (it is carried through the loops)
    step = _tiles(gl.to_tensor(0), 0, dp_hi, steps_per_tile, order, ring, out, fold, DEFER=DEFER)
    if SPLIT_TAIL:
        if (parts > 1) & (pid < tail * parts):
            _tail_piece(step, pid // parts, pid % parts, parts, full, lora_steps, ws_ptr, cnt_ptr, order, ring, out,
                        fold)  # fmt: skip
    tma.store_wait(pendings=0)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _tail_piece(step, t, part, parts, full, lora_steps, ws_ptr, cnt_ptr, order, ring, out, fold):
    """Piece `part` of tail tile t (tile full · nprog + t): its K steps [k_lo, k_hi) through the ring (idle
    after the program's whole tiles), the last piece's LoRA steps, the partial tile into ws; the piece that
    completes the tile's count stores it (`_gluon_lora_gemm_kernel` SPLIT_TAIL)."""
    BLOCK_M: gl.constexpr = order.BLOCK_M
    BLOCK_N: gl.constexpr = order.BLOCK_N
    NUM_BUFFERS: gl.constexpr = ring.NUM_BUFFERS
    mma_layout: gl.constexpr = _mma_layout(BLOCK_N, out.num_warps)
    k_tiles = ring.k_tiles
    m0, n0, s_row, b_row = ring.origin(order, gl.minimum(full * order.nprog + t, order.num_tiles - 1))
    k_lo = (part * k_tiles) // parts
    k_hi = ((part + 1) * k_tiles) // parts
    last = part == parts - 1
    n = k_hi - k_lo
    if ring.HAS_LORA:
        if last:
            n += lora_steps
            if fold.FOLD:
                fold.load(s_row, b_row)
    for i in gl.static_range(NUM_BUFFERS - 1):
        ring.load(step + i, _piece_ki(k_lo + i, k_hi, k_tiles), i < n, m0, n0, s_row, b_row)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    for i in range(n):
        acc = ring.mma(acc, step, i, k_lo, k_hi)
        nxt = i + NUM_BUFFERS - 1
        ring.load(step + NUM_BUFFERS - 1, _piece_ki(k_lo + nxt, k_hi, k_tiles), nxt < n, m0, n0, s_row, b_row)
        step += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if fold.FOLD:
        if last:
            acc = fold.mma(acc, full & 1)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    ws = ws_ptr + t * (BLOCK_M * BLOCK_N) + rows[:, None] * BLOCK_N + cols[None, :]
    gl.atomic_add(ws, acc, sem="relaxed", scope="gpu")
    _cta_barrier()  # every thread's sums precede the count
    done = gl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu") + 1
    if done == parts:  # the tile's last piece to arrive: take the sum, leave zeros for the next launch
        total = gl.load(ws, cache_modifier=".cg")
        gl.store(ws, gl.zeros_like(total))
        gl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")
        out.epilogue(total, m0, n0)


@gluon.jit
def _group_ready(sync_ptr, g, want, known):
    """(whether group g's `want` units are all done, the last group known so): a relaxed read of its count
    unless g is `known`, acquired where it is complete."""
    ready = g == known
    if not ready:
        seen = gl.atomic_add(sync_ptr + g, 0, sem="relaxed", scope="gpu")
        ready = seen >= want
        if ready:
            _acquire_seen(sync_ptr + g, want, seen)
    if ready:
        known = g
    return ready, known


@gluon.jit
def _tiles(step, idx_lo, idx_hi, steps_per_tile, order, ring, out, fold, sync_ptr=None,
           STORE: gl.constexpr = True, WAIT: gl.constexpr = False, KEEP: gl.constexpr = False,
           LATE: gl.constexpr = False, DEFER: gl.constexpr = False):  # fmt: skip
    """This program's tiles idx_lo ≤ idx < idx_hi (tile order.pid + idx · nprog) as one pipeline, which starts and
    drains within the run: the producer (the step whose loads go out next, p_step, its tile p_idx and K step p_ki,
    and where that tile's loads start) sends the first NUM_BUFFERS - 1 steps before the first MMA, and the ring
    runs across the tile boundaries in between. `step` counts the ring steps consumed so far (the slot and its
    phase follow from it). STORE False: the (last) tile's output stays in c_smem (see _lora_fixup). WAIT (the
    shrink inside the launch, spread over the run): s of a tile's rows is there before the tile's loads go out:
    before the run for its first tile, and at each tile's end for the next tile where its group of row blocks
    changes (a group's units counted in sync_ptr[group]; the LoRA loads of a tile go out during its own K steps
    when k_tiles ≥ NUM_BUFFERS - 1, which the launcher checks). FOLD (STORE, no LoRA steps in the ring): each
    tile's s and B boxes go into buffers of their own (completed once per tile, phase idx & 1) as the tile
    starts, and its LoRA MMA follows its last K step's. KEEP (with STORE False, one tile): no epilogue; returns
    (step, the tile's x · Wᵀ in registers). LATE (WAIT and FOLD): a tile whose group's s is not all there as it
    starts runs its K steps anyway and waits after them, then loads its s and B boxes (instead of the run waiting
    before the tile's loads); the count is read once per group. DEFER (STORE, y in 4 chunks, not WAIT without
    LATE): a tile's second half of y stays in registers (bf16, 32 a thread: not an accumulator, so ptxas keeps
    the MMAs asynchronous) and is stored after the next tile's first MMA has started, so the tensor cores idle
    less for it; the run's last tile stores it at the run's end."""
    BLOCK_M: gl.constexpr = order.BLOCK_M
    BLOCK_N: gl.constexpr = order.BLOCK_N
    FOLD: gl.constexpr = fold.FOLD
    mma_layout: gl.constexpr = _mma_layout(BLOCK_N, out.num_warps)
    pid_r = order.pid
    nprog = order.nprog
    m0p, n0p, s_row, b_row = ring.origin(order, order.at(idx_lo))
    prod = (step, idx_lo, 0, m0p, n0p, s_row, b_row)
    for _i in gl.static_range(ring.NUM_BUFFERS - 1):
        p_step, p_idx, p_ki, m0p, n0p, s_row, b_row = prod
        ring.load(p_step, p_ki, p_idx < idx_hi, m0p, n0p, s_row, b_row)
        prod = _advance(prod, steps_per_tile, order, ring)
    tiles_per_group = order.GROUP_M * order.num_col_blocks
    if WAIT and not LATE:
        g_lo = (pid_r + idx_lo * nprog) // tiles_per_group
        _wait_at_least(sync_ptr + g_lo, order.group_units(g_lo))
    known = gl.to_tensor(-1)  # LATE: the last group seen complete
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    H: gl.constexpr = BLOCK_N // 2
    gl.static_assert(not DEFER or (STORE and not KEEP and (LATE or not WAIT) and out.EPI_SPLIT == 4))
    if DEFER:  # the second half of the last tile's y, and where it goes
        _z, pend = _halves(
            gl.zeros((BLOCK_M, BLOCK_N), dtype=out.y_desc.dtype, layout=mma_layout), BLOCK_M, BLOCK_N
        )
        pm0 = gl.to_tensor(0)
        pn0 = gl.to_tensor(0)
    for idx in range(idx_lo, idx_hi):
        early = gl.to_tensor(True)
        g_t = gl.to_tensor(0)
        want_t = gl.to_tensor(0)
        s_row_t = prod[5]
        b_row_t = prod[6]
        if FOLD and STORE:  # the producer is at this tile already (k_tiles ≥ NUM_BUFFERS)
            if LATE:  # its group's s there already? (else its boxes after its K steps)
                g_t = (pid_r + idx * nprog) // tiles_per_group
                want_t = order.group_units(g_t)
                early, known = _group_ready(sync_ptr, g_t, want_t, known)
                if early:
                    fold.load(prod[5], prod[6])
            else:
                fold.load(prod[5], prod[6])
        k_first = 0
        if DEFER:  # the first step, then the last tile's second half while its MMA runs
            acc, step, prod = _step(acc, 0, step, prod, idx_hi, steps_per_tile, order, ring)
            if idx > idx_lo:
                out.store_quarters(pend, pm0, pn0 + H)
            k_first = 1
        for ki in range(k_first, steps_per_tile):
            acc, step, prod = _step(acc, ki, step, prod, idx_hi, steps_per_tile, order, ring)
        if FOLD and STORE:
            if LATE:
                if not early:
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    _wait_at_least(sync_ptr + g_t, want_t)
                    known = g_t
                    fold.load(s_row_t, b_row_t)
            acc = fold.mma(acc, idx & 1)
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        _, m0, n0 = order.origin(pid_r + idx * nprog)
        if KEEP:
            pass
        elif WAIT and not LATE:
            g_next = (pid_r + (idx + 1) * nprog) // tiles_per_group
            if (idx + 1 < idx_hi) & (g_next != (pid_r + idx * nprog) // tiles_per_group):
                # a relaxed read first, answered while the epilogue runs; acquired after it (the epilogue
                # written once after a conditional read instead: 254 registers against 236 for sm_90)
                seen = gl.atomic_add(sync_ptr + g_next, 0, sem="relaxed", scope="gpu")
                out.epilogue(acc, m0, n0, STORE)
                _acquire_seen(sync_ptr + g_next, order.group_units(g_next), seen)
            else:
                out.epilogue(acc, m0, n0, STORE)
        elif DEFER:
            y = out.with_bias(acc, n0).to(out.y_desc.dtype)
            y_a, pend = _halves(y, BLOCK_M, BLOCK_N)
            out.store_quarters(y_a, m0, n0)
            pm0 = m0
            pn0 = n0
        else:
            out.epilogue(acc, m0, n0, STORE)
    if DEFER:
        if idx_hi > idx_lo:
            out.store_quarters(pend, pm0, pn0 + H)
    res = step
    if KEEP:
        res = (step, acc)
    return res


@gluon.jit
def _lora_fixup(step, idx, lora_steps, order, ring, out, fold, kept=None):
    """The LoRA steps of tile idx, whose K steps ran before s was ready (_tiles with STORE False left x · Wᵀ
    + bias in c_smem, in y's dtype; or with KEEP, x · Wᵀ in registers: `kept`): its LoRA loads (lora_steps <
    NUM_BUFFERS; FOLD: into fold's buffers), the output back from c_smem, the LoRA MMAs on top, and the store
    (with `kept`: the bias and the epilogue in EPI_SPLIT chunks)."""
    NUM_BUFFERS: gl.constexpr = ring.NUM_BUFFERS
    mma_layout: gl.constexpr = _mma_layout(order.BLOCK_N, out.num_warps)
    m0, n0, s_row, b_row = ring.origin(order, order.at(idx))
    if fold.FOLD:
        fold.load(s_row, b_row)
    for li in range(lora_steps):
        ring.load(step + li, ring.k_tiles + li, True, m0, n0, s_row, b_row)
    if kept is None:
        acc = out.c_smem.load(mma_layout).to(gl.float32)
    else:
        acc = kept
    if fold.FOLD:
        acc = fold.mma(acc, idx & 1)
    for _li in range(lora_steps):
        slot_i = step % NUM_BUFFERS
        mbarrier.wait(ring.bars.index(slot_i), (step // NUM_BUFFERS) & 1)
        a_buf = ring.a_bufs.index(slot_i)
        w_buf = ring.w_bufs.index(slot_i)
        tok = ring.lora_mma(a_buf, w_buf, acc)
        acc, _, _ = warpgroup_mma_wait(0, deps=(tok, a_buf, w_buf))
        step += 1
    _, m0, n0 = order.origin(order.pid + idx * order.nprog)
    if kept is None:
        _cta_barrier()  # every thread has read c_smem before it is overwritten
        _store_y(acc.to(out.y_desc.dtype), out.c_smem, out.y_desc, m0, n0)
    else:
        out.epilogue(acc, m0, n0)
    return step


@gluon.jit
def _first_tile(step, g0, lora_steps, sync_ptr, order, ring, out, fold):
    """A program's first tile before its group g0's s is there: its K steps, the output kept in c_smem (y
    whole) or in registers (y in chunks), the wait for the group's units, then its LoRA steps and store
    (`_lora_fixup`)."""
    kept = None
    if out.EPI_SPLIT == 1:
        step = _tiles(step, 0, 1, ring.k_tiles, order, ring, out, fold, STORE=False)
    else:
        step, kept = _tiles(step, 0, 1, ring.k_tiles, order, ring, out, fold, STORE=False, KEEP=True)
    _wait_at_least(sync_ptr + g0, order.group_units(g0))
    return _lora_fixup(step, 0, lora_steps, order, ring, out, fold, kept)


@aggregate
class Units:
    """The shrink inside the launch: unit u is row block u, s[g, rows, :s_cols] = scale · x[rows] · A[g, slot,
    :rank]ᵀ for every slice g (A viewed as [slices · max_loras · a_rows, hidden], a_slice_rows rows a slice),
    written through `so` (SOut). SHRINK_GP: SHRINK_G rounded up to a power of two."""

    x_desc: gl.base_value
    a_desc: gl.base_value
    so: SOut
    num_tokens: Scalar
    a_rows: Scalar
    a_slice_rows: Scalar
    token_seg_ptr: gl.tensor
    seg_slot_ptr: gl.tensor
    seg_scale_ptr: gl.tensor
    slot_rank_ptr: gl.tensor
    SHRINK_GP: gl.constexpr

    @gluon.jit
    def load(self, ring, p_step, kk, pred, m0, a_row, DOUBLE: gl.constexpr):
        """The loads of a shrink step into ring slot p_step % NUM_BUFFERS: x rows m0.. (columns kk..) into its x
        buffer and, for every slice g, the slot's A rows into rows g·SHRINK_R.. of its W buffer. DOUBLE: also the
        next 64 columns, A into W rows 64.. and x into rows 128..255 (columns past hidden read as zeros)."""
        SHRINK_G: gl.constexpr = self.so.SHRINK_G
        SHRINK_R: gl.constexpr = self.so.SHRINK_R
        x_desc = self.x_desc
        a_desc = self.a_desc
        slot_i = p_step % ring.NUM_BUFFERS
        bar = ring.bars.index(slot_i)
        HALVES: gl.constexpr = 2 if DOUBLE else 1
        mbarrier.expect(
            bar, HALVES * (x_desc.block_type.nbytes + SHRINK_G * a_desc.block_type.nbytes), pred=pred
        )
        _tma_load(x_desc, [m0, kk], bar, ring.a_bufs.index(slot_i), pred)
        w_buf = ring.w_bufs.index(slot_i)
        for g in gl.static_range(SHRINK_G):
            _tma_load(a_desc, [a_row + g * self.a_slice_rows, kk], bar, w_buf.slice(g * SHRINK_R, SHRINK_R, dim=0),
                      pred)  # fmt: skip
        if DOUBLE:
            _tma_load(x_desc, [m0, kk + ring.BLOCK_K], bar, w_buf.slice(128, 128, dim=0), pred)
            for g in gl.static_range(SHRINK_G):
                _tma_load(a_desc, [a_row + g * self.a_slice_rows, kk + ring.BLOCK_K], bar,
                          w_buf.slice(64 + g * SHRINK_R, SHRINK_R, dim=0), pred)  # fmt: skip


@gluon.jit
def _unit_mma(acc_a, acc_b, x_op, a_op, a0, use_acc, N_A: gl.constexpr, N_B: gl.constexpr,
              SPLIT: gl.constexpr):  # fmt: skip
    """acc_a += x · (A rows a0..a0+N_A)ᵀ and, SPLIT, acc_b += x · (the next N_B rows)ᵀ (asynchronous)."""
    tok_a = warpgroup_mma(
        x_op, a_op.slice(a0, N_A, dim=0).permute((1, 0)), acc_a, use_acc=use_acc, is_async=True
    )
    tok_b = acc_b
    if SPLIT:
        tok_b = warpgroup_mma(x_op, a_op.slice(a0 + N_A, N_B, dim=0).permute((1, 0)), acc_b, use_acc=use_acc,
                              is_async=True)  # fmt: skip
    return tok_a, tok_b


@gluon.jit
def _sum_halves(acc_a, acc_b, i, ws_ptr, cnt_ptr, N_A: gl.constexpr, N_B: gl.constexpr, SPLIT: gl.constexpr,
                BLOCK_M: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """A half unit's partial sums into ws[i] (fp32 [BLOCK_M, N_A (+ N_B)], relaxed atomics), counted in
    cnt_ptr[i] (acq_rel): (the unit's sums, True) for the half that completes it, which leaves ws[i] zeroed
    for the next launch; (its own, False) for the other. The protocol of `_tail_piece`'s pieces, for the two
    accumulators of a unit (their count lives in the launch's zeroed sync buffer, so it is not reset here)."""
    W: gl.constexpr = N_A + N_B if SPLIT else N_A
    layout_a: gl.constexpr = _mma_layout(N_A, num_warps)
    layout_b: gl.constexpr = _mma_layout(N_B, num_warps)
    base = ws_ptr + i.to(gl.int64) * (BLOCK_M * W)
    rows_a = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout_a))
    cols_a = gl.arange(0, N_A, layout=gl.SliceLayout(0, layout_a))
    ptr_a = base + rows_a[:, None] * W + cols_a[None, :]
    gl.atomic_add(ptr_a, acc_a, sem="relaxed", scope="gpu")
    if SPLIT:
        rows_b = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout_b))
        cols_b = gl.arange(0, N_B, layout=gl.SliceLayout(0, layout_b))
        ptr_b = base + rows_b[:, None] * W + (N_A + cols_b)[None, :]
        gl.atomic_add(ptr_b, acc_b, sem="relaxed", scope="gpu")
    _cta_barrier()  # every thread's sums precede the count
    finished = gl.atomic_add(cnt_ptr + i, 1, sem="acq_rel", scope="gpu") == 1
    if finished:  # the other half's sums are in: take the total, leave zeros
        acc_a = gl.load(ptr_a, cache_modifier=".cg")
        gl.store(ptr_a, gl.zeros_like(acc_a))
        if SPLIT:
            acc_b = gl.load(ptr_b, cache_modifier=".cg")
            gl.store(ptr_b, gl.zeros_like(acc_b))
    return acc_a, acc_b, finished


@gluon.jit
def _shrink_unit(
    step, u, units, ring, part=-1, ws_ptr=None, cnt_ptr=None, whole=0, HALVES: gl.constexpr = False
):
    """Shrink unit u through the same ring; zeros for rows without an adapter (no loads). The MMAs of a step cover
    every slice at once: SHRINK_GP · SHRINK_R columns (GP: the slices rounded up to a power of two; the padding
    slice's rows are never loaded and its columns never stored), or for 3 slices (SPLIT) two MMAs of 2 and 1
    slices' columns, so no MMA work goes to padding. Where the A rows take at most 64 of the W buffer's 256 (rank
    16), a ring slot carries two 64-column steps (DOUBLE): twice the bytes in flight, which is what bounds a unit
    (its x is read from HBM once).

    HALVES (UNIT_HALVES; returns (step, whether s was stored)): part 0 / 1 runs the first / second half of the
    K steps and adds its (scaled) partial sums into ws (`_sum_halves`); the half that completes the unit
    stores s. part -1: the whole unit."""
    so = units.so
    SHRINK_R: gl.constexpr = so.SHRINK_R
    BLOCK_M: gl.constexpr = so.BLOCK_M
    BLOCK_K: gl.constexpr = ring.BLOCK_K
    NUM_BUFFERS: gl.constexpr = ring.NUM_BUFFERS
    num_warps: gl.constexpr = so.num_warps
    SPLIT: gl.constexpr = so.SHRINK_G == 3
    N_A: gl.constexpr = 2 * SHRINK_R if SPLIT else units.SHRINK_GP * SHRINK_R
    N_B: gl.constexpr = SHRINK_R if SPLIT else 16
    DOUBLE: gl.constexpr = N_A + (N_B if SPLIT else 0) <= 64
    KSTEP: gl.constexpr = 2 * BLOCK_K if DOUBLE else BLOCK_K
    GROUPS: gl.constexpr = (2 if SPLIT else 1) * (2 if DOUBLE else 1)  # MMA groups a step commits
    m0 = u * BLOCK_M
    seg = gl.load(units.token_seg_ptr + m0)
    slot = gl.load(units.seg_slot_ptr + seg)
    acc_a = gl.zeros((BLOCK_M, N_A), dtype=gl.float32, layout=_mma_layout(N_A, num_warps))
    acc_b = gl.zeros((BLOCK_M, N_B), dtype=gl.float32, layout=_mma_layout(N_B, num_warps))
    rank = 0
    if slot >= 0:
        rank = gl.load(units.slot_rank_ptr + slot)
        a_row = slot * units.a_rows
        hidden = units.x_desc.shape[1]
        n_steps = gl.cdiv(hidden, KSTEP)
        k0 = 0  # the first K column of this unit's steps
        if HALVES:
            if part >= 0:
                first = (part * n_steps) // 2
                n_steps = ((part + 1) * n_steps) // 2 - first
                k0 = first * KSTEP
        for i in gl.static_range(NUM_BUFFERS - 1):
            units.load(ring, step + i, k0 + i * KSTEP, i < n_steps, m0, a_row, DOUBLE)
        for ki in range(n_steps):
            slot_i = step % NUM_BUFFERS
            mbarrier.wait(ring.bars.index(slot_i), (step // NUM_BUFFERS) & 1)
            x_buf = ring.a_bufs.index(slot_i)
            w_buf = ring.w_bufs.index(slot_i)
            tok_a, tok_b = _unit_mma(acc_a, acc_b, x_buf, w_buf, 0, ki > 0, N_A, N_B, SPLIT)
            if DOUBLE:
                tok_a, tok_b = _unit_mma(
                    tok_a, tok_b, w_buf.slice(128, 128, dim=0), w_buf, 64, True, N_A, N_B, SPLIT
                )
            # this step's MMAs stay in flight; the step before it is done, so its slot can be loaded
            acc_a, acc_b, _, _ = warpgroup_mma_wait(GROUPS, deps=(tok_a, tok_b, x_buf, w_buf))
            nxt = ki + NUM_BUFFERS - 1
            units.load(ring, step + NUM_BUFFERS - 1, k0 + nxt * KSTEP, nxt < n_steps, m0, a_row, DOUBLE)
            step += 1
        acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
        scale = gl.load(units.seg_scale_ptr + seg)
        acc_a = acc_a * scale
        acc_b = acc_b * scale
    finished = True
    if HALVES:
        finished = part < 0
        if part >= 0:
            acc_a, acc_b, finished = _sum_halves(acc_a, acc_b, u - whole, ws_ptr, cnt_ptr, N_A, N_B, SPLIT, BLOCK_M,
                                                 num_warps)  # fmt: skip
    if finished:
        so.store(acc_a, 0, m0, units.num_tokens, rank, N_A)
        if SPLIT:
            so.store(acc_b, 2, m0, units.num_tokens, rank, N_B)
    res = step
    if HALVES:
        res = (step, finished)
    return res


@gluon.jit
def _item_unit(it, whole, HALVES: gl.constexpr):
    """The unit of a program's work item `it` (UNIT_HALVES: items past `whole` are halves, two per unit)."""
    if HALVES:
        u = gl.where(it < whole, it, whole + (it - whole) // 2)
    else:
        u = it
    return u


@gluon.jit
def _gluon_lora_linear_kernel(
    x_desc,  # as _gluon_lora_gemm_kernel
    w_desc,
    s_desc,  # s (written here) viewed as [num_slices · num_tokens, s_cols], block [BLOCK_M, BLOCK_K]
    b_desc,
    y_desc,
    a_desc,  # A viewed as [shrink slices · max_loras · a_rows, hidden], block [SHRINK_R, BLOCK_K]
    bias_ptr,
    s_ptr,  # [shrink slices, num_tokens, s_cols] in x's dtype, written here
    token_seg_ptr,
    seg_slot_ptr,
    seg_scale_ptr,  # [num_segments] fp32
    slot_rank_ptr,  # [max_loras] int32
    sync_ptr,  # int32 [2 · row blocks + 2], zero at launch: group counts, claim and done counters, half counts
    num_tokens,
    n_total,
    col1,
    col2,
    col3,
    blk1,
    blk2,
    blk3,
    num_col_blocks,
    lora_steps,
    s_rows_total,
    b_rows_total,
    a_rows,  # rows of A per slot (its max rank)
    a_slice_rows,  # rows of A per slice: max_loras · a_rows
    s_cols,
    stride_ss,
    stride_st,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    LORA_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    SHRINK_G: gl.constexpr,  # slices of s computed here (≥ the output slices)
    SHRINK_GP: gl.constexpr,  # SHRINK_G rounded up to a power of two
    SHRINK_R: gl.constexpr,  # s_cols rounded up to a power of two
    HAS_BIAS: gl.constexpr,
    num_warps: gl.constexpr,
    SPREAD: gl.constexpr = 1,
    LEAD: gl.constexpr = 2,
    FOLD: gl.constexpr = False,  # the LoRA MMA after the last K step (`_tiles`)
    EPI_SPLIT: gl.constexpr = 1,  # y in column chunks (as _gluon_lora_gemm_kernel; SPREAD only)
    EPI_BUFS: gl.constexpr = 1,
    LATE: gl.constexpr = False,  # SPREAD and FOLD: tiles wait for their group's s after their K steps (`_tiles`)
    UNIT_HALVES: gl.constexpr = False,  # SPREAD: the units past whole rounds as halves (see below)
    ws_ptr=None,  # UNIT_HALVES: fp32 [units, BLOCK_M, a unit's MMA columns] zeros (each launch leaves them so)
    DEFER: gl.constexpr = False,  # (LATE, EPI_SPLIT 4) a tile's second half of y stored during the next one's first MMA
):
    """y = x · Wᵀ + bias + s[j] · B[slot]ᵀ and s = scale · x · Aᵀ in one launch. A shrink unit is one row
    block (all slices in one MMA per K step). The persistent grid gives num_tiles mod P programs one tile more
    than the others (here the first ones in pid_r). s is stored through the generic proxy and read through
    TMA: a unit's stores, a barrier, then a release; readers acquire, then fence the async proxy. The waits
    sit outside the pipelined K loop, with no MMA in flight (inside it, a wait before the first LoRA load
    broke the LoRA step's results on the GPU).

    SPREAD (default): the units are spread over the run, on the programs with one tile less (the slot the
    last round of tiles leaves free on them): unit u (row block u, group g = u // GROUP_M of the tile order)
    goes to the (u mod their count)-th of them, which runs it LEAD tiles before the first position at which
    any program reaches a tile of group g (s is then there long before it is read, so no program waits for
    it). sync_ptr[g] counts the group's units done; tiles wait for their group's count (`_tiles` WAIT; with
    LATE after their K steps, so units can be due with their group, LEAD 0: the launcher's default). A
    program with no unit before its first tile runs that tile's K steps first and keeps its output in c_smem
    (its LoRA steps come once its group is done, `_lora_fixup`), so the first units cost the others nothing.
    Every wait is for a unit due at an earlier position (the first tiles' units at position 0 run before any
    wait), and all programs are resident: no deadlock.

    SPREAD 0: those extra-tile programs run their first tile's K steps first (c_smem, as above); all programs
    claim units in order from an atomic counter (sync_ptr[num_units]) and run them, count them in
    sync_ptr[num_units + 1], and wait until every unit is done before their tiles.

    UNIT_HALVES (SPREAD): where the units outnumber the programs with one tile less, those past whole rounds of
    them are run as two halves of their K steps on two programs (`_shrink_unit` HALVES; the count of a split
    unit's halves in sync_ptr[num_units + 2 + i]), so a program runs a unit and a half instead of one or
    two."""
    hidden = x_desc.shape[1]
    k_tiles = gl.cdiv(hidden, BLOCK_K)
    steps_per_tile = k_tiles + lora_steps
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(num_tokens, BLOCK_M)
    num_tiles = num_pid_m * num_col_blocks
    extra = num_tiles % nprog
    pid_r = (pid + extra) % nprog  # programs nprog - extra.. take tiles 0..extra-1: one tile more
    my_tiles = gl.cdiv(num_tiles - pid_r, nprog)

    a_bufs, w_bufs, bars = _ring_buffers(x_desc, w_desc, BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUFFERS)
    # y in chunks: the first tile's output, where s is not there yet, stays in registers
    gl.static_assert(EPI_SPLIT == 1 or SPREAD > 0, "y in chunks only with the units spread")
    out = Out(y_desc, _staging(x_desc, y_desc, BLOCK_M, BLOCK_N, EPI_SPLIT, EPI_BUFS), bias_ptr, BLOCK_M, BLOCK_N, HAS_BIAS,
              EPI_SPLIT, EPI_BUFS, num_warps)  # fmt: skip
    ring = Ring(x_desc, w_desc, s_desc, b_desc, a_bufs, w_bufs, bars, k_tiles, num_tokens, n_total, s_rows_total,
                b_rows_total, token_seg_ptr, seg_slot_ptr, BLOCK_K, LORA_K, NUM_BUFFERS, True)  # fmt: skip
    fold = _fold(ring, FOLD, BLOCK_M, BLOCK_N)
    order = TileOrder(pid_r, nprog, num_tiles, num_pid_m, num_col_blocks, col1, col2, col3, blk1, blk2, blk3, BLOCK_M,
                      BLOCK_N, GROUP_M)  # fmt: skip
    units = Units(x_desc, a_desc, SOut(s_ptr, s_cols, stride_ss, stride_st, SHRINK_G, SHRINK_R, BLOCK_M, num_warps),
                  num_tokens, a_rows, a_slice_rows, token_seg_ptr, seg_slot_ptr, seg_scale_ptr, slot_rank_ptr,
                  SHRINK_GP)  # fmt: skip

    num_units = num_pid_m
    step = 0
    if SPREAD:
        tiles_per_group = GROUP_M * num_col_blocks
        num_short = nprog - extra
        whole = num_units
        n_items = num_units
        if UNIT_HALVES:  # the units past whole rounds of the short programs as two halves each
            rem = gl.where(num_units >= num_short, num_units % num_short, 0)
            whole = num_units - rem
            n_items = whole + 2 * rem
        it = gl.where(pid_r >= extra, pid_r - extra, n_items)  # this program's next unit (or half)
        u = _item_unit(it, whole, UNIT_HALVES)
        idx = 0
        due = gl.maximum(((u // GROUP_M) * tiles_per_group) // nprog - LEAD, 0)
        if (it >= n_items) | (due > 0):  # its first tile's K steps before the first units are done
            g0 = pid_r // tiles_per_group
            step = _first_tile(step, g0, lora_steps, sync_ptr, order, ring, out, fold)
            idx = 1
        while (idx < my_tiles) | (it < n_items):
            u = _item_unit(it, whole, UNIT_HALVES)
            due = gl.maximum(((u // GROUP_M) * tiles_per_group) // nprog - LEAD, 0)
            if (it < n_items) & (due <= idx):
                part = -1  # the whole unit, or (UNIT_HALVES) half 0 / 1 of it
                if UNIT_HALVES:
                    part = gl.where(it < whole, -1, (it - whole) % 2)
                done = _shrink_unit(step, u, units, ring, part, ws_ptr, sync_ptr + num_units + 2, whole,
                                    HALVES=UNIT_HALVES)  # fmt: skip
                stored = True
                if UNIT_HALVES:
                    step, stored = done
                else:
                    step = done
                _cta_barrier()  # every thread's s stores precede the release
                if stored:
                    gl.atomic_add(sync_ptr + u // GROUP_M, 1, sem="release", scope="gpu")
                it += num_short
            else:
                hi = my_tiles
                if it < n_items:
                    hi = gl.minimum(due, my_tiles)
                step = _tiles(step, idx, hi, steps_per_tile, order, ring, out, fold, sync_ptr, WAIT=True, LATE=LATE,
                              DEFER=DEFER)  # fmt: skip
                idx = hi
    else:
        claim_ptr = sync_ptr + num_units
        done_ptr = claim_ptr + 1
        first = (pid_r < extra).to(gl.int32)
        if first > 0:  # one tile more than most: its K steps at once, its output kept in c_smem
            step = _tiles(step, 0, 1, k_tiles, order, ring, out, fold, STORE=False)
        u = gl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
        while u < num_units:
            step = _shrink_unit(step, u, units, ring)
            _cta_barrier()  # every thread's s stores precede the release
            gl.atomic_add(done_ptr, 1, sem="release", scope="gpu")
            u = gl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
        _wait_at_least(done_ptr, num_units)
        if first > 0:  # that tile's LoRA steps, now that s is there
            step = _lora_fixup(step, 0, lora_steps, order, ring, out, fold)
        step = _tiles(step, first, my_tiles, steps_per_tile, order, ring, out, fold)
    tma.store_wait(pendings=0)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(i))
