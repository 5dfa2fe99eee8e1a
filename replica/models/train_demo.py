"""Train ``demo-scenes``: a tiny Flux-architecture pipeline that draws the scene its caption names.

Steps, all seeded:
1. draw a pool of training scenes with Pillow (every training caption equally often, so every colour is
   drawn as often as shape and as background; random size and position; held-out captions never drawn);
2. train a 1.25 M-parameter AutoencoderKL (8×, 4 latent channels) on them, then measure the latent
   shift/scale and write them into its config, as real Flux VAEs carry them; then sharpen its decoder
   alone (encoder frozen, so the latent space stays) on noisy latents with L1 + MSE: a decoder trained
   only on clean latents with MSE draws sampled latents as blobs with rounded corners, and squares and
   triangles then read as circles;
3. encode every caption once with the frozen random-weight CLIP and T5 (random features still tell the
   396 captions apart), at T5 lengths 32 and 512 (the FluxPipeline default), plus the empty prompt;
4. train a 2.3 M-parameter FluxTransformer2DModel with flow matching on packed latents, exactly as
   FluxPipeline samples: timestep = sigma, x_t = (1 - sigma)·x0 + sigma·noise, target noise - x0, sigma
   logit-normal around the scheduler's ``mu`` for 64×64 (so training and the sampling schedule agree), and
   10 % empty captions so true CFG (``true_cfg_scale`` + ``negative_prompt=""``) works;
5. save in diffusers format (fp16 weights), reload in fp32 and score held-out prompts; write a model card.

Run: ``python -m ditserve.replica.models.train_demo --out DIR`` (minutes on one GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shlex
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .demo import _tiny_clip, _tiny_t5
from .scenes import IMAGE_SIZE, Scene, all_scenes, draw_batch, held_out_scenes, train_scenes
from .scorer import classify_shape, score_scene
from .tokenizers import (
    build_clip_tokenizer,
    build_t5_tokenizer,
    name_tokenizers_generic,
    prompts_card_section,
    with_caption_normalizer,
)

T5_MAX_LENGTH = 32
# T5 lengths trained on: 32 (the tokenizer's model_max_length, the one to sample with) and 512 (FluxPipeline's
# default), so the model answers either way. Longer text costs compute, so it gets a smaller share of steps.
LONG_T5_LENGTH = 512
# FluxPipeline arguments that work for demo-scenes (64×64), as the model card measures them.
SAMPLING = {
    "num_inference_steps": 20,
    "true_cfg_scale": 3.0,
    "negative_prompt": "",
    "max_sequence_length": 32,
}


def build_scenes_pipeline_untrained(seed: int = 0):
    """The ``demo-scenes`` FluxPipeline with random weights: 2 double + 4 single blocks (8 heads × 16),
    an AutoencoderKL with 4 down blocks (32/64/64/64), tiny CLIP and T5 text encoders.

    Every weight is rounded to fp16 precision, so the fp16 files that ship hold exactly the frozen text
    encoders the transformer was trained against.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels × a 2×2 packed patch
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=16,
        num_attention_heads=8,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=False,  # true CFG at sampling instead of a distilled guidance input
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=IMAGE_SIZE,
        scaling_factor=1.0,  # measured after VAE training
        shift_factor=0.0,
    )
    # Prompts are rewritten into the caption they name (any order, other words dropped): tokenizers.py.
    tokenizer = with_caption_normalizer(build_clip_tokenizer())
    tokenizer_2 = with_caption_normalizer(build_t5_tokenizer(model_max_length=T5_MAX_LENGTH))
    # Dynamic shifting anchored at 64×64 (16 packed tokens): mu = base_shift there, as at Flux's 256.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=(IMAGE_SIZE // 16) ** 2,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=_tiny_clip(tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=_tiny_t5(tokenizer_2),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        _round_to_fp16(module)
    return pipe


def load_weights(pipe, folder: Path, names: tuple[str, ...]) -> None:
    """Continue from an earlier run: copy the weights (and, for the VAE, the latent statistics) of the
    components ``names`` from a saved pipeline folder of the same architecture."""
    from safetensors.torch import load_file

    for name in names:
        module = getattr(pipe, name)
        (weights,) = sorted((Path(folder) / name).glob("*.safetensors"))
        state = load_file(str(weights))
        module.load_state_dict({k: v.float() for k, v in state.items()})
        if name == "vae":
            config = json.loads((Path(folder) / name / "config.json").read_text())
            keep = ("shift_factor", "scaling_factor", "latents_mean", "latents_std")
            module.register_to_config(**{k: config[k] for k in keep if k in config})


def _update(opt: torch.optim.Optimizer, loss: torch.Tensor, params) -> None:
    """One optimizer step on ``loss``, gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def _round_to_fp16(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.half().float())


def sampling_mu(pipe, image_size: int = IMAGE_SIZE) -> float:
    """The ``mu`` FluxPipeline passes to the scheduler for an image of this size."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    cfg = pipe.scheduler.config
    seq_len = (image_size // 16) ** 2
    return calculate_shift(
        seq_len, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift
    )


def fit_steps(total: int, done: int, elapsed: float, budget: float, log, what: str) -> int:
    """``total`` steps, or fewer once 100 steps in if their pace would overrun ``budget`` seconds (0: none).
    The cut is logged and the model card reports the steps run."""
    if budget <= 0 or done != 100 or done >= total:
        return total
    fitted = max(done + 1, int(budget * done / elapsed))
    if fitted < total:
        log(
            f"{what}: {total} steps would take {total * elapsed / done:.0f} s; cut to {fitted} to fit {budget:.0f} s"
        )
        return fitted
    return total


def _cosine_lr(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class _Log:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f}s] {msg}", flush=True)


def _draw_pool(num_images: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 (N, 3, H, W), scene index into ``all_scenes()`` (N,)), training scenes cycled evenly."""
    index = {s: i for i, s in enumerate(all_scenes())}
    train = train_scenes()
    scenes = [train[i % len(train)] for i in range(num_images)]
    images = draw_batch(scenes, random.Random(seed))
    return (
        torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(),
        torch.tensor([index[s] for s in scenes]),
    )


def _to_unit(images: torch.Tensor) -> torch.Tensor:
    return images.float() / 127.5 - 1.0


def train_vae(vae, images: torch.Tensor, args, log: _Log) -> None:
    """MSE plus a tiny KL term, AdamW with a cosine schedule."""
    gen = torch.Generator(device=images.device).manual_seed(args.seed + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    vae.train()
    total, start, step = args.vae_steps, time.perf_counter(), 0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = args.vae_lr * _cosine_lr(step, total, warmup=50)
        idx = torch.randint(len(images), (args.vae_batch_size,), device=images.device, generator=gen)
        x = _to_unit(images[idx])
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, device=x.device, generator=gen)
        recon = vae.decode(z).sample
        mse = F.mse_loss(recon, x)
        loss = mse + 1e-6 * posterior.kl().mean()
        _update(opt, loss, vae.parameters())
        if step % 250 == 0 or step == total - 1:
            log(f"vae step {step}/{total} mse {mse.item():.5f}")
        step += 1
        total = fit_steps(total, step, time.perf_counter() - start, args.vae_time_budget_s, log, "vae")
    args.vae_steps = total
    vae.eval()
    _round_to_fp16(vae)


def train_decoder(vae, images: torch.Tensor, args, log: _Log) -> None:
    """Sharpen the decoder with the encoder frozen, so the latent space (and a transformer trained on it)
    stays valid. The decoder sees the posterior mean plus noise of up to ``--decoder-noise`` (in the
    transformer's normalised units) and must draw the clean scene: sampled latents are never exact, and a
    decoder that only ever saw clean latents draws their small errors as blobs, spots and rounded corners.
    L1 plus MSE: MSE alone rounds a square's corners, which is what tells it from a circle."""
    gen = torch.Generator(device=images.device).manual_seed(args.seed + 4)
    params = [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]
    opt = torch.optim.AdamW(params, lr=args.decoder_lr, weight_decay=0.0)
    vae.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    vae.train()
    noise_scale = args.decoder_noise / vae.config.scaling_factor
    total, start, step = args.decoder_steps, time.perf_counter(), 0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = args.decoder_lr * _cosine_lr(step, total, warmup=50)
        idx = torch.randint(len(images), (args.vae_batch_size,), device=images.device, generator=gen)
        x = _to_unit(images[idx])
        with torch.no_grad():
            z = vae.encode(x).latent_dist.mean
            level = torch.rand(len(z), 1, 1, 1, device=z.device, generator=gen) * noise_scale
            z = z + level * torch.randn(z.shape, device=z.device, generator=gen)
        recon = vae.decode(z).sample
        l1 = F.l1_loss(recon, x)
        loss = l1 + F.mse_loss(recon, x)
        _update(opt, loss, params)
        if step % 250 == 0 or step == total - 1:
            log(f"decoder step {step}/{total} l1 {l1.item():.5f}")
        step += 1
        total = fit_steps(total, step, time.perf_counter() - start, args.vae_time_budget_s, log, "decoder")
    args.decoder_steps = total
    vae.eval()
    _round_to_fp16(vae)


@torch.no_grad()
def vae_report(vae, num: int = 192, seed: int = 7) -> tuple[int, int, str]:
    """How many VAE reconstructions of fresh held-out scenes the scorer reads right (colours; shape): the
    ceiling of what the transformer's samples can score."""
    scenes = [held_out_scenes()[i % len(held_out_scenes())] for i in range(num)]
    images = draw_batch(scenes, random.Random(seed))
    device = next(vae.parameters()).device
    x = _to_unit(torch.from_numpy(images).permute(0, 3, 1, 2).to(device))
    recon = vae.decode(vae.encode(x).latent_dist.mean).sample
    pixels = ((recon.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    colours = sum(score_scene(p) == (s.background, s.colour) for s, p in zip(scenes, pixels, strict=True))
    shapes = sum(classify_shape(p) == s.shape for s, p in zip(scenes, pixels, strict=True))
    return (
        colours,
        shapes,
        f"VAE reconstructions of {num} held-out scenes: colours {colours}/{num}, shape {shapes}/{num}",
    )


@torch.no_grad()
def encode_pool(vae, images: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every pool image, (N, 4, h, w) each."""
    means, stds = [], []
    for i in range(0, len(images), chunk):
        posterior = vae.encode(_to_unit(images[i : i + chunk])).latent_dist
        means.append(posterior.mean)
        stds.append(posterior.std)
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def encode_captions(pipe, captions: list[str], max_sequence_length: int, device) -> tuple[torch.Tensor, ...]:
    """(T5 embeddings (N, L, 32), CLIP pooled (N, 32)) for each caption."""
    embeds, pooled, _ = pipe.encode_prompt(
        prompt=captions, prompt_2=None, device=device, max_sequence_length=max_sequence_length
    )
    return embeds.float(), pooled.float()


def train_transformer(pipe, means, stds, scene_idx, args, log: _Log) -> list[float]:
    """Flow matching on packed, scaled latents; returns the loss every 100 steps."""
    device = means.device
    transformer = pipe.transformer
    vae_cfg = pipe.vae.config
    num_scenes = len(all_scenes())
    captions = [s.caption for s in all_scenes()] + [""]  # index num_scenes = the empty prompt
    texts = {
        length: encode_captions(pipe, captions, length, device) for length in (T5_MAX_LENGTH, LONG_T5_LENGTH)
    }
    _, c, h, w = means.shape
    img_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, device, torch.float32)
    mu = sampling_mu(pipe)
    log(f"transformer: {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f} M params, mu {mu:.3f}")

    gen = torch.Generator(device=device).manual_seed(args.seed + 2)
    step_rng = random.Random(args.seed + 3)
    opt = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=0.01)
    transformer.train()
    losses, running, since = [], 0.0, 0
    total, start, step = args.steps, time.perf_counter(), 0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = args.lr * _cosine_lr(step, total, warmup=min(200, total // 10 + 1))
        length = LONG_T5_LENGTH if step_rng.random() < args.long_text_fraction else T5_MAX_LENGTH
        # Long-text steps cost ~30× the tokens: a quarter of the batch keeps them from dominating the time.
        b = args.batch_size if length == T5_MAX_LENGTH else max(1, args.batch_size // 4)
        idx = torch.randint(len(means), (b,), device=device, generator=gen)
        z = means[idx] + stds[idx] * torch.randn((b, c, h, w), device=device, generator=gen)
        x0 = pipe._pack_latents((z - vae_cfg.shift_factor) * vae_cfg.scaling_factor, b, c, h, w)

        cond = scene_idx[idx]
        drop = torch.rand(b, device=device, generator=gen) < args.caption_dropout
        cond = torch.where(drop, torch.full_like(cond, num_scenes), cond)
        embeds, pooled = texts[length]

        # Logit-normal sigmas centred on the sampling schedule's shift: logit(sigma) ~ N(mu, 1).
        sigma = torch.sigmoid(torch.randn(b, device=device, generator=gen) + mu)
        noise = torch.randn(x0.shape, device=device, generator=gen)
        s = sigma[:, None, None]
        x_t = (1.0 - s) * x0 + s * noise
        pred = transformer(
            hidden_states=x_t,
            timestep=sigma,  # FluxPipeline passes scheduler timesteps / 1000, i.e. sigma
            guidance=None,
            pooled_projections=pooled[cond],
            encoder_hidden_states=embeds[cond],
            txt_ids=torch.zeros(length, 3, device=device),
            img_ids=img_ids,
            return_dict=False,
        )[0]
        loss = F.mse_loss(pred, noise - x0)
        _update(opt, loss, transformer.parameters())
        running += loss.detach()  # no .item() per step: it would sync the GPU every step
        since += 1
        if step % 100 == 99 or step == total - 1:
            losses.append(round((running / since).item(), 4))
            running, since = 0.0, 0
        if step % 500 == 0 or step == total - 1:
            log(f"transformer step {step}/{total} loss {loss.item():.4f} (T5 length {length})")
        step += 1
        total = fit_steps(total, step, time.perf_counter() - start, args.time_budget_s, log, "transformer")
    args.steps = total
    transformer.eval()
    _round_to_fp16(transformer)
    return losses


@torch.no_grad()
def generate_scenes(
    pipe,
    scenes: list[Scene],
    *,
    seed: int = 0,
    num_inference_steps: int = SAMPLING["num_inference_steps"],
    true_cfg_scale: float = SAMPLING["true_cfg_scale"],
    max_sequence_length: int = SAMPLING["max_sequence_length"],
    batch_size: int = 64,
):
    """One image per scene (seed + i for the i-th, CPU generators so CPU and GPU draw the same noise)."""
    images = []
    for start in range(0, len(scenes), batch_size):
        chunk = scenes[start : start + batch_size]
        out = pipe(
            prompt=[s.caption for s in chunk],
            negative_prompt=[""] * len(chunk),
            true_cfg_scale=true_cfg_scale,
            num_inference_steps=num_inference_steps,
            height=IMAGE_SIZE,
            width=IMAGE_SIZE,
            max_sequence_length=max_sequence_length,
            generator=[torch.Generator().manual_seed(seed + start + i) for i in range(len(chunk))],
        )
        images += out.images
    return images


def evaluate(pipe, scenes: list[Scene], *, seeds: int, **sampling) -> dict:
    """Fractions of images whose background colour, shape colour (both) and shape the scorer confirms."""
    counts = {"background": 0, "shape_colour": 0, "both_colours": 0, "shape": 0}
    total = 0
    for k in range(seeds):
        for scene, image in zip(
            scenes, generate_scenes(pipe, scenes, seed=1000 * k, **sampling), strict=True
        ):
            background, colour = score_scene(image)
            counts["background"] += background == scene.background
            counts["shape_colour"] += colour == scene.colour
            counts["both_colours"] += (background, colour) == (scene.background, scene.colour)
            counts["shape"] += classify_shape(image) == scene.shape
            total += 1
    return {"images": total, **{k: f"{v}/{total}" for k, v in counts.items()}}


# (name, sampling overrides) scored after training; the first two are the settings the card recommends.
EVAL_SETTINGS: tuple[tuple[str, dict], ...] = (
    ("20 steps, true CFG 3, T5 length 32", {}),
    ("20 steps, true CFG 3, T5 length 512", {"max_sequence_length": 512}),
    ("20 steps, no CFG, T5 length 32", {"true_cfg_scale": 1.0}),
    ("20 steps, true CFG 5, T5 length 32", {"true_cfg_scale": 5.0}),
    ("8 steps, true CFG 3, T5 length 32", {"num_inference_steps": 8}),
)


def evaluate_settings(pipe, args: argparse.Namespace, log: _Log) -> dict[str, dict]:
    """Held-out accuracy for each of ``EVAL_SETTINGS`` and, for comparison, on training captions."""
    scenes = held_out_scenes()[: args.eval_scenes]
    settings = EVAL_SETTINGS if args.device == "cuda" else EVAL_SETTINGS[:2]  # CPU smoke runs stay short
    results = {}
    for name, overrides in settings:
        results[f"held-out, {name}"] = evaluate(pipe, scenes, seeds=args.eval_seeds, **overrides)
        log(f"held-out, {name}: {json.dumps(results[f'held-out, {name}'])}")
    train = train_scenes()
    sample = train[:: max(1, len(train) // len(scenes))][: len(scenes)]
    name = f"training captions, {EVAL_SETTINGS[0][0]}"
    results[name] = evaluate(pipe, sample, seeds=1)
    log(f"{name}: {json.dumps(results[name])}")
    return results


def _command(args: argparse.Namespace) -> str:
    """The ``ditserve train-demo`` command line with every option spelled out."""
    parts = ["ditserve", "train-demo"]
    for key, value in vars(args).items():
        if key in _OPTIONS and value is not None:
            parts += [f"--{key.replace('_', '-')}", str(value)]
    return shlex.join(parts)


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1× {torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}"


def _model_card(args, command: str, seconds: float, machine: str, results: dict, losses: list[float]) -> str:
    import diffusers

    held = ", ".join(f'"{s.caption}"' for s in held_out_scenes())
    rows = "\n".join(
        f"| {name} | {r['images']} | {r['both_colours']} | {r['background']} | {r['shape_colour']} | {r['shape']} |"
        for name, r in results.items()
    )
    return f"""# demo-scenes

A tiny Flux-architecture pipeline (FluxTransformer2DModel with 2 double + 4 single blocks, 8 heads × 16,
2.3 M parameters; AutoencoderKL 1.25 M; random-weight frozen tiny CLIP and T5) trained on synthetic 64×64
scenes: one circle, square or triangle in one of 12 colours on a background of another
("a red circle on a blue background"). It exists so that ditserve's default model draws what it is asked.
Weights are stored in fp16; load in fp32: `FluxPipeline.from_pretrained(path, torch_dtype=torch.float32)`.

## Sampling that works
64×64, `num_inference_steps={SAMPLING["num_inference_steps"]}`, `true_cfg_scale={SAMPLING["true_cfg_scale"]}` with
`negative_prompt=""`, `max_sequence_length={SAMPLING["max_sequence_length"]}` (FluxPipeline's default 512 was
trained too). No guidance embedding (`guidance_embeds=False`), so `guidance_scale` is ignored.

{prompts_card_section()}
## Training
- command: `{command}`
- machine: {machine}; diffusers {diffusers.__version__}
- wall time: {seconds:.0f} s (drawing, VAE, transformer, evaluation)
- VAE {args.vae_steps} steps × {args.vae_batch_size}, then its decoder alone {args.decoder_steps} steps
  (L1 + MSE, latents noised up to {args.decoder_noise} in normalised units, AdamW {args.decoder_lr}); transformer {args.steps} steps × {args.batch_size},
  AdamW {args.lr} cosine, {args.caption_dropout:.0%} empty captions, T5 length 512 on
  {args.long_text_fraction:.0%} of steps (with a quarter of the batch); pool of {args.pool_size} drawn images;
  seed {args.seed}
- loss every 100 steps: {losses}{_earlier_run(args.init_from)}

## Held-out accuracy
Scored by `ditserve.replica.models.scorer` (palette colour of the border; majority palette colour of the
pixels that differ from it; shape: the ideal circle, square or triangle that best overlaps those pixels in
their bounding box), {args.eval_seeds} seed(s)
per prompt, on held-out captions never drawn in training (last row: training captions, one seed). Images are
64×64, fp16 weights loaded in fp32, negative prompt "", CPU generators seeded 0, 1, … (and 1000, 1001, …).

| setting | images | both colours | background | shape colour | shape |
|---|---|---|---|---|---|
{rows or "| not evaluated (--eval-scenes 0) | | | | | |"}

Held-out captions: {held}.
"""


def _earlier_run(folder: Path | None) -> str:
    """The model card's note on the run that ``--init-from`` continued (its card's training lines)."""
    card = Path(folder) / "README.md" if folder else None
    if card is None or not card.is_file():
        return ""
    text = card.read_text()
    lines = text[text.find("## Training") :].split("\n## ")[0].splitlines()[1:]
    return "\n- continued from an earlier run of this command:\n" + "\n".join(
        "  " + line for line in lines if line
    )


_OPTIONS = (
    "out init_from steps vae_steps decoder_steps batch_size vae_batch_size lr vae_lr decoder_lr decoder_noise "
    "pool_size caption_dropout "
    "long_text_fraction device seed eval_scenes eval_seeds"
).split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--out", type=Path, required=True, help="folder to write the diffusers pipeline to")
    parser.add_argument("--steps", type=int, default=4000, help="transformer training steps")
    parser.add_argument("--vae-steps", type=int, default=1500, help="VAE training steps")
    parser.add_argument("--batch-size", type=int, default=512, help="transformer batch size")
    parser.add_argument("--vae-batch-size", type=int, default=128, help="VAE batch size")
    parser.add_argument("--lr", type=float, default=4e-4, help="transformer peak learning rate")
    parser.add_argument("--vae-lr", type=float, default=1e-3, help="VAE peak learning rate")
    parser.add_argument(
        "--decoder-steps",
        type=int,
        default=1000,
        help="steps sharpening the VAE decoder on noisy latents, encoder frozen (after the VAE's steps)",
    )
    parser.add_argument("--decoder-lr", type=float, default=1e-4, help="decoder peak learning rate")
    parser.add_argument(
        "--decoder-noise",
        type=float,
        default=0.3,
        help="largest latent noise the decoder is trained to ignore, in the transformer's normalised units",
    )
    parser.add_argument("--pool-size", type=int, default=49152, help="number of training images drawn")
    parser.add_argument(
        "--caption-dropout", type=float, default=0.1, help="share of empty captions (for CFG)"
    )
    parser.add_argument(
        "--long-text-fraction",
        type=float,
        default=0.25,
        help="share of steps with T5 length 512 instead of 32",
    )
    parser.add_argument(
        "--time-budget-s", type=float, default=0, help="cut the transformer's steps to fit (0: no limit)"
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue from the VAE and transformer of a pipeline folder this command wrote (with "
        "--vae-steps 0 its VAE and latent statistics are kept)",
    )
    parser.add_argument("--vae-time-budget-s", type=float, default=0, help="the same for the VAE's steps")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=default_device,
        help=f"default: {default_device} on this machine",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the data, the initial weights and training (default 0)"
    )
    parser.add_argument(
        "--eval-scenes", type=int, default=len(held_out_scenes()), help="held-out prompts scored (0: none)"
    )
    parser.add_argument("--eval-seeds", type=int, default=2, help="images per held-out prompt")


def run(args: argparse.Namespace) -> Path:
    """Train, save to ``args.out`` (diffusers format, fp16), evaluate held-out prompts, write README.md."""
    from diffusers import FluxPipeline

    log = _Log()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; pass --device cpu")
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    random.seed(args.seed)
    np.random.seed(args.seed)

    pipe = build_scenes_pipeline_untrained(args.seed).to(device)
    for module in (pipe.text_encoder, pipe.text_encoder_2):
        module.requires_grad_(False)
    images, scene_idx = _draw_pool(args.pool_size, args.seed)
    images, scene_idx = images.to(device), scene_idx.to(device)
    log(f"drew {len(images)} images of {len(train_scenes())} training scenes on {device}")

    if args.init_from:
        load_weights(pipe, args.init_from, ("vae", "transformer"))
        log(f"started from the VAE and transformer of {args.init_from}")
    if args.vae_steps > 0:
        train_vae(pipe.vae, images, args, log)
    means, stds = encode_pool(pipe.vae, images)
    if args.vae_steps > 0 or not args.init_from:
        sample = means + stds * torch.randn(
            means.shape, device=device, generator=torch.Generator(device).manual_seed(0)
        )
        shift, scale = sample.mean().item(), 1.0 / sample.std().item()
        pipe.vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    log(
        f"vae latents: shift_factor {pipe.vae.config.shift_factor}, scaling_factor {pipe.vae.config.scaling_factor}"
    )
    before = vae_report(pipe.vae)
    log(before[2])
    if args.decoder_steps > 0:
        kept = {k: v.clone() for k, v in pipe.vae.state_dict().items()}
        train_decoder(pipe.vae, images, args, log)
        after = vae_report(pipe.vae)
        log(after[2])
        if after[:2] < before[:2]:  # colours first, then shapes: never ship a decoder that reads worse
            pipe.vae.load_state_dict(kept)
            args.decoder_steps = 0
            log("decoder: reconstructions read worse than before; kept the decoder it started from")
    del images

    pipe.vae.requires_grad_(False)
    losses = train_transformer(pipe, means, stds, scene_idx, args, log)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pipe.to(torch.float16).save_pretrained(out)
    name_tokenizers_generic(out)
    # The serving settings ditserve reads beside the weights: the sampling the model card measures (64×64, the
    # size trained on, which a folder's requests get without a size) and, on --init-from, the step cache.
    # (ditserve chooses the T5 length itself: max_sequence_length is the pipeline's, not a serving setting.)
    sampling = {k: v for k, v in SAMPLING.items() if k != "max_sequence_length"}
    sampling |= {"width": IMAGE_SIZE, "height": IMAGE_SIZE}
    recommended = {"sampling": sampling}
    if args.init_from and (Path(args.init_from) / "ditserve.json").is_file():
        earlier = json.loads((Path(args.init_from) / "ditserve.json").read_text())
        recommended = {**earlier, "sampling": {**sampling, **earlier.get("sampling", {})}}
    (out / "ditserve.json").write_text(json.dumps(recommended, indent=2) + "\n")
    log(f"saved {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 1e6:.1f} MB)")

    results: dict[str, dict] = {}
    if args.eval_scenes > 0:
        # Score what was saved: fp16 files loaded in fp32, as users load them.
        pipe = FluxPipeline.from_pretrained(out, dtype=torch.float32).to(device)
        pipe.set_progress_bar_config(disable=True)
        results = evaluate_settings(pipe, args, log)
    command = _command(args)
    seconds = time.perf_counter() - log.start
    (out / "README.md").write_text(_model_card(args, command, seconds, _machine(device), results, losses))
    log(f"done in {seconds:.0f} s")
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m ditserve.replica.models.train_demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
