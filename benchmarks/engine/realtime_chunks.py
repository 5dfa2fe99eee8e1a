"""Realtime video on one replica: AnyFlow-FAR-size (Wan 2.1 1.3B causal, random bf16) at 480p, one GPU.

A folder of the real-size model with random weights is written once (``tests/families/anyflow.py``'s
``build_pipeline("real")``), then served by the engine a replica runs (in process, ``--compile``). For 1, 2
and 4 concurrent sessions, each session streams ``--chunks`` chunks as the server does (the next chunk is
queued when the previous one is denoised, while that one's frames decode) and per session the first
chunk's latency and the median interval between the later chunks' frames are recorded. The baseline of the same run: diffusers'
``AnyFlowFARPipeline`` (its processor compiled alike) making the same chunks in one call; its time per chunk
is the call's time over the chunks. Goal: a steady chunk faster than its playback (frames / fps) for one
session. "graphs compiled": dynamo graphs compiled while those sessions ran, after the warm-up session
(0 in a steady state: no chunk index compiles new block graphs).

    python benchmarks/engine/realtime_chunks.py [--chunks 6 --sessions 1 2 4] [--tiny for a CPU smoke run]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from report import write_results  # noqa: E402

PROMPT = "a red fox running through the snow"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.engine import Engine
    from ditserve.replica.request import GenerationParams
    from ditserve.replica.worker import compile_blocks
    from tests.families import anyflow

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--quantization", nargs="+", default=["none"], choices=["none", "fp8"],
        help="one engine per value, in order (fp8: --quantization fp8, a GPU of compute capability 8.9+)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    settings = dict(anyflow.REAL_SETTINGS)
    width, height = (64, 64) if args.tiny else tuple(int(v) for v in settings["size"].split("x"))
    frames, steps, fps = (
        (8 if args.tiny else settings["num_frames"]),
        settings["num_inference_steps"],
        settings["fps"],
    )
    folder = Path(tempfile.mkdtemp()) / "anyflow-far"
    pipe = anyflow.build_pipeline(size="tiny" if args.tiny else "real", dtype=dtype, device=device)
    pipe.save_pretrained(folder)
    params_b = sum(p.numel() for p in pipe.transformer.parameters()) / 1e9

    # Baseline: diffusers makes the same chunks (first chunk 1 latent frame, then frames/4 per chunk).
    partition = [1] + [frames // 4] * (args.chunks - 1)
    if not args.tiny:
        compile_blocks(pipe.transformer)

    def diffusers_call() -> float:
        sync()
        start = time.perf_counter()
        pipe(
            prompt=PROMPT,
            height=height,
            width=width,
            num_frames=(sum(partition) - 1) * 4 + 1,
            num_inference_steps=steps,
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(0),
            chunk_partition=partition,
            output_type="np",
        )
        sync()
        return time.perf_counter() - start

    diffusers_call()  # compile
    base_total = diffusers_call()
    base_chunk = base_total / args.chunks
    pipe.to("cpu")  # the engine loads its own copy from the folder
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    def report(rows: list[dict]) -> str:
        """Write this run's results file (again after each row, so a time limit keeps what was measured)."""
        lines = [
            f"AnyFlow-FAR-size transformer ({params_b:.2f} B parameters, random {'fp32' if args.tiny else 'bf16'}), "
            f"{width}x{height}, {frames} frames per chunk, {steps} steps per chunk, {args.chunks} chunks per session; "
            f"diffusers (same run, compiled alike): {base_chunk:.3f} s per chunk ({base_total:.2f} s for the "
            f"{args.chunks} chunks in one call).",
            "",
            "| engine | sessions | first chunk (s) | steady chunk (s) | playback of a chunk (s) | steady / playback | steady / diffusers chunk | graphs compiled |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['engine']} | {r['sessions']} | {r['first_chunk_s']:.3f} | {r['steady_chunk_s']:.3f} | {r['playback_s']:.3f} | "
                f"{r['steady_chunk_s'] / r['playback_s']:.2f} | {r['steady_chunk_s'] / base_chunk:.2f} | "
                f"{r['graphs_compiled']} |"
            )
        text = "\n".join(lines)
        write_results("realtime_chunks", text, rows, out=args.out, baseline="diffusers AnyFlowFARPipeline")
        return text

    from torch._dynamo.utils import counters

    def run_engine(engine, label: str, rows: list[dict]) -> None:
        """Stream the sessions of every row of ``args.sessions`` through ``engine``; one row each."""

        def stream(sid: str, out: list[float]) -> None:
            """One session as the frontend drives it; ``out``: the first chunk's latency, then the time
            between one chunk's frames and the next's."""

            def submit(k: int):
                params = GenerationParams(
                    prompt=PROMPT, width=width, height=height, num_frames=frames, num_inference_steps=steps,
                    seed=0, guidance_scale=1.0,
                )  # fmt: skip
                return engine.submit_chunk(sid, k, params, args.chunks)

            last = time.perf_counter()
            chunk = submit(0)
            for k in range(args.chunks):
                chunk.denoised.result(timeout=600)
                after = submit(k + 1) if k + 1 < args.chunks else None
                chunk.frames.result(timeout=600)
                now = time.perf_counter()
                out.append(now - last)
                last, chunk = now, after
            engine.close_session(sid).result(timeout=120)

        def graphs() -> int:  # dynamo graphs compiled so far in this process (the ranks run in it)
            return int(counters["stats"]["unique_graphs"])

        try:
            stream("warm.0", [])  # compile, allocator
            for n in args.sessions:
                before = graphs()
                times: list[list[float]] = [[] for _ in range(n)]
                threads = [threading.Thread(target=stream, args=(f"s{n}.{i}", times[i])) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                first = statistics.median(t[0] for t in times)
                steady = statistics.median(x for t in times for x in t[2:])
                rows.append(
                    {
                        "engine": label,
                        "sessions": n,
                        "first_chunk_s": first,
                        "steady_chunk_s": steady,
                        "playback_s": frames / fps,
                        "diffusers_chunk_s": base_chunk,
                        "graphs_compiled": graphs() - before,  # 0 in a steady state
                    }
                )
                print(rows[-1], flush=True)
                report(rows)
        finally:
            engine.shutdown()

    rows: list[dict] = []
    for quantization in args.quantization:
        config = EngineConfig(
            model=str(folder), device=device, dtype="float32" if args.tiny else "bfloat16", compile=not args.tiny,
            max_batch_size=8, cuda_graphs=False, quantization=quantization,
        )  # fmt: skip
        label = ("--compile" if not args.tiny else "eager") + (
            f" --quantization {quantization}" if quantization != "none" else ""
        )
        run_engine(Engine(config).start(), label, rows)
    print(report(rows))


if __name__ == "__main__":
    main()
