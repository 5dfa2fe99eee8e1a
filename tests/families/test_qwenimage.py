"""Qwen-Image (text-to-image, Edit, Edit-Plus) through the engine's own step loop: one rank gives diffusers'
own images (prompts of different lengths batched with their padding masks, true CFG with its norm
rescaling, one and two reference images), through ``ditserve generate --image`` too; ulysses 2, ring 2,
tp 2 and cfg 2 give the same images (ulysses 2 × ring 2 and tp 2 × cfg 2; each axis alone with -m slow),
ulysses 2 with a reference too; ``ditserve serve`` answers the openai
client; a PEFT LoRA per request gives what diffusers' ``load_lora_weights`` gives, and an uploaded image with
``strength`` in the same batch gives QwenImageImg2ImgPipeline's image."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from diffusers import (
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImageImg2ImgPipeline,
    QwenImagePipeline,
)
from openai import BadRequestError
from PIL import Image

from ditserve.replica.config import EngineConfig
from ditserve.replica.engine import Engine
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.qwenimage import QwenImageRunner
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
    run_runner,
    sampling_body,
    served,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.families.qwenimage import build_folder
from tests.helpers import png_pixels, psnr

pytestmark = pytest.mark.usefixtures("single_thread")


REF, REF2 = picture(80, 48, 0), picture(48, 64, 1)
# Two prompts of different lengths: batched, the shorter one's embeddings are padded and masked.
CFG = GenerationParams(
    prompt="a red fox on a hill at dawn",
    negative_prompt="blurry",
    true_cfg_scale=3.0,
    width=96,
    height=64,
    num_inference_steps=2,
    seed=3,
)
PLAIN = GenerationParams(prompt="a cat", width=96, height=64, num_inference_steps=2, seed=4)
EDIT = GenerationParams(
    prompt="make the sky blue",
    negative_prompt="dark",
    true_cfg_scale=2.5,
    width=64,
    height=64,
    num_inference_steps=2,
    seed=5,
    images=(REF,),
)
PLUS = EDIT.model_copy(update={"images": (REF, REF2), "prompt": "the cat of picture 2 in picture 1"})
# Image-to-image on the text-to-image folder: 3 steps at strength 0.5 skip the first (get_timesteps).
I2I = CFG.model_copy(
    update={"num_inference_steps": 3, "strength": 0.5, "seed": 6, "images": (picture(96, 64, 2),)}
)
MAX_LEN = 512


def load(cls, folder):
    return load_pipeline(cls, folder, **QwenImageRunner.pipeline_components(folder))


def diffusers_image(pipe, p: GenerationParams) -> np.ndarray:
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in p.images]
    kwargs = {}
    if images:
        kwargs["image"] = images if len(images) > 1 else images[0]
    out = pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        true_cfg_scale=p.true_cfg_scale,
        height=p.height,
        width=p.width,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=MAX_LEN,
        output_type="np",
        **kwargs,
    )
    return (out.images[0] * 255).round().clip(0, 255).astype(np.uint8)


def runner_for(pipe):
    return QwenImageRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=MAX_LEN)


@pytest.fixture(scope="module")
def t2i_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("models") / "qwen-image-tiny")


@pytest.fixture(scope="module")
def edit_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("models") / "qwen-image-edit-tiny", edit=True)


@pytest.fixture(scope="module")
def t2i_pipe(t2i_folder):
    return load(QwenImagePipeline, t2i_folder)


@pytest.fixture(scope="module")
def t2i_expected(t2i_pipe):
    return [diffusers_image(t2i_pipe, p) for p in (CFG, PLAIN)]


@pytest.fixture(scope="module")
def edit_expected(edit_folder):
    return diffusers_image(load(QwenImageEditPipeline, edit_folder), EDIT)


def test_one_rank_batch_equals_qwenimage_pipeline(t2i_pipe, t2i_expected):
    runner = runner_for(t2i_pipe)
    states = [runner.add("a", CFG), runner.add("b", PLAIN)]
    # diffusers drops an all-valid mask; batched, the shorter prompt is padded and masked
    assert (
        states[0].cond["encoder_hidden_states"].shape[1] != states[1].cond["encoder_hidden_states"].shape[1]
    )
    assert states[0].uncond is not None and states[1].uncond is None
    ours = run_runner(runner, [CFG, PLAIN])
    for got, want in zip(ours, t2i_expected, strict=True):
        assert got.shape == want.shape == (64, 96, 3)
        assert psnr(got, want) >= 40
    assert psnr(ours[0], ours[1]) < 30
    with pytest.raises(ValueError, match="^image: image-to-image starts from one image, got 2"):
        runner.encode(PLAIN.model_copy(update={"images": (REF, REF)}))
    # true CFG without a negative prompt: diffusers draws unguided (a warning); refused naming the field
    with pytest.raises(ValueError, match="^true_cfg_scale: 3 guides against a negative prompt"):
        runner.encode(CFG.model_copy(update={"negative_prompt": None}))


@pytest.fixture(scope="module")
def plus_folder(tmp_path_factory):
    # zero_cond_t as Qwen-Image-Edit-2511's transformer (per-token modulation of the reference tokens)
    folder = tmp_path_factory.mktemp("models") / "qwen-image-edit-2511-tiny"
    return build_folder(folder, edit="plus", zero_cond_t=True)


@pytest.fixture(scope="module")
def plus_pipe(plus_folder):
    return load(QwenImageEditPlusPipeline, plus_folder)


@pytest.fixture(scope="module")
def plus_expected(plus_pipe):
    return diffusers_image(plus_pipe, PLUS)


def test_edit_plus_two_references_equal_pipeline_and_counts_are_checked(
    plus_pipe, plus_expected, edit_folder, plus_folder
):
    runner = runner_for(plus_pipe)
    assert psnr(run_runner(runner, [PLUS])[0], plus_expected) >= 40
    with pytest.raises(ValueError, match=r"^image: .*edits a reference image; .*\(POST /v1/images/edits"):
        runner.encode(PLUS.model_copy(update={"images": ()}))
    with pytest.raises(ValueError, match="^image: .*at most 3"):
        runner.encode(PLUS.model_copy(update={"images": (REF,) * 4}))
    with pytest.raises(ValueError, match="^image: .*at most 1"):
        runner_for(load(QwenImageEditPipeline, edit_folder)).encode(PLUS)
    # The engine's check, before the runner: each folder's own count (Edit: 1, not the family's 3).
    for folder, most in ((edit_folder, 1), (plus_folder, 3)):
        with pytest.raises(ValueError, match=rf"^image: .* takes at most {most} reference image\(s\), got 4"):
            Engine(EngineConfig(model=str(folder))).check(PLUS.model_copy(update={"images": (REF,) * 4}))


def test_edit_size_without_size_follows_the_pipelines(edit_folder):
    """An edit that names no size gets the edit pipelines' own size: the (last) reference's aspect at about
    1024² (diffusers' ``calculate_dimensions``), floored to the size multiple as the pipelines do."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    from ditserve.replica.models.registry import resolve_model

    spec = resolve_model(str(edit_folder))
    assert spec.edits and spec.size_multiple == 32
    for sizes in ([(80, 48)], [(80, 48), (48, 64)], [(1000, 333)]):
        w, h = calculate_dimensions(1024 * 1024, sizes[-1][0] / sizes[-1][1])
        assert spec.family_spec.edit_size(spec.folder, sizes) == (w // 32 * 32, h // 32 * 32)


def test_generate_cli_edit_equals_pipeline(edit_folder, edit_expected, tmp_path):
    ref = tmp_path / "ref.png"
    ref.write_bytes(REF)
    args = ["--width", "64", "--height", "64", "--num-inference-steps", "2", "--seed", "5"]
    args += ["--negative-prompt", "dark", "--true-cfg-scale", "2.5", "--image", str(ref)]
    assert psnr(cli_generate(EDIT.prompt, edit_folder, tmp_path / "out.png", *args), edit_expected) >= 40


@pytest.mark.parametrize("flags", LAYOUTS, ids=layout_id)
def test_layouts_equal_one_rank(t2i_folder, t2i_expected, flags):
    # One rank equals the pipeline (above), so each layout is checked against the pipeline's images.
    for got, want in zip(engine_images(t2i_folder, flags, [CFG, PLAIN]), t2i_expected, strict=True):
        assert got.shape == want.shape
        assert psnr(got, want) >= 40


@pytest.mark.parametrize(
    "which",
    ["edit", pytest.param("plus-2511", marks=pytest.mark.slow)],
)
def test_edit_ulysses_equals_one_rank(request, which):
    # The generated and reference tokens are sharded together; one rank equals the pipelines (above).
    if which == "edit":
        folder, p, want = (
            request.getfixturevalue("edit_folder"),
            EDIT,
            request.getfixturevalue("edit_expected"),
        )
    else:
        folder, p, want = (
            request.getfixturevalue("plus_folder"),
            PLUS,
            request.getfixturevalue("plus_expected"),
        )
    got = engine_images(folder, {"ulysses_degree": 2}, [p])[0]
    assert psnr(got, want) >= 40


# Image-to-image without a size: QwenImageImg2ImgPipeline draws its default (128 latents × the VAE's factor:
# 2048² with the tiny 16× VAE, 1024² with Qwen-Image's 8×), the start image resized to it; 1 step of 2.
UNSIZED = I2I.model_copy(update={"num_inference_steps": 2, "seed": 8})


@pytest.fixture(scope="module")
def unsized_expected(t2i_pipe):
    i2i = QwenImageImg2ImgPipeline.from_pipe(t2i_pipe)
    i2i.set_progress_bar_config(disable=True)
    p = UNSIZED
    out = i2i(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        true_cfg_scale=p.true_cfg_scale,
        image=Image.open(io.BytesIO(p.images[0])).convert("RGB"),
        strength=p.strength,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=MAX_LEN,
        output_type="np",
    )
    return to_uint8(out.images)[0]


@pytest.mark.slow  # the CLI's size rule is the server's (edit_request_size, served below); FLUX.1's CLI: test_edit_inpaint
def test_generate_cli_image_to_image_without_a_size_equals_pipeline(t2i_folder, unsized_expected, tmp_path):
    """``ditserve generate --image`` without --width/--height: the img2img pipeline's default size (it drew at
    the image's 96x64)."""
    side = resolve_model(str(t2i_folder)).default_size[0]
    assert unsized_expected.shape == (side, side, 3) and side != 96
    start = tmp_path / "start.png"
    start.write_bytes(UNSIZED.images[0])
    args = [*generate_args(UNSIZED)[4:], "--image", str(start)]
    assert "--width" not in args and "--height" not in args
    out = cli_generate(UNSIZED.prompt, t2i_folder, tmp_path / "out.png", *args)
    assert psnr(out, unsized_expected) >= 40


def test_serve_and_openai_client(t2i_folder, t2i_expected, unsized_expected):
    with served("--model", str(t2i_folder)) as server:
        unsized = openai_client(server).images.edit(
            model=t2i_folder.name,
            image=("start.png", UNSIZED.images[0], "image/png"),
            prompt=UNSIZED.prompt,
            extra_body=sampling_body(UNSIZED),
        )
        # One step: the scheduler's shift_terminal stretch divides 0 by 0, and the image was all black (NaN
        # latents; diffusers' pipeline draws the same). Refused naming the field; the server serves on.
        with pytest.raises(BadRequestError) as info:
            openai_client(server).images.generate(
                prompt=CFG.prompt, size="32x32", extra_body={"num_inference_steps": 1, "seed": 3}
            )
        assert info.value.body["param"] == "num_inference_steps"
        assert "at least 2 steps" in info.value.body["message"]
        result = openai_client(server).images.generate(
            model=t2i_folder.name,
            prompt=CFG.prompt,
            size="96x64",
            response_format="b64_json",
            extra_body={
                "num_inference_steps": 2,
                "seed": 3,
                "negative_prompt": "blurry",
                "true_cfg_scale": 3.0,
            },
        )
        # A session's first step with the same guidance fields draws the same image.
        sid = httpx.post(f"{server.base_url}/v1/sessions", json={"size": "96x64"}, timeout=60).json()["id"]
        step = {"prompt": CFG.prompt, **sampling_body(CFG)}
        session_step = httpx.post(f"{server.base_url}/v1/sessions/{sid}/generate", json=step, timeout=120)
    got = b64_pixels(result)
    assert session_step.status_code == 200, session_step.text
    assert (png_pixels(base64.b64decode(session_step.json()["data"][0]["b64_json"])) == got).all()
    assert got.shape == (64, 96, 3)
    assert psnr(got, t2i_expected[0]) >= 40
    # image-to-image without a size: the img2img pipeline's default size, not the image's 96x64
    side = unsized_expected.shape[0]
    assert unsized.size == f"{side}x{side}"
    assert psnr(b64_pixels(unsized), unsized_expected) >= 40


LORA_TARGETS = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.0.attn.add_v_proj",
    "transformer_blocks.0.img_mlp.net.0.proj",
    "transformer_blocks.1.attn.to_out.0",
    "transformer_blocks.1.attn.to_add_out",
    "transformer_blocks.1.img_mlp.net.2",
    "transformer_blocks.1.txt_mlp.net.2",
]


@pytest.fixture(scope="module")
def lora_file(t2i_folder, tmp_path_factory):
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = QwenImageTransformer2DModel.from_pretrained(t2i_folder / "transformer")
    torch.manual_seed(7)
    transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    )
    # B scaled up: random tiny weights over two steps otherwise change the image too little to see.
    state = {k: v * 40 if "lora_B" in k else v for k, v in get_peft_model_state_dict(transformer).items()}
    out = tmp_path_factory.mktemp("qwen-lora")
    QwenImagePipeline.save_lora_weights(out, transformer_lora_layers=state)
    return out / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def one_rank(t2i_folder, lora_file) -> list[np.ndarray]:
    """One engine's images for CFG with the adapter, PLAIN and I2I, submitted together (one batch)."""
    lora = CFG.model_copy(update={"lora": (LoRARef(name="style"),)})
    return engine_images(t2i_folder, {}, [lora, PLAIN, I2I], {"style": lora_file})


def test_lora_per_request_equals_load_lora_weights(t2i_folder, t2i_expected, lora_file, one_rank):
    pipe = load(QwenImagePipeline, t2i_folder)
    pipe.load_lora_weights(str(lora_file))
    want = diffusers_image(pipe, CFG)
    assert psnr(want, t2i_expected[0]) < 36  # the adapter changes the image (well past the 40 dB bar)
    with_lora, without, _ = one_rank
    assert psnr(with_lora, want) >= 40
    assert psnr(without, t2i_expected[1]) >= 40  # the same batch, no adapter


# Qwen-Image-Edit-2511's adapters on the modulation: one reference (an edit of two is checked above; the rows
# the modulation doubles are laid out alike with one, at half the reference tokens of the per-token targets,
# each adapted linear a Triton interpreter launch per forward on CPU).
PLUS_ONE = PLUS.model_copy(update={"images": (REF,)})
STYLED = PLUS_ONE.model_copy(update={"lora": (LoRARef(name="style"),), "seed": 6})


@pytest.fixture(scope="module")
def plus_one_expected(plus_pipe):
    return diffusers_image(plus_pipe, PLUS_ONE)


def styled_lora(plus_folder, plus_pipe, targets: list[str], folder) -> tuple:
    """A random adapter on ``targets`` (block 0's linears only: the rows are laid out alike in every block, and
    each adapted linear is a Triton interpreter launch per forward on CPU), and diffusers' image of STYLED with
    it (through ``load_lora_weights``)."""
    from tests.families.lora import save_random_lora

    file = save_random_lora(QwenImageEditPlusPipeline, plus_pipe.transformer, targets, folder)
    pipe = load(QwenImageEditPlusPipeline, plus_folder)
    pipe.load_lora_weights(str(file))
    return file, diffusers_image(pipe, STYLED)


def test_zero_cond_t_adapters_on_the_modulation_stay_with_their_request(
    plus_folder, plus_pipe, plus_one_expected, tmp_path
):
    """Qwen-Image-Edit-2511's transformer (zero_cond_t) runs its timestep embedding and every block's image
    modulation on [the batch's rows at t; the same rows at t = 0]. An adapter there reached the wrong rows of a
    mixed batch: the request without it, batched beside one with it, drew 30 dB from diffusers' image."""
    targets = [
        "timestep_embedder.linear_1",
        "timestep_embedder.linear_2",
        "transformer_blocks.0.img_mod.1",
        "transformer_blocks.0.img_mlp.net.2",
        "transformer_blocks.0.attn.to_q",
    ]
    file, want = styled_lora(plus_folder, plus_pipe, targets, tmp_path)
    ours = engine_images(plus_folder, {}, [STYLED, PLUS_ONE], {"style": file})
    assert psnr(want, diffusers_image(plus_pipe, STYLED)) < 35  # the adapter changes the image
    assert psnr(ours[0], want) >= 40
    assert psnr(ours[1], plus_one_expected) >= 40


def test_zero_cond_t_adapters_stay_with_their_request_after_a_weights_update(
    plus_folder, plus_pipe, plus_one_expected, tmp_path
):
    """A weights update brings a new transformer object: the rows its timestep embedding and image
    modulation run twice over are declared on it as on the one it replaces, so an adapter loaded before the
    update still reaches its own request's rows of a mixed batch (and the update keeps the adapter)."""
    from ditserve.replica.rank_control import ServingRankWorker

    targets = [
        "timestep_embedder.linear_1",
        "transformer_blocks.0.img_mod.1",
        "transformer_blocks.0.attn.to_q",
    ]
    file, want = styled_lora(plus_folder, plus_pipe, targets, tmp_path)
    worker = ServingRankWorker(EngineConfig(model=str(plus_folder)))
    worker.lora_load("style", str(file), 1.0)
    old = worker.pipe.transformer
    worker.stage_weights(str(plus_folder), "v2")
    worker.commit_weights("v2")
    assert worker.pipe.transformer is not old
    for name, params in (("styled", STYLED), ("plain", PLUS_ONE)):
        worker.add(name, params)
    while not worker.states["plain"].done:
        worker.step(["styled", "plain"])  # one batch: the adapter's rows beside rows without it
    ours = [worker.finish(name)["pixels"][0] for name in ("styled", "plain")]
    assert psnr(ours[0], want) >= 40
    assert psnr(ours[1], plus_one_expected) >= 40


def test_one_rank_image_to_image_equals_img2img_pipeline(t2i_pipe, t2i_expected, one_rank):
    want = img2img_image(QwenImageImg2ImgPipeline, t2i_pipe, I2I, max_sequence_length=MAX_LEN)
    assert one_rank[2].shape == want.shape == (64, 96, 3)
    assert psnr(one_rank[2], want) >= 40
    assert psnr(want, t2i_expected[0]) < 30  # not the text-to-image picture


def test_sessions_are_refused_where_a_step_would_be(t2i_folder, edit_folder, plus_folder):
    """A session's steps send prompts only, each from the last step's latents: Qwen-Image holds one, the edit
    models (a reference image in every request) are refused at POST /v1/sessions naming model, instead of
    opening a session whose every step is refused naming image."""
    from ditserve.cluster.api_sessions import session_refusal
    from ditserve.replica.models.registry import resolve_model

    assert session_refusal(resolve_model(str(t2i_folder)), "qwen") is None
    for folder in (edit_folder, plus_folder):
        refused = session_refusal(resolve_model(str(folder)), folder.name)
        assert refused is not None and refused.startswith(f"model: {folder.name} edits reference images")
        assert "POST /v1/images/edits" in refused
