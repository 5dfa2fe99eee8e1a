"""Plain torch segmented expand: a loop over segments and output slices. Also the CPU fallback."""

import torch


def fill_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = bias in every row (zeros without a bias); returns y."""
    return y.copy_(bias.expand_as(y) if bias is not None else torch.zeros_like(y))


def lora_expand_ref(
    y: torch.Tensor,  # [num_tokens, sum(out_slice_sizes)], updated in place
    s: torch.Tensor,  # [num_slices, num_tokens, rank_dim] fp32
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    seg_scale: torch.Tensor,  # [num_segments] fp32
    slot_rank: torch.Tensor,  # [max_loras] int32
    out_slice_sizes: list[int],
    accumulate: bool = True,
    bias: torch.Tensor | None = None,  # [sum(out_slice_sizes)], only with accumulate=False
) -> None:
    # accumulate: reads and writes num_tokens*n_total*y.itemsize bytes (writes only, when not accumulating),
    # reads num_slices*num_tokens*rank_dim*4 + (active slots)*n_total*rank*b.itemsize
    if not accumulate:
        fill_bias(y, bias)
    ranks = slot_rank.tolist()
    offsets = [0]
    for n in out_slice_sizes:
        offsets.append(offsets[-1] + n)
    segs = zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist(), seg_scale.tolist(), strict=True)
    for start, n, slot, scale in segs:
        if slot < 0 or n == 0 or ranks[slot] == 0:
            continue
        r = ranks[slot]
        rows = slice(start, start + n)
        for j in range(len(out_slice_sizes)):
            cols = slice(offsets[j], offsets[j + 1])
            delta = scale * s[j, rows, :r] @ b_stacked[slot, cols, :r].to(s.dtype).T
            y[rows, cols] = (y[rows, cols].to(s.dtype) + delta).to(y.dtype)
