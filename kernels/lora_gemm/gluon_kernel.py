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
while this tile's epilogue (bias, bf16, a TMA store) runs.

Contract (the launcher checks it): bf16/fp16 x, W, s, B; s pre-scaled in x's dtype; every segment starts
at a multiple of BLOCK_M (a tile's rows hold one segment); every output slice a multiple of BLOCK_N; x, W,
s, B, y laid out for TMA.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _tile_origin(tile_id, num_pid_m, num_col_blocks, col1, col2, col3, blk1, blk2, blk3,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """Tile tile_id in grouped order → (its slice j, first row m0, first column n0)."""
    num_in_group = GROUP_M * num_col_blocks
    group = tile_id // num_in_group
    first_m = group * GROUP_M
    group_size = gl.minimum(num_pid_m - first_m, GROUP_M)
    local = tile_id - group * num_in_group
    pid_m = first_m + local % group_size
    pid_n = local // group_size
    j = (pid_n >= blk1).to(gl.int32) + (pid_n >= blk2).to(gl.int32) + (pid_n >= blk3).to(gl.int32)
    col_lo = gl.where(j == 0, 0, gl.where(j == 1, col1, gl.where(j == 2, col2, col3)))
    blk_lo = gl.where(j == 0, 0, gl.where(j == 1, blk1, gl.where(j == 2, blk2, blk3)))
    return j, pid_m * BLOCK_M, col_lo + (pid_n - blk_lo) * BLOCK_N


@gluon.jit
def _load_origin(p_idx, pid, nprog, num_tiles, num_pid_m, num_col_blocks, num_tokens, n_total, col1, col2, col3,
                 blk1, blk2, blk3, s_rows_total, b_rows_total, token_seg_ptr, seg_slot_ptr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                 HAS_LORA: gl.constexpr):  # fmt: skip
    """Where the loads of this program's tile p_idx start: x/W rows m0 / n0, and the rows of s[j] and
    B[slot] for its LoRA steps (past the last row, i.e. zeros, where its rows have no adapter). Computed
    once per tile (the steps in between only advance the K coordinate)."""
    tile_id = gl.minimum(pid + p_idx * nprog, num_tiles - 1)
    j, m0, n0 = _tile_origin(tile_id, num_pid_m, num_col_blocks, col1, col2, col3, blk1, blk2, blk3,
                             BLOCK_M, BLOCK_N, GROUP_M)  # fmt: skip
    s_row = s_rows_total
    b_row = b_rows_total
    if HAS_LORA:
        slot = gl.load(seg_slot_ptr + gl.load(token_seg_ptr + m0))
        here = slot >= 0
        s_row = gl.where(here, j * num_tokens + m0, s_rows_total)
        b_row = gl.where(here, gl.maximum(slot, 0) * n_total + n0, b_rows_total)
    return m0, n0, s_row, b_row


@gluon.jit
def _issue_load(p_step, p_ki, pred, m0, n0, s_row, b_row, k_tiles, x_desc, w_desc, s_desc, b_desc, a_bufs, w_bufs,
                bars, BLOCK_K: gl.constexpr, NUM_BUFFERS: gl.constexpr, HAS_LORA: gl.constexpr):  # fmt: skip
    """The TMA loads of one pipeline step (K step p_ki of a tile; p_ki ≥ k_tiles: its LoRA steps) into ring
    slot p_step % NUM_BUFFERS (nothing where pred is false: past this program's last tile)."""
    slot_i = p_step % NUM_BUFFERS
    bar = bars.index(slot_i)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    if HAS_LORA:
        if p_ki < k_tiles:
            tma.async_copy_global_to_shared(x_desc, [m0, p_ki * BLOCK_K], bar, a_bufs.index(slot_i), pred)
            tma.async_copy_global_to_shared(w_desc, [n0, p_ki * BLOCK_K], bar, w_bufs.index(slot_i), pred)
        else:
            kk = (p_ki - k_tiles) * BLOCK_K
            tma.async_copy_global_to_shared(s_desc, [s_row, kk], bar, a_bufs.index(slot_i), pred)
            tma.async_copy_global_to_shared(b_desc, [b_row, kk], bar, w_bufs.index(slot_i), pred)
    else:
        tma.async_copy_global_to_shared(x_desc, [m0, p_ki * BLOCK_K], bar, a_bufs.index(slot_i), pred)
        tma.async_copy_global_to_shared(w_desc, [n0, p_ki * BLOCK_K], bar, w_bufs.index(slot_i), pred)


@gluon.jit
def _step(acc, ki, step, p_step, p_idx, p_ki, m0p, n0p, s_row, b_row, my_tiles, k_tiles, steps_per_tile, pid, nprog,
          num_tiles, num_pid_m, num_col_blocks, num_tokens, n_total, col1, col2, col3, blk1, blk2, blk3,
          s_rows_total, b_rows_total, token_seg_ptr, seg_slot_ptr, x_desc, w_desc, s_desc, b_desc, a_bufs, w_bufs,
          bars, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LORA_K: gl.constexpr,
          GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr, HAS_LORA: gl.constexpr):  # fmt: skip
    """Pipeline step `step` (step ki of its tile): wait for its slot, start its MMA, wait for the MMA before it,
    and send the loads NUM_BUFFERS - 1 steps ahead into the slot that MMA read; the producer's position
    (p_*) and where its tile's loads start move on."""
    slot_i = step % NUM_BUFFERS
    mbarrier.wait(bars.index(slot_i), (step // NUM_BUFFERS) & 1)
    a_buf = a_bufs.index(slot_i)
    w_buf = w_bufs.index(slot_i)
    if HAS_LORA:
        if ki < k_tiles:
            tok = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, use_acc=ki > 0, is_async=True)
        elif LORA_K == BLOCK_K:
            tok = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, is_async=True)
        else:  # only the first LORA_K columns hold rank columns: a narrower MMA
            a_l = a_buf.slice(0, LORA_K, dim=1)
            w_l = w_buf.slice(0, LORA_K, dim=1)
            tok = warpgroup_mma(a_l, w_l.permute((1, 0)), acc, is_async=True)
    else:
        tok = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, use_acc=ki > 0, is_async=True)
    acc, _, _ = warpgroup_mma_wait(1, deps=(tok, a_buf, w_buf))
    _issue_load(p_step, p_ki, p_idx < my_tiles, m0p, n0p, s_row, b_row, k_tiles, x_desc, w_desc, s_desc, b_desc,
                a_bufs, w_bufs, bars, BLOCK_K, NUM_BUFFERS, HAS_LORA)  # fmt: skip
    p_ki += 1
    if p_ki == steps_per_tile:
        p_ki = 0
        p_idx += 1
        m0p, n0p, s_row, b_row = _load_origin(p_idx, pid, nprog, num_tiles, num_pid_m, num_col_blocks, num_tokens,
                                              n_total, col1, col2, col3, blk1, blk2, blk3, s_rows_total,
                                              b_rows_total, token_seg_ptr, seg_slot_ptr, BLOCK_M, BLOCK_N, GROUP_M,
                                              HAS_LORA)  # fmt: skip
    return acc, step + 1, p_step + 1, p_idx, p_ki, m0p, n0p, s_row, b_row


@gluon.jit
def _store_y(out, c_smem, y_desc, m0, n0):
    """A tile of y through shared memory and a TMA store (once the store before it has left c_smem)."""
    tma.store_wait(pendings=0)
    c_smem.store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [m0, n0], c_smem)


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
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    LORA_K: gl.constexpr,  # columns of the LoRA boxes each LoRA step multiplies (16, 32 or BLOCK_K)
    GROUP_M: gl.constexpr,
    NUM_BUFFERS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = x_desc.dtype
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
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

    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(bars.index(i), count=1)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], y_desc.layout)

    # the producer: the step whose loads go out next (p_step), its tile (p_idx) and K step (p_ki), and where
    # that tile's loads start; the first NUM_BUFFERS - 1 steps go out before the first MMA
    p_step = 0
    p_idx = 0
    p_ki = 0
    m0p, n0p, s_row, b_row = _load_origin(0, pid, nprog, num_tiles, num_pid_m, num_col_blocks, num_tokens, n_total,
                                          col1, col2, col3, blk1, blk2, blk3, s_rows_total, b_rows_total,
                                          token_seg_ptr, seg_slot_ptr, BLOCK_M, BLOCK_N, GROUP_M,
                                          HAS_LORA)  # fmt: skip
    for _i in gl.static_range(NUM_BUFFERS - 1):
        _issue_load(p_step, p_ki, p_idx < my_tiles, m0p, n0p, s_row, b_row, k_tiles, x_desc, w_desc, s_desc, b_desc,
                    a_bufs, w_bufs, bars, BLOCK_K, NUM_BUFFERS, HAS_LORA)  # fmt: skip
        p_step += 1
        p_ki += 1
        if p_ki == steps_per_tile:
            p_ki = 0
            p_idx += 1
            m0p, n0p, s_row, b_row = _load_origin(p_idx, pid, nprog, num_tiles, num_pid_m, num_col_blocks,
                                                  num_tokens, n_total, col1, col2, col3, blk1, blk2, blk3,
                                                  s_rows_total, b_rows_total, token_seg_ptr, seg_slot_ptr,
                                                  BLOCK_M, BLOCK_N, GROUP_M, HAS_LORA)  # fmt: skip

    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    step = 0  # steps consumed so far (the ring slot and its phase follow from it)
    for idx in range(my_tiles):
        for ki in range(steps_per_tile):
            acc, step, p_step, p_idx, p_ki, m0p, n0p, s_row, b_row = _step(
                acc, ki, step, p_step, p_idx, p_ki, m0p, n0p, s_row, b_row, my_tiles, k_tiles, steps_per_tile,
                pid, nprog, num_tiles, num_pid_m, num_col_blocks, num_tokens, n_total, col1, col2, col3, blk1,
                blk2, blk3, s_rows_total, b_rows_total, token_seg_ptr, seg_slot_ptr, x_desc, w_desc, s_desc, b_desc,
                a_bufs, w_bufs, bars, BLOCK_M, BLOCK_N, BLOCK_K, LORA_K, GROUP_M, NUM_BUFFERS, HAS_LORA,
            )  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _, m0, n0 = _tile_origin(pid + idx * nprog, num_pid_m, num_col_blocks, col1, col2, col3, blk1, blk2, blk3,
                                 BLOCK_M, BLOCK_N, GROUP_M)  # fmt: skip
        out = acc
        if HAS_BIAS:
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            out = out + gl.load(bias_ptr + offs_n).to(gl.float32)[None, :]
        _store_y(out.to(dtype), c_smem, y_desc, m0, n0)
    tma.store_wait(pendings=0)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(i))
