"""Z-Image through the engine's own step loop, on a tiny random folder: the CLI and one rank give diffusers'
ZImagePipeline image (guidance's norm cap and truncation included); ulysses 2, ring 2, tp 2 and cfg 2 give
the one-rank images for a batch whose captions differ in padded length (the masked path); a LoRA applied
per request gives diffusers' ``load_lora_weights`` image while the same request without it, in the same
batch, is unchanged; an uploaded image with ``strength`` in that batch gives ZImageImg2ImgPipeline's image;
``ditserve serve`` answers the openai client with the image; Omni folders are refused."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ZImageImg2ImgPipeline, ZImageInpaintPipeline, ZImagePipeline
from PIL import Image

from ditserve.replica.caching.settings import CacheSettings
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.zimage import ZImageRunner
from ditserve.replica.request import GenerationParams, LoRARef
from tests.families.harness import (
    LAYOUTS,
    b64_pixels,
    cli_generate,
    engine_images,
    generate_args,
    img2img_image,
    layout_id,
    load_pipeline,
    openai_client,
    picture,
    results,
    running_engine,
    sampling_body,
    served,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.families.lora import save_random_lora
from tests.families.zimage import TURBO_TRANSFORMER, build_folder, build_pipeline
from tests.helpers import png_pixels, psnr

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_LEN = 64  # caption tokens
LONG = "a red fox on a green hill with a white cat and a black dog in the background of a yellow and blue day"
# Captions of 2×32 and 1×32 padded tokens in one batch (the masked path); CFG (guidance > 0) and none.
FOX = GenerationParams(
    prompt=LONG,
    negative_prompt="blurry",
    guidance_scale=4.0,
    width=80,
    height=48,
    num_inference_steps=2,  # the layouts' adapted linears are Triton interpreter launches per forward on CPU
    seed=3,
)
CAT = GenerationParams(
    prompt="a blue cat", guidance_scale=0.0, width=80, height=48, num_inference_steps=2, seed=4
)
FOX_LORA = FOX.model_copy(update={"lora": (LoRARef(name="style"),)})
BATCH = [FOX, CAT, FOX_LORA]  # submitted together: one batch, the same request with and without the LoRA
# Image-to-image: 4 steps at strength 0.6 skip the first (diffusers' get_timesteps), in BATCH's batch.
FOX_I2I = FOX.model_copy(
    update={"num_inference_steps": 4, "strength": 0.6, "seed": 5, "images": (picture(80, 48, 0),)}
)
# The caption embedder too: it runs on the batch's captions one after another, FOX's 2×32 tokens beside CAT's
# 1×32 (its adapters were refused, though diffusers' load_lora_weights applies them)
TARGETS = ["cap_embedder.1", "to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_folder(tmp_path_factory.mktemp("zimage") / "Z-Image-tiny")


def diffusers_image(pipe, p: GenerationParams, **kwargs) -> np.ndarray:
    out = pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        guidance_scale=p.guidance_scale,
        width=p.width,
        height=p.height,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=MAX_LEN,
        output_type="np",
        **kwargs,
    )
    return to_uint8(out.images)[0]


@pytest.fixture(scope="module")
def pipe(folder):
    return load_pipeline(ZImagePipeline, folder)


@pytest.fixture(scope="module")
def lora_file(pipe, tmp_path_factory) -> Path:
    return save_random_lora(ZImagePipeline, pipe.transformer, TARGETS, tmp_path_factory.mktemp("zimage-lora"))


@pytest.fixture(scope="module")
def reference(folder, lora_file) -> list[np.ndarray]:
    """diffusers' images for BATCH (the LoRA one through ``load_lora_weights``)."""
    pipe = load_pipeline(ZImagePipeline, folder)
    plain = [diffusers_image(pipe, p) for p in (FOX, CAT)]
    pipe.load_lora_weights(str(lora_file))
    return [*plain, diffusers_image(pipe, FOX)]


@pytest.fixture(scope="module")
def one_rank_all(folder, lora_file) -> list[np.ndarray]:
    """One engine's images for BATCH and FOX_I2I, submitted together."""
    requests = [*BATCH, FOX_I2I]
    return engine_images(folder, {}, requests, {"style": lora_file}, max_sequence_length=MAX_LEN)


@pytest.fixture(scope="module")
def one_rank(one_rank_all) -> list[np.ndarray]:
    return one_rank_all[: len(BATCH)]


def test_one_rank_equals_diffusers_with_and_without_lora_in_one_batch(one_rank, reference):
    for ours, ref in zip(one_rank, reference, strict=True):
        assert ours.shape == ref.shape == (48, 80, 3)
        assert psnr(ours, ref) >= 40
    assert psnr(reference[2], reference[0]) < 30  # the adapter changes the image


def test_one_rank_image_to_image_equals_diffusers_img2img(one_rank_all, pipe, reference):
    want = img2img_image(ZImageImg2ImgPipeline, pipe, FOX_I2I, max_sequence_length=MAX_LEN)
    assert one_rank_all[-1].shape == want.shape == (48, 80, 3)
    assert psnr(one_rank_all[-1], want) >= 40
    assert psnr(want, reference[0]) < 30  # not the text-to-image picture


def test_cfg_normalization_and_truncation_follow_the_pipeline(folder, pipe, tmp_path):
    """The norm cap and the truncation (guidance off at the last of 4 steps), recommended by the folder's
    ditserve.json, as ZImagePipeline applies them."""
    recommended = tmp_path / "Z-Image-recommended"
    shutil.copytree(folder, recommended)
    sampling = {"guidance_scale": 4.0, "cfg_normalization": 1.0, "cfg_truncation": 0.3}
    (recommended / "ditserve.json").write_text(json.dumps({"sampling": sampling}))
    runner = ZImageRunner(
        ZImagePipeline.from_pretrained(recommended, dtype=torch.float32),
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_sequence_length=MAX_LEN,
    )
    fox = FOX.model_copy(update={"num_inference_steps": 4, "guidance_scale": None})
    state = runner.add("fox", fox)
    assert state.cfg_scale == 4.0
    assert state.extra["guided_steps"] == [True, True, True, False]
    while not state.done:
        runner.step([state])
    ours = runner.decode(state)[0]
    fox = fox.model_copy(update={"guidance_scale": 4.0})
    ref = diffusers_image(pipe, fox, cfg_normalization=1.0, cfg_truncation=0.3)
    assert psnr(ours, ref) >= 40
    assert psnr(ref, diffusers_image(pipe, fox)) < 35  # the settings change the image


def test_truncated_guidance_reports_the_forwards_that_ran(folder, tmp_path):
    """usage under CFG truncation (guidance off at the last of 4 steps): that step runs one forward, not two,
    and its uncond cache is not consulted, on one rank and with the branches on two cfg ranks alike (cfg
    rank 1 runs uncond rows there and discards them). Taylorseer's schedule: the cond branch forecasts its
    fourth forward, the uncond branch's three all compute."""
    recommended = tmp_path / "Z-Image-truncated"
    shutil.copytree(folder, recommended)
    sampling = {"guidance_scale": 4.0, "cfg_truncation": 0.3}
    (recommended / "ditserve.json").write_text(json.dumps({"sampling": sampling}))
    fox = FOX.model_copy(
        update={"num_inference_steps": 4, "guidance_scale": None, "cache": CacheSettings(policy="taylorseer")}
    )
    for flags in ({}, {"cfg_parallel_size": 2}):
        with running_engine(recommended, flags, max_sequence_length=MAX_LEN) as engine:
            usage = results(engine, [fox])[0].usage
        assert (usage["transformer_forwards"], usage["cached_forwards"]) == (7, 1), (flags, usage)


@pytest.mark.slow  # one rank's engine (default) behind the CLI; the CLI in tests/e2e
def test_cli_generate_equals_diffusers(folder, reference, tmp_path):
    args = [*generate_args(FOX), "--max-sequence-length", str(MAX_LEN)]
    assert psnr(cli_generate(FOX.prompt, folder, tmp_path / "fox.png", *args), reference[0]) >= 40


@pytest.mark.parametrize("flags", LAYOUTS, ids=layout_id)
def test_layouts_equal_one_rank(folder, lora_file, one_rank, flags):
    got = engine_images(folder, flags, BATCH, {"style": lora_file}, max_sequence_length=MAX_LEN)
    for ours, ref in zip(got, one_rank, strict=True):
        assert psnr(ours, ref) >= 40


def test_serve_openai_client(folder, pipe, reference):
    """images.generate gives ZImagePipeline's image; an inpaint edit that gives no strength gives
    ZImageInpaintPipeline's called without one (its default strength is 1.0; it drew at image-to-image's
    0.6, another image)."""
    start = FOX_I2I.images[0]
    mask = np.zeros((48, 80), np.uint8)
    mask[8:40, 16:64] = 255  # white: repainted
    buffer = io.BytesIO()
    Image.fromarray(mask).save(buffer, format="PNG")
    settings = {"seed": 6, "num_inference_steps": 3, "guidance_scale": 4.0}
    with served("--model", str(folder), "--max-sequence-length", str(MAX_LEN)) as server:
        client = openai_client(server)
        result = client.images.generate(
            model=folder.name,
            prompt=FOX.prompt,
            size=f"{FOX.width}x{FOX.height}",
            extra_body=sampling_body(FOX),
        )
        inpainted = client.images.edit(
            model=folder.name,
            image=("start.png", start, "image/png"),
            mask=("mask.png", buffer.getvalue(), "image/png"),
            prompt="a red fox",
            extra_body=settings,
        )
    assert psnr(b64_pixels(result), reference[0]) >= 40
    inpaint = ZImageInpaintPipeline.from_pipe(pipe)
    inpaint.set_progress_bar_config(disable=True)
    out = inpaint(
        prompt="a red fox",
        image=Image.open(io.BytesIO(start)).convert("RGB"),
        mask_image=Image.fromarray(mask),
        num_inference_steps=3,
        guidance_scale=4.0,
        generator=torch.Generator("cpu").manual_seed(6),
        max_sequence_length=MAX_LEN,
        output_type="np",
    )
    assert inpainted.size == "80x48"
    assert psnr(b64_pixels(inpainted), to_uint8(out.images)[0]) >= 40


def test_a_size_past_the_rotary_table_is_refused_and_its_batch_served(folder, reference):
    """The tiny transformer's axes_lens (32 rows of 2×8 px) end at 512 px: a wider request is refused naming
    size before it is queued (it failed the shared forward with an IndexError); the next request is served."""
    wide = FOX.model_copy(update={"width": 528})
    with running_engine(folder, max_sequence_length=MAX_LEN) as engine:
        with pytest.raises(ValueError, match=r"^size: 528x48 is above this model's largest 512x512$"):
            engine.submit(wide)
        assert psnr(png_pixels(engine.submit(FOX).result(timeout=300).outputs[0]), reference[0]) >= 40


def test_a_caption_past_the_rotary_table_is_cut_there(pipe):
    """The tiny transformer's first rotary axis has 512 rows: a caption of the default 512 tokens (padded, with
    the image's row after it) has no positions past row 511. The prompt is cut at 480 tokens, the most
    that fit (it failed the batch's forward with an IndexError, a 500 over HTTP): diffusers' image at 480."""
    runner = ZImageRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=512)
    wordy = CAT.model_copy(update={"prompt": "a red fox " * 200, "num_inference_steps": 1})
    state = runner.add("wordy", wordy)
    runner.step([state])
    ours = runner.decode(state)[0]
    ref = pipe(
        prompt=wordy.prompt,
        guidance_scale=0.0,
        width=wordy.width,
        height=wordy.height,
        num_inference_steps=1,
        generator=torch.Generator("cpu").manual_seed(wordy.seed),
        max_sequence_length=480,
        output_type="np",
    )
    assert psnr(ours, to_uint8(ref.images)[0]) >= 40


def test_omni_folder_is_refused(folder, tmp_path):
    omni = tmp_path / "Z-Image-Omni"
    (omni / "transformer").mkdir(parents=True)
    shutil.copy(folder / "model_index.json", omni / "model_index.json")
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (omni / "transformer" / "config.json").write_text(json.dumps(config | {"siglip_feat_dim": 1152}))
    with pytest.raises(ValueError, match="siglip_feat_dim"):
        resolve_model(str(omni))


def test_step_cache_skips_blocks_of_its_request_only(pipe):
    """fbcache over the transformer's blocks: the cached request reuses its kept residual at every step after
    the first (both CFG branches); the uncached request beside it still gives diffusers' image."""
    runner = ZImageRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=MAX_LEN)
    fox = FOX.model_copy(update={"num_inference_steps": 3})
    cached = fox.model_copy(update={"cache": CacheSettings(policy="fbcache", threshold=10.0)})
    states = [runner.add("plain", fox), runner.add("cached", cached)]
    while not all(s.done for s in states):
        runner.step(states)
    plain, ours = (runner.decode(s)[0] for s in states)
    assert psnr(plain, diffusers_image(pipe, fox)) >= 40
    assert {branch: (c.forwards, c.cached) for branch, c in states[1].extra["cache"].items()} == {
        "cond": (3, 2),
        "uncond": (3, 2),
    }
    assert ours.shape == plain.shape


def test_real_pipeline_has_the_public_transformer():
    """The benchmark's pipeline (built on the meta device here: no memory) has the public transformer."""
    real = build_pipeline("real", torch.bfloat16, "meta")
    assert real.transformer.config.n_heads == TURBO_TRANSFORMER["n_heads"] == 30
    assert f"{sum(p.numel() for p in real.transformer.parameters()) / 1e9:.1f}" == "6.2"
