"""Launcher and torch custom ops for the adaLN modulation with a fused LoRA shrink (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import block_rank, use_triton
from ditserve.kernels.adaln_shrink.reference import adaln_ref, adaln_shrink_ref
from ditserve.kernels.lora_shrink.op import MAX_SLICES, scaled_cols

# Tiles: "BLOCK_M/BLOCK_K/num_warps/num_stages" (BLOCK_M rows of one batch element per program, BLOCK_K
# columns per step of both passes). The rows of the programs in flight should fit in L2, so that pass 2
# reads them from there. Candidates for benchmarks/adaln_lora.py (the GPU tests run each); compiled for
# sm_90 (hidden divisible by 16) they need 108-206 registers with LoRA and no spills, 40-48 without.
SWEEP: dict[str, dict[str, int]] = {
    "32/64/4/2": dict(BLOCK_M=32, BLOCK_K=64, num_warps=4, num_stages=2),
    "32/128/8/2": dict(BLOCK_M=32, BLOCK_K=128, num_warps=8, num_stages=2),
    "64/64/8/2": dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=2),
    "16/256/8/2": dict(BLOCK_M=16, BLOCK_K=256, num_warps=8, num_stages=2),
}
DEFAULT = SWEEP["32/128/8/2"]


def launch_adaln_shrink(
    x: torch.Tensor,  # [num_tokens, hidden] bf16/fp16/fp32, hidden contiguous
    shift: torch.Tensor,  # [batch, hidden] (num_tokens = batch · tokens_per_row), hidden contiguous
    scale: torch.Tensor,  # [batch, hidden]
    eps: float,
    a_stacked: torch.Tensor | None = None,  # [num_slices ≤ 4, max_loras, max_rank, hidden], x's dtype
    token_seg: torch.Tensor | None = None,  # the batch layout of LoRABatchMeta (all int32 but seg_scale)
    seg_start: torch.Tensor | None = None,
    seg_len: torch.Tensor | None = None,
    seg_slot: torch.Tensor | None = None,
    slot_rank: torch.Tensor | None = None,
    rank_dim: int = 0,
    seg_scale: torch.Tensor | None = None,  # [num_segments] fp32: s = scale(t) · y · Aᵀ in x's dtype
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # y; s as launch_lora_shrink writes it (None without A)
    from ditserve.kernels.adaln_shrink.kernel import _adaln_shrink_kernel

    num_tokens, hidden = x.shape
    batch = shift.shape[0]
    assert x.dim() == 2 and x.is_contiguous(), (x.shape, x.stride())
    assert x.numel() < 2**31, f"{x.numel()} elements: the kernel's offsets are 32-bit"

    assert shift.shape == scale.shape == (batch, hidden), (shift.shape, scale.shape, x.shape)
    assert shift.stride(1) == 1 and scale.stride(1) == 1, "hidden dim of shift/scale must be contiguous"
    assert batch > 0 and num_tokens % batch == 0, f"{num_tokens} tokens are not {batch} equal rows"
    y = torch.empty_like(x)
    has_lora = a_stacked is not None
    if has_lora:
        assert a_stacked.dim() == 4 and a_stacked.dtype == x.dtype and a_stacked.shape[3] == hidden
        assert 1 <= a_stacked.shape[0] <= MAX_SLICES and a_stacked.stride(3) == 1, a_stacked.shape
        assert a_stacked.stride(1) * a_stacked.shape[1] < 2**31, a_stacked.shape  # 32-bit offsets in a slot
        assert 0 <= rank_dim <= min(a_stacked.shape[2], 128), (rank_dim, a_stacked.shape)
        assert token_seg.shape[0] == num_tokens and slot_rank.shape[0] == a_stacked.shape[1]
        num_slices = a_stacked.shape[0]
        if seg_scale is not None:
            s = x.new_empty(num_slices, num_tokens, scaled_cols(rank_dim))
        else:
            s = x.new_empty(num_slices, num_tokens, rank_dim, dtype=torch.float32)
        if rank_dim == 0:
            s.zero_()
            has_lora = False
    else:
        s = None
    if num_tokens == 0:
        return y, s
    cfg = dict(config or DEFAULT)
    lora = (a_stacked, s, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank) if has_lora else (
        x, y, x, x, x, x, x, x)  # fmt: skip
    a_strides = a_stacked.stride()[:3] if has_lora else (0, 0, 0)
    s_strides = s.stride() if has_lora else (0, 0, 0)
    rows = num_tokens // batch
    grid = (-(-rows // cfg["BLOCK_M"]), batch)
    _adaln_shrink_kernel[grid](
        x, shift, scale, y, *lora, num_tokens, hidden, rows, s.shape[2] if has_lora else 0,
        eps, shift.stride(0), scale.stride(0), *a_strides, *s_strides,
        NUM_SLICES=a_stacked.shape[0] if has_lora else 1,
        BLOCK_R=block_rank(s.shape[2]) if has_lora else 16,
        HAS_LORA=has_lora, SCALED=seg_scale is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **cfg,
    )  # fmt: skip
    return y, s


@torch.library.custom_op("ditserve::adaln", mutates_args=())
def adaln_op(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm(x) · (1 + scale[b]) + shift[b] in one pass; Triton on CUDA (or TRITON_INTERPRET=1), else
    the torch reference."""
    if use_triton(x):
        return launch_adaln_shrink(x, shift, scale, eps)[0]
    return adaln_ref(x, shift, scale, eps)


@adaln_op.register_fake
def _(x, shift, scale, eps):
    return torch.empty_like(x)


@torch.library.custom_op("ditserve::adaln_shrink_scaled", mutates_args=())
def adaln_shrink_scaled_op(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    a_stacked: torch.Tensor,
    token_seg: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor,
    slot_rank: torch.Tensor,
    rank_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s): y as `adaln_op`, s = scale(t) · y · Aᵀ as `lora_shrink(y, a_stacked, meta, scaled=True)`
    returns it; y read once for both."""
    args = (a_stacked, token_seg, seg_start, seg_len, seg_slot)
    if use_triton(x):
        return launch_adaln_shrink(x, shift, scale, eps, *args, slot_rank, rank_dim, seg_scale)
    return adaln_shrink_ref(x, shift, scale, eps, *args, seg_scale, slot_rank, rank_dim)


@adaln_shrink_scaled_op.register_fake
def _(
    x, shift, scale, eps, a_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank, rank_dim
):
    return torch.empty_like(x), x.new_empty((a_stacked.shape[0], x.shape[0], scaled_cols(rank_dim)))


def adaln(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, a_stacked=None, meta=None):
    """``LayerNorm(x) · (1 + scale[:, None]) + shift[:, None]`` for x ``[batch, tokens, hidden]`` and shift,
    scale ``[batch, hidden]`` (diffusers' adaLN-Zero modulation, LayerNorm without affine), and with
    ``a_stacked`` and ``meta`` also ``lora_shrink(y, a_stacked, meta, scaled=True)`` from the same pass:
    returns y, or (y, s)."""
    x2 = x.reshape(-1, x.shape[-1])
    if a_stacked is None:
        return adaln_op(x2, shift, scale, eps).view_as(x)
    y, s = adaln_shrink_scaled_op(
        x2, shift, scale, eps, a_stacked, meta.token_seg, meta.seg_start, meta.seg_len, meta.seg_slot,
        meta.seg_scale, meta.slot_rank, meta.max_rank,
    )  # fmt: skip
    return y.view_as(x), s
