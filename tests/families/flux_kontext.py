"""FLUX.1 Kontext folders built offline with random weights.

- ``build_pipeline()``: a tiny ``FluxKontextPipeline`` (1 double + 1 single block, 8 heads × 8, the demo
  Flux's tiny 8× VAE, CLIP and T5), deterministic.
- ``build_folder(path)``: the same in diffusers format, for ``ditserve serve --model <path>`` and the
  engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ditserve.replica.models.demo import _tiny_clip, _tiny_t5
from ditserve.replica.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer

SEED = 0


def build_pipeline():
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxKontextPipeline,
        FluxTransformer2DModel,
    )

    torch.manual_seed(SEED)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels × a 2×2 packed patch
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=8,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(4, 4, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer(model_max_length=32)
    pipe = FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256
        ),
        vae=vae,
        text_encoder=_tiny_clip(tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=_tiny_t5(tokenizer_2),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_folder(path: Path) -> Path:
    """Write the tiny pipeline to ``path`` (a diffusers folder with ``model_index.json``); returns it."""
    if not (path / "model_index.json").is_file():
        build_pipeline().save_pretrained(path)
    return path
