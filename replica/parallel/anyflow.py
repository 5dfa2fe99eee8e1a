"""AnyFlow-FAR's self-attention (`FarCausalAttnProcessor`: one rank, Ulysses, ring, or both) and its parallel
plan (`ANYFLOW_PLAN`): each forward's tokens sharded over Ulysses × ring, the K/V cache sharded the same way.

A FAR forward is either one chunk's flow-map step (its tokens attend to the cached K/V of the past chunks,
to themselves and to the zero keys diffusers pads the chunk with) or the cache forward (every finished chunk,
the older ones through the compressed 4×4 patches, block-causal: a chunk's tokens attend to the chunks up to
their own), which writes the cache. The attention runs outside the compiled blocks (`far_attention`): the
lengths it slices change with every chunk.

With Ulysses degree U and ring degree R (sp = U·R shards, numbered as in ``mesh.py``):

1. the sequence is padded at its end to a multiple of sp and split where it first exists (``blocks.0``'s
   input), gathered and unpadded after ``proj_out``; the per-token modulation (``condition_embedder``'s
   ``temb`` and ``timestep_proj``) is split the same way. Padded tokens are a suffix of the sequence: they
   are never keys, and their outputs are cut off;
2. in each self-attention, q/k/v are computed for the local tokens (q/k RMS-normalised over all heads, per
   token), then one all-to-all gives the Ulysses group's contiguous *ring block* of the sequence for H/U
   heads; q and k are rotated at the block's global positions (keys are cached rotated);
3. the cache forward writes each rank's block of the cache sequence at the start of its buffer (without a
   ring: after the oldest chunks it keeps, ``FarCall.base``); a chunk step
   writes its block right after the rank's real cached keys, so every rank's keys are one prefix of its
   buffer (its cached block, then its chunk block). Memory per rank: H/U heads of about 1/R of the tokens;
4. with R = 1 one SDPA per call (diffusers' arithmetic, the zero pad keys written after the prefix); with
   R > 1 each rank's prefix travels around the ring (P2P, the next transfer overlapping this attention) and
   the partial results are merged by their log-sum-exp in fp32. The pad keys count once: each adds exp(0)
   to a query's softmax and nothing to its output, one partial of LSE log(pad). The cache forward's
   block-causal mask is a key prefix per chunk and block: chunk j's queries see block s's keys before the
   end of chunk j.

Ulysses 2 × ring 2 (ulysses pairs {0,1} {2,3}, ring pairs {0,2} {1,3}), a cache forward of 62 tokens::

    rank:                      0             1             2              3
    tokens (padded to 64):     0-15          16-31         32-47          48-61 + 2 padding
    ring block, after a2a:     0-31, h 0-1   0-31, h 2-3   32-63, h 0-1   32-63, h 2-3
    K/V cache rows written:    32            32            32 (30 real)   32 (30 real)

TP, K/V-gather and CFG-parallel are refused for this family (``validate_layout``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .attention import attention, merge_partial
from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan
from .ring import exchange
from .sequence import SequenceLayout, shard_sequence
from .ulysses import gather_heads, scatter_heads


class FarCall:
    """``kv_cache_flag`` of one forward, as an object the compiled blocks only pass along (a dict of ints
    would be read by dynamo and guarded on, compiling new block graphs as the counts change from chunk to
    chunk). ``ends``: the cache forward's chunk boundaries in the cache sequence; ``base``: the cache
    positions it keeps (one rank: the oldest compressed chunks, whose keys and values the previous cache
    forward wrote and no later chunk changes), its tokens being the ones after them (see
    :func:`far_attention`)."""

    def __init__(self, values: dict[str, Any], ends: tuple[int, ...] = (), base: int = 0) -> None:
        self.values, self.ends, self.base = dict(values), ends, base

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


class FarRing:
    """This rank's place on the ring: its process ``group``, its ``rank`` there (= the ring block it holds)
    of ``size``, and the Ulysses degree (a ring block is ``ulysses`` consecutive shards of the sequence)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, ulysses: int) -> None:
        self.group, self.rank, self.size, self.ulysses = group, rank, size, ulysses

    def blocks(self, num_tokens: int) -> list[int]:
        """Real tokens of each ring block of a sequence of ``num_tokens``, as the plan shards it."""
        shards = self.size * self.ulysses
        layout = SequenceLayout(num_tokens=num_tokens, num_shards=shards, shard_index=0, ulysses=self.ulysses)
        return layout.block_valid(self.size)


def _ring_blocks(block: torch.Tensor, ring: FarRing) -> Iterator[tuple[int, torch.Tensor]]:
    """(source ring rank, its block) for each ring step, this rank's own first. The next block is sent and
    received while the caller attends to the current one; blocks arrive in two buffers of their own that
    take turns (``block`` may be the cache itself: it is never written)."""
    send_to = dist.get_global_rank(ring.group, (ring.rank + 1) % ring.size)
    recv_from = dist.get_global_rank(ring.group, (ring.rank - 1) % ring.size)
    current, spare = block, []
    for step in range(ring.size):
        nxt, requests = None, []
        if step < ring.size - 1:
            nxt = spare.pop() if spare else torch.empty_like(current)
            requests = exchange(current, nxt, send_to=send_to, recv_from=recv_from, group=ring.group)
        yield (ring.rank - step) % ring.size, current
        for request in requests:
            request.wait()
        if current is not block:  # sent: free for the block after next
            spare.append(current)
        if nxt is not None:
            current = nxt


def _rotate(x: torch.Tensor, freqs: torch.Tensor, start: int, valid: int) -> torch.Tensor:
    """RoPE on the first ``valid`` rows of a (B, H, L, D) block whose first row is global position ``start``;
    the padding rows after them stay as they are."""
    from diffusers.models.transformers.transformer_anyflow_far import apply_rotary_emb

    rotated = apply_rotary_emb(x[:, :, :valid], freqs[:, :, start : start + valid])
    return rotated if valid == x.shape[2] else torch.cat([rotated, x[:, :, valid:]], dim=2)


@torch.compiler.disable
def far_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    rotary_emb: FarRope,
    kv_cache: FarLayerCache,
    kv_cache_flag: FarCall,
    ring: FarRing | None = None,
) -> torch.Tensor:
    """Causal FAR attention of this rank's (B, L, H, D) q/k/v (one rank: the whole sequence; sharded: its
    ring block, H/U heads under Ulysses); returns (B, L, H, D).

    Run eagerly, outside the compiled blocks: what changes from chunk to chunk (cached lengths, the chunk
    spans) would otherwise be guards that compile new block graphs for every chunk index (and, past the
    recompile limit, run the blocks and flex attention's unfused fallback eagerly). Here every length is an
    ordinary int and the kernels (SDPA: flash / cuDNN) take any shape.

    ``kv_cache.kv`` (2, B, H, capacity, D) holds this rank's cached keys already rotated (rotary embedding
    is per position, and a chunk's cached positions are the ones the cache forward rotated), then room for
    the chunk's block and, on one ring block, for the zero keys diffusers' flex call pads the chunk with (to
    a multiple of 128, unmasked: they are part of its softmax, so they are part of ours).
    """
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, H, L, D)
    num_tokens = rotary_emb["query"].shape[2]  # the forward's real tokens, on all ranks together
    length = q.shape[2]
    start = 0 if ring is None else ring.rank * length  # global position of this block's first token
    valid = max(0, min(length, num_tokens - start))
    q = _rotate(q, rotary_emb["query"], start, valid)
    k = _rotate(k, rotary_emb["key"][:, :, -num_tokens:], start, valid)
    if kv_cache_flag["is_cache_step"]:
        out = _cache_attention(
            q,
            k,
            v,
            kv_cache=kv_cache,
            ends=kv_cache_flag.ends,
            base=kv_cache_flag.base,
            ring=ring,
            start=start,
        )
    else:
        cached = kv_cache_flag["num_cached_compressed_tokens"] + kv_cache_flag["num_cached_full_tokens"]
        out = _chunk_attention(q, k, v, kv_cache=kv_cache, cached=cached, num_tokens=num_tokens, ring=ring)
    return out.transpose(1, 2)


def _cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_cache: FarLayerCache,
    ends: tuple[int, ...],
    base: int,
    ring: FarRing | None,
    start: int,
) -> torch.Tensor:
    """The cache forward: write this block's K/V, attend block-causally. The cache sequence is ordered by
    chunk (the compressed chunks, then the full ones; ``ends``: each chunk's end in it) and a query of chunk
    j attends to every token of chunks <= j: a prefix of the sequence. That is diffusers' "cache" block mask
    exactly (its padding is masked, so it changes no row). One rank: the forward's tokens are the cache
    positions from ``base`` on (before it: kept from the previous cache forward, keys only here)."""
    assert ends, ends
    cache, length = kv_cache.kv, k.shape[2]
    cache[0, :, :, base : base + length] = k
    cache[1, :, :, base : base + length] = v
    out = torch.zeros_like(q)  # padding rows (after the last chunk) stay zero
    if ring is None:  # one SDPA per chunk over its prefix
        begin = base
        for end in ends:
            keys, values = (k, v) if base == 0 else (cache[0, :, :, :end], cache[1, :, :, :end])
            out[:, :, begin - base : end - base] = F.scaled_dot_product_attention(
                q[:, :, begin - base : end - base], keys[:, :, :end], values[:, :, :end]
            )
            begin = end
        return out
    assert base == 0, "a ring's cache forward rewrites every chunk"
    # This block's rows of each chunk: (first row, past-the-last row, the chunk's global end).
    spans, begin = [], 0
    for end in ends:
        first, last = max(begin, start) - start, min(end, start + length) - start
        if first < last:
            spans.append((first, last, end))
        begin = end
    sizes = ring.blocks(ends[-1])
    total = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    for source, block in _ring_blocks(torch.stack([k, v]), ring):
        base = source * length
        # Consecutive chunks that see the same prefix of this block share one call.
        calls: list[list[int]] = []
        for first, last, end in spans:
            keys = max(0, min(sizes[source], end - base))
            if calls and calls[-1][2] == keys:
                calls[-1][1] = last
            else:
                calls.append([first, last, keys])
        for first, last, keys in calls:
            if keys == 0:
                continue
            part, part_lse = attention(
                q[:, :, first:last], block[0, :, :, :keys], block[1, :, :, :keys], need_lse=True
            )
            assert part_lse is not None
            total[:, :, first:last], lse[:, :, first:last] = merge_partial(
                total[:, :, first:last], lse[:, :, first:last], part, part_lse
            )
    return total.to(q.dtype)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    kv_cache: FarLayerCache,
    cached: int,
    num_tokens: int,
    ring: FarRing | None,
) -> torch.Tensor:
    """A chunk step: write this block's K/V after the rank's cached keys, attend to [cache | chunk | pad
    keys] of all ranks. ``cached``: the cached tokens of all ranks; ``num_tokens``: the chunk's."""
    cache, length = kv_cache.kv, k.shape[2]
    pad = -num_tokens % 128  # diffusers pads the chunk's tokens to a multiple of 128
    if ring is None:
        valid = min(length, num_tokens)
        cache[0, :, :, cached : cached + length] = k
        cache[1, :, :, cached : cached + length] = v
        end = cached + valid + pad
        if pad:
            cache[:, :, :, cached + valid : end] = 0
        return F.scaled_dot_product_attention(q, cache[0, :, :, :end], cache[1, :, :, :end])
    # Every rank's keys are one prefix of its buffer: its cached block's real keys, then its chunk block's.
    cached_blocks, chunk_blocks = ring.blocks(cached), ring.blocks(num_tokens)
    mine = cached_blocks[ring.rank]
    cache[0, :, :, mine : mine + length] = k
    cache[1, :, :, mine : mine + length] = v
    sizes = [a + b for a, b in zip(cached_blocks, chunk_blocks, strict=True)]
    total: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for source, block in _ring_blocks(cache[:, :, :, : max(sizes)].contiguous(), ring):
        keys = sizes[source]
        if keys:
            part, part_lse = attention(q, block[0, :, :, :keys], block[1, :, :, :keys], need_lse=True)
            assert part_lse is not None
            total, lse = merge_partial(total, lse, part, part_lse)
    assert total is not None and lse is not None
    if pad:  # pad zero keys: score 0 each (weight exp(0)), value 0; once for every query
        total, lse = merge_partial(total, lse, torch.zeros_like(total), torch.full_like(lse, math.log(pad)))
    return total.to(q.dtype)


class FarCausalAttnProcessor:
    """Self-attention of a FAR block (diffusers' ``AnyFlowCausalAttnProcessor`` arithmetic) on one rank or
    sharded: projections and norms over all heads (compiled with the block), then under Ulysses one
    all-to-all gives this rank its ring block for H/U heads; :func:`far_attention` runs eagerly (over the
    ring when there is one); the output goes back by the inverse all-to-all before ``to_out``."""

    def __init__(self, ulysses: dist.ProcessGroup | None = None, ring: FarRing | None = None) -> None:
        self.ulysses, self.ring = ulysses, ring

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
        if self.ulysses is not None:  # (B, L, H/U, D): the ulysses group's ring block
            query, key, value = scatter_heads(torch.stack([query, key, value]), self.ulysses)
        out = far_attention(
            query,
            key,
            value,
            rotary_emb=rotary_emb,
            kv_cache=kv_cache,
            kv_cache_flag=kv_cache_flag,
            ring=self.ring,
        )
        if self.ulysses is not None:
            out, _ = gather_heads(out.contiguous(), self.ulysses)
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
        raise NotImplementedError("sharded AnyFlow-FAR runs the K/V-cache paths only (inference)")
    if "hook" not in state.extra:  # once per model: the per-token modulation is split like the tokens
        state.extra["hook"] = model.condition_embedder.register_forward_hook(
            lambda module, args, output: (
                shard_sequence(output[0], state.require_layout(), dim=1),
                shard_sequence(output[1], state.require_layout(), dim=1),
                *output[2:],
            )
        )


def _processor(mesh: ParallelMesh, state: ForwardState) -> FarCausalAttnProcessor:
    group = mesh.get_group("ring")
    ring = None if group is None else FarRing(group, mesh.ring_rank, mesh.ring_size, mesh.ulysses_size)
    return FarCausalAttnProcessor(mesh.get_group("ulysses"), ring)


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
