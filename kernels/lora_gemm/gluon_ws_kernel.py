"""The Gluon GEMM of gluon_kernel.py with its loads in a warp of their own (warp specialization, Hopper).

In `_gluon_lora_gemm_kernel` the eight MMA warps also issue the TMA loads and look up each tile's slot, and
Triton's barrier analysis puts four CTA-wide barriers into every pipeline step (before the mbarrier wait,
the expect and each of the two loads: it cannot see that one elected thread issues them). Here one load
warp walks the same tiles and steps, waits for a ring slot to be free (`empty`), and loads it (`ready`);
the MMA warps wait for `ready`, run the step's MMA, and once the step before is done in both warpgroups (a
barrier of the MMA warps, then one arrival) hand its slot back. Same tiles, order, LoRA steps and epilogue
as gluon_kernel.py. Compiled for sm_90 (168 registers, no spills; two barriers per step in the MMA warps);
not yet measured: config "gluon ws" of lora_gemm.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ditserve.kernels.lora_gemm.gluon_kernel import (
    _epilogue,
    _issue_load,
    _load_origin,
    _lora_mma,
    _tile_origin,
)


@gluon.jit
def _ws_loads(pid, nprog, my_tiles, k_tiles, steps_per_tile, num_tiles, num_pid_m, num_col_blocks, num_tokens,
              n_total, col1, col2, col3, blk1, blk2, blk3, s_rows_total, b_rows_total, token_seg_ptr, seg_slot_ptr,
              x_desc, w_desc, s_desc, b_desc, a_bufs, w_bufs, ready, empty, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_BUFFERS: gl.constexpr):  # fmt: skip
    """The load warp: every step of this program's tiles into the ring, each slot once the MMA warps gave it
    back (a fresh `empty` barrier counts as given back: the wait is on the phase before)."""
    p = 0
    for idx in range(my_tiles):
        m0, n0, s_row, b_row = _load_origin(idx, pid, nprog, num_tiles, num_pid_m, num_col_blocks, num_tokens,
                                            n_total, col1, col2, col3, blk1, blk2, blk3, s_rows_total, b_rows_total,
                                            token_seg_ptr, seg_slot_ptr, BLOCK_M, BLOCK_N, GROUP_M, True)  # fmt: skip
        for ki in range(steps_per_tile):
            mbarrier.wait(empty.index(p % NUM_BUFFERS), ((p // NUM_BUFFERS) & 1) ^ 1)
            _issue_load(p, ki, True, m0, n0, s_row, b_row, k_tiles, x_desc, w_desc, s_desc, b_desc, a_bufs, w_bufs,
                        ready, BLOCK_K, NUM_BUFFERS, True)  # fmt: skip
            p += 1


@gluon.jit
def _ws_mma(pid, nprog, my_tiles, k_tiles, steps_per_tile, num_pid_m, num_col_blocks, col1, col2, col3, blk1,
            blk2, blk3, bias_ptr, y_desc, a_bufs, w_bufs, ready, empty, c_smem, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LORA_K: gl.constexpr, GROUP_M: gl.constexpr,
            NUM_BUFFERS: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The MMA warps (the default partition): the tile loop of gluon_kernel.py without its loads."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    c = 0
    for idx in range(my_tiles):
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        for ki in range(steps_per_tile):
            slot_i = c % NUM_BUFFERS
            mbarrier.wait(ready.index(slot_i), (c // NUM_BUFFERS) & 1)
            a_buf = a_bufs.index(slot_i)
            w_buf = w_bufs.index(slot_i)
            if ki < k_tiles:
                tok = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, use_acc=ki > 0, is_async=True)
            else:
                tok = _lora_mma(a_buf, w_buf, acc, LORA_K, BLOCK_K)
            acc, _, _ = warpgroup_mma_wait(1, deps=(tok, a_buf, w_buf))
            # the step before is done in both warpgroups (each waited for its own MMAs): its slot goes back
            gl.thread_barrier()
            mbarrier.arrive(empty.index((c + NUM_BUFFERS - 1) % NUM_BUFFERS), count=1, pred=c > 0)
            c += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _, m0, n0 = _tile_origin(pid + idx * nprog, num_pid_m, num_col_blocks, col1, col2, col3, blk1, blk2, blk3,
                                 BLOCK_M, BLOCK_N, GROUP_M)  # fmt: skip
        _epilogue(acc, bias_ptr, c_smem, y_desc, m0, n0, BLOCK_N, HAS_BIAS, num_warps)
    tma.store_wait(pendings=0)


@gluon.jit
def _gluon_lora_gemm_ws_kernel(x_desc, w_desc, s_desc, b_desc, y_desc, bias_ptr, token_seg_ptr, seg_slot_ptr,
                               num_tokens, n_total, col1, col2, col3, blk1, blk2, blk3, num_col_blocks, lora_steps,
                               s_rows_total, b_rows_total, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               BLOCK_K: gl.constexpr, LORA_K: gl.constexpr, GROUP_M: gl.constexpr,
                               NUM_BUFFERS: gl.constexpr, HAS_BIAS: gl.constexpr, LOAD_REGS: gl.constexpr,
                               num_warps: gl.constexpr):  # fmt: skip
    hidden = x_desc.shape[1]
    k_tiles = gl.cdiv(hidden, BLOCK_K)
    steps_per_tile = k_tiles + lora_steps
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(num_tokens, BLOCK_M)
    num_tiles = num_pid_m * num_col_blocks
    my_tiles = gl.cdiv(num_tiles - pid, nprog)
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_BUFFERS, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    c_smem = gl.allocate_shared_memory(x_desc.dtype, [BLOCK_M, BLOCK_N], y_desc.layout)
    gl.warp_specialize([
        (_ws_mma, (pid, nprog, my_tiles, k_tiles, steps_per_tile, num_pid_m, num_col_blocks, col1, col2, col3, blk1,
                   blk2, blk3, bias_ptr, y_desc, a_bufs, w_bufs, ready, empty, c_smem, BLOCK_M, BLOCK_N, BLOCK_K,
                   LORA_K, GROUP_M, NUM_BUFFERS, HAS_BIAS, num_warps)),
        (_ws_loads, (pid, nprog, my_tiles, k_tiles, steps_per_tile, num_tiles, num_pid_m, num_col_blocks, num_tokens,
                     n_total, col1, col2, col3, blk1, blk2, blk3, s_rows_total, b_rows_total, token_seg_ptr,
                     seg_slot_ptr, x_desc, w_desc, s_desc, b_desc, a_bufs, w_bufs, ready, empty, BLOCK_M, BLOCK_N,
                     BLOCK_K, GROUP_M, NUM_BUFFERS)),
    ], [1], [LOAD_REGS])  # fmt: skip
