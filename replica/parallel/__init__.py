"""Parallel layer of one engine replica: mesh, sharded attention, TP linears, model wrappers.

Typical use on every rank of a replica, after `torch.distributed.init_process_group`::

    dims = ParallelDims.from_flags(num_gpus=8, dp_size=1, cfg=2, ulysses=2, ring=2)
    mesh = build_mesh(dims, device_type="cuda")
    parallelize_flux(transformer, mesh=mesh)          # in place
    pred = transformer(**full_inputs_of_my_cfg_branch)[0]   # full output on every rank
    preds = cfg_all_gather(pred, mesh)                 # (cfg_size, ...) branch i from cfg rank i
"""

from .attention import BACKENDS, AttentionBackend, attention, merge_partial, select_backend
from .cfg import cfg_all_gather
from .dims import ParallelDims
from .flux import FluxParallelAttnProcessor, parallelize_flux
from .mesh import ParallelMesh, build_mesh
from .tp import ColumnParallelLinear, RowParallelLinear, ShardedRMSNorm
from .wan import WanParallelAttnProcessor, parallelize_wan

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
