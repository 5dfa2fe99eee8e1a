"""Z-Image pipelines built offline: a tiny random folder for tests, and one with Z-Image-Turbo's
transformer (random weights, made on the device) for benchmarks on a GPU. The Qwen3 text encoder stays
tiny (its width is the transformer's caption width); its tokenizer is FLUX.2 Klein's in-memory Qwen BPE
with a chat template that takes ``enable_thinking``."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from tests.families.flux2 import build_tokenizer

SEED = 0

# Tongyi-MAI/Z-Image-Turbo transformer/config.json (30 heads × 128)
TURBO_TRANSFORMER = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 2560,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
}
# 8 heads × 8 (rotary axes 4 + 2 + 2), 1 refiner block per stream, 2 main blocks (step caching needs 2).
TINY_TRANSFORMER = dict(
    TURBO_TRANSFORMER,
    dim=64,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=8,
    n_kv_heads=8,
    cap_feat_dim=32,
    axes_dims=[4, 2, 2],
    axes_lens=[512, 32, 32],
)
# Z-Image-Turbo's card: 9 steps (8 forwards), guidance 0, 1024².
REAL_SETTINGS = {"width": 1024, "height": 1024, "num_inference_steps": 9, "guidance_scale": 0.0}


def _text_encoder(vocab_size: int, hidden: int) -> Qwen3Model:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=2,  # the pipeline reads hidden_states[-2]
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
    )
    return Qwen3Model(config).eval()


def _vae() -> AutoencoderKL:
    """8× downsampling, 16 latent channels (FLUX.1's VAE shape, as Z-Image uses), tiny."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1159,
        scaling_factor=0.3611,
    )


def _transformer(config: dict, dtype: torch.dtype, device: str) -> ZImageTransformer2DModel:
    """Random weights made directly on ``device`` in ``dtype`` (deterministic for SEED). The model zeroes
    nothing but its pad tokens; those get random values too, so padding is visible in tests."""
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = ZImageTransformer2DModel(**config).eval()
            with torch.no_grad():
                model.x_pad_token.normal_()
                model.cap_pad_token.normal_()
            return model
    finally:
        torch.set_default_dtype(previous)


def build_pipeline(
    size: str = "tiny", dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> ZImagePipeline:
    """A ZImagePipeline in memory: ``tiny`` (tests) or ``real`` (Z-Image-Turbo's transformer with random
    weights; the text encoder and VAE stay tiny, the encoder as wide as the transformer's captions)."""
    if size not in ("tiny", "real"):
        raise ValueError(f"size: {size!r}; expected 'tiny' or 'real'")
    config = TINY_TRANSFORMER if size == "tiny" else TURBO_TRANSFORMER
    transformer = _transformer(config, dtype, device)
    torch.manual_seed(SEED + 1)
    tokenizer = build_tokenizer("qwen")
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),  # Turbo's
        vae=_vae(),
        text_encoder=_text_encoder(len(tokenizer), config["cap_feat_dim"]),
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def build_folder(path: str | Path) -> Path:
    """The tiny pipeline saved in diffusers format (what ``--model`` reads)."""
    path = Path(path)
    build_pipeline("tiny").save_pretrained(path)
    return path
