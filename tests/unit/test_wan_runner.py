"""WanRunner steps with the pipeline's own scheduler: Wan2.1's UniPC gives diffusers' WanPipeline video,
alone and batched with a request of another step count."""

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline

from ditserve.replica.models.demo import ensure_demo_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.wan import WanRunner
from ditserve.replica.request import GenerationParams
from tests.helpers import psnr

MAX_LEN = 32
REQUESTS = [
    GenerationParams(
        prompt="waves on a beach",
        negative_prompt="blurry, static",
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=5.0,
        seed=11,
    ),
    GenerationParams(
        prompt="a red fox running",
        negative_prompt="dark",
        num_frames=5,
        num_inference_steps=6,
        guidance_scale=3.0,
        seed=12,
    ),
]


@pytest.fixture(scope="module")
def pipe():
    pipe = WanPipeline.from_pretrained(ensure_demo_model("demo-wan"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    # Wan2.1's scheduler (480p flow shift); diffusers' own default when a Wan2.1 checkpoint is loaded.
    pipe.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return pipe


@pytest.fixture(scope="module")
def runner(pipe):
    return WanRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=MAX_LEN)


def diffusers_video(pipe, p: GenerationParams) -> tuple[np.ndarray, torch.Tensor]:
    """WanPipeline's uint8 frames and final latents for ``p``."""
    final = {}

    def keep_latents(_pipe, i, t, kwargs):
        final["latents"] = kwargs["latents"].clone()
        return {}

    out = pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        height=p.height,
        width=p.width,
        num_frames=p.num_frames,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=MAX_LEN,
        output_type="np",
        callback_on_step_end=keep_latents,
    )
    return to_uint8(np.asarray(out.frames))[0], final["latents"]


@pytest.fixture(scope="module")
def reference(pipe):
    return [diffusers_video(pipe, p) for p in REQUESTS]


def assert_matches(runner, state, want: tuple[np.ndarray, torch.Tensor]) -> None:
    frames, latents = want
    assert torch.allclose(state.latents, latents, atol=1e-5, rtol=0), (state.latents - latents).abs().max()
    got = runner.decode(state)[0]
    assert got.shape == frames.shape
    assert psnr(got, frames) >= 40 and np.abs(got.astype(int) - frames.astype(int)).max() <= 1


def test_alone_matches_wan_pipeline_with_unipc(pipe, runner, reference):
    state = runner.add("a", REQUESTS[0])
    assert type(state.scheduler) is UniPCMultistepScheduler and state.scheduler is not pipe.scheduler
    assert state.scheduler.config.flow_shift == 3.0
    assert state.uncond is not None  # true CFG: a negative branch every step
    pipe.scheduler.set_timesteps(REQUESTS[0].num_inference_steps)
    assert torch.equal(state.timesteps, pipe.scheduler.timesteps)  # 999, 900, 750, 500 (flow shift 3)
    while not state.done:
        runner.step([state])
    assert_matches(runner, state, reference[0])


def test_batched_requests_with_different_step_counts_each_match_alone(runner, reference):
    states = [runner.add(f"r{i}", p) for i, p in enumerate(REQUESTS)]
    assert states[0].bucket == states[1].bucket
    assert states[0].scheduler is not states[1].scheduler  # multistep history is per request
    while not all(s.done for s in states):
        runner.step([s for s in states if not s.done])  # both together, then the longer one alone
    for state, want in zip(states, reference, strict=True):
        assert_matches(runner, state, want)
