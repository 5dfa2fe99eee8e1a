"""Stable Diffusion 3.5 pipelines built offline: a tiny random folder for tests, and one with SD3.5 large's
transformer (random weights, made on the device) for benchmarks on a GPU."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from ditserve.replica.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

SEED = 0
CLIP_TOKENS = {"tiny": 16, "real": 77}  # the CLIP tokenizers' model_max_length (the real ones: 77)

# stabilityai/stable-diffusion-3.5-large transformer/config.json (38 heads × 64)
LARGE_TRANSFORMER = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 38,
    "attention_head_dim": 64,
    "num_attention_heads": 38,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 2432,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 192,
    "dual_attention_layers": (),
    "qk_norm": "rms_norm",
}
# 2 blocks (the first dual-attention as in 3.5 medium, the last context_pre_only), 8 heads × 8.
TINY_TRANSFORMER = {
    "sample_size": 32,
    "patch_size": 2,
    "in_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 8,
    "joint_attention_dim": 32,
    "caption_projection_dim": 64,
    "pooled_projection_dim": 32,
    "out_channels": 4,
    "pos_embed_max_size": 16,
    "dual_attention_layers": (0,),
    "qk_norm": "rms_norm",
}
# stabilityai/stable-diffusion-3.5-large's card: 28 steps, guidance 3.5, 1024².
REAL_SETTINGS = {"width": 1024, "height": 1024, "num_inference_steps": 28, "guidance_scale": 3.5}


def _clip(tokenizer, hidden: int, projection: int) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config).eval()


def _t5(tokenizer, d_model: int) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config).eval()


def _vae(latent_channels: int) -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,  # SD3's VAE
        scaling_factor=1.5305,
    )


def _transformer(config: dict, dtype: torch.dtype, device: str) -> SD3Transformer2DModel:
    """Random weights made directly on ``device`` in ``dtype`` (deterministic for SEED)."""
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return SD3Transformer2DModel(**config).eval()
    finally:
        torch.set_default_dtype(previous)


def build_pipeline(size: str = "tiny", dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A StableDiffusion3Pipeline in memory: ``tiny`` (tests) or ``real`` (SD3.5 large's transformer with
    random weights; the text encoders and VAE stay tiny, their output widths matching the transformer)."""
    if size not in ("tiny", "real"):
        raise ValueError(f"size: {size!r}; expected 'tiny' or 'real'")
    config = TINY_TRANSFORMER if size == "tiny" else LARGE_TRANSFORMER
    transformer = _transformer(config, dtype, device)
    torch.manual_seed(SEED + 1)
    # CLIP-L and CLIP-G hidden states side by side (zero-padded to T5's width); their projections are the
    # pooled vector: widths that add up to the transformer's joint and pooled dims.
    pooled = config["pooled_projection_dim"]
    clip_1, clip_2 = (16, 16) if size == "tiny" else (768, 1280)
    tokenizer, tokenizer_2 = (build_clip_tokenizer(CLIP_TOKENS[size]) for _ in range(2))
    tokenizer_3 = build_t5_tokenizer(model_max_length=256)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3's scheduler config
        vae=_vae(config["in_channels"]),
        text_encoder=_clip(tokenizer, clip_1, pooled * clip_1 // (clip_1 + clip_2)),
        tokenizer=tokenizer,
        text_encoder_2=_clip(tokenizer_2, clip_2, pooled * clip_2 // (clip_1 + clip_2)),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_t5(tokenizer_3, config["joint_attention_dim"]),
        tokenizer_3=tokenizer_3,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def build_folder(path: str | Path, t5: bool = True) -> Path:
    """The tiny pipeline saved in diffusers format (what ``--model`` reads); without ``t5`` saved as
    ``StableDiffusion3Pipeline(..., text_encoder_3=None, tokenizer_3=None)`` saves it (a low-memory setup)."""
    path = Path(path)
    pipe = build_pipeline("tiny")
    if not t5:
        pipe = StableDiffusion3Pipeline(**(pipe.components | {"text_encoder_3": None, "tokenizer_3": None}))
    pipe.save_pretrained(path)
    return path
