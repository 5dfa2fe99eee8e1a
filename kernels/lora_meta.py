"""Per-step batch description for the multi-LoRA kernels.

A step's tokens are laid out request after request (per CFG branch, per rank: the caller decides); each
contiguous range is a *segment* with one adapter slot (-1 = no LoRA) and one scale (alpha / rank ×
request strength). The segmented (SGEMM) kernels read the segment tables; the chunked SGMV kernels read
a permutation that groups tokens by slot, cut into chunks of at most `chunk_size` tokens.

Everything the kernels read is an int32/fp32 tensor built once per step on the host and copied to the
device in one go; the few Python ints (`num_tokens`, `max_rank`, ...) set grid sizes and constexprs, so
no launch needs a device→host sync.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

# SMs of the target GPU; only used by the chunk-size policy (an H100/H200 has 132).
DEFAULT_NUM_SMS = 132
# Chunk sizes the policy picks from; the smallest is the SGMV kernels' 64-row tiles, which a smaller chunk cuts
# down (measured: docs/notes/benchmarks-log.md, "The SGMV expand's row-stationary walk").
CHUNK_SIZES = (64, 128, 256)


def choose_chunk_size(tokens_per_slot: Sequence[int], num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Chunk-size policy for SGMV: the largest chunk that still gives every SM about two chunks, and never less
    than the smallest of CHUNK_SIZES (64 rows).

    Large chunks amortise the per-chunk adapter load (A or B tile stays in registers/L2 across more
    rows) and keep the kernels' row tiles whole; below 64 rows those tiles shrink to the chunk, which cost more
    than the SMs that larger chunks leave idle on small batches. A chunk never mixes slots, so each slot's tail
    adds at most one partial chunk.
    """
    counts = [n for n in tokens_per_slot if n > 0]
    for size in reversed(CHUNK_SIZES[1:]):
        if sum(-(-n // size) for n in counts) >= 2 * num_sms:
            return size
    return CHUNK_SIZES[0]


@dataclasses.dataclass(frozen=True)
class LoRABatchMeta:
    """Which adapter each token uses, in the forms the LoRA kernels read. Build with `LoRABatchMeta.build`.

    Tensors (all on one device, int32 unless noted):
      seg_start [num_segments]      first token of each segment
      seg_len   [num_segments]      tokens in each segment (0 allowed)
      seg_slot  [num_segments]      adapter slot, -1 = no LoRA (also where the rank is 0 or len is 0)
      seg_scale [num_segments] fp32 alpha / rank × strength of that request
      token_seg [num_tokens]        segment of each token (never an empty segment)
      slot_rank [max_loras]         rank of each slot (0 = empty slot)
      sorted_token_ids [num_tokens] tokens grouped by slot (LoRA slots first, no-LoRA tokens last)
      token_scale [num_tokens] fp32 seg_scale of each token
      chunk_slot  [num_chunks]      slot of each SGMV chunk (-1 = chunk of no-LoRA tokens)
      chunk_start [num_chunks]      first position of the chunk in sorted_token_ids
      chunk_len   [num_chunks]      tokens in the chunk (1..chunk_size)
    Host ints: num_tokens, max_rank (largest rank in use; 0 = no LoRA in the batch: kernels skip),
    chunk_size, num_chunks, seg_align (the greatest common divisor of the first tokens of the non-empty
    segments, 0 where all start at token 0: row blocks of b tokens never hold two segments when seg_align % b
    == 0; four requests of 4608 tokens: 4608, for blocks of 64, 128 or 192 rows; one request: any block).
    """

    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    seg_scale: torch.Tensor
    token_seg: torch.Tensor
    slot_rank: torch.Tensor
    sorted_token_ids: torch.Tensor
    token_scale: torch.Tensor
    chunk_slot: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    num_tokens: int
    max_rank: int
    chunk_size: int
    num_chunks: int
    seg_align: int = 1

    @property
    def num_segments(self) -> int:
        return self.seg_start.shape[0]

    @property
    def has_lora(self) -> bool:
        return self.max_rank > 0

    @classmethod
    def build(
        cls,
        requests: Sequence[tuple[int, int]],
        slot_ranks: Sequence[int],
        scales: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
        chunk_size: int | None = None,
        num_sms: int = DEFAULT_NUM_SMS,
    ) -> LoRABatchMeta:
        """Build from `requests` = [(num_tokens, slot), ...] in token order.

        slot_ranks: rank of every slot (len = max_loras); scales: one per request (default 1.0);
        chunk_size: SGMV chunk size, default from `choose_chunk_size`. Raises ValueError on a slot
        out of range or a negative token count.
        """
        num_loras = len(slot_ranks)
        if scales is None:
            scales = [1.0] * len(requests)
        if len(scales) != len(requests):
            raise ValueError(f"scales has {len(scales)} entries for {len(requests)} requests")
        starts, lens, slots = [], [], []
        token_seg: list[int] = []
        pos = 0
        for i, (n, slot) in enumerate(requests):
            if n < 0:
                raise ValueError(f"request {i}: num_tokens={n} < 0")
            if slot >= num_loras or slot < -1:
                raise ValueError(f"request {i}: slot {slot} not in [-1, {num_loras})")
            # a slot of rank 0 (or an empty request) is the same as no LoRA: the kernels test one thing
            active = slot >= 0 and slot_ranks[slot] > 0 and n > 0
            starts.append(pos)
            lens.append(n)
            slots.append(slot if active else -1)
            token_seg += [i] * n
            pos += n
        num_tokens = pos
        seg_align = math.gcd(*(start for start, n in zip(starts, lens, strict=True) if n))
        max_rank = max((slot_ranks[s] for s in slots if s >= 0), default=0)
        if max_rank > 128:
            raise ValueError(f"rank {max_rank} > 128 is not supported by the LoRA kernels")

        # SGMV: group tokens by slot (stable, so each group keeps token order), no-LoRA tokens last
        order = sorted(range(len(requests)), key=lambda i: (slots[i] < 0, slots[i]))
        sorted_ids: list[int] = []
        groups: list[tuple[int, int]] = []  # (slot, num_tokens) in sorted order
        for i in order:
            if groups and groups[-1][0] == slots[i]:
                groups[-1] = (slots[i], groups[-1][1] + lens[i])
            elif lens[i] > 0:
                groups.append((slots[i], lens[i]))
            sorted_ids += range(starts[i], starts[i] + lens[i])
        if chunk_size is None:
            chunk_size = choose_chunk_size([n for s, n in groups if s >= 0], num_sms)
        chunk_slot, chunk_start, chunk_len = [], [], []
        pos = 0
        for slot, n in groups:
            for off in range(0, n, chunk_size):
                chunk_slot.append(slot)
                chunk_start.append(pos + off)
                chunk_len.append(min(chunk_size, n - off))
            pos += n

        def i32(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int32)

        host = dict(
            seg_start=i32(starts),
            seg_len=i32(lens),
            seg_slot=i32(slots),
            seg_scale=torch.tensor(list(scales), dtype=torch.float32),
            token_seg=i32(token_seg),
            slot_rank=i32(list(slot_ranks)),
            sorted_token_ids=i32(sorted_ids),
            token_scale=torch.tensor([scales[i] for i in token_seg], dtype=torch.float32),
            chunk_slot=i32(chunk_slot),
            chunk_start=i32(chunk_start),
            chunk_len=i32(chunk_len),
        )
        dev = {k: v.to(device, non_blocking=True) for k, v in host.items()}
        return cls(
            **dev,
            num_tokens=num_tokens,
            max_rank=max_rank,
            chunk_size=chunk_size,
            num_chunks=len(chunk_slot),
            seg_align=seg_align,
        )
