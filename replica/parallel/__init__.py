"""Parallel layer of one engine replica: mesh, sharded attention, TP linears, model wrappers.

Typical use on every rank of a replica, after `torch.distributed.init_process_group`::

    dims = ParallelDims.from_flags(num_gpus=8, dp_size=1, cfg=2, ulysses=2, ring=2)
    mesh = build_mesh(dims, device_type="cuda")
    parallelize_flux(transformer, mesh=mesh)          # in place
    pred = transformer(**full_inputs_of_my_cfg_branch)[0]   # full output on every rank
    preds = cfg_all_gather(pred, mesh)                 # (cfg_size, ...) branch i from cfg rank i
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING

from .dims import ParallelDims

if TYPE_CHECKING:
    from .attention import BACKENDS, AttentionBackend, attention, merge_partial, select_backend
    from .cfg import cfg_all_gather
    from .flux import FluxParallelAttnProcessor, parallelize_flux
    from .mesh import ParallelMesh, build_mesh
    from .tp import ColumnParallelLinear, RowParallelLinear, ShardedRMSNorm
    from .wan import WanParallelAttnProcessor, parallelize_wan

# Imported on first use (PEP 562): config readers import `.dims` (the `serve` CLI checks a layout before Ray
# starts) and need neither torch (1.5-2 s of CPU) nor diffusers' models (the model wrappers, seconds more).
_LAZY = {
    **dict.fromkeys(
        ("BACKENDS", "AttentionBackend", "attention", "merge_partial", "select_backend"), "attention"
    ),
    "cfg_all_gather": "cfg",
    "ParallelMesh": "mesh",
    "build_mesh": "mesh",
    **dict.fromkeys(("ColumnParallelLinear", "RowParallelLinear", "ShardedRMSNorm"), "tp"),
    "FluxParallelAttnProcessor": "flux",
    "parallelize_flux": "flux",
    "WanParallelAttnProcessor": "wan",
    "parallelize_wan": "wan",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule `.attention` binds it here under its own name: the package's `attention`
        # stays the function, as it was when the package imported it at once.
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "ColumnParallelLinear",
    "FluxParallelAttnProcessor",
    "ParallelDims",
    "ParallelMesh",
    "RowParallelLinear",
    "ShardedRMSNorm",
    "WanParallelAttnProcessor",
    "attention",
    "build_mesh",
    "cfg_all_gather",
    "merge_partial",
    "parallelize_flux",
    "parallelize_wan",
    "select_backend",
]
