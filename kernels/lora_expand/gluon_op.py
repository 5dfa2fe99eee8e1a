"""Launcher of the Gluon in-place expand for Hopper (gluon_kernel.py), when it applies (`gluon_expand_ok`) and
where it is the default (`gluon_expand_choice`); `launch_lora_expand` falls back to the Triton kernels where
its contract does not hold."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import block_rank, num_programs_limit, tma_ok
from ditserve.kernels._hopper import SMEM_LIMIT, gluon_available, partition_regs
from ditserve.kernels._hopper import tma_desc as _tma_desc
from ditserve.kernels._tiling import column_blocks

# 128-row tiles on two warpgroups, 64 columns, as many ring slots as fit (STAGES 0, at most MAX_STAGES), a slot
# freed two TMA stores of y later (LAG); WG compute partitions of num_warps warps, each its own tiles
GLUON_EXPAND_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, STAGES=0, LAG=2, num_warps=8, WG=1)
MAX_STAGES = 12


def expand_smem(cfg: dict[str, int], rank_tile: int, itemsize: int = 2) -> tuple[int, int]:
    """(ring slots, bytes of shared memory) of `_gluon_lora_expand_kernel` (barriers aside): the slots' y and
    B boxes and each compute partition's scaled s; the slots a multiple of the partitions."""
    bm, bn, wg = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg.get("WG", 1)
    slot = (bm * bn + bn * rank_tile) * itemsize
    s_bytes = wg * bm * rank_tile * itemsize
    stages = cfg["STAGES"] or min(MAX_STAGES, (SMEM_LIMIT - 1024 - s_bytes) // slot) // wg * wg
    return stages, stages * slot + s_bytes


def gluon_expand_ok(
    y: torch.Tensor,
    s: torch.Tensor,
    b_stacked: torch.Tensor,
    out_slice_sizes: list[int],
    seg_align: int,
    cfg: dict[str, int] = GLUON_EXPAND_CONFIG,
) -> bool:
    """The Gluon expand's contract: Hopper, bf16/fp16 y and B (B contiguous), every segment on a row-block
    boundary, every slice whole column blocks, B at least a rank tile wide, TMA-friendly tensors, more ring slots
    than stores in flight for each compute partition, 1-2 partitions."""
    if (
        not y.is_cuda
        or y.dtype not in (torch.bfloat16, torch.float16)
        or not gluon_available(y.device.index or 0)
    ):
        return False
    if b_stacked.dtype != y.dtype or not b_stacked.is_contiguous() or seg_align % cfg["BLOCK_M"]:
        return False
    if any(n % cfg["BLOCK_N"] for n in out_slice_sizes):
        return False
    rank_tile = block_rank(s.shape[2])
    stages, smem = expand_smem(cfg, rank_tile, y.element_size())
    wg = cfg.get("WG", 1)
    return (
        rank_tile <= b_stacked.shape[2]
        and wg in (1, 2)
        and stages % wg == 0
        and stages // wg >= cfg["LAG"] + 2
        and cfg["BLOCK_M"] % (16 * cfg["num_warps"]) == 0
        and smem <= SMEM_LIMIT - 1024
        and tma_ok(y, b_stacked.flatten(0, 1))
        and s.is_contiguous()
    )


def launch_gluon_lora_expand(
    y: torch.Tensor,  # [num_tokens, sum(out_slice_sizes)], updated in place
    s: torch.Tensor,  # [num_slices, num_tokens, rank_dim] fp32, contiguous
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank], contiguous
    token_seg: torch.Tensor,  # [num_tokens] int32
    seg_slot: torch.Tensor,  # [num_segments] int32
    seg_scale: torch.Tensor,  # [num_segments] fp32
    slot_rank: torch.Tensor,  # [max_loras] int32
    out_slice_sizes: list[int],
    cfg: dict[str, int] = GLUON_EXPAND_CONFIG,
) -> None:
    """y += scale · s · Bᵀ per row block's adapter (the caller checked `gluon_expand_ok`)."""
    from ditserve.kernels.lora_expand.gluon_kernel import _gluon_lora_expand_kernel

    num_tokens, n_total = y.shape
    rank_dim = s.shape[2]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rank_tile = block_rank(rank_dim)
    stages, _ = expand_smem(cfg, rank_tile, y.element_size())
    wg = cfg.get("WG", 1)
    _, blks, num_col_blocks = column_blocks(out_slice_sizes, bn)  # first column block of slices 1..3
    num_tiles = -(-num_tokens // bm) * num_col_blocks
    _gluon_lora_expand_kernel[(min(num_tiles, num_programs_limit(y.device)),)](
        _tma_desc(y, [bm, bn]), _tma_desc(b_stacked.flatten(0, 1), [bn, rank_tile]), s, token_seg, seg_slot,
        seg_scale, slot_rank, num_tokens, rank_dim, n_total, s.stride(0), s.stride(1), num_col_blocks, num_tiles,
        *blks,
        R=rank_tile, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, LAG=cfg["LAG"], TPW_N=min(rank_tile // 4, 32),
        WG=wg, MMA_REGS=partition_regs(wg, cfg["num_warps"]), num_warps=cfg["num_warps"],
    )  # fmt: skip
