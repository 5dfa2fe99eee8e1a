"""Edit models that inpaint: a FLUX.1 Kontext folder and a Qwen-Image-Edit folder take a ``mask`` with their
image on POST /v1/images/edits (the official openai client), gRPC's EditImageStream and ``ditserve generate
--image --mask``, and draw what diffusers' FluxKontextInpaintPipeline and QwenImageEditInpaintPipeline draw
at the same seed, steps and (their default) strength, through the engine's own step loop; a mask of another
shape is a 400 naming mask (FLUX.2 Klein's, as Flux2KleinInpaintPipeline: test_flux2). The edit models
diffusers has no inpaint pipeline for (Qwen-Image-Edit Plus; FLUX.2 dev, in test_flux2) refuse a mask
naming it."""

from __future__ import annotations

import base64
import io

import grpc
import numpy as np
import pytest
import torch
from diffusers import (
    FluxImg2ImgPipeline,
    FluxKontextInpaintPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    QwenImageEditInpaintPipeline,
    QwenImageEditPipeline,
)
from openai import BadRequestError
from PIL import Image, ImageDraw

from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc
from ditserve.replica.config import EngineConfig
from ditserve.replica.engine import Engine
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.flux import FluxRunner
from ditserve.replica.pipelines.qwenimage import QwenImageRunner
from ditserve.replica.request import GenerationParams
from tests.families import flux_kontext, qwenimage
from tests.families.harness import (
    b64_pixels,
    cli_generate,
    engine_images,
    load_pipeline,
    openai_client,
    run_runner,
    served,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.helpers import png_pixels, psnr

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = "make the circle green"
STEPS = 4


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def scene(width: int, height: int) -> Image.Image:
    image = Image.new("RGB", (width, height), (30, 60, 210))
    ImageDraw.Draw(image).ellipse((8, 8, width // 2 + 8, height - 8), fill=(220, 30, 30))
    return image


def masks(width: int, height: int) -> tuple[Image.Image, Image.Image]:
    """The left half repainted: OpenAI's mask (transparent repaints) and diffusers' (white repaints)."""
    openai_mask = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    ImageDraw.Draw(openai_mask).rectangle((0, 0, width // 2 - 1, height - 1), fill=(0, 0, 0, 0))
    white = Image.new("L", (width, height), 0)
    ImageDraw.Draw(white).rectangle((0, 0, width // 2 - 1, height - 1), fill=255)
    return openai_mask, white


def check_served(server, folder, image, openai_mask, expected, sampling: dict, tmp_path) -> None:
    """What a user sees: the openai client's two images, gRPC's streamed one and ``ditserve generate``'s
    equal the inpaint pipeline's; the same edit without the mask is another picture; a mask of another
    shape is a 400 naming mask."""
    width, height = image.size
    client = openai_client(server)
    asked = {"model": folder.name, "image": ("in.png", png(image), "image/png"), "prompt": PROMPT}
    asked["size"] = f"{width}x{height}"
    extra = {"seed": 7, "num_inference_steps": STEPS, **sampling}
    result = client.images.edit(
        **asked, mask=("mask.png", png(openai_mask), "image/png"), n=2, extra_body=extra
    )
    ours = [png_pixels(base64.b64decode(d.b64_json)) for d in result.data]
    for i, want in enumerate(expected):
        assert ours[i].shape == want.shape == (height, width, 3)
        assert psnr(ours[i], want) >= 40, i
    unmasked = client.images.edit(**asked, extra_body={k: v for k, v in extra.items() if k != "strength"})
    assert psnr(b64_pixels(unmasked), expected[0]) < 35  # the mask is applied

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.DitServeStub(channel)
        request = pb.EditImageRequest(
            image=[png(image)], mask=png(openai_mask), prompt=PROMPT, size=asked["size"], **extra
        )
        events = list(stub.EditImageStream(request, timeout=120))
    steps = [e.progress.step for e in events if e.HasField("progress")]
    assert steps and steps == sorted(steps) and steps[-1] == events[0].progress.total
    assert psnr(png_pixels(events[-1].result.images[0]), expected[0]) >= 40

    with pytest.raises(BadRequestError) as info:
        square = openai_mask.resize((height, height))
        client.images.edit(**asked, mask=("m.png", png(square), "image/png"), extra_body=extra)
    assert info.value.status_code == 400 and info.value.body["param"] == "mask"
    assert f"{height}x{height} is not the shape of the image ({width}x{height})" in info.value.body["message"]

    (tmp_path / "in.png").write_bytes(png(image))
    (tmp_path / "mask.png").write_bytes(png(openai_mask))
    flags = ["--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "mask.png")]
    flags += [
        "--width",
        str(width),
        "--height",
        str(height),
        "--seed",
        "7",
        "--num-inference-steps",
        str(STEPS),
    ]
    for key, value in sampling.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    assert psnr(cli_generate(PROMPT, folder, tmp_path / "out.png", *flags), expected[0]) >= 40


# -- FLUX.1 Kontext -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kontext_folder(tmp_path_factory):
    return flux_kontext.build_folder(tmp_path_factory.mktemp("models") / "flux-kontext-tiny")


def test_kontext_mask_inpaints_as_flux_kontext_inpaint_pipeline(kontext_folder, tmp_path):
    """FluxKontextInpaintPipeline at its default strength (1.0) on an image of the output size, which it
    then keeps as is (``_auto_resize=False``; by default it resizes to a Kontext resolution of ~1024²).
    The same server's edit without a size: ``check_unsized_kontext_edit``."""
    image = scene(64, 48)
    openai_mask, white = masks(64, 48)
    pipe = FluxKontextInpaintPipeline(**load_pipeline(FluxKontextPipeline, kontext_folder).components)
    pipe.set_progress_bar_config(disable=True)
    expected = to_uint8(
        pipe(
            image=image,
            mask_image=white,
            prompt=PROMPT,
            num_inference_steps=STEPS,
            num_images_per_prompt=2,
            generator=torch.Generator("cpu").manual_seed(7),
            max_sequence_length=min(512, pipe.tokenizer_2.model_max_length),
            output_type="np",
            _auto_resize=False,
        ).images
    )
    with served("--model", str(kontext_folder)) as server:
        check_served(server, kontext_folder, image, openai_mask, expected, {}, tmp_path)
        check_unsized_kontext_edit(server, kontext_folder, tmp_path)


def without_size(pipe_cls, folder, image: Image.Image, steps: int = 1, **settings) -> np.ndarray:
    """diffusers' ``pipe_cls`` on ``folder`` called with ``image`` and no height or width (seed 7)."""
    pipe = load_pipeline(pipe_cls, folder)
    out = pipe(
        image=image,
        prompt=PROMPT,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(7),
        max_sequence_length=min(512, pipe.tokenizer_2.model_max_length),
        output_type="np",
        **settings,
    )
    return to_uint8(out.images)[0]


def check_unsized_kontext_edit(server, kontext_folder, tmp_path) -> None:
    """An edit that names no size gets what FluxKontextPipeline draws without height and width: 1024×1024
    (its default square at its max_area) whatever the reference's size, the reference going in at the Kontext
    resolution of its aspect; by the openai client and ``ditserve generate --image``. Both drew at the
    uploaded image's size (80x48)."""
    image = scene(80, 48)
    expected = without_size(FluxKontextPipeline, kontext_folder, image)
    assert expected.shape == (1024, 1024, 3)
    client = openai_client(server)
    edited = client.images.edit(
        model=kontext_folder.name,
        image=("wide.png", png(image), "image/png"),
        prompt=PROMPT,
        extra_body={"seed": 7, "num_inference_steps": 1},
    )
    assert edited.size == "1024x1024"
    assert psnr(b64_pixels(edited), expected) >= 40
    (tmp_path / "wide.png").write_bytes(png(image))
    flags = ["--image", str(tmp_path / "wide.png"), "--seed", "7", "--num-inference-steps", "1"]
    assert psnr(cli_generate(PROMPT, kontext_folder, tmp_path / "unsized.png", *flags), expected) >= 40


def test_flux_image_to_image_without_a_size_draws_as_flux_img2img_pipeline(kontext_folder, tmp_path):
    """FLUX.1 (a FluxPipeline folder) image-to-image without a size draws what FluxImg2ImgPipeline draws
    without height and width: its default 1024×1024, the start image resized to it (``ditserve generate
    --image`` at the pipeline's default strength 0.6 and guidance 7.0; the server sizes it alike,
    ``edit_request_size``). It drew at the image's size (80x48), and at FluxPipeline's guidance 3.5."""
    folder = tmp_path / "flux-tiny"
    FluxPipeline(**load_pipeline(FluxKontextPipeline, kontext_folder).components).save_pretrained(folder)
    image = scene(80, 48)
    expected = without_size(FluxImg2ImgPipeline, folder, image, steps=2)
    assert expected.shape == (1024, 1024, 3)
    assert resolve_model(str(folder)).edit_request_size([(80, 48)], masked=False) == (1024, 1024)
    (tmp_path / "wide.png").write_bytes(png(image))
    flags = ["--image", str(tmp_path / "wide.png"), "--seed", "7", "--num-inference-steps", "2"]
    assert psnr(cli_generate(PROMPT, folder, tmp_path / "out.png", *flags), expected) >= 40


def test_masked_and_unmasked_kontext_edits_of_one_image_share_the_engine(kontext_folder):
    """A masked edit's reference is its image at the output size, an unmasked one's the image at a Kontext
    resolution: requests of the same image, with and without a mask, sent together, each get their own
    image (ulysses 2: the reference tokens sharded with the generated ones), as one rank draws each alone.
    They were put in one batch, whose step failed (rows of two sequence lengths)."""
    image = png(scene(64, 48))
    masked = GenerationParams(
        prompt=PROMPT, width=64, height=48, num_inference_steps=2, seed=7, strength=0.8, images=(image,),
        mask=png(masks(64, 48)[0]),
    )  # fmt: skip
    requests = [
        masked,
        masked.model_copy(update={"mask": None, "seed": 8}),
        masked.model_copy(update={"seed": 9}),
    ]
    runner = FluxRunner(
        load_pipeline(FluxKontextPipeline, kontext_folder),
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_sequence_length=512,
    )
    alone = [run_runner(runner, [p])[0] for p in requests]
    together = engine_images(kontext_folder, {"ulysses_degree": 2}, requests)
    for i, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert psnr(got, want) >= 40, i


# -- Qwen-Image-Edit ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_edit_folder(tmp_path_factory):
    return qwenimage.build_folder(tmp_path_factory.mktemp("models") / "qwen-image-edit-tiny", edit=True)


def test_qwen_image_edit_mask_inpaints_as_its_inpaint_pipeline(qwen_edit_folder, tmp_path, monkeypatch):
    """QwenImageEditInpaintPipeline at its default strength (0.6), true CFG with a negative prompt. The
    pipeline always draws at about 1024² (the size a request without one gets: ``edit_request_size``); here
    its target area is the image's, the size the request asks for (96x64, a multiple of 32)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint as edit_inpaint

    image = scene(96, 64)
    openai_mask, white = masks(96, 64)
    spec = resolve_model(str(qwen_edit_folder))
    w, h, _ = edit_inpaint.calculate_dimensions(1024 * 1024, 96 / 64)
    assert spec.edit_request_size([(96, 64)], masked=True) == (w // 32 * 32, h // 32 * 32)

    calculate = edit_inpaint.calculate_dimensions
    monkeypatch.setattr(edit_inpaint, "calculate_dimensions", lambda area, ratio: calculate(96 * 64, ratio))
    edit = load_pipeline(
        QwenImageEditPipeline, qwen_edit_folder, **QwenImageRunner.pipeline_components(qwen_edit_folder)
    )
    pipe = QwenImageEditInpaintPipeline(**edit.components)
    pipe.set_progress_bar_config(disable=True)
    sampling = {"negative_prompt": "dark", "true_cfg_scale": 2.5}
    expected = to_uint8(
        pipe(
            image=image,
            mask_image=white,
            prompt=PROMPT,
            num_inference_steps=STEPS,
            num_images_per_prompt=2,
            generator=torch.Generator("cpu").manual_seed(7),
            max_sequence_length=512,
            output_type="np",
            **sampling,
        ).images
    )
    with served("--model", str(qwen_edit_folder)) as server:
        check_served(server, qwen_edit_folder, image, openai_mask, expected, sampling, tmp_path)


def test_qwen_image_edit_plus_refuses_a_mask(tmp_path):
    """diffusers has no inpaint pipeline for Qwen-Image-Edit Plus (2509/2511): its mask is bad input naming
    mask, not ignored."""
    folder = qwenimage.build_folder(tmp_path / "qwen-image-edit-plus-tiny", edit="plus")
    masked = GenerationParams(
        prompt=PROMPT, width=96, height=64, images=(png(scene(96, 64)),), mask=png(masks(96, 64)[1])
    )
    with pytest.raises(ValueError, match=r"^mask: .*QwenImageEditPlusPipeline.* does not inpaint"):
        Engine(EngineConfig(model=str(folder))).check(masked)
