"""Every served family at its real transformer size (random bf16 weights) against compiled diffusers, one GPU.

For each family named (a builder module ``tests/families/<name>.py`` with ``build_pipeline(size="real", dtype,
device)`` and ``REAL_SETTINGS``), in one process and on the same weights, in this order:

1. **diffusers, compiled**: the family's own pipeline after regional compilation of its blocks (``compile_blocks``, as ``--compile`` does; the
   baseline of the run); step times from ``callback_on_step_end`` with a device sync;
2. **ditserve bf16**: the family's runner on the same transformer, as a one-GPU replica runs it with
   ``--compile`` and its defaults (``--fused-epilogues``: the tanh-GELU MLPs' GELU in the GEMM's epilogue;
   CUDA graphs where the family's inputs allow them), compiled again;
3. **ditserve FP8**: after ``--quantization fp8`` (row-wise FP8 GEMMs), compiled again.

Per row:
- the median step time over ``--steps`` denoising steps, each timed between device syncs. Before it, a warm-up
  call compiles, then the row runs its own generations for ``--heat`` seconds. An H100 that has idled through
  a compile runs its GEMMs ~5 % faster in its first seconds than once at its power cap, so without heating
  the first row timed (the baseline) reads faster than the same kernels in later rows; heated, every row is
  timed warm, as a serving GPU runs;
- the step time without per-step syncs, (T(steps) - T(2)) / (steps - 2) from whole generations, as both run
  when nothing waits on each step (diffusers' loop, the engine's queue). A sync at each step adds each row's
  own host work before its first kernel, which the engine's step (inputs copied into a CUDA graph's buffers)
  has more of than a compiled pipeline's loop; without the sync that work overlaps the step before;
- the image time extrapolated to the settings' usual step count (steps × step time + the measured
  encode/decode), peak memory, and PSNR of the output against diffusers' (``--steps`` steps, same seed).

    python benchmarks/engine/families.py --family flux2 --family qwenimage --steps 4
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from report import kernel_kind, write_results  # noqa: E402

PROMPT = "a red fox in the snow, photograph"
SEED = 0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def to_uint8(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x) * 255).round().clip(0, 255).astype("uint8")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def diffusers_call(pipe, settings: dict, steps: int, callback=None) -> tuple[np.ndarray, float]:
    # Settings the pipeline's own call does not take (e.g. a guidance scale its guider config holds) stay ours.
    accepted = inspect.signature(pipe.__call__).parameters
    settings = {k: v for k, v in settings.items() if k in accepted}
    kwargs = {} if callback is None else {"callback_on_step_end": callback}
    sync()
    start = time.perf_counter()
    out = pipe(
        prompt=settings.pop("prompt", PROMPT),
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="np",
        **kwargs,
        **{**settings, "num_inference_steps": steps},
    )
    sync()
    frames = out.frames if hasattr(out, "frames") else out.images
    return to_uint8(frames)[0], time.perf_counter() - start


def diffusers_run(pipe, settings: dict, steps: int) -> tuple[np.ndarray, list[float], float]:
    """(uint8 output, per-step seconds, whole call seconds). Step times come from ``callback_on_step_end``
    with a device sync; a pipeline without that callback is timed at ``steps`` and at 2 steps and the
    difference split over the extra steps."""
    marks: list[float] = []

    def on_step(pipe_, index, t, kwargs):
        sync()
        marks.append(time.perf_counter())
        return kwargs

    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        out, total = diffusers_call(pipe, settings, steps, on_step)
        return out, list(np.diff(marks)), total
    out, total = diffusers_call(pipe, settings, steps)
    if steps <= 2:
        return out, [total / steps], total
    _, short = diffusers_call(pipe, settings, 2)
    return out, [(total - short) / (steps - 2)], total


def runner_params(settings: dict, steps: int):
    """The engine's request for ``settings`` at ``steps`` steps (the settings it does not take left out)."""
    from ditserve.replica.request import GenerationParams

    fields = set(GenerationParams.model_fields)
    kwargs = {k: v for k, v in settings.items() if k in fields} | {"num_inference_steps": steps}
    kwargs.setdefault("prompt", PROMPT)
    return GenerationParams(seed=SEED, **kwargs)


def runner_run(runner, settings: dict, steps: int) -> tuple[np.ndarray, list[float], float]:
    params = runner_params(settings, steps)
    sync()
    start = time.perf_counter()
    state = runner.add("bench", params)
    times = []
    while not state.done:
        sync()
        t0 = time.perf_counter()
        runner.step([state])
        sync()
        times.append(time.perf_counter() - t0)
    out = runner.decode(state)
    sync()
    return np.asarray(out)[0], times[1:], time.perf_counter() - start


def runner_total(runner, settings: dict, steps: int) -> float:
    """Seconds of a whole ``steps``-step generation (encode, steps, decode) with no sync between steps, as
    the engine runs them: a step's host work overlaps the GPU work queued before it."""
    params = runner_params(settings, steps)
    sync()
    start = time.perf_counter()
    state = runner.add("bench", params)
    while not state.done:
        runner.step([state])
    runner.decode(state)
    sync()
    return time.perf_counter() - start


def unsynced_step(total, steps: int, rounds: int = 3) -> float:
    """Seconds per step from whole generations without per-step syncs: (T(steps) - T(2)) / (steps - 2), the
    median of ``rounds`` alternated pairs (encode and decode, alike in both, drop out)."""
    longs, shorts = [], []
    for _ in range(rounds):
        longs.append(total(steps))
        shorts.append(total(2))
    return (statistics.median(longs) - statistics.median(shorts)) / (steps - 2)


def make_runner(pipe, cuda_graphs: bool, device: torch.device, dtype: torch.dtype):
    from ditserve.replica.families import pipeline_families

    family = pipeline_families()[type(pipe).__name__]
    cls = family.load("runner")
    runner = cls(
        pipe,
        device=device,
        dtype=dtype,
        max_sequence_length=512,
        mesh=None,
        cuda_graphs=cuda_graphs,
    )
    return family, runner


def transformers_of(pipe) -> list[torch.nn.Module]:
    return [
        m for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None)) if m is not None
    ]


def kernel_times(run) -> dict[str, tuple[float, int]]:
    """{kernel name: (GPU ms, calls)} of ``run()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    return {
        e.key: (e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0
    }


def step_kernels(run) -> dict[str, tuple[float, int]]:
    """The GPU kernels of one denoising step of ``run(steps)``: a 3-step generation's kernel times less a
    2-step one's, per kernel name, so encode and decode (alike in both) drop out."""
    three, two = kernel_times(lambda: run(3)), kernel_times(lambda: run(2))
    out = {}
    for key, (ms, calls) in three.items():
        ms2, calls2 = two.get(key, (0.0, 0))
        if calls > calls2:
            out[key] = (ms - ms2, calls - calls2)
    return out


def kernel_breakdown(name: str, runs: dict[str, object]) -> list[dict]:
    """Print one denoising step's GPU kernel time by kind (attention, GEMM, inductor's fused kernels,
    copies, ...) for each labelled ``run(steps)``, the baseline first, and each one's largest kernels: where
    a step's time goes, and how much of it is in kernels that every row shares (cuBLAS GEMMs, cuDNN
    attention). Returns one record per run for the results file."""
    records = []
    for label, run in runs.items():
        kernels = step_kernels(run)
        kinds: dict[str, float] = {}
        for key, (ms, _) in kernels.items():
            kinds[kernel_kind(key)] = kinds.get(kernel_kind(key), 0.0) + ms
        total = sum(kinds.values())
        parts = ", ".join(
            f"{k} {v:.1f} ms ({v / total:.1%})" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        )
        print(f"{name} / {label}: kernel time of one step {total:.1f} ms: {parts}", flush=True)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:16]
        for key, (ms, calls) in top:
            print(f"  {ms:9.2f} ms  {calls:5d}×  {kernel_kind(key):12s} {key[:100]}", flush=True)
        records.append(
            {
                "family": name,
                "config": label,
                "step_kernel_ms": total,
                "by_kind_ms": kinds,
                "top": [{"kernel": k, "ms": ms, "calls": c} for k, (ms, c) in top],
            }
        )
    return records


def measure(
    name: str,
    steps: int,
    graphs: bool,
    size: str = "real",
    device: str = "cuda",
    cfg_batch: bool = False,
    profiles: list[dict] | None = None,
    heat: float = 0.0,
    fp8: bool = True,
    stock_attention: bool = False,
) -> list[dict]:
    """The three rows of one family (``size="tiny", device="cpu"``: a smoke run of this script, bf16 → fp32,
    no compile, no FP8). With ``profiles`` (a list, on a GPU), one step's kernel time of the baseline and the
    bf16 row is appended to it."""
    profile = profiles is not None
    from ditserve.replica.worker import apply_speed_switches, compile_blocks

    module = importlib.import_module(f"tests.families.{name}")
    settings = dict(module.REAL_SETTINGS)
    if size == "tiny":  # a smoke run of this script: the tiny models' sizes
        settings |= {"width": 64, "height": 64} | ({"num_frames": 5} if "num_frames" in settings else {})
    usual = settings.get("num_inference_steps", steps)
    torch.manual_seed(0)
    on_gpu = device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    dev = torch.device(device)
    pipe = module.build_pipeline(size=size, dtype=dtype, device=device)
    pipe.set_progress_bar_config(disable=True)
    params_b = sum(p.numel() for m in transformers_of(pipe) for p in m.parameters()) / 1e9
    rows = []

    def row(label: str, run, ref=None, total=None) -> np.ndarray:
        run(2)  # warm-up: compiles, captures
        until = time.perf_counter() + heat
        while time.perf_counter() < until:  # the GPU to its warm clocks, as for every row
            run(steps)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        out, step_s, whole = run(steps)
        step = statistics.median(step_s)
        overhead = max(whole - step * steps, 0.0)
        free = unsynced_step(total, steps) if total is not None and steps > 2 else float("nan")
        rows.append(
            {
                "family": name,
                "config": label,
                "transformer_params_b": round(params_b, 2),
                "step_ms": step * 1e3,
                "step_unsynced_ms": free * 1e3,
                "image_s": overhead + step * usual,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan"),
                "psnr_vs_diffusers": None if ref is None else psnr(out, ref),
                "usual_steps": usual,
            }
        )
        print(rows[-1], flush=True)
        return out

    if on_gpu:
        for m in transformers_of(pipe):
            compile_blocks(m)
    ref = row(
        "diffusers compiled (baseline)",
        lambda n: diffusers_run(pipe, settings, n),
        total=lambda n: diffusers_call(pipe, settings, n)[1],
    )
    if profile and on_gpu:
        profiles += kernel_breakdown(name, {"diffusers compiled": lambda n: diffusers_run(pipe, settings, n)})
    family, runner = make_runner(pipe, graphs and on_gpu, dev, dtype)
    if on_gpu:  # the engine's defaults on one GPU: --fused-epilogues is on (auto), then --compile
        torch._dynamo.reset()
        for m in transformers_of(pipe):
            changed = apply_speed_switches(
                m, family=family.name, device=dev, dtype=dtype, fused_epilogues=True
            )
            print(
                f"{name}: --fused-epilogues changed {changed['fused_epilogues']} MLPs and {changed['fused_attention']} attention processors",
                flush=True,
            )
            compile_blocks(m)
        runner.model_changed()
    row(
        "ditserve bf16 --compile",
        lambda n: runner_run(runner, settings, n),
        ref,
        total=lambda n: runner_total(runner, settings, n),
    )
    if profile and on_gpu:
        profiles += kernel_breakdown(name, {"ditserve bf16": lambda n: runner_run(runner, settings, n)})
    if stock_attention and on_gpu:  # the same engine with diffusers' attention processors back
        torch._dynamo.reset()
        from ditserve.replica.parallel.plan import unfuse_one_rank_processors

        plan = family.load("plan")
        swapped = sum(unfuse_one_rank_processors(m, plan) for m in transformers_of(pipe))
        for m in transformers_of(pipe):
            compile_blocks(m)
        runner.model_changed()
        row(
            f"ditserve bf16 --compile, diffusers' attention processors ({swapped} put back)",
            lambda n: runner_run(runner, settings, n),
            ref,
            total=lambda n: runner_total(runner, settings, n),
        )
        torch._dynamo.reset()
        for m in transformers_of(pipe):
            apply_speed_switches(m, family=family.name, device=dev, dtype=dtype, fused_epilogues=True)
    if cfg_batch and on_gpu and not runner.batch_cfg:
        runner.batch_cfg = True  # the CFG branches as one forward of [uncond; cond] rows
        row(
            "ditserve bf16 --compile, CFG rows in one forward", lambda n: runner_run(runner, settings, n), ref
        )
        runner.batch_cfg = type(runner).batch_cfg
    if not on_gpu or not fp8:
        return rows
    torch._dynamo.reset()
    for m in transformers_of(pipe):
        apply_speed_switches(
            m, family=family.name, device=torch.device("cuda"), dtype=torch.bfloat16, quantization="fp8"
        )
        compile_blocks(m)
    runner.model_changed()
    row(
        "ditserve fp8 --compile",
        lambda n: runner_run(runner, settings, n),
        ref,
        total=lambda n: runner_total(runner, settings, n),
    )
    torch._dynamo.reset()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", action="append", required=True, help="builder module in tests/families")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-graphs", action="store_true", help="ditserve rows without CUDA graphs")
    parser.add_argument("--size", choices=["real", "tiny"], default="real")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--cfg-batch", action="store_true", help="an extra bf16 row: the CFG branches as one forward"
    )
    parser.add_argument(
        "--profile", action="store_true", help="print one step's kernel time by kind, baseline and bf16 row"
    )
    parser.add_argument(
        "--heat",
        type=float,
        default=30.0,
        help="seconds of each row's own generations before it is timed (0: none, as before Dec 2026)",
    )
    parser.add_argument("--no-fp8", action="store_true", help="leave out the FP8 row")
    parser.add_argument(
        "--stock-attention",
        action="store_true",
        help="an extra bf16 row: the engine with diffusers' own attention processors (the one-rank fused "
        "processors of --fused-epilogues put back), for the processors' share of the step",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows, failed, profiles = [], [], []
    for name in args.family:
        try:
            rows += measure(
                name,
                args.steps,
                not args.no_graphs,
                args.size,
                args.device,
                args.cfg_batch,
                profiles if args.profile else None,
                args.heat if args.device == "cuda" else 0.0,
                not args.no_fp8,
                args.stock_attention,
            )
        except Exception as exc:  # one family failing leaves the others' rows
            traceback.print_exc()
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[-300:]}")
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        write_results(
            "families",
            table(rows, failed) + profile_table(profiles),
            {"rows": rows, "failed": failed, "step_kernels": profiles},
            out=args.out,
            baseline="compiled diffusers pipeline, same weights, same run",
        )


def profile_table(profiles: list[dict]) -> str:
    """One denoising step's GPU kernel time by kind (``--profile``), and the share of the baseline's step that
    its cuBLAS GEMMs and cuDNN attention take: the same kernels run in every row, so no row goes below it
    without other kernels for those."""
    if not profiles:
        return ""
    kinds = ["gemm", "attention", "triton fused", "copy", "other", "conv"]
    lines = [
        "",
        "",
        "One step's GPU kernels (`--profile`: a 3-step generation's kernel times less a 2-step one's), ms:",
        "",
        "| family | config | total | " + " | ".join(kinds) + " |",
        "|---|---|---|" + "---|" * len(kinds),
    ]
    for p in profiles:
        cells = " | ".join(f"{p['by_kind_ms'].get(k, 0.0):.1f}" for k in kinds)
        lines.append(f"| {p['family']} | {p['config']} | {p['step_kernel_ms']:.1f} | {cells} |")
    return "\n".join(lines)


def table(rows: list[dict], failed: list[str]) -> str:
    lines = [
        "| family | config | params (B) | step (ms) | image (s, usual steps) | peak (GiB) | PSNR vs diffusers | × baseline "
        "| step, no per-step sync (ms) | × baseline, no per-step sync |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base, base_free = {}, {}
    for r in rows:
        free = r.get("step_unsynced_ms", float("nan"))
        if r["psnr_vs_diffusers"] is None:
            base[r["family"]], base_free[r["family"]] = r["step_ms"], free
        ratio = r["step_ms"] / base[r["family"]] if r["family"] in base else float("nan")
        ratio_free = free / base_free[r["family"]] if r["family"] in base_free else float("nan")
        p = r["psnr_vs_diffusers"]
        lines.append(
            f"| {r['family']} | {r['config']} | {r['transformer_params_b']} | {r['step_ms']:.1f} | {r['image_s']:.1f} "
            f"({r['usual_steps']}) | {r['peak_gib']:.1f} | {'—' if p is None else f'{p:.1f}'} | {ratio:.3f} "
            f"| {free:.1f} | {ratio_free:.3f} |"
        )
    if failed:
        lines += ["", "Not measured:", *[f"- {f}" for f in failed]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
