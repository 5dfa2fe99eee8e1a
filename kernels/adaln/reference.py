"""Plain torch adaLN modulation (the CPU fallback and the tests' reference)."""

import torch
import torch.nn.functional as F


def adaln_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    shift: torch.Tensor,  # [batch, hidden]
    scale: torch.Tensor,  # [batch, hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden], x's dtype: LayerNorm(x) · (1 + scale[b]) + shift[b], in fp32
    rows = x.shape[0] // max(shift.shape[0], 1)
    xf = x.float().view(shift.shape[0], rows, x.shape[1])
    y = F.layer_norm(xf, (x.shape[1],), eps=eps) * (1 + scale.float()[:, None]) + shift.float()[:, None]
    return y.view_as(x).to(x.dtype)
