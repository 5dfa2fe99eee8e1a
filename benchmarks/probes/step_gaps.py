"""Where a ditserve step's wall time is not GPU kernel time: one denoising step of a family at its real size
(as ``benchmarks/engine/families.py`` runs the bf16 row: ``--fused-epilogues``, ``--compile``, CUDA graphs),
profiled with CPU and CUDA activity; prints the step's wall time, its kernels' summed time, and the largest
idle gaps of the GPU between kernels with the kernels around each gap and the CPU ops running meanwhile.

    python benchmarks/probes/step_gaps.py --family sd3 [--steps 4] [--trace out.json]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "engine"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trace", default=None, help="also write the profile as a Chrome trace")
    ap.add_argument("--gaps", type=int, default=15)
    ap.add_argument("--size", choices=["real", "tiny"], default="real", help="tiny: a CPU smoke run")
    args = ap.parse_args()

    from families import make_runner, runner_params, transformers_of

    from ditserve.replica.worker import apply_speed_switches, compile_blocks

    module = importlib.import_module(f"tests.families.{args.family}")
    settings = dict(module.REAL_SETTINGS)
    on_gpu = torch.cuda.is_available()
    dev, dtype = torch.device("cuda" if on_gpu else "cpu"), torch.bfloat16 if on_gpu else torch.float32
    if args.size == "tiny":
        settings |= {"width": 64, "height": 64} | ({"num_frames": 5} if "num_frames" in settings else {})
    pipe = module.build_pipeline(size=args.size, dtype=dtype, device=dev.type)
    pipe.set_progress_bar_config(disable=True)
    family, runner = make_runner(pipe, on_gpu, dev, dtype)
    if on_gpu:
        for m in transformers_of(pipe):
            apply_speed_switches(m, family=family.name, device=dev, dtype=dtype, fused_epilogues=True)
            compile_blocks(m)
        runner.model_changed()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def new_state(tag: str):
        return runner.add(tag, runner_params(settings, args.steps + 4))

    warm = new_state("warm")
    while not warm.done:  # compiles and captures
        runner.step([warm])
    state = new_state("timed")
    for _ in range(2):
        runner.step([state])
    sync()
    walls = []
    for _ in range(args.steps - 1):
        t0 = time.perf_counter()
        runner.step([state])
        sync()
        walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        t0 = time.perf_counter()
        with record_function("ditserve_step"):
            runner.step([state])
            sync()
        wall = time.perf_counter() - t0
    if args.trace:
        prof.export_chrome_trace(args.trace)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.time_range.end > e.time_range.start
    )
    cpu = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CPU
    ]
    busy = sum(end - start for start, end, _ in kernels) / 1e3
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0
    print(
        f"{args.family}: unprofiled steps {', '.join(f'{w * 1e3:.1f}' for w in walls)} ms; profiled step "
        f"{wall * 1e3:.1f} ms; first-to-last kernel {span:.1f} ms; kernel time {busy:.1f} ms "
        f"({len(kernels)} kernels)",
        flush=True,
    )
    # The lead-in: from the step's call to its first kernel, what the host does while the GPU has nothing
    # (the step's own host work, after a per-step sync; overlapped with the previous step's kernels without).
    marker = next((e for e in cpu if e[2] == "ditserve_step"), None)
    if marker is not None and kernels:
        lead_end = kernels[0][0]
        lead = (lead_end - marker[0]) / 1e3
        tail = (marker[1] - kernels[-1][1]) / 1e3
        print(
            f"lead-in (step call to first kernel): {lead:.2f} ms; last kernel to the step's return: {tail:.2f} ms"
        )
        inside = sorted(
            (
                (min(e, lead_end) - st, name)
                for st, e, name in cpu
                if marker[0] <= st < lead_end and name != "ditserve_step"
            ),
            reverse=True,
        )
        for dur, name in inside[: args.gaps]:
            print(f"  lead-in CPU {dur / 1e3:7.3f} ms {name[:90]}", flush=True)
    gaps = []
    end_so_far = kernels[0][1] if kernels else 0
    for i in range(1, len(kernels)):
        start = kernels[i][0]
        if start > end_so_far:
            gaps.append((start - end_so_far, end_so_far, start, i))
        end_so_far = max(end_so_far, kernels[i][1])
    total_gap = sum(g[0] for g in gaps) / 1e3
    print(f"GPU idle between its first and last kernel: {total_gap:.2f} ms in {len(gaps)} gaps", flush=True)
    for size, g0, g1, i in sorted(gaps, reverse=True)[: args.gaps]:
        during = sorted(
            {name for s, e, name in cpu if s < g1 and e > g0 and not name.startswith("ProfilerStep")},
            key=len,
        )[:8]
        print(
            f"  {size / 1e3:7.3f} ms after {kernels[i - 1][2][:60]!r} before {kernels[i][2][:60]!r}; "
            f"CPU: {during}",
            flush=True,
        )


if __name__ == "__main__":
    main()
