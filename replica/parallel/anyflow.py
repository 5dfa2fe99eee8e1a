"""AnyFlow-FAR's self-attention (`FarCausalAttnProcessor`, on one rank and under Ulysses) and its parallel
plan (`ANYFLOW_PLAN`): Ulysses over the tokens of a forward, the K/V cache sharded the same way (by heads).

A FAR forward is either one chunk's flow-map step (its tokens attend to the cached K/V of the past chunks
and to themselves) or the cache forward (every finished chunk, the older ones through the compressed 4×4
patches, block-causal: a chunk's tokens attend to the chunks up to their own). The attention itself runs
outside the compiled blocks (`far_attention`): the lengths it slices change with every chunk.

With Ulysses degree U:

1. the sequence is split where it first exists (``blocks.0``'s input) and gathered after ``proj_out``;
   the per-token modulation (``condition_embedder``'s ``temb`` and ``timestep_proj``) is split the same way;
2. in each self-attention, q/k/v are computed for the local tokens (q/k RMS-normalised over all heads,
   per token), then one all-to-all gives every rank the *whole* sequence for H/U heads; the causal
   attention runs on those heads (cache write or cache read, RoPE over the whole sequence), so each rank's
   K/V cache holds its H/U heads of every cached token; the output goes back by the inverse all-to-all
   before ``to_out``. Cross-attention to the (replicated) text needs no communication.

A forward's token count must divide by U (no padding: padded tokens would enter the causal mask as real
ones): ``width``, ``height`` and the frames per chunk decide it, and a request that does not fit is refused
naming them. TP, ring, K/V-gather and CFG-parallel are refused for this family (``validate_layout``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan
from .sequence import shard_sequence
from .ulysses import gather_heads, scatter_heads


class FarCall:
    """``kv_cache_flag`` of one forward, as an object the compiled blocks only pass along (a dict of ints
    would be read by dynamo and guarded on, compiling new block graphs as the counts change from chunk to
    chunk). ``ends``: the cache forward's chunk boundaries (see :func:`far_attention`)."""

    def __init__(self, values: dict[str, Any], ends: tuple[int, ...] = ()) -> None:
        self.values, self.ends = dict(values), ends

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


class FarLayerCache:
    """One layer's K/V cache, ``kv`` (2, rows, heads, positions, head_dim) (see :func:`far_attention`);
    a holder rather than the tensor, so that the compiled blocks do not guard on its length (a session
    without a known length gets a longer one as it grows)."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv


class FarRope:
    """The rotary table of one forward (diffusers' ``{"query", "key"}`` dict), opaque to the compiled
    blocks for the same reason: its key length grows with every chunk, and in the cache forward query and
    key are one tensor (an aliasing guard)."""

    def __init__(self, freqs: dict[str, torch.Tensor]) -> None:
        self.freqs = dict(freqs)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.freqs[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.freqs[key] = value


@torch.compiler.disable
def far_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    rotary_emb: FarRope,
    kv_cache: FarLayerCache,
    kv_cache_flag: FarCall,
) -> torch.Tensor:
    """Causal FAR attention of (B, S, H, D) q/k/v (the whole sequence; under Ulysses H/U heads); returns
    (B, S, H, D).

    Run eagerly, outside the compiled blocks: what changes from chunk to chunk (cached lengths, the chunk
    spans) would otherwise be guards that compile new block graphs for every chunk index (and, past the
    recompile limit, run the blocks and flex attention's unfused fallback eagerly). Here every length is an
    ordinary int and the kernels (SDPA: flash / cuDNN) take any shape.

    ``kv_cache.kv`` (2, B, H, capacity, D) holds the cached keys already rotated (rotary embedding is per
    position, and a chunk's cached positions are the ones the cache forward rotated), then room for the chunk
    and for the zero keys diffusers' flex call pads the sequence with (to a multiple of 128, unmasked: they
    are part of its softmax, so they are part of ours).
    """
    from diffusers.models.transformers.transformer_anyflow_far import apply_rotary_emb

    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, H, S, D)
    cache = kv_cache.kv
    seq = q.shape[2]
    q = apply_rotary_emb(q, rotary_emb["query"][:, :, -seq:])
    k = apply_rotary_emb(k, rotary_emb["key"][:, :, -seq:])
    if kv_cache_flag["is_cache_step"]:
        # Its tokens are ordered by chunk (the compressed chunks, then the full ones) and a query of chunk j
        # attends to every token of chunks <= j: a prefix of the sequence. That is diffusers' "cache" block
        # mask exactly (its padding is masked, so it changes no row), one SDPA per chunk.
        ends = kv_cache_flag.ends
        assert ends and ends[-1] == seq, (ends, seq)
        cache[0, :, :, :seq] = k
        cache[1, :, :, :seq] = v
        out = torch.empty_like(q)
        start = 0
        for end in ends:
            out[:, :, start:end] = F.scaled_dot_product_attention(
                q[:, :, start:end], k[:, :, :end], v[:, :, :end]
            )
            start = end
        return out.transpose(1, 2)
    cached = kv_cache_flag["num_cached_compressed_tokens"] + kv_cache_flag["num_cached_full_tokens"]
    pad = -seq % 128
    end = cached + seq + pad
    cache[0, :, :, cached : cached + seq] = k
    cache[1, :, :, cached : cached + seq] = v
    if pad:
        cache[:, :, :, cached + seq : end] = 0
    out = F.scaled_dot_product_attention(q, cache[0, :, :, :end], cache[1, :, :, :end])
    return out.transpose(1, 2)


class FarCausalAttnProcessor:
    """Self-attention of a FAR block (diffusers' ``AnyFlowCausalAttnProcessor`` arithmetic) on one rank or
    under Ulysses: projections and norms over all heads (compiled with the block), then under Ulysses one
    all-to-all gives this rank the whole sequence for H/U heads; :func:`far_attention` runs eagerly; the
    output goes back by the inverse all-to-all before ``to_out``."""

    def __init__(self, group=None, world: int = 1) -> None:
        self.group, self.world = group, world

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: Any = None,  # unused: the cache forward's spans travel in ``kv_cache_flag``
        rotary_emb: FarRope | None = None,
        kv_cache: FarLayerCache | None = None,
        kv_cache_flag: FarCall | None = None,
    ) -> torch.Tensor:
        if kv_cache is None:
            raise NotImplementedError("AnyFlow-FAR here runs the K/V-cache paths only (inference)")
        dtype = hidden_states.dtype
        query = attn.norm_q(attn.to_q(hidden_states)).to(dtype).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).to(dtype).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))  # (B, S_local, H, D)
        if self.world > 1:
            query, key, value = scatter_heads(torch.stack([query, key, value]), self.group)  # (B, S, H/U, D)
        out = far_attention(
            query,
            key,
            value,
            rotary_emb=rotary_emb,
            kv_cache=kv_cache,
            kv_cache_flag=kv_cache_flag,
        )
        if self.world > 1:
            out, _ = gather_heads(out.contiguous(), self.group)
        out = attn.to_out[0](out.flatten(2).to(dtype))
        return attn.to_out[1](out)


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


def _processor(mesh: ParallelMesh, state: ForwardState) -> FarCausalAttnProcessor:
    state.extra["ulysses"] = mesh.ulysses_size
    return FarCausalAttnProcessor(mesh.get_group("ulysses"), mesh.ulysses_size)


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
