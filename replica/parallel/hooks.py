"""Bookkeeping shared by the model wrappers: per-forward state and the handle left on the model."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .mesh import ParallelMesh
from .sequence import SequenceLayout


@dataclass
class ForwardState:
    """What the first-block split learned about this forward, read by processors and the final gather.

    Written by the model's pre-forward hook at the start of every forward, so it never goes stale.
    """

    layout: SequenceLayout | None = None
    num_text: int = 0
    # Family bookkeeping written by a plan's ``on_forward`` (e.g. masks, replicated-token counts).
    extra: dict[str, Any] = field(default_factory=dict)

    def require_layout(self) -> SequenceLayout:
        assert self.layout is not None, "parallel forward state read before the model's pre-forward hook ran"
        return self.layout


@dataclass
class ParallelHandle:
    """Left on a parallelized model as `model._ditserve_parallel` (for the engine, logs, and undo)."""

    mesh: ParallelMesh
    state: ForwardState
    family: str
    tp_modules: list[str] = field(default_factory=list)
    hooks: list[RemovableHandle] = field(default_factory=list)


ATTR = "_ditserve_parallel"


def claim(model: nn.Module, mesh: ParallelMesh, family: str) -> ParallelHandle:
    if getattr(model, ATTR, None) is not None:
        raise ValueError(f"this {type(model).__name__} is already parallelized; build a fresh model instead")
    handle = ParallelHandle(mesh=mesh, state=ForwardState(), family=family)
    setattr(model, ATTR, handle)
    return handle


def begin_parallelize(
    model: nn.Module, mesh: ParallelMesh, family: str, *, num_heads: int | None = None
) -> ParallelHandle:
    """What every ``parallelize`` starts with: check the layout against the model's heads, refuse fused
    projections (they must be sharded unfused), then claim the model."""
    heads = num_heads if num_heads is not None else model.config.num_attention_heads
    mesh.dims.validate(num_heads=heads, attention_supports_lse=True)
    for name, module in model.named_modules():
        if getattr(module, "fused_projections", False):
            raise ValueError(f"{name} has fused projections; parallelize before fuse_qkv_projections()")
    return claim(model, mesh, family)


def bind_forward_args(fn: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Turn a forward call's positional + keyword arguments into one dict of keyword arguments."""
    return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)
