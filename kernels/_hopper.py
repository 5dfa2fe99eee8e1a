"""Hopper (sm_90) facts the Gluon launchers share: shared memory and registers of an SM, the Triton versions
the Gluon kernels were tested with, whether they can run here, and TMA descriptors in Gluon's layouts."""

from __future__ import annotations

import functools

import torch

SMEM_LIMIT = 232448  # bytes of shared memory a program may use on sm_90
REGISTERS = 65536  # 32-bit registers of an SM, shared by a program's warps

# Triton versions (major, minor) the Gluon kernels were compiled and tested with on a Hopper GPU. Gluon's
# API and checks still change between versions: Triton 3.9 renames the TMA copies and the CTA barrier
# (`_gluon.py` takes either name: the same PTX on 3.6) and refuses a TMA box that differs from its
# shared-memory buffer, which the ring's LoRA load (dead code under FOLD) does; with any other version the
# Triton kernels run.
GLUON_TRITON = ((3, 6),)


def gluon_triton_ok(version: str) -> bool:
    """Whether the Gluon kernels are used with this Triton version ("3.6.0" yes; "3.9.0" not yet)."""
    major, minor = (int(p) for p in version.split(".")[:2])
    return (major, minor) in GLUON_TRITON


@functools.cache
def gluon_available(device_index: int) -> bool:
    """A Hopper GPU (warpgroup MMA) and a Triton with Gluon's Hopper module, of a version the kernels were
    tested with (`GLUON_TRITON`)."""
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    import triton

    if not gluon_triton_ok(triton.__version__):
        return False
    try:
        from ditserve.kernels import _gluon  # noqa: F401
    except ImportError:
        return False
    return True


def partition_regs(wg: int, warps: int) -> int:
    """Registers per thread a program of WG MMA partitions and the loader warp starts with (what ptxas reports
    for it: the warps counted in whole warpgroups, 8-register steps; 168 / 128 at WG 2 / 3)."""
    groups = -(-(wg * warps + 1) // 4)
    return REGISTERS // (groups * 4 * 32) // 8 * 8


def tma_desc(t: torch.Tensor, block: list[int]):
    """A TMA descriptor of t (bf16/fp16) for boxes of `block`, in the default shared layout of that box."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gdt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt))
