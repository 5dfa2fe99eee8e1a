"""AnyFlow-FAR folders and pipelines built offline with random weights.

- ``build_folder(path)``: a tiny ``AnyFlowFARPipeline`` (2 blocks, 4 heads × 16, tiny Wan VAE and UMT5) in
  diffusers format, for CPU tests and ``ditserve serve --model <path>``.
- ``build_pipeline(size, dtype, device)``: ``"tiny"`` as above; ``"real"``: the public AnyFlow-FAR
  Wan2.1-1.3B transformer shape (30 blocks, 12 heads × 128, FFN 8960, UMT5-XXL text width 4096) with
  random weights on ``device``, next to a tiny text encoder and the real Wan 2.1 VAE shape, for timing.
- ``REAL_SETTINGS``: the realtime settings the H200 benchmark runs at (480p, 3 latent frames per chunk).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from ditserve.replica.models.demo import _tiny_t5
from ditserve.replica.models.tokenizers import build_t5_tokenizer

SEED = 0

# 480p realtime: 832×480, 12 frames (3 latent frames) per chunk after a first chunk of one frame, 4 flow-map
# steps per chunk, guidance fused into the weights (1.0).
REAL_SETTINGS = {
    "size": "832x480",
    "num_frames": 12,
    "num_inference_steps": 4,
    "guidance_scale": 1.0,
    "fps": 16,
    "max_chunks": 8,
}

_TRANSFORMER = {
    "tiny": {
        "num_attention_heads": 4,
        "attention_head_dim": 16,
        "ffn_dim": 64,
        "num_layers": 2,
        "text_dim": 32,
        "freq_dim": 32,
        "rope_max_seq_len": 64,
    },
    # The released AnyFlow-FAR-Wan2.1-1.3B transformer: Wan2.1 1.3B's dimensions with the FAR defaults.
    "real": {
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "ffn_dim": 8960,
        "num_layers": 30,
        "text_dim": 4096,
        "freq_dim": 256,
        "rope_max_seq_len": 1024,
    },
}


def build_pipeline(
    size: Literal["tiny", "real"] = "tiny",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vae_stages: bool = False,
):
    """An ``AnyFlowFARPipeline`` with random weights (seeded), on ``device`` in ``dtype``; ``vae_stages``: the
    tiny VAE with Wan 2.1's stages (channels 1, 2, 4, 4 times its base, two residual blocks each) instead of
    one width throughout."""
    from diffusers import (
        AnyFlowFARPipeline,
        AnyFlowFARTransformer3DModel,
        AutoencoderKLWan,
        FlowMapEulerDiscreteScheduler,
    )

    torch.manual_seed(SEED)
    dims = _TRANSFORMER[size]
    transformer = AnyFlowFARTransformer3DModel(
        patch_size=(1, 2, 2),
        compressed_patch_size=(1, 4, 4),
        full_chunk_limit=3,
        in_channels=16,
        out_channels=16,
        cross_attn_norm=True,
        gate_value=0.25,
        deltatime_type="r",
        **dims,
    )
    if size == "tiny":
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 2, 4, 4] if vae_stages else [1, 1, 1, 1],
            num_res_blocks=2 if vae_stages else 1,
            temperal_downsample=[False, True, True],
        )
    else:
        vae = AutoencoderKLWan()  # Wan 2.1's VAE shape (base_dim 96)
    tokenizer = build_t5_tokenizer(model_max_length=32)
    text_encoder = _tiny_t5(tokenizer, "UMT5EncoderModel")
    if size == "real":
        # The text encoder's width must match the transformer's text_dim; its depth does not matter here.
        import transformers

        config = text_encoder.config
        config.d_model = dims["text_dim"]
        text_encoder = transformers.UMT5EncoderModel(config).eval()
    pipe = AnyFlowFARPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMapEulerDiscreteScheduler(shift=5.0),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def build_folder(path: str | Path, vae_stages: bool = False) -> Path:
    """The tiny pipeline written in diffusers format to ``path`` (created); returns ``path``."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        build_pipeline("tiny", vae_stages=vae_stages).save_pretrained(path)
    return path
