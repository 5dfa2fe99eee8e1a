"""Z-Image's parallel plan (`ZIMAGE_PLAN`): Ulysses / ring / K/V-gather / TP on a diffusers
ZImageTransformer2DModel, applied in place by `parallelize` (``plan.py``).

The model embeds the image tokens (padded to a multiple of 32 with its own pad token, which is attended
like any token) and refines them alone (``noise_refiner``), refines the caption alone
(``context_refiner``), then runs ``layers`` over each row's [image; caption] sequence, padded per batch
with a key mask where captions differ in length. Under sequence parallelism:

1. TP: column-parallel q/k/v and the SwiGLU's w1/w3, row-parallel ``to_out.0`` and w2, in every block
   (refiners too); q/k RMSNorms are per head, so TP leaves them whole;
2. the image tokens are split at ``noise_refiner.0``'s input; rotary tables stay global in the model and
   each processor takes this rank's rows of them (the model's own ``[:x_len]`` slices keep a shard as is);
3. the caption is replicated: the context refiner attends locally (its key mask as the model gives it);
   in ``layers`` it rides as the text of `sequence_parallel_attention`, a batch with captions of several
   lengths attended in groups of rows sharing one length (no padded caption key is ever attended);
4. the final layer's output is cut to the image part, all-gathered and unpadded before the unpatchify.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor
from torch.utils.hooks import RemovableHandle

from .hooks import ForwardState
from .mesh import ParallelMesh
from .plan import ParallelPlan, parallelize
from .processor import ParallelAttnProcessor, image_qkv, rows_by_length, stock_attention
from .sequence import gather_sequence, shard_sequence
from .sp_attention import sequence_parallel_attention

SEQ_MULTIPLE = 32  # the model pads image and caption tokens to multiples of this

ZIMAGE_TP_PLAN: dict[str, str] = {
    "*.attention.to_[qkv]": "column",
    "*.attention.to_out.0": "row",
    "*.feed_forward.w[13]": "column",
    "*.feed_forward.w2": "row",
}


class ZImageParallelAttnProcessor(ParallelAttnProcessor):
    """One processor for the three kinds of blocks, told apart by the module (``state.extra["stage"]``)."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        stage = self.state.extra["stage"][id(attn)]
        layout = self.state.require_layout()
        num_image = self.state.extra["num_image"]  # the global image tokens (the model's own padding incl.)
        freqs = freqs_cis
        if freqs is not None and stage == "noise":  # the image alone, sharded
            freqs = shard_sequence(freqs_cis, layout, dim=1)
        elif freqs is not None and stage == "main":  # [local image; caption]
            freqs = torch.cat(
                [shard_sequence(freqs_cis[:, :num_image], layout, dim=1), freqs_cis[:, num_image:]], 1
            )
        q, k, v = image_qkv(attn, hidden_states, freqs)

        if stage == "context":  # the caption alone, replicated: local attention with the model's key mask
            mask = None if attention_mask is None else attention_mask[:, None, None, :]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask
            )
            out = out.transpose(1, 2)
        elif stage == "noise":
            if attention_mask is not None:
                raise NotImplementedError("rows of different image sizes are never batched together")
            out, _ = sequence_parallel_attention(q, k, v, mesh=self.mesh, layout=layout)
        else:
            out = self._joint(q, k, v, layout.num_local, attention_mask, num_image)
        out = out.flatten(2).to(q.dtype)
        out = attn.to_out[0](out)
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out

    def _joint(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        num_local: int,
        mask: torch.Tensor | None,
        num_image: int,
    ) -> torch.Tensor:
        """Image queries (sharded) and caption queries (replicated) against every image key and each row's
        real caption keys. Rows are grouped by caption length, so no padded caption key is attended."""
        layout = self.state.require_layout()
        img = (q[:, :num_local], k[:, :num_local], v[:, :num_local])
        tq, tk, tv = q[:, num_local:], k[:, num_local:], v[:, num_local:]
        num_text = tq.shape[1]
        lengths = [num_text] * q.shape[0] if mask is None else mask[:, num_image:].sum(1).tolist()
        out = torch.empty_like(q)
        for group in rows_by_length(lengths, q.device):
            img_out, text_out = sequence_parallel_attention(
                *(group.take(x) for x in img),
                mesh=self.mesh,
                layout=layout,
                text=(group.take(tq), group.take(tk)[:, : group.length], group.take(tv)[:, : group.length]),
            )
            both = torch.cat([img_out, text_out], dim=1).to(q.dtype)
            if group.index is None:  # one group of every row
                return both
            out[group.index] = both
        return out


def _zimage_tokens(model: nn.Module, bound: dict[str, Any]) -> int:
    """Image tokens of a row after the model's patchify and its padding to a multiple of 32."""
    _, frames, height, width = bound["x"][0].shape
    patch, f_patch = bound.get("patch_size", 2), bound.get("f_patch_size", 1)
    tokens = (frames // f_patch) * (height // patch) * (width // patch)
    return tokens + (-tokens) % SEQ_MULTIPLE


def _zimage_on_forward(model: nn.Module, bound: dict[str, Any], state: ForwardState) -> None:
    x = bound["x"]
    if isinstance(x[0], list) or bound.get("siglip_feats") is not None:
        raise NotImplementedError("Z-Image Omni inputs (several images, SigLIP features) are not sharded")
    if bound.get("controlnet_block_samples") is not None:
        raise NotImplementedError("ControlNet residuals are not sharded")
    if any(xi.shape != x[0].shape for xi in x):
        raise NotImplementedError("rows of different image sizes are never batched together")
    state.extra["num_image"] = _zimage_tokens(model, bound)
    if "stage" not in state.extra:
        stages = {"noise_refiner": "noise", "context_refiner": "context", "layers": "main"}
        state.extra["stage"] = {
            id(block.attention): stage for name, stage in stages.items() for block in getattr(model, name)
        }


def _gather_image(model: nn.Module, mesh: ParallelMesh, state: ForwardState) -> list[RemovableHandle]:
    """The final layer's output is [local image; caption]: keep the image part and gather it."""

    def gather(module, args, output):
        layout = state.require_layout()
        return gather_sequence(output[:, : layout.num_local], layout, mesh, dim=1)

    return [layer.register_forward_hook(gather) for layer in model.all_final_layer.values()]


class ZImageFusedAttnProcessor(ZSingleStreamAttnProcessor):
    """One rank, ``--fused-epilogues``: diffusers' Z-Image processor with each q/k per-head norm and rotary
    as one pass of ``kernels.qk_norm_rope`` (diffusers' complex products run as eager kernels compiled)."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if freqs_cis is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        q, k, v = image_qkv(attn, hidden_states, freqs_cis)
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]
        out = attn.to_out[0](stock_attention(self, q, k, v, attention_mask))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


ZIMAGE_PLAN = ParallelPlan(
    family="zimage",
    tp=ZIMAGE_TP_PLAN,
    attention=("noise_refiner.*.attention", "context_refiner.*.attention", "layers.*.attention"),
    processor=ZImageParallelAttnProcessor,
    tokens=_zimage_tokens,
    split_block_inputs={"noise_refiner.0": 1},  # the image tokens, embedded and padded to 32 by the model
    gather={},
    extra_hooks=_gather_image,
    on_forward=_zimage_on_forward,
    heads=lambda model: int(model.config.n_heads),
    one_rank_processors=(ZImageFusedAttnProcessor,),
)


def parallelize_zimage(transformer: nn.Module, *, mesh: ParallelMesh) -> nn.Module:
    """Shard a ZImageTransformer2DModel over `mesh` in place; every rank then calls it with full inputs."""
    return parallelize(transformer, ZIMAGE_PLAN, mesh=mesh)
