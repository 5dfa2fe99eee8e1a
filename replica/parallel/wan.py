"""Wan's parallel plan (`WAN_PLAN`): Ulysses / ring / K/V-gather / TP on a diffusers
WanTransformer3DModel, applied in place by `parallelize` (``plan.py``).

Order of steps:

1. validate the layout against the model's heads;
2. TP: column-parallel q/k/v (+ I2V add_k/add_v) and ffn-in, row-parallel to_out and ffn-out
   (`WAN_TP_PLAN`); Wan normalises q and k over *all* heads, so those RMSNorms become ShardedRMSNorm
   (one small all-reduce of squared sums for q and k together);
3. swap every WanAttention processor for `WanParallelAttnProcessor`: self-attention over the sharded
   video sequence, cross-attention to the (replicated) text stays local with no communication;
4. hooks that split the sequence where it first exists: the model's pre-forward hook plans the layout
   (and splits a per-token Wan 2.2 timestep), the `rope` output and `blocks.0`'s hidden_states are
   padded + split; the final `proj_out` output is all-gathered and unpadded before the unpatchify.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from ditserve.kernels.qk_norm_rope.op import qk_norm_rope
from ditserve.kernels.qk_norm_rope.reference import rotate_pairs

from .mesh import ParallelMesh
from .plan import ParallelPlan, feed_forward_tp, parallelize
from .processor import ParallelAttnProcessor, local_attention, plain_rms_norms, stock_attention
from .sp_attention import sequence_parallel_attention
from .tp import ColumnParallelLinear, ShardedRMSNorm, sharded_rms_norm_many

WAN_TP_PLAN: dict[str, str] = {
    "blocks.*.attn1.to_[qkv]": "column",
    "blocks.*.attn1.to_out.0": "row",
    "blocks.*.attn2.to_[qkv]": "column",
    "blocks.*.attn2.add_[kv]_proj": "column",
    "blocks.*.attn2.to_out.0": "row",
    **feed_forward_tp("blocks.*.ffn"),
}

# Wan's I2V processor treats everything before the last 512 context tokens as image context.
_WAN_TEXT_CONTEXT = 512


class WanParallelAttnProcessor(ParallelAttnProcessor):
    """Wan self-attention over the sharded sequence; cross-attention local."""

    @staticmethod
    def _norm_pair(
        norm_q: nn.Module, norm_k: nn.Module, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(norm_q, ShardedRMSNorm) and isinstance(norm_k, ShardedRMSNorm):
            q, k = sharded_rms_norm_many([norm_q, norm_k], [q, k])
            return q, k
        return norm_q(q), norm_k(k)

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError("WanParallelAttnProcessor does not take an attention_mask")
        image_context = None
        if attn.add_k_proj is not None and encoder_hidden_states is not None:
            num_image = encoder_hidden_states.shape[1] - _WAN_TEXT_CONTEXT
            image_context = encoder_hidden_states[:, :num_image]
            encoder_hidden_states = encoder_hidden_states[:, num_image:]
        head_dim = attn.inner_dim // attn.heads
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states

        if rotary_emb is not None and encoder_hidden_states is None and plain_rms_norms(attn):
            # one kernel pass for each of q and k (kernels/qk_norm_rope; the same arithmetic off CUDA)
            q = qk_norm_rope(attn.to_q(hidden_states), attn.norm_q, *rotary_emb)
            k = qk_norm_rope(attn.to_k(hidden_states), attn.norm_k, *rotary_emb)
            v = attn.to_v(hidden_states).unflatten(2, (-1, head_dim))
        else:
            q, k = self._norm_pair(attn.norm_q, attn.norm_k, attn.to_q(hidden_states), attn.to_k(context))
            v = attn.to_v(context)
            q, k, v = (t.unflatten(2, (-1, head_dim)) for t in (q, k, v))
            if rotary_emb is not None:
                q = rotate_pairs(q, *rotary_emb)
                k = rotate_pairs(k, *rotary_emb)

        if encoder_hidden_states is None:  # self-attention over the sharded video sequence
            out, _ = sequence_parallel_attention(q, k, v, mesh=self.mesh, layout=self.state.require_layout())
        else:  # cross-attention: the context is replicated, nothing to communicate
            out = local_attention(q, k, v)
        out = out.flatten(2).type_as(q)

        if image_context is not None:  # Wan 2.1 I2V: a second, local cross-attention to image tokens
            k_img = attn.norm_added_k(attn.add_k_proj(image_context)).unflatten(2, (-1, head_dim))
            v_img = attn.add_v_proj(image_context).unflatten(2, (-1, head_dim))
            out = out + local_attention(q, k_img, v_img).flatten(2).type_as(q)

        return attn.to_out[1](attn.to_out[0](out))


def _shard_norms(transformer: nn.Module) -> None:
    """Replace Wan's across-heads q/k RMSNorms by TP-aware ones cut like the q/k projections."""
    for block in transformer.blocks:
        for attn in (block.attn1, block.attn2):
            to_q, to_k = attn.to_q, attn.to_k
            assert isinstance(to_q, ColumnParallelLinear) and isinstance(to_k, ColumnParallelLinear)
            attn.norm_q = ShardedRMSNorm(attn.norm_q, group=to_q.tp_group, ranges=to_q.tp_slices)
            attn.norm_k = ShardedRMSNorm(attn.norm_k, group=to_k.tp_group, ranges=to_k.tp_slices)
            if attn.add_k_proj is not None:
                add_k = attn.add_k_proj
                assert isinstance(add_k, ColumnParallelLinear)
                attn.norm_added_k = ShardedRMSNorm(
                    attn.norm_added_k, group=add_k.tp_group, ranges=add_k.tp_slices
                )


def _wan_tokens(model: nn.Module, bound: dict) -> int:
    _, _, frames, height, width = bound["hidden_states"].shape
    patch = tuple(model.config.patch_size)
    return math.prod(n // p for n, p in zip((frames, height, width), patch, strict=True))


class WanFusedAttnProcessor(WanAttnProcessor):
    """One rank, ``--fused-epilogues``: diffusers' Wan processor with self-attention's q/k RMSNorm and rotary
    as one pass of ``kernels.qk_norm_rope`` each. Compiled, diffusers' strided-store rotary after the norm runs
    as an inductor kernel that reads each pair back with gathered loads, at about a third of the bytes' time."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if (
            encoder_hidden_states is not None
            or rotary_emb is None
            or attn.fused_projections
            or attn.add_k_proj is not None
            or not plain_rms_norms(attn)
        ):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        q = qk_norm_rope(attn.to_q(hidden_states), attn.norm_q, *rotary_emb)
        k = qk_norm_rope(attn.to_k(hidden_states), attn.norm_k, *rotary_emb)
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        out = stock_attention(self, q, k, v, attention_mask)
        return attn.to_out[1](attn.to_out[0](out))


WAN_PLAN = ParallelPlan(
    family="wan",
    tp=WAN_TP_PLAN,
    after_tp=_shard_norms,
    attention=("blocks.*.attn1", "blocks.*.attn2"),
    processor=WanParallelAttnProcessor,
    tokens=_wan_tokens,
    # Wan 2.2 TI2V: one timestep per token (2-D), sharded like the tokens; a per-request one stays whole.
    split_inputs={"timestep": 1},
    split_outputs={"rope": 1},  # built for the full sequence
    split_block_inputs={"blocks.0": 1},  # the sequence first exists after the patch embedding
    gather={"proj_out": 1},
    one_rank_processors=(WanFusedAttnProcessor,),
)


def parallelize_wan(transformer: nn.Module, *, mesh: ParallelMesh) -> nn.Module:
    """Shard a WanTransformer3DModel over `mesh` in place; every rank then calls it with full inputs."""
    return parallelize(transformer, WAN_PLAN, mesh=mesh)
