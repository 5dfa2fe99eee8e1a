"""``--quantization fp8``: the transformer blocks' linears as FP8 (e4m3) GEMMs with row-wise scales.

Weights are quantized once, one scale per output row (amax / 448); activations at every call, one scale
per token (dynamic, so no calibration); the product is ``torch._scaled_mm`` with both row-wise scales and
the bias fused, written in the compute dtype. On Hopper an FP8 GEMM has twice the tensor-core rate of bf16;
under ``--compile`` the activation quantization fuses into the kernel that produces the activation.

Only what the repeated blocks spend their time in is converted: ``nn.Linear`` layers inside the model's
repeated blocks (``models/blocks.py``: attention projections, MLPs), not the per-block modulation linears (one row per
request: nothing to gain, and they set every activation's scale and shift) nor the embedders and the final
projection. Tensor-parallel linears keep their own classes and stay in the compute dtype. An adapter on a
converted linear adds its delta after the FP8 GEMM (the fused LoRA GEMM reads bf16 weights).

Images change: FP8 rounds every GEMM input to 3 mantissa bits. benchmarks/engine/engine_vs_diffusers.py and
wan_vs_diffusers.py report the PSNR against bf16.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .blocks import repeated_blocks

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor, fp32 scales [rows, 1]) with t ≈ q · scale row by row."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Float8Linear(nn.Module):
    """A frozen ``nn.Linear`` computed as an FP8 GEMM (row-wise scales on both sides)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        q, scale = quantize_rowwise(linear.weight.detach())
        self.weight = nn.Parameter(q, requires_grad=False)  # [out, in] e4m3
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # [1, out] fp32
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)
        if x2.shape[0] == 0:
            return x2.new_empty((*x.shape[:-1], self.out_features))
        xq, x_scale = quantize_rowwise(x2)
        y = torch._scaled_mm(
            xq,
            self.weight.t(),  # column-major, as the FP8 GEMM wants its second operand
            scale_a=x_scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=self.compute_dtype,
        )
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise"


def check_fp8_device(device: torch.device, dtype: torch.dtype) -> None:
    """FP8 GEMMs need compute capability 8.9 (Ada) or newer on CUDA, and write bf16 there (row-wise
    scales); the CPU runs them too (slowly, any float dtype), which the tests use."""
    if device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"--quantization fp8 needs an FP8 GPU (compute capability ≥ 8.9); {name} is not one")
    if dtype != torch.bfloat16:
        raise ValueError("--quantization fp8 writes bfloat16 GEMM outputs on GPUs; use --dtype bfloat16")


def quantize_fp8(transformer: nn.Module) -> int:
    """Swap the repeated blocks' linears for :class:`Float8Linear` in place; returns how many."""
    count = 0
    for block in repeated_blocks(transformer):
        for name, child in list(block.named_modules()):
            if type(child) is not nn.Linear or "norm" in name.split(".")[0]:
                continue
            if child.in_features % 16 or child.out_features % 16:  # FP8 GEMM shape rule
                continue
            if child.weight.is_cuda and child.weight.dtype != torch.bfloat16:  # kept in fp32 by the model
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, attr, Float8Linear(child))
            count += 1
    return count
