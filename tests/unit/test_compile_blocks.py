"""--compile and --quantization fp8 on every family: diffusers' regional compilation where the class names its repeated blocks,
else each block of the model's block lists compiled alike (SD3's transformer names none, and
``compile_repeated_blocks`` refuses it)."""

import pytest
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

from ditserve.replica.worker import compile_blocks


def test_blocks_are_compiled_where_diffusers_names_none():
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match="_repeated_blocks"):
        model.compile_repeated_blocks(fullgraph=False)
    assert compile_blocks(model) == 3
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.transformer_blocks)


def test_diffusers_regional_compilation_where_the_class_names_blocks():
    model = FluxTransformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    assert compile_blocks(model) == 0
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in model.single_transformer_blocks)


def test_fp8_takes_the_block_linears_where_diffusers_names_no_blocks():
    from ditserve.replica.models.fp8 import Float8Linear, quantize_fp8

    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
    )  # fmt: skip
    count = quantize_fp8(model)
    converted = [m for b in model.transformer_blocks for m in b.modules() if isinstance(m, Float8Linear)]
    assert count == len(converted) > 0
