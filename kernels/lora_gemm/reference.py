"""Plain torch GEMM + segmented LoRA: the base linear in fp32, then the expand reference on it.
Also the CPU fallback."""

import torch

from ditserve.kernels.lora_expand.reference import lora_expand_ref


def lora_gemm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [sum(out_slice_sizes), hidden]
    bias: torch.Tensor | None,  # [sum(out_slice_sizes)]
    s: torch.Tensor,  # [num_slices, num_tokens, rank_dim] (rank_dim 0 = no LoRA)
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    seg_scale: torch.Tensor,  # [num_segments] fp32
    slot_rank: torch.Tensor,  # [max_loras] int32
    out_slice_sizes: list[int],
    s_scaled: bool = False,  # s already holds scale · x · Aᵀ (seg_scale not applied again)
) -> torch.Tensor:  # [num_tokens, sum(out_slice_sizes)], x's dtype
    # reads num_tokens*hidden + n_total*hidden + num_slices*num_tokens*rank_dim + (active slots)*n_total*rank
    # elements, writes num_tokens*n_total once
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for the oracle tests
    y = x.to(acc) @ weight.to(acc).T
    if bias is not None:
        y += bias.to(acc)
    if s.shape[2] > 0:
        scale = torch.ones_like(seg_scale) if s_scaled else seg_scale
        ranks = slot_rank.clamp(max=min(s.shape[2], b_stacked.shape[2]))
        lora_expand_ref(y, s.to(acc), b_stacked, seg_start, seg_len, seg_slot, scale, ranks, out_slice_sizes)
    return y.to(x.dtype)
