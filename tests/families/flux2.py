"""FLUX.2 test models, built offline: tiny random ``Flux2Pipeline`` / ``Flux2KleinPipeline`` folders, and an
in-memory FLUX.2 dev pipeline with the public transformer config (random weights) for the GPU benchmark.

The text encoders are tiny but deep enough for the layers the pipelines read (Mistral3: hidden states 10,
20, 30; Qwen3: 9, 18, 27), so ``encode_prompt`` runs unchanged. Their tokenizer is a byte-level BPE made
in memory (every prompt tokenizes) with whole-word merges for the system message and common prompt words,
and a chat template that renders the pipelines' messages (Mistral's list-of-parts contents, Qwen's
``enable_thinking``). Real FLUX.2 dev ships a ``PixtralProcessor`` as its tokenizer; the pipeline only calls
its ``apply_chat_template``, which a tokenizer has too (and the processor needs torchvision, absent here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ditserve.replica.models.tokenizers import DEMO_WORDS, _byte_alphabet

TEXT_HIDDEN = 16  # the tiny encoders' width; the transformer reads 3 stacked layers: 48 features
MAX_TEXT_TOKENS = 96  # the tokenizers' model_max_length (the runner caps max_sequence_length by it)

# FLUX.2 dev's public transformer config (black-forest-labs/FLUX.2-dev, transformer/config.json).
DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=128,
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=True,
)
# 8 heads so that every layout up to 8 ranks is legal; 1 double + 2 single blocks (step caching needs 2).
TINY_TRANSFORMER = dict(
    DEV_TRANSFORMER,
    in_channels=16,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=8,
    num_attention_heads=8,
    joint_attention_dim=3 * TEXT_HIDDEN,
    timestep_guidance_channels=32,
    mlp_ratio=2.0,
    axes_dims_rope=(2, 2, 2, 2),
)
SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
# The lead's H200 benchmark: FLUX.2 dev at 1024², its usual steps and guidance.
REAL_SETTINGS = dict(width=1024, height=1024, num_inference_steps=50, guidance_scale=4.0)

MISTRAL_TEMPLATE = (
    "{% for conversation_message in messages %}"
    "[{{ conversation_message['role'] | upper }}]"
    "{% if conversation_message['content'] is string %}{{ conversation_message['content'] }}"
    "{% else %}{% for part in conversation_message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}[IMG]{% endif %}"
    "{% endfor %}{% endif %}[/{{ conversation_message['role'] | upper }}]{% endfor %}"
)
QWEN_TEMPLATE = (
    "{% for conversation_message in messages %}<|im_start|>{{ conversation_message['role'] }}\n"
    "{{ conversation_message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tokenizer(kind: Literal["mistral", "qwen"]) -> Qwen2Tokenizer:
    """Byte-level BPE: the 256 byte symbols, then one merge chain per word and one more for it after a space."""
    alphabet = _byte_alphabet()
    space = alphabet[ord(" ")]
    vocab: dict[str, int] = {}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []
    words = set(DEMO_WORDS) | {w.strip(".,") for w in SYSTEM_MESSAGE.split()} | {"sign", "hello", "world"}
    for word in sorted(w for w in words if w):
        merged = word[0]
        for ch in word[1:]:
            if (merged, ch) not in merges:
                merges.append((merged, ch))
            merged += ch
            vocab.setdefault(merged, len(vocab))
        merges.append((space, word))  # " word" (the pre-tokenizer keeps the space in front) after "word"
        vocab.setdefault(space + word, len(vocab))
    if kind == "mistral":
        specials = ["<pad>", "<s>", "</s>", "[SYSTEM]", "[/SYSTEM]", "[USER]", "[/USER]", "[IMG]"]
        tok = Qwen2Tokenizer(
            vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="</s>", pad_token="<pad>"
        )
        tok.chat_template = MISTRAL_TEMPLATE
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tok.chat_template = QWEN_TEMPLATE
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.model_max_length = MAX_TEXT_TOKENS
    return tok


def build_mistral3(
    vocab_size: int, hidden: int = TEXT_HIDDEN, head_dim: int = 8
) -> Mistral3ForConditionalGeneration:
    """A 30-layer Mistral3 (FLUX.2 dev reads hidden states 10, 20 and 30), narrow everywhere but ``hidden``."""
    text = MistralConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=8,
        num_hidden_layers=30,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=512,
    )
    vision = PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=32,
        patch_size=16,
    )
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=vocab_size - 1)
    return Mistral3ForConditionalGeneration(config).eval()


def build_qwen3(vocab_size: int) -> Qwen3ForCausalLM:
    """A 27-layer Qwen3 (FLUX.2 Klein reads hidden states 9, 18 and 27)."""
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=16,
        num_hidden_layers=27,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config).eval()


def build_vae() -> AutoencoderKLFlux2:
    """4× downsampling (64×64 images → 16×16 latents → 8×8 packed tokens), random batch-norm statistics."""
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=64,
    )
    with torch.no_grad():
        vae.bn.running_mean.uniform_(-0.5, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae.eval()


def build_tiny(klein: bool = False, seed: int = 0):
    """The tiny pipeline in memory (fp32, CPU)."""
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(**{**TINY_TRANSFORMER, "guidance_embeds": not klein}).eval()
    vae = build_vae()
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    if klein:
        tokenizer = build_tokenizer("qwen")
        encoder = build_qwen3(len(tokenizer))
        return Flux2KleinPipeline(scheduler, vae, encoder, tokenizer, transformer, is_distilled=False)
    tokenizer = build_tokenizer("mistral")
    encoder = build_mistral3(len(tokenizer))
    return Flux2Pipeline(scheduler, vae, encoder, tokenizer, transformer)


def build_folder(path: str | Path, klein: bool = False) -> Path:
    """A tiny random ``Flux2Pipeline`` (or ``Flux2KleinPipeline``) folder, written once (safetensors)."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        build_tiny(klein).save_pretrained(path)
    return path


def as_pixtral_folder(path: str | Path) -> Path:
    """Turn a saved tiny FLUX.2 dev folder's tokenizer into what FLUX.2 dev ships: a ``PixtralProcessor``
    (``model_index.json`` and ``processor_config.json``) around the same tokenizer files."""
    path = Path(path)
    index = json.loads((path / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    config = {"processor_class": "PixtralProcessor", "patch_size": 16, "spatial_merge_size": 2}
    (path / "tokenizer" / "processor_config.json").write_text(json.dumps(config, indent=2))
    return path


def build_pipeline(
    size: Literal["tiny", "real"] = "tiny",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Flux2Pipeline:
    """An in-memory ``Flux2Pipeline``. ``real``: FLUX.2 dev's transformer config with random weights made on
    ``device`` (~32 B parameters: 64 GB in bf16), the tiny VAE's 32 latent channels as the real one, and a
    tiny Mistral3 whose hidden size (5120) gives the transformer its 15360 input features."""
    if size == "tiny":
        return build_tiny().to(device=device, dtype=dtype)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in ``dtype``: 32 B fp32 parameters would not fit one GPU
    try:
        with torch.device(device):
            transformer = Flux2Transformer2DModel(**DEV_TRANSFORMER)
            tokenizer = build_tokenizer("mistral")
            encoder = build_mistral3(len(tokenizer), hidden=DEV_TRANSFORMER["joint_attention_dim"] // 3)
            vae = AutoencoderKLFlux2(
                block_out_channels=(32, 32, 32, 32), norm_num_groups=8, layers_per_block=1, latent_channels=32
            )
    finally:
        torch.set_default_dtype(default)
    tokenizer.model_max_length = 512
    pipe = Flux2Pipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae, encoder, tokenizer, transformer)
    return pipe.to(device=device, dtype=dtype)
