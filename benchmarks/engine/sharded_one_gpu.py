"""Every sharded layout of one replica, each against one rank, with the ranks sharing ONE GPU over gloo.

    GIT_COMMIT=$(git rev-parse --short HEAD) python benchmarks/engine/sharded_one_gpu.py --out DIR      # H200
    python benchmarks/engine/sharded_one_gpu.py --tiny --device cpu --out DIR                     # CPU smoke run

No multi-GPU machine is needed to run the parallel layer's GPU code paths (cuDNN attention with LSE under
ring and Ulysses, fused epilogues, the LoRA kernels on TP slices): the test mode
``DITSERVE_TEST_SHARED_GPU_GLOO=1`` (never a user default) starts every rank on the same GPU over gloo,
which takes CUDA tensors for its collectives; the ring's P2P is staged through host memory there. Speed is
not what this measures (gloo moves CUDA tensors through the host): parity is.

A FLUX.1-dev-sized pipeline with random bf16 weights (``engine_vs_diffusers.build_pipe``) and four random
rank-64 adapters (diffusers layout, every linear of the blocks) are written to a folder once; each layout
runs the real engine on it (``Engine`` with ``LocalProcessLauncher``: ``RankWorker`` loads the folder,
shards it, applies the GPU defaults: fused epilogues; compile off). Per layout, two batches of four
true-CFG requests at ``--size``², ``--steps`` steps, started together: without adapters, and with a
different adapter on each request (the mixed batch). PSNR: each request's image against the one-rank
image of the same request in the same batch (uint8, the minimum over the four). Writes DIR/<stem>.md/.json.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from engine_vs_diffusers import build_pipe, flux_configs, psnr  # noqa: E402
from report import write_results  # noqa: E402

LAYOUTS: list[dict[str, int]] = [
    dict(ulysses_degree=2),
    dict(ring_degree=2),
    dict(kv_gather_degree=2),
    dict(tp_size=2),
    dict(cfg_parallel_size=2),
    dict(cfg_parallel_size=2, ulysses_degree=2),
    dict(tp_size=2, ulysses_degree=2),
]
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
           "ff_context.net.2", "proj_mlp", "proj_out")  # fmt: skip
NUM_ADAPTERS = 4


def write_adapters(transformer, folder: Path, rank: int) -> list[Path]:
    """``NUM_ADAPTERS`` random adapters in diffusers' layout (no alpha: scale 1), one file each."""
    from safetensors.torch import save_file

    paths = []
    for i in range(NUM_ADAPTERS):
        g = torch.Generator().manual_seed(100 + i)
        tensors = {}
        for name, module in transformer.named_modules():
            if isinstance(module, torch.nn.Linear) and "blocks." in name and name.endswith(TARGETS):
                a = torch.randn(rank, module.in_features, generator=g) * 0.01
                b = torch.randn(module.out_features, rank, generator=g) * 0.01
                tensors[f"transformer.{name}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"transformer.{name}.lora_B.weight"] = b.to(torch.bfloat16)
        paths.append(folder / f"adapter{i}.safetensors")
        save_file(tensors, str(paths[-1]))
    return paths


def decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def batch_images(engine, params: list) -> list[np.ndarray]:
    """Run ``params`` as one batch: the loop thread is held between two steps until all are queued."""
    gate = threading.Event()
    held = engine.run_control(gate.wait)
    futures = [engine.submit(p) for p in params]
    gate.set()
    held.result()
    return [decode_png(f.result().outputs[0]) for f in futures]


def run_layout(folder: str, adapters: list[Path], layout: dict[str, int], args) -> dict:
    from ditserve.replica.config import EngineConfig, ParallelFlags
    from ditserve.replica.engine import Engine
    from ditserve.replica.launcher import default_launcher
    from ditserve.replica.request import GenerationParams, LoRARef

    parallel = ParallelFlags(**layout)
    config = EngineConfig(
        model=folder,
        device=args.device,
        dtype=args.dtype,
        parallel=parallel,
        max_batch_size=NUM_ADAPTERS,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=args.rank,
        max_sequence_length=flux_configs(args.tiny)["max_sequence_length"],
    )
    t0 = time.perf_counter()
    engine = Engine(config, launcher=default_launcher(parallel.world_size)).start()
    started_s = time.perf_counter() - t0
    try:

        def params(with_lora: bool) -> list:
            return [
                GenerationParams(
                    prompt=f"a photograph of a red fox number {i}",
                    negative_prompt="blurry",
                    true_cfg_scale=4.0,
                    width=args.size,
                    height=args.size,
                    num_inference_steps=args.steps,
                    seed=i,
                    lora=[LoRARef(name=f"a{i}")] if with_lora else [],
                )  # fmt: skip
                for i in range(NUM_ADAPTERS)
            ]

        t0 = time.perf_counter()
        plain = batch_images(engine, params(False))
        plain_s = time.perf_counter() - t0
        for i, path in enumerate(adapters):
            engine.load_lora(f"a{i}", str(path), 1.0)
        t0 = time.perf_counter()
        lora = batch_images(engine, params(True))
        lora_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"started_s": started_s, "plain_s": plain_s, "lora_s": lora_s, "plain": plain, "lora": lora}


def describe(layout: dict[str, int]) -> str:
    short = {"ulysses_degree": "ulysses", "ring_degree": "ring", "kv_gather_degree": "kv-gather",
             "tp_size": "tp", "cfg_parallel_size": "cfg"}  # fmt: skip
    return " × ".join(f"{short[k]} {v}" for k, v in layout.items()) or "1 rank"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--layouts", default="all", help="comma-separated indices into LAYOUTS, or all")
    parser.add_argument("--budget-s", type=float, default=540, help="skip layouts that would start later")
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.tiny:
        args.size, args.steps, args.rank = 32, 2, 4
    os.environ["DITSERVE_TEST_SHARED_GPU_GLOO"] = "1"  # read by the rank processes (spawned after this)
    os.environ.setdefault("DITSERVE_HOME", tempfile.mkdtemp(prefix="ditserve-home-"))
    t_start = time.perf_counter()
    picked = LAYOUTS if args.layouts == "all" else [LAYOUTS[int(i)] for i in args.layouts.split(",")]

    folder = Path(tempfile.mkdtemp(prefix="flux-random-"))
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with torch.no_grad():
        pipe = build_pipe(tiny=args.tiny, device=device, dtype=dtype)
        pipe.save_pretrained(folder)
        adapters = write_adapters(pipe.transformer, folder, args.rank)
    del pipe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"model and adapters written in {time.perf_counter() - t_start:.0f}s", flush=True)

    reference = run_layout(str(folder), adapters, {}, args)
    rows, skipped = [], []
    for layout in picked:
        name = describe(layout)
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(f"{name}: time budget")
            continue
        try:
            got = run_layout(str(folder), adapters, layout, args)
        except Exception as exc:
            traceback.print_exc()
            skipped.append(f"{name}: {type(exc).__name__}: {str(exc)[:400]}")
            continue
        row = {
            "layout": name,
            "psnr_plain": min(psnr(a, b) for a, b in zip(got["plain"], reference["plain"], strict=True)),
            "psnr_lora": min(psnr(a, b) for a, b in zip(got["lora"], reference["lora"], strict=True)),
            "lora_changes_image": min(psnr(a, b) for a, b in zip(got["lora"], got["plain"], strict=True)),
            "start_s": round(got["started_s"], 1),
            "batch_s": round(got["plain_s"], 2),
            "lora_batch_s": round(got["lora_s"], 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_report(args.out, args, rows, skipped)


def write_report(out: str | None, args, rows: list[dict], skipped: list[str]) -> None:
    lines = [
        f"{'Tiny' if args.tiny else 'FLUX.1-dev-sized'} random {args.dtype} weights, {args.size}², {args.steps} "
        f"steps, 4 true-CFG requests per batch; adapters: 4 × rank {args.rank}, one per request. Ranks share "
        "one device over gloo. PSNR (dB, uint8, min over the 4 requests) against the one-rank image of the same "
        "request; 'LoRA vs plain' shows the adapters change the image. Times include gloo's host copies: not "
        "speed.",
        "",
        "| layout | PSNR no LoRA | PSNR 4 adapters | LoRA vs plain | start s | batch s | LoRA batch s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['psnr_plain']:.1f} | {r['psnr_lora']:.1f} | {r['lora_changes_image']:.1f} "
            f"| {r['start_s']} | {r['batch_s']} | {r['lora_batch_s']} |"
        )
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    write_results(
        "sharded_one_gpu", "\n".join(lines), {"rows": rows, "skipped": skipped}, out=out,
        baseline="one rank, the same batches (GPU defaults)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
