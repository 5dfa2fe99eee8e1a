"""One attention dispatch with backends that declare whether they return the softmax log-sum-exp.

Layout everywhere in this module: q, k, v are (batch, heads, seq, head_dim); the LSE is (batch, heads,
seq_q) in fp32. Ring attention and joint text+image attention merge partial results with `merge_partial`,
which needs each part's LSE; a backend without LSE (plain SDPA) is still the fastest choice when a
single call sees every key (Ulysses alone, K/V-gather).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor | None]
]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    supports_lse: bool
    fn: AttentionFn


def _math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference backend: fp32 scores and softmax, works on every device and dtype."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(probs, v.float())
    return out.to(q.dtype), lse


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, None]:
    return F.scaled_dot_product_attention(q, k, v, scale=scale), None


def _normalize_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # Kernels disagree on a trailing singleton dim and on padding seq_q; make it (B, H, Sq) fp32.
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., : q.shape[-2]].float()


def _cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, False, False, scale=scale
    )[:2]
    return out, _normalize_lse(lse, q)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, _normalize_lse(lse, q)


BACKENDS: dict[str, AttentionBackend] = {
    "math": AttentionBackend("math", supports_lse=True, fn=_math),
    "sdpa": AttentionBackend("sdpa", supports_lse=False, fn=_sdpa),
    "cudnn": AttentionBackend("cudnn", supports_lse=True, fn=_cudnn),
    "flash": AttentionBackend("flash", supports_lse=True, fn=_flash),
}

# (device, dtype) -> name of the GPU LSE backend that passed the probe
_probed: dict[tuple[str, torch.dtype], str] = {}


def _probe_gpu_lse_backend(device: torch.device, dtype: torch.dtype) -> str:
    """Pick cuDNN if it really returns a correct LSE here, else flash, else math.

    cuDNN is about twice as fast as the flash op on H200, but whether it returns the LSE depends on the
    cuDNN build; a wrong or empty LSE would silently corrupt ring merges, so compare once on a tiny input.
    """
    key = (str(device), dtype)
    if key in _probed:
        return _probed[key]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, device=device, dtype=dtype, generator=gen) for _ in range(3))
    scale = 1 / 8
    ref_out, ref_lse = _math(q, k, v, scale)
    choice = "math"
    for name in ("cudnn", "flash"):
        try:
            out, lse = BACKENDS[name].fn(q, k, v, scale)
        except (RuntimeError, NotImplementedError):
            continue
        if (
            lse is not None
            and lse.shape == ref_lse.shape
            and torch.allclose(lse, ref_lse, atol=2e-2, rtol=0)
            and torch.allclose(out.float(), ref_out.float(), atol=2e-2, rtol=0)
        ):
            choice = name
            break
    _probed[key] = choice
    return choice


def select_backend(q: torch.Tensor, *, need_lse: bool) -> AttentionBackend:
    """Default backend for these inputs: the fastest one that gives an LSE when one is needed."""
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return BACKENDS[_probe_gpu_lse_backend(q.device, q.dtype)] if need_lse else BACKENDS["sdpa"]
    return BACKENDS["math"] if need_lse else BACKENDS["sdpa"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    need_lse: bool,
    scale: float | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Non-causal attention over (B, H, S, D) tensors; returns (out, lse or None).

    `backend` forces one of BACKENDS (tests, benchmarks); otherwise `select_backend` decides.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    impl = select_backend(q, need_lse=need_lse) if backend is None else BACKENDS[backend]
    if need_lse and not impl.supports_lse:
        raise ValueError(f"attention backend {impl.name!r} does not return the log-sum-exp needed here")
    return impl.fn(q, k, v, scale)


def merge_partial(
    out: torch.Tensor | None, lse: torch.Tensor | None, part_out: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one partial attention result into a running (out fp32, lse fp32) pair.

    softmax over the union of two key sets = the two partial outputs weighted by exp(lse_i - lse_total);
    done in fp32 so bf16 partials do not lose mass across many ring steps.
    """
    part_out = part_out.float()
    part_lse = part_lse.float()
    if out is None or lse is None:
        return part_out, part_lse
    new_lse = torch.logaddexp(lse, part_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + part_out * torch.exp(part_lse - new_lse).unsqueeze(
        -1
    )
    return out, new_lse
