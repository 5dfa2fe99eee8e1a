"""Chunked SGMV LoRA shrink: tokens grouped by adapter through a permutation, one program per chunk.

A chunk is ≤ chunk_size tokens of one slot (LoRABatchMeta.sorted_token_ids[chunk_start : +chunk_len]).
The program walks its chunk in BLOCK_M sub-blocks, gathering x rows by token id and scattering s rows
back, so requests that share an adapter share chunks and a skewed mix still yields evenly sized work.
Chunks of no-LoRA tokens (slot -1) only write zeros. With SPLIT the grid is (chunks, slices): a program
computes one slice's s (fewer accumulators a program, at ranks 64-128 what lets the segmented kernel keep its
tiles large), reading its chunk's x rows once per slice.
"""

import triton
import triton.language as tl

from ditserve.kernels._tiles import a_tile_ptrs, shrink_k_steps, slot_rank, store_slices, zero_slices


@triton.jit
def _lora_shrink_sgmv_kernel(
    x_ptr,  # [num_tokens, hidden]
    a_ptr,  # [num_slices, max_loras, max_rank, hidden]
    s_ptr,  # [num_slices, num_tokens, rank_dim] fp32
    sorted_ids_ptr,  # [num_tokens] int32
    chunk_slot_ptr,  # [num_chunks] int32
    chunk_start_ptr,  # [num_chunks] int32
    chunk_len_ptr,  # [num_chunks] int32
    slot_rank_ptr,  # [max_loras] int32
    hidden,
    rank_dim,
    stride_xt,
    stride_xh,
    stride_as,
    stride_al,
    stride_ar,
    stride_ah,
    stride_ss,
    stride_st,
    stride_sr,
    NUM_SLICES: tl.constexpr,  # slices a program computes (1 with SPLIT)
    SPLIT: tl.constexpr,  # the grid's second axis is the slice
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    if SPLIT:
        a_ptr += tl.program_id(1).to(tl.int64) * stride_as
        s_ptr += tl.program_id(1).to(tl.int64) * stride_ss
    # the chunk's table entries loaded before the slot's rank (the order the expand's chunk_adapter differs in)
    slot = tl.load(chunk_slot_ptr + chunk)
    start = tl.load(chunk_start_ptr + chunk)
    length = tl.load(chunk_len_ptr + chunk)
    rank = slot_rank(slot, slot_rank_ptr)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    k_iters = tl.where(rank > 0, tl.cdiv(hidden, BLOCK_K), 0)
    a_base = a_tile_ptrs(a_ptr, slot, offs_r, offs_k, stride_al, stride_ar, stride_ah)
    for m0 in range(0, length, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_mask = offs_m < length
        tok = tl.load(sorted_ids_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
        acc0, acc1, acc2, acc3 = zero_slices(BLOCK_M, BLOCK_R)
        x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
        acc0, acc1, acc2, acc3 = shrink_k_steps(
            acc0, acc1, acc2, acc3, x_ptrs, a_base, row_mask, r_mask, k_iters, hidden, stride_xh, stride_as,
            stride_ah, NUM_SLICES, BLOCK_K, PRECISION,
        )  # fmt: skip
        s_ptrs = s_ptr + tok[:, None] * stride_st + offs_r[None, :] * stride_sr
        s_mask = row_mask[:, None] & (offs_r < rank_dim)[None, :]
        store_slices(s_ptrs, s_mask, stride_ss, acc0, acc1, acc2, acc3, NUM_SLICES)
