"""Column tiling of fused outputs (q, k, v side by side), shared by the expand (segmented and SGMV) and GEMM
launchers, and the row blocks the SGMV launchers walk a chunk in."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import tma_ok


def column_blocks(out_slice_sizes: list[int], block_n: int) -> tuple[list[int], list[int], int]:
    """Slice boundaries (col1..col3) and first column block of slices 1..3, padded for absent slices,
    and the total number of column blocks."""
    cols, blks = [], []
    col = blk = 0
    for n in out_slice_sizes:
        cols.append(col)
        blks.append(blk)
        col += n
        blk += -(-n // block_n)
    cols, blks = cols[1:], blks[1:]
    cols += [col] * (3 - len(cols))
    blks += [blk] * (3 - len(blks))
    return cols, blks, blk


def column_align(cols: list[int]) -> int:
    """The widest power of two (≤ 16) dividing every slice boundary: lets y and bias use vector accesses."""
    align = 16
    while align > 1 and any(c % align for c in cols):
        align //= 2
    return align


def column_chunks(blks: list[int], num_col_blocks: int, chunk: int) -> list[int]:
    """First chunk of slices 1..3 (the number of chunks when absent), CHUNK column blocks per chunk cut per
    slice; the last entry is the number of chunks."""
    edges = [0, *blks, num_col_blocks]
    out, total = [], 0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        total += -(-(hi - lo) // chunk)
        out.append(total)
    return out


def b_descriptor(b_stacked: torch.Tensor, want: bool, block_n: int, block_r: int):
    """(B viewed as [max_loras · n_total, max_rank] through a TMA descriptor of [block_n, block_r] boxes,
    True) where asked for and B's layout allows it; else (b_stacked, a placeholder for the kernel's unread
    descriptor argument, False)."""
    b_rows = b_stacked.flatten(0, 1)
    if not (want and b_stacked.is_contiguous() and tma_ok(b_rows)):
        return b_stacked, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(b_rows, [block_n, block_r]), True


def chunk_block_m(block_m: int, chunk_size: int) -> int:
    """Rows of the sub-blocks an SGMV program walks its chunk in: the tile's, at most the longest chunk, ≥ 16
    (tl.dot's smallest M)."""
    return max(16, min(block_m, chunk_size))
