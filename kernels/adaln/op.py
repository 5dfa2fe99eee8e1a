"""Launcher and torch custom op for the one-pass adaLN modulation (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import num_programs_limit, use_triton
from ditserve.kernels.adaln.reference import adaln_ref

# Tiles: "BLOCK_M/BLOCK_K/num_warps/num_stages" (BLOCK_M rows of one batch element per program, BLOCK_K
# columns per step of both passes). benchmarks/kernels/adaln.py times them (the GPU tests run each); DEFAULT
# won on large batches, SMALL on batches of fewer row blocks than SMs (benchmarks/results/adaln_h200_*.md).
SWEEP: dict[str, dict[str, int]] = {
    "32/64/4/2": dict(BLOCK_M=32, BLOCK_K=64, num_warps=4, num_stages=2),
    "32/128/8/2": dict(BLOCK_M=32, BLOCK_K=128, num_warps=8, num_stages=2),
    "64/64/8/2": dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=2),
    "16/256/8/2": dict(BLOCK_M=16, BLOCK_K=256, num_warps=8, num_stages=2),
}
DEFAULT = SWEEP["32/128/8/2"]
SMALL = SWEEP["16/256/8/2"]


def adaln_config(num_tokens: int, num_sms: int) -> dict[str, int]:
    """DEFAULT, or for batches with fewer 32-row blocks than the device has SMs, SMALL (more programs)."""
    return SMALL if num_tokens < DEFAULT["BLOCK_M"] * num_sms else DEFAULT


def launch_adaln(
    x: torch.Tensor,  # [num_tokens, hidden] bf16/fp16/fp32, contiguous
    shift: torch.Tensor,  # [batch, hidden] (num_tokens = batch · tokens per element), hidden contiguous
    scale: torch.Tensor,  # [batch, hidden]
    eps: float,
    config: dict[str, int] | None = None,
) -> torch.Tensor:  # y, like x
    from ditserve.kernels.adaln.kernel import _adaln_kernel

    num_tokens, hidden = x.shape
    batch = shift.shape[0]
    assert x.dim() == 2 and x.is_contiguous(), (x.shape, x.stride())
    assert x.numel() < 2**31, f"{x.numel()} elements: the kernel's offsets are 32-bit"
    assert shift.shape == scale.shape == (batch, hidden), (shift.shape, scale.shape, x.shape)
    assert shift.stride(1) == 1 and scale.stride(1) == 1, "hidden dim of shift/scale must be contiguous"
    assert batch > 0 and num_tokens % batch == 0, f"{num_tokens} tokens are not {batch} equal rows"
    y = torch.empty_like(x)
    if num_tokens == 0:
        return y
    cfg = dict(config or adaln_config(num_tokens, num_programs_limit(x.device)))
    rows = num_tokens // batch
    grid = (-(-rows // cfg["BLOCK_M"]), batch)
    _adaln_kernel[grid](x, shift, scale, y, hidden, rows, eps, shift.stride(0), scale.stride(0), **cfg)
    return y


@torch.library.custom_op("ditserve::adaln", mutates_args=())
def adaln_op(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm(x) · (1 + scale[b]) + shift[b] in one pass; Triton on CUDA (or TRITON_INTERPRET=1), else
    the torch reference."""
    if use_triton(x):
        return launch_adaln(x, shift, scale, eps)
    return adaln_ref(x, shift, scale, eps)


@adaln_op.register_fake
def _(x, shift, scale, eps):
    return torch.empty_like(x)


def adaln(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``LayerNorm(x) · (1 + scale[:, None]) + shift[:, None]`` for x ``[batch, tokens, hidden]`` and shift,
    scale ``[batch, hidden]``: diffusers' adaLN-Zero modulation (LayerNorm without affine), one kernel."""
    return adaln_op(x.contiguous().view(-1, x.shape[-1]), shift, scale, eps).view(x.shape)
