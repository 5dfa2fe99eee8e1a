"""Stable Diffusion 3.5 through the engine's own step loop, on a tiny random folder: the CLI and one rank
give diffusers' StableDiffusion3Pipeline image; ulysses 2 × ring 2 and tp 2 × cfg 2 give the one-rank images
(each axis alone with -m slow);
a LoRA applied per request gives diffusers' ``load_lora_weights`` image while the same request without it,
in the same batch, is unchanged; an uploaded image with ``strength`` gives StableDiffusion3Img2ImgPipeline's
image (in that batch, through ``ditserve generate --image`` and the openai client's ``images.edit``);
``ditserve serve`` answers the openai client with the image."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import StableDiffusion3Img2ImgPipeline, StableDiffusion3Pipeline
from PIL import Image

from ditserve.replica.caching.settings import CacheSettings
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.sd3 import SD3Runner
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
    sampling_body,
    served,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.families.lora import save_random_lora
from tests.families.sd3 import LARGE_TRANSFORMER, build_folder, build_pipeline
from tests.helpers import png_pixels, psnr

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_LEN = 16  # T5 tokens
# 80×48: 5×3 = 15 image tokens, padded for every 2-way split; one request with CFG, one without.
FOX = GenerationParams(
    prompt="a red fox", negative_prompt="blurry", guidance_scale=4.0, width=80, height=48,
    num_inference_steps=3, seed=3,
)  # fmt: skip
CAT = GenerationParams(
    prompt="a blue cat", guidance_scale=1.0, width=80, height=48, num_inference_steps=2, seed=4
)
FOX_LORA = FOX.model_copy(update={"lora": (LoRARef(name="style"),)})
BATCH = [FOX, CAT, FOX_LORA]  # submitted together: one batch, the same request with and without the LoRA
# Image-to-image: 3 steps at strength 0.5 skip the first (diffusers' get_timesteps), in BATCH's batch.
START = picture(80, 48, 0)
FOX_I2I = GenerationParams(
    prompt="a red fox in the snow", negative_prompt="blurry", guidance_scale=4.0, width=80, height=48,
    num_inference_steps=3, strength=0.5, seed=5, images=(START,),
)  # fmt: skip
TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.2",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_folder(tmp_path_factory.mktemp("sd3") / "stable-diffusion-3.5-tiny")


def diffusers_call(pipe, p: GenerationParams, output_type: str):
    return pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        guidance_scale=p.guidance_scale,
        width=p.width,
        height=p.height,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=MAX_LEN,
        output_type=output_type,
    ).images


def diffusers_image(pipe, p: GenerationParams) -> np.ndarray:
    return to_uint8(diffusers_call(pipe, p, "np"))[0]


@pytest.fixture(scope="module")
def lora_file(folder, tmp_path_factory) -> Path:
    transformer = StableDiffusion3Pipeline.from_pretrained(folder).transformer
    return save_random_lora(
        StableDiffusion3Pipeline, transformer, TARGETS, tmp_path_factory.mktemp("sd3-lora")
    )


@pytest.fixture(scope="module")
def reference(folder, lora_file) -> list[np.ndarray]:
    """diffusers' images for BATCH (the LoRA one through ``load_lora_weights``)."""
    pipe = load_pipeline(StableDiffusion3Pipeline, folder)
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


@pytest.fixture(scope="module")
def pipe(folder):
    return load_pipeline(StableDiffusion3Pipeline, folder)


@pytest.fixture(scope="module")
def img2img_reference(pipe) -> np.ndarray:
    return img2img_image(StableDiffusion3Img2ImgPipeline, pipe, FOX_I2I, max_sequence_length=MAX_LEN)


def test_one_rank_equals_diffusers_with_and_without_lora_in_one_batch(one_rank, reference):
    for ours, ref in zip(one_rank, reference, strict=True):
        assert ours.shape == ref.shape == (48, 80, 3)
        assert psnr(ours, ref) >= 40
    assert psnr(reference[2], reference[0]) < 30  # the adapter changes the image


def test_folder_saved_without_t5_equals_diffusers(tmp_path):
    """A folder saved with ``text_encoder_3=None, tokenizer_3=None`` loads (it failed in ``from_pretrained``)
    and gives the image diffusers' pipeline gives on it: zeros in T5's place, the CLIPs' embeddings."""
    folder = build_folder(tmp_path / "sd3-no-t5", t5=False)
    pipe = load_pipeline(StableDiffusion3Pipeline, folder, text_encoder_3=None, tokenizer_3=None)
    assert pipe.text_encoder_3 is None
    (ours,) = engine_images(folder, {}, [FOX], max_sequence_length=MAX_LEN)
    assert psnr(ours, diffusers_image(pipe, FOX)) >= 40


def test_one_rank_bf16_steps_to_diffusers_latents_bit_for_bit(folder):
    """In bf16 a guided request alone ends on the very latents StableDiffusion3Pipeline gives: the runner
    batches the uncond and cond rows into one forward as the pipeline does (a forward per branch rounds
    differently)."""
    pipe = load_pipeline(StableDiffusion3Pipeline, folder).to(torch.bfloat16)
    want = diffusers_call(pipe, FOX, "latent")
    runner = SD3Runner(pipe, device=torch.device("cpu"), dtype=torch.bfloat16, max_sequence_length=MAX_LEN)
    state = runner.add("fox", FOX)
    while not state.done:
        runner.step([state])
    assert state.latents.dtype == want.dtype == torch.bfloat16
    assert torch.equal(state.latents, want)


def test_prompt_length_is_the_pipelines_default_or_the_flags_up_to_512(folder):
    """T5 encodes 256 tokens, StableDiffusion3Pipeline's default, when --max-sequence-length is left out, and
    the flag's length when given, up to the pipeline's 512 (a flag of 300 gave 256 without a word)."""
    pipe = load_pipeline(StableDiffusion3Pipeline, folder)

    def encoded(flag, expected_t5):
        runner = SD3Runner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=flag)
        ours = runner.encode(FOX)["cond"]["encoder_hidden_states"]
        want, *_ = pipe.encode_prompt(
            prompt=FOX.prompt, prompt_2=None, prompt_3=None, max_sequence_length=expected_t5,
            do_classifier_free_guidance=False, device=torch.device("cpu"),
        )  # fmt: skip
        assert ours.shape == want.shape and torch.allclose(ours, want, atol=1e-4), (ours.shape, want.shape)
        return ours.shape[1]

    clip = encoded(None, 256) - 256  # CLIP's tokens come first
    assert encoded(300, 300) == clip + 300
    assert encoded(1000, 512) == clip + 512


def test_one_rank_image_to_image_equals_diffusers_img2img(one_rank_all, img2img_reference, reference):
    ours = one_rank_all[-1]
    assert ours.shape == img2img_reference.shape == (48, 80, 3)
    assert psnr(ours, img2img_reference) >= 40
    assert psnr(img2img_reference, reference[0]) < 30  # not the text-to-image picture


@pytest.mark.slow  # one rank's engine (default) behind the CLI; the CLI in tests/e2e
def test_cli_generate_equals_diffusers(folder, reference, tmp_path):
    args = [*generate_args(FOX), "--max-sequence-length", str(MAX_LEN)]
    assert psnr(cli_generate(FOX.prompt, folder, tmp_path / "fox.png", *args), reference[0]) >= 40


@pytest.mark.slow  # the image-to-image request runs by default in one rank's engine (above)
def test_cli_generate_image_to_image_equals_diffusers(folder, img2img_reference, tmp_path):
    start = tmp_path / "start.png"
    start.write_bytes(START)
    args = [*generate_args(FOX_I2I), "--image", str(start), "--max-sequence-length", str(MAX_LEN)]
    out = cli_generate(FOX_I2I.prompt, folder, tmp_path / "fox.png", *args)
    assert psnr(out, img2img_reference) >= 40


@pytest.mark.parametrize("flags", LAYOUTS, ids=layout_id)
def test_layouts_equal_one_rank(folder, lora_file, one_rank, flags):
    got = engine_images(folder, flags, BATCH, {"style": lora_file}, max_sequence_length=MAX_LEN)
    for ours, ref in zip(got, one_rank, strict=True):
        assert psnr(ours, ref) >= 40


def edit(client, model: str, p: GenerationParams):
    """``client.images.edit`` with ``p``'s start image, prompt, size and sampling fields (``strength``)."""
    return client.images.edit(
        model=model,
        image=("start.png", p.images[0], "image/png"),
        prompt=p.prompt,
        size=f"{p.width}x{p.height}",
        extra_body=sampling_body(p),
    )


@pytest.fixture(scope="module")
def unsized_reference(pipe) -> np.ndarray:
    """StableDiffusion3Img2ImgPipeline called without height and width on FOX_I2I's 80x48 start image: its
    default size (the transformer's sample_size × the VAE's 8), the image resized to it."""
    i2i = StableDiffusion3Img2ImgPipeline.from_pipe(pipe)
    i2i.set_progress_bar_config(disable=True)
    p = FOX_I2I
    out = i2i(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        guidance_scale=p.guidance_scale,
        image=Image.open(io.BytesIO(START)).convert("RGB"),
        strength=p.strength,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=MAX_LEN,
        output_type="np",
    )
    return to_uint8(out.images)[0]


@pytest.mark.slow  # the CLI's size rule is the server's (edit_request_size, served below); FLUX.1's CLI: test_edit_inpaint
def test_cli_generate_image_to_image_without_a_size_equals_diffusers(folder, unsized_reference, tmp_path):
    """``ditserve generate --image`` without --width/--height draws the img2img pipeline's default size (it
    drew at the image's 80x48)."""
    side = resolve_model(str(folder)).default_size[0]
    assert unsized_reference.shape == (side, side, 3) and side != 80
    start = tmp_path / "start.png"
    start.write_bytes(START)
    args = [*generate_args(FOX_I2I)[4:], "--image", str(start), "--max-sequence-length", str(MAX_LEN)]
    assert "--width" not in args and "--height" not in args
    out = cli_generate(FOX_I2I.prompt, folder, tmp_path / "fox.png", *args)
    assert psnr(out, unsized_reference) >= 40


def test_serve_openai_client(folder, reference, img2img_reference, unsized_reference):
    """images.generate gives the pipeline's image; images.edit (SD3 is no edit model: image-to-image) gives
    the img2img pipeline's, after a strength outside (0, 1] was a 400 naming it. SD3 guides with
    guidance_scale: a true_cfg_scale (accepted and dropped once, the image made as if it were not there) is a
    400 naming it."""
    with served("--model", str(folder), "--max-sequence-length", str(MAX_LEN)) as server:
        client = openai_client(server)
        with pytest.raises(openai.BadRequestError) as true_cfg:
            client.images.generate(
                model=folder.name, prompt=FOX.prompt, size=f"{FOX.width}x{FOX.height}",
                extra_body=sampling_body(FOX) | {"true_cfg_scale": 4.0},
            )  # fmt: skip
        result = client.images.generate(
            model=folder.name,
            prompt=FOX.prompt,
            size=f"{FOX.width}x{FOX.height}",
            extra_body=sampling_body(FOX),
        )
        # Streamed with previews: each partial image shows the latents on their grid (1/8 of the size); SD3's
        # latents are [n, C, h, w], and the previews were 1 pixel high strips (read as packed FLUX latents).
        events = list(
            client.images.generate(
                model=folder.name,
                prompt=FOX.prompt,
                size=f"{FOX.width}x{FOX.height}",
                stream=True,
                partial_images=2,
                extra_body=sampling_body(FOX),
            )
        )
        refused = []
        for strength in (0.0, 1.5):
            with pytest.raises(openai.BadRequestError) as error:
                edit(client, folder.name, FOX_I2I.model_copy(update={"strength": strength}))
            refused.append(error.value)
        edited = edit(client, folder.name, FOX_I2I)
        # A session step takes the same guidance fields: true_cfg_scale refused naming it, the session
        # usable after it, its first step the pipeline's image (negative prompt under guidance_scale).
        size = {"size": f"{FOX.width}x{FOX.height}"}
        sid = httpx.post(f"{server.base_url}/v1/sessions", json=size, timeout=60).json()["id"]
        step = {"prompt": FOX.prompt, **sampling_body(FOX)}
        url = f"{server.base_url}/v1/sessions/{sid}/generate"
        session_true_cfg = httpx.post(url, json=step | {"true_cfg_scale": 4.0}, timeout=120)
        session_step = httpx.post(url, json=step, timeout=120)
        unsized = client.images.edit(
            model=folder.name,
            image=("start.png", START, "image/png"),
            prompt=FOX_I2I.prompt,
            extra_body=sampling_body(FOX_I2I),
        )
    assert (true_cfg.value.status_code, true_cfg.value.param) == (400, "true_cfg_scale")
    message = true_cfg.value.body["message"]
    assert message.startswith("true_cfg_scale: ") and "guidance_scale" in message, message
    assert psnr(b64_pixels(result), reference[0]) >= 40
    partial = [png_pixels(base64.b64decode(e.b64_json)) for e in events if e.type.endswith("partial_image")]
    assert [p.shape for p in partial] == [(FOX.height // 8, FOX.width // 8, 3)] * 2
    assert all(p.std() > 0 for p in partial)  # the latents' picture, not one grey level
    assert events[-1].type.endswith("completed")
    assert psnr(png_pixels(base64.b64decode(events[-1].b64_json)), reference[0]) >= 40
    assert [(e.status_code, e.param) for e in refused] == [(400, "strength")] * 2
    assert all(e.body["message"].startswith("strength: ") for e in refused), [e.body for e in refused]
    assert psnr(b64_pixels(edited), img2img_reference) >= 40
    assert session_true_cfg.status_code == 400, session_true_cfg.text
    assert session_true_cfg.json()["error"]["message"] == message
    assert session_step.status_code == 200 and session_step.json()["step"] == 1, session_step.text
    assert psnr(png_pixels(base64.b64decode(session_step.json()["data"][0]["b64_json"])), reference[0]) >= 40
    # without a size: the img2img pipeline's default size, not the image's 80x48
    side = unsized_reference.shape[0]
    assert unsized.size == f"{side}x{side}"
    assert psnr(b64_pixels(unsized), unsized_reference) >= 40


def test_step_cache_skips_blocks_of_its_request_only(pipe, reference):
    """fbcache over the transformer's blocks: the cached request reuses its kept residual at every step after
    the first (both CFG branches); the uncached request beside it still gives diffusers' image."""
    runner = SD3Runner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=MAX_LEN)
    cached = FOX.model_copy(update={"cache": CacheSettings(policy="fbcache", threshold=10.0)})
    states = [runner.add("plain", FOX), runner.add("cached", cached)]
    while not all(s.done for s in states):
        runner.step(states)
    plain, ours = (runner.decode(s)[0] for s in states)
    assert psnr(plain, reference[0]) >= 40
    assert {branch: (c.forwards, c.cached) for branch, c in states[1].extra["cache"].items()} == {
        "cond": (3, 2),
        "uncond": (3, 2),
    }
    assert ours.shape == plain.shape


def test_real_pipeline_has_the_public_transformer():
    """The benchmark's pipeline (built on the meta device here: no memory) has the public transformer."""
    real = build_pipeline("real", torch.bfloat16, "meta")
    assert real.transformer.config.num_attention_heads == LARGE_TRANSFORMER["num_attention_heads"] == 38
    assert f"{sum(p.numel() for p in real.transformer.parameters()) / 1e9:.1f}" == "8.1"
