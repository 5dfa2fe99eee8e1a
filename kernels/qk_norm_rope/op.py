"""Launcher, torch custom op and module-level entry points for the one-pass q/k RMSNorm + rotary (see
kernel.py). The entry points take the attention module's own norm: where the kernel cannot run it (off
CUDA, a head_dim that is not a power of two, a norm of another kind or dtype), they run the module and the
rotation in torch, as diffusers does."""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

from ditserve.kernels._dispatch import next_pow2, use_triton
from ditserve.kernels.qk_norm_rope.reference import qk_norm_rope_ref, rotate_complex, rotate_pairs


def launch_qk_norm_rope(
    x: torch.Tensor,  # [batch, tokens, heads · head_dim]
    weight: torch.Tensor,  # [heads · head_dim], or [head_dim] with per_head
    eps: float,
    cos: torch.Tensor,  # [1 or batch, tokens, head_dim] fp32
    sin: torch.Tensor,  # [1 or batch, tokens, head_dim] fp32
    per_head: bool = False,
    round_before_weight: bool = False,
) -> torch.Tensor:  # [batch, tokens, heads · head_dim], x's dtype
    from ditserve.kernels.qk_norm_rope.kernel import _qk_norm_rope_kernel

    batch, tokens, hidden = x.shape
    head_dim = cos.shape[-1]
    # rows one stride apart (a slice of a fused projection's output) are read in place, else copied
    try:
        rows = x.view(batch * tokens, hidden)
    except RuntimeError:
        rows = x.reshape(batch * tokens, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight, cos, sin = (t.contiguous() for t in (weight, cos, sin))
    assert head_dim == next_pow2(head_dim) and head_dim >= 2, f"head_dim {head_dim}: a power of two"
    assert hidden % head_dim == 0, (hidden, head_dim)
    assert weight.shape == ((head_dim,) if per_head else (hidden,)), (weight.shape, hidden, head_dim)
    assert cos.shape == sin.shape and cos.shape[1:] == (tokens, head_dim), (cos.shape, sin.shape, tokens)
    assert cos.shape[0] in (1, batch) and cos.dtype == sin.dtype == torch.float32, (cos.shape, cos.dtype)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous
    if x.numel() == 0:
        return y
    heads = hidden // head_dim
    heads_pad = next_pow2(heads)
    _qk_norm_rope_kernel[(batch * tokens,)](
        rows, weight, cos, sin, y, rows.stride(0) if rows.shape[0] > 1 else hidden, heads, tokens,
        0 if cos.shape[0] == 1 else tokens * head_dim, eps,
        HEAD_DIM=head_dim, HEADS_PAD=heads_pad, PER_HEAD=per_head, ROUND_BEFORE_WEIGHT=round_before_weight,
        num_warps=max(1, min(16, heads_pad * head_dim // 512)),
    )  # fmt: skip
    return y


@torch.library.custom_op("ditserve::qk_norm_rope", mutates_args=())
def qk_norm_rope_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    per_head: bool,
    round_before_weight: bool,
) -> torch.Tensor:
    """`launch_qk_norm_rope` on CUDA (or TRITON_INTERPRET=1), else the torch reference. Returns
    [batch, tokens, heads · head_dim]."""
    if use_triton(x):
        return launch_qk_norm_rope(x, weight, eps, cos, sin, per_head, round_before_weight)
    return qk_norm_rope_ref(x, weight, eps, cos, sin, per_head, round_before_weight).flatten(-2)


@qk_norm_rope_op.register_fake
def _(x, weight, eps, cos, sin, per_head, round_before_weight):
    return x.new_empty(x.shape)


# The entry points below run the kernel on CUDA tensors. Under Triton's CPU interpreter they run it only where
# this is set (the kernel's own tests): the interpreter runs one program per token row, and a model's CPU run
# would spend minutes in it for what the torch path computes alike.
interpret_on_cpu = False


def _kernel_runs(x: torch.Tensor, norm: nn.Module, head_dim: int) -> bool:
    weight = getattr(norm, "weight", None)
    return (
        (x.is_cuda or (interpret_on_cpu and use_triton(x)))
        and head_dim >= 2
        and head_dim == next_pow2(head_dim)
        and weight is not None
        and weight.dtype == x.dtype
    )


def qk_norm_rope(x: torch.Tensor, norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan: ``rotate_pairs(norm(x))`` for x [batch, tokens, heads · head_dim], ``norm`` a
    ``torch.nn.RMSNorm`` over the whole hidden, and Wan's rotary tables cos/sin ([1, tokens, 1, head_dim],
    each pair's value repeated): [batch, tokens, heads, head_dim] in x's dtype."""
    head_dim = cos.shape[-1]
    if type(norm) is not nn.RMSNorm or not _kernel_runs(x, norm, head_dim):
        return rotate_pairs(norm(x).unflatten(-1, (-1, head_dim)), cos, sin)
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    tables = [t.reshape(-1, x.shape[1], head_dim).float() for t in (cos, sin)]
    out = qk_norm_rope_op(x, norm.weight, eps, *tables, False, False)
    return out.unflatten(-1, (-1, head_dim))


def heads_qk_norm_rope(
    x: torch.Tensor, norm: nn.Module, rotary_emb: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """FLUX.2: diffusers' ``apply_rotary_emb(norm(x), rotary_emb, sequence_dim=1)`` for x [batch, tokens,
    heads, head_dim] (rows may be a slice of a wider projection's output), ``norm`` a ``torch.nn.RMSNorm``
    per head and real tables cos/sin [tokens, head_dim] (each pair's value repeated): [batch, tokens, heads,
    head_dim] in x's dtype."""
    cos, sin = rotary_emb
    head_dim = x.shape[-1]
    if (
        type(norm) is not nn.RMSNorm
        or tuple(norm.normalized_shape) != (head_dim,)
        or not _kernel_runs(x, norm, head_dim)
        or cos.shape[-1] != head_dim
    ):
        return apply_rotary_emb(norm(x), rotary_emb, sequence_dim=1)
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    tables = [t.reshape(-1, x.shape[1], head_dim).float() for t in (cos, sin)]
    out = qk_norm_rope_op(x.flatten(-2), norm.weight, eps, *tables, True, False)
    return out.unflatten(-1, (-1, head_dim))


def head_qk_norm_rope(x: torch.Tensor, norm: nn.Module | None, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen-Image / Z-Image: ``rotate_complex(norm(x), freqs)`` for x [batch, tokens, heads, head_dim],
    ``norm`` diffusers' ``RMSNorm(head_dim)`` (or None) and a complex table freqs ([tokens, head_dim / 2] or
    [batch, tokens, head_dim / 2]): [batch, tokens, heads, head_dim] in x's dtype."""
    head_dim = x.shape[-1]
    if (
        type(norm) is not DiffusersRMSNorm
        or norm.bias is not None
        or not _kernel_runs(x, norm, head_dim)
        or x.shape[1] != freqs.shape[-2]
    ):
        return rotate_complex(x if norm is None else norm(x), freqs)
    table = torch.view_as_real(freqs).flatten(-2).float()
    table = table if table.dim() == 3 else table[None]
    out = qk_norm_rope_op(x.flatten(-2), norm.weight, norm.eps, table, table, True, True)
    return out.unflatten(-1, (-1, head_dim))
