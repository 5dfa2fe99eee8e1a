"""The LoRA linear as one torch custom op: y = x · Wᵀ + bias + scale · (x · Aᵀ) · Bᵀ, and s = scale · x · Aᵀ.

Where `lora_gemm.op.shrink_in_ok` holds (Triton runs, TMA, segments aligned to the row blocks: Flux's
image and text tokens at the usual sizes), one `lora_gemm` launch computes s on the programs the last
round of tiles leaves idle and adds the expand in the K loop (SHRINK_IN, see `lora_gemm/kernel.py`);
elsewhere the scaled shrink kernel runs first, then `lora_gemm`. With `KernelPolicy.gluon` on Hopper the Gluon
kernels take their place where their contract holds: the same one launch for ranks up to 64, else the
shrink kernel and the Gluon GEMM. s is returned for every slice of a_stacked, which may hold more slices
than the output: a group of linears on one input (q, k, v) shares it.
"""

from __future__ import annotations

import torch

from ditserve.kernels._checks import MAX_SLICES
from ditserve.kernels._dispatch import num_programs_limit, use_triton
from ditserve.kernels.lora_gemm import gluon_op
from ditserve.kernels.lora_gemm.op import launch_lora_gemm, shrink_in_ok
from ditserve.kernels.lora_linear.reference import lora_linear_ref
from ditserve.kernels.lora_shrink.op import launch_lora_shrink, scaled_cols
from ditserve.kernels.lora_shrink.reference import lora_shrink_scaled_ref
from ditserve.kernels.policy import KernelPolicy, active_policy

# The one Gluon launch only where its shrink units are narrow enough to spread over the run (slices × rank
# columns ≤ this: rank 16 with 3 or 4 slices); wider units run before the tiles, which costs more than the
# shrink kernel on one request, so there the shrink kernel and the Gluon GEMM run
GLUON_ONE_LAUNCH_COLS = gluon_op.NARROW_UNIT_COLS
# `one_launch_pays`: row blocks (shrink units) per program with one tile less in the last round, and the
# hidden size, above which the shrink kernel before the GEMM is faster
UNITS_PER_IDLE = 4
ONE_LAUNCH_MAX_HIDDEN = 12288


def one_launch_pays(
    num_tokens: int, hidden: int, out_slice_sizes: list[int], programs: int, cfg: dict = gluon_op.GLUON_CONFIG
) -> bool:
    """Whether the shrink inside the GEMM launch beats the shrink kernel launched before the GEMM. Its units
    (one per row block) run on the programs with one tile less in the last round of tiles: where the row blocks
    outnumber those programs more than UNITS_PER_IDLE times the units hold up the launch, and units over rows
    longer than ONE_LAUNCH_MAX_HIDDEN cost more than the kernel (FLUX.1-dev projections on an H200,
    `benchmarks/kernels/lora_linear_shapes.py`; docs/notes/benchmarks-log.md, "The one launch only where it pays")."""
    if hidden > ONE_LAUNCH_MAX_HIDDEN:
        return False
    row_blocks = -(-num_tokens // cfg["BLOCK_M"])
    col_blocks = sum(-(-n // cfg["BLOCK_N"]) for n in out_slice_sizes)
    idle = -(row_blocks * col_blocks) % programs  # programs with one tile less
    return row_blocks <= UNITS_PER_IDLE * idle


def _check(x, a_stacked, b_stacked, max_rank, sizes):
    assert x.dim() == 2 and a_stacked.dim() == 4 and b_stacked.dim() == 3, (x.shape, a_stacked.shape)
    assert 1 <= len(sizes) <= a_stacked.shape[0] <= MAX_SLICES, (sizes, a_stacked.shape)
    assert a_stacked.shape[3] == x.shape[1] and a_stacked.dtype == x.dtype, (a_stacked.shape, a_stacked.dtype)
    assert a_stacked.shape[1] == b_stacked.shape[0], (a_stacked.shape, b_stacked.shape)
    assert 0 < max_rank <= min(a_stacked.shape[2], b_stacked.shape[2], 128), max_rank


def launch_lora_linear(
    x: torch.Tensor,  # [num_tokens, hidden] fp16/bf16/fp32
    weight: torch.Tensor,  # [sum(out_slice_sizes), hidden]
    bias: torch.Tensor | None,  # [sum(out_slice_sizes)]
    a_stacked: torch.Tensor,  # [groups ≥ output slices, max_loras, max_rank, hidden]
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    token_seg: torch.Tensor,  # [num_tokens] int32
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    seg_scale: torch.Tensor,  # [num_segments] fp32, alpha/rank × strength
    slot_rank: torch.Tensor,  # [max_loras] int32
    max_rank: int,  # largest rank in use (1..128)
    out_slice_sizes: list[int],  # 1..4 output slices, slice j pairs with a_stacked[j]
    seg_align: int = 1,  # LoRABatchMeta.seg_align
    config: dict[str, int]
    | None = None,  # lora_gemm tile override (benchmarks, tests); SHRINK_IN=0: two launches
    policy: KernelPolicy | None = None,  # which variants may run (None: active_policy())
) -> tuple[torch.Tensor, torch.Tensor]:  # y [num_tokens, sum(sizes)]; s [groups, num_tokens, scaled_cols]
    _check(x, a_stacked, b_stacked, max_rank, out_slice_sizes)
    policy = policy or active_policy()
    seg = (token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank)
    use_gluon = policy.gluon and config is None
    if (
        use_gluon
        and policy.shrink_in
        and gluon_op.unit_cols(a_stacked.shape[0], max_rank) <= GLUON_ONE_LAUNCH_COLS
        and gluon_op.gluon_linear_ok(x, weight, a_stacked, b_stacked, max_rank, out_slice_sizes, seg_align)
        and (
            not policy.one_launch_rule
            or one_launch_pays(x.shape[0], x.shape[1], out_slice_sizes, num_programs_limit(x.device))
        )
    ):
        return gluon_op.launch_gluon_lora_linear(
            x, weight, bias, a_stacked, b_stacked, token_seg, seg_slot, seg_scale, slot_rank, max_rank,
            out_slice_sizes,
        )  # fmt: skip
    if use_gluon and gluon_op.gluon_ok(x, weight, None, b_stacked, out_slice_sizes, True, seg_align):
        s = launch_lora_shrink(
            x,
            a_stacked,
            *seg[:4],
            slot_rank,
            max_rank,
            seg_scale=seg_scale,
            seg_align=seg_align,
            policy=policy,
        )
        ns = len(out_slice_sizes)
        y = gluon_op.launch_gluon_lora_gemm(
            x, weight, bias, s[:ns], b_stacked, token_seg, seg_slot, out_slice_sizes
        )
        return y, s
    if policy.shrink_in and shrink_in_ok(x, weight, a_stacked, b_stacked, seg_align, config):
        s = x.new_empty((a_stacked.shape[0], x.shape[0], scaled_cols(max_rank)))
        y = launch_lora_gemm(x, weight, bias, s, b_stacked, *seg, out_slice_sizes, config=config, s_scaled=True,
                             seg_align=seg_align, a_stacked=a_stacked)  # fmt: skip
        return y, s
    s = launch_lora_shrink(
        x, a_stacked, *seg[:4], slot_rank, max_rank, seg_scale=seg_scale, seg_align=seg_align, policy=policy
    )
    ns = len(out_slice_sizes)
    y = launch_lora_gemm(x, weight, bias, s[:ns], b_stacked, *seg, out_slice_sizes, config=config, s_scaled=True,
                         seg_align=seg_align)  # fmt: skip
    return y, s


@torch.library.custom_op("ditserve::lora_linear", mutates_args=())
def lora_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    token_seg: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor,
    slot_rank: torch.Tensor,
    max_rank: int,
    out_slice_sizes: list[int],
    seg_align: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x · Wᵀ + bias + the segmented LoRA term, scale · x · Aᵀ for every slice of a_stacked in x's dtype);
    Triton on CUDA (or TRITON_INTERPRET=1), else the reference."""
    args = (
        x,
        weight,
        bias,
        a_stacked,
        b_stacked,
        token_seg,
        seg_start,
        seg_len,
        seg_slot,
        seg_scale,
        slot_rank,
    )
    if use_triton(x):
        return launch_lora_linear(*args, max_rank, out_slice_sizes, seg_align)
    ns = len(out_slice_sizes)
    y = lora_linear_ref(x, weight, bias, a_stacked[:ns], b_stacked, seg_start, seg_len, seg_slot, seg_scale,
                        slot_rank, max_rank, out_slice_sizes)  # fmt: skip
    s = lora_shrink_scaled_ref(
        x, a_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank, max_rank
    )
    return y, s


@lora_linear_op.register_fake
def _(x, weight, bias, a_stacked, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
      max_rank, out_slice_sizes, seg_align=1):  # fmt: skip
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty(
        (a_stacked.shape[0], x.shape[0], scaled_cols(max_rank))
    )
