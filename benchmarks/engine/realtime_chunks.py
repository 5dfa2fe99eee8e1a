"""Realtime video on one replica: AnyFlow-FAR-size (Wan 2.1 1.3B causal, random bf16) at 480p, one GPU.

A folder of the real-size model with random weights is written once (``tests/families/anyflow.py``'s
``build_pipeline("real")``), then served by the engine a replica runs (in process, ``--compile``). For 1, 2
and 4 concurrent sessions, each session streams ``--chunks`` chunks as the server does (the next chunk is
queued when the previous one is denoised, while that one's frames decode) and per session the first
chunk's latency and the median interval between the later chunks' frames are recorded. Goal: a steady
chunk faster than its playback (frames / fps) for one session. "graphs compiled": dynamo graphs compiled
while those sessions ran, after the warm-up session (0 in a steady state: no chunk index compiles new block
graphs).

Per chunk of the one-session row: the time from its submission to its denoised latents (its cache forward
and flow-map steps, beside the previous chunk's decode), from then to its frames (the rest of its decode),
the interval between frames, and the tokens of its cache forward (the engine re-encodes the recent chunks
only; diffusers every finished chunk, listed beside it): a later chunk should cost what chunk 2 costs.

The baseline, after the engine's rows: diffusers' ``AnyFlowFARPipeline`` (its blocks compiled alike) making
the same chunks in one call; its time per chunk is the call's time over the chunks. ``--budget-s``: a row
(or the baseline) that would end past it is left out and named in the results.

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
import torch._dynamo

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
    parser.add_argument(
        "--budget-s", type=float, default=150.0,
        help="leave out the rows (and the baseline) that would end later than this many seconds after the start",
    )  # fmt: skip
    args = parser.parse_args()
    t_start = time.perf_counter()
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
    # Built on the host: the engine loads its own copy from the folder; the baseline's moves over after.
    pipe = anyflow.build_pipeline(size="tiny" if args.tiny else "real", dtype=dtype, device="cpu")
    pipe.save_pretrained(folder)
    params_b = sum(p.numel() for p in pipe.transformer.parameters()) / 1e9
    config_t = pipe.transformer.config
    latent_h, latent_w = height // 8, width // 8
    full_tokens = (latent_h // config_t.patch_size[1]) * (latent_w // config_t.patch_size[2])
    compressed_tokens = (latent_h // config_t.compressed_patch_size[1]) * (
        latent_w // config_t.compressed_patch_size[2]
    )
    partition = [1] + [frames // 4] * (args.chunks - 1)

    def diffusers_cache_tokens(k: int) -> int:
        """Tokens of diffusers' cache forward before chunk ``k``: every finished chunk."""
        if k == 0:
            return 0
        compressed = max(0, k - (config_t.full_chunk_limit - 1))
        return sum(partition[:compressed]) * compressed_tokens + sum(partition[compressed:k]) * full_tokens

    baseline: dict[str, float] = {}
    steady_one: list[float] = []  # a one-session steady chunk of the first engine (for estimates)
    left_out: list[str] = []

    def report(rows: list[dict], per_chunk: list[dict]) -> str:
        """Write this run's results file (again after each row, so a time limit keeps what was measured)."""
        base_chunk = baseline.get("chunk_s")
        base_text = (
            f"diffusers (same run, compiled alike): {base_chunk:.3f} s per chunk ({baseline['total_s']:.2f} s "
            f"for the {args.chunks} chunks in one call)."
            if base_chunk is not None
            else "diffusers: not measured in this run (see below)."
        )
        lines = [
            f"AnyFlow-FAR-size transformer ({params_b:.2f} B parameters, random {'fp32' if args.tiny else 'bf16'}), "
            f"{width}x{height}, {frames} frames per chunk, {steps} steps per chunk, {args.chunks} chunks per session; "
            + base_text,
            "",
            "| engine | sessions | first chunk (s) | steady chunk (s) | playback of a chunk (s) | steady / playback | steady / diffusers chunk | graphs compiled |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            versus = f"{r['steady_chunk_s'] / base_chunk:.2f}" if base_chunk else "-"
            lines.append(
                f"| {r['engine']} | {r['sessions']} | {r['first_chunk_s']:.3f} | {r['steady_chunk_s']:.3f} | {r['playback_s']:.3f} | "
                f"{r['steady_chunk_s'] / r['playback_s']:.2f} | {versus} | {r['graphs_compiled']} |"
            )
        if per_chunk:
            lines += [
                "",
                "The one-session row, per chunk:",
                "",
                "| engine | chunk | submitted → denoised (s) | denoised → frames (s) | frames interval (s) | cache forward tokens | diffusers' cache forward tokens |",
                "|---|---|---|---|---|---|---|",
            ]
            for c in per_chunk:
                lines.append(
                    f"| {c['engine']} | {c['chunk']} | {c['denoise_s']:.3f} | {c['decode_wait_s']:.3f} | "
                    f"{c['interval_s']:.3f} | {c['cache_tokens']} | {c['diffusers_cache_tokens']} |"
                )
        if left_out:
            lines += ["", f"Left out (over --budget-s {args.budget_s:.0f}): {', '.join(left_out)}."]
        text = "\n".join(lines)
        data = {"rows": rows, "per_chunk": per_chunk, "baseline": baseline, "left_out": left_out}
        write_results("realtime_chunks", text, data, out=args.out, baseline="diffusers AnyFlowFARPipeline")
        return text

    from torch._dynamo.utils import counters

    def run_engine(engine, label: str, rows: list[dict], per_chunk: list[dict]) -> None:
        """Stream the sessions of every row of ``args.sessions`` through ``engine``; one row each."""
        runner = engine.launcher.worker.runner  # one rank, in this process
        cache_tokens: list[int] = []  # of the row running (read for one session)

        def count(module, args_, kwargs) -> None:  # a cache forward's tokens (no device read)
            if kwargs["kv_cache_flag"]["is_cache_step"]:
                h, w = kwargs["hidden_states"].shape[-2:]
                parts = list(kwargs["chunk_partition"])
                compressed = max(0, len(parts) - (config_t.full_chunk_limit - 1))
                per_frame = [
                    (h // size[1]) * (w // size[2])
                    for size in (config_t.compressed_patch_size, config_t.patch_size)
                ]
                cache_tokens.append(
                    sum(parts[:compressed]) * per_frame[0] + sum(parts[compressed:]) * per_frame[1]
                )

        hook = runner.pipe.transformer.register_forward_pre_hook(count, with_kwargs=True)

        def stream(sid: str, out: list[tuple[float, float, float]]) -> None:
            """One session as the frontend drives it; ``out``: per chunk, (submitted → denoised, denoised →
            frames, the time since the previous chunk's frames, or since the start for the first)."""

            def submit(k: int):
                params = GenerationParams(
                    prompt=PROMPT, width=width, height=height, num_frames=frames, num_inference_steps=steps,
                    seed=0, guidance_scale=1.0,
                )  # fmt: skip
                return engine.submit_chunk(sid, k, params, args.chunks), time.perf_counter()

            last = time.perf_counter()
            chunk, submitted = submit(0)
            for k in range(args.chunks):
                chunk.denoised.result(timeout=600)
                denoised = time.perf_counter()
                after = submit(k + 1) if k + 1 < args.chunks else None
                chunk.frames.result(timeout=600)
                now = time.perf_counter()
                out.append((denoised - submitted, now - denoised, now - last))
                last = now
                if after is not None:
                    chunk, submitted = after
            engine.close_session(sid).result(timeout=120)

        def graphs() -> int:  # dynamo graphs compiled so far in this process (the ranks run in it)
            return int(counters["stats"]["unique_graphs"])

        try:
            stream("warm.0", [])  # compile, allocator
            for n in args.sessions:
                if steady_one:  # the chunks of n sessions take turns on the one GPU
                    needed = n * args.chunks * steady_one[0] * 1.2
                    if time.perf_counter() - t_start + needed > args.budget_s:
                        left_out.append(f"{label}, {n} sessions (about {needed:.0f} s)")
                        print("left out:", left_out[-1], flush=True)
                        continue
                before = graphs()
                cache_tokens.clear()
                times: list[list[tuple[float, float, float]]] = [[] for _ in range(n)]
                threads = [threading.Thread(target=stream, args=(f"s{n}.{i}", times[i])) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                first = statistics.median(t[0][2] for t in times)
                steady = statistics.median(x[2] for t in times for x in t[2:])
                if not steady_one:
                    steady_one.append(steady / n)
                rows.append(
                    {
                        "engine": label,
                        "sessions": n,
                        "first_chunk_s": first,
                        "steady_chunk_s": steady,
                        "playback_s": frames / fps,
                        "graphs_compiled": graphs() - before,  # 0 in a steady state
                    }
                )
                if n == 1:
                    tokens = list(cache_tokens)
                    for k, (denoise, decode_wait, interval) in enumerate(times[0]):
                        per_chunk.append(
                            {
                                "engine": label,
                                "chunk": k,
                                "denoise_s": denoise,
                                "decode_wait_s": decode_wait,
                                "interval_s": interval,
                                # chunk 0 has no cache forward; chunk k's is the k-th
                                "cache_tokens": tokens[k - 1] if 0 < k <= len(tokens) else 0,
                                "diffusers_cache_tokens": diffusers_cache_tokens(k),
                            }
                        )
                print(rows[-1], flush=True)
                report(rows, per_chunk)
        finally:
            hook.remove()
            engine.shutdown()

    rows: list[dict] = []
    per_chunk: list[dict] = []
    for quantization in args.quantization:
        config = EngineConfig(
            model=str(folder), device=device, dtype="float32" if args.tiny else "bfloat16", compile=not args.tiny,
            max_batch_size=8, cuda_graphs=False, quantization=quantization,
        )  # fmt: skip
        label = ("--compile" if not args.tiny else "eager") + (
            f" --quantization {quantization}" if quantization != "none" else ""
        )
        torch._dynamo.reset()  # each engine's block graphs from an empty cache (one recompile limit each)
        run_engine(Engine(config).start(), label, rows, per_chunk)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # Baseline: diffusers makes the same chunks (first chunk 1 latent frame, then frames/4 per chunk), two
    # calls (the first compiles); left out when they would not fit (a diffusers chunk has taken about 3
    # steady engine chunks).
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

    needed = 2 * args.chunks * 3 * steady_one[0] if steady_one else 60.0
    if time.perf_counter() - t_start + needed > args.budget_s:
        left_out.append(f"the diffusers baseline (about {needed:.0f} s and its compiling)")
        print(report(rows, per_chunk))
        return
    pipe.to(device)
    if not args.tiny:
        # Its blocks' graphs start from an empty cache: they share the block forward's code object (and its
        # recompile limit) with the engine's, which the rows above compiled.
        torch._dynamo.reset()
        compile_blocks(pipe.transformer)
    first_call = diffusers_call()  # compiles
    # The timed call takes about what the first did less its compiling: start it only if that fits.
    if time.perf_counter() - t_start + first_call > args.budget_s:
        left_out.append(
            f"the diffusers baseline's timed call (its first call, compiling: {first_call:.0f} s)"
        )
    else:
        total = diffusers_call()
        baseline.update(total_s=total, chunk_s=total / args.chunks)
        for r in rows:
            r["diffusers_chunk_s"] = baseline["chunk_s"]
    print(report(rows, per_chunk))


if __name__ == "__main__":
    main()
