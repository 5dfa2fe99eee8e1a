"""Fewer activation round trips through HBM in FLUX blocks (``--fused-epilogues``); the GELU epilogue in
every family's tanh-GELU MLPs (``fuse_gelu_epilogues``).

A compiled FLUX step at 1024² spends ~17 ms of ~131 in elementwise kernels; two of them move the widest
tensors of the model (tokens × 12288 MLP activations) and can go into the GEMMs around them:

- the tanh GELU after the MLP up-projection (single blocks' ``proj_mlp``, double blocks' ``ff.net.0``)
  becomes the GEMM's epilogue: ``torch._addmm_activation(..., use_gelu=True)`` is cuBLASLt's GELU_BIAS
  epilogue on CUDA (tanh GELU; inductor keeps it as one extern kernel), so the pre-activation is never
  written and read back;
- single blocks no longer concatenate the attention output with the MLP activations for ``proj_out``: the
  product is two GEMMs over column slices of its weight, the second accumulating into the first's output
  (``proj_out(cat([a, m])) = a · W[:, :d]ᵀ + m · W[:, d:]ᵀ + b``);
- the adaLN-Zero norms before the projections (double blocks' ``norm1`` and ``norm1_context``, single
  blocks' ``norm``) run eagerly as three kernels (LayerNorm, · (1 + scale), + shift), each reading and writing
  tokens × hidden; ``kernels.adaln`` does it in one pass. Under torch.compile the stock ops are traced
  instead (inductor fuses them itself, with the residual add before them).

Where a linear is not a plain ``nn.Linear`` (tensor-parallel swaps) or carries an installed LoRA layer
(``forward`` overridden on the instance), the stock path runs: the same numbers, no fusion. Off CUDA the
stock path runs too (``_addmm_activation`` on CPU is the exact GELU, not tanh).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import ditserve.kernels.adaln.op as adaln_ops
from ditserve.kernels._dispatch import use_triton


def _plain(linear: nn.Module) -> bool:
    """A plain nn.Linear whose forward nobody replaced (LoRA layers override it on the instance)."""
    return type(linear) is nn.Linear and "forward" not in linear.__dict__


def linear_gelu_tanh(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """``gelu(linear(x), approximate="tanh")``, the GELU in the GEMM's epilogue on CUDA."""
    if (
        x.is_cuda
        and _plain(linear)
        and linear.bias is not None
        and x.dtype in (torch.bfloat16, torch.float16)
    ):
        flat = x.reshape(-1, x.shape[-1])
        y = torch._addmm_activation(linear.bias, flat, linear.weight.t(), use_gelu=True)
        return y.view(*x.shape[:-1], y.shape[-1])
    return F.gelu(linear(x), approximate="tanh")


def linear_of_concat(linear: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``linear(torch.cat([a, b], -1))`` without materialising the concatenation."""
    if not _plain(linear):
        return linear(torch.cat([a, b], dim=-1))
    k = a.shape[-1]
    w = linear.weight
    a2, b2 = a.reshape(-1, k), b.reshape(-1, b.shape[-1])
    y = a2 @ w[:, :k].t() if linear.bias is None else torch.addmm(linear.bias, a2, w[:, :k].t())
    y = torch.addmm(y, b2, w[:, k:].t())
    return y.view(*a.shape[:-1], y.shape[-1])


def _single_block_forward(
    self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None
):
    """FluxSingleTransformerBlock.forward with the GELU in proj_mlp's GEMM and proj_out without the concat."""
    n_text = encoder_hidden_states.shape[1]
    joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    normed, gate = self.norm(joint, emb=temb)
    mlp = linear_gelu_tanh(normed, self.proj_mlp)
    attn = self.attn(
        hidden_states=normed, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {})
    )
    joint = joint + gate.unsqueeze(1) * linear_of_concat(self.proj_out, attn, mlp)
    if joint.dtype == torch.float16:
        joint = joint.clip(-65504, 65504)
    return joint[:, :n_text], joint[:, n_text:]


def adaln_modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, norm: nn.Module
) -> torch.Tensor:
    """``norm(x) · (1 + scale[:, None]) + shift[:, None]`` (x ``[batch, tokens, hidden]``, shift and scale
    ``[batch, hidden]``): one kernel where Triton runs, outside torch.compile (eager only, so the launcher
    is called directly, without the custom op's dispatch)."""
    if (
        not torch.compiler.is_compiling()
        and use_triton(x)
        and x.dim() == 3
        and shift.shape == scale.shape == (x.shape[0], x.shape[2])
    ):
        y = adaln_ops.launch_adaln(x.contiguous().view(-1, x.shape[2]), shift, scale, norm.eps)
        return y.view(x.shape)
    return norm(x) * (1 + scale[:, None]) + shift[:, None]


def _adaln_zero_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(
        6, dim=1
    )
    return adaln_modulate(x, shift_msa, scale_msa, self.norm), gate_msa, shift_mlp, scale_mlp, gate_mlp


def _adaln_single_forward(self, x, emb=None):
    shift_msa, scale_msa, gate_msa = self.linear(self.silu(emb)).chunk(3, dim=1)
    return adaln_modulate(x, shift_msa, scale_msa, self.norm), gate_msa


def _gelu_forward(self, hidden_states):
    return linear_gelu_tanh(hidden_states, self.proj)


def _plain_layer_norm(module: nn.Module) -> bool:
    """An adaLN-Zero norm without its own embedding whose norm is a LayerNorm without affine."""
    norm = module.norm
    return getattr(module, "emb", None) is None and type(norm) is nn.LayerNorm and not norm.elementwise_affine


def fuse_flux_epilogues(transformer: nn.Module) -> int:
    """Patch the blocks of a diffusers FluxTransformer2DModel in place; returns how many modules changed.
    Call before ``compile_repeated_blocks`` (the compiled blocks trace the patched forwards)."""
    from diffusers.models.activations import GELU
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    changed = 0
    for module in transformer.modules():
        if isinstance(module, FluxSingleTransformerBlock):
            act = module.act_mlp
            if isinstance(act, nn.GELU) and act.approximate == "tanh":
                module.forward = types.MethodType(_single_block_forward, module)
                changed += 1
        elif type(module) is GELU and module.approximate == "tanh":
            module.forward = types.MethodType(_gelu_forward, module)
            changed += 1
    return changed + fuse_flux_norms(transformer)


def fuse_gelu_epilogues(transformer: nn.Module) -> int:
    """The part of ``fuse_flux_epilogues`` that every family can take: each diffusers ``GELU`` projection
    with the tanh approximation (``FeedForward(activation_fn="gelu-approximate")``: the MLPs of Wan, SD3,
    Qwen-Image, HunyuanVideo 1.5) gets its GELU in the GEMM's epilogue. Returns how many modules changed."""
    from diffusers.models.activations import GELU

    changed = 0
    for module in transformer.modules():
        if type(module) is GELU and module.approximate == "tanh":
            module.forward = types.MethodType(_gelu_forward, module)
            changed += 1
    return changed


def fuse_flux_norms(transformer: nn.Module) -> int:
    """Only the adaLN-Zero norms of ``fuse_flux_epilogues`` (one pass each); returns how many changed."""
    from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

    changed = 0
    for module in transformer.modules():
        if type(module) in (AdaLayerNormZero, AdaLayerNormZeroSingle) and _plain_layer_norm(module):
            forward = _adaln_zero_forward if type(module) is AdaLayerNormZero else _adaln_single_forward
            module.forward = types.MethodType(forward, module)
            changed += 1
    return changed
