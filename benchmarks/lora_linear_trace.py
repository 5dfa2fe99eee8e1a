"""Where the one Gluon launch's time goes: a timeline per program (TRACE, `gluon_kernel._trace`) of the
shrink inside the launch with its units spread over the run (SPREAD), on the Flux QKV shape (4 requests ×
4608 tokens, hidden 3072, 3 × 3072 outputs, 4 adapters). For each traced launch: the span from the first
program's start to the last program's end; per program its runs of tiles (time per tile), its shrink units,
its first tile (K steps, the wait for its group's s, the LoRA steps) and its end; then the programs with one
tile more ("long") against those that run the units ("short"). One H200:

    python3 benchmarks/lora_linear_trace.py --ranks 16 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
import triton.testing

from ditserve.kernels._bench import make_problem
from ditserve.kernels._dispatch import num_programs_limit
from ditserve.kernels.lora_gemm import gluon_op
from ditserve.kernels.lora_gemm.gluon_kernel import TRACE_EVENTS


def cuda_ms(fn) -> float:
    """Median ms of fn (as the other kernel benchmarks time it)."""
    return triton.testing.do_bench(fn, return_mode="median")


def timeline(trace: torch.Tensor) -> dict:
    """The per-program events of one launch → a summary (µs from the first program's start)."""
    ev = trace.cpu().tolist()
    t0 = min(p[0][2] for p in ev if p[0][2] > 0)
    progs = []
    for events in ev:
        events = [(k, a, (t - t0) / 1e3) for k, a, t in events if t > 0]
        runs, units, first, last = [], [], None, events[0][2]  # (tiles, µs) per run, µs per unit
        open_run = open_unit = None
        for kind, aux, t in events:
            last = max(last, t)
            if kind == 3:
                open_run = (aux, t)
            elif kind == 4 and open_run:
                runs.append(dict(tiles=aux - open_run[0], us=t - open_run[1]))
            elif kind == 1:
                open_unit = t
            elif kind == 2 and open_unit is not None:
                units.append(t - open_unit)
            elif kind == 5:
                first = t - events[0][2]
        tiles = sum(r["tiles"] for r in runs) + (first is not None)
        progs.append(dict(start=events[0][2], end=last, tiles=tiles, runs=runs, units=units, first=first))
    span = max(p["end"] for p in progs)
    per_tile = [r["us"] / r["tiles"] for p in progs for r in p["runs"] if r["tiles"] >= 4]
    unit_us = [u for p in progs for u in p["units"]]
    most = max(p["tiles"] for p in progs)
    long_ = [p for p in progs if p["tiles"] == most]
    short = [p for p in progs if p["tiles"] < most]

    def q(xs):
        xs = sorted(xs)
        return [round(xs[0], 1), round(statistics.median(xs), 1), round(xs[-1], 1)] if xs else []

    return dict(
        span_us=round(span, 1),
        per_tile_us=q(per_tile),
        unit_us=q(unit_us),
        units=len(unit_us),
        first_tile_us=q([p["first"] for p in progs if p["first"] is not None]),
        long_programs=len(long_),
        long_end_us=q([p["end"] for p in long_]),
        short_end_us=q([p["end"] for p in short]),
        short_busy_in_units_us=q([sum(p["units"]) for p in short]),
        start_skew_us=q([p["start"] for p in progs]),
        idle_at_end_us=round(sum(span - p["end"] for p in progs) / len(progs), 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="16")
    ap.add_argument("--traces", type=int, default=5)
    ap.add_argument("--variants", default="", help="GLUON_CONFIG overrides to trace besides the default, "
                    "e.g. 'LATE=1,LEAD=0;LATE=1'")  # fmt: skip
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {}
    variants = [""] + [v for v in args.variants.split(";") if v]
    for rank, variant in ((int(r), v) for r in args.ranks.split(",") for v in variants):
        p = make_problem([(4608, i) for i in range(4)], rank, [3072] * 3)
        m = p.meta
        over = {k: int(v) for k, v in (kv.split("=") for kv in variant.split(",") if kv)}
        cfg = {**gluon_op.GLUON_CONFIG, "SPREAD": 2, **over}

        def run(trace=None, p=p, m=m, cfg=cfg):
            return gluon_op.launch_gluon_lora_linear(
                p.x, p.w, None, p.a, p.b, m.token_seg, m.seg_slot, m.seg_scale, m.slot_rank, m.max_rank, p.sizes,
                cfg, trace=trace,
            )  # fmt: skip

        base = cuda_ms(lambda p=p: F.linear(p.x, p.w))
        plain = cuda_ms(run)
        events = int(TRACE_EVENTS.value)
        trace = torch.zeros(num_programs_limit(p.x.device), events, 3, dtype=torch.int64, device="cuda")
        traced = cuda_ms(lambda run=run, trace=trace: run(trace))
        lines = []
        for _ in range(args.traces):
            trace.zero_()
            run(trace)
            torch.cuda.synchronize()
            lines.append(timeline(trace))
        results[f"rank {rank} {variant}".strip()] = dict(
            cublas_us=base * 1e3, one_launch_us=plain * 1e3, traced_us=traced * 1e3, runs=lines
        )
        print(f"rank {rank} {variant}: cuBLAS {base * 1e3:.0f} µs, one launch {plain * 1e3:.0f} µs "
              f"({100 * (plain / base - 1):+.1f} %), traced {traced * 1e3:.0f} µs")  # fmt: skip
        for line in lines:
            print(json.dumps(line))
    with open(os.path.join(args.out, "lora_linear_trace.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
