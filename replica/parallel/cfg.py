"""CFG parallelism: branch i of classifier-free guidance runs on cfg rank i; one all-gather per step."""

from __future__ import annotations

import torch

from .collectives import all_gather_stacked
from .mesh import ParallelMesh


def cfg_all_gather(noise_pred_local: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """Stack every cfg rank's prediction: (cfg_size, *noise_pred_local.shape), branch i from cfg rank i.

    The engine combines the branches (e.g. uncond + scale · (cond − uncond)); every rank gets all of
    them, so every rank can take the scheduler step and stay in lockstep without another collective.
    """
    group = mesh.get_group("cfg")
    local = noise_pred_local.contiguous()
    if group is None:
        return local.unsqueeze(0)
    return all_gather_stacked(local, group)
