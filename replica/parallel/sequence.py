"""Cutting the image/video token sequence into sp shards and putting it back together.

The sequence is padded at its end to a multiple of sp = ulysses × (ring | kv_gather); shard i holds
tokens [i·L, (i+1)·L). Padding is always a suffix of the global sequence, so in any contiguous block
the real keys are a prefix: attention masks padding by slicing, which is exact and free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .collectives import all_gather_stacked
from .mesh import ParallelMesh


@dataclass(frozen=True)
class SequenceLayout:
    """How one forward's image/video tokens are spread over the sp axis."""

    num_tokens: int  # real tokens in the global sequence
    num_shards: int  # sp degree
    shard_index: int  # this rank's shard (= sp rank)
    ulysses: int  # ulysses degree (block = ulysses consecutive shards)

    @property
    def num_local(self) -> int:
        return -(-self.num_tokens // self.num_shards)

    @property
    def num_padded(self) -> int:
        return self.num_local * self.num_shards

    @property
    def block_len(self) -> int:
        """Tokens of one ring / kv-gather block: what a Ulysses group holds after its all-to-all."""
        return self.num_local * self.ulysses

    def block_valid(self, num_blocks: int) -> list[int]:
        """Real (non-padding) tokens in each ring / kv-gather block, in block order."""
        length = self.block_len
        return [max(0, min(length, self.num_tokens - j * length)) for j in range(num_blocks)]

    @classmethod
    def plan(cls, num_tokens: int, mesh: ParallelMesh) -> SequenceLayout:
        return cls(
            num_tokens=num_tokens,
            num_shards=mesh.sp_size,
            shard_index=mesh.sp_rank,
            ulysses=mesh.ulysses_size,
        )


def shard_sequence(x: torch.Tensor, layout: SequenceLayout, dim: int) -> torch.Tensor:
    """Pad `x` along `dim` to the padded length and return this rank's shard (contiguous)."""
    assert x.shape[dim] == layout.num_tokens, (x.shape, dim, layout)
    if layout.num_shards == 1:
        return x
    dim = dim % x.dim()
    pad = layout.num_padded - layout.num_tokens
    if pad:
        # F.pad counts from the last dim: (left, right) pairs
        spec = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
        x = F.pad(x, spec)
    return x.narrow(dim, layout.shard_index * layout.num_local, layout.num_local).contiguous()


def gather_sequence(x: torch.Tensor, layout: SequenceLayout, mesh: ParallelMesh, dim: int) -> torch.Tensor:
    """All-gather shards along `dim` over the sp axis and cut the padding off."""
    group = mesh.get_group("sp")
    if group is None:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    gathered = all_gather_stacked(x, group)
    full = gathered.movedim(0, dim).flatten(dim, dim + 1)
    return full.narrow(dim, 0, layout.num_tokens)
