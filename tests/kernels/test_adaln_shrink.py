"""The adaLN modulation with the LoRA shrink of its output in the same pass (kernels/adaln_shrink)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import AdaLayerNormZero
from hypothesis import given, settings
from hypothesis import strategies as st

from ditserve.kernels.adaln_shrink.op import SWEEP, adaln, launch_adaln_shrink
from ditserve.kernels.adaln_shrink.reference import adaln_ref
from ditserve.kernels.lora import lora_shrink
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref, lora_shrink_scaled_ref
from tests.kernels.lora_cases import layouts, make_case

SETTINGS = settings(max_examples=20, deadline=None)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-2, rtol=2e-2)}
# the op's candidates, and small tiles: rows past the end, hidden not a multiple of BLOCK_K
configs = st.sampled_from(
    [None, *SWEEP.values(), dict(BLOCK_M=16, BLOCK_K=32, num_warps=4, num_stages=1),
     dict(BLOCK_M=16, BLOCK_K=16, num_warps=2, num_stages=1)]
)  # fmt: skip


def modulation(batch: int, hidden: int, dtype, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    shift = torch.randn(batch, hidden, generator=g).to(dtype)
    scale = (torch.randn(batch, hidden, generator=g) * 0.5).to(dtype)
    return shift, scale


@SETTINGS
@given(layouts(), st.integers(1, 4), st.sampled_from([torch.float32, torch.float16]), configs, st.booleans())
def test_adaln_shrink_matches_reference(layout, num_slices, dtype, config, scaled):
    """y is LayerNorm · (1 + scale) + shift per batch row (rows far from zero mean: the statistics must not
    cancel); s is the segmented shrink of exactly that y (scaled or fp32), over generated segment layouts:
    empty and 1-token segments, rank 0, slot -1, several segments in one row block, 1-4 slices."""
    c = make_case(layout, num_slices, [16] * num_slices, 48, dtype)
    m = c.meta
    x = (c.x.float() * 2 + 30).to(dtype)
    batch = 2 if m.num_tokens % 2 == 0 and m.num_tokens else 1
    shift, scale = modulation(batch, 48, dtype)
    seg = (m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    y, s = launch_adaln_shrink(x, shift, scale, 1e-6, c.a, *seg, m.seg_scale if scaled else None,
                               config=config)  # fmt: skip
    torch.testing.assert_close(y, adaln_ref(x, shift, scale, 1e-6), **TOL[dtype])
    if scaled:
        want = lora_shrink_scaled_ref(y, c.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale,
                                      m.slot_rank, m.max_rank)  # fmt: skip
    else:
        want = lora_shrink_ref(y, c.a, m.seg_start, m.seg_len, m.seg_slot, m.slot_rank, m.max_rank)
    assert s.shape == want.shape and s.dtype == want.dtype
    torch.testing.assert_close(s, want, **TOL[dtype])


def test_adaln_equals_diffusers_norm_and_the_shrink_op():
    """Without A: diffusers' AdaLayerNormZero output (same shift and scale chunks); with A and a batch
    meta, `adaln` returns that y and what `lora_shrink(y, A, meta, scaled=True)` returns."""
    torch.manual_seed(0)
    hidden, tokens = 64, 40
    norm = AdaLayerNormZero(hidden)
    x = torch.randn(2, tokens, hidden) * 3 + 5
    emb = torch.randn(2, hidden)
    with torch.no_grad():
        want, *_ = norm(x, emb=emb)
        shift, scale = norm.linear(norm.silu(emb)).chunk(6, dim=1)[:2]
    y = adaln(x, shift, scale, norm.norm.eps)
    assert y.shape == x.shape
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)

    c = make_case(([(30, 0), (20, -1), (30, 2)], [16, 8, 32, 0], [1.0, 1.0, -0.5]), 3, [16] * 3, hidden,
                  torch.float32)  # fmt: skip
    y2, s = adaln(x, shift, scale, norm.norm.eps, c.a, c.meta)
    torch.testing.assert_close(y2, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, lora_shrink(y2.reshape(-1, hidden), c.a, c.meta, scaled=True))
    assert s[:, 30:50].abs().max() == 0 and s[:, :30].abs().max() > 0  # the rows without LoRA


def test_adaln_rank0_and_bad_shapes():
    """A batch whose adapters all have rank 0 gets y and an empty s; shift rows that do not divide the
    tokens are refused."""
    c = make_case(([(10, 0), (6, 1)], [0, 0, 0, 0], [1.0, 1.0]), 2, [16, 16], 32, torch.float32)
    m = c.meta
    shift, scale = modulation(2, 32, torch.float32)
    y, s = launch_adaln_shrink(c.x, shift, scale, 1e-6, c.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot,
                               m.slot_rank, m.max_rank, m.seg_scale)  # fmt: skip
    torch.testing.assert_close(y, adaln_ref(c.x, shift, scale, 1e-6), atol=1e-4, rtol=1e-4)
    assert s.shape == (2, 16, 0)  # as lora_shrink: no columns when no adapter has rank
    with pytest.raises(AssertionError, match="equal rows"):
        launch_adaln_shrink(c.x, *modulation(3, 32, torch.float32), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("num_slices,rank", [(3, 16), (3, 64), (4, 64), (1, 128)])
@pytest.mark.parametrize("name", [None, *SWEEP])
def test_adaln_shrink_gpu_bf16(num_slices, rank, name):
    """bf16 on the GPU at Flux sizes (hidden 3072, 2 × 4608 tokens, requests of 4608 and 2 × 2304 tokens),
    every candidate tile."""
    layout = ([(4608, 0), (2304, -1), (2304, 1)], [rank, rank // 2, 0, 0], [1.0, 1.0, 0.5])
    c = make_case(layout, num_slices, [16] * num_slices, 3072, torch.bfloat16, device="cuda", max_rank=rank)
    m = c.meta
    shift, scale = modulation(2, 3072, torch.bfloat16)
    shift, scale = shift.cuda(), scale.cuda()
    y, s = launch_adaln_shrink(c.x, shift, scale, 1e-6, c.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot,
                               m.slot_rank, m.max_rank, m.seg_scale, config=SWEEP.get(name))  # fmt: skip
    torch.testing.assert_close(y.float(), adaln_ref(c.x.float(), shift.float(), scale.float(), 1e-6),
                               atol=6e-2, rtol=2e-2)  # fmt: skip
    want = lora_shrink_scaled_ref(y, c.a, m.token_seg, m.seg_start, m.seg_len, m.seg_slot, m.seg_scale,
                                  m.slot_rank, m.max_rank)  # fmt: skip
    torch.testing.assert_close(s.float(), want.float(), atol=6e-2, rtol=3e-2)
