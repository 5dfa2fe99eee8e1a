"""Step caching: our per-request fbcache against diffusers' own FirstBlockCache hook, and inside a batch."""

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from diffusers.hooks import FirstBlockCacheConfig
from pydantic import ValidationError

from ditserve.replica.caching import CacheSettings
from ditserve.replica.models.demo import ensure_demo_model
from ditserve.replica.pipelines.flux import FluxRunner
from ditserve.replica.request import GenerationParams
from tests.helpers import psnr

STEPS = 8


@pytest.fixture(scope="module")
def pipe():
    return FluxPipeline.from_pretrained(str(ensure_demo_model("demo-flux")), torch_dtype=torch.float32)


def tail_calls(pipe) -> list[int]:
    """Counts forwards that ran the last block (the blocks a cache hit skips)."""
    calls = [0]
    block = pipe.transformer.single_transformer_blocks[-1]
    handle = block.proj_out.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


def run_ours(pipe, params_list: list[GenerationParams]) -> tuple[list[np.ndarray], list]:
    runner = FluxRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=32)
    states = [runner.add(f"r{i}", p) for i, p in enumerate(params_list)]
    running = list(states)
    while running:
        runner.step(running)
        running = [s for s in running if not s.done]
    return [runner.decode(s)[0] for s in states], states


def test_fbcache_on_one_request_skips_what_diffusers_first_block_cache_skips(pipe):
    threshold = 0.45
    kwargs = dict(prompt="a red fox", height=64, width=64, num_inference_steps=STEPS, guidance_scale=3.5)
    # Reference: diffusers' own hook on the whole pipeline.
    calls, handle = tail_calls(pipe)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        ref = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(5), output_type="np").images[0]
    finally:
        pipe.transformer.disable_cache()
    ref_computed = calls[0]
    calls[0] = 0
    cache = CacheSettings(policy="fbcache", threshold=threshold)
    (ours,), (state,) = run_ours(pipe, [GenerationParams(**kwargs, seed=5, cache=cache)])
    handle.remove()
    record = state.extra["cache"]["cond"]
    assert 0 < ref_computed < STEPS, (
        "the threshold must give a mixed hit pattern for this check to mean anything"
    )
    assert calls[0] == ref_computed == STEPS - record.cached
    assert record.forwards == STEPS
    assert psnr(ours, (ref * 255).round().clip(0, 255).astype("uint8")) >= 40


def test_mixed_batch_each_request_equals_its_solo_run(pipe):
    base = dict(height=64, width=64, guidance_scale=3.5)
    params = [
        GenerationParams(
            prompt="a red fox",
            num_inference_steps=8,
            seed=1,
            cache=CacheSettings(policy="fbcache", threshold=0.45),
            **base,
        ),
        GenerationParams(prompt="a blue cat", num_inference_steps=5, seed=2, **base),
        GenerationParams(
            prompt="a green dog",
            num_inference_steps=6,
            seed=3,
            cache=CacheSettings(policy="fbcache", threshold=0.35),
            **base,
        ),
        GenerationParams(
            prompt="a grey owl",
            negative_prompt="red",
            true_cfg_scale=2.0,
            num_inference_steps=7,
            seed=4,
            cache=CacheSettings(policy="fbcache", threshold=0.45),
            **base,
        ),
    ]
    solo = [run_ours(pipe, [p]) for p in params]
    together, states = run_ours(pipe, params)
    for ((want,), (solo_state,)), got, state in zip(solo, together, states, strict=True):
        assert psnr(got, want) >= 40
        for branch, rec in state.extra.get("cache", {}).items():
            assert rec.decisions == solo_state.extra["cache"][branch].decisions
    assert any(any(r.decisions) for s in states for r in s.extra.get("cache", {}).values())


def test_bad_cache_values_name_the_field():
    with pytest.raises(ValidationError, match="policy"):
        CacheSettings(policy="teacache")
    with pytest.raises(ValidationError, match="threshold"):
        CacheSettings(policy="fbcache", threshold=-1)


def test_engine_batch_with_lora_and_cached_requests_equals_solo_runs(tmp_path):
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.engine import Engine
    from ditserve.replica.request import LoRARef
    from tests.helpers import png_pixels
    from tests.unit.test_lora_engine import weights, write_kohya

    path = write_kohya(tmp_path / "a.safetensors", weights(1))
    config = EngineConfig(model="demo-flux", max_loras=1, max_lora_rank=8, lora_roots=(str(tmp_path),))
    engine = Engine(config).start()
    try:
        engine.load_lora("a", str(path))
        fb = CacheSettings(policy="fbcache", threshold=0.45)
        base = dict(height=64, width=64, guidance_scale=3.5)
        params = [
            GenerationParams(prompt="a red fox", num_inference_steps=8, seed=1, cache=fb, **base),
            GenerationParams(
                prompt="a blue cat", num_inference_steps=5, seed=2, lora=(LoRARef(name="a"),), **base
            ),
            GenerationParams(
                prompt="a green dog",
                num_inference_steps=6,
                seed=3,
                cache=fb,
                lora=(LoRARef(name="a"),),
                **base,
            ),
        ]
        alone = [png_pixels(engine.generate(p, timeout=120).outputs[0]) for p in params]
        steps_before = engine.steps_run
        futures = [engine.submit(p) for p in params]
        together = [png_pixels(f.result(timeout=120).outputs[0]) for f in futures]
        assert engine.steps_run - steps_before < sum(p.num_inference_steps for p in params)
        for got, want in zip(together, alone, strict=True):
            assert psnr(got, want) >= 40
    finally:
        engine.shutdown()


def test_settings_default_per_policy_and_another_policys_setting_has_no_effect():
    assert CacheSettings(policy="taylorseer").value("interval") == 3
    assert CacheSettings(policy="fbcache").value("threshold") == 0.1
    with pytest.raises(ValidationError) as exc:
        CacheSettings(policy="taylorseer", interval=0)
    assert exc.value.errors()[0]["loc"] == ("interval",)


def test_taylorseer_forecasts_on_its_schedule_inside_a_batch(pipe):
    """taylorseer: warmup forwards compute, then one in `interval`; the others are forecast. In a batch with an
    uncached request (and a cached one at another interval) each request equals its solo run, and the forecast
    (order 1) is not the plain reuse of the last residual (order 0)."""
    base = dict(height=64, width=64, guidance_scale=3.5, num_inference_steps=STEPS)
    ts = CacheSettings(policy="taylorseer", interval=3, warmup=2, order=1)
    params = [
        GenerationParams(prompt="a red fox", seed=1, cache=ts, **base),
        GenerationParams(prompt="a blue cat", seed=2, **base),
        GenerationParams(
            prompt="a green dog", seed=3, cache=CacheSettings(policy="taylorseer", interval=2), **base
        ),
    ]
    together, states = run_ours(pipe, params)
    for p, image, state in zip(params, together, states, strict=True):
        (solo,), (solo_state,) = run_ours(pipe, [p])
        assert psnr(image, solo) >= 40
        if p.cache is not None:
            assert state.extra["cache"]["cond"].decisions == solo_state.extra["cache"]["cond"].decisions
    decisions = states[0].extra["cache"]["cond"].decisions
    # forwards 0, 1 (warmup) and 2, 5 (every 3rd after it) compute; the rest are forecast
    assert decisions == [False, False, False, True, True, False, True, True]
    from ditserve.replica.pipelines.base import usage

    assert usage(states[0]) == {"transformer_forwards": STEPS, "cached_forwards": 4}
    assert usage(states[1]) == {"transformer_forwards": STEPS, "cached_forwards": 0}
    (order0,), _ = run_ours(
        pipe, [params[0].model_copy(update={"cache": ts.model_copy(update={"order": 0})})]
    )
    uncached = run_ours(pipe, [params[0].model_copy(update={"cache": None})])[0][0]
    assert (order0 != together[0]).any() and (uncached != together[0]).any()
