"""A cuBLAS GEMM launched eagerly against the same GEMM replayed from a CUDA graph (GPU), on FLUX shapes.

    python3 benchmarks/graph_gemm.py [--rounds 4] [--gap-s 0.3] --out DIR

bf16 ``F.linear`` with bias; the graph holds 10 of them in a row, timed per GEMM. Rounds interleave the two
forms (the order alternating) with ``--gap-s`` of idle GPU before each timing; the fastest of each is
reported, with the largest difference between the outputs (0: the same cuBLAS algorithm). Writes
DIR/graph_gemm.md.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

SHAPES = [(18432, 3072, 9216), (18432, 3072, 12288), (18432, 15360, 3072), (4096, 3072, 3072)]


def bench(fn, n: int) -> float:
    """ms per call of n calls in a row."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gap-s", type=float, default=0.3)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.rounds} interleaved rounds, "
        f"{args.gap_s:g} s idle before each timing",
        "",
        "| tokens × in → out | eager µs | graph µs | graph / eager | max output difference |",
        "|---|---|---|---|---|",
    ]
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)

        def eager(x=x, w=w, b=b):
            return F.linear(x, w, b)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                out = F.linear(x, w, b)
        te, tg = [], []
        for r in range(args.rounds):
            for which in ("eager", "graph") if r % 2 == 0 else ("graph", "eager"):
                torch.cuda.synchronize()
                time.sleep(args.gap_s)
                if which == "eager":
                    te.append(bench(eager, 10))
                else:
                    tg.append(bench(graph.replay, 1) / 10)
        graph.replay()
        diff = (out - eager()).abs().max().item()
        lines.append(
            f"| {m} × {k} → {n} | {min(te) * 1e3:.1f} | {min(tg) * 1e3:.1f} | {min(tg) / min(te):.3f} | {diff:g} |"
        )
        print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "graph_gemm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
