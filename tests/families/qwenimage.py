"""Tiny (and real-sized) Qwen-Image pipelines with random weights, built offline.

``build_folder(path, edit)`` writes a diffusers folder (QwenImagePipeline, QwenImageEditPipeline with
``edit=True``, QwenImageEditPlusPipeline with ``edit="plus"``) with a 2-block transformer (4 heads × 16),
a tiny Qwen-Image VAE (8× spatial like the real one), a tiny Qwen2.5-VL text encoder and a byte-level
Qwen2 tokenizer + processor made in memory. ``build_pipeline(size, dtype, device)`` returns the pipeline
in memory; ``"real"`` has Qwen-Image's public transformer config (60 blocks, 24 heads × 128) with random
weights created on ``device`` (the text encoder stays tiny, with the real 3584-wide output).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

Edit = bool | Literal["plus"]

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Words of the prompt templates that get one token each (the rest falls back to bytes).
TEMPLATE_WORDS = (
    "system user assistant Describe the image by detailing color shape size texture quantity text spatial "
    "relationships of objects and background key features input then explain how user's instruction should "
    "alter or modify Generate a new that meets requirements while maintaining consistency with original "
    "where appropriate Picture"
).split()

# Qwen-Image's published configs (transformer, VAE, scheduler).
REAL_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
TINY_TRANSFORMER = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),
)
SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)
# What the lead benchmarks on an H200: Qwen-Image's usual settings.
REAL_SETTINGS = dict(
    width=1024,
    height=1024,
    num_inference_steps=50,
    true_cfg_scale=4.0,
    negative_prompt=" ",
    prompt="A coffee shop entrance features a chalkboard sign reading 'Qwen Coffee 😊 $2 per cup'",
)


def build_tokenizer():
    """A Qwen2 (byte-level BPE) tokenizer: the byte alphabet, one merge chain per template word, and the
    chat / vision special tokens the pipelines' templates use."""
    from transformers import Qwen2Tokenizer

    from ditserve.replica.models.tokenizers import _byte_alphabet

    alphabet = _byte_alphabet()
    vocab: dict[str, int] = {}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []
    space = alphabet[ord(" ")]
    for word in TEMPLATE_WORDS:
        chars = [alphabet[b] for b in (" " + word).encode()]
        merged = chars[0]
        for ch in chars[1:]:
            if (merged, ch) not in merges:
                merges.append((merged, ch))
            merged += ch
            vocab.setdefault(merged, len(vocab))
    assert space in vocab
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=2048)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def build_image_processor():
    """Qwen2-VL's image processor (PIL backend) with small pixel budgets: few vision tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)


def build_text_encoder(tokenizer, hidden_size: int = 32, num_heads: int = 2):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = hidden_size // num_heads
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=hidden_size,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            vocab_size=len(tokenizer),
            rope_scaling={"mrope_section": _mrope(head_dim), "rope_type": "default", "type": "default"},
            rope_theta=1000000.0,
            max_position_embeddings=4096,
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden_size
        ),
        vocab_size=len(tokenizer),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _mrope(head_dim: int) -> list[int]:
    """M-RoPE sections (temporal, height, width) summing to head_dim / 2."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def build_vae(real: bool = False):
    """Qwen-Image's VAE: the published config, or a tiny one with 16× spatial downsampling (the edit
    pipelines encode every reference at about 1024² pixels: 4096 latent pixels per reference instead of
    16384, and a CPU encode of seconds instead of tens)."""
    from diffusers import AutoencoderKLQwenImage

    if real:
        return AutoencoderKLQwenImage(
            base_dim=96,
            z_dim=16,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=2,
            temperal_downsample=[False, True, True],
            latents_mean=[0.1 * (i % 3 - 1) for i in range(16)],
            latents_std=[1.5 + 0.1 * i for i in range(16)],
        ).eval()
    return AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 2, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.1, -0.1, 0.0, 0.2],
        latents_std=[1.0, 1.5, 0.8, 1.2],
    ).eval()


def _pipeline_class(edit: Edit):
    import diffusers

    if edit == "plus":
        return diffusers.QwenImageEditPlusPipeline
    return diffusers.QwenImageEditPipeline if edit else diffusers.QwenImagePipeline


def build_pipeline(
    size: Literal["tiny", "real"] = "tiny",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    edit: Edit = False,
    seed: int = 0,
    zero_cond_t: bool = False,
):
    """The pipeline in memory, random weights from ``seed``; ``zero_cond_t`` as Qwen-Image-Edit-2511's
    transformer (reference tokens modulated at t = 0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    real = size == "real"
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(
        tokenizer, hidden_size=3584 if real else 32, num_heads=28 if real else 2
    )
    vae = build_vae(real)
    config = REAL_TRANSFORMER if real else TINY_TRANSFORMER
    default = torch.get_default_dtype()
    # Created on the device in its dtype (the real one is 20.4 B parameters: 41 GB in bf16).
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            transformer = QwenImageTransformer2DModel(**config, zero_cond_t=zero_cond_t)
    finally:
        torch.set_default_dtype(default)
    parts = dict(
        transformer=transformer.to(dtype),
        vae=vae.to(device, dtype),
        text_encoder=text_encoder.to(device, dtype),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    )
    if edit:
        from ditserve.replica.pipelines.qwenimage import pil_processor

        parts["processor"] = pil_processor(build_image_processor(), tokenizer)
    pipe = _pipeline_class(edit)(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_folder(path: str | Path, edit: Edit = False, zero_cond_t: bool = False) -> Path:
    """Write a tiny random pipeline folder (diffusers format) to ``path``; returns it. An edit folder's
    ``processor/`` is written as a real checkpoint's is (tokenizer + ``preprocessor_config.json`` naming
    ``Qwen2VLImageProcessor``): a processor without a video processor cannot save itself."""
    path = Path(path)
    pipe = build_pipeline("tiny", edit=edit, zero_cond_t=zero_cond_t)
    processor = getattr(pipe, "processor", None)
    if processor is not None:
        pipe.register_modules(processor=None)
    pipe.save_pretrained(path)
    if processor is not None:
        folder = path / "processor"
        processor.tokenizer.save_pretrained(folder)
        processor.image_processor.save_pretrained(folder)
        config_file = folder / "preprocessor_config.json"
        config = json.loads(config_file.read_text())
        config["image_processor_type"] = "Qwen2VLImageProcessor"
        config_file.write_text(json.dumps(config, indent=2))
        index_file = path / "model_index.json"
        index = json.loads(index_file.read_text())
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
        index_file.write_text(json.dumps(index, indent=2))
    return path
