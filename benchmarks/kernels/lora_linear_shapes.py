"""The LoRA linear on every kind of projection a FLUX.1-dev step runs (GPU): the shrink inside the GEMM launch
(one launch) against the shrink kernel before the GEMM (two launches), each against cuBLAS without LoRA, in
interleaved rounds, 4 requests with an adapter each.

    PYTHONPATH=<dir holding ditserve/> python3 benchmarks/kernels/lora_linear_shapes.py --ranks 16,64 --out DIR

Shapes at 1024² (4 × 4096 image tokens and 4 × 512 text tokens in the double blocks, 4 × 4608 in the single
blocks): q/k/v (3 slices), the single blocks' q/k/v/mlp (4 slices), attention out, the feed-forward's up and
down projections and the single blocks' proj_out (1 slice each). "vs cuBLAS" = median of the per-round ratios
to `F.linear` without LoRA, minus 1; each path's output is checked against the other first. Writes
DIR/lora_linear_shapes.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import make_problem  # noqa: E402
from ditserve.kernels.lora_linear import op as linear_op  # noqa: E402
from ditserve.kernels.policy import KernelPolicy  # noqa: E402

# name -> (tokens per request, hidden, output slices)
SHAPES = {
    "double img q/k/v": (4096, 3072, [3072] * 3),
    "double img out": (4096, 3072, [3072]),
    "double img ff up": (4096, 3072, [12288]),
    "double img ff down": (4096, 12288, [3072]),
    "double txt q/k/v": (512, 3072, [3072] * 3),
    "double txt out": (512, 3072, [3072]),
    "double txt ff up": (512, 3072, [12288]),
    "double txt ff down": (512, 12288, [3072]),
    "single q/k/v/mlp": (4608, 3072, [3072] * 3 + [12288]),
    "single proj_out": (4608, 15360, [3072]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated SHAPES names")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gap-s", type=float, default=0.1)
    args = ap.parse_args()
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, commit {lk.commit()}; 4 requests, 4 adapters",
        "",
        "| projection | tokens | hidden | outputs | rank | cuBLAS | one launch | two launches |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank in map(int, args.ranks.split(",")):
        for name in args.shapes.split(","):
            per_request, hidden, sizes = SHAPES[name]
            p = make_problem([(per_request, i) for i in range(4)], rank, sizes, hidden=hidden)
            m = p.meta
            seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)

            def lora(shrink_in: bool, p=p, m=m, seg=seg):
                return linear_op.launch_lora_linear(
                    p.x, p.w, None, p.a, p.b, *seg, m.max_rank, p.sizes, m.seg_align,
                    policy=KernelPolicy(gluon=True, shrink_in=shrink_in),
                )[0]  # fmt: skip

            one, two = lora(True), lora(False)
            ok = torch.allclose(one.float(), two.float(), atol=6e-2, rtol=3e-2)
            res = lk.interleaved(
                {
                    "cuBLAS": lambda p=p: F.linear(p.x, p.w),
                    "one launch": lambda lora=lora: lora(True),
                    "two launches": lambda lora=lora: lora(False),
                },
                args.rounds,
                args.gap_s,
            )

            def col(key, res=res):
                return f"{100 * (res[key][1] - 1):+.1f}%" if key in res else "—"

            lines.append(
                f"| {name} | {m.num_tokens} | {hidden} | {'+'.join(map(str, sizes))} | {rank} | "
                f"{res['cuBLAS'][0] * 1e3:.0f} µs | {col('one launch')} | {col('two launches')}"
                f"{'' if ok else ' (outputs differ)'} |"
            )
            print(lines[-1], flush=True)
            lk.save(args.out, lines, "lora_linear_shapes")
            del p, one, two
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
