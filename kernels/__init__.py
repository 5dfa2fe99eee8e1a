"""Triton kernels, one folder per op (kernel.py, op.py, reference.py, bench.py); see lora.py for multi-LoRA."""

from ditserve.kernels.lora import (
    LoRABatchMeta,
    apply_lora,
    choose_chunk_size,
    lora_expand,
    lora_linear,
    lora_shrink,
)

__all__ = ["LoRABatchMeta", "apply_lora", "choose_chunk_size", "lora_expand", "lora_linear", "lora_shrink"]
