"""LoRA in the engine: a batch of requests with different adapters against the same batch without LoRA.

    GIT_COMMIT=$(git rev-parse --short HEAD) python benchmarks/lora_engine.py --out DIR
    python benchmarks/lora_engine.py --tiny --device cpu --size 64 --out /tmp/le      # CPU smoke run

FLUX.1-dev-sized transformer (random bf16 weights, built in memory as in engine_vs_diffusers.py) in the
real Engine loop. ``--requests`` requests of one size share every step; with LoRA each has its own adapter
(rank ``--rank`` on every linear of the transformer blocks: attention q/k/v/out for both streams, the
feed-forwards, single-block proj_mlp/proj_out), random weights put straight into the slots. Time per
step = the engine's step time (every rank command of the step), median over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from batching import config_folder  # noqa: E402
from engine_vs_diffusers import build_pipe, commit, device_name, flux_configs  # noqa: E402

from ditserve.replica.config import EngineConfig  # noqa: E402
from ditserve.replica.engine import Engine  # noqa: E402
from ditserve.replica.launcher import InProcessLauncher  # noqa: E402
from ditserve.replica.lora.loader import LoRAFile, LoRAModule  # noqa: E402
from ditserve.replica.request import GenerationParams, LoRARef  # noqa: E402

TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
    "proj_out",
)


def random_adapter(transformer, rank: int, seed: int) -> LoRAFile:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and "blocks." in name and name.endswith(TARGETS):
            a = torch.randn(rank, module.in_features, generator=g) * 0.01
            b = torch.randn(module.out_features, rank, generator=g) * 0.01
            modules[name] = LoRAModule(a=a, b=b, bias=None)
    return LoRAFile(modules=modules, rank=rank, ignored=0)


def timed_steps(engine: Engine, params: list[GenerationParams]) -> list[float]:
    """Per-step times of one batch run (all requests submitted together)."""
    times: list[float] = []
    last = [engine.step_seconds_total]

    def on_progress(done: int, total: int) -> None:
        if engine.step_seconds_total != last[0]:
            times.append(engine.step_seconds_total - last[0])
            last[0] = engine.step_seconds_total

    futures = [engine.submit(p, on_progress=on_progress if i == 0 else None) for i, p in enumerate(params)]
    for f in futures:
        f.result()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    pipe = build_pipe(tiny=args.tiny, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    config = EngineConfig(
        model=config_folder(pipe),
        device=args.device,
        dtype=str(dtype).removeprefix("torch."),
        max_batch_size=args.requests,
        max_loras=args.requests,
        max_lora_rank=args.rank,
        max_sequence_length=flux_configs(args.tiny)["max_sequence_length"],
    )
    engine = Engine(config, launcher=InProcessLauncher(pipe)).start()
    t0 = time.perf_counter()
    manager = engine.launcher.worker.lora
    for i in range(args.requests):
        info = manager.load_weights(f"a{i}", random_adapter(pipe.transformer, args.rank, i), source="memory")
        engine.loras[f"a{i}"] = info
    load_s = time.perf_counter() - t0

    def batch(with_lora: bool) -> list[GenerationParams]:
        return [
            GenerationParams(
                prompt=f"request {i}",
                width=args.size,
                height=args.size,
                seed=i,
                num_inference_steps=args.steps,
                lora=(LoRARef(name=f"a{i}"),) if with_lora else (),
            )
            for i in range(args.requests)
        ]

    rows = []
    try:
        for with_lora in (False, True):  # warm-up both paths, then time
            timed_steps(engine, batch(with_lora))
        results = {}
        for with_lora in (False, True, False, True):
            results.setdefault(with_lora, []).extend(timed_steps(engine, batch(with_lora))[1:])
    finally:
        engine.shutdown()
    base, lora = statistics.median(results[False]), statistics.median(results[True])
    row = {
        "size": args.size,
        "requests": args.requests,
        "rank": args.rank,
        "adapters": args.requests,
        "linears": len(manager.layers),
        "step_ms_no_lora": base * 1e3,
        "step_ms_lora": lora * 1e3,
        "ratio": lora / base,
        "load_s": load_s,
        "device": device_name(device),
        "commit": commit(),
    }
    rows.append(row)
    print(
        "| size | requests × adapters | rank | LoRA linears | step ms, no LoRA | step ms, 4 LoRAs | ratio | device |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.size}² | {args.requests} × {args.requests} | {args.rank} | {row['linears']} | {base * 1e3:.1f} | "
        f"{lora * 1e3:.1f} | {lora / base:.3f} | {row['device']} ({row['commit']}) |",
        flush=True,
    )
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "lora_engine.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
