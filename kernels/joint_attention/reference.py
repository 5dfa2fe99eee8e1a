"""What the joint kernel computes, as diffusers' ``JointAttnProcessor2_0`` computes it: the two streams
concatenated [image; text], SDPA, the output split back."""

from __future__ import annotations

import torch
import torch.nn.functional as F

QNorm = tuple[torch.Tensor, float]  # a per-head RMSNorm's weight [head_dim] and eps


def rms_norm_heads(x: torch.Tensor, norm: QNorm, head_dim: int) -> torch.Tensor:
    """diffusers' ``RMSNorm(head_dim)`` on each head of x [batch, tokens, heads · head_dim]."""
    weight, eps = norm
    h = x.unflatten(-1, (-1, head_dim))
    y = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(weight.dtype) * weight).flatten(-2)


def joint_attention_ref(
    img: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    txt: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    head_dim: int,
    q_norms: tuple[QNorm, QNorm] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """img, txt: (q, k, v), each [batch, tokens, heads · head_dim] → (image out, text out) of the same
    shapes, in q's dtype. ``q_norms``: each stream's q RMSNorm (image, text), applied first."""
    if q_norms is not None:
        img = (rms_norm_heads(img[0], q_norms[0], head_dim), *img[1:])
        txt = (rms_norm_heads(txt[0], q_norms[1], head_dim), *txt[1:])
    num_img = img[0].shape[1]
    q, k, v = (
        torch.cat([a, b], dim=1).unflatten(-1, (-1, head_dim)).transpose(1, 2)
        for a, b in zip(img, txt, strict=True)
    )
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2).to(q.dtype)
    return out[:, :num_img], out[:, num_img:]
