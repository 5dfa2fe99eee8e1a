"""Launcher and torch custom op for the one-pass adaLN modulation (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._dispatch import next_pow2, num_programs_limit, use_triton
from ditserve.kernels.adaln.reference import adaln_ref, adaln_shrink_ref
from ditserve.kernels.lora_shrink.op import scaled_cols

# Tiles: "BLOCK_M/BLOCK_K/num_warps/num_stages" (BLOCK_M rows of one batch element per program, BLOCK_K
# columns per step of both passes). benchmarks/adaln.py times them (the GPU tests run each); on an H200,
# bf16, hidden 3072 (BENCHMARKS.md): x [4, 4608]: 32/128/8/2 85.5 µs, 16/256/8/2 90.3, the others 117;
# x [4, 512] (fewer row blocks of 32 than SMs): 16/256/8/2 21.1 µs, 32/128/8/2 27.2.
SWEEP: dict[str, dict[str, int]] = {
    "32/64/4/2": dict(BLOCK_M=32, BLOCK_K=64, num_warps=4, num_stages=2),
    "32/128/8/2": dict(BLOCK_M=32, BLOCK_K=128, num_warps=8, num_stages=2),
    "64/64/8/2": dict(BLOCK_M=64, BLOCK_K=64, num_warps=8, num_stages=2),
    "16/256/8/2": dict(BLOCK_M=16, BLOCK_K=256, num_warps=8, num_stages=2),
}
DEFAULT = SWEEP["32/128/8/2"]
SMALL = SWEEP["16/256/8/2"]


# With the LoRA shrink (`launch_adaln_shrink`): a program's A rows come from L2 once per BLOCK_K columns, so
# taller row blocks read them fewer times. benchmarks/adaln.py --shrink times them.
SHRINK_SWEEP: dict[str, dict[str, int]] = {
    "32/128/8/2": SWEEP["32/128/8/2"],
    "64/64/8/2": SWEEP["64/64/8/2"],
    "64/128/8/2": dict(BLOCK_M=64, BLOCK_K=128, num_warps=8, num_stages=2),
    "128/64/8/2": dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, num_stages=2),
}
SHRINK_DEFAULT = SHRINK_SWEEP["64/64/8/2"]
MAX_SHRINK_COLS = 256  # slices × scaled rank columns in the fused shrink's one dot; wider groups shrink apart


def adaln_config(num_tokens: int, num_sms: int) -> dict[str, int]:
    """DEFAULT, or for batches with fewer 32-row blocks than the device has SMs, SMALL (more programs)."""
    return SMALL if num_tokens < DEFAULT["BLOCK_M"] * num_sms else DEFAULT


def _check(x, shift, scale):
    num_tokens, hidden = x.shape
    batch = shift.shape[0]
    assert x.dim() == 2 and x.is_contiguous(), (x.shape, x.stride())
    assert x.numel() < 2**31, f"{x.numel()} elements: the kernel's offsets are 32-bit"
    assert shift.shape == scale.shape == (batch, hidden), (shift.shape, scale.shape, x.shape)
    assert shift.stride(1) == 1 and scale.stride(1) == 1, "hidden dim of shift/scale must be contiguous"
    assert batch > 0 and num_tokens % batch == 0, f"{num_tokens} tokens are not {batch} equal rows"


def shrink_fits(num_slices: int, max_rank: int) -> bool:
    """Whether `launch_adaln_shrink` takes a group of num_slices linears at this rank (one dot ≤ 256 wide)."""
    return 1 <= num_slices <= 4 and 0 < max_rank and num_slices * scaled_cols(max_rank) <= MAX_SHRINK_COLS


def launch_adaln(
    x: torch.Tensor,  # [num_tokens, hidden] bf16/fp16/fp32, contiguous
    shift: torch.Tensor,  # [batch, hidden] (num_tokens = batch · tokens per element), hidden contiguous
    scale: torch.Tensor,  # [batch, hidden]
    eps: float,
    config: dict[str, int] | None = None,
) -> torch.Tensor:  # y, like x
    from ditserve.kernels.adaln.kernel import _adaln_kernel

    _check(x, shift, scale)
    num_tokens, hidden = x.shape
    y = torch.empty_like(x)
    if num_tokens == 0:
        return y
    cfg = dict(config or adaln_config(num_tokens, num_programs_limit(x.device)))
    rows = num_tokens // shift.shape[0]
    grid = (-(-rows // cfg["BLOCK_M"]), shift.shape[0])
    none = (x,) * 5 + (0,) * 6  # no shrink (R_PAD 0): its arguments are never read
    _adaln_kernel[grid](x, shift, scale, y, hidden, rows, eps, shift.stride(0), scale.stride(0), *none, **cfg)
    return y


def launch_adaln_shrink(
    x: torch.Tensor,  # [num_tokens, hidden] bf16/fp16/fp32, contiguous; batch elements of equal rows
    shift: torch.Tensor,  # [batch, hidden]
    scale: torch.Tensor,  # [batch, hidden]
    eps: float,
    a_stacked: torch.Tensor,  # [num_slices, max_loras, ≥ max_rank, hidden], x's dtype, hidden contiguous
    row_slot: torch.Tensor,  # [batch] int32: the adapter slot of each batch element, -1 = none
    row_scale: torch.Tensor,  # [batch] fp32: alpha / rank × the request's strength
    slot_rank: torch.Tensor,  # [max_loras] int32
    max_rank: int,  # largest rank in use
    config: dict[str, int] | None = None,
) -> tuple[
    torch.Tensor, torch.Tensor
]:  # y like x; s [num_slices, num_tokens, scaled_cols(max_rank)], x's dtype
    """The adaLN modulation and, in the same pass, the scaled LoRA shrink of its output for a group of
    linears that read it (s as `lora_shrink(y, a_stacked, meta, scaled=True)` gives it, with one segment
    per batch element): the fused GEMM after it reads s instead of shrinking y again."""
    from ditserve.kernels.adaln.kernel import _adaln_kernel

    _check(x, shift, scale)
    num_tokens, hidden = x.shape
    batch, num_slices = shift.shape[0], a_stacked.shape[0]
    assert shrink_fits(num_slices, max_rank), (num_slices, max_rank)
    assert a_stacked.dim() == 4 and a_stacked.shape[3] == hidden and a_stacked.stride(3) == 1, a_stacked.shape
    assert a_stacked.dtype == x.dtype and a_stacked.shape[2] >= max_rank, (a_stacked.dtype, a_stacked.shape)
    assert row_slot.shape == row_scale.shape == (batch,), (row_slot.shape, row_scale.shape, batch)
    assert row_slot.dtype == slot_rank.dtype == torch.int32 and row_scale.dtype == torch.float32
    cols = scaled_cols(max_rank)
    y = torch.empty_like(x)
    s = x.new_empty((num_slices, num_tokens, cols))
    if num_tokens == 0:
        return y, s
    cfg = dict(config or SHRINK_DEFAULT)
    rows = num_tokens // batch
    grid = (-(-rows // cfg["BLOCK_M"]), batch)
    _adaln_kernel[grid](
        x, shift, scale, y, hidden, rows, eps, shift.stride(0), scale.stride(0),
        s, a_stacked, row_slot, row_scale, slot_rank, num_slices, s.stride(0), s.stride(1),
        a_stacked.stride(0), a_stacked.stride(1), a_stacked.stride(2),
        R_COLS=cols, R_PAD=next_pow2(max(num_slices * cols, 16)), **cfg,
    )  # fmt: skip
    return y, s


@torch.library.custom_op("ditserve::adaln", mutates_args=())
def adaln_op(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm(x) · (1 + scale[b]) + shift[b] in one pass; Triton on CUDA (or TRITON_INTERPRET=1), else
    the torch reference."""
    if use_triton(x):
        return launch_adaln(x, shift, scale, eps)
    return adaln_ref(x, shift, scale, eps)


@adaln_op.register_fake
def _(x, shift, scale, eps):
    return torch.empty_like(x)


@torch.library.custom_op("ditserve::adaln_shrink", mutates_args=())
def adaln_shrink_op(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    a_stacked: torch.Tensor,
    row_slot: torch.Tensor,
    row_scale: torch.Tensor,
    slot_rank: torch.Tensor,
    max_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the adaLN modulation y, the scaled LoRA shrink of y per batch element's adapter): Triton on CUDA (or
    TRITON_INTERPRET=1), else the torch reference."""
    args = (x, shift, scale, eps, a_stacked, row_slot, row_scale, slot_rank, max_rank)
    if use_triton(x) and shrink_fits(a_stacked.shape[0], max_rank):
        return launch_adaln_shrink(*args)
    return adaln_shrink_ref(*args)


@adaln_shrink_op.register_fake
def _(x, shift, scale, eps, a_stacked, row_slot, row_scale, slot_rank, max_rank):
    return torch.empty_like(x), x.new_empty((a_stacked.shape[0], x.shape[0], scaled_cols(max_rank)))


def adaln(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``LayerNorm(x) · (1 + scale[:, None]) + shift[:, None]`` for x ``[batch, tokens, hidden]`` and shift,
    scale ``[batch, hidden]``: diffusers' adaLN-Zero modulation (LayerNorm without affine), one kernel."""
    return adaln_op(x.contiguous().view(-1, x.shape[-1]), shift, scale, eps).view(x.shape)
