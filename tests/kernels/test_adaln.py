"""The one-pass adaLN-Zero modulation (kernels/adaln) against its reference and diffusers' norm."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.normalization import AdaLayerNormZero
from hypothesis import given, settings
from hypothesis import strategies as st

from ditserve.kernels.adaln.op import SWEEP, adaln, launch_adaln
from ditserve.kernels.adaln.reference import adaln_ref

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-2, rtol=2e-2)}
# the op's candidates, and small tiles: rows past a batch element's end, hidden not a multiple of BLOCK_K
configs = st.sampled_from(
    [None, *SWEEP.values(), dict(BLOCK_M=16, BLOCK_K=32, num_warps=4, num_stages=1),
     dict(BLOCK_M=16, BLOCK_K=16, num_warps=2, num_stages=1)]
)  # fmt: skip


def modulation(batch: int, hidden: int, dtype, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    shift = torch.randn(batch, hidden, generator=g).to(dtype)
    scale = (torch.randn(batch, hidden, generator=g) * 0.5).to(dtype)
    return shift, scale


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(0, 70),
    st.sampled_from([16, 48, 72]),
    st.sampled_from([torch.float32, torch.float16]),
    configs,
    st.sampled_from([0.0, 30.0, 1000.0]),
)
def test_adaln_matches_reference(batch, rows, hidden, dtype, config, offset):
    """LayerNorm · (1 + scale[b]) + shift[b] for every batch element's rows (each its own shift and scale),
    rows far from zero mean included (the statistics must not cancel), empty batches, 1-row elements."""
    g = torch.Generator().manual_seed(rows * 7 + batch)
    x = (torch.randn(batch * rows, hidden, generator=g) * 2 + offset).to(dtype)
    shift, scale = modulation(batch, hidden, dtype)
    y = launch_adaln(x, shift, scale, 1e-6, config=config)
    # x near 1000 carries its own rounding (fp32 spacing 6e-5 there, y ≈ x / std): one more ulp of x per row
    tol = dict(TOL[dtype], atol=TOL[dtype]["atol"] + 1e-6 * offset)
    torch.testing.assert_close(y, adaln_ref(x, shift, scale, 1e-6), **tol)


def test_adaln_equals_diffusers_norm():
    """diffusers' AdaLayerNormZero output, from the same shift and scale chunks of its embedding."""
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


def test_adaln_config_by_batch_size():
    """On an H200 (132 SMs), small batches (Flux's text stream: 4 × 512 tokens) take 16-row tiles, large
    ones 32-row tiles."""
    from ditserve.kernels.adaln.op import DEFAULT, SMALL, adaln_config

    assert adaln_config(4 * 512, 132) == SMALL and SMALL["BLOCK_M"] == 16
    assert adaln_config(4 * 4608, 132) == DEFAULT and DEFAULT["BLOCK_M"] == 32


def test_adaln_op_traces():
    """The custom op's fake implementation agrees with the real one (what torch.compile would trace)."""
    x = torch.randn(2 * 24, 32)
    torch.library.opcheck(torch.ops.ditserve.adaln.default, (x, *modulation(2, 32, torch.float32), 1e-6))


def test_adaln_refuses_rows_that_do_not_split():
    x = torch.randn(10, 32)
    with pytest.raises(AssertionError, match="equal rows"):
        launch_adaln(x, *modulation(3, 32, torch.float32), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [4608, 512, 4097])
@pytest.mark.parametrize("name", [None, *SWEEP])
def test_adaln_gpu_bf16(tokens, name):
    """bf16 on the GPU at Flux sizes (hidden 3072, 2 batch elements), every candidate tile."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2 * tokens, 3072, device="cuda", generator=g) * 2 + 0.5).bfloat16()
    shift, scale = (t.cuda() for t in modulation(2, 3072, torch.bfloat16))
    y = launch_adaln(x, shift, scale, 1e-6, config=SWEEP.get(name))
    want = adaln_ref(x.float(), shift.float(), scale.float(), 1e-6)
    torch.testing.assert_close(y.float(), want, atol=6e-2, rtol=2e-2)
