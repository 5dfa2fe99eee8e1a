"""Launcher and torch custom op for the segmented LoRA expand (see kernel.py)."""

from __future__ import annotations

import torch

from ditserve.kernels._checks import check_expand, check_segments
from ditserve.kernels._dispatch import block_rank, dot_precision, num_programs_limit, tma_ok, use_triton
from ditserve.kernels._tiling import b_descriptor, column_blocks, column_chunks
from ditserve.kernels.lora_expand import gluon_op
from ditserve.kernels.lora_expand.configs import ExpandProblem, choose, triton_tiles
from ditserve.kernels.lora_expand.reference import fill_bias, lora_expand_ref
from ditserve.kernels.policy import KernelPolicy

# Row-stationary tiles (configs.py) may carry PER_SM: programs of the tile an SM holds (rank 64: 106 KB of shared memory, rank 128: 229 KB); with it the
# launch chooses between CHUNK and ALT_CHUNK (`wave_chunk`)


def wave_chunk(
    slice_blocks: list[int],
    row_blocks: int,
    chunks: tuple[int, int],
    per_sm: int,
    num_sms: int,
    cost: float = 2.0,
) -> int:
    """The chunk (of `chunks`, the first the default) with which a launch takes the fewest rounds × steps: a
    tile that fills an SM (per_sm 1) runs its programs in rounds of one per SM, each round (chunk + a program's
    fixed cost, ~2 column blocks: its s tile and pipeline fill) long. With two per SM the programs share an SM's
    bandwidth and many rounds blur, so there the other chunk is taken only when all its programs run in one
    round (measured: docs/notes/benchmarks-log.md, "The in-place expand: chunks by rounds of programs")."""
    slots = per_sm * num_sms

    def programs(c: int) -> int:
        return row_blocks * sum(-(-b // c) for b in slice_blocks)

    def steps(c: int) -> float:
        return -(-programs(c) // slots) * (c + cost)

    fits = [c for c in chunks if c == chunks[0] or per_sm == 1 or programs(c) <= slots]
    return min(fits, key=steps)


def launch_lora_expand(
    y: torch.Tensor,  # [num_tokens, sum(out_slice_sizes)] fp16/bf16/fp32, updated in place
    s: torch.Tensor,  # [num_slices, num_tokens, rank_dim] fp32 (from lora_shrink)
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank], y's dtype
    token_seg: torch.Tensor,  # [num_tokens] int32
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    seg_scale: torch.Tensor,  # [num_segments] fp32, alpha/rank × strength
    slot_rank: torch.Tensor,  # [max_loras] int32
    out_slice_sizes: list[int],  # 1..4 output slices, slice j pairs with s[j]
    accumulate: bool = True,  # False: y = delta + bias, every element written
    bias: torch.Tensor | None = None,  # [sum(out_slice_sizes)], y's dtype
    config: dict[str, int] | None = None,  # tile override (benchmarks); GLUON=1: the Gluon kernel for Hopper
    seg_align: int = 1,  # LoRABatchMeta.seg_align: the Gluon kernel needs segments on its row blocks
    policy: KernelPolicy | None = None,  # which variants the default may take (None: active_policy())
) -> None:
    from ditserve.kernels.lora_expand.kernel import _lora_expand_kernel, _lora_expand_rows_kernel

    check_expand(y, s, b_stacked, out_slice_sizes)
    check_segments(y, b_stacked.shape[0], token_seg, seg_start, seg_len, seg_slot, slot_rank, seg_scale)
    if bias is not None:
        assert bias.shape == (y.shape[1],) and bias.is_contiguous(), bias.shape
    num_tokens, rank_dim = y.shape[0], s.shape[2]
    if num_tokens == 0:
        return
    if rank_dim == 0:
        if not accumulate:
            fill_bias(y, bias)
        return
    block_r = block_rank(rank_dim)
    cfg = dict(
        config
        or choose(
            ExpandProblem(len(out_slice_sizes), block_r, accumulate, bias is not None), y.device, policy
        )
    )
    if cfg.pop("GLUON", 0):  # the Gluon kernel where its contract holds, else the Triton kernel's tiles
        if (
            accumulate
            and bias is None
            and gluon_op.gluon_expand_ok(y, s, b_stacked, out_slice_sizes, seg_align, cfg)
        ):
            gluon_op.launch_gluon_lora_expand(
                y, s, b_stacked, token_seg, seg_slot, seg_scale, slot_rank, out_slice_sizes, cfg
            )
            return
        cfg = dict(triton_tiles(block_r, accumulate, bias is not None, y.device))
    cols, blks, num_col_blocks = column_blocks(out_slice_sizes, cfg["BLOCK_N"])
    precision = dot_precision(y.dtype)
    if cfg.pop("ROWS", 0) and accumulate and bias is None:
        chunk, stages = cfg.pop("CHUNK"), cfg.pop("STAGES")
        per_sm, alt_chunk = cfg.pop("PER_SM", 0), cfg.pop("ALT_CHUNK", 0)
        if per_sm and alt_chunk:
            slice_blocks = [-(-n // cfg["BLOCK_N"]) for n in out_slice_sizes]
            row_blocks = -(-num_tokens // cfg["BLOCK_M"])
            chunk = wave_chunk(
                slice_blocks, row_blocks, (chunk, alt_chunk), per_sm, num_programs_limit(y.device)
            )
        chks = column_chunks(blks, num_col_blocks, chunk)
        b_desc, b_tma = b_descriptor(b_stacked, bool(cfg.pop("B_TMA", 0)), cfg["BLOCK_N"], block_r)
        # y's TMA store must not cross a slice: every slice whole column blocks
        y_tma = bool(cfg.pop("Y_TMA", 0)) and b_tma and tma_ok(y)
        y_tma = y_tma and all(n % cfg["BLOCK_N"] == 0 for n in out_slice_sizes)
        s_early = bool(cfg.pop("S_EARLY", 0)) and y_tma
        y_desc = b_stacked  # a placeholder where the kernel reads no descriptor
        if y_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            y_desc = TensorDescriptor.from_tensor(y, [cfg["BLOCK_M"], cfg["BLOCK_N"]])
        _lora_expand_rows_kernel[(chks[-1], -(-num_tokens // cfg["BLOCK_M"]))](
            y, s, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
            num_tokens, rank_dim, *cols, y.shape[1], *blks, *chks[:3],
            *y.stride(), *s.stride(), *b_stacked.stride(), b_desc, y_desc,
            BLOCK_R=block_r, CHUNK=chunk, STAGES=stages, B_TMA=b_tma, Y_TMA=y_tma, S_EARLY=s_early,
            PRECISION=precision, **cfg,
        )  # fmt: skip
        return
    for key in ("CHUNK", "STAGES", "B_TMA", "Y_TMA", "S_EARLY", "PER_SM", "ALT_CHUNK"):
        cfg.pop(key, None)
    grid = (num_col_blocks, -(-num_tokens // cfg["BLOCK_M"]))
    _lora_expand_kernel[grid](
        y, s, b_stacked, bias if bias is not None else y,
        token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank,
        num_tokens, rank_dim, *cols, y.shape[1], *blks,
        *y.stride(), *s.stride(), *b_stacked.stride(),
        BLOCK_R=block_r, ACCUMULATE=accumulate, HAS_BIAS=bias is not None, PRECISION=precision, **cfg,
    )  # fmt: skip


@torch.library.custom_op("ditserve::lora_expand", mutates_args=("y",))
def lora_expand_op(
    y: torch.Tensor,
    s: torch.Tensor,
    b_stacked: torch.Tensor,
    token_seg: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor,
    slot_rank: torch.Tensor,
    out_slice_sizes: list[int],
    accumulate: bool = True,
    bias: torch.Tensor | None = None,
    seg_align: int = 1,
) -> None:
    """Segmented expand into y (in place); Triton on CUDA (or TRITON_INTERPRET=1), else the reference."""
    args = (y, s, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank, out_slice_sizes)
    if use_triton(y):
        launch_lora_expand(*args, accumulate=accumulate, bias=bias, seg_align=seg_align)
    else:
        lora_expand_ref(y, s, b_stacked, seg_start, seg_len, seg_slot, seg_scale, slot_rank, out_slice_sizes,
                        accumulate=accumulate, bias=bias)  # fmt: skip


@lora_expand_op.register_fake
def _(y, s, b_stacked, token_seg, seg_start, seg_len, seg_slot, seg_scale, slot_rank, out_slice_sizes,
      accumulate=True, bias=None, seg_align=1):  # fmt: skip
    return None
