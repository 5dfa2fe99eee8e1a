"""AnyFlow-FAR's parallel plan (`ANYFLOW_PLAN`): Ulysses over the tokens of a forward, the K/V cache
sharded the same way (by heads).

A FAR forward is either one chunk's flow-map step (its tokens attend to the cached K/V of the past chunks
and to themselves) or the cache forward (every finished chunk, the older ones through the compressed 4×4
patches, under a block-causal flex-attention mask). With Ulysses degree U:

1. the sequence is split where it first exists (``blocks.0``'s input) and gathered after ``proj_out``;
   the per-token modulation (``condition_embedder``'s ``temb`` and ``timestep_proj``) is split the same way;
2. in each self-attention, q/k/v are computed for the local tokens (q/k RMS-normalised over all heads,
   per token), then one all-to-all per tensor gives every rank the *whole* sequence for H/U heads; the
   diffusers causal processor then runs unchanged on those heads (cache write or cache read, RoPE over the
   whole sequence, the flex block mask), so each rank's K/V cache holds its H/U heads of every cached
   token; the output goes back by the inverse all-to-all before ``to_out``. Cross-attention to the
   (replicated) text needs no communication.

A forward's token count must divide by U (no padding: padded tokens would enter the causal mask as real
ones): ``width``, ``height`` and the frames per chunk decide it, and a request that does not fit is refused
naming them. TP, ring, K/V-gather and CFG-parallel are refused for this family (``validate_layout``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan
from .sequence import shard_sequence
from .ulysses import gather_heads, scatter_heads


class _HeadSlice:
    """What the diffusers causal processor sees of an attention module under Ulysses: H/U heads over the
    whole sequence. q/k/v arrive scattered (normalised first, over all heads), ``to_out`` gathers back."""

    def __init__(self, attn: nn.Module, group, world: int):
        self.attn, self.group, self.world = attn, group, world
        self.heads = attn.heads // world
        self.norm_q = self.norm_k = None  # applied before the scatter (over all heads)
        self.to_out = [self._out, attn.to_out[1]]

    def _scatter(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(2, (self.attn.heads, -1))  # (B, S_local, H, D)
        return scatter_heads(x.unsqueeze(0).contiguous(), self.group)[0].flatten(2)  # (B, S, H/U·D)

    def to_q(self, x: torch.Tensor) -> torch.Tensor:
        return self._scatter(self.attn.norm_q(self.attn.to_q(x)).to(x.dtype))

    def to_k(self, x: torch.Tensor) -> torch.Tensor:
        return self._scatter(self.attn.norm_k(self.attn.to_k(x)).to(x.dtype))

    def to_v(self, x: torch.Tensor) -> torch.Tensor:
        return self._scatter(self.attn.to_v(x))

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        full, _ = gather_heads(x.unflatten(2, (self.heads, -1)).contiguous(), self.group)
        return self.attn.to_out[0](full.flatten(2))


class FarUlyssesAttnProcessor:
    """Self-attention of a FAR block over the Ulysses-sharded sequence (see the module docstring)."""

    def __init__(self, mesh: ParallelMesh, state: ForwardState) -> None:
        from diffusers.models.transformers.transformer_anyflow_far import AnyFlowCausalAttnProcessor

        self.inner = AnyFlowCausalAttnProcessor()
        self.group = mesh.get_group("ulysses")
        self.world = mesh.ulysses_size
        self.state = state

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.inner(_HeadSlice(attn, self.group, self.world), hidden_states, **kwargs)


def far_tokens(model: nn.Module, bound: dict[str, Any]) -> int:
    """Tokens of one forward: a chunk's (full resolution), or the cache forward's (compressed + full)."""
    config = model.config
    _, frames, _, height, width = bound["hidden_states"].shape  # (B, F, C, H, W)
    full = (height // config.patch_size[1]) * (width // config.patch_size[2])
    compressed = (height // config.compressed_patch_size[1]) * (width // config.compressed_patch_size[2])
    flag = bound.get("kv_cache_flag") or {}
    if not flag.get("is_cache_step"):
        return frames * full
    partition = list(bound["chunk_partition"])
    limit = config.full_chunk_limit - 1
    num_compressed = max(0, len(partition) - limit)
    compressed_frames = sum(partition[:num_compressed])
    return compressed_frames * compressed + (sum(partition) - compressed_frames) * full


def _on_forward(model: nn.Module, bound: dict[str, Any], state: ForwardState) -> None:
    if bound.get("kv_cache") is None:
        raise NotImplementedError("AnyFlow-FAR under Ulysses runs the K/V-cache paths only (inference)")
    world = state.extra["ulysses"]
    tokens = far_tokens(model, bound)
    if tokens % world:
        raise ValueError(
            f"size: a forward of {tokens} tokens does not split over --ulysses-degree {world}; choose a width, "
            f"height and frames per chunk whose token counts divide by {world}"
        )
    if "hook" not in state.extra:  # once per model: the per-token modulation is split like the tokens
        state.extra["hook"] = model.condition_embedder.register_forward_hook(
            lambda module, args, output: (
                shard_sequence(output[0], state.require_layout(), dim=1),
                shard_sequence(output[1], state.require_layout(), dim=1),
                *output[2:],
            )
        )


def _processor(mesh: ParallelMesh, state: ForwardState) -> FarUlyssesAttnProcessor:
    state.extra["ulysses"] = mesh.ulysses_size
    return FarUlyssesAttnProcessor(mesh, state)


ANYFLOW_PLAN = ParallelPlan(
    family="anyflow",
    tp={},
    attention="blocks.*.attn1",
    processor=_processor,
    tokens=far_tokens,
    split_block_inputs={"blocks.0": 1},
    gather={"proj_out": 1},
    on_forward=_on_forward,
)
