"""Stable Diffusion 3 / 3.5's parallel plan (`SD3_PLAN`): Ulysses / ring / K/V-gather / TP on a diffusers
SD3Transformer2DModel, applied in place by `parallelize` (``plan.py``).

What the plan does, in order:

1. validate the layout against the model's heads;
2. TP: column-parallel q/k/v of both streams (image ``to_*``, text ``add_*_proj``), the image-only
   ``attn2`` of SD3.5 medium's dual-attention blocks and the MLPs' up-projections; row-parallel outputs
   (``to_out.0``, ``to_add_out``, the MLPs' down-projections). The last block is ``context_pre_only``: it
   has no text output projection nor text MLP, so those patterns simply match nothing there. q/k RMSNorms
   are per head (``qk_norm="rms_norm"``), so TP leaves them whole;
3. swap every attention processor for `SD3ParallelAttnProcessor`;
4. split the image tokens after ``pos_embed`` (patches + learned positions); the text stays replicated;
5. all-gather the image tokens after the final ``proj_out`` and cut the padding (before the unpatchify).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

from ditserve.kernels.joint_attention.op import joint_attention

from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan, feed_forward_tp, joint_attention_tp, parallelize
from .processor import ParallelAttnProcessor, image_qkv, joint_out, text_image_attention, text_qkv
from .sp_attention import sequence_parallel_attention

SD3_TP_PLAN: dict[str, str] = {
    **joint_attention_tp("transformer_blocks.*.attn"),
    "transformer_blocks.*.attn2.to_[qkv]": "column",
    "transformer_blocks.*.attn2.to_out.0": "row",
    **feed_forward_tp("transformer_blocks.*.ff", "transformer_blocks.*.ff_context"),
}


class SD3ParallelAttnProcessor(ParallelAttnProcessor):
    """Joint attention (``attn``: image sharded, text replicated and attended once) and SD3.5's image-only
    self-attention (``attn2``) over the sharded sequence."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None or kwargs:
            raise NotImplementedError(
                "SD3ParallelAttnProcessor takes no attention_mask nor IP-adapter inputs"
            )
        q, k, v = image_qkv(attn, hidden_states)
        layout = self.state.require_layout()
        if encoder_hidden_states is None:  # attn2: image-only self-attention
            img, _ = sequence_parallel_attention(q, k, v, mesh=self.mesh, layout=layout)
            return attn.to_out[1](attn.to_out[0](img.flatten(2).to(q.dtype)))

        text = text_qkv(attn, encoder_hidden_states)
        img, text_out = text_image_attention((q, k, v), text, mesh=self.mesh, layout=layout)
        if attn.context_pre_only:  # the last block: the text stream ends here (its output is unused)
            return attn.to_out[1](attn.to_out[0](img)), text_out
        return joint_out(attn, img, text_out)


def _plain_q_norms(attn: nn.Module, head_dim: int):
    """Both streams' q norms as (weight, eps) where each is diffusers' ``RMSNorm(head_dim)`` with a weight and
    no bias (SD3.5's ``qk_norm="rms_norm"``): what the joint kernel applies on load; else None."""
    norms = (attn.norm_q, attn.norm_added_q)
    if not all(
        type(n) is DiffusersRMSNorm and n.weight is not None and getattr(n, "bias", None) is None
        and tuple(n.weight.shape) == (head_dim,)
        for n in norms
    ):  # fmt: skip
        return None
    return tuple((n.weight, float(n.eps)) for n in norms)


class SD3FusedAttnProcessor(JointAttnProcessor2_0):
    """One rank, ``--fused-epilogues``: diffusers' SD3 joint processor with the attention of [image; text]
    done by ``kernels.joint_attention``, which reads each stream's q, k, v where the projections (and the
    k norms) left them, normalises the queries as it loads them (SD3.5's per-head RMSNorms; other norms run
    before it) and writes each stream's output where its output projection reads it: no
    concatenation of q, k and v, no transpose back and no copy of either half of the output. The image-only
    ``attn2`` (SD3.5 medium) and a call with a mask run diffusers' path."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is not None or args or kwargs:
            return super().__call__(
                attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs
            )
        head_dim = attn.inner_dim // attn.heads
        q_norms = _plain_q_norms(attn, head_dim)  # the kernel normalises q as it loads it
        raw = q_norms is not None
        image = tuple(t.flatten(2) for t in image_qkv(attn, hidden_states, norm_q=not raw))
        text = tuple(t.flatten(2) for t in text_qkv(attn, encoder_hidden_states, norm_q=not raw))
        img, text_out = joint_attention(image, text, head_dim, q_norms)  # type: ignore[arg-type]
        if attn.context_pre_only:  # the last block: diffusers hands the text half back unprojected
            return attn.to_out[1](attn.to_out[0](img)), text_out
        return joint_out(attn, img, text_out)


def _sd3_tokens(model: nn.Module, bound: dict) -> int:
    height, width = bound["hidden_states"].shape[-2:]
    patch = model.config.patch_size
    return (height // patch) * (width // patch)


def _sd3_on_forward(model: nn.Module, bound: dict, state: ForwardState) -> None:
    if bound.get("block_controlnet_hidden_states") is not None or bound.get("skip_layers") is not None:
        raise NotImplementedError("ControlNet residuals and skip-layer guidance are not sharded")
    state.num_text = bound["encoder_hidden_states"].shape[1]


SD3_PLAN = ParallelPlan(
    family="sd3",
    tp=SD3_TP_PLAN,
    attention=("transformer_blocks.*.attn", "transformer_blocks.*.attn2"),
    processor=SD3ParallelAttnProcessor,
    tokens=_sd3_tokens,
    split_outputs={"pos_embed": 1},  # patch embedding + positions for the full image, then split
    gather={"proj_out": 1},
    on_forward=_sd3_on_forward,
    one_rank_processors=(SD3FusedAttnProcessor,),
)


def parallelize_sd3(transformer: nn.Module, *, mesh: ParallelMesh) -> nn.Module:
    """Shard an SD3Transformer2DModel over `mesh` in place; every rank then calls it with full inputs."""
    return parallelize(transformer, SD3_PLAN, mesh=mesh)
