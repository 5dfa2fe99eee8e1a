"""What the vendor's GEMMs reach on the shrink's shapes (GPU): the segmented shrink (`lora_shrink`, fp32 s as in
the kernel table, and the scaled bf16 s the fused GEMM reads) against cuBLAS on the same bytes and FLOPs with one
adapter for every row (x · Aᵀ, A the slices' rows stacked: no segments at all), PyTorch's grouped GEMM
(`torch._grouped_mm`, one group per request, where this torch has it) and a plain read of x, all graph-timed with
the kernel table's L2 flush (read). % HBM is against the kernel table's floor (bytes / 2 GiB copy bandwidth).

    PYTHONPATH=<dir holding ditserve/> python3 benchmarks/probes/shrink_baselines.py --out DIR   # DIR/shrink_baselines.md
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels"))
import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import copy_bandwidth, make_problem, matmul_flops  # noqa: E402
from ditserve.kernels.lora import lora_shrink  # noqa: E402


def grouped_call(p):
    """torch._grouped_mm over the requests (x rows of request g times its adapter's stacked A rows), or None
    where this torch or GPU has none."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    m = p.meta
    slots = m.seg_slot.tolist()
    w = torch.stack([p.a[:, max(s, 0)].reshape(-1, p.a.shape[-1]) for s in slots])  # [G, slices·rank, hidden]
    offs = (m.seg_start + m.seg_len).to(torch.int32)
    fn = lambda: torch._grouped_mm(p.x, w.transpose(-2, -1), offs=offs)  # noqa: E731
    try:
        out = fn()
        spans = zip(m.seg_start.tolist(), m.seg_len.tolist(), strict=True)
        ref = torch.cat([p.x[a : a + n] @ w[g].T for g, (a, n) in enumerate(spans)])
        assert torch.allclose(out.float(), ref.float(), atol=0.1, rtol=0.05), "grouped_mm differs"
    except Exception as e:  # noqa: BLE001 - reported as the row's cell
        print(f"grouped_mm: {type(e).__name__}: {str(e)[:100]}", flush=True)
        return None
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--batches", default="4x4608,skew 4608/1024/4608/256,1x4608")
    ap.add_argument("--slices", default="3,4")
    ap.add_argument("--ranks", default="16,32,64,128")
    args = ap.parse_args()
    lk.FLUSH_MODE = "read"
    bw, mm = copy_bandwidth(), matmul_flops()
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, commit {lk.commit()}; 2 GiB clone "
        f"{bw / 1e9:.0f} GB/s, bf16 matmul 8192³ {mm / 1e12:.0f} TFLOP/s; L2 flushed by a read before each call",
        "",
        "| batch | slices | rank | floor (HBM / roof) | shrink, fp32 s | shrink, scaled bf16 s | cuBLAS x · Aᵀ, "
        "one adapter | grouped_mm | read of x |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for batch in args.batches.split(","):
        for nsl in map(int, args.slices.split(",")):
            for rank in map(int, args.ranks.split(",")):
                p = make_problem(lk.BATCHES[batch], rank, lk.SLICES[nsl])
                m = p.meta
                hbm = p.shrink_bytes() / bw * 1e3
                roof = max(hbm, p.shrink_flops() / mm * 1e3)
                dense = p.a[:, 0].reshape(-1, p.a.shape[-1]).contiguous()  # [slices·rank, hidden]
                x64 = p.x.view(torch.int64)
                fns = {
                    "fp32": lambda p=p, m=m: lora_shrink(p.x, p.a, m),
                    "scaled": lambda p=p, m=m: lora_shrink(p.x, p.a, m, scaled=True),
                    "cublas": lambda p=p, d=dense: p.x @ d.T,
                    "grouped": grouped_call(p),
                    "read": lambda x64=x64: x64.sum(),
                }
                cells = []
                for fn in fns.values():
                    if fn is None:
                        cells.append("—")
                        continue
                    ms = min(lk.quick_graph_ms(fn) for _ in range(3))
                    cells.append(f"{ms * 1e3:.1f} µs · {100 * hbm / ms:.0f}% / {100 * roof / ms:.0f}%")
                lines.append(f"| {batch} | {nsl} | {rank} | {hbm * 1e3:.1f} / {roof * 1e3:.1f} µs | "
                             + " | ".join(cells) + " |")  # fmt: skip
                print(lines[-1], flush=True)
                lk.save(args.out, lines, "shrink_baselines")
                del p, dense, x64
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
