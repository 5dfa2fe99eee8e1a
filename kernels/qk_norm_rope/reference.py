"""Plain torch q/k RMSNorm + rotary (the tests' reference, and the rotations the CPU path runs after the
modules' own norms): the same arithmetic as diffusers' Wan, Qwen-Image and Z-Image attention processors."""

import torch


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., S, H, D) turned per (even, odd) channel pair; cos/sin broadcast to (..., S, 1, D) with each
    pair's value repeated (Wan's tables). In fp32 where the tables are, in x's dtype out."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)


def rotate_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary positions given as a complex table (Qwen-Image's and Z-Image's ``freqs_cis``): x (B, S, H, D) as
    D/2 (real, imaginary) channel pairs, freqs (..., S, D/2) complex, broadcast over the heads. The product is
    written out in real arithmetic, the complex product's own formula in fp32, so that torch.compile fuses it
    with q/k's norm and cast: inductor runs complex tensors as separate eager kernels with fp32 round trips."""
    table = torch.view_as_real(freqs).unsqueeze(-3)  # (..., S, 1, D/2, 2)
    cos, sin = table[..., 0], table[..., 1]
    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2).type_as(x)


def qk_norm_rope_ref(
    x: torch.Tensor,  # [batch, tokens, heads · head_dim]
    weight: torch.Tensor,  # [heads · head_dim], or [head_dim] with per_head
    eps: float,
    cos: torch.Tensor,  # [1 or batch, tokens, head_dim] fp32: pair i turns by cos[..., 2i] ...
    sin: torch.Tensor,  # ... and sin[..., 2i + 1]
    per_head: bool = False,
    round_before_weight: bool = False,
) -> torch.Tensor:  # [batch, tokens, heads, head_dim], x's dtype
    """The kernel's definition: ``torch.nn.RMSNorm`` over the row (x · rstd · w in fp32, rounded once), or
    with ``per_head`` and ``round_before_weight`` diffusers' ``RMSNorm`` over each head (x · rstd rounded to
    x's dtype, then · w rounded), then `rotate_pairs` by the token's (and batch row's) table."""
    head_dim = cos.shape[-1]
    xf = x.float().unflatten(-1, (-1, head_dim)) if per_head else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if round_before_weight:
        y = y.to(x.dtype).float()
    y = (y * weight.float()).to(x.dtype)
    y = y if per_head else y.unflatten(-1, (-1, head_dim))
    return rotate_pairs(y, cos[:, :, None], sin[:, :, None])
