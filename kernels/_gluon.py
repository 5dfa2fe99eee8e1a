"""Gluon pieces the Hopper kernels share: TMA copy names across Triton versions, a segment's adapter, the
ring barriers of a loader warp and its consumers (`Slots`), the store of shrink results (`SOut`)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 (the kernels import them from here)
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Gluon state bundled for helpers (Triton 3.6 and 3.9 both have it here; 3.9 also exports it as gl.aggregate).
from triton.language.core import _aggregate  # noqa: E402

# a runtime scalar, or one the launch specialised to a constant (an integer argument equal to 1)
Scalar = gl.tensor | gl.constexpr

# names that newer Triton changed (3.9: the old ones raise or are gone): the TMA copies (async_load /
# async_store, before async_copy_global_to_shared / async_copy_shared_to_global) and the CTA barrier
# (barrier, before thread_barrier)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def aggregate(cls):
    """Triton's aggregate with the constructor 3.9 writes itself and 3.6 wants written out: the fields in the
    order they are declared, the constexpr ones wrapped (a constexpr function gets its arguments unwrapped). An
    aggregate is immutable once built (3.9 refuses later writes): a helper returns new values instead."""
    names = tuple(cls.__annotations__)
    constexprs = frozenset(name for name, kind in cls.__annotations__.items() if kind is gl.constexpr)

    def __init__(self, *values):
        for name, value in zip(names, values, strict=True):
            setattr(self, name, gl.constexpr(value) if name in constexprs else value)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = gluon.constexpr_function(__init__)
    return _aggregate(cls)


@gluon.constexpr_function
def _mma_layout(N, num_warps):
    """The accumulator layout of a warpgroup MMA N columns wide over num_warps warps (warpgroups along M)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 16])


@gluon.jit
def _segment_adapter(seg, seg_slot_ptr, slot_rank_ptr, seg_scale_ptr):
    """Segment seg's (slot, rank, scale): its adapter slot (-1: none), that slot's rank (0 without one) and the
    segment's scale."""
    slot = gl.load(seg_slot_ptr + seg)
    rank = gl.where(slot >= 0, gl.load(slot_rank_ptr + gl.maximum(slot, 0)), 0)
    scale = gl.load(seg_scale_ptr + seg)
    return slot, rank, scale


@aggregate
class Slots:
    """The barriers of a ring of STAGES shared-memory slots that a loader warp fills for its consumer partitions:
    step j goes into slot j % STAGES; ready[i] completes once the slot's loads have landed, empty[i] once its
    consumers have freed it (as many arrivals as the count it was made with)."""

    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.jit
    def fill(self, j, nbytes: gl.constexpr):
        """The loader's step j: wait until its slot is free, expect nbytes on it; (the slot, the barrier its loads
        complete)."""
        i = j % self.STAGES
        mbarrier.wait(self.empty.index(i), ((j // self.STAGES) & 1) ^ 1)
        bar = self.ready.index(i)
        mbarrier.expect(bar, nbytes)
        return i, bar

    @gluon.jit
    def wait(self, j):
        """A consumer's step j: wait until its slot's loads have landed; the slot."""
        i = j % self.STAGES
        mbarrier.wait(self.ready.index(i), (j // self.STAGES) & 1)
        return i

    @gluon.jit
    def free(self, j):
        """A consumer is done with step j's slot."""
        mbarrier.arrive(self.empty.index(j % self.STAGES))

    @gluon.jit
    def invalidate(self):
        for i in gl.static_range(self.STAGES):
            mbarrier.invalidate(self.ready.index(i))
            mbarrier.invalidate(self.empty.index(i))


@gluon.jit
def _slots(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The barriers of a ring of STAGES slots, each freed by CONSUMERS arrivals."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return Slots(ready, empty, STAGES)


@aggregate
class SOut:
    """Where shrink results go: s [slices, tokens, s_cols] at s_ptr (strides stride_ss, stride_st), SHRINK_G real
    slices of SHRINK_R rank columns each, from MMAs over BLOCK_M rows and num_warps warps."""

    s_ptr: gl.tensor
    s_cols: Scalar
    stride_ss: Scalar
    stride_st: Scalar
    SHRINK_G: gl.constexpr
    SHRINK_R: gl.constexpr
    BLOCK_M: gl.constexpr
    num_warps: gl.constexpr

    @gluon.jit
    def store(self, acc, g0, m0, num_tokens, rank, N: gl.constexpr):
        """s[g0 + c // SHRINK_R, rows, c % SHRINK_R] = acc[:, c] (N columns) for the columns of real slices within
        s_cols, rows m0.. below num_tokens."""
        layout: gl.constexpr = _mma_layout(N, self.num_warps)
        rows = m0 + gl.arange(0, self.BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, N, layout=gl.SliceLayout(0, layout))
        g = g0 + cols // self.SHRINK_R
        r = cols % self.SHRINK_R
        # A rows past the slot's rank belong to the next slot (or are zeros): drop them
        acc = gl.where((r < rank)[None, :], acc, 0.0)
        ptrs = (
            self.s_ptr + g.to(gl.int64)[None, :] * self.stride_ss + rows.to(gl.int64)[:, None] * self.stride_st
            + r[None, :]
        )  # fmt: skip
        mask = (rows < num_tokens)[:, None] & ((r < self.s_cols) & (g < self.SHRINK_G))[None, :]
        gl.store(ptrs, acc.to(self.s_ptr.dtype.element_ty), mask=mask)
