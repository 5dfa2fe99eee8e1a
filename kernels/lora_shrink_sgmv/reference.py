"""Plain torch SGMV shrink: a loop over slots, each gathering its tokens. Also the CPU fallback."""

import torch


def lora_shrink_sgmv_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden]
    sorted_token_ids: torch.Tensor,  # [num_tokens] int32
    chunk_slot: torch.Tensor,  # [num_chunks] int32
    chunk_start: torch.Tensor,  # [num_chunks] int32
    chunk_len: torch.Tensor,  # [num_chunks] int32
    slot_rank: torch.Tensor,  # [max_loras] int32
    rank_dim: int,
) -> torch.Tensor:  # [num_slices, num_tokens, rank_dim] fp32, zero where no LoRA applies
    # reads num_tokens*hidden*x.itemsize + A of active slots, writes num_slices*num_tokens*rank_dim*4
    num_slices = a_stacked.shape[0]
    s = torch.zeros(num_slices, x.shape[0], rank_dim, dtype=torch.float32, device=x.device)
    ranks = slot_rank.tolist()
    ids = sorted_token_ids.long()
    tokens_of: dict[int, list[torch.Tensor]] = {}
    for slot, start, n in zip(chunk_slot.tolist(), chunk_start.tolist(), chunk_len.tolist(), strict=True):
        tokens_of.setdefault(slot, []).append(ids[start : start + n])
    for slot, parts in tokens_of.items():
        if slot < 0 or ranks[slot] == 0:
            continue
        tok = torch.cat(parts)
        r = ranks[slot]
        for j in range(num_slices):
            s[j, tok, :r] = x[tok].float() @ a_stacked[j, slot, :r].float().T
    return s
