"""Column tiling of fused outputs (q, k, v side by side), shared by the expand and GEMM launchers."""

from __future__ import annotations


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
