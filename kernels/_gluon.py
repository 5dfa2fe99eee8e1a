"""Gluon pieces the Hopper kernels share: TMA copy names across Triton versions, a row block's adapter, the
store of shrink results."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# names that newer Triton changed (3.9: the old ones raise or are gone): the TMA copies (async_load /
# async_store, before async_copy_global_to_shared / async_copy_shared_to_global) and the CTA barrier
# (barrier, before thread_barrier)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _segment_adapter(seg, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr):
    """Segment seg's (slot, rank, scale): its adapter slot (-1: none), that slot's rank (0 without one) and the
    segment's scale."""
    slot = gl.load(seg_slot_ptr + seg)
    rank = gl.where(slot >= 0, gl.load(slot_rank_ptr + gl.maximum(slot, 0)), 0)
    scale = gl.load(seg_scale_ptr + seg)
    return slot, rank, scale


@gluon.jit
def _block_segment(rb, token_seg_ptr, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr, ROWS: gl.constexpr):
    """Row block rb's (slot, rank, scale), from its first row's segment (the Gluon expand's blocks, which hold
    one segment each)."""
    return _segment_adapter(gl.load(token_seg_ptr + rb * ROWS), seg_slot_ptr, slot_rank_ptr, seg_scale_ptr)


@gluon.jit
def _store_s(acc, g0, m0, num_tokens, rank, s_cols, stride_ss, stride_st, s_ptr, N: gl.constexpr,
             SHRINK_G: gl.constexpr, SHRINK_R: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """s[g0 + c // SHRINK_R, rows, c % SHRINK_R] = acc[:, c] for the columns of real slices within s_cols."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 16]
    )
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, N, layout=gl.SliceLayout(0, layout))
    g = g0 + cols // SHRINK_R
    r = cols % SHRINK_R
    # A rows past the slot's rank belong to the next slot (or are zeros): drop them
    acc = gl.where((r < rank)[None, :], acc, 0.0)
    ptrs = s_ptr + g.to(gl.int64)[None, :] * stride_ss + rows.to(gl.int64)[:, None] * stride_st + r[None, :]
    mask = (rows < num_tokens)[:, None] & ((r < s_cols) & (g < SHRINK_G))[None, :]
    gl.store(ptrs, acc.to(s_ptr.dtype.element_ty), mask=mask)
