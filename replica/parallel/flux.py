"""FLUX.1's parallel plan (`FLUX_PLAN`): Ulysses / ring / K/V-gather / TP on a diffusers
FluxTransformer2DModel, applied in place by `parallelize` (``plan.py``).

What the plan does, in order:

1. validate the layout against the model's heads;
2. TP: swap q/k/v, ff-in, proj_mlp for column-parallel and out / ff-out / proj_out for row-parallel
   linears (`FLUX_TP_PLAN`);
3. swap every FluxAttention processor for `FluxParallelAttnProcessor`;
4. pre-forward hook on the model: pad + split `hidden_states` and `img_ids` along the image sequence
   (the model then builds rotary embeddings for [text; local image] itself, consistent with the shard);
   text stays replicated;
5. forward hook on the final `proj_out`: all-gather the image sequence and cut the padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from diffusers.models.embeddings import apply_rotary_emb

from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan, parallelize
from .sp_attention import sequence_parallel_attention
from .tp import RowParallelLinear, fused_row_parallel

FLUX_TP_PLAN: dict[str, str] = {
    # double-stream blocks: image and text streams, each column → row
    "transformer_blocks.*.attn.to_[qkv]": "column",
    "transformer_blocks.*.attn.add_[qkv]_proj": "column",
    "transformer_blocks.*.attn.to_out.0": "row",
    "transformer_blocks.*.attn.to_add_out": "row",
    "transformer_blocks.*.ff.net.0.proj": "column",
    "transformer_blocks.*.ff.net.2": "row",
    "transformer_blocks.*.ff_context.net.0.proj": "column",
    "transformer_blocks.*.ff_context.net.2": "row",
    # single-stream blocks: attention and MLP side by side, one row-parallel proj_out (see below)
    "single_transformer_blocks.*.attn.to_[qkv]": "column",
    "single_transformer_blocks.*.proj_mlp": "column",
}


class FluxParallelAttnProcessor:
    """Joint text+image attention with the image sequence sharded and the text replicated.

    Double blocks get (image, text) separately; single blocks get [text; image] concatenated and learn
    the text length from the forward state. Heads are read as `-1` so TP's local head count just works.
    """

    def __init__(self, mesh: ParallelMesh, state: ForwardState) -> None:
        self.mesh = mesh
        self.state = state

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise NotImplementedError("FluxParallelAttnProcessor does not take an attention_mask")

        def split_heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, attn.head_dim))

        q = attn.norm_q(split_heads(attn.to_q(hidden_states)))
        k = attn.norm_k(split_heads(attn.to_k(hidden_states)))
        v = split_heads(attn.to_v(hidden_states))
        if encoder_hidden_states is not None:  # double block: text has its own projections
            tq = attn.norm_added_q(split_heads(attn.add_q_proj(encoder_hidden_states)))
            tk = attn.norm_added_k(split_heads(attn.add_k_proj(encoder_hidden_states)))
            tv = split_heads(attn.add_v_proj(encoder_hidden_states))
            num_text = tq.shape[1]
            q, k, v = torch.cat([tq, q], 1), torch.cat([tk, k], 1), torch.cat([tv, v], 1)
        else:  # single block: [text; image] already
            num_text = self.state.num_text
        if image_rotary_emb is not None:  # built for [text; local image] by the model
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)

        img, text = sequence_parallel_attention(
            q[:, num_text:],
            k[:, num_text:],
            v[:, num_text:],
            mesh=self.mesh,
            layout=self.state.require_layout(),
            text=(q[:, :num_text], k[:, :num_text], v[:, :num_text]),
        )
        assert text is not None
        img = img.flatten(2).to(q.dtype)
        text = text.flatten(2).to(q.dtype)
        if encoder_hidden_states is None:
            return torch.cat([text, img], dim=1)
        out, add_out = attn.to_out[0], attn.to_add_out
        if isinstance(out, RowParallelLinear) and isinstance(add_out, RowParallelLinear):
            img, text = fused_row_parallel([out, add_out], [img, text])  # one all-reduce for both streams
        else:
            img, text = out(img), add_out(text)
        return attn.to_out[1](img), text


def _flux_tp_plan(transformer: nn.Module) -> dict[str, Any]:
    plan: dict[str, Any] = dict(FLUX_TP_PLAN)
    blocks = getattr(transformer, "single_transformer_blocks", [])
    if len(blocks):
        # proj_out reads cat(attention (dim), mlp (mlp_hidden_dim)); both halves are column-sharded, so
        # each rank holds a slice of each half: two packed blocks on the input dim.
        block = blocks[0]
        dim = block.proj_out.out_features
        plan["single_transformer_blocks.*.proj_out"] = ("row", [dim, block.mlp_hidden_dim])
    return plan


def _flux_on_forward(model: nn.Module, bound: dict[str, Any], state: ForwardState) -> None:
    if bound.get("controlnet_block_samples") is not None or bound.get("controlnet_single_block_samples"):
        raise NotImplementedError("ControlNet residuals are not sharded yet")
    if bound["img_ids"].ndim == 3:  # deprecated batched ids: diffusers takes the first
        bound["img_ids"] = bound["img_ids"][0]
    state.num_text = bound["encoder_hidden_states"].shape[1]


FLUX_PLAN = ParallelPlan(
    family="flux",
    tp=_flux_tp_plan,
    attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    processor=FluxParallelAttnProcessor,
    tokens=lambda model, bound: bound["hidden_states"].shape[1],
    # The model builds rotary embeddings for [text; local image] itself from the split ids.
    split_inputs={"hidden_states": 1, "img_ids": 0},
    gather={"proj_out": 1},
    on_forward=_flux_on_forward,
)


def parallelize_flux(transformer: nn.Module, *, mesh: ParallelMesh) -> nn.Module:
    """Shard a FluxTransformer2DModel over `mesh` in place; every rank then calls it with full inputs."""
    return parallelize(transformer, FLUX_PLAN, mesh=mesh)
