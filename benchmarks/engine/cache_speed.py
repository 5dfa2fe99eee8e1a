"""Step caching's saving in time on a FLUX.1-dev-size transformer (random bf16 weights), one GPU.

Random weights cannot show real cache hit rates, so the hit pattern is forced: ``taylorseer`` decides by
schedule only (warmup, then one computed forward in ``interval``), and its default here (interval 2, warmup
2: the setting demo-scenes recommends, see benchmarks/engine/cache_scenes.py) gives the same pattern as on
demo-scenes. Rows, all eager bf16 through the runner a replica uses (1024², 28 steps):

- batch 1: one request uncached (the baseline) and cached;
- a 4-request batch: all uncached (the baseline), then two of the four cached.

Per row: seconds per image, computed forwards / all forwards (the ideal time ratio if time ∝ computed
forwards), and measured ratio / ideal (goal ≤ 1.05). The first block runs on every forward (it decides),
so a little above 1 is expected.

    python benchmarks/engine/cache_speed.py [--size 1024 --steps 28 --interval 2 --warmup 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from engine_vs_diffusers import build_pipe, make_runner  # noqa: E402
from report import write_results  # noqa: E402

from ditserve.replica.caching import CacheSettings  # noqa: E402
from ditserve.replica.pipelines.base import usage  # noqa: E402
from ditserve.replica.request import GenerationParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_batch(runner, params: list[GenerationParams]) -> tuple[float, int, int]:
    """(seconds for the whole batch to finish, computed forwards, all forwards)."""
    sync()
    start = time.perf_counter()
    states = [runner.add(f"r{i}", p) for i, p in enumerate(params)]
    running = list(states)
    while running:
        runner.step(running)
        running = [s for s in running if not s.done]
    sync()
    seconds = time.perf_counter() - start
    used = [usage(s) for s in states]
    total = sum(u["transformer_forwards"] for u in used)
    return seconds, total - sum(u["cached_forwards"] for u in used), total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run on a tiny model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    pipe = build_pipe(tiny=args.tiny, device=device, dtype=dtype)
    runner = make_runner(pipe, device=device, dtype=dtype, max_sequence_length=32 if args.tiny else 512)
    cache = CacheSettings(policy="taylorseer", interval=args.interval, warmup=args.warmup)

    def request(i: int, cached: bool) -> GenerationParams:
        return GenerationParams(
            prompt=f"a photograph number {i}",
            width=args.size,
            height=args.size,
            num_inference_steps=args.steps,
            guidance_scale=3.5,
            seed=i,
            cache=cache if cached else None,
        )

    run_batch(runner, [request(0, False)])  # warm-up (allocator, kernels)
    run_batch(runner, [request(0, True)])
    rows = []
    for label, batch in (
        ("batch 1", [False]),
        ("batch 1", [True]),
        ("batch 4", [False] * 4),
        ("batch 4", [True, False, True, False]),
    ):
        seconds, computed, total = run_batch(runner, [request(i, c) for i, c in enumerate(batch)])
        rows.append(
            {
                "batch": label,
                "cached_requests": sum(batch),
                "s_per_image": seconds / len(batch),
                "computed_forwards": computed,
                "forwards": total,
            }
        )
        print(rows[-1], flush=True)
    lines = [
        f"FLUX.1-dev-size transformer, random bf16 weights, eager, {args.size}², {args.steps} steps; taylorseer "
        f"interval {args.interval}, warmup {args.warmup}.",
        "",
        "| batch | cached requests | s / image | computed / all forwards (ideal ratio) | measured ratio | measured / ideal |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(b for b in rows if b["batch"] == r["batch"] and b["cached_requests"] == 0)
        ideal = r["computed_forwards"] / r["forwards"]
        measured = r["s_per_image"] / base["s_per_image"]
        r["ideal_ratio"], r["measured_ratio"] = ideal, measured
        lines.append(
            f"| {r['batch']} | {r['cached_requests']} | {r['s_per_image']:.2f} | {r['computed_forwards']}/"
            f"{r['forwards']} ({ideal:.3f}) | {measured:.3f} | {measured / ideal:.3f} |"
        )
    write_results("cache_speed", "\n".join(lines), rows, out=args.out, baseline="the same batch uncached")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
