"""Qwen-Image's parallel plan (`QWENIMAGE_PLAN`): Ulysses / ring / K/V-gather / TP on a diffusers
QwenImageTransformer2DModel, applied in place by `parallelize` (``plan.py``).

What the plan does, in order:

1. validate the layout against the model's heads;
2. TP: column-parallel q/k/v and add_q/k/v_proj (both streams), img/txt MLP in; row-parallel to_out,
   to_add_out and the MLP outs (`QWENIMAGE_TP_PLAN`, the same split diffusers' ``_tp_plan`` names). The
   q/k RMSNorms are per head, so they need nothing under TP;
3. swap every block's attention processor for `QwenImageParallelAttnProcessor`;
4. pre-forward hook on the model: pad + split ``hidden_states`` along the image sequence. For edits that
   sequence is [generated tokens; reference tokens], and the references are sharded with it (they are
   image tokens like the others: they attend and are attended jointly, and the model gives them rotary
   positions of their own; replicating them would repeat ~4096 tokens per reference on every rank). The
   text stream stays replicated; the processor takes its rank's slice of the image rotary table;
5. zero_cond_t transformers (Qwen-Image-Edit-2511: reference tokens modulated at t = 0): a pre-hook on
   every block takes this rank's columns of the per-token ``modulate_index`` the model builds;
6. forward hook on the final ``proj_out``: all-gather the image sequence and cut the padding (the runner
   then drops the reference tokens' predictions, as the pipelines do).

Text masks: rows of one forward may carry prompts of different lengths, padded and marked by
``encoder_hidden_states_mask``. `sequence_parallel_attention` takes replicated text without a mask, so the
processor runs it once per distinct mask with only that mask's valid text tokens (padding text keys get no
weight, exactly as the masked softmax gives them; the padding text queries' outputs are never read by an
unpadded token, and are returned as zeros). One forward of equal-length prompts is one call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan, feed_forward_tp, joint_attention_tp, parallelize
from .processor import (
    ParallelAttnProcessor,
    image_qkv,
    joint_out,
    stock_attention,
    text_image_attention,
    text_qkv,
)
from .sequence import shard_sequence
from .sp_attention import sequence_parallel_attention

QWENIMAGE_TP_PLAN: dict[str, str] = {
    **joint_attention_tp("transformer_blocks.*.attn"),
    **feed_forward_tp("transformer_blocks.*.img_mlp", "transformer_blocks.*.txt_mlp"),
}


class QwenImageParallelAttnProcessor(ParallelAttnProcessor):
    """Joint [text; image] attention with the image sequence sharded and the text replicated."""

    def _local_freqs(self, freqs: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the image rotary table (built by the model for the whole sequence), once per
        forward."""
        cached = self.state.extra.get("qwen_freqs")
        if cached is None or cached[0] is not freqs:
            cached = (freqs, shard_sequence(freqs, self.state.require_layout(), dim=0))
            self.state.extra["qwen_freqs"] = cached
        return cached[1]

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is not None:
            raise NotImplementedError(
                "QwenImageParallelAttnProcessor needs the text stream and no attention_mask"
            )
        img_freqs = txt_freqs = None
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_freqs = self._local_freqs(img_freqs)
        q, k, v = image_qkv(attn, hidden_states, img_freqs)
        tq, tk, tv = text_qkv(attn, encoder_hidden_states, txt_freqs)

        layout = self.state.require_layout()
        if encoder_hidden_states_mask is None:
            img, text = text_image_attention((q, k, v), (tq, tk, tv), mesh=self.mesh, layout=layout)
        else:
            masked = self._masked(q, k, v, (tq, tk, tv), encoder_hidden_states_mask.bool())
            img, text = (x.flatten(2).to(q.dtype) for x in masked)
        return joint_out(attn, img, text)

    def _masked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        text: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence-parallel call per distinct text mask, with that mask's valid text tokens only. Every
        rank holds the same rows and masks, so every rank makes the same calls (same collectives)."""
        layout = self.state.require_layout()
        patterns, which = torch.unique(mask, dim=0, return_inverse=True)
        img_out = q.new_empty(q.shape)
        text_out = text[0].new_zeros(text[0].shape)
        for index in range(patterns.shape[0]):
            rows = (which == index).nonzero().flatten()
            keep = patterns[index].nonzero().flatten()
            part = tuple(t[rows][:, keep] for t in text)
            img, txt = sequence_parallel_attention(
                q[rows],
                k[rows],
                v[rows],
                mesh=self.mesh,
                layout=layout,
                text=part,  # type: ignore[arg-type]
            )
            assert txt is not None
            img_out[rows] = img.to(img_out.dtype)
            text_out[rows[:, None], keep[None, :]] = txt.to(text_out.dtype)
        return img_out, text_out


def _split_modulate_index(state: ForwardState):
    """A block pre-hook: this rank's columns of ``modulate_index`` (zero_cond_t models: 0 for generated
    tokens, 1 for reference tokens), which the model builds for the whole image sequence."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        index = kwargs.get("modulate_index")
        layout = state.require_layout()
        if index is not None and layout.num_shards > 1 and index.shape[1] == layout.num_tokens:
            kwargs = {**kwargs, "modulate_index": shard_sequence(index, layout, dim=1)}
        return args, kwargs

    return hook


def _qwen_on_forward(model: nn.Module, bound: dict[str, Any], state: ForwardState) -> None:
    if bound.get("controlnet_block_samples") is not None:
        raise NotImplementedError("ControlNet residuals are not sharded yet")
    state.extra.pop("qwen_freqs", None)
    if getattr(model, "zero_cond_t", False) and "qwen_modulate_hooks" not in state.extra:
        # Qwen-Image-Edit-2511: per-token modulation, split like the tokens (hooks added once, on first use).
        hook = _split_modulate_index(state)
        state.extra["qwen_modulate_hooks"] = [
            block.register_forward_pre_hook(hook, with_kwargs=True) for block in model.transformer_blocks
        ]


class QwenImageFusedAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """One rank, ``--fused-epilogues``: diffusers' Qwen-Image joint [text; image] processor with each q/k
    per-head norm and rotary as one pass of ``kernels.qk_norm_rope``. Compiled, diffusers' complex rotary
    products run as eager complex kernels with fp32 round trips (inductor generates no complex code)."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is not None or image_rotary_emb is None:
            return super().__call__(
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                attention_mask,
                image_rotary_emb,
            )
        img_freqs, txt_freqs = image_rotary_emb
        q, k, v = image_qkv(attn, hidden_states, img_freqs)
        tq, tk, tv = text_qkv(attn, encoder_hidden_states, txt_freqs)
        mask = None
        if encoder_hidden_states_mask is not None:  # the text's mask, every image token attended
            image = encoder_hidden_states_mask.new_ones(q.shape[:2], dtype=torch.bool)
            mask = torch.cat([encoder_hidden_states_mask, image], dim=1)[:, None, None, :]
        joint = (torch.cat([tq, q], dim=1), torch.cat([tk, k], dim=1), torch.cat([tv, v], dim=1))
        out = stock_attention(self, *joint, mask)
        num_text = tq.shape[1]
        return joint_out(attn, out[:, num_text:], out[:, :num_text])


QWENIMAGE_PLAN = ParallelPlan(
    family="qwenimage",
    tp=QWENIMAGE_TP_PLAN,
    attention="transformer_blocks.*.attn",
    processor=QwenImageParallelAttnProcessor,
    tokens=lambda model, bound: bound["hidden_states"].shape[1],
    # The rotary table is built for the whole image sequence; the processor takes its rank's rows.
    split_inputs={"hidden_states": 1},
    gather={"proj_out": 1},
    on_forward=_qwen_on_forward,
    one_rank_processors=(QwenImageFusedAttnProcessor,),
)


def parallelize_qwenimage(transformer: nn.Module, *, mesh: ParallelMesh) -> nn.Module:
    """Shard a QwenImageTransformer2DModel over `mesh` in place; every rank then calls it with full inputs."""
    return parallelize(transformer, QWENIMAGE_PLAN, mesh=mesh)
