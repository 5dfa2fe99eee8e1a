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

from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan, feed_forward_tp, joint_attention_tp, parallelize
from .processor import (
    ParallelAttnProcessor,
    image_qkv,
    joint_out,
    rotate_qk,
    split_text,
    text_image_attention,
    text_qkv,
)

FLUX_TP_PLAN: dict[str, str] = {
    # double-stream blocks: image and text streams, each column → row
    **joint_attention_tp("transformer_blocks.*.attn"),
    **feed_forward_tp("transformer_blocks.*.ff", "transformer_blocks.*.ff_context"),
    # single-stream blocks: attention and MLP side by side, one row-parallel proj_out (see below)
    "single_transformer_blocks.*.attn.to_[qkv]": "column",
    "single_transformer_blocks.*.proj_mlp": "column",
}


class FluxParallelAttnProcessor(ParallelAttnProcessor):
    """Joint text+image attention with the image sequence sharded and the text replicated.

    Double blocks get (image, text) separately; single blocks get [text; image] concatenated and learn
    the text length from the forward state.
    """

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
        q, k, v = image_qkv(attn, hidden_states)
        if encoder_hidden_states is not None:  # double block: text has its own projections
            tq, tk, tv = text_qkv(attn, encoder_hidden_states)
            num_text = tq.shape[1]
            q, k, v = torch.cat([tq, q], 1), torch.cat([tk, k], 1), torch.cat([tv, v], 1)
        else:  # single block: [text; image] already
            num_text = self.state.num_text
        q, k = rotate_qk(q, k, image_rotary_emb)  # built for [text; local image] by the model
        image, text = split_text((q, k, v), num_text)
        img, text_out = text_image_attention(image, text, mesh=self.mesh, layout=self.state.require_layout())
        if encoder_hidden_states is None:
            return torch.cat([text_out, img], dim=1)
        return joint_out(attn, img, text_out)


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
