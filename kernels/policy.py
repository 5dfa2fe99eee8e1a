"""Which kernel variants the LoRA ops may take: one frozen object, built once from the environment.

The launchers take a `policy` argument; the torch custom ops (which take tensors and plain values only) use
`active_policy()`. A benchmark that times the whole engine under another policy builds its own and runs
under `use_policy(...)`, which swaps the active one for the duration and restores it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    # the Gluon kernels on Hopper where their contract holds and where they were measured faster
    # (DITSERVE_GLUON_GEMM=0: the Triton kernels everywhere)
    gluon: bool = True
    # the shrink inside the GEMM launch where the batch allows it (False: the shrink kernel, then the GEMM)
    shrink_in: bool = True
    # the one Gluon launch only where `lora_linear.op.one_launch_pays` (False: wherever it applies)
    one_launch_rule: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelPolicy:
        return cls(gluon=environ.get("DITSERVE_GLUON_GEMM", "1") != "0")


_ACTIVE = [KernelPolicy.from_env()]


def active_policy() -> KernelPolicy:
    """The policy the custom ops run under: the environment's, unless inside `use_policy`."""
    return _ACTIVE[-1]


@contextlib.contextmanager
def use_policy(policy: KernelPolicy) -> Iterator[KernelPolicy]:
    """Run the custom ops under `policy` (every thread of the process) until the block ends."""
    _ACTIVE.append(policy)
    try:
        yield policy
    finally:
        _ACTIVE.pop()
