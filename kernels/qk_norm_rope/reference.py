"""Plain torch RMSNorm + interleaved-pair rotary (the CPU path and the tests' reference): the same
arithmetic as diffusers' Wan attention, which normalises q and k with ``torch.nn.RMSNorm`` and then turns
each (even, odd) pair by ``cos[..., 0::2]`` / ``sin[..., 1::2]`` of its tables."""

import torch
import torch.nn.functional as F


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., S, H, D) turned per (even, odd) channel pair; cos/sin broadcast to (..., S, 1, D) with each
    pair's value repeated (Wan's tables). In fp32 where the tables are, in x's dtype out."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)


def qk_norm_rope_ref(
    x: torch.Tensor,  # [batch, tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float | None,
    cos: torch.Tensor,  # [tokens, head_dim]
    sin: torch.Tensor,  # [tokens, head_dim]
) -> torch.Tensor:  # [batch, tokens, heads, head_dim]
    head_dim = cos.shape[-1]
    y = F.rms_norm(x, (x.shape[-1],), weight, eps).unflatten(-1, (-1, head_dim))
    return rotate_pairs(y, cos[:, None], sin[:, None])
