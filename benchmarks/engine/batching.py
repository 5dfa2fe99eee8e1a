"""Step-level continuous batching against one request at a time and a static batch, on the real Engine loop.

    GIT_COMMIT=$(git rev-parse --short HEAD) python benchmarks/engine/batching.py --out DIR
    python benchmarks/engine/batching.py --tiny --device cpu --sizes 64 --out /tmp/b     # CPU smoke run

FLUX.1-dev-sized transformer with random bf16 weights (built in memory, as in engine_vs_diffusers.py),
``--clients`` requests of ``--steps`` steps per size. Three modes, same weights, same run:

* continuous: ``max_batch_size = clients``; requests arrive at random times (uniform over a window as
  long as ``--window`` one-at-a-time images, fixed seed) and join the running batch between steps;
* one-at-a-time: ``max_batch_size = 1``, the same arrival times;
* static: every request submitted at t = 0 as one batch of identical size — the throughput ceiling.

Reports throughput (images/s) and p50/p95 latency (submit → PNG) per mode, and the ratios the goal
names: continuous / static throughput, continuous / one-at-a-time p95.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the report helper
from engine_vs_diffusers import build_pipe, commit, device_name, flux_configs  # noqa: E402
from report import markdown_table, write_results  # noqa: E402

from ditserve.replica.config import EngineConfig  # noqa: E402
from ditserve.replica.engine import Engine  # noqa: E402
from ditserve.replica.launcher import InProcessLauncher  # noqa: E402
from ditserve.replica.request import GenerationParams  # noqa: E402


def config_folder(pipe) -> str:
    """A folder with the pipeline's configs only: what the engine resolves the model spec from."""
    root = Path(tempfile.mkdtemp(prefix="ditserve-bench-"))
    pipe.save_config(root)
    pipe.transformer.save_config(root / "transformer")
    pipe.vae.save_config(root / "vae")
    return str(root)


def start_engine(pipe, **config) -> Engine:
    """The in-process Engine on an in-memory pipeline; ``config``: EngineConfig fields (dtype: the pipe's)."""
    config.setdefault("dtype", str(pipe.dtype).removeprefix("torch."))
    engine_config = EngineConfig(model=config_folder(pipe), **config)
    return Engine(engine_config, launcher=InProcessLauncher(pipe)).start()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run_mode(
    pipe, device: str, size: int, steps: int, arrivals: list[float], batch: int, max_len: int
) -> dict:
    engine = start_engine(
        pipe, device=device, max_batch_size=batch, max_queue=len(arrivals) + 1, max_sequence_length=max_len
    )
    try:
        warm = GenerationParams(prompt="warm up", width=size, height=size, num_inference_steps=2, seed=0)
        engine.generate(warm)
        latencies: list[float] = [0.0] * len(arrivals)
        done = threading.Barrier(len(arrivals) + 1)
        t0 = time.perf_counter()

        def client(i: int) -> None:
            time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
            start = time.perf_counter()
            params = GenerationParams(
                prompt=f"request {i}", width=size, height=size, num_inference_steps=steps, seed=i
            )
            engine.generate(params)
            latencies[i] = time.perf_counter() - start
            done.wait()

        steps_before = engine.steps_run
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(arrivals))]
        for t in threads:
            t.start()
        done.wait()
        wall = time.perf_counter() - t0
        return {
            "throughput": len(arrivals) / wall,
            "p50": statistics.median(latencies),
            "p95": percentile(latencies, 0.95),
            "wall": wall,
            "forwards": engine.steps_run - steps_before,
        }
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--window", type=float, default=2.0, help="arrival window in one-at-a-time images")
    parser.add_argument(
        "--budget-s", type=float, default=400.0, help="skip sizes once this much time is spent"
    )
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    start = time.perf_counter()
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    pipe = build_pipe(tiny=args.tiny, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    max_len = flux_configs(args.tiny)["max_sequence_length"]
    rows = []
    header = (
        "| size | clients | steps | mode | img/s | p50 s | p95 s | forwards | "
        "cont/static thr | cont/one p95 | device | commit |"
    )
    print(header + "\n|" + "---|" * 12, flush=True)
    for size in args.sizes:
        if time.perf_counter() - start > args.budget_s:
            print(f"skipping {size}²: time budget spent", flush=True)
            continue
        # Arrival window: a few one-at-a-time images long, measured by one image first.
        probe = run_mode(pipe, args.device, size, args.steps, [0.0], 1, max_len)
        rng = random.Random(size)
        window = args.window * probe["wall"]
        arrivals = sorted(rng.uniform(0, window) for _ in range(args.clients))
        results = {
            "continuous": run_mode(pipe, args.device, size, args.steps, arrivals, args.clients, max_len),
            "one-at-a-time": run_mode(pipe, args.device, size, args.steps, arrivals, 1, max_len),
            "static": run_mode(
                pipe, args.device, size, args.steps, [0.0] * args.clients, args.clients, max_len
            ),
        }
        thr_ratio = results["continuous"]["throughput"] / results["static"]["throughput"]
        p95_ratio = results["continuous"]["p95"] / results["one-at-a-time"]["p95"]
        for mode, r in results.items():
            row = {
                "size": size,
                "clients": args.clients,
                "steps": args.steps,
                "mode": mode,
                **r,
                "cont_static_throughput": thr_ratio,
                "cont_one_p95": p95_ratio,
                "device": device_name(device),
                "commit": commit(),
            }
            rows.append(row)
            print(
                f"| {size}² | {args.clients} | {args.steps} | {mode} | {r['throughput']:.3f} | {r['p50']:.2f} | "
                f"{r['p95']:.2f} | {r['forwards']} | {thr_ratio:.2f} | {p95_ratio:.2f} | {row['device']} | "
                f"{row['commit']} |",
                flush=True,
            )
    write_results("batching", markdown_table(rows), rows, out=args.out, baseline="one request at a time")


if __name__ == "__main__":
    main()
