"""Wan 2.2 model folders built offline with random weights: A14B (two experts switching at
``boundary_ratio``) and TI2V-5B (per-token timesteps, the 48-channel 16× VAE).

``build_folder(path, variant=...)`` writes a tiny diffusers folder for tests; ``build_pipeline(size, dtype,
device)`` builds the pipeline in memory: "tiny" (the tests' sizes) or "real" (Wan 2.2 A14B's public
transformer config twice, random weights created on ``device``; a tiny text encoder of the matching
width), with ``REAL_SETTINGS`` for a 480p benchmark.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from ditserve.replica.models.tokenizers import build_t5_tokenizer

Variant = Literal["a14b", "ti2v"]

# Wan 2.2 T2V A14B (Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/config.json), both experts.
A14B_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
A14B_BOUNDARY = 0.875
# 480p, 33 frames, the model card's 40 steps and (high, low noise) guidance 4.0 / 3.0.
REAL_SETTINGS = dict(
    width=832, height=480, num_frames=33, num_inference_steps=40, guidance_scale=4.0, guidance_scale_2=3.0
)

TINY_TEXT_DIM = 32
TEXT_LENGTH = 16  # the tokenizer's model_max_length: short text sequences keep the tests fast


def tiny_text_encoder(tokenizer, d_model: int = TINY_TEXT_DIM):
    """A 1-2 layer UMT5 encoder with output width ``d_model`` (the transformer's text_dim)."""
    import transformers

    config = transformers.UMT5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=64,
        num_layers=2 if d_model <= 64 else 1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return transformers.UMT5EncoderModel(config).eval()


def tiny_transformer(seed: int, *, in_channels: int = 16, out_channels: int = 16, **extra):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=TINY_TEXT_DIM,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
        **extra,
    ).eval()


def tiny_vae_21():
    """Wan 2.1's VAE shape (z_dim 16, 4× temporal, 8× spatial), tiny."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(7)
    return AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    ).eval()


def tiny_vae_22():
    """Wan 2.2's VAE shape (z_dim 48, residual blocks, 2×2 patchified pixels: 16× spatial, 4× temporal)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(8)
    return AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.1 * (i % 7) - 0.3 for i in range(48)],
        latents_std=[1.0 + 0.05 * (i % 5) for i in range(48)],
    ).eval()


def scheduler(shift: float = 3.0):
    from diffusers import UniPCMultistepScheduler

    # Wan's own scheduler (UniPC, flow prediction, a flow shift) as the Wan 2.2 folders ship it.
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)


def build_tiny(variant: Variant = "a14b"):
    from diffusers import WanPipeline

    tokenizer = build_t5_tokenizer(model_max_length=TEXT_LENGTH)
    torch.manual_seed(3)
    text_encoder = tiny_text_encoder(tokenizer)
    if variant == "a14b":
        return WanPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=tiny_vae_21(),
            scheduler=scheduler(),
            transformer=tiny_transformer(1),
            transformer_2=tiny_transformer(2),
            boundary_ratio=A14B_BOUNDARY,
        )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=tiny_vae_22(),
        scheduler=scheduler(),
        transformer=tiny_transformer(4, in_channels=48, out_channels=48),
        expand_timesteps=True,
    )


def build_folder(path: str | Path, variant: Variant = "a14b") -> Path:
    """Write a tiny Wan 2.2 folder (diffusers format) to ``path`` and return it."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        build_tiny(variant).save_pretrained(path)
    return path


def build_pipeline(size: Literal["tiny", "real"], dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Wan 2.2 A14B in memory: "tiny" (the test folder's config) or "real" (the public transformer config
    for both experts, random weights created directly on ``device``; tiny text encoder, Wan 2.1 VAE)."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    if size == "tiny":
        return build_tiny("a14b").to(device=device, dtype=dtype)
    device = torch.device(device)
    tokenizer = build_t5_tokenizer(model_max_length=512)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(
        dtype
    )  # made in ``dtype``: an fp32 expert (57 GB) beside the other does not fit an H100
    try:
        with device:
            torch.manual_seed(0)
            experts = [WanTransformer3DModel(**A14B_TRANSFORMER).to(dtype).eval() for _ in range(2)]
    finally:
        torch.set_default_dtype(previous)
    with device:
        text_encoder = tiny_text_encoder(tokenizer, d_model=A14B_TRANSFORMER["text_dim"]).to(dtype)
        vae = AutoencoderKLWan().eval()  # Wan 2.1 VAE (A14B uses it) in fp32, as the model cards load it
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler(shift=12.0),
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=A14B_BOUNDARY,
    )
