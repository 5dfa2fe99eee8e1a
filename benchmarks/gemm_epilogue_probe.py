"""How much of the Gluon GEMM's distance to cuBLAS is its epilogue (one H200)? A bare persistent Gluon GEMM
(no LoRA, no bias: the ring, tile order, 128 × 256 tiles and chunked TMA store of `kernels/lora_gemm`) in three
forms, against cuBLAS and the real Gluon GEMM without LoRA, on the QKV projection (hidden 3072, 3 × 3072
outputs), bf16:

- `one acc`: one 128 × 256 accumulator; at a tile's end the MMAs drain (wait 0) and the tensor cores idle
  while y is converted and stored (what `kernels/lora_gemm` did before DEFER);
- `one acc, y stored during the next tile's first MMA`: y converted to bf16 registers at the tile's end, the
  next tile's first MMA started, then y stored from those registers while it runs (64 more registers a
  thread; ptxas serializes every MMA if an accumulator is read while any MMA is in flight, so the conversion
  stays before it);
- `two accs`: the tile as two 128 × 128 column halves, two MMAs per K step (one in flight), both stored at the
  tile's end (what narrower MMAs cost; storing one half while the other's MMAs run is what ptxas serializes).

    python3 benchmarks/gemm_epilogue_probe.py [--batches 4x4608,1x4608] [--rounds 9] --out DIR

Each output is checked against `F.linear` first. Times: CUDA-graph replay with an L2 flush before each call,
interleaved rounds with 0.25 s idle before each timing; "+%" = median of the per-round ratios to cuBLAS - 1.
Writes DIR/gemm_epilogue_probe.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# the kernel's own epilogue pieces (y in column chunks through two staging buffers) and TMA names
from ditserve.kernels.lora_gemm.gluon_kernel import _store_chunks, _store_quarters, _tma_load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora_kernels as lk  # noqa: E402


@gluon.jit
def _origin(tile_id, num_pid_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
            num_pid_n):  # fmt: skip
    """Tile tile_id in grouped order (GROUP_M row blocks per column block) → its first row and column."""
    num_in_group = GROUP_M * num_pid_n
    group = tile_id // num_in_group
    first_m = group * GROUP_M
    size = gl.minimum(num_pid_m - first_m, GROUP_M)
    local = tile_id - group * num_in_group
    return (first_m + local % size) * BLOCK_M, (local // size) * BLOCK_N


@gluon.jit
def _load(p, total, pid, nprog, k_tiles, num_pid_m, num_pid_n, x_desc, w_desc, a_bufs, w_bufs, bars,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
          NUM_BUFFERS: gl.constexpr):  # fmt: skip
    """The TMA loads of this program's pipeline step p (none past its last step) into ring slot p % NB."""
    pred = p < total
    q = gl.minimum(p, total - 1)
    m0, n0 = _origin(pid + (q // k_tiles) * nprog, num_pid_m, BLOCK_M, BLOCK_N, GROUP_M, num_pid_n)
    k0 = (q % k_tiles) * BLOCK_K
    slot = p % NUM_BUFFERS
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    _tma_load(x_desc, [m0, k0], bar, a_bufs.index(slot), pred)
    _tma_load(w_desc, [n0, k0], bar, w_bufs.index(slot), pred)


@gluon.jit
def _kstep(acc, use_acc, step, total, pid, nprog, k_tiles, num_pid_m, num_pid_n, x_desc, w_desc, a_bufs, w_bufs,
           bars, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
           NUM_BUFFERS: gl.constexpr):  # fmt: skip
    """Pipeline step `step` of the one-accumulator loop: wait for its slot, start its MMA, wait for the one
    before, and send the loads NUM_BUFFERS - 1 steps ahead into the slot that one read."""
    slot = step % NUM_BUFFERS
    mbarrier.wait(bars.index(slot), (step // NUM_BUFFERS) & 1)
    a_buf = a_bufs.index(slot)
    w_buf = w_bufs.index(slot)
    tok = warpgroup_mma(a_buf, w_buf.permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(1, deps=(tok, a_buf, w_buf))
    _load(step + NUM_BUFFERS - 1, total, pid, nprog, k_tiles, num_pid_m, num_pid_n, x_desc, w_desc, a_bufs,
          w_bufs, bars, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_BUFFERS)  # fmt: skip
    return acc, step + 1


@gluon.jit
def _probe_gemm_kernel(x_desc, w_desc, y_desc, num_tokens, n_total, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                       HALVES: gl.constexpr, DEFER: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = x_desc.dtype
    H: gl.constexpr = BLOCK_N // 2
    k_tiles = gl.cdiv(x_desc.shape[1], BLOCK_K)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_m = gl.cdiv(num_tokens, BLOCK_M)
    num_pid_n = gl.cdiv(n_total, BLOCK_N)
    my_tiles = gl.cdiv(num_pid_m * num_pid_n - pid, nprog)
    total = my_tiles * k_tiles
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, BLOCK_K], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(bars.index(i), count=1)
    c_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N // 4], y_desc.layout)
    for i in gl.static_range(NUM_BUFFERS - 1):
        _load(i, total, pid, nprog, k_tiles, num_pid_m, num_pid_n, x_desc, w_desc, a_bufs, w_bufs, bars,
              BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_BUFFERS)  # fmt: skip
    step = gl.to_tensor(0)
    if not HALVES:
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        out = gl.zeros((BLOCK_M, BLOCK_N), dtype=dtype, layout=layout)  # DEFER: the last tile's y, in bf16
        pm0 = gl.to_tensor(0)
        pn0 = gl.to_tensor(0)
        for t in range(my_tiles):
            # the tile's first K step, peeled: with DEFER the previous tile's y is stored while its MMA runs
            # (from registers that are no MMA's accumulator, so ptxas keeps the MMAs asynchronous)
            acc, step = _kstep(acc, False, step, total, pid, nprog, k_tiles, num_pid_m, num_pid_n, x_desc, w_desc,
                               a_bufs, w_bufs, bars, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_BUFFERS)  # fmt: skip
            if DEFER:
                if t > 0:
                    _store_chunks(out, c_smem, y_desc, pm0, pn0, BLOCK_M, BLOCK_N, 4, 2)
            for _ki in range(1, k_tiles):
                acc, step = _kstep(acc, True, step, total, pid, nprog, k_tiles, num_pid_m, num_pid_n, x_desc,
                                   w_desc, a_bufs, w_bufs, bars, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                   NUM_BUFFERS)  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=(acc,))
            m0, n0 = _origin(pid + t * nprog, num_pid_m, BLOCK_M, BLOCK_N, GROUP_M, num_pid_n)
            if DEFER:
                out = acc.to(dtype)
                pm0 = m0
                pn0 = n0
            else:
                _store_chunks(acc.to(dtype), c_smem, y_desc, m0, n0, BLOCK_M, BLOCK_N, 4, 2)
        if DEFER:
            if my_tiles > 0:
                _store_chunks(out, c_smem, y_desc, pm0, pn0, BLOCK_M, BLOCK_N, 4, 2)
    else:  # two column halves, two MMAs per K step (one in flight), both stored at the tile's end
        half: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, H, 16]
        )
        acc_a = gl.zeros((BLOCK_M, H), dtype=gl.float32, layout=half)
        acc_b = gl.zeros((BLOCK_M, H), dtype=gl.float32, layout=half)
        for t in range(my_tiles):
            for ki in range(k_tiles):
                slot = step % NUM_BUFFERS
                mbarrier.wait(bars.index(slot), (step // NUM_BUFFERS) & 1)
                a_buf = a_bufs.index(slot)
                w_buf = w_bufs.index(slot)
                tok_a = warpgroup_mma(a_buf, w_buf.slice(0, H, dim=0).permute((1, 0)), acc_a, use_acc=ki > 0,
                                      is_async=True)  # fmt: skip
                acc_a, acc_b = warpgroup_mma_wait(1, deps=(tok_a, acc_b))
                _load(step + NUM_BUFFERS - 1, total, pid, nprog, k_tiles, num_pid_m, num_pid_n, x_desc, w_desc,
                      a_bufs, w_bufs, bars, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_BUFFERS)  # fmt: skip
                tok_b = warpgroup_mma(a_buf, w_buf.slice(H, H, dim=0).permute((1, 0)), acc_b, use_acc=ki > 0,
                                      is_async=True)  # fmt: skip
                acc_b, acc_a, _, _ = warpgroup_mma_wait(1, deps=(tok_b, acc_a, a_buf, w_buf))
                step += 1
            acc_b, acc_a = warpgroup_mma_wait(0, deps=(acc_b, acc_a))
            m0, n0 = _origin(pid + t * nprog, num_pid_m, BLOCK_M, BLOCK_N, GROUP_M, num_pid_n)
            _store_quarters(acc_a.to(dtype), c_smem, y_desc, m0, n0, BLOCK_M, H, 2)
            _store_quarters(acc_b.to(dtype), c_smem, y_desc, m0, n0 + H, BLOCK_M, H, 2)
    tma.store_wait(pendings=0)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(i))


def probe_gemm(x: torch.Tensor, w: torch.Tensor, halves: bool, defer: bool) -> torch.Tensor:
    """y = x · Wᵀ with the probe kernel (bf16, shapes multiples of the 128 × 256 × 64 tiles)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bm, bn, bk = 128, 256, 64
    y = x.new_empty((x.shape[0], w.shape[0]))

    def desc(t, block):
        return TensorDescriptor.from_tensor(
            t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        )

    tiles = (x.shape[0] // bm) * (w.shape[0] // bn)
    grid = min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)
    _probe_gemm_kernel[(grid,)](
        desc(x, [bm, bk]), desc(w, [bn, bk]), desc(y, [bm, bn // 4]), x.shape[0], w.shape[0],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=16, NUM_BUFFERS=3, HALVES=halves, DEFER=defer,
        num_warps=8,
    )  # fmt: skip
    return y


def _rows(batch: str, rounds: int) -> list[str]:
    """The table rows of one batch ("4x4608": 4 × 4608 tokens): every form checked, then timed."""
    from ditserve.kernels.lora_gemm import gluon_op

    n_req, tokens = (int(v) for v in batch.split("x"))
    x = torch.randn(n_req * tokens, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(9216, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    want = F.linear(x, w)
    seg = torch.zeros(x.shape[0], device="cuda", dtype=torch.int32)
    slot = torch.full((1,), -1, device="cuda", dtype=torch.int32)
    s0 = x.new_empty((3, x.shape[0], 0))
    b0 = x.new_empty((1, 9216, 16))
    fns = {
        "cuBLAS": lambda: F.linear(x, w),
        "Gluon GEMM (kernels/lora_gemm), no LoRA": lambda: gluon_op.launch_gluon_lora_gemm(
            x, w, None, s0, b0, seg, slot, [3072] * 3
        ),
        "one acc": lambda: probe_gemm(x, w, False, False),
        "one acc, y stored during the next tile's first MMA": lambda: probe_gemm(x, w, False, True),
        "two accs": lambda: probe_gemm(x, w, True, False),
    }
    rows = []
    for name, fn in list(fns.items())[1:]:
        err = (fn().float() - want.float()).abs().max().item()
        print(f"{batch} {name}: max |y - F.linear| = {err:.3g}", flush=True)
        if err > 0.1:
            rows.append(f"| {batch} | | {name} | WRONG ({err:.3g}) | |")
            del fns[name]
    res = lk.interleaved(fns, rounds, 0.25)
    base = res["cuBLAS"][0]
    for name, (ms, ratio) in res.items():
        if name != "cuBLAS":
            rows.append(
                f"| {batch} | {base * 1e3:.0f} µs | {name} | {ms * 1e3:.0f} µs | {100 * (ratio - 1):+.1f}% |"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="4x4608,1x4608")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; QKV 3 × 3072, hidden 3072, bf16; "
        f"{args.rounds} interleaved rounds, 0.25 s idle before each timing",
        "",
        "| batch | cuBLAS | form | time | vs cuBLAS |",
        "|---|---|---|---|---|",
    ]
    for batch in args.batches.split(","):
        lines += _rows(batch, args.rounds)
        print("\n".join(lines), flush=True)
    with open(os.path.join(args.out, "gemm_epilogue_probe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
