"""Where a realtime chunk's time goes: AnyFlow-FAR-size (random bf16), 480p, one GPU, one rank in process.

Per chunk of a session: the chunk's start (encode + prepare), its first step (which carries the K/V cache
forward over the finished chunks), the later flow-map steps and the VAE decode of its frames; eager and
``--compile``; dynamo's counters (compiled frames, graph breaks, recompiles) after a warm-up session and in
the timed one (a steady state compiles nothing); a profiler table of one steady chunk (compiled). Then an
A/B of one 12-frame chunk's VAE decode: cuDNN's heuristic vs benchmarked algorithms, NCDHW vs
channels_last_3d, and the decoder's norms compiled.

    python benchmarks/probes/realtime_profile.py [--chunks 6] [--modes compile] [--tiny]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPT = "a red fox running through the snow"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def session(worker, params_for, chunks: int, name: str, profile_chunk: int | None = None) -> list[dict]:
    rows = []
    for k in range(chunks):
        params = params_for(k)
        prof = None
        if profile_chunk == k:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        rid = f"{name}.{k}"
        sync()
        t0 = time.perf_counter()
        steps = worker.add_chunk(rid, name, k, params, chunks)
        sync()
        t1 = time.perf_counter()
        worker.step([rid])
        sync()
        t2 = time.perf_counter()
        for _ in range(steps - 1):
            worker.step([rid])
        sync()
        t3 = time.perf_counter()
        worker.finish(rid)
        sync()
        t4 = time.perf_counter()
        if prof is not None:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
        rows.append(
            dict(
                chunk=k, start=t1 - t0, first_step=t2 - t1, later_steps=t3 - t2, decode=t4 - t3, total=t4 - t0
            )
        )
        print(
            name, {key: round(v, 4) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True
        )
    worker.close_session(name)
    return rows


def decode_ab(worker, params, repeats: int) -> None:
    """One chunk's decode (after a first chunk of one latent frame, as in a session) under decoder
    variants, the same latents each time; prints seconds per chunk (median) and PSNR to the first variant."""
    import statistics

    runner = worker.runner
    vae = runner.pipe.vae
    temporal = runner.pipe.vae_scale_factor_temporal
    latent = (1, 16, 1 + params.num_frames // temporal, params.height // 8, params.width // 8)
    z = torch.randn(latent, generator=torch.Generator().manual_seed(0)).to(runner.device, runner.dtype)

    def decode(x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        vae.clear_cache()
        feat = [None] * vae._conv_num
        x = vae.post_quant_conv(x)
        out = None
        for i in range(x.shape[2]):  # frame 0 is the first chunk's, then the timed chunk's frames
            piece = vae.decoder(
                x[:, :, i : i + 1].contiguous(memory_format=memory_format), feat_cache=feat, feat_idx=[0],
                first_chunk=i == 0,
            )  # fmt: skip
            if i == 0:
                sync()
                start = time.perf_counter()
            else:
                out = piece if out is None else torch.cat([out, piece], dim=2)
        sync()
        return out, time.perf_counter() - start

    def run(name: str, benchmark: bool, memory_format=torch.contiguous_format) -> torch.Tensor:
        times, out = [], None
        with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, benchmark=benchmark):
            for _ in range(repeats + 1):
                out, seconds = decode(z, memory_format)
                times.append(seconds)
        print(f"decode {name}: {statistics.median(times[1:]):.4f} s per chunk", flush=True)
        return out.float()

    norms = [m for m in vae.decoder.modules() if type(m).__name__ == "WanRMS_norm"]
    served = [m._compiled_call_impl for m in norms]  # what the runner runs (compiled under --compile)
    for m in norms:
        m._compiled_call_impl = None
    base = run("cudnn heuristic", False)
    variants = {"cudnn benchmark": run("cudnn benchmark", True)}
    convs = [m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d)]
    for m in convs:
        m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
    variants["cudnn benchmark + channels_last_3d"] = run(
        "cudnn benchmark + channels_last_3d", True, torch.channels_last_3d
    )
    for m in convs:
        m.weight.data = m.weight.data.contiguous()
    from ditserve.replica.pipelines.anyflow import _norm_call

    for m in norms:  # as the runner compiles them (one dynamic-shape function for all)
        m._compiled_call_impl = functools.partial(_norm_call, m)
    variants["cudnn benchmark + compiled norms"] = run("cudnn benchmark + compiled norms", True)
    for m, impl in zip(norms, served, strict=True):
        m._compiled_call_impl = impl
    for name, out in variants.items():
        mse = torch.mean((out - base) ** 2).item()
        psnr = 10 * torch.log10(torch.tensor(4.0 / max(mse, 1e-20))).item()
        print(f"decode {name}: PSNR to the heuristic's frames {psnr:.1f} dB", flush=True)


def main() -> None:
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.request import GenerationParams
    from ditserve.replica.worker import RankWorker
    from tests.families import anyflow

    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--modes", nargs="+", default=["eager", "compile"])
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    settings = dict(anyflow.REAL_SETTINGS)
    width, height = (64, 64) if args.tiny else tuple(int(v) for v in settings["size"].split("x"))
    frames = 8 if args.tiny else settings["num_frames"]
    steps = settings["num_inference_steps"]
    import tempfile

    folder = Path(tempfile.mkdtemp()) / "anyflow-far"
    anyflow.build_pipeline(size="tiny" if args.tiny else "real", dtype=dtype, device="cpu").save_pretrained(
        folder
    )

    def params_for(k: int) -> GenerationParams:
        return GenerationParams(
            prompt=PROMPT, width=width, height=height, num_frames=frames, num_inference_steps=steps, seed=0,
            guidance_scale=1.0,
        )  # fmt: skip

    import torch._dynamo.utils as dynamo_utils

    for mode in args.modes:
        config = EngineConfig(
            model=str(folder), device=device, dtype="float32" if args.tiny else "bfloat16",
            compile=mode == "compile", max_batch_size=8, cuda_graphs=False,
        )  # fmt: skip
        worker = RankWorker(config)
        dynamo_utils.counters.clear()
        session(worker, params_for, args.chunks, f"{mode}-warm")
        print(
            mode,
            "dynamo counters after warm-up:",
            {k: dict(v) for k, v in dynamo_utils.counters.items()},
            flush=True,
        )
        dynamo_utils.counters.clear()
        session(
            worker,
            params_for,
            args.chunks,
            f"{mode}-timed",
            profile_chunk=args.chunks - 2 if mode == "compile" else None,
        )
        print(
            mode,
            "dynamo counters in the timed session:",
            {k: dict(v) for k, v in dynamo_utils.counters.items()},
            flush=True,
        )
        if mode == "compile" or len(args.modes) == 1:
            decode_ab(worker, params_for(1), repeats=3 if args.tiny else 10)
        del worker
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
