"""Which shrink kernel and tiles a batch takes: `choose(problem, device, policy)` over the tuned tables
(`tuned_<gpu>.json`, measured on an H200: benchmarks/results/lora_kernels_h200_*.md and the log they link).

- The Gluon kernel (Hopper, policy.gluon) where it was measured faster: 192-row blocks (3 MMA partitions) on
  batches whose segments lie on them and fill ≥ 70 % of the SMs in one wave; else 128-row forms for batches of
  at least half as many 128-row blocks as SMs, 64-row forms for smaller ones of half as many 64-row blocks —
  each only where the segments lie on its row blocks; batches whose segments are off 128-row blocks take the
  64-row forms whose pieces end at segment ends.
- Else the Triton kernels: batches of fewer 64-row blocks than SMs the small-batch tiles; larger ones the
  first large-batch entry whose stream-K programs (STREAMK=n per SM) all get a row block, else the plain tiles.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ditserve.kernels._configs import key, tables
from ditserve.kernels._dispatch import num_programs_limit
from ditserve.kernels._hopper import gluon_available
from ditserve.kernels.policy import KernelPolicy, active_policy

_DIR = Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class ShrinkProblem:
    num_slices: int  # 1..4
    rank_tile: int  # block_rank(s columns): 16..128
    num_tokens: int
    seg_align: int = 1  # LoRABatchMeta.seg_align


def choose(
    problem: ShrinkProblem, device: torch.device, policy: KernelPolicy | None = None
) -> dict[str, int]:
    """The shrink's kernel and tiles for this batch (GLUON=1: the Gluon kernel, where its contract holds)."""
    policy = policy or active_policy()
    if device.type == "cuda" and policy.gluon and gluon_available(device.index or 0):
        cfg = gluon_choice(problem, num_programs_limit(device), device)
        if cfg is not None:
            return cfg
    return triton_choice(problem, device)


def row_block(cfg: dict[str, int]) -> int:
    """Rows of a Gluon form's row block (WG MMA partitions of BLOCK_M rows)."""
    return cfg.get("WG", 1) * cfg["BLOCK_M"]


def wave_programs(num_blocks: int, num_sms: int) -> int:
    """Programs of the Gluon shrink's one-wave launch: each takes cdiv(blocks, SMs) consecutive blocks."""
    return -(-num_blocks // -(-num_blocks // num_sms)) if num_blocks else 0


def gluon_choice(
    problem: ShrinkProblem, num_sms: int, device: torch.device = torch.device("cpu")
) -> dict[str, int] | None:
    """The Gluon form this batch takes by default, or None (the Triton kernels)."""
    t = tables(_DIR, device)
    k = key(problem.num_slices, problem.rank_tile)
    tokens, align = problem.num_tokens, problem.seg_align
    if align % 192 == 0 and wave_programs(-(-tokens // 192), num_sms) >= 0.7 * num_sms:
        cfg = t["gluon_192_rows"].get(k)
        if cfg is not None:
            return cfg
    cfg = None
    if -(-tokens // 128) >= num_sms // 2:
        cfg = t["gluon_large_batch"].get(k)
    elif -(-tokens // 64) >= num_sms // 2:
        cfg = t["gluon_small_batch"].get(k)
    if cfg is not None and align % row_block(cfg) == 0:
        return cfg
    if align % 128 and -(-tokens // 64) >= num_sms // 2:
        return t["gluon_off_blocks"].get(k)
    return None


def triton_choice(problem: ShrinkProblem, device: torch.device) -> dict[str, int]:
    """The Triton shrink's tiles for this batch (the small-batch, large-batch or plain tables)."""
    t = tables(_DIR, device)
    k = key(problem.num_slices, problem.rank_tile)
    sms = num_programs_limit(device)
    if problem.num_tokens < 64 * sms:
        return t["triton_small_batch"].get(k, t["triton_small_batch_default"])
    for cfg in t["triton_large_batch"].get(k, ()):
        if problem.num_tokens >= cfg.get("STREAMK", 0) * sms * cfg["BLOCK_M"]:
            return cfg
    return triton_tiles(problem.num_slices, problem.rank_tile, device)


def triton_tiles(
    num_slices: int, rank_tile: int, device: torch.device = torch.device("cpu")
) -> dict[str, int]:
    """The plain pointer tiles (also the chunked SGMV shrink's): the table, else 64-row tiles with 8 warps once
    the fp32 accumulators (slices × BLOCK_M × rank tile) pass 8K elements."""
    cfg = tables(_DIR, device)["triton"].get(key(num_slices, rank_tile))
    if cfg is not None:
        return cfg
    if num_slices * rank_tile <= 128:
        return dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=3)
