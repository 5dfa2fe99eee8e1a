"""The transformer's repeated blocks: what regional compilation and FP8 GEMMs work on."""

from __future__ import annotations

import torch.nn as nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The block instances of ``model``: those of the classes its ``_repeated_blocks`` names (diffusers'
    declaration), else every module of its block lists (ModuleLists of two or more modules of one class),
    for classes that declare none (SD3, HunyuanVideo 1.5)."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    blocks: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, nn.ModuleList) and len(child) >= 2 and len({type(b) for b in child}) == 1:
            blocks += list(child)
    return blocks
