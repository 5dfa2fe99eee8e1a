"""Attention backends and the LSE merge that ring attention relies on (single process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditserve.replica.parallel import BACKENDS, attention, merge_partial, select_backend


def _qkv(seq_q: int = 9, seq_k: int = 13, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(0)
    shape = (2, 3, seq_q, 16)
    q = torch.randn(shape, generator=g, device=device, dtype=dtype)
    k = torch.randn((2, 3, seq_k, 16), generator=g, device=device, dtype=dtype)
    v = torch.randn((2, 3, seq_k, 16), generator=g, device=device, dtype=dtype)
    return q, k, v


def test_math_backend_matches_sdpa_and_returns_lse() -> None:
    q, k, v = _qkv()
    out, lse = attention(q, k, v, need_lse=True, backend="math")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    expected_lse = torch.logsumexp(q @ k.transpose(-1, -2) / 4.0, dim=-1)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


def test_merging_key_halves_equals_attention_over_all_keys() -> None:
    q, k, v = _qkv(seq_k=13)
    full, full_lse = attention(q, k, v, need_lse=True, backend="math")
    out = lse = None
    for part in (slice(0, 5), slice(5, 6), slice(6, 13)):  # uneven blocks, as with padding
        o, lse_part = attention(q, k[:, :, part], v[:, :, part], need_lse=True, backend="math")
        out, lse = merge_partial(out, lse, o, lse_part)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)


def test_default_selection_on_cpu() -> None:
    q, _, _ = _qkv()
    assert select_backend(q, need_lse=True).name == "math"
    assert select_backend(q, need_lse=False).name == "sdpa"
    assert BACKENDS["sdpa"].supports_lse is False


def test_asking_lse_from_a_backend_without_it_fails() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="does not return the log-sum-exp"):
        attention(q, k, v, need_lse=True, backend="sdpa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["cudnn", "flash"])
def test_gpu_lse_backends_match_math(name: str) -> None:
    q, k, v = _qkv(seq_q=300, seq_k=517, dtype=torch.bfloat16, device="cuda")
    ref_out, ref_lse = attention(q, k, v, need_lse=True, backend="math")
    out, lse = attention(q, k, v, need_lse=True, backend=name)
    assert lse is not None and lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=0)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_default_lse_backend_is_a_fast_one() -> None:
    q, _, _ = _qkv(dtype=torch.bfloat16, device="cuda")
    assert select_backend(q, need_lse=True).name in ("cudnn", "flash")
