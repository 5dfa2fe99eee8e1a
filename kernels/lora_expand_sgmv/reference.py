"""Plain torch SGMV expand: the segmented reference over the tokens in sorted order, whose chunks are its
segments (each token's scale applied to its s row first). Also the CPU fallback."""

import torch

from ditserve.kernels.lora_expand.reference import lora_expand_ref


def lora_expand_sgmv_ref(
    y: torch.Tensor,  # [num_tokens, sum(out_slice_sizes)], updated in place
    s: torch.Tensor,  # [num_slices, num_tokens, rank_dim] fp32
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    sorted_token_ids: torch.Tensor,  # [num_tokens] int32, a permutation of range(num_tokens)
    token_scale: torch.Tensor,  # [num_tokens] fp32
    chunk_slot: torch.Tensor,  # [num_chunks] int32
    chunk_start: torch.Tensor,  # [num_chunks] int32
    chunk_len: torch.Tensor,  # [num_chunks] int32
    slot_rank: torch.Tensor,  # [max_loras] int32
    out_slice_sizes: list[int],
) -> None:
    # reads and writes the LoRA tokens' rows of y (num_lora_tokens*n_total*y.itemsize each way),
    # reads their s rows and B of the active slots
    ids = sorted_token_ids.long()
    y_sorted = y[ids]
    s_sorted = s[:, ids] * token_scale[ids][None, :, None]
    ones = torch.ones(chunk_start.shape)  # the scale is in s_sorted already
    segs = (chunk_start, chunk_len, chunk_slot, ones, slot_rank)
    lora_expand_ref(y_sorted, s_sorted, b_stacked, *segs, out_slice_sizes)
    y[ids] = y_sorted
