"""ditserve's Flux runner against stock diffusers FluxPipeline on one GPU: same weights, inputs and run.

    GIT_COMMIT=$(git rev-parse --short HEAD) python benchmarks/engine/engine_vs_diffusers.py --out DIR
    python benchmarks/engine/engine_vs_diffusers.py --tiny --device cpu --out /tmp/evd      # CPU smoke run

The model is FLUX.1-dev-sized (19 double + 38 single blocks, 24 heads × 128, joint dim 4096, pooled 768,
guidance embeds) with random weights built directly on the device in bf16, plus the real FLUX VAE config.
The text encoders are tiny random CLIP / T5 models whose outputs have the real shapes (T5 512 × 4096,
pooled 768): text encoding is NOT what is measured (it is inside "image s" but costs next to nothing).
Nothing is downloaded or written to disk except the result files.

Configurations, in this order, per size: (a) diffusers FluxPipeline eager; (c) ditserve FluxRunner
prepare/step/decode on the same pipe object, eager; then ``pipe.transformer.compile_repeated_blocks(
fullgraph=True)`` and (b) diffusers compiled, and (d) our runner on that compiled transformer (the engine's
``--compile`` compiles the same blocks, without fullgraph so that LoRA steps can call the adapter path).
Then ``--extras`` (default epilogues,fp8,graphs): the engine's --fused-epilogues and --quantization fp8,
applied cumulatively in place to the same transformer (recompiled), then --cuda-graphs (the runner replays
each forward as a CUDA graph); our runner only. Last, ``engine``: the whole in-process Engine (scheduler
loop, request queue, PNG encoding, its own ``--compile``: regional without fullgraph) with those flags, as
``ditserve serve`` runs them (image = wall time of ``Engine.generate``). Transformer step time = CUDA events around every
transformer forward (hooks on the model; around the runner's forward call for graph replays), median over
the timed images' steps; image time = wall time of one whole
image (text encode + 28 steps + VAE decode), median over the timed images. Warm-up images are excluded;
for compiled rows the first image's extra time over the steady image is reported as compile time.
Prints a markdown table and writes DIR/engine_vs_diffusers.md and .json.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the report helper
from report import write_results  # noqa: E402

PROMPT = "a photograph of an astronaut riding a horse on the moon, high detail"
NEGATIVE = "blurry, low quality"
SEED = 1234
WEIGHT_SEED = 0


# ---- model ---------------------------------------------------------------------------------------------
def flux_configs(tiny: bool) -> dict:
    """Component configs: FLUX.1-dev sizes, or a tiny stand-in for the CPU smoke run."""
    if tiny:
        return dict(
            transformer=dict(
                patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32,
                guidance_embeds=True, axes_dims_rope=(4, 6, 6),
            ),
            vae=dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                     scaling_factor=1.5035, shift_factor=0.0609),
            clip_hidden=32, t5_dim=32, max_sequence_length=32,
        )  # fmt: skip
    return dict(
        transformer=dict(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
            guidance_embeds=True, axes_dims_rope=(16, 56, 56),
        ),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                 norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159, sample_size=1024),
        clip_hidden=768, t5_dim=4096, max_sequence_length=512,
    )  # fmt: skip


def build_pipe(*, tiny: bool, device: torch.device, dtype: torch.dtype, seed: int = WEIGHT_SEED):
    """A FluxPipeline with random weights, built on ``device`` in ``dtype`` (same seed → same weights)."""
    import diffusers
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from ditserve.replica.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()  # the tiny run's prompt-truncation warning
    transformers.utils.logging.set_verbosity_error()
    cfg = flux_configs(tiny)
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer(model_max_length=cfg["max_sequence_length"])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in dtype: no fp32 copy, no CPU init
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(**cfg["transformer"])
            vae = AutoencoderKL(
                in_channels=3,
                out_channels=3,
                down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4,
                use_quant_conv=False,
                use_post_quant_conv=False,
                **cfg["vae"],
            )
            clip = CLIPTextModel(
                CLIPTextConfig(
                    vocab_size=len(tokenizer), hidden_size=cfg["clip_hidden"], intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=77,
                    projection_dim=cfg["clip_hidden"], bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                )
            )  # fmt: skip
            t5 = T5EncoderModel(
                T5Config(
                    vocab_size=len(tokenizer_2), d_model=cfg["t5_dim"], d_kv=16, d_ff=64, num_layers=1,
                    num_heads=2, relative_attention_num_buckets=8, pad_token_id=tokenizer_2.pad_token_id,
                    eos_token_id=tokenizer_2.eos_token_id, decoder_start_token_id=tokenizer_2.pad_token_id,
                )
            )  # fmt: skip
    finally:
        torch.set_default_dtype(previous)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
            base_image_seq_len=256,
            base_shift=0.5,
            max_image_seq_len=4096,
            max_shift=1.15,
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
        ),  # fmt: skip
        vae=vae.eval(),
        text_encoder=clip.eval(),
        tokenizer=tokenizer,
        text_encoder_2=t5.eval(),
        tokenizer_2=tokenizer_2,
        transformer=transformer.eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, clip, t5):
        bad = [n for n, p in module.named_parameters() if p.dtype != dtype or p.device.type != device.type]
        assert not bad, f"{type(module).__name__}: {bad[:3]} not {dtype} on {device}"
    return pipe


def make_runner(pipe, *, device: torch.device, dtype: torch.dtype, max_sequence_length: int, mesh=None):
    """FluxRunner with the arguments ``replica.worker.build_runner`` passes."""
    from ditserve.replica.pipelines.flux import FluxRunner

    return FluxRunner(pipe, device=device, dtype=dtype, max_sequence_length=max_sequence_length, mesh=mesh)


# ---- measuring ------------------------------------------------------------------------------------------
class ForwardTimer:
    """Times every forward of ``module``: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self._start = None
        self.suspended = 0
        self.handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _skip(self) -> bool:
        # inside time_calls (timed there) or while a CUDA graph is being captured (no events then)
        return self.suspended > 0 or (self.cuda and torch.cuda.is_current_stream_capturing())

    def _pre(self, module, args):
        if not self._skip():
            self._start = self._mark()

    def _post(self, module, args, output):
        if not self._skip():
            self.pending.append((self._start, self._mark()))

    def time_calls(self, fn):
        """``fn`` timed as one forward per call (CUDA-graph replays run no module hooks); forwards inside it
        are not timed again."""

        def timed(*args, **kwargs):
            start = self._mark()
            self.suspended += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self.suspended -= 1
            self.pending.append((start, self._mark()))
            return out

        return timed

    def take(self) -> list[float]:
        """ms of each forward since the last take."""
        sync()
        if self.cuda:
            out = [s.elapsed_time(e) for s, e in self.pending]
        else:
            out = [(e - s) * 1e3 for s, e in self.pending]
        self.pending = []
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR of two uint8 images in dB (inf when identical)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def fmt_psnr(x: float | None) -> str:
    if x is None:
        return "—"
    return "identical (inf)" if math.isinf(x) else f"{x:.1f}"


def commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class Skips:
    """Rows a benchmark did not measure: over its time budget, or failed (the other rows still run)."""

    def __init__(self, budget_s: float, t_start: float):
        self.t_start = t_start  # the budget counts from here (the benchmark's start)
        self.budget_s = budget_s
        self.reasons: list[str] = []

    def add(self, label: str, reason: str) -> None:
        self.reasons.append(f"{label}: {reason}")
        print(f"skip {label}: {reason}", flush=True)

    def over_budget(self, label: str) -> bool:
        if time.perf_counter() - self.t_start > self.budget_s:
            self.add(label, "time budget")
            return True
        return False

    def failed(self, label: str, exc: BaseException) -> None:
        traceback.print_exc()
        self.add(label, f"{type(exc).__name__}: {str(exc)[:300]}")


def write_report(out_dir: str | None, stem: str, text: str, meta: dict, rows: list[dict]) -> None:
    """Print the table, and write it and the measurements as this run's results file (benchmarks/report.py)."""
    print("\n" + text)
    write_results(
        stem, text, dict(meta=meta, rows=rows), out=out_dir, baseline="stock diffusers, same weights"
    )


# ---- the two ways to make one image -----------------------------------------------------------------
def diffusers_image(pipe, size: int, steps: int, max_len: int) -> np.ndarray:
    from ditserve.replica.pipelines.base import to_uint8

    out = pipe(
        prompt=PROMPT,
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=3.5,
        generator=torch.Generator("cpu").manual_seed(SEED),
        max_sequence_length=max_len,
        output_type="np",
    )
    return to_uint8(out.images)[0]


def runner_image(runner, size: int, steps: int) -> np.ndarray:
    from ditserve.replica.request import GenerationParams

    params = GenerationParams(
        prompt=PROMPT, width=size, height=size, num_inference_steps=steps, guidance_scale=3.5, seed=SEED
    )
    state = runner.add("bench", params)
    while not state.done:
        runner.step([state])
    return runner.decode(state)[0]


def engine_flags(switches: list[str], no_compile: bool) -> list[str]:
    names = {"epilogues": "--fused-epilogues", "fp8": "--quantization fp8", "graphs": "--cuda-graphs"}
    return ([] if no_compile else ["--compile"]) + [names[s] for s in switches]


def engine_switch_flags(switches: list[str], device: torch.device) -> dict:
    """EngineConfig fields for the switches named (the others off, whatever the engine defaults)."""
    return dict(
        quantization="fp8" if "fp8" in switches else "none",
        fused_epilogues="epilogues" in switches,
        cuda_graphs="graphs" in switches and device.type == "cuda",
    )


def engine_image(engine, size: int, steps: int) -> np.ndarray:
    import io

    from PIL import Image

    from ditserve.replica.request import GenerationParams

    params = GenerationParams(
        prompt=PROMPT, width=size, height=size, num_inference_steps=steps, guidance_scale=3.5, seed=SEED
    )
    png = engine.generate(params, timeout=600).outputs[0]
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def measure(make_image, timer: ForwardTimer, device: torch.device, warmup: int, repeats: int) -> dict:
    """Warm-up images (kept apart), then ``repeats`` timed images."""
    first_s = None
    for i in range(warmup):
        sync()
        t0 = time.perf_counter()
        make_image()
        sync()
        if i == 0:
            first_s = time.perf_counter() - t0
    timer.take()
    reset_peak(device)
    image_s, step_ms, image = [], [], None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        image = make_image()
        sync()
        image_s.append(time.perf_counter() - t0)
        step_ms += timer.take()
    return dict(
        step_ms=statistics.median(step_ms),
        step_ms_min=min(step_ms),
        step_ms_max=max(step_ms),
        forwards=len(step_ms),
        image_s=statistics.median(image_s),
        first_image_s=first_s,
        peak_gib=peak_gib(device),
        image=image,
        image_std=float(image.astype(np.float64).std()),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", default=None, help="comma list of square sizes (default 1024,512; tiny 64,32)")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager rows (ratios then show —)")
    ap.add_argument(
        "--extras",
        default="epilogues,fp8,graphs,engine",
        help="engine switches applied after the stock rows, cumulatively, in place on the same transformer: "
        "epilogues (--fused-epilogues), fp8 (--quantization fp8), graphs (--cuda-graphs); engine: the whole "
        "in-process Engine with the switches so far; empty: none",
    )
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip configs that start after this many s")
    ap.add_argument(
        "--out", default=os.environ.get("OUT"), help="results folder (default: benchmarks/results)"
    )
    args = ap.parse_args()

    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    sizes = [int(s) for s in (args.sizes or ("64,32" if args.tiny else "1024,512")).split(",")]
    max_len = flux_configs(args.tiny)["max_sequence_length"]
    import diffusers

    t0 = time.perf_counter()
    pipe = build_pipe(tiny=args.tiny, device=device, dtype=dtype)
    sync()
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"built pipeline in {build_s:.1f}s: transformer {n_params / 1e9:.2f}B params, {dtype}, {device}")
    runner = make_runner(pipe, device=device, dtype=dtype, max_sequence_length=max_len)
    timer = ForwardTimer(pipe.transformer, device)

    results: dict[tuple[int, str], dict] = {}
    extra_impls: list[str] = []
    skips = Skips(args.budget_s, t_start)

    def run(size: int, impl: str, make_image, warmup: int) -> None:
        if skips.over_budget(f"{impl} {size}²"):
            return
        try:
            r = measure(make_image, timer, device, warmup, args.repeats)
        except Exception as exc:  # e.g. a compile failure: keep the other rows
            timer.take()
            skips.failed(f"{impl} {size}²", exc)
            return
        results[(size, impl)] = r
        print(
            f"{size}² {impl}: step {r['step_ms']:.2f} ms, image {r['image_s']:.3f} s, "
            f"first {r['first_image_s']:.2f} s, peak {r['peak_gib']:.2f} GiB, std {r['image_std']:.1f}",
            flush=True,
        )

    with torch.no_grad():
        for size in sizes if not args.no_eager else ():
            run(
                size,
                "diffusers eager",
                lambda s=size: diffusers_image(pipe, s, args.steps, max_len),
                args.warmup,
            )
            run(size, "ditserve eager", lambda s=size: runner_image(runner, s, args.steps), args.warmup)
        if not args.no_compile:
            # One static graph per shape bucket, as a serving engine with fixed buckets would keep.
            torch._dynamo.config.automatic_dynamic_shapes = False
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
            for size in sizes:
                run(size, "diffusers compiled", lambda s=size: diffusers_image(pipe, s, args.steps, max_len),
                    max(args.warmup, 1))  # fmt: skip
                run(
                    size,
                    "ditserve on compiled",
                    lambda s=size: runner_image(runner, s, args.steps),
                    args.warmup,
                )

        # The engine's own switches, on top of what the rows above measured (they change the model in place,
        # so they come last; each is cumulative with the previous one).
        from ditserve.replica.worker import apply_speed_switches

        switches = {
            "epilogues": dict(fused_epilogues=True), "fp8": dict(quantization="fp8"), "graphs": {}, "engine": {}
        }  # fmt: skip
        applied, flags = [], {}
        for extra in filter(None, args.extras.split(",")):
            if extra not in switches:
                raise SystemExit(f"--extras: unknown {extra!r} ({', '.join(switches)})")
            if extra == "engine":  # the whole Engine with the flags so far, as `ditserve serve` runs them
                impl = f"ditserve Engine, {' '.join(engine_flags(applied, args.no_compile)) or 'defaults'}"
                extra_impls.append(impl)
                if skips.over_budget(impl):
                    continue
                torch._dynamo.reset()
                from batching import start_engine  # this folder is on sys.path when a benchmark runs

                engine = start_engine(pipe, device=device.type, max_sequence_length=max_len,
                                      compile=not args.no_compile, **engine_switch_flags(applied, device))  # fmt: skip
                worker_runner = engine.launcher.worker.runner
                worker_runner._run_rows = timer.time_calls(worker_runner._run_rows)
                try:
                    for size in sizes:
                        run(
                            size,
                            impl,
                            lambda s=size, e=engine: engine_image(e, s, args.steps),
                            max(args.warmup, 1),
                        )
                finally:
                    engine.shutdown()
                continue
            applied.append(extra)
            impl = f"ditserve {'eager' if args.no_compile else 'compiled'} + {' + '.join(applied)}"
            extra_impls.append(impl)
            runner.model_changed()
            if extra == "graphs":  # the engine's --cuda-graphs: the runner replays its forwards
                if device.type != "cuda":
                    print("graphs: CUDA only, skipped")
                    continue
                from ditserve.replica.pipelines.graphs import StepGraphs

                runner.graphs = StepGraphs(runner.model_forward, device)
                runner._run_rows = timer.time_calls(runner._run_rows)
            else:
                flags.update(switches[extra])
                apply_speed_switches(pipe.transformer, family="flux", device=device, dtype=dtype, **flags)
                if not args.no_compile:
                    torch._dynamo.reset()
                    pipe.transformer.compile_repeated_blocks(fullgraph=True)
            for size in sizes:
                run(size, impl, lambda s=size: runner_image(runner, s, args.steps), max(args.warmup, 1))

    # ---- table ----------------------------------------------------------------------------------------
    sha = commit()
    dev = device_name(device)
    header = (
        "| commit | device | model | size | steps | dtype | batch | implementation | transformer step ms "
        "(median [min–max]) | step vs diffusers eager | image s | image vs diffusers eager | compile s "
        "| peak GiB | PSNR vs diffusers eager dB | PSNR vs diffusers compiled dB |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    model = "tiny Flux" if args.tiny else "FLUX.1-dev-size, random"
    for size in sizes:
        base = results.get((size, "diffusers eager"))
        comp = results.get((size, "diffusers compiled"))
        for impl in (
            "diffusers eager",
            "ditserve eager",
            "diffusers compiled",
            "ditserve on compiled",
            *extra_impls,
        ):
            r = results.get((size, impl))
            if r is None:
                continue
            compile_s = "—"
            if impl == "diffusers compiled" and r["first_image_s"] is not None:
                compile_s = f"{r['first_image_s'] - r['image_s']:.1f}"
            r["psnr_eager"] = psnr(r["image"], base["image"]) if base else None
            r["psnr_compiled"] = psnr(r["image"], comp["image"]) if comp else None
            step_ratio = f"{base['step_ms'] / r['step_ms']:.2f}×" if base else "—"
            image_ratio = f"{base['image_s'] / r['image_s']:.2f}×" if base else "—"
            lines.append(
                f"| {sha} | {dev} | {model} | {size}² | {args.steps} | {args.dtype} | 1 | {impl} | "
                f"{r['step_ms']:.2f} [{r['step_ms_min']:.2f}–{r['step_ms_max']:.2f}] | {step_ratio} | "
                f"{r['image_s']:.3f} | {image_ratio} | {compile_s} | {r['peak_gib']:.2f} | "
                f"{fmt_psnr(r['psnr_eager'])} | {fmt_psnr(r['psnr_compiled'])} |"
            )
    notes = [
        "",
        f"Text encoders are tiny random CLIP/T5 with real output shapes (T5 {max_len} × "
        f"{flux_configs(args.tiny)['t5_dim']}, pooled {flux_configs(args.tiny)['clip_hidden']}): "
        "text encoding is not measured (it is inside 'image s' but negligible).",
        f"diffusers {diffusers.__version__}, torch {torch.__version__}; warm-up {args.warmup} image(s), "
        f"{args.repeats} timed images per row; step ratio = diffusers-eager step / this row's step (>1 = faster).",
        f"'ditserve on compiled' = FluxRunner on the transformer after compile_repeated_blocks (what the "
        f"engine's --compile does); '+ epilogues' = --fused-epilogues, '+ fp8' = --quantization fp8, "
        f"'+ graphs' = --cuda-graphs, applied "
        f"in place to the same transformer after the rows above; 'ditserve Engine, FLAGS' = the whole in-process "
        f"Engine with those flags (its own regional compile), step = its forward calls. Pipeline build {build_s:.1f}s, whole run "
        f"{time.perf_counter() - t_start:.0f}s.",
    ]
    if skips.reasons:
        notes.append("Skipped: " + "; ".join(skips.reasons))
    rows = [
        {"size": s, "impl": i, **{k: v for k, v in r.items() if k != "image"}}
        for (s, i), r in results.items()
    ]
    meta = dict(commit=sha, device=dev, dtype=args.dtype, steps=args.steps, tiny=args.tiny,
                skipped=skips.reasons, argv=sys.argv, build_s=build_s)  # fmt: skip
    write_report(args.out, "engine_vs_diffusers", "\n".join(lines + notes), meta, rows)
    timer.remove()


if __name__ == "__main__":
    main()
