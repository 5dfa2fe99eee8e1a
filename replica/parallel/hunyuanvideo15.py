"""HunyuanVideo 1.5's parallel plan (`HUNYUANVIDEO15_PLAN`): Ulysses / ring / K/V-gather / TP on a
diffusers HunyuanVideo15Transformer3DModel, applied in place by `parallelize` (``plan.py``).

The model's dual-stream blocks attend jointly over [video; context], where the context is the image
(SigLIP), glyph (byT5) and text (Qwen) tokens, reordered by the model so that each row's valid tokens come
first and its padding after, with a key/query mask (padding neither attends nor is attended). So:

1. validate the layout against the model's heads;
2. TP (`HUNYUANVIDEO15_TP_PLAN`): column-parallel q/k/v of both streams and the ff inputs, row-parallel
   to_out / to_add_out (one all-reduce for both) and the ff outputs; q/k RMSNorms are per head, so they
   need nothing. The token refiner (a few blocks over the text alone) stays replicated;
3. every block's attention runs `HunyuanVideo15ParallelAttnProcessor`: the video sequence is sharded, the
   context replicated, and only each row's *valid* context tokens take part (rows grouped by their valid
   length), which is exactly what the mask computes for the video and the valid context tokens. Padding
   context tokens get zeros: they never reach a video token (masked as keys), and the last block's
   context output is discarded;
4. hooks: the `rope` output (built for the full sequence) and `transformer_blocks.0`'s hidden_states are
   padded + split; the final `proj_out` output is all-gathered and unpadded before the unpatchify.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan, feed_forward_tp, joint_attention_tp, parallelize
from .processor import (
    ParallelAttnProcessor,
    image_qkv,
    joint_out,
    local_attention,
    rotate_qk,
    rows_by_length,
    text_qkv,
)
from .sp_attention import sequence_parallel_attention

HUNYUANVIDEO15_TP_PLAN: dict[str, str] = {
    **joint_attention_tp("transformer_blocks.*.attn"),
    **feed_forward_tp("transformer_blocks.*.ff", "transformer_blocks.*.ff_context"),
}


class HunyuanVideo15ParallelAttnProcessor(ParallelAttnProcessor):
    """Joint [video; valid context] attention with the video sharded and the context replicated."""

    def __init__(self, mesh: ParallelMesh, state: ForwardState) -> None:
        super().__init__(mesh, state)
        # The model passes one mask tensor to every block of a forward: its rows' valid lengths are read
        # to the host once per mask, not once per block.
        self._mask: torch.Tensor | None = None
        self._lengths: list[int] = []

    def _valid_lengths(self, mask: torch.Tensor) -> list[int]:
        if mask is not self._mask:
            lengths = mask.bool().sum(dim=1)
            # The model puts each row's valid tokens first; anything else would need a real mask.
            positions = torch.arange(mask.shape[1], device=mask.device)
            prefix = (positions[None, :] < lengths[:, None]) == mask.bool()
            if not bool(prefix.all()):
                raise NotImplementedError("context mask is not a prefix of valid tokens per row")
            self._mask, self._lengths = mask, lengths.tolist()
        return self._lengths

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(video out, context out) of joint attention, video sharded over the sp axis."""
        img, out = sequence_parallel_attention(
            q, k, v, mesh=self.mesh, layout=self.state.require_layout(), text=text
        )
        assert out is not None
        return img, out

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is None:
            raise NotImplementedError("HunyuanVideo15ParallelAttnProcessor expects the context and its mask")
        q, k, v = image_qkv(attn, hidden_states)
        q, k = rotate_qk(q, k, image_rotary_emb)  # video tokens only; split with them
        context = text_qkv(attn, encoder_hidden_states)

        img = torch.empty_like(q)
        text = torch.zeros_like(context[0])
        # One sequence-parallel attention per distinct valid length.
        for group in rows_by_length(self._valid_lengths(attention_mask), q.device):
            n = group.length
            part_img, part_text = self._attend(
                *(group.take(x) for x in (q, k, v)), tuple(group.take(x)[:, :n] for x in context)
            )
            if group.index is None:
                img = part_img.to(q.dtype)
            else:
                img[group.index] = part_img.to(q.dtype)
            text[group.rows, :n] = part_text.to(q.dtype)
        return joint_out(attn, img.flatten(2), text.flatten(2))


class HunyuanVideo15ValidContextAttnProcessor(HunyuanVideo15ParallelAttnProcessor):
    """One rank: the same valid-context attention, local. Spares the model's own processor's per-block
    (rows, 1, S, S) boolean mask and lets attention take its mask-free kernels."""

    def __init__(self) -> None:
        super().__init__(mesh=None, state=None)  # type: ignore[arg-type]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_video = q.shape[1]
        out = local_attention(*(torch.cat([x, t], dim=1) for x, t in zip((q, k, v), text, strict=True)))
        return out[:, :num_video], out[:, num_video:]


def _tokens(model: nn.Module, bound: dict) -> int:
    _, _, frames, height, width = bound["hidden_states"].shape
    config = model.config
    patch = (config.patch_size_t, config.patch_size, config.patch_size)
    return math.prod(n // p for n, p in zip((frames, height, width), patch, strict=True))


HUNYUANVIDEO15_PLAN = ParallelPlan(
    family="hunyuanvideo15",
    tp=HUNYUANVIDEO15_TP_PLAN,
    attention="transformer_blocks.*.attn",
    processor=HunyuanVideo15ParallelAttnProcessor,
    tokens=_tokens,
    split_outputs={"rope": 0},  # (cos, sin), each (tokens, head_dim), built for the full sequence
    split_block_inputs={"transformer_blocks.0": 1},  # the sequence first exists after the patch embedding
    gather={"proj_out": 1},
)


def parallelize_hunyuanvideo15(transformer: nn.Module, *, mesh: ParallelMesh) -> nn.Module:
    """Shard a HunyuanVideo15Transformer3DModel over `mesh` in place; every rank then calls it with full
    inputs and gets the full output."""
    return parallelize(transformer, HUNYUANVIDEO15_PLAN, mesh=mesh)
