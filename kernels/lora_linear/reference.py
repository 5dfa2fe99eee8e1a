"""Plain torch LoRA linear: the shrink reference, then the GEMM + expand reference. Also the CPU fallback."""

import torch

from ditserve.kernels.lora_gemm.reference import lora_gemm_ref
from ditserve.kernels.lora_shrink.reference import lora_shrink_ref


def lora_linear_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [sum(out_slice_sizes), hidden]
    bias: torch.Tensor | None,  # [sum(out_slice_sizes)]
    a_stacked: torch.Tensor,  # [num_slices, max_loras, max_rank, hidden]
    b_stacked: torch.Tensor,  # [max_loras, sum(out_slice_sizes), max_rank]
    seg_start: torch.Tensor,  # [num_segments] int32
    seg_len: torch.Tensor,  # [num_segments] int32
    seg_slot: torch.Tensor,  # [num_segments] int32, -1 = no LoRA
    seg_scale: torch.Tensor,  # [num_segments] fp32
    slot_rank: torch.Tensor,  # [max_loras] int32
    max_rank: int,  # largest rank in use (0 = no LoRA)
    out_slice_sizes: list[int],
) -> torch.Tensor:  # [num_tokens, sum(out_slice_sizes)], x's dtype
    # reads x, W and the active slots' A and B once, writes y once
    s = lora_shrink_ref(x, a_stacked, seg_start, seg_len, seg_slot, slot_rank, max_rank)
    return lora_gemm_ref(
        x, weight, bias, s, b_stacked, seg_start, seg_len, seg_slot, seg_scale, slot_rank, out_slice_sizes
    )
