"""POST /v1/images/edits and gRPC EditImage as a user runs them against one real ``ditserve serve --model
demo-scenes`` (a FLUX.1 folder: image-to-image), and FLUX.1 Kontext folders (reference images) on the
engine at one rank and at Ulysses 2, each against the diffusers pipeline run in this process."""

from __future__ import annotations

import base64
import io

import grpc
import httpx
import numpy as np
import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline
from openai import BadRequestError, OpenAI
from PIL import Image, ImageDraw

from ditserve.cluster.client import Client
from ditserve.cluster.grpc_gen import ditserve_pb2 as pb
from ditserve.cluster.grpc_gen import ditserve_pb2_grpc as pb_grpc
from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.flux import FluxRunner
from ditserve.replica.request import GenerationParams
from tests.e2e.test_generate_cli import generate
from tests.families.flux_kontext import build_folder
from tests.helpers import ServeProcess, png_pixels, psnr

MAX_IMAGE_BYTES = 40_000
MAX_IMAGE_PIXELS = 256 * 256


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def scene(size: tuple[int, int] = (64, 64)) -> Image.Image:
    """A red circle on a blue background (a demo-scenes caption's picture)."""
    image = Image.new("RGB", size, (30, 60, 210))
    ImageDraw.Draw(image).ellipse((12, 16, 44, 48), fill=(220, 30, 30))
    return image


SOURCE = png(scene())
NOISE = png(Image.fromarray(np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8)))
HUGE = png(Image.new("RGB", (512, 300), (0, 0, 0)))  # few bytes, too many pixels


@pytest.fixture(scope="module")
def server():
    proc = ServeProcess(
        "--model", "demo-scenes", "--max-n", "2", "--max-width", "128", "--max-height", "128",
        "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-image-pixels", str(MAX_IMAGE_PIXELS),
        "--cache-policy", "none",  # compared with diffusers' image: demo-scenes' recommended step cache off
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        yield pb_grpc.DitServeStub(channel)


# -- FLUX.1: image-to-image -----------------------------------------------------------------------------
def test_openai_edit_is_diffusers_img2img(server):
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    settings = {"seed": 7, "num_inference_steps": 4, "strength": 0.6, "guidance_scale": 3.5}
    cfg = {"negative_prompt": "", "true_cfg_scale": 3.0}  # demo-scenes' recommended sampling, given here
    result = client.images.edit(
        model="demo-scenes",
        image=("scene.png", SOURCE, "image/png"),
        prompt="a red square on a green background",
        size="64x64",
        n=2,
        response_format="b64_json",
        extra_body=settings | cfg,
    )
    ours = [png_pixels(base64.b64decode(d.b64_json)) for d in result.data]

    spec = resolve_model("demo-scenes")
    pipe = FluxImg2ImgPipeline.from_pretrained(spec.path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(
        image=Image.open(io.BytesIO(SOURCE)).convert("RGB"),
        prompt="a red square on a green background",
        height=64,
        width=64,
        num_images_per_prompt=2,
        generator=torch.Generator("cpu").manual_seed(settings["seed"]),
        num_inference_steps=settings["num_inference_steps"],
        strength=settings["strength"],
        guidance_scale=settings["guidance_scale"],
        max_sequence_length=min(512, pipe.tokenizer_2.model_max_length),
        output_type="np",
        **cfg,
    ).images
    for i, ref in enumerate(to_uint8(reference)):
        assert ours[i].shape == ref.shape == (64, 64, 3)
        assert psnr(ours[i], ref) >= 40, f"image {i}"


def test_openai_mask_inpaints_as_diffusers(server, stub, tmp_path):
    """A mask with the image-to-image start image inpaints as FluxInpaintPipeline: OpenAI's mask (the
    transparent pixels are repainted) and diffusers' (white repaints) of half the image's size give the
    same image, as gRPC's EditImage and ``ditserve generate --mask`` do; a mask of another shape is a 400
    naming mask (generate: an error naming --mask)."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    start = scene((64, 48))
    openai_mask = Image.new("RGBA", (64, 48), (0, 0, 0, 255))
    ImageDraw.Draw(openai_mask).rectangle((0, 0, 31, 47), fill=(0, 0, 0, 0))  # repaint the left half
    white = Image.new("L", (64, 48), 0)
    ImageDraw.Draw(white).rectangle((0, 0, 31, 47), fill=255)
    settings = {"seed": 7, "num_inference_steps": 4, "strength": 0.8}
    asked = {"image": ("scene.png", png(start), "image/png"), "prompt": "a red square on a green background"}
    results = [
        client.images.edit(**asked, mask=("mask.png", png(mask), "image/png"), n=2, extra_body=settings)
        for mask in (openai_mask, white.resize((32, 24)))
    ]
    assert results[0].size == "64x48"
    ours = [[png_pixels(base64.b64decode(d.b64_json)) for d in r.data] for r in results]

    spec = resolve_model("demo-scenes")
    pipe = FluxInpaintPipeline.from_pretrained(spec.path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(
        image=start,
        mask_image=white,
        prompt=asked["prompt"],
        height=48,
        width=64,
        num_images_per_prompt=2,
        generator=torch.Generator("cpu").manual_seed(settings["seed"]),
        num_inference_steps=settings["num_inference_steps"],
        strength=settings["strength"],
        max_sequence_length=min(512, pipe.tokenizer_2.model_max_length),
        output_type="np",
        negative_prompt="",  # demo-scenes' recommended sampling, the server's default for it
        true_cfg_scale=3.0,
    ).images
    for i, ref in enumerate(to_uint8(reference)):
        for mask, images in zip(("openai", "diffusers"), ours, strict=True):
            assert psnr(images[i], ref) >= 40, (mask, i)
    unmasked = client.images.edit(**asked, extra_body=settings)  # image-to-image: the right half redrawn too
    assert psnr(png_pixels(base64.b64decode(unmasked.data[0].b64_json)), ours[0][0]) < 30
    grpc_reply = stub.EditImage(
        pb.EditImageRequest(image=[png(start)], mask=png(openai_mask), prompt=asked["prompt"], **settings),
        timeout=120,
    )
    assert psnr(png_pixels(grpc_reply.images[0]), ours[0][0]) >= 40
    files = {"start.png": png(start), "mask.png": png(openai_mask), "square.png": png(white.resize((48, 48)))}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    flags = ["--model", "demo-scenes", "--image", str(tmp_path / "start.png"), "--seed", "7"]
    flags += ["--num-inference-steps", "4", "--strength", "0.8", "--cache-policy", "none"]
    done = generate(
        asked["prompt"], *flags, "--mask", str(tmp_path / "mask.png"), "-o", str(tmp_path / "o.png")
    )
    assert done.returncode == 0, done.stderr
    assert psnr(png_pixels((tmp_path / "o.png").read_bytes()), ours[0][0]) >= 40
    done = generate(
        asked["prompt"], *flags, "--mask", str(tmp_path / "square.png"), "-o", str(tmp_path / "x.png")
    )
    assert done.returncode != 0 and "--mask" in done.stderr and "48x48 is not the shape" in done.stderr
    with pytest.raises(BadRequestError) as info:
        client.images.edit(
            **asked, mask=("m.png", png(white.resize((48, 48))), "image/png"), extra_body=settings
        )
    assert info.value.body["param"] == "mask" and "48x48 is not the shape of the image (64x48)" in str(
        info.value.body["message"]
    )


def test_mask_files_read_as_one_mask():
    """One mask in the files a user may send: OpenAI's (transparent = repaint) as RGBA, LA, a palette with a
    transparent entry or a lossless WebP; diffusers' (white = repaint) as 8- or 16-bit greyscale, a JPEG
    (also one stored turned a quarter with its EXIF orientation), a fully opaque RGBA, or at half size."""
    from ditserve.replica.pipelines.img2img import latent_mask

    openai_mask = Image.new("RGBA", (64, 48), (255, 255, 255, 255))
    ImageDraw.Draw(openai_mask).rectangle((0, 0, 31, 47), fill=(0, 0, 0, 0))
    white = Image.new("L", (64, 48), 0)
    ImageDraw.Draw(white).rectangle((0, 0, 31, 47), fill=255)

    def encoded(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format=fmt, **kw)
        return buf.getvalue()

    exif = Image.Exif()
    exif[0x0112] = 6  # stored 48x64, shown 64x48
    files = {
        "rgba": encoded(openai_mask),
        "la": encoded(openai_mask.convert("LA")),
        "palette": encoded(openai_mask.quantize()),
        "webp": encoded(openai_mask, "WEBP", lossless=True),
        "grey": encoded(white),
        "grey 16-bit": encoded(Image.fromarray(np.asarray(white).astype(np.uint16) * 257)),
        "jpeg": encoded(white, "JPEG"),
        "jpeg turned": encoded(white.transpose(Image.Transpose.ROTATE_90), "JPEG", exif=exif.tobytes()),
        "opaque rgba": encoded(white.convert("RGBA")),
        "half size": encoded(white.resize((32, 24))),
    }
    want = torch.zeros(1, 1, 6, 8)
    want[..., :4] = 1  # the left half repainted
    for name, data in files.items():
        params = GenerationParams(prompt="a", width=64, height=48, images=(SOURCE,), mask=data)
        assert torch.equal(latent_mask(params, 6, 8), want), name


def _sd3_16_channels():
    """The tiny SD3 pipeline with SD3's 16 latent channels (StableDiffusion3InpaintPipeline takes no other)."""
    from tests.families import sd3

    tiny = sd3.TINY_TRANSFORMER
    sd3.TINY_TRANSFORMER = {**tiny, "in_channels": 16, "out_channels": 16}
    try:
        return sd3.build_pipeline()
    finally:
        sd3.TINY_TRANSFORMER = tiny


def _zimage():
    from tests.families import zimage

    return zimage.build_pipeline()


def _qwenimage():
    from tests.families import qwenimage

    return qwenimage.build_pipeline()


@pytest.mark.parametrize(
    "family, build, runner_path, inpaint_class, settings",
    [
        ("sd3", _sd3_16_channels, "sd3:SD3Runner", "StableDiffusion3InpaintPipeline", {"max_sequence_length": 16}),
        ("zimage", _zimage, "zimage:ZImageRunner", "ZImageInpaintPipeline", {"max_sequence_length": 64}),
        (
            "qwenimage", _qwenimage, "qwenimage:QwenImageRunner", "QwenImageInpaintPipeline",
            {"max_sequence_length": 512, "negative_prompt": "blurry", "true_cfg_scale": 3.0},
        ),
    ],
)  # fmt: skip
def test_inpainting_families_are_their_inpaint_pipelines(family, build, runner_path, inpaint_class, settings):
    """SD3, Z-Image and Qwen-Image inpaint a masked start image as their diffusers inpaint pipelines (the
    denoised latents; SD3's pipeline decodes without the VAE's shift_factor, which its others add), two
    outputs of one request; without the mask it is image-to-image, another image."""
    import importlib

    import diffusers

    pipe = build()
    module, name = runner_path.split(":")
    runner_class = getattr(importlib.import_module(f"ditserve.replica.pipelines.{module}"), name)
    length = settings["max_sequence_length"]
    runner = runner_class(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=length)
    start = scene((64, 32))  # a multiple of every family's size multiple
    mask = Image.new("L", (64, 32), 0)
    ImageDraw.Draw(mask).rectangle((0, 0, 31, 31), fill=255)
    sampling = {k: v for k, v in settings.items() if k != "max_sequence_length"}
    params = GenerationParams(
        prompt="a red square", width=64, height=32, num_inference_steps=4, seed=7, strength=0.8, n=2,
        images=(png(start),), mask=png(mask), **sampling,
    )  # fmt: skip

    def run(p: GenerationParams) -> np.ndarray:
        state = runner.add("a", p)
        while not state.done:
            runner.step([state])
        return runner.decode(state)

    ours = run(params)
    inpaint = getattr(diffusers, inpaint_class)(**pipe.components)
    inpaint.set_progress_bar_config(disable=True)
    latents = inpaint(
        image=start, mask_image=mask, prompt=params.prompt, height=32, width=64, strength=0.8,
        num_inference_steps=4, num_images_per_prompt=2, generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent", **settings,
    ).images  # fmt: skip
    state = runner.add("b", params.model_copy(update={"mask": None}))
    state.latents = latents.to(state.latents.dtype)  # the pipeline's last latents, decoded as ours are
    reference = runner.decode(state)
    for i in range(2):
        assert ours[i].shape == reference[i].shape == (32, 64, 3)
        assert psnr(ours[i], reference[i]) >= 40, (family, i)
    assert psnr(run(params.model_copy(update={"mask": None}))[0], ours[0]) < 35


def test_openai_edit_output_formats(server):
    """jpeg and webp as asked (the PNG's pixels, lossy), OpenAI's harmless fields accepted."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    asked = {
        "image": ("scene.png", SOURCE, "image/png"),
        "prompt": "a red square on a green background",
        "extra_body": {"seed": 7, "num_inference_steps": 2},
    }
    reference = client.images.edit(**asked)
    assert reference.output_format == "png" and reference.size == "64x64" and reference.background == "opaque"
    pixels = png_pixels(base64.b64decode(reference.data[0].b64_json))
    sizes = {}
    for output_format, pil_format in (("jpeg", "JPEG"), ("webp", "WEBP")):
        result = client.images.edit(
            **asked,
            output_format=output_format,
            output_compression=90,
            quality="high",
            background="opaque",
            input_fidelity="low",
            user="u-1",
            safety_identifier="s-1",
        )
        assert result.output_format == output_format
        data = base64.b64decode(result.data[0].b64_json)
        assert Image.open(io.BytesIO(data)).format == pil_format
        assert psnr(png_pixels(data), pixels) >= 25, output_format
        sizes[output_format] = len(data)
    small = client.images.edit(**asked, output_format="jpeg", output_compression=5)
    assert len(base64.b64decode(small.data[0].b64_json)) < sizes["jpeg"]


def test_openai_generate_output_formats(server):
    """POST /v1/images/generations takes the same output formats; a stream is png only."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    asked = {"prompt": "a red circle", "size": "64x48", "extra_body": {"seed": 2, "num_inference_steps": 2}}
    pixels = png_pixels(base64.b64decode(client.images.generate(**asked).data[0].b64_json))
    result = client.images.generate(**asked, output_format="webp", quality="high", moderation="low")
    data = base64.b64decode(result.data[0].b64_json)
    assert result.output_format == "webp" and Image.open(io.BytesIO(data)).format == "WEBP"
    assert result.background == "opaque"
    assert psnr(png_pixels(data), pixels) >= 25
    for bad, param in (
        ({"output_format": "gif"}, "output_format"),
        ({"output_compression": 101}, "output_compression"),
        ({"background": "transparent"}, "background"),
        ({"output_format": "jpeg", "stream": True}, "output_format"),
    ):
        r = httpx.post(f"{server.base_url}/v1/images/generations", json={"prompt": "a", **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_a_session_step_draws_with_the_models_recommended_guidance(server):
    """demo-scenes recommends true CFG 3.0 against the negative prompt "" (its ditserve.json): a session's
    first step draws what images.generate draws with the same seed and steps, both guided (two forwards a
    step). Sessions ignored the recommendation and drew another, unguided image."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    settings = {"seed": 3, "num_inference_steps": 3}
    image = client.images.generate(prompt="a red circle", size="64x64", extra_body=settings)
    sid = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}, timeout=60).json()["id"]
    try:
        url = f"{server.base_url}/v1/sessions/{sid}/generate"
        step = httpx.post(url, json={"prompt": "a red circle", **settings}, timeout=120)
    finally:
        httpx.delete(f"{server.base_url}/v1/sessions/{sid}", timeout=60)
    assert step.status_code == 200, step.text
    assert image.usage.transformer_forwards == 6
    assert step.json()["usage"]["transformer_forwards"] == 6
    expected = png_pixels(base64.b64decode(image.data[0].b64_json))
    assert (png_pixels(base64.b64decode(step.json()["data"][0]["b64_json"])) == expected).all()


def test_uploads_are_read_as_shown(server):
    """A JPEG whose EXIF turns it a quarter is edited upright (its shown size, not its stored one); a 16-bit
    greyscale PNG is the same picture as its 8-bit twin (not clipped to white)."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    asked = {"prompt": "a red circle", "extra_body": {"seed": 3, "num_inference_steps": 2, "strength": 0.2}}
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 64x48, shown 48x64
    buf = io.BytesIO()
    scene((64, 48)).save(buf, format="JPEG", exif=exif.tobytes())
    turned = client.images.edit(image=("turned.jpg", buf.getvalue(), "image/jpeg"), **asked)
    assert turned.size == "48x64"
    assert png_pixels(base64.b64decode(turned.data[0].b64_json)).shape == (64, 48, 3)

    grey = np.array(scene().convert("L"))
    deep = png(Image.fromarray(grey.astype(np.uint16) * 257))
    assert Image.open(io.BytesIO(deep)).mode.startswith("I")  # 16 bits a pixel
    results = [
        client.images.edit(image=("g.png", data, "image/png"), **asked)
        for data in (png(Image.fromarray(grey)), deep)
    ]
    eight, sixteen = (png_pixels(base64.b64decode(r.data[0].b64_json)) for r in results)
    assert psnr(sixteen, eight) >= 40


def test_a_multi_picture_jpeg_is_its_first_picture(server):
    """A JPEG that carries a second picture after the first (Pillow reads it as MPO: a camera's
    multi-picture file, a phone's HDR photo with its gain map) is a JPEG: edited as its first picture, as the
    plain JPEG of that picture is (it was refused as "MPO images are not taken; send PNG, JPEG or WebP")."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    asked = {"prompt": "a red circle", "extra_body": {"seed": 3, "num_inference_steps": 2, "strength": 0.2}}
    plain, multi = io.BytesIO(), io.BytesIO()
    scene().save(plain, format="JPEG")
    scene().save(multi, format="MPO", save_all=True, append_images=[Image.new("RGB", (32, 32))])
    assert Image.open(io.BytesIO(multi.getvalue())).format == "MPO"
    results = [
        client.images.edit(image=("photo.jpg", buf.getvalue(), "image/jpeg"), **asked)
        for buf in (plain, multi)
    ]
    assert results[1].size == "64x64"
    first, ours = (png_pixels(base64.b64decode(r.data[0].b64_json)) for r in results)
    assert psnr(ours, first) >= 40


def test_openai_client_mappings_in_extra_body(server):
    """A cache or lora mapping in extra_body (the client sends it as cache[policy], lora[name] fields) is
    read as the mapping, and the usage it reports is read by the client's model; a list of adapters is asked
    as JSON text; a picture too narrow for the server's size says its own size."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    asked = {"image": ("scene.png", SOURCE, "image/png"), "prompt": "a red circle"}
    steps = {"seed": 1, "num_inference_steps": 2}
    cached = client.images.edit(
        **asked, extra_body={**steps, "cache": {"policy": "fbcache", "threshold": 0.1}}
    )
    assert cached.usage.cache_policy == "fbcache"
    # the prompt's demo tokens as demo-scenes reads it ("a red circle on a black background": 7); the input
    # image is not counted as tokens, nothing is generated as tokens
    usage = cached.usage
    assert (usage.input_tokens_details.text_tokens, usage.input_tokens_details.image_tokens) == (7, 0)
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (7, 0, 7)
    with pytest.raises(BadRequestError) as info:
        client.images.edit(**asked, extra_body={**steps, "lora": {"name": "style", "scale": 0.5}})
    assert info.value.body["param"] == "lora" and "'style' is not loaded" in info.value.body["message"]
    # A list of adapters has no form shape: one item or several (lora[][name] sent twice, which was refused
    # as the field "lora[][name]" given more than once), JSON text is asked for.
    for adapters in ([{"name": "style"}], [{"name": "style"}, {"name": "ink", "scale": 0.5}]):
        with pytest.raises(BadRequestError) as info:
            client.images.edit(**asked, extra_body={**steps, "lora": adapters})
        assert info.value.body["param"] == "lora", adapters
        assert "send it as JSON text in lora" in info.value.body["message"], adapters
    narrow = png(scene((512, 16)))
    with pytest.raises(BadRequestError) as info:
        client.images.edit(image=("narrow.png", narrow, "image/png"), prompt="a", extra_body=steps)
    assert info.value.body["param"] == "size" and "(512x16)" in info.value.body["message"]


def test_an_image_larger_than_the_maximum_is_scaled_down_alike(server, tmp_path):
    """Without a size, an image above the maximum width is edited at its aspect scaled down to fit, by the
    server and by ``ditserve generate`` with the same limits (generate refused it: '512x384 is above the
    maximum 128x128', the size it had not asked for)."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    large = png(scene((256, 192)))
    steps = {"seed": 1, "num_inference_steps": 1}
    served = client.images.edit(
        image=("large.png", large, "image/png"), prompt="a red circle", extra_body=steps
    )
    assert served.size == "128x96"
    (tmp_path / "large.png").write_bytes(large)
    done = generate(
        "a red circle", "--model", "demo-scenes", "--image", str(tmp_path / "large.png"), "--seed", "1",
        "--num-inference-steps", "1", "--max-width", "128", "--max-height", "128", "-o", str(tmp_path / "o.png"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert png_pixels((tmp_path / "o.png").read_bytes()).shape == (96, 128, 3)


def test_openai_client_streams_an_edit(server):
    """stream=True on an edit: image_edit.progress per step, partial_images previews (b64_json), then
    image_edit.completed with the image the same edit answers unstreamed; a stream is png only."""
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    asked = {"image": ("scene.png", SOURCE, "image/png"), "prompt": "a red square"}
    settings = {"seed": 5, "num_inference_steps": 4, "strength": 1.0}
    events = list(client.images.edit(**asked, stream=True, partial_images=1, extra_body=settings))
    kinds = [e.type for e in events]
    assert kinds == ["image_edit.progress"] * 3 + ["image_edit.partial_image", "image_edit.progress"] + [
        "image_edit.completed"
    ]
    assert png_pixels(base64.b64decode(events[3].b64_json)).shape == (8, 8, 3)
    assert events[-1].size == "64x64" and events[-1].output_format == "png"
    plain = client.images.edit(**asked, extra_body=settings)
    assert events[-1].b64_json == plain.data[0].b64_json
    with pytest.raises(BadRequestError) as info:
        client.images.edit(**asked, stream=True, output_format="jpeg", extra_body=settings)
    assert info.value.body["param"] == "output_format"


def test_grpc_streams_an_edit_as_http_does(server, stub):
    """EditImageStream: a progress event per step (partial_images: a latent preview with the last N steps),
    then the image EditImage answers for the same request; png only, and the uploads are checked as
    EditImage checks them."""
    asked = dict(image=[SOURCE], prompt="a red square", seed=5, num_inference_steps=4, strength=1.0)
    events = list(stub.EditImageStream(pb.EditImageRequest(partial_images=1, **asked), timeout=120))
    assert [e.WhichOneof("event") for e in events] == ["progress"] * 4 + ["result"]
    assert [e.progress.step for e in events[:-1] if e.progress.preview] == [3]
    assert png_pixels(events[2].progress.preview).shape == (8, 8, 3)
    assert events[-1].result.size == "64x64"
    assert events[-1].result.images[0] == stub.EditImage(pb.EditImageRequest(**asked), timeout=120).images[0]
    for fields, param in ((dict(output_format="jpeg"), "output_format"), (dict(image=[b"x"]), "image")):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.EditImageStream(pb.EditImageRequest(**{**asked, **fields}), timeout=120))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{param}: "), info.value.details()


# -- bad uploads, HTTP and gRPC ---------------------------------------------------------------------------
HTTP_CASES = [
    ("not an image", {"image": ("a.png", b"not an image", "image/png")}, {}, "image"),
    ("truncated", {"image": ("a.png", SOURCE[: len(SOURCE) // 2], "image/png")}, {}, "image"),
    ("too many bytes", {"image": ("a.png", NOISE, "image/png")}, {}, "image"),
    ("too many pixels", {"image": ("a.png", HUGE, "image/png")}, {}, "image"),
    ("no image", {}, {}, "image"),
    ("two images", [("image[]", ("a.png", SOURCE)), ("image[]", ("b.png", SOURCE))], {}, "image"),
    (
        "a mask of another shape",
        {"image": ("a.png", SOURCE), "mask": ("m.png", png(scene((64, 32))))},
        {},
        "mask",
    ),
    ("a mask not an image", {"image": ("a.png", SOURCE), "mask": ("m.png", b"GIF89a")}, {}, "mask"),
    ("size", {"image": ("a.png", SOURCE)}, {"size": "65x64"}, "size"),
    ("unknown field", {"image": ("a.png", SOURCE)}, {"colour": "red"}, "colour"),
    ("strength", {"image": ("a.png", SOURCE)}, {"strength": "1.5"}, "strength"),
    ("lora not JSON", {"image": ("a.png", SOURCE)}, {"lora": "{name"}, "lora"),
    ("n zero", {"image": ("a.png", SOURCE)}, {"n": "0"}, "n"),
    ("n above max", {"image": ("a.png", SOURCE)}, {"n": "3"}, "n"),
    ("n not a number", {"image": ("a.png", SOURCE)}, {"n": "two"}, "n"),
    ("gif", {"image": ("a.png", SOURCE)}, {"output_format": "gif"}, "output_format"),
    ("compression", {"image": ("a.png", SOURCE)}, {"output_compression": "101"}, "output_compression"),
    ("transparent", {"image": ("a.png", SOURCE)}, {"background": "transparent"}, "background"),
    ("markup file", {"image": ("a.png", SOURCE), "markup": ("m.png", SOURCE)}, {}, "markup"),
]


def http_edit(server, files, data) -> httpx.Response:
    form = {"prompt": "a red circle on a blue background", "num_inference_steps": "1", "seed": "1", **data}
    if not files:  # multipart with text fields only
        files = [("prompt", (None, form.pop("prompt")))]
    return httpx.post(f"{server.base_url}/v1/images/edits", data=form, files=files, timeout=120)


def test_bad_uploads_are_400_naming_the_field(server):
    for name, files, data, param in HTTP_CASES:
        r = http_edit(server, files, data)
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (name, error)
        assert error["message"].startswith(param), (name, error)
        ok = http_edit(server, {"image": ("a.png", SOURCE, "image/png")}, {"size": "32x48"})
        assert ok.status_code == 200, (name, ok.text)
        assert png_pixels(base64.b64decode(ok.json()["data"][0]["b64_json"])).shape == (48, 32, 3)


def test_empty_file_inputs_of_an_html_form_are_no_files(server):
    """A browser sends a file input left empty as a part with filename "" and no bytes: an optional mask and a
    second image[] slot left empty are no files (they were a mask the model does not take and an unreadable
    image); a zero-byte file that has a name is still refused naming the field."""
    boundary = "form-boundary"

    def part(name: str, data: bytes, filename: str | None = None) -> bytes:
        disposition = f'form-data; name="{name}"' + (
            f'; filename="{filename}"' if filename is not None else ""
        )
        kind = "Content-Type: application/octet-stream\r\n" if filename is not None else ""
        return f"--{boundary}\r\nContent-Disposition: {disposition}\r\n{kind}\r\n".encode() + data + b"\r\n"

    def post(*files: tuple[str, bytes, str]) -> httpx.Response:
        fields = [part("prompt", b"a red circle"), part("num_inference_steps", b"1"), part("seed", b"1")]
        body = b"".join([*fields, *(part(name, data, filename) for name, data, filename in files)])
        headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
        return httpx.post(
            f"{server.base_url}/v1/images/edits", content=body + f"--{boundary}--\r\n".encode(), headers=headers,
            timeout=120,
        )  # fmt: skip

    r = post(("image[]", SOURCE, "scene.png"), ("image[]", b"", ""), ("mask", b"", ""))
    assert r.status_code == 200, r.text
    assert r.json()["size"] == "64x64"
    named = post(("image", SOURCE, "scene.png"), ("mask", b"", "mask.png"))
    assert named.status_code == 400 and named.json()["error"]["param"] == "mask", named.text


def test_a_body_cut_off_before_its_closing_boundary_is_refused(server):
    """A multipart body whose end is missing (an upload cut off inside the prompt) was read as far as it went:
    the edit drew "a red" for "a red circle on a blue background". It is a 400 now, and the server keeps
    serving; the media type is read in any case, as HTTP's media types are."""
    request = httpx.Request(
        "POST",
        f"{server.base_url}/v1/images/edits",
        files=[("image", ("scene.png", SOURCE, "image/png")), ("num_inference_steps", (None, b"1"))]
        + [("prompt", (None, b"a red circle on a blue background"))],
    )
    body, content_type = request.read(), request.headers["content-type"]
    url = f"{server.base_url}/v1/images/edits"
    cut = httpx.post(
        url, content=body[: body.index(b" circle")], headers={"content-type": content_type}, timeout=120
    )
    assert cut.status_code == 400, cut.text
    assert "closing boundary is missing" in cut.json()["error"]["message"], cut.text
    upper = content_type.replace("multipart/form-data", "Multipart/Form-Data")
    whole = httpx.post(url, content=body, headers={"content-type": upper}, timeout=120)
    assert whole.status_code == 200, whole.text


def _fields(message) -> dict:
    return {f.name: v for f, v in message.ListFields()}


def test_grpc_edit_and_its_bad_uploads(server, stub):
    good = pb.EditImageRequest(image=[SOURCE], prompt="a red circle", num_inference_steps=1, seed=1)
    reply = stub.EditImage(good, timeout=120)
    assert reply.size == "64x64"  # the image's own size
    assert png_pixels(reply.images[0]).shape == (64, 64, 3) and reply.output_format == "png"
    webp = stub.EditImage(pb.EditImageRequest(output_format="webp", **_fields(good)), timeout=120)
    assert webp.output_format == "webp" and Image.open(io.BytesIO(webp.images[0])).format == "WEBP"
    assert psnr(png_pixels(webp.images[0]), png_pixels(reply.images[0])) >= 25
    with Client(f"127.0.0.1:{server.grpc_port}") as client:  # the package's own client, same request
        assert client.edit_image([SOURCE], "a red circle", num_inference_steps=1, seed=1) == list(
            reply.images
        )
    generated = stub.Generate(pb.GenerateRequest(prompt="a", num_inference_steps=1, output_format="jpeg"))
    assert generated.output_format == "jpeg" and Image.open(io.BytesIO(generated.images[0])).format == "JPEG"
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(pb.GenerateRequest(prompt="a", output_format="jpeg"), timeout=120))
    assert info.value.details().startswith("output_format"), info.value.details()
    cases = [
        (dict(image=[SOURCE], output_format="gif"), "output_format"),
        (dict(image=[b"not an image"]), "image"),
        (dict(image=[NOISE]), "image"),
        (dict(image=[HUGE]), "image"),
        (dict(image=[]), "image"),
        (dict(image=[SOURCE, SOURCE]), "image"),
        (dict(image=[SOURCE], mask=png(scene((64, 32)))), "mask"),
        (dict(image=[SOURCE], size="64x65"), "size"),
    ]
    for fields, param in cases:
        request = pb.EditImageRequest(prompt="a red circle", num_inference_steps=1, **fields)
        with pytest.raises(grpc.RpcError) as info:
            stub.EditImage(request, timeout=120)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (param, info.value.details())
        assert info.value.details().startswith(param), (param, info.value.details())
        assert "image[]" not in info.value.details()  # HTTP's form field; gRPC's image field repeats
        assert png_pixels(stub.EditImage(good, timeout=120).images[0]).shape == (64, 64, 3)


# -- FLUX.1 Kontext: reference images -----------------------------------------------------------------------
KONTEXT = GenerationParams(
    prompt="make the circle green",
    width=64,
    height=48,
    num_inference_steps=2,
    guidance_scale=2.5,
    seed=3,
    images=(png(scene((80, 48))),),
)


@pytest.fixture(scope="module")
def kontext_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("kontext") / "flux-kontext-tiny")


@pytest.fixture(scope="module")
def kontext_one_rank(kontext_folder) -> tuple[np.ndarray, FluxKontextPipeline]:
    """The FLUX.1 runner on one rank in this process (no engine start), and the pipeline it ran on."""
    pipe = FluxKontextPipeline.from_pretrained(kontext_folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    runner = FluxRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=512)
    state = runner.add("kontext", KONTEXT)
    while not state.done:
        runner.step([state])
    return runner.decode(state)[0], pipe


def test_kontext_one_rank_is_diffusers(kontext_one_rank):
    ours, pipe = kontext_one_rank
    p = KONTEXT
    reference = pipe(
        image=Image.open(io.BytesIO(p.images[0])).convert("RGB"),
        prompt=p.prompt,
        height=p.height,
        width=p.width,
        max_area=p.height * p.width,  # the requested size as is
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=min(512, pipe.tokenizer_2.model_max_length),
        output_type="np",
    ).images
    assert ours.shape == (48, 64, 3)
    assert psnr(ours, to_uint8(reference)[0]) >= 40


def test_kontext_refuses_a_reference_under_its_multiple(kontext_one_rank):
    """A reference with a side under 16 pixels (diffusers would divide by its rounded-down side, 0) is bad
    input naming the image (a 400 at the server), not a ZeroDivisionError (a 500)."""
    pipe = kontext_one_rank[1]
    runner = FluxRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=512)
    tiny = KONTEXT.model_copy(update={"images": (png(scene((8, 8))),)})
    with pytest.raises(ValueError, match=r"^image: the reference is 8x8; .* at least 16 pixels a side"):
        runner.add("tiny", tiny)


def test_kontext_engine_ulysses2_is_one_rank(kontext_folder, kontext_one_rank):
    """Reference tokens sharded with the generated ones over two ranks (gloo), the output gathered; batched
    with a request of the same reference (their rows share the forward)."""
    engine = Engine(EngineConfig(model=str(kontext_folder), parallel=ParallelFlags(ulysses_degree=2))).start()
    try:
        futures = [engine.submit(KONTEXT), engine.submit(KONTEXT.model_copy(update={"seed": 4}))]
        results = [f.result(timeout=300) for f in futures]
    finally:
        engine.shutdown()
    assert psnr(png_pixels(results[0].outputs[0]), kontext_one_rank[0]) >= 40
    assert psnr(png_pixels(results[1].outputs[0]), kontext_one_rank[0]) < 40  # its own seed
