"""One named DeviceMesh per replica, passed around as an argument (never a module-level group).

Axes, outermost first: ``cfg, ring, kv_gather, ulysses, tp`` (one of ring / kv_gather is always 1;
axes of degree 1 are left out of the DeviceMesh, `get_optional_mesh` returns None for them). Global rank = (((cfg · R + ring) · G + kv_gather) · U + ulysses) · T + tp.

Example, 8 ranks, cfg 2 × ring 2 × ulysses 2 (tp 1, kv_gather 1)::

    rank:      0  1  2  3  4  5  6  7
    cfg:       0  0  0  0  1  1  1  1      cfg groups     {0,4} {1,5} {2,6} {3,7}
    ring:      0  0  1  1  0  0  1  1      ring groups    {0,2} {1,3} {4,6} {5,7}   (strided)
    ulysses:   0  1  0  1  0  1  0  1      ulysses groups {0,1} {2,3} {4,5} {6,7}   (contiguous)
    sp shard:  0  1  2  3  0  1  2  3      sp groups      {0,1,2,3} {4,5,6,7}

The image sequence is cut into sp = ring·ulysses shards; rank r holds shard ``ring·U + ulysses``, so
after the Ulysses all-to-all a ulysses group holds one contiguous ring block. With tp 2 × ulysses 2 ×
ring 2 instead, tp pairs are {0,1} {2,3} {4,5} {6,7}, ulysses pairs {0,2} {1,3} {4,6} {5,7}, ring pairs
{0,4} {1,5} {2,6} {3,7}; TP ranks share one sequence shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .dims import AXES, SP_AXES, ParallelDims


def _backend_override(timeout: timedelta) -> tuple[str, object] | None:
    """Options that carry our timeout into DeviceMesh's subgroups (they otherwise get 30 min)."""
    backend = str(dist.get_backend())
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        opts = dist.ProcessGroupNCCL.Options()
    else:  # mixed "cpu:gloo,cuda:nccl" strings etc.: keep torch's defaults
        return None
    opts._timeout = timeout
    return (backend, opts)


def build_mesh(
    dims: ParallelDims, device_type: str = "cpu", *, timeout: timedelta = timedelta(minutes=5)
) -> ParallelMesh:
    """Build the named DeviceMesh of `dims` (call after `init_process_group`, on every rank)."""
    return ParallelMesh.build(dims, device_type=device_type, timeout=timeout)


@dataclass(frozen=True)
class ParallelMesh:
    """The replica's DeviceMesh plus the derived 'sp' (sequence) axis and per-axis rank helpers."""

    dims: ParallelDims
    device_mesh: DeviceMesh
    sp_mesh: DeviceMesh | None  # None when the sequence is not split

    @classmethod
    def build(cls, dims: ParallelDims, *, device_type: str, timeout: timedelta) -> ParallelMesh:
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group before build_mesh")
        world = dist.get_world_size()
        if world != dims.world_size:
            raise ValueError(
                f"the process group has {world} ranks but the layout {dims.describe()} needs "
                f"{dims.world_size}; start {dims.world_size} ranks per replica or change the degrees."
            )
        override = _backend_override(timeout)
        # Only axes of degree > 1 get a mesh dim: a degree-1 axis would cost one process group per rank
        # and carry no traffic. Rank order is unchanged by dropping size-1 dims.
        names = tuple(a for a in AXES if getattr(dims, a) > 1) or ("cfg",)
        shape = tuple(getattr(dims, a) for a in names)
        mesh = init_device_mesh(
            device_type,
            shape,
            mesh_dim_names=names,
            backend_override=None if override is None else {a: override for a in names},
        )
        # One flattened axis for the sequence: the final all-gather runs over it in shard order.
        sp_names = tuple(a for a in SP_AXES if a in names)
        sp_mesh = None
        if len(sp_names) == 1:
            sp_mesh = mesh[sp_names[0]]
        elif len(sp_names) > 1:
            sp_mesh = mesh[sp_names]._flatten("sp", backend_override=override)
        return cls(dims=dims, device_mesh=mesh, sp_mesh=sp_mesh)

    # ---- axis access ------------------------------------------------------------------------------
    def get_optional_mesh(self, name: str) -> DeviceMesh | None:
        """The 1-D mesh of axis `name` ("sp" included), or None when its degree is 1.

        None lets call sites skip the communication with one `if`.
        """
        if name == "sp":
            return self.sp_mesh
        if name not in AXES:
            raise KeyError(f"unknown mesh axis {name!r}; axes are {AXES + ('sp',)}")
        names = self.device_mesh.mesh_dim_names or ()
        if name not in names or self.device_mesh.size(names.index(name)) == 1:
            return None
        return self.device_mesh[name]

    def get_group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of axis `name` that holds this rank, or None for degree 1."""
        mesh = self.get_optional_mesh(name)
        return None if mesh is None else mesh.get_group()

    def size(self, name: str) -> int:
        mesh = self.get_optional_mesh(name)
        return 1 if mesh is None else mesh.size()

    def local_rank(self, name: str) -> int:
        mesh = self.get_optional_mesh(name)
        return 0 if mesh is None else mesh.get_local_rank()

    def destroy(self) -> None:
        """Destroy this mesh's subgroups (not the default group); the mesh is unusable afterwards.

        Each gloo group keeps worker threads; a process that builds many meshes (tests, a weights swap
        that changes layout) should destroy the ones it no longer needs.
        """
        groups = [self.device_mesh.get_group(n) for n in self.device_mesh.mesh_dim_names or ()]
        if self.sp_mesh is not None and self.sp_mesh.mesh_dim_names == ("sp",):
            groups.append(self.sp_mesh.get_group())
        for group in groups:
            if group is not dist.group.WORLD and group != dist.distributed_c10d._get_default_group():
                dist.destroy_process_group(group)

    # Named shortcuts, read by the engine and the wrappers.
    @property
    def cfg_rank(self) -> int:
        return self.local_rank("cfg")

    @property
    def cfg_size(self) -> int:
        return self.size("cfg")

    @property
    def tp_rank(self) -> int:
        return self.local_rank("tp")

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def ulysses_rank(self) -> int:
        return self.local_rank("ulysses")

    @property
    def ulysses_size(self) -> int:
        return self.size("ulysses")

    @property
    def ring_rank(self) -> int:
        return self.local_rank("ring")

    @property
    def ring_size(self) -> int:
        return self.size("ring")

    @property
    def kv_gather_rank(self) -> int:
        return self.local_rank("kv_gather")

    @property
    def kv_gather_size(self) -> int:
        return self.size("kv_gather")

    @property
    def sp_rank(self) -> int:
        """Index of this rank's sequence shard (ring-or-gather rank · ulysses + ulysses rank)."""
        return self.local_rank("sp")

    @property
    def sp_size(self) -> int:
        return self.size("sp")

    def groups_of(self, name: str) -> list[list[int]]:
        """Every group of axis `name` as sorted lists of global ranks (see `ParallelDims.groups`)."""
        return self.dims.groups(name)
