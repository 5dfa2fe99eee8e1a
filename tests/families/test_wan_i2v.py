"""Wan image-to-video through the engine's step loop: Wan 2.1 I2V (CLIP image tokens + conditioning
channels) and Wan 2.2 I2V A14B (two experts) give diffusers' WanImageToVideoPipeline video for the same
seed and first frame; the first frame is encoded once (encoder rank) and the sharded layout gives the
single-rank video."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.wan_i2v import IMAGE_TEXT_LENGTH, WanI2VRunner
from ditserve.replica.request import GenerationParams
from tests.families.wan_i2v import build_folder, build_tiny, reference_png
from tests.helpers import psnr

PARAMS = GenerationParams(
    prompt="a red square drifts",
    negative_prompt="blurry",
    width=64,
    height=48,
    num_frames=5,
    num_inference_steps=3,
    guidance_scale=4.0,
    seed=21,
    images=(reference_png(),),
)


def diffusers_i2v(pipe, p: GenerationParams, text_length: int):
    out = pipe(
        image=Image.open(io.BytesIO(p.images[0])).convert("RGB"),
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        height=p.height,
        width=p.width,
        num_frames=p.num_frames,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=text_length,
        output_type="np",
    )
    return to_uint8(np.asarray(out.frames))[0]


def runner_video(pipe, p: GenerationParams, text_length: int) -> tuple[np.ndarray, object]:
    runner = WanI2VRunner(
        pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=text_length
    )
    state = runner.add("r", p)
    while not state.done:
        runner.step([state])
    return runner.decode(state)[0], state


def test_wan21_i2v_matches_image_to_video_pipeline():
    pipe = build_tiny("wan21")
    pipe.set_progress_bar_config(disable=True)
    got, state = runner_video(pipe, PARAMS, text_length=16)
    # the image tokens sit before exactly 512 text tokens (the transformer's hard-coded split)
    assert state.cond["encoder_hidden_states"].shape[1] == IMAGE_TEXT_LENGTH
    assert state.cond["condition"].shape == (1, 4 + 16, 2, 6, 8)  # frame mask + image latents
    want = diffusers_i2v(pipe, PARAMS, IMAGE_TEXT_LENGTH)
    assert got.shape == want.shape == (5, 48, 64, 3)
    assert psnr(got, want) >= 40


def test_wan22_i2v_a14b_matches_image_to_video_pipeline():
    pipe = build_tiny("a14b")
    pipe.set_progress_bar_config(disable=True)
    got, state = runner_video(pipe, PARAMS, text_length=16)
    assert state.extra["boundary"] == 900.0
    want = diffusers_i2v(pipe, PARAMS, 16)
    assert psnr(got, want) >= 40


def test_16_bit_first_frame_is_its_8_bit_twin():
    # A 16-bit greyscale PNG is scaled to 8 bits, not clipped by Pillow's RGB conversion (which turned it
    # nearly white): its video is the one of the same picture saved with 8 bits.
    levels = np.linspace(0, 65535, 60 * 80).reshape(60, 80).astype(np.uint16)
    files = []
    for image in (Image.fromarray(levels), Image.fromarray((levels / 257).round().astype(np.uint8))):
        out = io.BytesIO()
        image.save(out, format="PNG")
        files.append(out.getvalue())
    assert Image.open(io.BytesIO(files[0])).mode == "I;16"
    pipe = build_tiny("a14b")
    videos = [runner_video(pipe, PARAMS.model_copy(update={"images": (f,)}), 16)[0] for f in files]
    np.testing.assert_array_equal(videos[0], videos[1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("wan_i2v") / "i2v")


def engine_latents(folder, flags: dict) -> np.ndarray:
    engine = Engine(EngineConfig(model=str(folder), parallel=ParallelFlags(**flags))).start()
    try:
        with pytest.raises(ValueError, match="^input_reference: .* image-to-video model"):
            engine.submit(PARAMS.model_copy(update={"images": ()}))
        # as POST /v1/videos refuses it (ditserve generate --image took it: CLIP upscales its short side)
        with pytest.raises(ValueError, match="^input_reference: 600x1 is longer than 8:1"):
            engine.submit(PARAMS.model_copy(update={"images": (reference_png(600, 1),)}))
        return engine.generate(PARAMS.model_copy(update={"return_latents": True}), timeout=300).latents
    finally:
        engine.shutdown()


def test_ulysses2_matches_one_rank(folder):
    one = engine_latents(folder, {})
    two = engine_latents(folder, {"ulysses_degree": 2})
    assert one.shape == (1, 16, 2, 6, 8)
    np.testing.assert_allclose(two, one, atol=1e-4)


def test_a_first_last_frame_folder_is_refused(folder, tmp_path):
    """Wan 2.1 FLF2V (WanImageToVideoPipeline with the transformer's pos_embed_seq_len) pairs a first and a
    last frame's image tokens: given one frame its forward failed (a reshape), so every request did; the
    folder is refused by name when it is resolved."""
    import json
    import shutil

    from ditserve.replica.models.registry import resolve_model

    flf2v = tmp_path / "flf2v"
    shutil.copytree(folder, flf2v)
    config = json.loads((flf2v / "transformer" / "config.json").read_text())
    (flf2v / "transformer" / "config.json").write_text(json.dumps({**config, "pos_embed_seq_len": 2 * 17}))
    with pytest.raises(ValueError, match="first-last-frame folder .* is not supported"):
        resolve_model(str(flf2v))
