"""Small wrappers over torch.distributed collectives that every backend (gloo included) accepts."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(…) → (world, …): one `all_gather_into_tensor`, rank i's tensor at index i.

    gloo wants the output as the flat concatenation along dim 0, so gather into (world·d0, …) and view.
    """
    world = dist.get_world_size(group)
    x = x.contiguous()
    if x.dim() == 0:
        x = x.reshape(1)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; keep both working
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)
    return out.view(world, *x.shape)
