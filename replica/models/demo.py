"""Demo models: tiny Flux and Wan pipelines with random weights, built offline (the trained demo models,
``demo-scenes`` and ``demo-scenes-video``, ship as folders instead: ``scenes.py``).

They are the embedded default (no download, no GPU). Each is built once from a fixed seed, written in
diffusers format to ``$DITSERVE_HOME/models/<name>`` and then loaded through ``from_pretrained`` — the same
path real checkpoints take. Both have 8 attention heads so every parallel layout up to 8 ranks is legal.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .tokenizers import build_clip_tokenizer, build_t5_tokenizer

DEMO_SEED = 0


def ditserve_home() -> Path:
    """Cache root: ``$DITSERVE_HOME`` or ``~/.cache/ditserve`` (also when the variable is set but empty: an
    empty path would put the demo models under whatever folder the command ran in)."""
    return Path(os.environ.get("DITSERVE_HOME") or Path.home() / ".cache" / "ditserve")


def _tiny_clip(tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=32,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def _tiny_t5(tokenizer, cls_name: str = "T5EncoderModel"):
    import transformers

    config_cls = transformers.UMT5Config if cls_name == "UMT5EncoderModel" else transformers.T5Config
    config = config_cls(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return getattr(transformers, cls_name)(config).eval()


def build_demo_flux():
    """A FluxPipeline: 1 double + 1 single block, 8 heads × 16, 4-channel 8× VAE, tiny CLIP and T5."""
    import torch  # here: the API front end reads the registry, which imports this module, and needs no torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(DEMO_SEED)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels × a 2×2 packed patch
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=8,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
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
    return FluxPipeline(
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


def build_demo_wan():
    """A WanPipeline with random weights (its videos are noise): 2 blocks, 8 heads × 12, tiny Wan VAE
    (4× temporal, 8× spatial), tiny UMT5. It exercises the Wan code paths (parity tests, layouts); the video
    model that films what it is asked is the trained ``demo-scenes-video`` (``train_demo_video.py``)."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    torch.manual_seed(DEMO_SEED)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    tokenizer = build_t5_tokenizer(model_max_length=32)
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_tiny_t5(tokenizer, "UMT5EncoderModel"),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer,
    )


DEMO_BUILDERS: dict[str, Callable] = {"demo-flux": build_demo_flux, "demo-wan": build_demo_wan}


def ensure_demo_model(name: str, root: Path | None = None) -> Path:
    """Write the demo pipeline ``name`` once (atomically) and return its folder."""
    if name not in DEMO_BUILDERS:
        raise ValueError(f"unknown demo model {name!r}; known: {sorted(DEMO_BUILDERS)}")
    root = root or ditserve_home() / "models"
    target = root / name
    if (target / "model_index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build into a temporary folder and rename, so concurrent processes never read a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        DEMO_BUILDERS[name]().save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
