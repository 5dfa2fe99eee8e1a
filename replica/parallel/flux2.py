"""FLUX.2's parallel plan (`FLUX2_PLAN`): Ulysses / ring / K/V-gather / TP on a diffusers
Flux2Transformer2DModel (FLUX.2 dev and Klein), applied in place by `parallelize` (``plan.py``).

- TP: the double blocks' q/k/v and add_q/k/v_proj column-parallel, to_out.0 / to_add_out row-parallel
  (one all-reduce for both streams); their SwiGLU feed-forwards' ``linear_in`` column-parallel as two
  packed halves (gate, value) and ``linear_out`` row-parallel. A single block has one fused input linear
  ``to_qkv_mlp_proj`` = [q; k; v; gate; value], sharded as five packed column blocks so each rank holds
  its heads' q/k/v and its slice of the MLP, and one output linear ``to_out`` over [attention; mlp],
  row-parallel with two packed input blocks. Modulation (computed once per forward, shared by all blocks)
  and the QK norms (per head) stay replicated.
- Sequence: ``hidden_states`` and ``img_ids`` are split at the model's entry; the model then builds its
  rotary embedding for [text; local tokens] itself. Reference-image tokens are part of ``hidden_states``
  (after the image tokens) and are sharded with them: every block computes them like image tokens, so
  splitting them divides that work too. Text stays replicated; single blocks see [text; local tokens]
  and learn the text length from the forward state. ``proj_out`` is gathered (and unpadded).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor

from ditserve.kernels.qk_norm_rope.op import heads_qk_norm_rope

from .flux import FluxParallelAttnProcessor
from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan, joint_attention_tp, parallelize
from .processor import ParallelAttnProcessor, rotate_qk, split_text, stock_attention, text_image_attention

FLUX2_TP_PLAN: dict[str, Any] = {
    **joint_attention_tp("transformer_blocks.*.attn"),
    "transformer_blocks.*.ff.linear_out": "row",
    "transformer_blocks.*.ff_context.linear_out": "row",
}


def _flux2_tp_plan(transformer: nn.Module) -> dict[str, Any]:
    plan = dict(FLUX2_TP_PLAN)
    if len(transformer.transformer_blocks):
        ff = transformer.transformer_blocks[0].ff.linear_out.in_features
        for stream in ("ff", "ff_context"):
            plan[f"transformer_blocks.*.{stream}.linear_in"] = ("column", [ff, ff])  # SwiGLU gate, value
    if len(transformer.single_transformer_blocks):
        attn = transformer.single_transformer_blocks[0].attn
        inner, mlp = attn.inner_dim, attn.mlp_hidden_dim
        plan["single_transformer_blocks.*.attn.to_qkv_mlp_proj"] = ("column", [inner] * 3 + [mlp] * 2)
        plan["single_transformer_blocks.*.attn.to_out"] = ("row", [inner, mlp])
    return plan


class Flux2ParallelSingleAttnProcessor(ParallelAttnProcessor):
    """A single block's fused attention + MLP with the image sequence sharded and the text replicated.

    The fused projection's local output is [q; k; v; gate; value] of this rank's share (TP) or all of it;
    the q/k/v part is the same fraction of it either way."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError("Flux2ParallelSingleAttnProcessor does not take an attention_mask")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = projected.split([local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))
        q, k = rotate_qk(attn.norm_q(q), attn.norm_k(k), image_rotary_emb)  # for [text; local tokens]
        image, text = split_text((q, k, v), self.state.num_text)
        img, text_out = text_image_attention(image, text, mesh=self.mesh, layout=self.state.require_layout())
        out = torch.cat([text_out, img], dim=1)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class Flux2ParallelAttnProcessor:
    """Set on every FLUX.2 attention module; each call goes to the processor of its block kind: double
    blocks (separate text and image projections: FLUX.1's processor fits them unchanged) or single blocks
    (fused attention + MLP)."""

    def __init__(self, mesh: ParallelMesh, state: ForwardState) -> None:
        self.double = FluxParallelAttnProcessor(mesh, state)
        self.single = Flux2ParallelSingleAttnProcessor(mesh, state)

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
        if hasattr(attn, "to_qkv_mlp_proj"):
            return self.single(attn, hidden_states, *args, **kwargs)
        return self.double(attn, hidden_states, *args, **kwargs)


def _flux2_on_forward(model: nn.Module, bound: dict[str, Any], state: ForwardState) -> None:
    if bound.get("kv_cache_mode") is not None or bound.get("kv_cache") is not None:
        raise NotImplementedError("FLUX.2's reference K/V cache (Flux2KleinKVPipeline) is not sharded")
    for name in ("img_ids", "txt_ids"):
        if bound[name].ndim == 3:  # batched ids: the model takes the first
            bound[name] = bound[name][0]
    state.num_text = bound["encoder_hidden_states"].shape[1]


class Flux2FusedAttnProcessor(Flux2AttnProcessor):
    """One rank, ``--fused-epilogues``: diffusers' FLUX.2 double-stream processor with each stream's q/k
    per-head RMSNorm and rotary as one pass of ``kernels.qk_norm_rope`` (the text stream by the table's
    first rows, the image stream by the rest), instead of the norms, the concatenation and a rotary pass
    that inductor runs with gathered loads."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if (
            image_rotary_emb is None
            or getattr(attn, "fused_projections", False)
            or (encoder_hidden_states is None) != (attn.added_kv_proj_dim is None)
        ):
            return super().__call__(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, attn.head_dim))

        cos, sin = image_rotary_emb
        num_text = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        text_rope, image_rope = (cos[:num_text], sin[:num_text]), (cos[num_text:], sin[num_text:])
        q = heads_qk_norm_rope(heads(attn.to_q(hidden_states)), attn.norm_q, image_rope)
        k = heads_qk_norm_rope(heads(attn.to_k(hidden_states)), attn.norm_k, image_rope)
        v = heads(attn.to_v(hidden_states))
        if num_text:
            tq = heads_qk_norm_rope(
                heads(attn.add_q_proj(encoder_hidden_states)), attn.norm_added_q, text_rope
            )
            tk = heads_qk_norm_rope(
                heads(attn.add_k_proj(encoder_hidden_states)), attn.norm_added_k, text_rope
            )
            tv = heads(attn.add_v_proj(encoder_hidden_states))
            q, k, v = torch.cat([tq, q], dim=1), torch.cat([tk, k], dim=1), torch.cat([tv, v], dim=1)
        out = stock_attention(self, q, k, v, attention_mask)
        if encoder_hidden_states is not None:
            text, out = out.split_with_sizes([num_text, out.shape[1] - num_text], dim=1)
            text = attn.to_add_out(text)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, text) if encoder_hidden_states is not None else out


class Flux2FusedParallelSelfAttnProcessor(Flux2ParallelSelfAttnProcessor):
    """One rank, ``--fused-epilogues``: diffusers' FLUX.2 single-stream processor with q/k's per-head RMSNorm
    and rotary as one pass of ``kernels.qk_norm_rope`` each, read in place from the fused input projection's
    output."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if image_rotary_emb is None:
            return super().__call__(attn, hidden_states, attention_mask, image_rotary_emb)
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))
        q = heads_qk_norm_rope(q, attn.norm_q, image_rotary_emb)
        k = heads_qk_norm_rope(k, attn.norm_k, image_rotary_emb)
        out = stock_attention(self, q, k, v, attention_mask)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


FLUX2_PLAN = ParallelPlan(
    family="flux2",
    tp=_flux2_tp_plan,
    attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    processor=Flux2ParallelAttnProcessor,
    tokens=lambda model, bound: bound["hidden_states"].shape[1],
    # Image and reference tokens together; the model builds rotary embeddings from the split ids.
    split_inputs={"hidden_states": 1, "img_ids": 0},
    gather={"proj_out": 1},
    on_forward=_flux2_on_forward,
    one_rank_processors=(Flux2FusedAttnProcessor, Flux2FusedParallelSelfAttnProcessor),
)


def parallelize_flux2(transformer: nn.Module, *, mesh: ParallelMesh) -> nn.Module:
    """Shard a Flux2Transformer2DModel over `mesh` in place; every rank then calls it with full inputs."""
    return parallelize(transformer, FLUX2_PLAN, mesh=mesh)
