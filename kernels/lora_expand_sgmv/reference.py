"""Plain torch SGMV expand: a loop over slots, each gathering its tokens. Also the CPU fallback."""

import torch


def lora_expand_sgmv_ref(
    y: torch.Tensor,  # [num_tokens, sum(out_slice_sizes)], updated in place
    s: torch.Tensor,  # [num_slices, num_tokens, rank_dim] fp32
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    sorted_token_ids: torch.Tensor,  # [num_tokens] int32
    token_scale: torch.Tensor,  # [num_tokens] fp32
    chunk_slot: torch.Tensor,  # [num_chunks] int32
    chunk_start: torch.Tensor,  # [num_chunks] int32
    chunk_len: torch.Tensor,  # [num_chunks] int32
    slot_rank: torch.Tensor,  # [max_loras] int32
    out_slice_sizes: list[int],
) -> None:
    # reads and writes the LoRA tokens' rows of y (num_lora_tokens*n_total*y.itemsize each way),
    # reads their s rows and B of the active slots
    ranks = slot_rank.tolist()
    ids = sorted_token_ids.long()
    offsets = [0]
    for n in out_slice_sizes:
        offsets.append(offsets[-1] + n)
    tokens_of: dict[int, list[torch.Tensor]] = {}
    for slot, start, n in zip(chunk_slot.tolist(), chunk_start.tolist(), chunk_len.tolist(), strict=True):
        tokens_of.setdefault(slot, []).append(ids[start : start + n])
    for slot, parts in tokens_of.items():
        if slot < 0 or ranks[slot] == 0:
            continue
        tok = torch.cat(parts)
        r = ranks[slot]
        scale = token_scale[tok][:, None]
        for j in range(len(out_slice_sizes)):
            cols = slice(offsets[j], offsets[j + 1])
            delta = (scale * s[j, tok, :r]) @ b_stacked[slot, cols, :r].to(s.dtype).T
            y[tok, cols] = (y[tok, cols].to(s.dtype) + delta).to(y.dtype)
