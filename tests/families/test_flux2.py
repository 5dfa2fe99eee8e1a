"""FLUX.2 dev and Klein through the engine's own step loop: one rank gives diffusers' own images (text
only and with a reference image); tp 2 × ulysses 2 (with a LoRA) gives the one-rank images (ulysses 2,
ring 2, tp 2 alone, Klein's cfg 2 and ``ditserve generate --image`` with -m slow); ``ditserve serve`` answers
the openai client's generate and edit; a PEFT LoRA per request gives what diffusers' ``load_lora_weights``
gives, beside the same request without it in one batch. A masked Klein edit (one rank, ulysses 2,
``ditserve generate --mask``; the openai client with -m slow) gives Flux2KleinInpaintPipeline's image, beside
an unmasked edit in one batch."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from openai import BadRequestError
from PIL import Image

from ditserve.replica.caching.settings import CacheSettings
from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import validate_layout
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.flux2 import Flux2KleinRunner, Flux2Runner, TextProcessor
from ditserve.replica.request import GenerationParams, LoRARef
from tests.families.flux2 import MAX_TEXT_TOKENS, as_pixtral_folder, build_folder
from tests.families.harness import (
    b64_pixels,
    cli_generate,
    engine_images,
    images,
    layout_id,
    load_pipeline,
    openai_client,
    picture,
    run_runner,
    running_engine,
    served,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.helpers import png_pixels, psnr, user_env

pytestmark = pytest.mark.usefixtures("single_thread")


def reference_png() -> bytes:
    """A 72×72 picture (smooth colours plus noise): 9×9 packed reference tokens, so that image + reference
    tokens (64 + 81) need padding under every 2-way sequence split."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:72, 0:72] / 72
    pixels = np.stack([x, y, 1 - x * y], -1) * 200 + rng.integers(0, 55, (72, 72, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


REF = reference_png()
TEXT = GenerationParams(prompt="a red fox on a hill", width=64, height=64, num_inference_steps=3, seed=3)
EDIT = GenerationParams(
    prompt="a blue cat", width=64, height=64, num_inference_steps=3, guidance_scale=2.5, seed=4, images=(REF,)
)
TEXT_LORA = TEXT.model_copy(update={"lora": (LoRARef(name="style"),)})
BATCH = [TEXT, EDIT, TEXT_LORA]  # submitted together: the same request with and without the adapter


def diffusers_image(pipe, p: GenerationParams) -> np.ndarray:
    image = [Image.open(io.BytesIO(b)) for b in p.images] or None
    kwargs = {} if p.guidance_scale is None else {"guidance_scale": p.guidance_scale}
    out = pipe(
        prompt=p.prompt,
        image=image,
        height=p.height,
        width=p.width,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=MAX_TEXT_TOKENS,
        output_type="np",
        **kwargs,
    )
    return (out.images[0] * 255).round().clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def dev_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("models") / "flux2-dev-tiny")


@pytest.fixture(scope="module")
def klein_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("models") / "flux2-klein-tiny", klein=True)


@pytest.fixture(scope="module")
def dev_pipe(dev_folder):
    return load_pipeline(Flux2Pipeline, dev_folder)


@pytest.fixture(scope="module")
def dev_expected(dev_pipe):
    return [diffusers_image(dev_pipe, p) for p in (TEXT, EDIT)]


def runner_for(cls, pipe):
    return cls(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=512)


def test_dev_one_rank_equals_flux2_pipeline_with_and_without_reference(dev_pipe, dev_expected):
    runner = runner_for(Flux2Runner, dev_pipe)
    ours = run_runner(runner, [TEXT, EDIT])
    for got, want in zip(ours, dev_expected, strict=True):
        assert got.shape == want.shape == (64, 64, 3)
        assert psnr(got, want) >= 40
    assert psnr(ours[0], ours[1]) < 30  # the two requests really differ
    # The reference image changes the picture (its tokens take part in attention; little, with random weights).
    alone = run_runner(runner, [EDIT.model_copy(update={"images": ()})])[0]
    assert not np.array_equal(alone, ours[1])
    # Step cache (first single block decides): hits skip the other blocks, beside an uncached request.
    cached = EDIT.model_copy(update={"cache": CacheSettings(policy="fbcache", threshold=5.0)})
    states = [runner.add("cached", cached), runner.add("plain", EDIT.model_copy(update={"seed": 9}))]
    while not states[0].done:
        runner.step(states)
    assert states[0].extra["cache"]["cond"].cached == 2  # steps 2 and 3 reused step 1's residual
    image = runner.decode(states[0])[0]
    assert 30 <= psnr(image, ours[1]) < 100
    # Refusals name the field: a reference below the pipeline's 64 px minimum, a negative prompt.
    small = io.BytesIO()
    Image.new("RGB", (48, 64)).save(small, format="PNG")
    with pytest.raises(ValueError, match=r"image: reference 2: .*48×64"):
        runner.encode(EDIT.model_copy(update={"images": (REF, small.getvalue())}))
    with pytest.raises(ValueError, match="negative_prompt"):
        runner.encode(TEXT.model_copy(update={"negative_prompt": "blurry"}))


@pytest.fixture(scope="module")
def klein_pipe(klein_folder):
    return load_pipeline(Flux2KleinPipeline, klein_folder)


@pytest.fixture(scope="module")
def klein_expected(klein_pipe):
    # guidance 4 (the pipeline's default) and 2.5: true CFG against the empty prompt
    return [diffusers_image(klein_pipe, p) for p in (TEXT, EDIT)]


def test_klein_one_rank_equals_klein_pipeline_with_cfg_and_reference(klein_pipe, klein_expected):
    runner = runner_for(Flux2KleinRunner, klein_pipe)
    states = [runner.add(f"k{i}", p) for i, p in enumerate((TEXT, EDIT))]
    assert all(s.uncond is not None for s in states)
    for got, want in zip(run_runner(runner, [TEXT, EDIT]), klein_expected, strict=True):
        assert psnr(got, want) >= 40
    with pytest.raises(ValueError, match="negative_prompt"):
        runner.encode(TEXT.model_copy(update={"negative_prompt": "blurry"}))


def test_pixtral_processor_folder_loads_without_torchvision(dev_folder, dev_expected, tmp_path):
    """FLUX.2 dev ships a PixtralProcessor as its tokenizer (transformers needs torchvision for it, absent
    here): the engine passes the processor's tokenizer in its place and draws the same image."""
    folder = as_pixtral_folder(shutil.copytree(dev_folder, tmp_path / "flux2-dev-pixtral"))
    assert Flux2Runner.pipeline_components(folder) == {"tokenizer": None}
    with running_engine(folder) as engine:
        assert isinstance(engine.launcher.worker.pipe.tokenizer, TextProcessor)
        image = images(engine, [TEXT], timeout=120)[0]
    assert psnr(image, dev_expected[0]) >= 40


def test_an_edit_without_a_size_takes_the_first_reference_at_most_1024_squared(dev_folder, klein_folder):
    """Flux2Pipeline and Flux2KleinPipeline, called without height and width, draw at the first reference's
    size as they take it: brought down to 1024² pixels by their image processor where it has more, floored
    to the size multiple. A 2048x1024 reference was drawn at 2048x1024 (then 1448x724 by diffusers)."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    for folder in (dev_folder, klein_folder):
        spec = resolve_model(str(folder))
        multiple = spec.size_multiple
        for first, second in (((2048, 1024), (64, 64)), ((1100, 1000), (2048, 2048)), ((80, 48), (4096, 16))):
            taken = Flux2ImageProcessor._resize_if_exceeds_area(Image.new("RGB", first), 1024 * 1024).size
            want = tuple(side // multiple * multiple for side in taken)
            assert spec.edit_request_size([first, second], masked=False) == want, (folder.name, first)
    assert spec.edit_request_size([(2048, 1024)], masked=False) == (1448 // multiple * multiple, 720)


@pytest.mark.slow  # ~1M-pixel images (minutes on CPU); the size rule against diffusers' in the default run above
def test_an_edit_of_a_reference_above_1024_squared_without_a_size_equals_flux2_pipeline(
    dev_pipe, dev_folder, tmp_path
):
    """A 1100x1000 reference, no size: the openai client's edit and ``ditserve generate --image`` draw
    Flux2Pipeline's image called without height and width (1072x976: the reference brought down to 1024²
    pixels, floored to the multiple). They drew 1100x1000 (1096x1000 on the multiple)."""
    big = picture(1100, 1000, 0)
    out = dev_pipe(
        prompt=EDIT.prompt,
        image=[Image.open(io.BytesIO(big))],
        num_inference_steps=1,
        generator=torch.Generator("cpu").manual_seed(4),
        max_sequence_length=MAX_TEXT_TOKENS,
        output_type="np",
    )
    expected = (out.images[0] * 255).round().clip(0, 255).astype(np.uint8)
    assert expected.shape == (976, 1072, 3)
    with served("--model", str(dev_folder)) as server:
        edited = openai_client(server, timeout=600).images.edit(
            model=dev_folder.name,
            image=("big.png", big, "image/png"),
            prompt=EDIT.prompt,
            extra_body={"num_inference_steps": 1, "seed": 4},
        )
    assert edited.size == "1072x976"
    assert psnr(b64_pixels(edited), expected) >= 40
    (tmp_path / "big.png").write_bytes(big)
    flags = ["--image", str(tmp_path / "big.png"), "--seed", "4", "--num-inference-steps", "1"]
    assert (
        psnr(cli_generate(EDIT.prompt, dev_folder, tmp_path / "out.png", *flags, timeout=600), expected) >= 40
    )


@pytest.mark.slow  # serve's images.edit sends this reference (default); --image: test_qwenimage.py
def test_generate_cli_with_reference_image(dev_folder, dev_expected, tmp_path):
    ref = tmp_path / "ref.png"
    ref.write_bytes(REF)
    args = ["--width", "64", "--height", "64", "--num-inference-steps", "3", "--guidance-scale", "2.5"]
    args += ["--seed", "4", "--image", str(ref), "--max-sequence-length", "512"]
    assert psnr(cli_generate(EDIT.prompt, dev_folder, tmp_path / "out.png", *args), dev_expected[1]) >= 40


# tp 2 × ulysses 2 by default (dev distils guidance: no CFG branch to split); each axis alone with -m slow.
# Ring shares sequence_parallel_attention with Ulysses (the family code is the same).
LAYOUTS = [
    {"tp_size": 2, "ulysses_degree": 2},
    pytest.param({"ulysses_degree": 2}, marks=pytest.mark.slow),
    pytest.param({"ring_degree": 2}, marks=pytest.mark.slow),
    pytest.param({"tp_size": 2}, marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def one_rank(dev_folder, lora_file):
    """One rank's images for BATCH (the adapter applied to the last request only)."""
    return engine_images(dev_folder, {}, BATCH, {"style": lora_file})


def test_one_rank_engine_equals_diffusers(one_rank, dev_expected):
    for got, want in zip(one_rank[:2], dev_expected, strict=True):
        assert psnr(got, want) >= 40


@pytest.mark.parametrize("flags", LAYOUTS, ids=layout_id)
def test_layouts_equal_one_rank(dev_folder, one_rank, flags, lora_file):
    # With an adapter on the packed linears (sliced per rank under tp).
    got = engine_images(dev_folder, flags, BATCH, {"style": lora_file})
    for image, want in zip(got, one_rank, strict=True):
        assert image.shape == want.shape
        assert psnr(image, want) >= 40


@pytest.mark.slow
def test_klein_cfg_parallel_equals_pipeline(klein_folder, klein_expected):
    """Klein's two branches on two ranks (cfg 2): the empty-prompt branch runs on rank 1."""
    got = engine_images(klein_folder, {"cfg_parallel_size": 2}, [TEXT, EDIT])
    for image, want in zip(got, klein_expected, strict=True):
        assert psnr(image, want) >= 40


def mask_png(width: int, height: int, left: int, alpha: bool = False) -> bytes:
    """The ``left`` columns repainted: white on black (diffusers' mask), or transparent in an opaque image
    (OpenAI's). ``left`` off the 8-pixel token grid makes the pipeline's bilinear token mask soft there."""
    if alpha:
        image = Image.new("RGBA", (width, height), (0, 0, 0, 255))
        image.paste((0, 0, 0, 0), (0, 0, left, height))
    else:
        image = Image.new("L", (width, height), 0)
        image.paste(255, (0, 0, left, height))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


SECOND_REF = picture(96, 64, 1)  # a masked edit's image_reference: 12×8 more tokens
# REF (72×72) inpainted on its 29 left columns; guidance left to the inpaint pipeline's default (8: CFG).
MASKED = GenerationParams(
    prompt="a blue cat",
    width=72,
    height=72,
    num_inference_steps=4,
    strength=0.7,
    seed=5,
    images=(REF,),
    mask=mask_png(72, 72, 29, alpha=True),
)
# Unmasked, of the masked edit's size and reference grid: one bucket, one forward a step with it.
EDIT72 = EDIT.model_copy(update={"width": 72, "height": 72})


def inpaint_image(pipe, p: GenerationParams) -> np.ndarray:
    """Flux2KleinInpaintPipeline (on ``pipe``'s components) for ``p``: its image and the diffusers mask of
    the same pixels (white repaints), a second image as ``image_reference``, no size (the pipeline takes the
    image's); the first of ``p.n`` images ([n, h, w, 3] with ``p.n`` > 1)."""
    from diffusers import Flux2KleinInpaintPipeline

    inpaint = Flux2KleinInpaintPipeline.from_pipe(pipe)
    inpaint.set_progress_bar_config(disable=True)
    kwargs = {} if p.guidance_scale is None else {"guidance_scale": p.guidance_scale}
    if len(p.images) > 1:
        kwargs["image_reference"] = Image.open(io.BytesIO(p.images[1]))
    out = inpaint(
        prompt=p.prompt,
        image=Image.open(io.BytesIO(p.images[0])),
        mask_image=Image.open(io.BytesIO(mask_png(p.width, p.height, 29))),
        strength=p.strength,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        num_images_per_prompt=p.n,
        max_sequence_length=MAX_TEXT_TOKENS,
        output_type="np",
        **kwargs,
    )
    images = (out.images * 255).round().clip(0, 255).astype(np.uint8)
    return images if p.n > 1 else images[0]


@pytest.fixture(scope="module")
def inpaint_expected(klein_pipe):
    """The inpaint pipeline's images for MASKED (one reference; two; n=2 at guidance 1) and the Klein
    pipeline's for EDIT72."""
    with_ref = MASKED.model_copy(update={"images": (REF, SECOND_REF), "strength": 0.5})
    return {
        "masked": inpaint_image(klein_pipe, MASKED),
        "with_ref": inpaint_image(klein_pipe, with_ref),
        "edit72": diffusers_image(klein_pipe, EDIT72),
    }


def test_klein_masked_edit_equals_klein_inpaint_pipeline_beside_an_unmasked_edit(
    klein_pipe, inpaint_expected
):
    """A mask on FLUX.2 Klein draws Flux2KleinInpaintPipeline's image (the image noised to strength, kept
    outside the soft-edged mask, and the first reference; a second image as its image_reference; its default
    guidance 8), batched in one forward with an unmasked edit of the same size that draws
    Flux2KleinPipeline's. The mask was refused ('Flux2KleinInpaintPipeline is not served here')."""
    runner = runner_for(Flux2KleinRunner, klein_pipe)
    with_ref = MASKED.model_copy(update={"images": (REF, SECOND_REF), "strength": 0.5})
    states = [runner.add("m", MASKED), runner.add("e", EDIT72)]
    assert states[0].bucket == states[1].bucket and states[0].cfg_scale == 8.0
    masked, edit, two = run_runner(runner, [MASKED, EDIT72, with_ref])
    assert masked.shape == (72, 72, 3)
    assert psnr(masked, inpaint_expected["masked"]) >= 40
    assert psnr(edit, inpaint_expected["edit72"]) >= 40
    assert psnr(two, inpaint_expected["with_ref"]) >= 40
    # The mask keeps the image on the right (little changed) and repaints the left.
    source = np.asarray(Image.open(io.BytesIO(REF)).convert("RGB")).astype(float)
    kept, painted = (np.abs(masked.astype(float) - source)[:, a:b].mean() for a, b in ((40, 72), (0, 24)))
    assert kept * 2 < painted, (kept, painted)
    with pytest.raises(ValueError, match="^image: a masked FLUX.2 Klein edit takes .* not 3 images"):
        runner.encode(with_ref.model_copy(update={"images": (REF, REF, REF)}))


def test_klein_masked_edit_under_ulysses_2_equals_klein_inpaint_pipeline(klein_folder, inpaint_expected):
    """Ulysses 2 (the packed tokens and the mask's start latents split over two ranks' sequence, CFG on):
    the masked edit beside the unmasked one of its bucket gives the pipelines' images."""
    got = engine_images(klein_folder, {"ulysses_degree": 2}, [MASKED, EDIT72])
    assert psnr(got[0], inpaint_expected["masked"]) >= 40
    assert psnr(got[1], inpaint_expected["edit72"]) >= 40


# What the server and CLI send: no size, strength or guidance (the inpaint pipeline's 0.8 and 8), 2 steps.
SERVED_MASKED = MASKED.model_copy(update={"num_inference_steps": 2, "strength": 0.8, "seed": 7, "n": 2})


@pytest.fixture(scope="module")
def served_inpaint_expected(klein_pipe):
    return inpaint_image(klein_pipe, SERVED_MASKED)


@pytest.mark.slow  # a server start (~30 s); the CLI below sends the same request by default
def test_klein_serve_inpaints_with_a_mask_as_klein_inpaint_pipeline(klein_folder, served_inpaint_expected):
    """POST /v1/images/edits with a mask on a Klein folder (the openai client; OpenAI's transparent mask, n=2,
    no size, strength or guidance): Flux2KleinInpaintPipeline's two images at its defaults. It was a 400
    ('Flux2KleinInpaintPipeline is not served here')."""
    with served("--model", str(klein_folder)) as server:
        client = openai_client(server)
        edited = client.images.edit(
            model=klein_folder.name,
            image=("ref.png", REF, "image/png"),
            mask=("mask.png", SERVED_MASKED.mask, "image/png"),
            prompt=SERVED_MASKED.prompt,
            n=2,
            extra_body={"num_inference_steps": 2, "seed": 7},
        )
        # a mask of another shape is still a 400 naming mask
        with pytest.raises(BadRequestError) as info:
            client.images.edit(
                image=("ref.png", REF, "image/png"),
                mask=("mask.png", mask_png(64, 72, 29), "image/png"),
                prompt=SERVED_MASKED.prompt,
            )
        assert info.value.body["param"] == "mask" and "not the shape" in info.value.body["message"]
        # the inpaint pipeline takes one image_reference beside its image: a third image is a 400 naming image
        with pytest.raises(BadRequestError) as info:
            client.images.edit(
                image=[("a.png", REF, "image/png")] * 3,
                mask=("mask.png", SERVED_MASKED.mask, "image/png"),
                prompt=SERVED_MASKED.prompt,
            )
        assert info.value.body["param"] == "image" and "not 3 images" in info.value.body["message"]
    assert edited.size == "72x72"
    for i, want in enumerate(served_inpaint_expected):
        got = png_pixels(base64.b64decode(edited.data[i].b64_json))
        assert psnr(got, want) >= 40, i


def test_klein_generate_cli_with_mask(klein_folder, served_inpaint_expected, tmp_path):
    (tmp_path / "ref.png").write_bytes(REF)
    (tmp_path / "mask.png").write_bytes(SERVED_MASKED.mask)
    flags = ["--image", str(tmp_path / "ref.png"), "--mask", str(tmp_path / "mask.png")]
    flags += ["--seed", "7", "--num-inference-steps", "2"]
    got = cli_generate(SERVED_MASKED.prompt, klein_folder, tmp_path / "out.png", *flags)
    assert psnr(got, served_inpaint_expected[0]) >= 40


def test_a_mask_is_refused_where_diffusers_has_no_inpaint_pipeline(dev_folder, klein_folder):
    """FLUX.2 dev has no inpaint pipeline in diffusers: a mask is refused saying so. Klein takes one
    (Flux2KleinInpaintPipeline's default strength 0.8); its size without one is the image's."""
    assert "(diffusers has no inpaint pipeline for it)" in resolve_model(str(dev_folder)).mask_refusal()
    assert not resolve_model(str(dev_folder)).inpaints
    klein = resolve_model(str(klein_folder))
    assert klein.inpaints and klein.default_strength(True, 0.6) == 0.8
    assert klein.edit_request_size([(72, 72), (96, 64)], masked=True) == (72, 72)


def test_cfg_parallel_is_refused_where_one_branch_runs(dev_folder, klein_folder, tmp_path):
    """FLUX.2 dev (distilled guidance) and a step-distilled Klein folder run one branch a step:
    --cfg-parallel-size 2 was taken and its second rank repeated the first's forwards (half the GPUs busy for
    nothing). Now refused before anything starts, naming the flag and where the GPUs can go; Klein with its
    own CFG keeps it."""
    distilled = Path(shutil.copytree(klein_folder, tmp_path / "klein-distilled"))
    index = json.loads((distilled / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps(index | {"is_distilled": True}))
    for folder, why in ((dev_folder, "guidance is distilled"), (distilled, "step-distilled")):
        config = EngineConfig(model=str(folder), device="cpu", parallel=ParallelFlags(cfg_parallel_size=2))
        with pytest.raises(ValueError, match=f"^--cfg-parallel-size 2: .*one branch a step.*{why}") as err:
            validate_layout(config, resolve_model(str(folder)))
        assert "--tp-size" in str(err.value)
    config = EngineConfig(model=str(klein_folder), device="cpu", parallel=ParallelFlags(cfg_parallel_size=2))
    assert validate_layout(config, resolve_model(str(klein_folder))) == 2
    flags = {"tp_size": 2, "ulysses_degree": 2}
    config = EngineConfig(model=str(dev_folder), device="cpu", parallel=ParallelFlags(**flags))
    assert validate_layout(config, resolve_model(str(dev_folder))) == 4


def test_serve_and_openai_client(dev_folder, dev_expected):
    with served("--model", str(dev_folder)) as server:
        # the start line names the id requests give as model (it printed the folder's path alone)
        assert f"ditserve: serving {dev_folder.name} ({dev_folder}) at http" in server.output()
        client = openai_client(server)
        assert [m.id for m in client.models.list()] == [dev_folder.name]
        result = client.images.generate(
            model=dev_folder.name,
            prompt=TEXT.prompt,
            size="64x64",
            response_format="b64_json",
            extra_body={"num_inference_steps": 3, "seed": 3, "guidance_scale": 4.0},
        )
        # POST /v1/images/edits: the uploaded file is the reference image.
        edited = client.images.edit(
            model=dev_folder.name,
            image=("ref.png", REF, "image/png"),
            prompt=EDIT.prompt,
            size="64x64",
            response_format="b64_json",
            extra_body={"num_inference_steps": 3, "seed": 4, "guidance_scale": 2.5},
        )
        # diffusers has no inpaint pipeline for FLUX.2: a mask is refused naming it, not ignored.
        with pytest.raises(BadRequestError) as info:
            client.images.edit(
                image=("ref.png", REF, "image/png"), mask=("mask.png", REF, "image/png"), prompt=EDIT.prompt
            )
        assert info.value.body["param"] == "mask" and "does not inpaint" in info.value.body["message"]
        # The tiny VAE's size multiple is 8: 8 pixels a side is a multiple, still under every model's 16.
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format="PNG")
        # A 2-pixel-wide reference without a size: its width floors to 0 on the multiple (a 500 before:
        # the frontend divided by it), refused naming size as the 8x8 one.
        thin = io.BytesIO()
        Image.new("RGB", (2, 400)).save(thin, format="PNG")
        for call in (
            lambda: client.images.generate(prompt="a", size="8x8"),
            lambda: client.images.edit(image=("tiny.png", buf.getvalue(), "image/png"), prompt="a"),
            lambda: client.images.edit(image=("thin.png", thin.getvalue(), "image/png"), prompt="a"),
        ):
            with pytest.raises(BadRequestError) as info:
                call()
            assert info.value.body["param"] == "size" and "16 pixels" in info.value.body["message"]
        # A session refines each image from the last (image-to-image), which FLUX.2 does not do: refused as
        # it opens, naming model (it opened, and its second step was refused naming init_latents).
        r = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "64x64"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "no image-to-image" in r.json()["error"]["message"]
    got = b64_pixels(result)
    assert got.shape == (64, 64, 3)
    assert psnr(got, dev_expected[0]) >= 40
    assert psnr(b64_pixels(edited), dev_expected[1]) >= 40


def test_generate_cli_refuses_a_reference_too_thin_for_a_size(dev_folder, tmp_path):
    """``ditserve generate --image`` without a size, a 2x400 reference: FLUX.2's size from it floors the width
    to 0 on the multiple; refused naming --image and the way out (it ended in a ZeroDivisionError)."""
    thin = tmp_path / "thin.png"
    Image.new("RGB", (2, 400)).save(thin)
    cmd = [str(Path(sys.executable).with_name("ditserve")), "generate", "a", "--model", str(dev_folder)]
    cmd += ["--image", str(thin), "-o", str(tmp_path / "out.png")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=user_env())
    assert done.returncode == 2, done.stderr
    assert "--image: the image (2x400)" in done.stderr and "give --width and --height" in done.stderr
    assert "Traceback" not in done.stderr


LORA_TARGETS = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.add_k_proj",
    "transformer_blocks.0.ff.linear_in",
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
    "single_transformer_blocks.1.attn.to_out",
]


@pytest.fixture(scope="module")
def lora_file(dev_folder, tmp_path_factory):
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = Flux2Transformer2DModel.from_pretrained(dev_folder / "transformer")
    torch.manual_seed(7)
    transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=64, target_modules=LORA_TARGETS, init_lora_weights=False)
    )
    folder = tmp_path_factory.mktemp("lora")
    metadata = transformer.peft_config["default"].to_dict()  # lora_alpha / r: both sides scale by 16
    Flux2Pipeline.save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(transformer),
        transformer_lora_adapter_metadata=metadata,
    )
    return folder / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def lora_expected(dev_folder, lora_file):
    pipe = load_pipeline(Flux2Pipeline, dev_folder)
    pipe.load_lora_weights(str(lora_file))
    return diffusers_image(pipe, TEXT)


def test_lora_per_request_equals_load_lora_weights(one_rank, lora_expected, dev_expected):
    assert psnr(lora_expected, dev_expected[0]) < 30  # the adapter changes the image
    without, with_lora = one_rank[0], one_rank[2]  # one batch
    assert psnr(with_lora, lora_expected) >= 40
    assert psnr(without, dev_expected[0]) >= 40  # the same batch, no adapter
