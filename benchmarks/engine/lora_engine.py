"""LoRA in the engine: a batch of requests with different adapters against the same batch without LoRA,
and the same requests through stock diffusers + PEFT (one after another: it cannot mix adapters in a batch).

    GIT_COMMIT=$(git rev-parse --short HEAD) python benchmarks/engine/lora_engine.py --budget-s 400 --out DIR
    python benchmarks/engine/lora_engine.py --tiny --device cpu --size 64 --out /tmp/le      # CPU smoke run

FLUX.1-dev-sized transformer (random bf16 weights, built in memory as in engine_vs_diffusers.py). For each
rank of ``--rank`` (default 16 and 64) every request gets its own adapter: rank r on every linear of the
transformer blocks (attention q/k/v/out for both streams, the feed-forwards, single-block
proj_mlp/proj_out), random weights generated once per rank and given to both implementations.

Rows, in this order (the stock-diffusers rows run first, on the clean model):
- diffusers FluxPipeline, one request, no LoRA: transformer step ms (ForwardTimer: CUDA events around
  each transformer forward), median over its steps; "4-request equivalent" = 4 × that step.
- diffusers + PEFT, per rank: the 4 adapters loaded with ``pipe.load_lora_weights(state_dict,
  adapter_name=...)`` (diffusers-format state dict built in memory, alpha = rank, so scale 1 as in the
  engine), then each request after ``pipe.set_adapters(its adapter)``, one after another. Step ms = median
  over all 4 requests' steps; "4-request equivalent" = sum over the 4 requests of their median step
  (what one step of the batch costs when the requests run one after another); wall s = the 4 requests'
  total time (text encode, steps and VAE decode included). ``pipe.unload_lora_weights()`` afterwards
  (checked: no PEFT layer left) and the memory is released before the next rows.
- ditserve Engine, per rank: ``--requests`` requests of one size share every step; batch step = the
  engine's step time (every rank command of the step), median over the timed steps, without LoRA and
  with one adapter per request (``max_lora_rank`` = rank), in interleaved modes: no LoRA; LoRA (the
  default); the shrink kernel launched before each fused GEMM instead of inside it; a shrink per linear
  instead of one per group; unfused; all of them without CUDA graphs. Where the engine has them
  (``--cuda-graphs``, on by default for one GPU): no LoRA and LoRA again, each forward replayed as a graph
  (one per adapter layout with LoRA). After each engine the LoRA hooks are removed.

PSNR: each request's image from the engine batch with LoRA against the same request through diffusers +
PEFT with the same adapter (uint8; 4 requests, minimum reported).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import io
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

# Loading a second adapter into one model is what these rows do on purpose.
warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the report helper
from batching import start_engine  # noqa: E402
from engine_vs_diffusers import (  # noqa: E402
    ForwardTimer,
    Skips,
    build_pipe,
    commit,
    device_name,
    flux_configs,
    fmt_psnr,
    psnr,
    sync,
)
from report import write_results  # noqa: E402

from ditserve.kernels.policy import KernelPolicy, active_policy, use_policy  # noqa: E402
from ditserve.replica.engine import Engine  # noqa: E402
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
GUIDANCE = 3.5  # FluxRunner's default distilled guidance, passed to diffusers explicitly


def random_adapter(transformer, rank: int, seed: int) -> LoRAFile:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and "blocks." in name and name.endswith(TARGETS):
            a = torch.randn(rank, module.in_features, generator=g) * 0.01
            b = torch.randn(module.out_features, rank, generator=g) * 0.01
            modules[name] = LoRAModule(a=a, b=b, bias=None)
    return LoRAFile(modules=modules, rank=rank, ignored=0)


def diffusers_state_dict(lora: LoRAFile, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapter in diffusers/PEFT layout (``transformer.<module>.lora_A/B.weight``), no alpha: scale 1."""
    out = {}
    for name, m in lora.modules.items():
        out[f"transformer.{name}.lora_A.weight"] = m.a.to(device, dtype)
        out[f"transformer.{name}.lora_B.weight"] = m.b.to(device, dtype)
    return out


def peft_layers(module: torch.nn.Module) -> int:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sum(isinstance(m, BaseTunerLayer) for m in module.modules())


def detach_lora(manager) -> None:
    """Give the transformer's linears their own forward back (the engine is shut down; the pipe stays)."""
    manager.batch, manager.active = None, False
    for layer in manager.layers.values():
        layer.detach()
    manager.layers.clear()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_png(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def timed_steps(engine: Engine, params: list[GenerationParams]) -> tuple[list[float], list[np.ndarray]]:
    """Per-step times of one batch run (all requests submitted together), and each request's image: the wall
    time between the ends of consecutive steps, the GPU drained at each end (a step replayed as a CUDA graph
    returns to the host before the GPU has run it; the first interval also holds the admission)."""
    times: list[float] = []
    last = [time.perf_counter()]

    def on_progress(done: int, total: int) -> None:  # in the engine's loop thread, after every step
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    futures = [engine.submit(p, on_progress=on_progress if i == 0 else None) for i, p in enumerate(params)]
    return times, [decode_png(f.result().outputs[0]) for f in futures]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rank", default="16,64", help="comma list of LoRA ranks")
    parser.add_argument(
        "--adapters-per-request",
        type=int,
        default=1,
        help="engine rows: request i gets adapters a_i, a_i+1, ... (a style and a character); needs --no-peft",
    )
    parser.add_argument("--no-peft", action="store_true", help="skip the diffusers + PEFT rows")
    parser.add_argument(
        "--compile", action="store_true", help="engine with --compile (regional torch.compile)"
    )
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip rows that would start after this")
    parser.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    if args.adapters_per_request > 1 and not args.no_peft:
        parser.error("--adapters-per-request > 1 times the engine only: add --no-peft")
    t_start = time.perf_counter()
    ranks = [int(r) for r in str(args.rank).split(",")]
    device = torch.device(args.device if args.device != "cuda" else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    max_len = flux_configs(args.tiny)["max_sequence_length"]
    pipe = build_pipe(tiny=args.tiny, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    sha, dev = commit(), device_name(device)
    n = args.requests
    adapters: dict[int, list[LoRAFile]] = {}

    def adapters_for(rank: int) -> list[LoRAFile]:
        """Made once per rank and kept (host memory: rank 64 ≈ 1 GB per FLUX-size adapter in fp32)."""
        if rank not in adapters:
            adapters[rank] = [random_adapter(pipe.transformer, rank, i) for i in range(n)]
        return adapters[rank]

    rows: list[dict] = []
    skips = Skips(args.budget_s, t_start)
    images: dict[tuple[str, int, int], np.ndarray] = {}  # (impl, rank, request) → image

    dirty: list[str] = []  # set when PEFT layers could not be removed: later rows would be wrong

    def over_budget(label: str) -> bool:
        if dirty:
            skips.add(label, dirty[0])
            return True
        return skips.over_budget(label)

    failed = skips.failed

    # ---- stock diffusers (+ PEFT), one request at a time, on the clean model ----------------------------
    def diffusers_request(i: int) -> np.ndarray:
        from ditserve.replica.pipelines.base import to_uint8

        out = pipe(
            prompt=f"request {i}",
            height=args.size,
            width=args.size,
            num_inference_steps=args.steps,
            guidance_scale=GUIDANCE,
            generator=torch.Generator("cpu").manual_seed(i),
            max_sequence_length=max_len,
            output_type="np",
        )
        return to_uint8(out.images)[0]

    have_peft = importlib.util.find_spec("peft") is not None
    if args.no_peft:
        skips.reasons.append("diffusers rows: --no-peft")
    elif not have_peft:
        skips.add("diffusers + PEFT rows", "peft is not installed (pip install peft)")
    if not args.no_peft:
        timer = ForwardTimer(pipe.transformer, device)
        try:
            label = "diffusers, no LoRA"
            if not over_budget(label):
                try:
                    with torch.no_grad():
                        diffusers_request(0)  # warm-up
                        timer.take()
                        t0 = time.perf_counter()
                        diffusers_request(0)
                        sync()
                        wall = time.perf_counter() - t0
                        step = statistics.median(timer.take())
                    rows.append(dict(impl="diffusers", size=args.size, requests=1, rank=0, adapters=0,
                                     step_ms=step, batch_equiv_ms=n * step, wall_s=wall, device=dev,
                                     commit=sha))  # fmt: skip
                    print(f"{label}: step {step:.1f} ms, request {wall:.2f} s", flush=True)
                except Exception as exc:
                    timer.take()
                    failed(label, exc)
            for rank in ranks if have_peft else []:
                label = f"diffusers + PEFT, rank {rank}"
                if over_budget(label):
                    continue
                names = [f"peft{i}" for i in range(n)]
                try:
                    t0 = time.perf_counter()
                    for name, lora in zip(names, adapters_for(rank), strict=True):
                        pipe.load_lora_weights(diffusers_state_dict(lora, device, dtype), adapter_name=name)
                    sync()
                    load_s = time.perf_counter() - t0
                    with torch.no_grad():
                        pipe.set_adapters(names[0])
                        diffusers_request(0)  # warm-up with an adapter
                        timer.take()
                        per_request, wall = [], 0.0
                        for i, name in enumerate(names):
                            pipe.set_adapters(name)
                            t0 = time.perf_counter()
                            images[("peft", rank, i)] = diffusers_request(i)
                            sync()
                            wall += time.perf_counter() - t0
                            per_request.append(timer.take())
                    step = statistics.median([t for ts in per_request for t in ts])
                    equiv = sum(statistics.median(ts) for ts in per_request)
                    rows.append(dict(impl="diffusers + PEFT", size=args.size, requests=n, rank=rank,
                                     adapters=n, step_ms=step, batch_equiv_ms=equiv, wall_s=wall,
                                     load_s=load_s, device=dev, commit=sha))  # fmt: skip
                    print(f"{label}: step {step:.1f} ms, {n} requests {wall:.2f} s, "
                          f"batch-step equivalent {equiv:.1f} ms, load {load_s:.1f} s", flush=True)  # fmt: skip
                except Exception as exc:
                    timer.take()
                    failed(label, exc)
                finally:
                    try:
                        pipe.unload_lora_weights()
                    except Exception as exc:
                        failed(f"{label}: unload", exc)
                    left = peft_layers(pipe.transformer)
                    if left:
                        dirty.append(f"{left} PEFT layers left in the transformer after unload_lora_weights")
                    free(device)
        finally:
            timer.remove()

    # ---- ditserve engine: the whole batch in every step --------------------------------------------------
    def batch(with_lora: bool) -> list[GenerationParams]:
        return [
            GenerationParams(
                prompt=f"request {i}",
                width=args.size,
                height=args.size,
                seed=i,
                num_inference_steps=args.steps,
                lora=tuple(LoRARef(name=f"a{(i + k) % n}") for k in range(args.adapters_per_request))
                if with_lora
                else (),
            )
            for i in range(n)
        ]

    gluon_default = (
        active_policy().gluon
    )  # the engine's choice (DITSERVE_GLUON_GEMM); the modes below keep it
    for rank in ranks:
        label = f"ditserve engine, rank {rank}, {args.adapters_per_request} adapter(s) per request"
        if over_budget(label):
            continue
        engine = manager = None
        try:
            engine = start_engine(
                pipe,
                device=args.device,
                max_batch_size=n,
                max_loras=n,
                max_lora_rank=rank,
                max_sequence_length=max_len,
                compile=args.compile,
            )
            manager = engine.launcher.worker.lora
            runner = engine.launcher.worker.runner
            graphs = runner.graphs  # StepGraphs (--cuda-graphs) or None
            t0 = time.perf_counter()
            for i, lora in enumerate(adapters_for(rank)):
                engine.loras[f"a{i}"] = manager.load_weights(f"a{i}", lora, source="memory")
            load_s = time.perf_counter() - t0
            # modes: no LoRA; LoRA inside the GEMM (fused_lora, the default: the shrink inside the GEMM launch
            # where the batch allows; the Gluon kernels on Hopper); the same with the shrink kernel launched
            # first; with one shrink per linear instead of one per group of linears on the same input; base
            # GEMM + in-place expand. ", triton": the Triton kernels where the default takes the Gluon ones;
            # "fused, one launch wherever it applies": without `one_launch_pays` choosing where it does
            modes = (
                "none",
                "fused",
                "fused, one launch wherever it applies",
                "fused, triton",
                "two launches",
                "two launches, triton",
                "unshared",
                "inplace",
            )
            if graphs is not None:  # the default engine on one GPU: every forward a CUDA graph
                modes += ("none, graphs", "fused, graphs", "fused, triton, graphs")

            def set_mode(
                mode: str, manager=manager, runner=runner, graphs=graphs, gluon_default=gluon_default
            ) -> KernelPolicy:
                manager.fused = not mode.startswith("inplace")
                manager.share_shrink = mode != "unshared"
                # the Gluon kernels (Hopper) where they apply, unless the mode asks for the Triton ones
                policy = KernelPolicy(
                    gluon=gluon_default and "triton" not in mode,
                    shrink_in=not mode.startswith("two launches"),
                    one_launch_rule="wherever" not in mode,
                )
                runner.graphs = graphs if mode.endswith(", graphs") else None
                if graphs is not None and mode.endswith(", graphs") and set_mode.kernels != policy.gluon:
                    graphs.clear()  # a graph holds the kernels it was captured with
                    set_mode.kernels = policy.gluon
                return policy

            set_mode.kernels = None

            for mode in modes:  # warm-up every path, then time them interleaved
                with use_policy(set_mode(mode)):
                    timed_steps(engine, batch(mode != "none"))
            results: dict[str, list[float]] = {}
            for mode in modes + modes:
                with use_policy(set_mode(mode)):
                    times, outs = timed_steps(engine, batch(mode != "none"))
                results.setdefault(mode, []).extend(times[1:])
                if mode in ("fused", "fused, graphs", "fused, triton", "fused, triton, graphs", "none"):
                    # "fused": the engine's images against PEFT
                    for i, image in enumerate(outs):
                        images[(mode, rank, i)] = image
        except Exception as exc:
            failed(label, exc)
            continue
        finally:
            if engine is not None:
                engine.shutdown()
            if manager is not None:
                detach_lora(manager)
            del engine, manager
            free(device)
        base, lora = statistics.median(results["none"]), statistics.median(results["fused"])
        print(
            f"rank {rank}, step medians (ms): "
            + ", ".join(f"{m_}: {statistics.median(t) * 1e3:.1f}" for m_, t in results.items()),
            flush=True,
        )
        graphed = {
            m: statistics.median(results[m]) for m in ("none, graphs", "fused, graphs") if m in results
        }
        if graphed:  # the graphs draw what the eager forwards draw, and the adapters show
            same = min(psnr(images[("fused, graphs", rank, i)], images[("fused", rank, i)]) for i in range(n))
            kernels = min(
                psnr(images[("fused", rank, i)], images[("fused, triton", rank, i)]) for i in range(n)
            )
            triton_graphs = min(
                psnr(images[("fused, triton, graphs", rank, i)], images[("fused, triton", rank, i)])
                for i in range(n)
            )
            print(
                f"rank {rank}: PSNR default vs Triton kernels eager (min) {kernels:.1f} dB; Triton kernels with "
                f"graphs vs eager (min) {triton_graphs:.1f} dB",
                flush=True,
            )
            shows = max(psnr(images[("fused", rank, i)], images[("none", rank, i)]) for i in range(n))
            print(
                f"rank {rank}: PSNR LoRA with graphs vs eager (min) {same:.1f} dB; LoRA vs no LoRA (max) "
                f"{shows:.1f} dB",
                flush=True,
            )
        inplace = statistics.median(results["inplace"])
        two = statistics.median(results["two launches"])
        triton = statistics.median(results["fused, triton"])
        unshared = statistics.median(results["unshared"])
        psnrs = [
            psnr(images[("fused", rank, i)], images[("peft", rank, i)])
            for i in range(n)
            if ("peft", rank, i) in images and ("fused", rank, i) in images
        ]
        rows.append(
            {
                "impl": "ditserve engine",
                "size": args.size,
                "requests": n,
                "rank": rank,
                "adapters": n,
                "linears": len(adapters_for(rank)[0].modules),
                "step_ms_no_lora": base * 1e3,
                "step_ms_lora": lora * 1e3,
                "ratio": lora / base,
                "step_ms_lora_inplace": inplace * 1e3,
                "ratio_inplace": inplace / base,
                "step_ms_lora_triton": triton * 1e3,
                "ratio_triton": triton / base,
                "step_ms_lora_two_launches": two * 1e3,
                "ratio_two_launches": two / base,
                "step_ms_lora_unshared": unshared * 1e3,
                "ratio_unshared": unshared / base,
                # every mode's median step (ms), the Gluon ones included
                "mode_step_ms": {m_: statistics.median(t) * 1e3 for m_, t in results.items()},
                "load_s": load_s,
                **(
                    {
                        "step_ms_no_lora_graphs": graphed["none, graphs"] * 1e3,
                        "step_ms_lora_graphs": graphed["fused, graphs"] * 1e3,
                        "ratio_graphs": graphed["fused, graphs"] / graphed["none, graphs"],
                    }
                    if graphed
                    else {}
                ),
                "psnr_vs_peft_min": min(psnrs) if psnrs else None,
                "device": dev,
                "commit": sha,
            }
        )
        print(f"{label}: batch step {base * 1e3:.1f} ms no LoRA, {lora * 1e3:.1f} ms with {n} LoRAs "
              f"({lora / base:.3f}×), {two * 1e3:.1f} ms with the shrink kernel launched first ({two / base:.3f}×), "
              f"{unshared * 1e3:.1f} ms with a shrink per linear ({unshared / base:.3f}×), "
              f"{inplace * 1e3:.1f} ms unfused ({inplace / base:.3f}×)"
              + (f"; with CUDA graphs {graphed['none, graphs'] * 1e3:.1f} ms no LoRA, "
                 f"{graphed['fused, graphs'] * 1e3:.1f} ms with LoRA "
                 f"({graphed['fused, graphs'] / graphed['none, graphs']:.3f}×)" if graphed else ""),
              flush=True)  # fmt: skip

    # ---- table ----------------------------------------------------------------------------------------
    engine_rows = {r["rank"]: r for r in rows if r["impl"] == "ditserve engine"}
    engine_base = (
        statistics.median([r["step_ms_no_lora"] for r in engine_rows.values()]) if engine_rows else None
    )
    lines = [
        f"| size | implementation | rank | requests × adapters | transformer step ms | batch-step ms ({n} requests; "
        "diffusers: equivalent, one after another) | vs ditserve batch without LoRA | vs ditserve batch "
        "with the same LoRAs | PSNR engine vs PEFT dB (min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(x: float, ref: float | None) -> str:
        return f"{x / ref:.3f}×" if ref else "—"

    for r in rows:
        size = f"{r['size']}²"
        if r["impl"] == "ditserve engine":
            lines.append(f"| {size} | ditserve engine, no LoRA | — | {n} × 0 | — | {r['step_ms_no_lora']:.1f} | "
                         "1.000× | — | — |")  # fmt: skip
            lines.append(
                f"| {size} | ditserve engine, {n} LoRAs | {r['rank']} | {n} × {n} | — | {r['step_ms_lora']:.1f} | "
                f"{r['ratio']:.3f}× | 1.000× | {fmt_psnr(r['psnr_vs_peft_min'])} |"
            )
            lines.append(
                f"| {size} | ditserve engine, {n} LoRAs, the Triton kernels | {r['rank']} | {n} × {n} | — | "
                f"{r['step_ms_lora_triton']:.1f} | {r['ratio_triton']:.3f}× | "
                f"{r['step_ms_lora_triton'] / r['step_ms_lora']:.3f}× | — |"
            )
            lines.append(
                f"| {size} | ditserve engine, {n} LoRAs, the shrink kernel before each fused GEMM | {r['rank']} | "
                f"{n} × {n} | — | {r['step_ms_lora_two_launches']:.1f} | {r['ratio_two_launches']:.3f}× | "
                f"{r['step_ms_lora_two_launches'] / r['step_ms_lora']:.3f}× | — |"
            )
            lines.append(
                f"| {size} | ditserve engine, {n} LoRAs, a shrink per linear | {r['rank']} | {n} × {n} | — | "
                f"{r['step_ms_lora_unshared']:.1f} | {r['ratio_unshared']:.3f}× | "
                f"{r['step_ms_lora_unshared'] / r['step_ms_lora']:.3f}× | — |"
            )
            lines.append(
                f"| {size} | ditserve engine, {n} LoRAs, unfused (--no-fused-lora) | {r['rank']} | {n} × {n} | — | "
                f"{r['step_ms_lora_inplace']:.1f} | {r['ratio_inplace']:.3f}× | "
                f"{r['step_ms_lora_inplace'] / r['step_ms_lora']:.3f}× | — |"
            )
            if "step_ms_lora_graphs" in r:
                lines.append(f"| {size} | ditserve engine, no LoRA, CUDA graphs | — | {n} × 0 | — | "
                             f"{r['step_ms_no_lora_graphs']:.1f} | — | — | — |")  # fmt: skip
                lines.append(
                    f"| {size} | ditserve engine, {n} LoRAs, CUDA graphs | {r['rank']} | {n} × {n} | — | "
                    f"{r['step_ms_lora_graphs']:.1f} | {r['ratio_graphs']:.3f}× (vs graphs without LoRA) | "
                    f"{r['step_ms_lora_graphs'] / r['step_ms_lora']:.3f}× | — |"
                )
        else:
            same = engine_rows.get(r["rank"])
            lora_ref = same["step_ms_lora"] if same else None
            lines.append(
                f"| {size} | {r['impl']}{', one request' if r['requests'] == 1 else ''} | {r['rank'] or '—'} | "
                f"{r['requests']} × {r['adapters']} | {r['step_ms']:.1f} | {r['batch_equiv_ms']:.1f} | "
                f"{ratio(r['batch_equiv_ms'], engine_base)} | "
                f"{ratio(r['batch_equiv_ms'], lora_ref) if r['adapters'] else '—'} | — |"
            )
    notes = [
        "",
        f"{dev}, commit {sha}, {args.steps} steps per request, {args.adapters_per_request} adapter(s) per "
        f"request, {'float32 tiny' if args.tiny else 'bf16'} model, "
        f"engine {'with --compile' if args.compile else 'eager'}; "
        f"whole run {time.perf_counter() - t_start:.0f}s.",
        "'vs ditserve batch without LoRA': an engine row against the same engine's no-LoRA batch step; a "
        "diffusers row against the median no-LoRA batch step of the engines. Diffusers batch-step = sum of "
        "the requests' median transformer step (no-LoRA row: requests × its one request's step).",
    ]
    if skips.reasons:
        notes.append("Skipped: " + "; ".join(skips.reasons))
    print("\n" + "\n".join(lines + notes), flush=True)
    out_rows = rows + [{"impl": "skipped", "reason": s} for s in skips.reasons]
    write_results(
        "lora_engine",
        "\n".join(lines + notes),
        out_rows,
        out=args.out,
        baseline="the same batch without LoRA",
    )


if __name__ == "__main__":
    main()
