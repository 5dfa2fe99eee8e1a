"""K/V-gather: all-gather K/V once and attend local queries to all of it.

Cheaper than a ring at small degree (one collective, one attention call, no LSE needed), at the cost of
holding the whole K/V block. Layout: (batch, heads, seq, head_dim).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .attention import attention
from .collectives import all_gather_stacked


def kv_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    num_valid: int,
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attend q to every rank's K/V block; keys past `num_valid` (sequence padding) are dropped."""
    world = dist.get_world_size(group)
    kv = torch.stack([k, v]).contiguous()  # (2, B, H, S, D)
    gathered = all_gather_stacked(kv, group)
    two, b, h, s, d = kv.shape
    # (G, 2, B, H, S, D) → (2, B, H, G·S, D) in shard order; padding sits at the end, so slice it off
    full = gathered.permute(1, 2, 3, 0, 4, 5).reshape(two, b, h, world * s, d)[:, :, :, :num_valid]
    kf, vf = full[0], full[1]
    if prefix_kv is not None:
        kf = torch.cat([prefix_kv[0], kf], dim=2)
        vf = torch.cat([prefix_kv[1], vf], dim=2)
    out, _ = attention(q, kf, vf, need_lse=False)
    return out
