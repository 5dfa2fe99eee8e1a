"""Parallel layer of one engine replica: mesh, sharded attention, TP linears, model wrappers.

Typical use on every rank of a replica, after `torch.distributed.init_process_group`::

    dims = ParallelDims.from_flags(num_gpus=8, dp_size=1, cfg=2, ulysses=2, ring=2)
    mesh = build_mesh(dims, device_type="cuda")
    parallelize_flux(transformer, mesh=mesh)          # in place
    pred = transformer(**full_inputs_of_my_cfg_branch)[0]   # full output on every rank
    preds = cfg_all_gather(pred, mesh)                 # (cfg_size, ...) branch i from cfg rank i
"""

import importlib
from typing import TYPE_CHECKING

from .attention import BACKENDS, AttentionBackend, attention, merge_partial, select_backend
from .cfg import cfg_all_gather
from .dims import ParallelDims
from .mesh import ParallelMesh, build_mesh
from .tp import ColumnParallelLinear, RowParallelLinear, ShardedRMSNorm

if TYPE_CHECKING:
    from .flux import FluxParallelAttnProcessor, parallelize_flux
    from .wan import WanParallelAttnProcessor, parallelize_wan

# The model wrappers load diffusers' models: imported on first use (PEP 562), so that config readers, which
# import `.dims` (the `serve` CLI checks a layout), do not spend seconds of CPU on them.
_MODEL_WRAPPERS = {
    "FluxParallelAttnProcessor": "flux",
    "parallelize_flux": "flux",
    "WanParallelAttnProcessor": "wan",
    "parallelize_wan": "wan",
}


def __getattr__(name: str):
    if name not in _MODEL_WRAPPERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODEL_WRAPPERS[name]}", __name__), name)
    globals()[name] = value
    return value


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
