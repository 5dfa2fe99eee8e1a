"""Which expand kernel and tiles a batch takes: `choose(problem, device, policy)` over the tuned tables
(`tuned_<gpu>.json`, measured on an H200: benchmarks/results/lora_kernels_h200_*.md and the log they link).

- y += delta (no bias): the Gluon kernel (policy.gluon) where it was measured faster (3 slices at rank tile 128;
  the launch falls back to the Triton tiles where its contract does not hold, e.g. off Hopper), else the
  row-stationary Triton kernel (ROWS=1: a program keeps its rows' scaled s across CHUNK column blocks).
- With a bias, or writing y (no accumulate): one y tile per program, larger tiles as the rank grows (each
  program re-reads an s tile and a B tile from L2 for its y tile).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ditserve.kernels._configs import key, tables
from ditserve.kernels.policy import KernelPolicy, active_policy

_DIR = Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class ExpandProblem:
    num_slices: int  # 1..4
    rank_tile: int  # block_rank(s columns): 16..128
    accumulate: bool = True  # y += delta (False: y = delta + bias)
    has_bias: bool = False


def choose(
    problem: ExpandProblem, device: torch.device, policy: KernelPolicy | None = None
) -> dict[str, int]:
    """The expand's kernel and tiles for this batch (GLUON=1: the Gluon kernel, where its contract holds)."""
    policy = policy or active_policy()
    if problem.accumulate and not problem.has_bias and policy.gluon:
        cfg = tables(_DIR, device)["gluon"].get(key(problem.num_slices, problem.rank_tile))
        if cfg is not None:
            return {"GLUON": 1, **cfg}
    return triton_tiles(problem.rank_tile, problem.accumulate, problem.has_bias, device)


def triton_tiles(
    rank_tile: int,
    accumulate: bool = False,
    has_bias: bool = False,
    device: torch.device = torch.device("cpu"),
) -> dict[str, int]:
    """The Triton expand's tiles by rank tile: the row-stationary kernel where it applies (y += delta, no
    bias), else one y tile per program."""
    t = tables(_DIR, device)
    if accumulate and not has_bias and str(rank_tile) in t["triton_rows"]:
        return t["triton_rows"][str(rank_tile)]
    return t["triton"].get(str(rank_tile), dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2))
