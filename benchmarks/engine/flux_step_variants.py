"""Where a FLUX-size transformer step goes on one GPU, and what each optimisation of it buys.

    python benchmarks/engine/flux_step_variants.py --out DIR                 # one GPU, ~5 minutes
    python benchmarks/engine/flux_step_variants.py --tiny --device cpu --variants eager --out /tmp/fsv

One FLUX.1-dev-sized transformer (random bf16 weights, built as in engine_vs_diffusers.py), fixed inputs,
batch 1. Each variant is applied to the same model object in order and timed over ``--iters`` forwards
after warm-up (CUDA events around the whole batch of forwards; compile time = first call − steady call).
Variants are cumulative where the name says so. `epilogues` (ditserve's --fused-epilogues) and `fp8`
(--quantization fp8) change the model in place, so run them after the stock ones:
`--variants eager,compiled,compiled+epilogues,compiled+epilogues+fp8`; `eager+norms` and `eager+epilogues`
patch without compiling (the one-pass adaLN norms alone, then all of --fused-epilogues). Also prints the attention kernels on
the FLUX-1024 shape and, per size, a kernel-time breakdown (torch.profiler) of the baseline and the last
variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the report helper
from engine_vs_diffusers import build_pipe, flux_configs  # noqa: E402
from report import kernel_kind, write_results  # noqa: E402


def inputs(transformer, size: int, device, dtype, text_len: int) -> dict:
    cfg = transformer.config
    g = torch.Generator(device="cpu").manual_seed(0)
    n = (size // 16) ** 2
    ids = torch.zeros(size // 16, size // 16, 3)
    ids[..., 1] += torch.arange(size // 16)[:, None]
    ids[..., 2] += torch.arange(size // 16)[None, :]
    return dict(
        hidden_states=torch.randn(1, n, cfg.in_channels, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(1, text_len, cfg.joint_attention_dim, generator=g).to(
            device, dtype
        ),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g).to(device, dtype),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=ids.reshape(n, 3).to(device),
        txt_ids=torch.zeros(text_len, 3, device=device),
        guidance=torch.tensor([3.5], device=device, dtype=torch.float32),
        return_dict=False,
    )


def timed(fn, iters: int, device) -> float:
    """ms per call, CUDA events around ``iters`` calls (perf_counter on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def breakdown(fn, device, top: int = 18) -> list[str]:
    """Kernel time per category and the top kernels of two calls (GPU only)."""
    if device.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        fn()
        torch.cuda.synchronize()
    rows = []
    cats: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t <= 0 or ev.key.startswith(("ProfilerStep", "aten::")):
            continue
        name = ev.key
        cat = kernel_kind(name)
        cats[cat] = cats.get(cat, 0) + t / 2e3
        rows.append((t / 2e3, ev.count // 2, cat, name[:110]))
    rows.sort(reverse=True)
    out = ["  per category (ms / call): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cats.items()))]
    out += [f"  {t:8.3f} ms  x{n:<4d} {cat:12s} {name}" for t, n, cat, name in rows[:top]]
    return out


def attention_kernels(device, dtype, lines: list[str]) -> None:
    if device.type != "cuda":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(1, 24, 4608, 128, device=device, dtype=dtype) for _ in range(3))
    flops = 4 * 24 * 4608 * 4608 * 128
    for name, backends in (
        ("sdpa default", None),
        ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
        ("flash", [SDPBackend.FLASH_ATTENTION]),
        ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
    ):
        try:
            if backends is None:
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
                ms = timed(fn, 3, device) and timed(fn, 20, device)
            else:
                with sdpa_kernel(backends):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
                    ms = timed(fn, 3, device) and timed(fn, 20, device)
            lines.append(f"attention 1x24x4608x128 {name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"attention {name}: {type(exc).__name__}: {str(exc)[:120]}")
    with profile_names(device) as names:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    lines.append(f"sdpa default runs: {names}")
    # the layout the model hands over: [B, S, H, D] projections viewed as [B, H, S, D] (not contiguous)
    qs, ks, vs = (torch.randn(1, 4608, 24, 128, device=device, dtype=dtype).transpose(1, 2) for _ in range(3))
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)  # noqa: E731
    ms = timed(fn, 3, device) and timed(fn, 20, device)
    lines.append(
        f"attention 1x24x4608x128 sdpa default, BSHD views: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s"
    )


class profile_names:
    def __init__(self, device):
        self.device = device
        self.names: list[str] = []

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.__enter__()
        return self.names

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.prof.__exit__(*exc)
        self.names.extend(
            sorted({e.key[:80] for e in self.prof.key_averages() if not e.key.startswith("aten")})
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--variants",
        default="eager,compiled,compiled+cudnn,compiled+cudnn+fused,compiled+cudnn+fused+cdt,+graph,max-autotune",
    )
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument(
        "--out", default=os.environ.get("OUT"), help="results folder (default: benchmarks/results)"
    )
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dtype = torch.bfloat16
    sizes = [int(s) for s in (args.sizes or ("64" if args.tiny else "1024,512")).split(",")]
    text_len = flux_configs(args.tiny)["max_sequence_length"]
    pipe = build_pipe(tiny=args.tiny, device=device, dtype=dtype)
    tr = pipe.transformer
    lines: list[str] = [
        f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    ]
    attention_kernels(device, dtype, lines)
    print("\n".join(lines), flush=True)
    feeds = {s: inputs(tr, s, device, dtype, text_len) for s in sizes}
    results: dict[str, dict[int, float]] = {}
    reference: dict[int, torch.Tensor] = {}
    graphs: dict[int, tuple] = {}
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.cache_size_limit = 64

    def apply(variant: str) -> None:
        if variant == "eager":
            return
        if variant == "+graph":
            return
        if variant.startswith("eager+"):  # eager, with --fused-epilogues' norms only / all of it
            from ditserve.replica.models.flux_fused import fuse_flux_epilogues, fuse_flux_norms

            fuse = fuse_flux_epilogues if "epilogues" in variant else fuse_flux_norms
            lines.append(f"{variant}: {fuse(tr)} modules patched")
            return
        torch._dynamo.reset()
        if "cudnn" in variant:
            tr.set_attention_backend("_native_cudnn")
        if "fused" in variant:
            tr.fuse_qkv_projections()
        if "cdt" in variant:
            torch._inductor.config.coordinate_descent_tuning = True
        if "epilogues" in variant or "fp8" in variant:  # the engine's --fused-epilogues / --quantization fp8
            from ditserve.replica.worker import apply_speed_switches

            changed = apply_speed_switches(
                tr,
                family="flux",
                device=device,
                dtype=dtype,
                quantization="fp8" if "fp8" in variant else "none",
                fused_epilogues="epilogues" in variant,
            )
            lines.append(f"{variant}: fused epilogues in {changed['fused_epilogues']} modules")
            lines.append(f"{variant}: {changed['fp8_linears']} linears as FP8 GEMMs")
        if variant == "max-autotune":
            tr.compile_repeated_blocks(fullgraph=True, mode="max-autotune-no-cudagraphs")
        else:
            tr.compile_repeated_blocks(fullgraph=True)

    with torch.no_grad():
        for variant in args.variants.split(","):
            if time.perf_counter() - t_start > args.budget_s:
                lines.append(f"{variant}: skipped (budget)")
                continue
            try:
                apply(variant)
            except Exception as exc:  # noqa: BLE001
                lines.append(f"{variant}: apply failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            results[variant] = {}
            for size in sizes:
                feed = feeds[size]
                try:
                    if variant == "+graph":
                        static = feed
                        stream = torch.cuda.Stream()
                        stream.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(stream):
                            for _ in range(2):
                                tr(**static)
                        torch.cuda.current_stream().wait_stream(stream)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            out_static = tr(**static)[0]
                        graphs[size] = (graph, out_static)
                        fn = graph.replay
                        t0 = time.perf_counter()
                        fn()
                        torch.cuda.synchronize()
                        first = time.perf_counter() - t0
                        out = out_static
                    else:
                        t0 = time.perf_counter()
                        out = tr(**feed)[0]
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        first = time.perf_counter() - t0
                        fn = lambda f=feed: tr(**f)  # noqa: E731
                    timed(fn, 2, device)
                    ms = timed(fn, args.iters, device)
                except Exception as exc:  # noqa: BLE001
                    lines.append(f"{variant} {size}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                    print(lines[-1], flush=True)
                    continue
                if size not in reference:
                    reference[size] = out.float().clone()
                err = (out.float() - reference[size]).abs().max().item()
                rel = err / reference[size].abs().max().item()
                results[variant][size] = ms
                line = (
                    f"{variant:40s} {size}²: {ms:8.2f} ms/step, first call {first:6.1f} s, "
                    f"max|Δ| vs eager {rel:.2e} (rel)"
                )
                lines.append(line)
                print(line, flush=True)
                if (
                    variant in ("compiled", "compiled+cudnn+fused+cdt", "compiled+epilogues")
                    or "fp8" in variant
                ) and device.type == "cuda":
                    b = breakdown(fn, device)
                    lines += [f"breakdown {variant} {size}²:"] + b
                    print("\n".join(b), flush=True)
    lines.append(f"whole run {time.perf_counter() - t_start:.0f} s")
    text = "\n".join(lines)
    print("\n" + text)
    write_results(
        "flux_step_variants", text, results, out=args.out, baseline="stock diffusers eager, same model"
    )


if __name__ == "__main__":
    main()
