"""A random LoRA on a tiny transformer, made with peft and saved with the pipeline's own
``save_lora_weights`` (the file layout diffusers' ``load_lora_weights`` reads)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def save_random_lora(
    pipeline_cls, transformer, targets: list[str], folder: Path, *, rank: int = 4, seed: int = 7
) -> Path:
    """Write a rank-``rank`` adapter (alpha = 2·rank, so alpha/rank matters) on ``targets``, its weights drawn
    from ``seed``; returns the file."""
    from peft import LoraConfig, get_peft_model_state_dict

    model = copy.deepcopy(transformer)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model.add_adapter(config)
    state = {k: v * 4.0 if "lora_B" in k else v for k, v in get_peft_model_state_dict(model).items()}
    metadata = {"r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets)}
    pipeline_cls.save_lora_weights(
        folder, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata
    )
    return folder / "pytorch_lora_weights.safetensors"
