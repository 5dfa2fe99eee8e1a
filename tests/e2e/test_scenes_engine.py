"""demo-scenes through the engine a user runs: `generate`'s engine, a sharded layout, FP8 GEMMs, and the README
prompt.

(tests/e2e/test_scenes_model.py checks the weights through diffusers; test_serve_http.py through `serve`.)
"""

import subprocess
import sys

import pytest
from PIL import Image

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.models.scenes import held_out_scenes
from ditserve.replica.models.scorer import classify_shape, score_scene
from ditserve.replica.request import GenerationParams
from tests.helpers import png_pixels

SEED = 1000  # per-image seeds SEED + i, as in test_scenes_model.py


def held_out_requests() -> list[tuple]:
    spec = resolve_model("demo-scenes")
    negative, true_cfg = spec.guidance_defaults(None, None)  # the model's recommended CFG
    return [
        (
            s,
            GenerationParams(
                prompt=s.caption,
                negative_prompt=negative,
                true_cfg_scale=true_cfg,
                width=64,
                height=64,
                num_inference_steps=20,
                seed=SEED + i,
            ),
        )
        for i, s in enumerate(held_out_scenes()[:16])
    ]


def count_right(flags: dict, **config) -> tuple[int, list, float]:
    """(prompts drawn right of 16 on background, shape colour and shape, the wrong ones, the share of
    transformer forwards the step cache answered)."""
    engine = Engine(EngineConfig(model="demo-scenes", parallel=ParallelFlags(**flags), **config)).start()
    try:
        requests = held_out_requests()
        futures = [engine.submit(p) for _, p in requests]
        results = [f.result(timeout=600) for f in futures]
    finally:
        engine.shutdown()
    images = [Image.fromarray(png_pixels(r.outputs[0])) for r in results]
    scored = [(*score_scene(img), classify_shape(img)) for img in images]
    wrong = [
        (s.caption, got)
        for (s, _), got in zip(requests, scored, strict=True)
        if got != (s.background, s.colour, s.shape)
    ]
    forwards = sum(r.usage["transformer_forwards"] for r in results)
    cached = sum(r.usage["cached_forwards"] for r in results)
    return 16 - len(wrong), wrong, cached / forwards


@pytest.fixture(scope="module")
def uncached():
    return count_right({}, cache_policy="none")


def test_held_out_prompts_drawn_right(uncached):
    right, wrong, share = uncached
    assert right >= 15 and share == 0, wrong


def test_recommended_step_cache_skips_a_third_and_keeps_the_prompts(uncached):
    """demo-scenes' ditserve.json recommends a step cache, which the server applies to requests that ask for
    none: at least 30 % of the forwards are answered by the cache and at most one more prompt goes wrong."""
    assert resolve_model("demo-scenes").recommended_cache is not None
    right, wrong, share = count_right({})
    assert share >= 0.30, share
    assert right >= uncached[0] - 1, wrong


def test_held_out_prompts_drawn_right_at_cfg2_ulysses2():
    right, wrong, _ = count_right({"cfg_parallel_size": 2, "ulysses_degree": 2}, cache_policy="none")
    assert right >= 15, wrong


def test_held_out_prompts_drawn_right_with_fp8_gemms():
    """--quantization fp8: every block linear an FP8 GEMM, and the model still draws what it is asked."""
    right, wrong, _ = count_right({}, quantization="fp8", cache_policy="none")
    assert right >= 15, wrong


def test_readme_prompt_through_generate(tmp_path):
    out = tmp_path / "out.png"
    cmd = [
        sys.executable,
        "-m",
        "ditserve.cluster.cli",
        "generate",
        "a yellow triangle on a purple background",
        "-o",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    image = Image.open(out)
    assert (*score_scene(image), classify_shape(image)) == ("purple", "yellow", "triangle")


def phrase(caption: str, k: int) -> str:
    """The caption as users type it, in one of several ways."""
    ways = (
        lambda c: c[0].upper() + c[1:] + ".",  # a sentence
        lambda c: c.replace(" a o", " an o").title(),
        lambda c: c.upper(),
        lambda c: "  " + c.replace(" background", "") + "  ",  # no "background"
        lambda c: c.replace(" on a ", " against the ").replace("gray", "grey") + "!",
    )
    return ways[k % len(ways)](caption)


def test_user_phrasings_through_generate(tmp_path):
    """Prompts typed as users type them (capitals, a full stop, "an orange", "grey", no "background") are drawn
    as the captions are: 8 held-out prompts in one `generate` batch, at most one wrong."""
    scenes = held_out_scenes()[:8]
    prompts = [phrase(s.caption, k) for k, s in enumerate(scenes)]
    out = tmp_path / "out.png"
    cmd = [
        sys.executable,
        "-m",
        "ditserve.cluster.cli",
        "generate",
        *prompts,
        "--seed",
        str(SEED),
        "-o",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    wrong = []
    for k, s in enumerate(scenes):
        image = Image.open(tmp_path / f"out-{k}.png")
        if (got := (*score_scene(image), classify_shape(image))) != (s.background, s.colour, s.shape):
            wrong.append((prompts[k], got))
    assert len(wrong) <= 1, wrong
