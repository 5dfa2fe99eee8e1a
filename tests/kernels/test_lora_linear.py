"""The one-kernel LoRA linear (shrink inside the GEMM launch) against its torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ditserve.kernels.lora_linear.op import SWEEP, launch_lora_linear, lora_linear_op
from ditserve.kernels.lora_linear.reference import lora_linear_ref
from tests.kernels.lora_cases import gpu_problem, layouts, make_case

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-2, rtol=2e-2)}


def _cfg(bm, bn, bk, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=1, **kw)


# 16-row tiles make segments straddle row blocks; 4 persistent programs loop over several tiles and row
# blocks; TMA zero-fills rows and K columns past the end (hidden 40 is not a multiple of 32)
configs = st.sampled_from(
    [
        None,
        _cfg(16, 16, 16, TMA=0),
        _cfg(16, 32, 32, TMA=0, GROUP_M=2),
        _cfg(32, 16, 16, TMA=1, FLATTEN=1),
        _cfg(16, 64, 32, TMA=1, GROUP_M=1, LORA_LOOP=0),
    ]
)
out_slices = st.lists(st.sampled_from([8, 16, 40, 17, 70]), min_size=1, max_size=4)


def args(c, w, bias):
    m = c.meta
    return (c.x, w, bias, c.a, c.b, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank,
            m.max_rank, c.sizes)  # fmt: skip


def reference(c, w, bias):
    m = c.meta
    return lora_linear_ref(c.x, w, bias, c.a, c.b, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank,
                           m.max_rank, c.sizes)  # fmt: skip


def weights(c, dtype, with_bias, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = c.x.shape[1]
    w = (torch.randn(sum(c.sizes), hidden, generator=g) * hidden**-0.5).to(dtype)
    bias = torch.randn(sum(c.sizes), generator=g).to(dtype) if with_bias else None
    return w, bias


@SETTINGS
@given(layouts(), out_slices, st.sampled_from([32, 40, 48]), st.sampled_from([torch.float32, torch.float16]),
       st.booleans(), configs)  # fmt: skip
def test_matches_reference(layout, sizes, hidden, dtype, with_bias, cfg):
    """Zero-length and 1-token requests, slot -1, rank 0 and mixed ranks up to 128, 1-4 slices of
    unequal sizes: y equals x · Wᵀ + bias + scale · (x · Aᵀ) · Bᵀ per request."""
    c = make_case(layout, len(sizes), sizes, hidden, dtype)
    if not c.meta.has_lora:
        return  # lora_linear runs a plain linear then (tests/kernels/test_lora_gemm.py)
    w, bias = weights(c, dtype, with_bias)
    got = launch_lora_linear(*args(c, w, bias), config=cfg)
    torch.testing.assert_close(got, reference(c, w, bias), **TOL[dtype])


def test_lora_term_lands_on_its_request_and_slice():
    """Two requests with different adapters and one without, 3 slices: each request's rows change by its
    own adapter's delta and the plain request's rows are the base linear exactly (to fp32 rounding)."""
    c = make_case(([(37, 1), (20, -1), (41, 3)], [0, 16, 0, 32], [1.0, 1.0, -0.5]), 3, [24, 24, 40], 32,
                  torch.float32)  # fmt: skip
    w, _ = weights(c, torch.float32, False)
    got = launch_lora_linear(*args(c, w, None), config=_cfg(16, 16, 16, TMA=0))
    base = c.x @ w.T
    torch.testing.assert_close(got[37:57], base[37:57], atol=1e-5, rtol=1e-5)
    for rows, slot, scale in ((slice(0, 37), 1, 1.0), (slice(57, 98), 3, -0.5)):
        cols = 0
        for j, n in enumerate(c.sizes):
            a = c.a[j, slot, : 16 if slot == 1 else 32]
            b = c.b[slot, cols : cols + n, : a.shape[0]]
            want = base[rows, cols : cols + n] + scale * (c.x[rows] @ a.T) @ b.T
            torch.testing.assert_close(got[rows, cols : cols + n], want, atol=1e-4, rtol=1e-4)
            cols += n


def test_custom_op_contract():
    c = make_case(([(9, 0), (7, 1)], [16, 8, 0, 0], [1.0, 0.5]), 2, [16, 24], 32, torch.float32)
    w, bias = weights(c, torch.float32, True)
    torch.library.opcheck(lora_linear_op, args(c, w, bias))


# --- GPU, bf16, Flux sizes ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", [None, *SWEEP])
@pytest.mark.parametrize("num_slices", [3, 4])
def test_bf16_gpu_every_config(num_slices, name):
    """Straddling row blocks, a slot of rank 128 (shrink in two passes of 256 columns at 4 slices), a
    request without LoRA, 1- and 0-token requests: every swept config matches the reference."""
    meta, x, a, b, w, bias, sizes = gpu_problem(num_slices)
    m = meta
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale, m.slot_rank)
    want = lora_linear_ref(x, w, bias, a, b, *seg[1:], m.max_rank, sizes)
    for _ in range(3):  # the flags must come back to zero for the next launch
        got = launch_lora_linear(x, w, bias, a, b, *seg, m.max_rank, sizes, config=SWEEP.get(name))
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=3e-2)
