"""Plain torch SGMV shrink: the segmented reference over the tokens in sorted order, whose chunks are its
segments. Also the CPU fallback."""

import torch

from ditserve.kernels.lora_shrink.reference import lora_shrink_ref


def lora_shrink_sgmv_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden]
    sorted_token_ids: torch.Tensor,  # [num_tokens] int32, a permutation of range(num_tokens)
    chunk_slot: torch.Tensor,  # [num_chunks] int32
    chunk_start: torch.Tensor,  # [num_chunks] int32
    chunk_len: torch.Tensor,  # [num_chunks] int32
    slot_rank: torch.Tensor,  # [max_loras] int32
    rank_dim: int,
) -> torch.Tensor:  # [num_slices, num_tokens, rank_dim] fp32, zero where no LoRA applies
    # reads num_tokens*hidden*x.itemsize + A of active slots, writes num_slices*num_tokens*rank_dim*4
    ids = sorted_token_ids.long()
    s_sorted = lora_shrink_ref(x[ids], a_stacked, chunk_start, chunk_len, chunk_slot, slot_rank, rank_dim)
    s = torch.zeros_like(s_sorted)
    s[:, ids] = s_sorted
    return s
