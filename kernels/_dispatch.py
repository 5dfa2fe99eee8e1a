"""Where a kernel runs: Triton on CUDA tensors or under TRITON_INTERPRET=1, else the torch reference."""

from __future__ import annotations

import functools
import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is *decorated* (our kernel modules are imported together with
# this one), so the choice is fixed at import: setting the variable later must not send CPU tensors to
# kernels that were built for the GPU ("Cannot call @triton.jit'd outside of the scope of a kernel").
_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_interpret() -> bool:
    return _INTERPRET_AT_IMPORT


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or anywhere when the interpreter is on (CPU tests)."""
    if t.is_cuda:
        return True
    if not triton_interpret():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of dtype: exact fp32 products for fp32 (what the tests compare
    against), else tf32 (a setting only fp32 operands feel)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_rank(max_rank: int) -> int:
    """Rank tile: power of two, ≥ 16 because tl.dot needs K, N ≥ 16 on the GPU."""
    return max(16, next_pow2(max_rank))


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides, and a unit inner stride."""
    return all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in tensors
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs_limit(device: torch.device) -> int:
    """Programs a persistent launch keeps resident: one per SM (4 in the interpreter, so tests loop)."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 4


# Scratch that kernels leave in a known state between launches (zeroed sums and counts), one buffer per (name,
# device); launches on one device must not run concurrently on two streams. A larger request allocates a new
# zeroed buffer and keeps the old one alive: CUDA graphs captured before hold its address and use it on every
# replay (freed, its memory could be handed to other tensors).
_SCRATCH: dict[tuple[str, torch.device], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def zeroed_scratch(
    name: str, device: torch.device, numel: int, dtype: torch.dtype, min_numel: int = 0
) -> torch.Tensor:
    """A buffer of at least numel elements, zero when first allocated, kept per (name, device)."""
    buf = _SCRATCH.get((name, device))
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        buf = _SCRATCH[name, device] = torch.zeros(max(numel, min_numel), dtype=dtype, device=device)
    return buf
