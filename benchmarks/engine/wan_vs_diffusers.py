"""ditserve's Wan runner against stock diffusers WanPipeline on one GPU: same weights, inputs and run.

    GIT_COMMIT=$(git rev-parse --short HEAD) python benchmarks/engine/wan_vs_diffusers.py --budget-s 420 --out DIR
    python benchmarks/engine/wan_vs_diffusers.py --tiny --device cpu --out /tmp/wvd      # CPU smoke run

The model is Wan2.1-T2V-1.3B-sized (30 blocks, 12 heads × 128 = dim 1536, ffn 8960, text dim 4096, freq dim
256, patch (1, 2, 2), RMS q/k norm across heads, cross-attention norm) with random weights built directly
on the device in ``--dtype``; the modules diffusers keeps in fp32 when it loads Wan in bf16
(``_keep_in_fp32_modules``: time embedder, modulation tables, norms) are fp32 here too, as after
``from_pretrained``. The VAE is ``AutoencoderKLWan`` with the Wan2.1 config (base dim 96, z 16, dim_mult
1/2/4/4, 2 res blocks, 4× temporal / 8× spatial, Wan2.1 latent mean/std), in ``--vae-dtype`` (default: the
engine's dtype, as ``from_pretrained(dtype=...)`` loads it). The scheduler is Wan2.1's
``UniPCMultistepScheduler`` config (flow prediction, flow sigmas, flow_shift 3.0 for 480p). The text encoder
is a tiny random UMT5 whose output has the real shape (512 × 4096): text encoding is NOT what is measured
(it is inside "video s" but costs next to nothing). Nothing is downloaded or written to disk except the
result files.

Rows, in this order: diffusers WanPipeline eager; ditserve WanRunner prepare/step/decode on the same pipe
(eager, the engine's default); a scheduler check with both pipelines on FlowMatchEulerDiscreteScheduler
(shift = flow_shift): WanRunner steps every request with its own instance of the pipe's scheduler class and
config, so it must match diffusers with either scheduler (1 timed video each, no extra warm-up: the shapes
are warm); then
``pipe.transformer.compile_repeated_blocks(fullgraph=True)``, diffusers compiled and our runner on the
compiled transformer (what the engine's ``compile`` flag does); last, our runner with the block linears as
FP8 GEMMs (``--quantization fp8``, recompiled; ``--no-fp8`` skips it). Guidance 5.0 with a negative prompt: two transformer forwards per step (cond and
uncond), as WanPipeline does. Forward = CUDA events around every transformer forward (hooks on the model),
median over the timed videos' forwards; video = wall time of one whole video (text encode + steps + VAE
decode), median over the timed videos; VAE decode = wall time of ``vae.decode`` (synchronised), median.
Warm-up videos are excluded; for the compiled diffusers row the first video's extra time over the steady
video is reported as compile time. Peak = ``torch.cuda.max_memory_allocated`` over the timed videos.
PSNR on the uint8 frames. Prints a markdown table and writes DIR/wan_vs_diffusers.md and .json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_vs_diffusers import (  # noqa: E402
    NEGATIVE,
    PROMPT,
    SEED,
    WEIGHT_SEED,
    ForwardTimer,
    Skips,
    commit,
    device_name,
    fmt_psnr,
    measure,
    psnr,
    sync,
    write_report,
)

GUIDANCE = 5.0

# Wan2.1 VAE (Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json).
WAN21_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
WAN21_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]  # fmt: skip

# Wan2.1 scheduler (scheduler/scheduler_config.json); flow_shift 3.0 is the 480p value (5.0 for 720p).
WAN21_SCHEDULER = dict(
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", solver_order=2,
    prediction_type="flow_prediction", thresholding=False, dynamic_thresholding_ratio=0.995,
    sample_max_value=1.0, predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[],
    solver_p=None, use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
    use_flow_sigmas=True, flow_shift=3.0, timestep_spacing="linspace", steps_offset=0,
    final_sigmas_type="zero", rescale_betas_zero_snr=False,
)  # fmt: skip


# ---- model ---------------------------------------------------------------------------------------------
def wan_configs(tiny: bool) -> dict:
    """Component configs: Wan2.1-T2V-1.3B sizes, or a tiny stand-in for the CPU smoke run."""
    vae = dict(
        base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
        temperal_downsample=[False, True, True], latents_mean=WAN21_LATENTS_MEAN, latents_std=WAN21_LATENTS_STD,
    )  # fmt: skip
    if tiny:
        return dict(
            transformer=dict(
                patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16,
                out_channels=16, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64,
            ),
            vae={**vae, "base_dim": 8, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1},
            t5_dim=32, max_sequence_length=32, width=64, height=64, frames=5,
        )  # fmt: skip
    return dict(
        transformer=dict(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
            out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        ),
        vae=vae,
        t5_dim=4096, max_sequence_length=512, width=832, height=480, frames=33,
    )  # fmt: skip


def keep_in_fp32(model: torch.nn.Module) -> int:
    """Cast the parameters ``from_pretrained`` keeps in fp32 (``_keep_in_fp32_modules``); returns how many."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    n = 0
    for name, p in model.named_parameters():
        if any(m in name.split(".") for m in keep) and p.dtype != torch.float32:
            p.data = p.data.float()
            n += 1
    return n


def build_wan_pipe(
    *, tiny: bool, device: torch.device, dtype: torch.dtype, vae_dtype: torch.dtype, seed: int = WEIGHT_SEED
):
    """A WanPipeline with random weights, built on ``device`` (same seed → same weights)."""
    import diffusers
    import transformers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from ditserve.replica.models.tokenizers import build_t5_tokenizer

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()  # prompt truncation, scheduler config key warnings
    transformers.utils.logging.set_verbosity_error()
    cfg = wan_configs(tiny)
    tokenizer = build_t5_tokenizer(model_max_length=cfg["max_sequence_length"])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    try:
        with torch.device(device):
            torch.set_default_dtype(dtype)  # parameters are created in dtype: no fp32 copy, no CPU init
            transformer = WanTransformer3DModel(**cfg["transformer"])
            text_encoder = UMT5EncoderModel(
                UMT5Config(
                    vocab_size=len(tokenizer), d_model=cfg["t5_dim"], d_kv=16, d_ff=64, num_layers=1,
                    num_heads=2, relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                )
            )  # fmt: skip
            torch.set_default_dtype(vae_dtype)
            vae = AutoencoderKLWan(**cfg["vae"])
    finally:
        torch.set_default_dtype(previous)
    kept = keep_in_fp32(transformer) if dtype != torch.float32 else 0
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder.eval(),
        vae=vae.eval(),
        scheduler=UniPCMultistepScheduler(**WAN21_SCHEDULER),
        transformer=transformer.eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    for module, want in ((transformer, dtype), (vae, vae_dtype), (text_encoder, dtype)):
        bad = [
            n
            for n, p in module.named_parameters()
            if p.device.type != device.type or p.dtype not in (want, torch.float32)
        ]
        assert not bad, f"{type(module).__name__}: {bad[:3]} not {want} on {device}"
    return pipe, kept


def make_runner(pipe, *, device: torch.device, dtype: torch.dtype, max_sequence_length: int, mesh=None):
    """WanRunner with the arguments ``replica.worker.build_runner`` passes."""
    from ditserve.replica.pipelines.wan import WanRunner

    return WanRunner(pipe, device=device, dtype=dtype, max_sequence_length=max_sequence_length, mesh=mesh)


def euler_scheduler(pipe):
    """FlowMatchEulerDiscreteScheduler with the pipe's flow shift: a second scheduler class for both sides."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.get("flow_shift", 3.0))


class DecodeTimer:
    """Wall time of every ``vae.decode`` call (synchronised before and after)."""

    def __init__(self, vae):
        self.vae = vae
        self.original = vae.decode
        self.seconds: list[float] = []
        vae.decode = self._decode  # instance attribute: both pipelines look decode up on the object

    def _decode(self, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = self.original(*args, **kwargs)
        sync()
        self.seconds.append(time.perf_counter() - t0)
        return out

    def take(self) -> list[float]:
        out, self.seconds = self.seconds, []
        return out

    def remove(self) -> None:
        del self.vae.decode


# ---- the two ways to make one video ------------------------------------------------------------------
def diffusers_video(pipe, args, max_len: int) -> np.ndarray:
    from ditserve.replica.pipelines.base import to_uint8

    out = pipe(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        generator=torch.Generator("cpu").manual_seed(SEED),
        max_sequence_length=max_len,
        output_type="np",
    )
    return to_uint8(np.asarray(out.frames))[0]


FP8_IMPL = {False: "ditserve compiled + fp8", True: "ditserve eager + fp8"}  # by --no-compile


def runner_video(runner, args) -> np.ndarray:
    from ditserve.replica.request import GenerationParams

    params = GenerationParams(
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        width=args.width,
        height=args.height,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=SEED,
    )
    state = runner.add("bench", params)
    while not state.done:
        runner.step([state])
    return runner.decode(state)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run): 64×64, 5 frames")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vae-dtype", default=None, help="VAE dtype (default: --dtype, as the engine loads it)")
    ap.add_argument("--width", type=int, default=None, help="default 832 (tiny 64)")
    ap.add_argument("--height", type=int, default=None, help="default 480 (tiny 64)")
    ap.add_argument("--frames", type=int, default=None, help="default 33 (tiny 5)")
    ap.add_argument("--steps", type=int, default=None, help="default 30 (tiny 2)")
    ap.add_argument("--guidance", type=float, default=GUIDANCE)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-euler-check", action="store_true", help="skip the FlowMatchEuler scheduler rows")
    ap.add_argument(
        "--no-fp8", action="store_true", help="skip the last row: our runner with --quantization fp8"
    )
    ap.add_argument(
        "--budget-s", type=float, default=1e9, help="skip rows that would start after this many s"
    )
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
    vae_dtype = getattr(torch, args.vae_dtype or args.dtype)
    cfg = wan_configs(args.tiny)
    args.width = args.width or cfg["width"]
    args.height = args.height or cfg["height"]
    args.frames = args.frames or cfg["frames"]
    args.steps = args.steps or (2 if args.tiny else 30)
    max_len = cfg["max_sequence_length"]
    import diffusers

    t0 = time.perf_counter()
    pipe, kept = build_wan_pipe(tiny=args.tiny, device=device, dtype=dtype, vae_dtype=vae_dtype)
    sync()
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    print(
        f"built pipeline in {build_s:.1f}s: transformer {n_params / 1e9:.2f}B params, {dtype} "
        f"({kept} fp32 tensors kept as from_pretrained does), VAE {vae_dtype}, {device}",
        flush=True,
    )
    unipc = pipe.scheduler
    runner = make_runner(pipe, device=device, dtype=dtype, max_sequence_length=max_len)
    timer = ForwardTimer(pipe.transformer, device)
    decode = DecodeTimer(pipe.vae)

    results: dict[tuple[str, str], dict] = {}  # (scheduler, impl) → measurements
    skips = Skips(args.budget_s, t_start)

    def run(sched: str, impl: str, make_video, warmup: int, repeats: int) -> None:
        label = f"{impl} ({sched})"
        if skips.over_budget(label):
            return
        decode.take()
        try:
            r = measure(make_video, timer, device, warmup, repeats)
        except Exception as exc:  # e.g. a compile failure or OOM: keep the other rows
            timer.take()
            decode.take()
            skips.failed(label, exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return
        r["decode_s"] = statistics.median(decode.take()[-repeats:])
        r["video"] = r.pop("image")
        r["video_s"] = r.pop("image_s")
        r["first_video_s"] = r.pop("first_image_s")
        r["video_std"] = r.pop("image_std")
        results[(sched, impl)] = r
        print(
            f"{label}: forward {r['step_ms']:.2f} ms ({r['forwards']} timed), video {r['video_s']:.3f} s, "
            f"VAE decode {r['decode_s']:.3f} s, first {r['first_video_s'] or float('nan'):.2f} s, "
            f"peak {r['peak_gib']:.2f} GiB, std {r['video_std']:.1f}",
            flush=True,
        )

    def diffusers_fn():
        return diffusers_video(pipe, args, max_len)

    def runner_fn():
        return runner_video(runner, args)

    with torch.no_grad():
        run("unipc", "diffusers eager", diffusers_fn, args.warmup, args.repeats)
        run("unipc", "ditserve eager", runner_fn, args.warmup, args.repeats)
        if not args.no_euler_check:
            pipe.scheduler = euler_scheduler(pipe)
            try:
                run("euler", "diffusers eager", diffusers_fn, 0, 1)
                run("euler", "ditserve eager", runner_fn, 0, 1)
            finally:
                pipe.scheduler = unipc
        if not args.no_compile:
            # One static graph per shape, as a serving engine with fixed buckets would keep.
            torch._dynamo.config.automatic_dynamic_shapes = False
            try:
                pipe.transformer.compile_repeated_blocks(fullgraph=True)
            except Exception as exc:
                skips.failed("compile_repeated_blocks", exc)
            else:
                run("unipc", "diffusers compiled", diffusers_fn, max(args.warmup, 1), args.repeats)
                run("unipc", "ditserve on compiled", runner_fn, args.warmup, args.repeats)
        if not args.no_fp8:  # last: it converts the shared transformer in place
            from ditserve.replica.worker import apply_speed_switches

            apply_speed_switches(
                pipe.transformer, family="wan", device=device, dtype=dtype, quantization="fp8"
            )
            if not args.no_compile:
                torch._dynamo.reset()
                pipe.transformer.compile_repeated_blocks(fullgraph=True)
            run("unipc", FP8_IMPL[args.no_compile], runner_fn, max(args.warmup, 1), args.repeats)

    # ---- table ----------------------------------------------------------------------------------------
    sha = commit()
    dev = device_name(device)
    header = (
        "| commit | device | model | size | frames | steps | dtype | scheduler | implementation | transformer "
        "forward ms (median [min–max]) | forward vs diffusers eager | video s | video vs diffusers eager "
        "| VAE decode s | compile s | peak GiB | PSNR vs diffusers eager dB | PSNR vs diffusers compiled dB |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    model = "tiny Wan" if args.tiny else "Wan2.1-1.3B-size, random"
    order = [
        ("unipc", "diffusers eager"),
        ("unipc", "ditserve eager"),
        ("euler", "diffusers eager"),
        ("euler", "ditserve eager"),
        ("unipc", "diffusers compiled"),
        ("unipc", "ditserve on compiled"),
        ("unipc", FP8_IMPL[args.no_compile]),
    ]
    sched_name = {
        "unipc": f"UniPC flow_shift {unipc.config.flow_shift}",
        "euler": f"FlowMatchEuler shift {unipc.config.flow_shift}",
    }
    for sched, impl in order:
        r = results.get((sched, impl))
        if r is None:
            continue
        base = results.get((sched, "diffusers eager"))  # PSNR against the same scheduler
        comp = results.get((sched, "diffusers compiled"))
        speed = results.get(("unipc", "diffusers eager"))
        compile_s = "—"
        if impl == "diffusers compiled" and r["first_video_s"] is not None:
            compile_s = f"{r['first_video_s'] - r['video_s']:.1f}"
        r["psnr_eager"] = psnr(r["video"], base["video"]) if base else None
        r["psnr_compiled"] = psnr(r["video"], comp["video"]) if comp else None
        fwd_ratio = f"{speed['step_ms'] / r['step_ms']:.2f}×" if speed else "—"
        video_ratio = f"{speed['video_s'] / r['video_s']:.2f}×" if speed else "—"
        lines.append(
            f"| {sha} | {dev} | {model} | {args.width}×{args.height} | {args.frames} | {args.steps} | "
            f"{args.dtype} | {sched_name[sched]} | {impl} | "
            f"{r['step_ms']:.2f} [{r['step_ms_min']:.2f}–{r['step_ms_max']:.2f}] | {fwd_ratio} | "
            f"{r['video_s']:.3f} | {video_ratio} | {r['decode_s']:.3f} | {compile_s} | {r['peak_gib']:.2f} | "
            f"{fmt_psnr(r['psnr_eager'])} | {fmt_psnr(r['psnr_compiled'])} |"
        )
    notes = [
        "",
        f"Text encoder is a tiny random UMT5 with the real output shape ({max_len} × {cfg['t5_dim']}): text "
        "encoding is not measured (it is inside 'video s' but negligible). Guidance "
        f"{args.guidance} with a negative prompt: 2 transformer forwards per step.",
        f"diffusers {diffusers.__version__}, torch {torch.__version__}; transformer {args.dtype} ({kept} "
        f"fp32 tensors kept, as from_pretrained does), VAE {str(vae_dtype).removeprefix('torch.')}; warm-up "
        f"{args.warmup} video(s), {args.repeats} timed videos per row (scheduler-check rows: 0 and 1); "
        "ratios = diffusers-eager (UniPC) / this row (>1 = faster). PSNR columns compare against the "
        "diffusers row with the same scheduler.",
        "The FlowMatchEuler rows check that the runner follows the pipe's scheduler: WanRunner steps every "
        "request with its own instance of the pipe's scheduler class and config (UniPC, then FlowMatchEuler), "
        "set up as WanPipeline sets it, so both schedulers' rows should match diffusers.",
        "'ditserve on compiled' = WanRunner on the transformer after compile_repeated_blocks(fullgraph=True), "
        f"what the engine's --compile does; '+ fp8' = --quantization fp8 (block linears as FP8 GEMMs), applied "
        f"in place after the rows above. Pipeline build {build_s:.1f}s, whole run "
        f"{time.perf_counter() - t_start:.0f}s.",
    ]
    if skips.reasons:
        notes.append("Skipped: " + "; ".join(skips.reasons))
    rows = [
        {"scheduler": s, "impl": i, **{k: v for k, v in r.items() if k != "video"}}
        for (s, i), r in results.items()
    ]
    meta = dict(
        commit=sha, device=dev, dtype=args.dtype, vae_dtype=str(vae_dtype).removeprefix("torch."),
        width=args.width, height=args.height, frames=args.frames, steps=args.steps, guidance=args.guidance,
        tiny=args.tiny, skipped=skips.reasons, argv=sys.argv, build_s=build_s, transformer_params=n_params,
        diffusers=diffusers.__version__, torch=torch.__version__,
    )  # fmt: skip
    write_report(args.out, "wan_vs_diffusers", "\n".join(lines + notes), meta, rows)
    timer.remove()
    decode.remove()


if __name__ == "__main__":
    main()
