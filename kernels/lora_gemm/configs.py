"""The Triton lora_gemm's tiles: `choose(problem, device)` over the tuned tables (`tuned_<gpu>.json`, measured
on an H200: benchmarks/results/lora_kernels_h200_*.md and the log they link). Keys of a config: BLOCK_M/N/K,
GROUP_M (row blocks per column block in the tile order), num_warps, num_stages, PERSISTENT (one program per SM
looping over tiles), TMA (x, W, s and B through TensorDescriptors), FLATTEN (tile and K loops flattened into
one pipelined loop), LORA_LOOP (with a pre-scaled s: 1 = the LoRA term as extra
iterations of the K loop; 2 = a loop of its own after the K loop; 0 = in the epilogue, R_CHUNK rank columns per
dot), TMA_STORE (y through a TMA store in 1 or 2 column pieces), SHRINK_IN (0: no shrink inside the launch),
GLUON (1: the Gluon kernel for Hopper where its contract holds).

"large" (≥ 2 waves of 128×256 tiles, Flux QKV at 4608+ tokens) is the Hopper GEMM shape with the loops
flattened and y through a TMA store; fewer tiles take smaller ones so every SM gets work. A batch with LoRA
iterations whose row blocks may hold two segments runs unflattened: the per-segment epilogue those tiles need
keeps Triton from flattening the loop, and the plain persistent loop carries it at no such cost.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ditserve.kernels._configs import tables

_DIR = Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    num_tokens: int
    n_total: int  # output columns, all slices
    lora_in_loop: bool = False  # LoRA iterations in the K loop (a pre-scaled s with columns)
    seg_align: int = 1  # LoRABatchMeta.seg_align


def defaults(device: torch.device = torch.device("cpu")) -> dict[str, int]:
    """What a config leaves out."""
    return tables(_DIR, device)["defaults"]


def size_class(num_tokens: int, n_total: int, num_sms: int = 132) -> str:
    tiles = -(-num_tokens // 128) * -(-n_total // 256)
    return "large" if tiles >= 2 * num_sms else "small"


def tuned(num_tokens: int, n_total: int, device: torch.device = torch.device("cpu")) -> dict[str, int]:
    """The tuned tiles for the problem size, over the defaults."""
    return {**defaults(device), **tables(_DIR, device)["triton"][size_class(num_tokens, n_total)]}


def choose(problem: GemmProblem, device: torch.device = torch.device("cpu")) -> dict[str, int]:
    """The launch config for this batch."""
    cfg = tuned(problem.num_tokens, problem.n_total, device)
    if (
        problem.lora_in_loop
        and cfg["FLATTEN"]
        and cfg["LORA_LOOP"] == 1
        and problem.seg_align % cfg["BLOCK_M"]
    ):
        cfg = {**cfg, "FLATTEN": 0}
    return cfg
