"""Wan image-to-video folders built offline with random weights: Wan 2.1 I2V (CLIP image encoder, the
transformer's image cross-attention) and Wan 2.2 I2V A14B (two experts, no image encoder).

``build_folder(path, variant=...)`` writes a tiny diffusers folder; ``build_pipeline(size, dtype, device)``
builds Wan 2.2 I2V A14B in memory: "tiny" or "real" (the public transformer config twice, random weights on
``device``, a tiny text encoder of the matching width), with ``REAL_SETTINGS`` for a 480p benchmark.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Literal

import torch

from ditserve.replica.models.tokenizers import build_t5_tokenizer
from tests.families.wan22 import (
    A14B_TRANSFORMER,
    TEXT_LENGTH,
    scheduler,
    tiny_text_encoder,
    tiny_transformer,
    tiny_vae_21,
)

Variant = Literal["wan21", "a14b"]

I2V_BOUNDARY = 0.9  # Wan 2.2 I2V A14B's model_index.json
# 480p, 33 frames, the model card's 40 steps, guidance 3.5 for both experts.
REAL_SETTINGS = dict(width=832, height=480, num_frames=33, num_inference_steps=40, guidance_scale=3.5)
CLIP_DIM = 16


def tiny_image_encoder():
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(9)
    config = CLIPVisionConfig(
        hidden_size=CLIP_DIM,
        projection_dim=CLIP_DIM,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        intermediate_size=32,
        patch_size=8,
    )
    return CLIPVisionModel(config).eval(), CLIPImageProcessor(crop_size=32, size=32)


def build_tiny(variant: Variant = "wan21"):
    from diffusers import WanImageToVideoPipeline

    tokenizer = build_t5_tokenizer(model_max_length=TEXT_LENGTH)
    torch.manual_seed(3)
    text_encoder = tiny_text_encoder(tokenizer)
    # input channels: 16 noisy latents + 4 frame-mask + 16 image-condition channels
    if variant == "wan21":
        image_encoder, image_processor = tiny_image_encoder()
        return WanImageToVideoPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=tiny_vae_21(),
            scheduler=scheduler(),
            image_encoder=image_encoder,
            image_processor=image_processor,
            transformer=tiny_transformer(5, in_channels=36, image_dim=CLIP_DIM, added_kv_proj_dim=64),
        )
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=tiny_vae_21(),
        scheduler=scheduler(),
        transformer=tiny_transformer(6, in_channels=36),
        transformer_2=tiny_transformer(7, in_channels=36),
        boundary_ratio=I2V_BOUNDARY,
    )


def build_folder(path: str | Path, variant: Variant = "wan21") -> Path:
    """Write a tiny Wan I2V folder (diffusers format) to ``path`` and return it."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        build_tiny(variant).save_pretrained(path)
    return path


def build_pipeline(size: Literal["tiny", "real"], dtype: torch.dtype, device: str | torch.device = "cpu"):
    """Wan 2.2 I2V A14B in memory: "tiny" (the test folder's config) or "real" (the public transformer
    config with 36 input channels for both experts, random weights created on ``device``)."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel

    if size == "tiny":
        return build_tiny("a14b").to(device=device, dtype=dtype)
    device = torch.device(device)
    tokenizer = build_t5_tokenizer(model_max_length=512)
    config = {**A14B_TRANSFORMER, "in_channels": 36}
    with device:
        torch.manual_seed(0)
        experts = [WanTransformer3DModel(**config).to(dtype).eval() for _ in range(2)]
        text_encoder = tiny_text_encoder(tokenizer, d_model=config["text_dim"]).to(dtype)
        vae = AutoencoderKLWan().eval()  # Wan 2.1 VAE (A14B uses it) in fp32, as the model cards load it
    return WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler(shift=5.0),
        transformer=experts[0],
        transformer_2=experts[1],
        boundary_ratio=I2V_BOUNDARY,
    )


def reference_png(width: int = 80, height: int = 60) -> bytes:
    """A first frame: a red square on blue (a size other than the video's: it is resized as diffusers does)."""
    from PIL import Image

    image = Image.new("RGB", (width, height), (30, 60, 90))
    image.paste((220, 40, 20), (width // 4, height // 6, 3 * width // 4, 5 * height // 6))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
