"""Plain torch segmented shrink: a loop over segments and slices. Also the CPU fallback."""

import torch


def lora_shrink_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden]
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    slot_rank: torch.Tensor,  # [max_loras] int32
    rank_dim: int,
) -> torch.Tensor:  # [num_slices, num_tokens, rank_dim] fp32, zero where no LoRA applies
    # reads num_tokens*hidden*x.itemsize + num_slices*(active slots)*rank*hidden*a.itemsize bytes,
    # writes num_slices*num_tokens*rank_dim*4
    num_slices = a_stacked.shape[0]
    s = torch.zeros(num_slices, x.shape[0], rank_dim, dtype=torch.float32, device=x.device)
    ranks = slot_rank.tolist()
    for start, n, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist(), strict=True):
        if slot < 0 or n == 0 or ranks[slot] == 0:
            continue
        r = ranks[slot]
        xs = x[start : start + n].float()
        for j in range(num_slices):
            s[j, start : start + n, :r] = xs @ a_stacked[j, slot, :r].float().T
    return s


def lora_shrink_scaled_ref(
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    token_seg: torch.Tensor,  # [num_tokens] int32
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_scale: torch.Tensor,  # [num_segments] fp32
    slot_rank: torch.Tensor,
    rank_dim: int,
) -> torch.Tensor:  # [num_slices, num_tokens, rank_dim rounded up to 16] in x's dtype
    """scale(t) · s in x's dtype, zero columns up to a multiple of 16 (the fused GEMM's input)."""
    s = lora_shrink_ref(x, a_stacked, seg_start, seg_len, seg_slot, slot_rank, rank_dim)
    s = s * seg_scale[token_seg.long()][None, :, None] if x.shape[0] else s
    return torch.nn.functional.pad(s, (0, -rank_dim % 16)).to(x.dtype)
