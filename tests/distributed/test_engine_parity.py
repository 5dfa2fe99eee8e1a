"""The whole engine (text encoders, scheduler, VAE) under sharded layouts gives the single-rank output.

tests/distributed/test_parity.py checks the transformer alone over every layout; this checks the path a
user runs: `Engine` → local rank processes (gloo) → PNG/MP4, with CFG branches, padding and batching.
"""

import pytest

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.media import decode_mp4
from ditserve.replica.request import GenerationParams
from tests.helpers import png_pixels, psnr

FLUX = [
    GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=3),
    # true CFG (two branches) and a 48×80 image: 3×5 packed tokens need padding for 4-way sequence splits
    GenerationParams(
        prompt="a blue cat",
        negative_prompt="green",
        true_cfg_scale=3.0,
        width=80,
        height=48,
        num_inference_steps=3,
        seed=4,
    ),
]
WAN = [GenerationParams(prompt="a red fox", width=64, height=48, num_frames=5, num_inference_steps=2, seed=5)]


def run(model: str, flags: dict, requests: list[GenerationParams]) -> list:
    engine = Engine(EngineConfig(model=model, parallel=ParallelFlags(**flags))).start()
    try:
        futures = [engine.submit(p) for p in requests]  # submitted together: they share steps
        results = [f.result(timeout=300) for f in futures]
    finally:
        engine.shutdown()
    if engine.spec.kind == "video":
        return [decode_mp4(r.outputs[0]) for r in results]
    return [png_pixels(r.outputs[0]) for r in results]


@pytest.fixture(scope="module")
def flux_reference():
    return run("demo-flux", {}, FLUX)


@pytest.fixture(scope="module")
def wan_reference():
    return run("demo-wan", {}, WAN)


@pytest.mark.parametrize(
    "flags",
    [
        {"ring_degree": 2, "ulysses_degree": 2},
        {"cfg_parallel_size": 2, "kv_gather_degree": 2},
        pytest.param({"ulysses_degree": 2}, marks=pytest.mark.slow),
        pytest.param({"tp_size": 2, "ring_degree": 2}, marks=pytest.mark.slow),
    ],
    ids=lambda f: "-".join(f"{k.split('_')[0]}{v}" for k, v in f.items()),
)
def test_flux_layouts_match_one_rank(flux_reference, flags):
    for ours, ref in zip(run("demo-flux", flags, FLUX), flux_reference, strict=True):
        assert ours.shape == ref.shape
        assert psnr(ours, ref) >= 40


@pytest.mark.parametrize(
    "flags",
    [{"cfg_parallel_size": 2, "ulysses_degree": 2}, pytest.param({"tp_size": 2}, marks=pytest.mark.slow)],
)
def test_wan_layouts_match_one_rank(wan_reference, flags):
    for ours, ref in zip(run("demo-wan", flags, WAN), wan_reference, strict=True):
        assert ours.shape == ref.shape
        assert psnr(ours, ref) >= 40
