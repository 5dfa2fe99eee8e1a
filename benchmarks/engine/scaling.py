"""Multi-GPU layouts of one engine replica: step time and image parity against one GPU, in the same run.

    GIT_COMMIT=$(git rev-parse --short HEAD) python benchmarks/engine/scaling.py --out DIR          # 2 GPUs, NCCL
    python benchmarks/engine/scaling.py --tiny --device cpu --out /tmp/scaling                      # gloo smoke run

Two rank processes (NCCL on GPUs, gloo on CPU). Each builds the same FLUX.1-dev-sized random-weight
pipeline as ``engine_vs_diffusers.py`` (same seed → same weights on every rank; checked), then does what
``replica/worker.py`` does: ``build_mesh`` → ``parallelize_flux`` → ``FluxRunner``. The model is
rebuilt for every layout (parallelize_flux works in place). Rank 0 first makes the one-GPU references
(no mesh: stock diffusers attention) without and with true CFG while rank 1 waits; then every layout runs
on both ranks. Step time = CUDA events around ``runner.step`` (the whole step: forward(s), CFG gather,
scheduler), median over the 28 steps of one image after a warm-up of a few steps and one decode.
PSNR is each layout's uint8 image against the one-GPU image of the same request (bf16).
Prints a markdown table and writes DIR/scaling.md and .json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the report helper
from engine_vs_diffusers import (  # noqa: E402
    NEGATIVE,
    PROMPT,
    SEED,
    ForwardTimer,
    build_pipe,
    commit,
    flux_configs,
    fmt_psnr,
    make_runner,
    psnr,
    reset_peak,
    sync,
)
from report import write_results  # noqa: E402

LAYOUTS: list[dict[str, int]] = [
    dict(ulysses=2),
    dict(ring=2),
    dict(kv_gather=2),
    dict(tp=2),
    dict(cfg=2),
]
TRUE_CFG_SCALE = 4.0


def generate(runner, *, size: int, steps: int, true_cfg: bool, device, warmup_steps: int) -> dict:
    """Warm up (a few steps + one decode), then one timed image with per-step CUDA events."""
    from ditserve.replica.request import GenerationParams

    params = GenerationParams(
        prompt=PROMPT,
        negative_prompt=NEGATIVE if true_cfg else None,
        true_cfg_scale=TRUE_CFG_SCALE if true_cfg else 1.0,
        width=size,
        height=size,
        num_inference_steps=steps,
        guidance_scale=3.5,
        seed=SEED,
    )
    timer = ForwardTimer(runner.pipe.transformer, device)
    warm = runner.add("warm", params)
    for _ in range(warmup_steps):
        runner.step([warm])
    runner.decode(warm)
    timer.take()
    reset_peak(device)
    cuda = device.type == "cuda"
    sync()
    t0 = time.perf_counter()
    state = runner.add("bench", params)
    marks = []
    while not state.done:
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            runner.step([state])
            e.record()
            marks.append((s, e))
        else:
            t = time.perf_counter()
            runner.step([state])
            marks.append((t, time.perf_counter()))
    image = runner.decode(state)[0]
    sync()
    image_s = time.perf_counter() - t0
    step_ms = [s.elapsed_time(e) for s, e in marks] if cuda else [(e - s) * 1e3 for s, e in marks]
    fwd_ms = timer.take()
    timer.remove()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    return dict(
        step_ms=statistics.median(step_ms),
        step_ms_min=min(step_ms),
        step_ms_max=max(step_ms),
        forward_ms=statistics.median(fwd_ms),
        forwards_per_step=len(fwd_ms) / len(step_ms),
        image_s=image_s,
        peak_gib=peak,
        image=image,
    )


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def weights_fingerprint(module: torch.nn.Module, device) -> torch.Tensor:
    params = list(module.parameters())
    return torch.stack([p.detach().float().sum() for p in params[:: max(1, len(params) // 16)]]).to(device)


def rank_main(rank: int, world: int, init_method: str, args: dict, queue) -> None:
    try:
        queue.put((rank, True, _rank_body(rank, world, init_method, args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def _rank_body(rank: int, world: int, init_method: str, args: dict) -> dict | None:
    import torch.distributed as dist

    from ditserve.replica.parallel import ParallelDims, build_mesh, parallelize_flux

    t_start = time.perf_counter()
    cuda = args["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    dtype = getattr(torch, args["dtype"])
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=900),
        **({"device_id": device} if cuda else {}),
    )
    max_len = flux_configs(args["tiny"])["max_sequence_length"]
    size, steps, warmup = args["size"], args["steps"], args["warmup_steps"]
    out: dict = {"refs": {}, "layouts": [], "skipped": []}

    def barrier():
        dist.barrier(device_ids=[rank]) if cuda else dist.barrier()

    with torch.no_grad():
        # ---- one-GPU references on rank 0 ----------------------------------------------------------
        refs = {}
        if rank == 0:
            pipe = build_pipe(tiny=args["tiny"], device=device, dtype=dtype)
            runner = make_runner(pipe, device=device, dtype=dtype, max_sequence_length=max_len)
            for true_cfg in (False, True):
                r = generate(
                    runner, size=size, steps=steps, true_cfg=true_cfg, device=device, warmup_steps=warmup
                )
                refs[true_cfg] = r.pop("image")
                out["refs"][true_cfg] = r
                print(
                    f"1 GPU true_cfg={true_cfg}: step {r['step_ms']:.2f} ms, image {r['image_s']:.2f} s",
                    flush=True,
                )
            del pipe, runner
            free()
        barrier()

        # ---- every layout on all ranks ------------------------------------------------------------
        for layout in LAYOUTS:
            dims = ParallelDims(**layout)
            name = dims.describe()
            go = torch.tensor([1 if time.perf_counter() - t_start < args["budget_s"] else 0], device=device)
            dist.broadcast(go, src=0)
            if not go.item():
                out["skipped"].append(f"{name}: time budget")
                continue
            if dims.world_size != world:
                out["skipped"].append(f"{name}: needs {dims.world_size} ranks")
                continue
            try:
                mesh = build_mesh(dims, device_type=device.type)
                pipe = build_pipe(tiny=args["tiny"], device=device, dtype=dtype)
                fp = weights_fingerprint(pipe.transformer, device)
                fps = [torch.empty_like(fp) for _ in range(world)]
                dist.all_gather(fps, fp)
                same_weights = all(torch.equal(fps[0], f) for f in fps)
                parallelize_flux(pipe.transformer, mesh=mesh)
                runner = make_runner(pipe, device=device, dtype=dtype, max_sequence_length=max_len, mesh=mesh)
                true_cfg = dims.cfg == 2
                r = generate(
                    runner, size=size, steps=steps, true_cfg=true_cfg, device=device, warmup_steps=warmup
                )
                peaks = [torch.zeros(1, device=device) for _ in range(world)]
                dist.all_gather(peaks, torch.tensor([r["peak_gib"]], device=device, dtype=torch.float32))
                r["peak_gib_ranks"] = [float(p.item()) for p in peaks]
                r["same_weights"] = same_weights
                r["layout"], r["true_cfg"] = name, true_cfg
                image = r.pop("image")
                if rank == 0:
                    r["psnr"] = psnr(image, refs[true_cfg])
                    print(f"{name}: step {r['step_ms']:.2f} ms, PSNR {fmt_psnr(r['psnr'])}", flush=True)
                out["layouts"].append(r)
                mesh.destroy()
                del pipe, runner, mesh
                free()
            except Exception as exc:  # keep the numbers measured so far
                traceback.print_exc()
                out["skipped"].append(f"{name} and later: {type(exc).__name__}: {str(exc)[:300]}")
                # The ranks may be out of step inside a collective now: stop; the driver kills the others.
                return out if rank == 0 else None
            barrier()
    dist.destroy_process_group()
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", type=int, default=None, help="square size (default 1024; tiny 32)")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip layouts that start after this many s")
    ap.add_argument(
        "--out", default=os.environ.get("OUT"), help="results folder (default: benchmarks/results)"
    )
    a = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args = dict(
        tiny=a.tiny, device=a.device, dtype=a.dtype, size=a.size or (32 if a.tiny else 1024), steps=a.steps,
        warmup_steps=a.warmup_steps, budget_s=a.budget_s,
    )  # fmt: skip
    t0 = time.perf_counter()
    import torch.multiprocessing as mp

    from ditserve.replica.launcher import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=rank_main, args=(r, a.world, init_method, args, queue)) for r in range(a.world)
    ]
    for p in procs:
        p.start()
    answers, errors = {}, []
    # Wait for rank 0 (it answers with whatever it measured, also after a failure); then give the
    # others a minute: a rank stuck in a collective after a failure elsewhere is killed.
    while 0 not in answers and not errors:
        try:
            rank, ok, value = queue.get(timeout=5)
        except Exception:  # queue.Empty
            if not any(p.is_alive() for p in procs):
                errors.append("every rank exited without an answer")
            continue
        (answers.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
    deadline = time.time() + 60
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.time()))
        if p.is_alive():
            print(f"killing rank process {p.pid} (no exit within 60 s)", file=sys.stderr)
            p.kill()
    if errors:
        print("\n".join(errors), file=sys.stderr)
    res = answers.get(0)

    sha = commit()
    dev = (torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu") + f" × {a.world}"
    model = "tiny Flux" if a.tiny else "FLUX.1-dev-size, random"
    header = (
        "| commit | devices | model | size | steps | dtype | batch | layout | true CFG | step ms (median [min–max]) "
        "| forwards/step | speed-up vs 1 GPU (same CFG) | image s | peak GiB (per rank) | PSNR vs 1 GPU dB |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    notes = []
    if res is not None:
        refs = res["refs"]
        for true_cfg, r in refs.items():
            lines.append(
                f"| {sha} | {dev.split(' × ')[0]} × 1 | {model} | {args['size']}² | {a.steps} | {a.dtype} | 1 | "
                f"1 GPU (no mesh) | {'yes' if true_cfg else 'no'} | {r['step_ms']:.2f} [{r['step_ms_min']:.2f}–"
                f"{r['step_ms_max']:.2f}] | {r['forwards_per_step']:.0f} | 1.00× | {r['image_s']:.2f} | "
                f"{r['peak_gib']:.2f} | reference |"
            )
        for r in res["layouts"]:
            base = refs[r["true_cfg"]]
            speed = base["step_ms"] / r["step_ms"]
            r["speedup"] = speed
            peaks = " / ".join(f"{p:.2f}" for p in r["peak_gib_ranks"])
            lines.append(
                f"| {sha} | {dev} | {model} | {args['size']}² | {a.steps} | {a.dtype} | 1 | {r['layout']} | "
                f"{'yes' if r['true_cfg'] else 'no'} | {r['step_ms']:.2f} [{r['step_ms_min']:.2f}–"
                f"{r['step_ms_max']:.2f}] | {r['forwards_per_step']:.0f} | {speed:.2f}× | {r['image_s']:.2f} | "
                f"{peaks} | {fmt_psnr(r['psnr'])} |"
            )
            if not r["same_weights"]:
                notes.append(f"WARNING {r['layout']}: ranks built different weights")
        uly = [r for r in res["layouts"] if r["layout"] == "cfg1×ulysses2"]
        if uly:
            verdict = "met" if uly[0]["speedup"] >= 1.8 else "NOT met"
            notes.append(f"Goal 'Ulysses-2 step ≥ 1.8× one GPU': {uly[0]['speedup']:.2f}× → {verdict}.")
        if res["skipped"]:
            notes.append("Skipped: " + "; ".join(res["skipped"]))
    else:
        notes.append("No results from rank 0 (see errors above).")
    notes.append(
        f"True CFG rows: negative prompt, true_cfg_scale {TRUE_CFG_SCALE} (two forwards per step on one GPU). "
        f"Warm-up {a.warmup_steps} steps + one decode per layout; one timed image each. torch {torch.__version__}. "
        f"Whole run {time.perf_counter() - t0:.0f}s."
    )
    text = "\n".join(lines + [""] + notes)
    print("\n" + text)
    data = dict(meta=dict(commit=sha, devices=dev, **args), result=res, errors=errors)
    write_results("scaling", text, json.loads(json.dumps(data, default=str).replace("NaN", "null")), out=a.out,
                  baseline="the one-GPU runner")  # fmt: skip
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
