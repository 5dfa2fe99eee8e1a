"""Plain torch adaLN modulation and shrink (the CPU fallback and the tests' reference)."""

import torch
import torch.nn.functional as F

from ditserve.kernels.lora_shrink.reference import lora_shrink_ref, lora_shrink_scaled_ref


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


def adaln_shrink_ref(x, shift, scale, eps, a_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale,
                     slot_rank, rank_dim):  # fmt: skip
    """(y, s): y as adaln_ref, s the segmented shrink of y (scaled as `lora_shrink_scaled_ref` when
    seg_scale is given, else fp32 unscaled)."""
    y = adaln_ref(x, shift, scale, eps)
    if seg_scale is None:
        return y, lora_shrink_ref(y, a_stacked, seg_start, seg_len, seg_slot, slot_rank, rank_dim)
    s = lora_shrink_scaled_ref(y, a_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
                               rank_dim)  # fmt: skip
    return y, s
