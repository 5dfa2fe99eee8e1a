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


def adaln_shrink_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    shift: torch.Tensor,  # [batch, hidden]
    scale: torch.Tensor,  # [batch, hidden]
    eps: float,
    a_stacked: torch.Tensor,  # [num_slices, max_loras, ≥ max_rank, hidden]
    row_slot: torch.Tensor,  # [batch] int32, -1 = no adapter
    row_scale: torch.Tensor,  # [batch] fp32
    slot_rank: torch.Tensor,  # [max_loras] int32
    max_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # y; s [num_slices, num_tokens, max_rank rounded up to 16], x's dtype
    """y = adaln_ref(...), and s[j, rows of b, :r] = row_scale[b] · y · A[j, row_slot[b], :r]ᵀ (r the slot's
    rank; y as stored, in x's dtype), zero elsewhere."""
    y = adaln_ref(x, shift, scale, eps)
    batch = shift.shape[0]
    rows = x.shape[0] // max(batch, 1)
    cols = -(-max_rank // 16) * 16
    s = torch.zeros(a_stacked.shape[0], x.shape[0], cols, dtype=torch.float32, device=x.device)
    ranks = slot_rank.tolist()
    for b, (slot, sc) in enumerate(zip(row_slot.tolist(), row_scale.tolist(), strict=True)):
        if slot < 0:
            continue
        r = min(ranks[slot], max_rank)
        yb = y[b * rows : (b + 1) * rows].float()
        for j in range(a_stacked.shape[0]):
            s[j, b * rows : (b + 1) * rows, :r] = sc * (yb @ a_stacked[j, slot, :r].float().T)
    return y, s.to(x.dtype)
