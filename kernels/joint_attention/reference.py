"""What the joint kernel computes, as diffusers' ``JointAttnProcessor2_0`` computes it: the two streams
concatenated [image; text], SDPA, the output split back."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def joint_attention_ref(
    img: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    txt: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """img, txt: (q, k, v), each [batch, tokens, heads · head_dim] → (image out, text out) of the same
    shapes, in q's dtype."""
    num_img = img[0].shape[1]
    q, k, v = (
        torch.cat([a, b], dim=1).unflatten(-1, (-1, head_dim)).transpose(1, 2)
        for a, b in zip(img, txt, strict=True)
    )
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2).to(q.dtype)
    return out[:, :num_img], out[:, num_img:]
