"""--quantization fp8: the block linears become FP8 GEMMs with row-wise scales (torch._scaled_mm, which runs
on CPU too); adapters still apply on top; a weights update gets the same treatment."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from pydantic import ValidationError

from ditserve.replica.config import EngineConfig
from ditserve.replica.engine import Engine
from ditserve.replica.models.demo import ensure_demo_model
from ditserve.replica.models.fp8 import Float8Linear, quantize_fp8, quantize_rowwise
from ditserve.replica.rank_control import ServingRankWorker
from ditserve.replica.request import GenerationParams, LoRARef
from tests.helpers import png_pixels, psnr
from tests.unit.test_lora_engine import weights, write_peft

REQ = dict(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=3)


def test_rowwise_quantization_round_trips_within_e4m3_precision():
    t = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different magnitude
    q, scale = quantize_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = q.float() * scale
    assert ((back - t).abs() <= t.abs() * 2**-3 + scale * 2**-9).all()  # 3 mantissa bits, per row


@pytest.mark.parametrize("bias", [True, False])
def test_float8_linear_is_close_to_the_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=bias)
    f8 = Float8Linear(lin)
    x = torch.randn(3, 7, 256)
    want, got = lin(x), f8(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).norm() / want.norm() < 0.06
    assert f8(x[:, :0]).shape == (3, 0, 96)


def _counts(model):
    f8 = sum(isinstance(m, Float8Linear) for m in model.modules())
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    return f8, plain


def test_block_linears_converted_and_modulation_kept():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(ensure_demo_model("demo-flux") / "transformer")
    n_double, n_single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    assert quantize_fp8(model) == 12 * n_double + 5 * n_single  # q k v out, text q k v out, 2 MLPs × 2
    f8, plain = _counts(model)
    assert f8 == 12 * n_double + 5 * n_single
    # what stays: per-block modulation linears, embedders, the final projection
    assert all(
        ".norm" in n or not n.startswith(("transformer_blocks", "single_transformer_blocks")) for n in plain
    )
    assert "single_transformer_blocks.0.norm.linear" in plain and "proj_out" in plain


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    return write_peft(tmp_path_factory.mktemp("fp8lora") / "a.safetensors", weights(1))


def _images(lora_file, **config):
    engine = Engine(EngineConfig(model="demo-flux", max_loras=2, max_lora_rank=8, **config)).start()
    try:
        engine.load_lora("a", str(lora_file))
        out = []
        for refs in ((), (LoRARef(name="a", scale=1.0),)):
            result = engine.generate(GenerationParams(**REQ, lora=refs), timeout=120)
            out.append(png_pixels(result.outputs[0]))
        return out
    finally:
        engine.shutdown()


def test_fp8_engine_draws_close_to_full_precision_with_and_without_lora(lora_file):
    plain, plain_lora = _images(lora_file)
    f8, f8_lora = _images(lora_file, quantization="fp8")
    assert not np.array_equal(f8, plain)  # the GEMMs really are FP8
    assert psnr(f8, plain) >= 20 and psnr(f8_lora, plain_lora) >= 20
    # the adapter still changes the picture the way it does at full precision
    assert psnr(f8_lora, f8) < 40
    assert psnr(f8_lora, plain_lora) > psnr(f8_lora, plain)


def test_weights_update_prepares_the_new_transformer_the_same_way():
    from ditserve.replica.models.flux_fused import _single_block_forward

    config = EngineConfig(model="demo-flux", quantization="fp8", fused_epilogues=True, compile=True)
    worker = ServingRankWorker(config)
    old = worker.pipe.transformer
    worker.stage_weights(str(ensure_demo_model("demo-flux")), "v2")
    worker.commit_weights("v2")
    new = worker.pipe.transformer
    assert new is not old
    assert _counts(new)[0] == _counts(old)[0] > 0
    assert all(b.forward.__func__ is _single_block_forward for b in new.single_transformer_blocks)
    blocks = [*new.transformer_blocks, *new.single_transformer_blocks]
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)  # --compile kept


def test_fp8_on_gpu_needs_bfloat16():
    with pytest.raises(ValidationError, match="--quantization fp8"):
        EngineConfig(model="demo-flux", device="cuda", dtype="float16", quantization="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_bf16_gpu_float8_linear(compile):
    torch.manual_seed(0)
    lin = nn.Linear(3072, 9216, device="cuda", dtype=torch.bfloat16)
    f8 = Float8Linear(lin)
    x = torch.randn(2, 4608, 3072, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(f8, fullgraph=True) if compile else f8
    with torch.no_grad():
        want, got = lin(x).float(), fn(x).float()
    assert (got - want).norm() / want.norm() < 0.06


def test_fp8_wan_video_latents_close_to_full_precision():
    def latents(**config):
        engine = Engine(EngineConfig(model="demo-wan", **config)).start()
        try:
            p = GenerationParams(prompt="waves", width=64, height=64, num_frames=5, num_inference_steps=3, seed=1,
                                 return_latents=True)  # fmt: skip
            return engine.generate(p, timeout=120).latents
        finally:
            engine.shutdown()

    full, f8 = latents(), latents(quantization="fp8")
    rel = np.linalg.norm(f8 - full) / np.linalg.norm(full)
    assert 0 < rel < 0.05, rel
