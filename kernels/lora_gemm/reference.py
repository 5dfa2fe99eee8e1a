"""Plain torch GEMM + segmented LoRA: the base linear in fp32, then a loop over segments and output slices.
Also the CPU fallback."""

import torch


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
    ranks = slot_rank.tolist()
    offsets = [0]
    for n in out_slice_sizes:
        offsets.append(offsets[-1] + n)
    segs = zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist(), seg_scale.tolist(), strict=True)
    for start, n, slot, scale in segs:
        if slot < 0 or n == 0 or ranks[slot] == 0 or s.shape[2] == 0:
            continue
        r = min(ranks[slot], s.shape[2], b_stacked.shape[2])
        if s_scaled:
            scale = 1.0
        rows = slice(start, start + n)
        for j in range(len(out_slice_sizes)):
            cols = slice(offsets[j], offsets[j + 1])
            y[rows, cols] += scale * s[j, rows, :r].to(acc) @ b_stacked[slot, cols, :r].to(acc).T
    return y.to(x.dtype)
