"""Launcher of the Gluon lora_gemm for Hopper (gluon_kernel.py), and when it applies (`gluon_ok`)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import next_pow2, num_programs_limit, tma_ok, zeroed_scratch
from ditserve.kernels._hopper import SMEM_LIMIT, gluon_available
from ditserve.kernels._hopper import tma_desc as _tma_desc
from ditserve.kernels._tiling import column_blocks

# 128×256 tiles over 8 warps (two warpgroups of 64 rows), 64-wide K steps, a ring of 3 slots (3 × 48 KB)
# next to a 64 KB store buffer, 16 row blocks per column block in the tile order. The shrink inside the
# launch: SPREAD puts its units on the programs with one tile less, LEAD tiles before any program needs
# them (1: where a unit's MMAs are narrow, 2: always), else they all run first (_gluon_lora_linear_kernel);
# LATE: a tile whose group's s is not all there runs its K steps first and waits after them, so the units
# can be due with their group (LEAD 0) and read x about when its first tiles do.
# FOLD: at rank ≤ 16 the LoRA MMA follows the last K step, its s and B boxes in buffers of their own (no
# LoRA step in the ring). SPLIT_TAIL (the GEMM launch): a last round of tiles that leaves at least half the
# programs idle is cut along K into pieces for them (`tail_parts`). EPI_SPLIT / EPI_BUFS: y stored in 4 column
# chunks through 2 staging buffers of 128 × 64 (32 KB instead of a 64 KB whole-tile buffer; the one launch
# keeps a first tile whose s is not there yet in registers instead). DEFER: a tile's second half of y is stored
# once the next tile's first MMA has started. Each measured faster on an H200 (docs/notes/benchmarks-log.md)
GLUON_CONFIG = dict(
    BLOCK_M=128,
    BLOCK_N=256,
    BLOCK_K=64,
    GROUP_M=16,
    NUM_BUFFERS=3,
    num_warps=8,
    SPREAD=1,
    LEAD=0,
    FOLD=1,
    SPLIT_TAIL=1,
    EPI_SPLIT=4,
    EPI_BUFS=2,
    LATE=1,
    # LEAD for launches whose tiles wait for s before their K steps (no LATE: LoRA MMAs wider than 16, i.e.
    # no FOLD, or LATE 0): a group's units are then done before its first tile starts
    LEAD_NOT_LATE=2,
    # spread units past whole rounds of the programs with one tile less run as two halves of their K steps
    UNIT_HALVES=1,
    # a tile's second half of y stored while the next tile's first MMA runs (the GEMM; the one launch's LATE runs)
    DEFER=1,
)


def gluon_ok(
    x: torch.Tensor,
    weight: torch.Tensor,
    s: torch.Tensor | None,
    b_stacked: torch.Tensor,
    out_slice_sizes: list[int],
    s_scaled: bool,
    seg_align: int,
    cfg: dict[str, int] = GLUON_CONFIG,
) -> bool:
    """The Gluon kernel's contract: Hopper, bf16/fp16, s pre-scaled in x's dtype (or no LoRA), every segment
    on a row-block boundary, every output slice whole column blocks, TMA-friendly tensors. s None: the s the
    scaled shrink kernel will write (contiguous, 16-column multiples)."""
    if (
        not x.is_cuda
        or x.dtype not in (torch.bfloat16, torch.float16)
        or not gluon_available(x.device.index or 0)
    ):
        return False
    if x.shape[0] == 0 or x.shape[1] == 0 or weight.dtype != x.dtype:
        return False
    if seg_align % cfg["BLOCK_M"] or any(n % cfg["BLOCK_N"] for n in out_slice_sizes):
        return False
    if not (tma_ok(x, weight) and x.is_contiguous() and weight.is_contiguous()):
        return False
    if s is None:
        return b_stacked.is_contiguous() and tma_ok(b_stacked.flatten(0, 1))
    if s.shape[2] > 0:
        if not s_scaled or s.dtype != x.dtype or not (s.is_contiguous() and b_stacked.is_contiguous()):
            return False
        if not tma_ok(s.flatten(0, 1), b_stacked.flatten(0, 1)):
            return False
    return True


def gemm_smem(cfg: dict[str, int], fold: bool, itemsize: int = 2) -> int:
    """Shared memory of `_gluon_lora_gemm_kernel` (bytes, barriers aside): the ring, y's staging buffer(s)
    (the whole tile, or EPI_BUFS chunks of BLOCK_N / EPI_SPLIT columns) and FOLD's s and B boxes."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    epi = cfg.get("EPI_SPLIT", 1)
    staging = bm * bn if epi == 1 else cfg.get("EPI_BUFS", 1) * bm * (bn // epi)
    return itemsize * (cfg["NUM_BUFFERS"] * (bm + bn) * bk + staging + (bm + bn) * 16 * fold)


def _fold(cfg: dict[str, int], lora_steps: int, lora_cols: int, hidden: int) -> bool:
    """FOLD (`_tiles`): one LoRA MMA of 16 rank columns, whose boxes fit shared memory next to the ring and
    y's staging buffer, and K steps enough that the producer is at a tile when it starts (k_tiles ≥
    NUM_BUFFERS)."""
    return (
        bool(cfg.get("FOLD", 1))
        and lora_steps == 1
        and lora_cols == 16
        and hidden >= cfg["NUM_BUFFERS"] * cfg["BLOCK_K"]
        and gemm_smem(cfg, True) + 256 <= SMEM_LIMIT
    )


def _lora_boxes(s: torch.Tensor, b_stacked: torch.Tensor, lora_k: int, cfg: dict[str, int], hidden: int):
    """(s and B descriptors, LoRA steps in the ring, rank columns per LoRA MMA, FOLD) for lora_k ≥ 1 rank
    columns: boxes of BLOCK_K columns for the ring's LoRA steps, or of the 16 rank columns under FOLD (then no
    LoRA step in the ring)."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    lora_steps, lora_cols = lora_step_shape(lora_k, bk)
    fold = _fold(cfg, lora_steps, lora_cols, hidden)
    width = lora_cols if fold else bk
    s_desc = _tma_desc(s.flatten(0, 1), [bm, width])
    b_desc = _tma_desc(b_stacked.flatten(0, 1), [bn, width])
    return s_desc, b_desc, 0 if fold else lora_steps, lora_cols, fold


def lora_step_shape(lora_k: int, block_k: int) -> tuple[int, int]:
    """(LoRA steps per tile, rank columns each one multiplies) for lora_k rank columns: the steps multiply
    only the rank columns, 16 or 32 of a 64-column box at ranks ≤ 16 / ≤ 32; (0, block_k) without LoRA."""
    steps = -(-lora_k // block_k)
    return steps, block_k if steps != 1 else min(block_k, max(16, next_pow2(lora_k)))


def launch_gluon_lora_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    s: torch.Tensor,  # [num_slices, num_tokens, s_cols] pre-scaled, x's dtype; s_cols 0 = no LoRA
    b_stacked: torch.Tensor,  # [max_loras, n_total, max_rank]
    token_seg: torch.Tensor,
    seg_slot: torch.Tensor,
    out_slice_sizes: list[int],
    cfg: dict[str, int] = GLUON_CONFIG,
) -> torch.Tensor:
    """y = x · Wᵀ + bias + s[j] · B[slot]ᵀ per tile (the caller checked `gluon_ok`)."""
    from ditserve.kernels.lora_gemm.gluon_kernel import _gluon_lora_gemm_kernel

    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_tokens, _ = x.shape
    n_total = weight.shape[0]
    y = x.new_empty((num_tokens, n_total))
    epi = cfg.get("EPI_SPLIT", 1)
    x_desc, w_desc = _tma_desc(x, [bm, bk]), _tma_desc(weight, [bn, bk])
    y_desc = _tma_desc(y, [bm, bn // epi])
    lora_k = min(s.shape[2], b_stacked.shape[2])
    if lora_k > 0:
        s_desc, b_desc, lora_steps, lora_cols, fold = _lora_boxes(s, b_stacked, lora_k, cfg, x.shape[1])
    else:
        s_desc, b_desc = x_desc, w_desc  # never read
        (lora_steps, lora_cols), fold = lora_step_shape(0, bk), False
    cols, blks, num_col_blocks = column_blocks(out_slice_sizes, bn)
    num_tiles = -(-num_tokens // bm) * num_col_blocks
    grid = min(num_tiles, num_programs_limit(x.device))
    split = tail_parts(num_tiles, grid, -(-x.shape[1] // bk)) > 1 and bool(cfg.get("SPLIT_TAIL", 0))
    ws, cnt = y, y  # never read without SPLIT_TAIL
    if split:  # at most half the programs' tiles (sized for that at once: the same buffers for every shape)
        half = num_programs_limit(x.device) // 2
        ws = zeroed_scratch("gemm tail sums", x.device, half * bm * bn, torch.float32)
        cnt = zeroed_scratch("gemm tail counts", x.device, half, torch.int32)
    # the LoRA code also without LoRA (zero LoRA steps): ptxas makes faster code of it (docs/notes/benchmarks-log.md)
    _gluon_lora_gemm_kernel[(grid,)](
        x_desc, w_desc, s_desc, b_desc, y_desc, bias if bias is not None else y, token_seg, seg_slot,
        num_tokens, n_total, *cols, *blks, num_col_blocks, lora_steps,
        s.shape[0] * num_tokens, b_stacked.shape[0] * n_total, ws, cnt,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, LORA_K=lora_cols, GROUP_M=cfg["GROUP_M"],
        NUM_BUFFERS=cfg["NUM_BUFFERS"], HAS_BIAS=bias is not None, num_warps=cfg["num_warps"], HAS_LORA=True,
        FOLD=fold, SPLIT_TAIL=split, EPI_SPLIT=epi, EPI_BUFS=cfg.get("EPI_BUFS", 1),
        DEFER=bool(cfg.get("DEFER", 0)) and epi == 4,
    )  # fmt: skip
    return y


def tail_parts(num_tiles: int, programs: int, k_tiles: int) -> int:
    """Pieces each tile of the last partial round is cut into along K (`_gluon_lora_gemm_kernel` SPLIT_TAIL):
    as many as the programs left idle allow, each of at least 4 K steps; 1 (no cut) without such a round."""
    tail = num_tiles % programs
    return min(programs // tail, k_tiles // 4) if tail and num_tiles > programs else 1


NARROW_UNIT_COLS = 64  # a shrink unit's MMAs at most this wide (slices × rank columns): spread (SPREAD 1)


def unit_cols(groups: int, max_rank: int) -> int:
    """Columns of a shrink unit's MMAs in the one launch: the slices times the rank columns (SHRINK_R)."""
    return groups * shrink_geometry(groups, max_rank)[1]


def unit_lead(cfg: dict[str, int], late: bool) -> int:
    """Tiles before the first of its group that a spread shrink unit is due: LEAD where the tiles wait for s
    after their K steps (LATE), else LEAD_NOT_LATE (there a unit due with its group holds up the group's tiles
    before their loads: docs/notes/benchmarks-log.md, rank 64 spread). At least 0: a unit of the first group due after a
    first tile would wait for itself."""
    lead = cfg.get("LEAD", 2) if late else cfg.get("LEAD_NOT_LATE", 2)
    assert lead >= 0, "units are due LEAD ≥ 0 tiles before their group"
    return lead


def shrink_geometry(num_slices: int, max_rank: int) -> tuple[int, int, int]:
    """(s columns, SHRINK_R, SHRINK_GP) of the in-launch shrink: s_cols = max_rank rounded up to 16, its
    power of two, and the slices' power of two (one MMA of SHRINK_GP · SHRINK_R columns per K step)."""
    s_cols = -(-max_rank // 16) * 16
    return s_cols, next_pow2(s_cols), next_pow2(num_slices)


def gluon_linear_ok(
    x: torch.Tensor,
    weight: torch.Tensor,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    max_rank: int,
    out_slice_sizes: list[int],
    seg_align: int,
    cfg: dict[str, int] = GLUON_CONFIG,
) -> bool:
    """`launch_gluon_lora_linear`'s contract: `gluon_ok` for the GEMM, A laid out for TMA, and every slice's
    rank columns in one MMA of at most BLOCK_N columns (ranks ≤ 64)."""
    if not gluon_ok(x, weight, None, b_stacked, out_slice_sizes, True, seg_align, cfg):
        return False
    _, shrink_r, shrink_gp = shrink_geometry(a_stacked.shape[0], max_rank)
    if shrink_gp * shrink_r > cfg["BLOCK_N"] or a_stacked.dtype != x.dtype or not a_stacked.is_contiguous():
        return False
    return tma_ok(a_stacked.flatten(0, 2))


def launch_gluon_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_stacked: torch.Tensor,  # [groups ≥ output slices, max_loras, max_rank, hidden]
    b_stacked: torch.Tensor,  # [max_loras, n_total, max_rank]
    token_seg: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor,
    slot_rank: torch.Tensor,
    max_rank: int,
    out_slice_sizes: list[int],
    cfg: dict[str, int] = GLUON_CONFIG,
    sync: torch.Tensor | None = None,  # int32 [2 · row blocks + 2] zeros (None: a new one)
    s: torch.Tensor | None = None,  # where s goes (None: a new tensor)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s): the shrink and the GEMM with the expand in one launch (the caller checked `gluon_linear_ok`);
    s [groups, num_tokens, s_cols] pre-scaled in x's dtype, as `lora_shrink(..., seg_scale=...)` writes it."""
    from ditserve.kernels.lora_gemm.gluon_kernel import _gluon_lora_linear_kernel

    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_tokens, _ = x.shape
    n_total = weight.shape[0]
    groups, max_loras, a_rows, _ = a_stacked.shape
    s_cols, shrink_r, shrink_gp = shrink_geometry(groups, max_rank)
    y = x.new_empty((num_tokens, n_total))
    if s is None:
        s = x.new_empty((groups, num_tokens, s_cols))
    # spread units (SPREAD 1: where a unit's MMAs are at most 64 columns wide, e.g. rank 16 with 3 or 4
    # slices; wider ones take longer than the slack of the programs with one tile less; 2: always): a tile's
    # LoRA loads must go out during its own K steps, after its wait
    spread = cfg.get("SPREAD", 1) == 2 or (
        cfg.get("SPREAD", 1) == 1 and unit_cols(groups, max_rank) <= NARROW_UNIT_COLS
    )
    spread = int(spread and x.shape[1] >= (cfg["NUM_BUFFERS"] - 1) * bk)
    epi = cfg.get("EPI_SPLIT", 1) if spread else 1  # y in chunks only with the units spread
    x_desc, w_desc = _tma_desc(x, [bm, bk]), _tma_desc(weight, [bn, bk])
    y_desc = _tma_desc(y, [bm, bn // epi])
    a_desc = _tma_desc(a_stacked.flatten(0, 2), [shrink_r, bk])
    lora_k = min(s_cols, b_stacked.shape[2])
    s_desc, b_desc, lora_steps, lora_cols, fold = _lora_boxes(
        s, b_stacked, lora_k, {**cfg, "EPI_SPLIT": epi}, x.shape[1]
    )
    late = bool(cfg.get("LATE", 0) and spread and fold)
    cols, blks, num_col_blocks = column_blocks(out_slice_sizes, bn)
    num_pid_m = -(-num_tokens // bm)
    grid = min(num_pid_m * num_col_blocks, num_programs_limit(x.device))
    halves = bool(cfg.get("UNIT_HALVES", 0) and spread)
    ws = y  # never read without halves
    if halves:  # a split unit's partial sums (zeros between launches: each leaves them so)
        ws = zeroed_scratch("unit halves", x.device, num_pid_m * bm * shrink_gp * shrink_r, torch.float32)
    if sync is None:  # group counts, SPREAD 0's claim and done counters, UNIT_HALVES' half counts
        sync = torch.zeros(2 * num_pid_m + 2, dtype=torch.int32, device=x.device)
    _gluon_lora_linear_kernel[(grid,)](
        x_desc, w_desc, s_desc, b_desc, y_desc, a_desc, bias if bias is not None else y, s, token_seg, seg_slot,
        seg_scale, slot_rank, sync, num_tokens, n_total, *cols, *blks, num_col_blocks, lora_steps,
        groups * num_tokens, b_stacked.shape[0] * n_total, a_rows, max_loras * a_rows, s_cols, s.stride(0),
        s.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, LORA_K=lora_cols, GROUP_M=cfg["GROUP_M"],
        NUM_BUFFERS=cfg["NUM_BUFFERS"], SHRINK_G=groups, SHRINK_GP=shrink_gp, SHRINK_R=shrink_r,
        HAS_BIAS=bias is not None, num_warps=cfg["num_warps"], SPREAD=spread, LEAD=unit_lead(cfg, late),
        FOLD=fold, EPI_SPLIT=epi, EPI_BUFS=cfg.get("EPI_BUFS", 1), LATE=late, UNIT_HALVES=halves, ws_ptr=ws,
        DEFER=bool(cfg.get("DEFER", 0)) and late and epi == 4,
    )  # fmt: skip
    return y, s
