"""Step caching under sharded layouts: every rank takes the same decision per request (a diverging rank
would hang the next collective, failing the run) and the images equal the single-rank ones."""

import pytest

from ditserve.replica.caching import CacheSettings
from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.request import GenerationParams
from tests.helpers import png_pixels, psnr

FB = CacheSettings(policy="fbcache", threshold=0.45)
REQUESTS = [
    GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=6, seed=1, cache=FB),
    GenerationParams(prompt="a blue cat", width=64, height=64, num_inference_steps=4, seed=2),
    GenerationParams(
        prompt="a grey owl",
        negative_prompt="red",
        true_cfg_scale=2.0,
        width=64,
        height=64,
        num_inference_steps=5,
        seed=3,
        cache=FB,
    ),
]


def run(flags: dict, requests: list[GenerationParams] = REQUESTS) -> list:
    engine = Engine(EngineConfig(model="demo-flux", parallel=ParallelFlags(**flags))).start()
    try:
        futures = [engine.submit(p) for p in requests]  # submitted together: they share steps
        return [png_pixels(f.result(timeout=300).outputs[0]) for f in futures]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference():
    uncached = REQUESTS[0].model_copy(update={"cache": None})
    *images, plain = run({}, [*REQUESTS, uncached])
    # The cache did skip blocks for the first request (its image is not the uncached one).
    assert (images[0] != plain).any()
    return images


@pytest.mark.parametrize(
    "flags",
    [{"ulysses_degree": 2}, {"ring_degree": 2}, {"tp_size": 2}, {"cfg_parallel_size": 2}],
    ids=lambda f: "-".join(f"{k.split('_')[0]}{v}" for k, v in f.items()),
)
def test_cached_batch_under_layout_matches_one_rank(reference, flags):
    for ours, ref in zip(run(flags), reference, strict=True):
        assert psnr(ours, ref) >= 40
