"""Launcher and torch custom op for the one-pass q/k RMSNorm + rotary (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import next_pow2, use_triton
from ditserve.kernels.qk_norm_rope.reference import qk_norm_rope_ref


def _num_warps(pairs: int) -> int:
    return max(1, min(16, pairs // 128))


def launch_qk_norm_rope(
    x: torch.Tensor,  # [batch, tokens, hidden], contiguous
    weight: torch.Tensor,  # [hidden]
    eps: float,
    cos: torch.Tensor,  # [tokens, head_dim] fp32, contiguous
    sin: torch.Tensor,  # [tokens, head_dim] fp32, contiguous
) -> torch.Tensor:  # [batch, tokens, hidden], x's dtype
    from ditserve.kernels.qk_norm_rope.kernel import _qk_norm_rope_kernel

    batch, tokens, hidden = x.shape
    head_dim = cos.shape[-1]
    assert x.is_contiguous(), (x.shape, x.stride())
    assert weight.shape == (hidden,) and weight.is_contiguous(), (weight.shape, hidden)
    assert cos.shape == sin.shape == (tokens, head_dim), (cos.shape, sin.shape, tokens)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32
    assert head_dim % 2 == 0 and hidden % head_dim == 0, (hidden, head_dim)
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    pairs = next_pow2(hidden // 2)
    _qk_norm_rope_kernel[(batch * tokens,)](
        x, weight, cos, sin, y, hidden, tokens, eps,
        HALF_HEAD=head_dim // 2, PAIRS=pairs, num_warps=_num_warps(pairs),
    )  # fmt: skip
    return y


@torch.library.custom_op("ditserve::qk_norm_rope", mutates_args=())
def qk_norm_rope_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """RMSNorm(x) · weight, then each head's (even, odd) channel pairs turned by the token's cos/sin; Triton
    on CUDA (or TRITON_INTERPRET=1), else the torch reference. Returns [batch, tokens, hidden]."""
    if use_triton(x):
        return launch_qk_norm_rope(x, weight, eps, cos, sin)
    return qk_norm_rope_ref(x, weight, eps, cos, sin).flatten(-2)


@qk_norm_rope_op.register_fake
def _(x, weight, eps, cos, sin):
    return torch.empty_like(x)


def qk_norm_rope(
    x: torch.Tensor, norm: torch.nn.RMSNorm, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``rotate(norm(x))`` for x [batch, tokens, heads · head_dim] and Wan's rotary tables cos/sin
    (broadcastable to [1, tokens, 1, head_dim], each pair's value repeated): [batch, tokens, heads, head_dim]
    in x's dtype. ``norm`` is a ``torch.nn.RMSNorm`` over the whole hidden, with its weight."""
    head_dim = cos.shape[-1]
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    tables = [t.reshape(-1, head_dim).float().contiguous() for t in (cos, sin)]
    out = qk_norm_rope_op(x.contiguous(), norm.weight, eps, *tables)
    return out.unflatten(-1, (-1, head_dim))
