"""HunyuanVideo 1.5 pipelines with random weights, built offline.

``build_folder(path)`` writes a tiny diffusers folder (2 blocks, 8 heads × 8, tiny Qwen2.5-VL text model,
byT5 glyph encoder, VAE, SigLIP for image-to-video) with tokenizers made in memory, for the tests.
``build_pipeline("real", ...)`` is the public 480p transformer (54 blocks, 16 heads × 128) with random
weights made on ``device`` beside the real VAE shape and text encoders cut to a few layers of the real
widths, for GPU benchmarks (``REAL_SETTINGS``: the model card's 480p, 33 frames, 50 steps, CFG 6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from ditserve.replica.models.tokenizers import _byte_alphabet

Size = Literal["tiny", "real"]
Task = Literal["t2v", "i2v"]
SEED = 0

# HunyuanVideo-1.5 480p: 16:9 bucket of target_size 640 (848x480), 33 frames, the model card's sampling.
REAL_SETTINGS = {
    "width": 848,
    "height": 480,
    "num_frames": 33,
    "num_inference_steps": 50,
    "guidance_scale": 6.0,
}

# A Qwen2-style chat template: what ``_get_mllm_prompt_embeds`` applies to [system, user] conversations.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Words that get one token each, so prompts and the system message stay short in the tiny model.
_WORDS = (
    "a the of and to in on with video by describe main content theme color shape size texture quantity "
    "text spatial relationships objects actions events behaviors temporal physical movement changes "
    "background environment light style atmosphere camera angles movements transitions used you are "
    "helpful assistant detailing following aspects red fox cat dog blue green running waves beach sign"
).split()


def build_qwen_tokenizer():
    """A byte-level BPE Qwen2 tokenizer with the chat special tokens and a chat template."""
    from transformers import Qwen2Tokenizer

    vocab: dict[str, int] = {}
    for ch in _byte_alphabet():
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        for piece in (word, "Ġ" + word):  # Ġ: a leading space in the byte-level alphabet
            merged = piece[0]
            for ch in piece[1:]:
                if (merged, ch) not in merges:
                    merges.append((merged, ch))
                merged += ch
                vocab.setdefault(merged, len(vocab))
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab.setdefault(special, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _qwen(tokenizer, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int):
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    head_dim = hidden // heads
    quarter = head_dim // 16  # Qwen2.5-VL-7B: head_dim 128 → sections (16, 24, 24)
    config = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rope_scaling={
            "mrope_section": [quarter * 2, quarter * 3, quarter * 3] if quarter else [1, 1, 2],
            "rope_type": "default",
            "type": "default",
        },
        rope_theta=1000000.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    return Qwen2_5_VLTextModel(config).eval()


def _byt5(d_model: int, layers: int):
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = ByT5Tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=8 if d_model <= 64 else 64,
        d_ff=2 * d_model,
        num_layers=layers,
        num_heads=4 if d_model <= 64 else 6,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return tokenizer, T5EncoderModel(config).eval()


def _siglip(hidden: int, image_size: int, patch: int, layers: int):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    try:
        from transformers import SiglipImageProcessorPil as Processor
    except ImportError:  # older transformers: one SiglipImageProcessor
        from transformers import SiglipImageProcessor as Processor

    config = SiglipVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2 if hidden <= 64 else 16,
        image_size=image_size,
        patch_size=patch,
    )
    processor = Processor(size={"height": image_size, "width": image_size})
    return SiglipVisionModel(config).eval(), processor


def build_pipeline(size: Size = "tiny", dtype: torch.dtype = torch.float32, device="cpu", task: Task = "t2v"):
    """An in-memory HunyuanVideo15Pipeline (or image-to-video pipeline) with random weights on ``device``."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance

    torch.manual_seed(SEED)
    tokenizer = build_qwen_tokenizer()
    with torch.device(device):
        if size == "tiny":
            # 8 heads so every layout up to 8 ranks is legal; text widths 16 (Qwen) and 32 (byT5).
            transformer = HunyuanVideo15Transformer3DModel(
                in_channels=9,
                out_channels=4,
                num_attention_heads=8,
                attention_head_dim=8,
                num_layers=2,
                num_refiner_layers=1,
                mlp_ratio=2.0,
                text_embed_dim=16,
                text_embed_2_dim=32,
                image_embed_dim=16,
                rope_axes_dim=(2, 2, 4),
                target_size=64,
                task_type=task,
            )
            vae = AutoencoderKLHunyuanVideo15(
                latent_channels=4,
                block_out_channels=(16, 16),
                layers_per_block=1,
                spatial_compression_ratio=4,
                temporal_compression_ratio=2,
                downsample_match_channel=False,
                upsample_match_channel=False,
            )
            text_encoder = _qwen(tokenizer, hidden=16, layers=2, heads=2, kv_heads=2, intermediate=16)
            tokenizer_2, text_encoder_2 = _byt5(32, 2)
            siglip = _siglip(16, 32, 8, 1) if task == "i2v" else None
        else:
            # The public 480p transformer (scripts/convert_hunyuan_video1_5_to_diffusers.py, 480p_t2v/i2v)
            # and VAE; Qwen2.5-VL-7B and Glyph-byT5 at their real widths but with few layers.
            transformer = HunyuanVideo15Transformer3DModel(
                in_channels=65,
                out_channels=32,
                num_attention_heads=16,
                attention_head_dim=128,
                num_layers=54,
                num_refiner_layers=2,
                mlp_ratio=4.0,
                text_embed_dim=3584,
                text_embed_2_dim=1472,
                image_embed_dim=1152,
                rope_axes_dim=(16, 56, 56),
                target_size=640,
                task_type=task,
            )
            vae = AutoencoderKLHunyuanVideo15()
            text_encoder = _qwen(tokenizer, hidden=3584, layers=2, heads=28, kv_heads=4, intermediate=1024)
            tokenizer_2, text_encoder_2 = _byt5(1472, 1)
            siglip = _siglip(1152, 384, 14, 1) if task == "i2v" else None
    parts = dict(
        transformer=transformer.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    if task == "i2v":
        pipe = HunyuanVideo15ImageToVideoPipeline(
            image_encoder=siglip[0], feature_extractor=siglip[1], **parts
        )
    else:
        pipe = HunyuanVideo15Pipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def build_folder(path: str | Path, task: Task = "t2v") -> Path:
    """Write the tiny pipeline to ``path`` in diffusers format (once) and return it."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        build_pipeline("tiny", task=task).save_pretrained(path)
    return path
