"""The LoRA overhead of a Flux block's QKV projection counted from the norm that feeds it (GPU).

    python benchmarks/lora_norm_qkv.py --out DIR [--rounds 7] [--gap-s 0.25] [--ranks 16,32,64] [--slices 3,4]

A block's q, k, v (and a single block's proj_mlp) read the output of its adaLN norm. Without LoRA the engine
runs the norm (`kernels/adaln`) and then the projection (cuBLAS). With LoRA it runs, on the same norm output,
either `lora_linear` (the shrink inside the GEMM launch: what the engine ran before) or the norm with the
shrink in its own pass (`launch_adaln_shrink`) and then `lora_gemm` on that s. Each form is timed as the pair
of launches, interleaved in rounds (lora_kernels.interleaved's timing: CUDA-graph replays, L2 emptied before
each call), together with each launch alone. Overhead = median over the rounds of
(pair with LoRA - norm + cuBLAS) / cuBLAS, i.e. everything LoRA adds to the norm and the projection, as a
fraction of the projection's GEMM. Shapes: hidden 3072, 4 requests × 4608 tokens (one per batch element),
4 adapters, 3 slices (q, k, v: 3 × 3072) or 4 (+ proj_mlp 12288), as in lora_kernels.py --qkv-only. Every
form's y and s are checked against the torch references first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lora_kernels as lk  # noqa: E402

from ditserve.kernels._bench import make_problem  # noqa: E402
from ditserve.kernels.adaln.op import SHRINK_DEFAULT, SHRINK_SWEEP, launch_adaln, launch_adaln_shrink  # noqa: E402
from ditserve.kernels.lora_gemm.op import launch_lora_gemm  # noqa: E402
from ditserve.kernels.lora_linear.op import launch_lora_linear  # noqa: E402
from ditserve.kernels.lora_linear.reference import lora_linear_ref  # noqa: E402
from ditserve.kernels.lora_shrink.reference import lora_shrink_scaled_ref  # noqa: E402

HIDDEN, REQUESTS, TOKENS, EPS = 3072, 4, 4608, 1e-6
TARGETS = {16: 4.0, 64: 8.0}


def run_shape(nsl: int, rank: int, args) -> tuple[list[str], dict]:
    p = make_problem([(TOKENS, i) for i in range(REQUESTS)], rank, lk.SLICES[nsl])
    m = p.meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(REQUESTS * TOKENS, HIDDEN, device="cuda", generator=g) * 2 + 0.5).bfloat16()
    shift = torch.randn(REQUESTS, HIDDEN, device="cuda", generator=g).bfloat16()
    scale = (torch.randn(REQUESTS, HIDDEN, device="cuda", generator=g) * 0.3).bfloat16()
    row_slot = torch.arange(REQUESTS, dtype=torch.int32, device="cuda")
    row_scale = m.seg_scale.clone()  # one segment per request, in row order
    y0 = launch_adaln(x, shift, scale, EPS)

    def norm_shrink(cfg=None):
        return launch_adaln_shrink(
            x, shift, scale, EPS, p.a, row_slot, row_scale, m.slot_rank, m.max_rank, cfg
        )

    def gemm(y, s):
        return launch_lora_gemm(
            y, p.w, None, s[:nsl], p.b, *seg, p.sizes, s_scaled=True, seg_align=m.seg_align
        )

    def linear(y):
        return launch_lora_linear(y, p.w, None, p.a, p.b, *seg, m.max_rank, p.sizes, m.seg_align)[0]

    # checks: the fused norm's y is the norm's, its s the shrink of that y, both LoRA forms the reference
    s_want = lora_shrink_scaled_ref(y0, p.a, *seg[:4], m.seg_scale, m.slot_rank, m.max_rank)
    want = lora_linear_ref(y0, p.w, None, p.a, p.b, *seg[1:], m.max_rank, p.sizes).float()
    for name, cfg in SHRINK_SWEEP.items():
        y, s = norm_shrink(cfg)
        torch.testing.assert_close(y, launch_adaln(x, shift, scale, EPS, config=cfg), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(
            s.float(), s_want.float(), atol=2e-2, rtol=2e-2, msg=lambda e, n=name: f"{n}: {e}"
        )
    y, s = norm_shrink()
    for name, out in (("norm-shrink + lora_gemm", gemm(y, s)), ("norm + lora_linear", linear(y0))):
        torch.testing.assert_close(out.float(), want, atol=6e-2, rtol=3e-2, msg=lambda e, n=name: f"{n}: {e}")

    fns = {
        "norm + cuBLAS": lambda: F.linear(launch_adaln(x, shift, scale, EPS), p.w),
        "norm + lora_linear": lambda: linear(launch_adaln(x, shift, scale, EPS)),
        "norm-shrink + lora_gemm": lambda: gemm(*norm_shrink()),
        "cuBLAS": lambda: F.linear(y0, p.w),
        "lora_linear": lambda: linear(y0),
        "lora_gemm (s given)": lambda: gemm(y0, s),
        "norm": lambda: launch_adaln(x, shift, scale, EPS),
    }
    for name, cfg in SHRINK_SWEEP.items():
        fns[f"norm-shrink {name}" + (" (default)" if cfg == SHRINK_DEFAULT else "")] = lambda cfg=cfg: (
            norm_shrink(cfg)
        )
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        row = {}
        for k, fn in fns.items():
            torch.cuda.synchronize()
            time.sleep(args.gap_s)
            row[k] = lk.quick_graph_ms(fn)
        rounds.append(row)
    med = statistics.median
    t = {k: med(r[k] for r in rounds) * 1e3 for k in fns}  # µs

    def over(k: str) -> float:
        return 100 * med((r[k] - r["norm + cuBLAS"]) / r["cuBLAS"] for r in rounds)

    def part(k: str, base: str) -> float:
        return 100 * med((r[k] - r[base]) / r["cuBLAS"] for r in rounds)

    target = TARGETS.get(rank) if nsl == 3 else None
    row = (
        f"| {nsl} | {rank} | {t['cuBLAS']:.1f} | {t['norm']:.1f} | {t['norm + cuBLAS']:.1f} | "
        f"{t['norm + lora_linear']:.1f} | **{over('norm + lora_linear'):+.1f} %** | "
        f"{t['norm-shrink + lora_gemm']:.1f} | **{over('norm-shrink + lora_gemm'):+.1f} %** | "
        f"{part('lora_gemm (s given)', 'cuBLAS'):+.1f} % | "
        + " | ".join(f"{t[k]:.1f}" for k in fns if k.startswith("norm-shrink ") and "+" not in k)
        + (f" | ≤ {target:g} % |" if target else " |  |")
    )
    return [row], {"slices": nsl, "rank": rank, "us": t, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gap-s", type=float, default=0.25)
    ap.add_argument("--ranks", default="16,32,64")
    ap.add_argument("--slices", default="3,4")
    args = ap.parse_args()
    names = [k + (" (default)" if c == SHRINK_DEFAULT else "") for k, c in SHRINK_SWEEP.items()]
    lines = [
        f"# The QKV projection's LoRA overhead from the norm on ({torch.cuda.get_device_name()}, commit "
        f"{lk.commit()}, torch {torch.__version__})",
        "",
        f"hidden {HIDDEN}, {REQUESTS} requests × {TOKENS} tokens, {REQUESTS} adapters; {args.rounds} rounds, "
        f"{args.gap_s:g} s idle before each timing; µs are medians; overhead = median over rounds of (pair - "
        "(norm + cuBLAS)) / cuBLAS; norm-shrink columns: the fused norm alone per tile (BLOCK_M/BLOCK_K/warps/"
        "stages)",
        "",
        "| slices | rank | cuBLAS | norm | norm + cuBLAS | norm + lora_linear | overhead | norm-shrink + lora_gemm "
        "| overhead | lora_gemm alone vs cuBLAS | "
        + " | ".join(f"norm-shrink {n}" for n in names)
        + " | target |",
        "|" + "---|" * (11 + len(names)),
    ]
    print("\n".join(lines), flush=True)
    records = []
    for nsl in map(int, args.slices.split(",")):
        for rank in map(int, args.ranks.split(",")):
            rows, rec = run_shape(nsl, rank, args)
            lines += rows
            records.append(rec)
            print("\n".join(rows), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lora_norm_qkv.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "lora_norm_qkv.json"), "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
