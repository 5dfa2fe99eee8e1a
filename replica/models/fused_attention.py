"""q/k preparation in fewer passes over memory for one-rank replicas (``--fused-epilogues``).

On one rank the model keeps diffusers' own attention processors (the sharded layouts swap in the parallel
plan's). Three of them prepare q and k in a way that torch.compile cannot fuse well:

- **Qwen-Image and Z-Image** turn q and k by complex products (``torch.view_as_complex``). Inductor does
  not generate code for complex tensors: the norm's output is written in fp32, multiplied by an eager
  complex kernel, and read back for the cast, about 15 ms of a 274 ms Qwen-Image step on an H100.
  `QwenImageFusedAttnProcessor` and `ZImageFusedAttnProcessor` run each per-head RMSNorm and its rotary
  as one pass of ``kernels.qk_norm_rope`` (the complex table read as its (real, imaginary) pairs).
- **Wan** normalises q and k over all heads and then turns (even, odd) channel pairs, written by diffusers
  as strided stores into an empty tensor; inductor's fused kernel reads each row's pairs back with gathered
  loads and runs at about a third of the bandwidth. `WanFusedAttnProcessor` calls ``kernels.qk_norm_rope``
  for self-attention: one pass, one row per program.

Each processor is a subclass of diffusers' and computes the same arithmetic (the same products in fp32, the
same roundings); anything it does not handle (no rotary table, a fused QKV projection, another norm) goes
to diffusers' own ``__call__``. Only processors of exactly diffusers' class are swapped, so an adapter
loader's or a user's processor stays.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from ditserve.kernels.qk_norm_rope.op import qk_norm_rope

from ..parallel.processor import image_qkv, joint_out, plain_rms_norms, text_qkv


class WanFusedAttnProcessor(WanAttnProcessor):
    """diffusers' Wan processor; self-attention's q/k RMSNorm and rotary in one kernel pass."""

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
        out = dispatch_attention_fn(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class QwenImageFusedAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """diffusers' Qwen-Image joint [text; image] processor with the rotary product in real arithmetic."""

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
        out = dispatch_attention_fn(
            torch.cat([tq, q], dim=1),
            torch.cat([tk, k], dim=1),
            torch.cat([tv, v], dim=1),
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(q.dtype)
        num_text = tq.shape[1]
        return joint_out(attn, out[:, num_text:], out[:, :num_text])


class ZImageFusedAttnProcessor(ZSingleStreamAttnProcessor):
    """diffusers' Z-Image processor with the rotary product in real arithmetic."""

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
        out = dispatch_attention_fn(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = attn.to_out[0](out.flatten(2, 3).to(q.dtype))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


_SWAPS = {
    WanAttnProcessor: WanFusedAttnProcessor,
    QwenDoubleStreamAttnProcessor2_0: QwenImageFusedAttnProcessor,
    ZSingleStreamAttnProcessor: ZImageFusedAttnProcessor,
}


def fuse_attention_prologues(transformer: nn.Module) -> int:
    """Swap every attention processor of exactly one of diffusers' classes above for ours (keeping its
    attention backend); returns how many were swapped. Applying it again swaps nothing."""
    swapped = 0
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        ours = _SWAPS.get(type(processor))
        if ours is None or not hasattr(module, "set_processor"):
            continue
        new = ours()
        new._attention_backend = processor._attention_backend
        new._parallel_config = processor._parallel_config
        module.set_processor(new)
        swapped += 1
    return swapped
