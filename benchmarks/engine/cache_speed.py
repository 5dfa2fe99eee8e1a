"""Step caching's saving in time on a FLUX.1-dev-size transformer (random bf16 weights), one GPU.

Random weights cannot show real cache hit rates, so the hit pattern is forced: ``taylorseer`` decides by
schedule only (warmup, then one computed forward in ``interval``), and its default here (interval 2, warmup
2: the setting demo-scenes recommends, see benchmarks/engine/cache_scenes.py) gives the same pattern as on
demo-scenes. Every row runs through the worker a replica runs on each rank (runner, LoRA manager and their
wiring; no CUDA graphs, no fused epilogues), bf16, 1024², 28 steps, each against its own uncached baseline
measured in the same run:

- eager, batch 1: one request uncached (the baseline) and cached;
- eager, a 4-request batch: all uncached (the baseline), then two of the four cached;
- eager, a 4-request batch with LoRA on every request (its own adapter each: rank ``--lora-rank`` on every
  linear of the transformer blocks): all uncached, then two cached (the hits leave the batch for the
  blocks after the first; the adapters of the computing rows follow them);
- ``--compile`` (regional compilation, as the engine does), batch 1 and the 4-request batch as above:
  compiled after the eager rows, warmed up on every row count the cached rows give the later blocks.

Per row: seconds per image, computed forwards / all forwards (the ideal time ratio if time ∝ computed
forwards), and measured ratio / ideal (goal ≤ 1.05). The first block runs on every forward (it decides),
so a little above 1 is expected. Results are written after each group of rows; a group that would not
finish within ``--budget-s`` is left out (and named in the results).

    GIT_COMMIT=$(git rev-parse --short HEAD) python benchmarks/engine/cache_speed.py --out DIR
    python benchmarks/engine/cache_speed.py --tiny --size 64 --steps 6 --out /tmp/cs     # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from batching import config_folder  # noqa: E402
from engine_vs_diffusers import build_pipe  # noqa: E402
from lora_engine import detach_lora, random_adapter  # noqa: E402
from report import write_results  # noqa: E402

from ditserve.replica.caching import CacheSettings  # noqa: E402
from ditserve.replica.config import EngineConfig  # noqa: E402
from ditserve.replica.pipelines.base import usage  # noqa: E402
from ditserve.replica.request import GenerationParams, LoRARef  # noqa: E402
from ditserve.replica.worker import RankWorker  # noqa: E402


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
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--groups", default="eager,lora,compile", help="row groups to run, in this order (comma-separated)"
    )
    parser.add_argument("--budget-s", type=float, default=500.0, help="leave out groups that would end later")
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run on a tiny model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    groups = args.groups.split(",")
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    pipe = build_pipe(tiny=args.tiny, device=device, dtype=dtype)
    config = EngineConfig(
        model=config_folder(pipe),
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        max_sequence_length=32 if args.tiny else 512,
        max_batch_size=4,
        max_loras=4,
        max_lora_rank=args.lora_rank,
        cuda_graphs=False,  # caching forwards run without graphs; the baselines too
        fused_epilogues=False,
    )
    worker = RankWorker(config, pipe=pipe)
    cache = CacheSettings(policy="taylorseer", interval=args.interval, warmup=args.warmup)

    def request(i: int, cached: bool, lora: bool = False, steps: int = args.steps) -> GenerationParams:
        return GenerationParams(
            prompt=f"a photograph number {i}",
            width=args.size,
            height=args.size,
            num_inference_steps=steps,
            guidance_scale=3.5,
            seed=i,
            cache=cache if cached else None,
            lora=(LoRARef(name=f"a{i}"),) if lora else (),
        )

    rows: list[dict] = []
    left_out: list[str] = []
    notes: list[str] = []

    def measure(label: str, batches: list[list[bool]], lora: bool = False) -> None:
        for batch in batches:
            params = [request(i, c, lora) for i, c in enumerate(batch)]
            seconds, computed, total = run_batch(worker.runner, params)
            rows.append(
                {
                    "batch": label,
                    "requests": len(batch),
                    "cached_requests": sum(batch),
                    "lora": lora,
                    "s_per_image": seconds / len(batch),
                    "computed_forwards": computed,
                    "forwards": total,
                }
            )
            print(rows[-1], flush=True)
        report()

    def report() -> None:
        lines = [
            f"{'Tiny' if args.tiny else 'FLUX.1-dev-size'} transformer, random "
            f"{str(dtype).removeprefix('torch.')} weights, {args.size}², "
            f"{args.steps} steps; taylorseer interval {args.interval}, warmup {args.warmup}; LoRA: one "
            f"rank-{args.lora_rank} adapter per request on every block linear; no CUDA graphs, no fused "
            "epilogues.",
            "",
            "| rows | requests | cached requests | s / image | computed / all forwards (ideal ratio) | "
            "measured ratio | measured / ideal |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            base = next(b for b in rows if b["batch"] == r["batch"] and b["cached_requests"] == 0)
            ideal = r["computed_forwards"] / r["forwards"]
            measured = r["s_per_image"] / base["s_per_image"]
            r["ideal_ratio"], r["measured_ratio"] = ideal, measured
            lines.append(
                f"| {r['batch']} | {r['requests']} | {r['cached_requests']} | {r['s_per_image']:.2f} | "
                f"{r['computed_forwards']}/{r['forwards']} ({ideal:.3f}) | {measured:.3f} | "
                f"{measured / ideal:.3f} |"
            )
        if left_out:
            lines += ["", f"Left out (over --budget-s {args.budget_s:.0f}): {', '.join(left_out)}."]
        lines += ["", *notes, f"Run time: {time.perf_counter() - t0:.0f} s."]
        write_results("cache_speed", "\n".join(lines), rows, out=args.out, baseline="the same rows uncached")
        print("\n".join(lines), flush=True)

    def fits(group: str, batch4_s: float) -> bool:
        """Whether a group's rows (a rough multiple of one uncached 4-request batch) end within the budget."""
        needed = {"eager": 0.0, "lora": 3.5 * batch4_s, "compile": 5.0 * batch4_s + 180.0}[group]
        if group in groups and time.perf_counter() - t0 + needed > args.budget_s:
            left_out.append(group)
            print(f"left out: {group} (budget)", flush=True)
            return False
        return group in groups

    run_batch(worker.runner, [request(0, False)])  # warm-up (allocator, kernels)
    run_batch(worker.runner, [request(0, True)])
    if fits("eager", 0.0):
        measure("eager, batch 1", [[False], [True]])
        measure("eager, batch 4", [[False] * 4, [True, False, True, False]])
    batch4 = next((r["s_per_image"] * 4 for r in rows if r["batch"] == "eager, batch 4"), 0.0)
    if fits("lora", batch4):
        for i in range(4):
            lora = random_adapter(pipe.transformer, args.lora_rank, seed=100 + i)
            worker.lora.load_weights(f"a{i}", lora, source="memory")
        # warm-up: the groups of linears on one input are learned, the LoRA kernels built
        run_batch(worker.runner, [request(i, False, True, steps=4) for i in range(4)])
        run_batch(worker.runner, [request(i, i % 2 == 0, True, steps=4) for i in range(4)])
        measure("eager, batch 4, LoRA", [[False] * 4, [True, False, True, False]], lora=True)
        detach_lora(worker.lora)  # the compiled rows run without LoRA on the same transformer
    if fits("compile", batch4):
        # the same transformer compiled in place, as --compile does (the worker's step cache wraps the
        # compiled blocks: built again for this worker)
        worker = RankWorker(config.model_copy(update={"compile": True}), pipe=pipe)
        gc.collect()
        # warm-up, short: batch 1, and 4 rows whose later blocks then see 2 (the compiled shapes)
        run_batch(worker.runner, [request(0, False, steps=4)])
        run_batch(worker.runner, [request(0, True, steps=4)])
        run_batch(worker.runner, [request(i, i % 2 == 0, steps=4) for i in range(4)])
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        measure("compiled, batch 1", [[False], [True]])
        measure("compiled, batch 4", [[False] * 4, [True, False, True, False]])
        notes.append(
            f"--compile: {graphs} graphs compiled in the warm-up, "
            f"{counters['stats']['unique_graphs'] - graphs} more while the compiled rows were timed."
        )
    report()


if __name__ == "__main__":
    main()
