"""FLUX.2 dev and Klein through the engine's own step loop: one rank gives diffusers' own images (text
only and with a reference image), through ``ditserve generate --image`` too; ulysses 2, ring 2 and tp 2
(with a LoRA) give the one-rank images, Klein's cfg 2 its pipeline's; ``ditserve serve`` answers the openai
client's generate and edit; a PEFT LoRA per request gives what diffusers' ``load_lora_weights`` gives."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from PIL import Image

from ditserve.replica.caching.settings import CacheSettings
from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.pipelines.flux2 import Flux2KleinRunner, Flux2Runner, TextProcessor
from ditserve.replica.request import GenerationParams, LoRARef
from tests.families.flux2 import MAX_TEXT_TOKENS, as_pixtral_folder, build_folder
from tests.helpers import ServeProcess, png_pixels, psnr


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


def load(cls, folder):
    pipe = cls.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


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


def run_runner(runner, requests: list[GenerationParams]) -> list[np.ndarray]:
    """The requests stepped to the end, those of one bucket (size and reference sizes) batched together."""
    states = [runner.add(f"r{i}", p) for i, p in enumerate(requests)]
    while not all(s.done for s in states):
        for bucket in dict.fromkeys(s.bucket for s in states):
            runner.step([s for s in states if s.bucket == bucket and not s.done])
    return [runner.decode(s)[0] for s in states]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread here and in the ranks and servers started from here: these models are a few
    kilobytes wide, and on a shared 2-core machine more threads only contend (10× slower measured)."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="module")
def dev_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("models") / "flux2-dev-tiny")


@pytest.fixture(scope="module")
def klein_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("models") / "flux2-klein-tiny", klein=True)


@pytest.fixture(scope="module")
def dev_pipe(dev_folder):
    return load(Flux2Pipeline, dev_folder)


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
    return load(Flux2KleinPipeline, klein_folder)


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
    engine = Engine(EngineConfig(model=str(folder))).start()
    try:
        assert isinstance(engine.launcher.worker.pipe.tokenizer, TextProcessor)
        image = png_pixels(engine.generate(TEXT, timeout=120).outputs[0])
    finally:
        engine.shutdown()
    assert psnr(image, dev_expected[0]) >= 40


def test_generate_cli_with_reference_image(dev_folder, dev_expected, tmp_path):
    ref = tmp_path / "ref.png"
    ref.write_bytes(REF)
    out = tmp_path / "out.png"
    cmd = [sys.executable, "-m", "ditserve.cluster.cli", "generate", EDIT.prompt, "--model", str(dev_folder)]
    cmd += ["--width", "64", "--height", "64", "--num-inference-steps", "3", "--guidance-scale", "2.5"]
    cmd += ["--seed", "4", "--image", str(ref), "--max-sequence-length", "512", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert psnr(np.array(Image.open(out)), dev_expected[1]) >= 40


# Ring shares sequence_parallel_attention with Ulysses (the family code is the same): in the slow matrix.
LAYOUTS = [{"ulysses_degree": 2}, pytest.param({"ring_degree": 2}, marks=pytest.mark.slow), {"tp_size": 2}]


def engine_images(folder, flags: dict, requests: list[GenerationParams], lora=None) -> list[np.ndarray]:
    engine = Engine(EngineConfig(model=str(folder), parallel=ParallelFlags(**flags))).start()
    try:
        if lora is not None:
            engine.load_lora(lora[0], str(lora[1]))
        futures = [engine.submit(p) for p in requests]  # submitted together: they share steps
        return [png_pixels(f.result(timeout=120).outputs[0]) for f in futures]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def one_rank(dev_folder):
    return engine_images(dev_folder, {}, [TEXT, EDIT])


def test_one_rank_engine_equals_diffusers(one_rank, dev_expected):
    for got, want in zip(one_rank, dev_expected, strict=True):
        assert psnr(got, want) >= 40


@pytest.mark.parametrize(
    "flags", LAYOUTS, ids=lambda f: "-".join(f"{k.split('_')[0]}{v}" for k, v in f.items())
)
def test_layouts_equal_one_rank(dev_folder, one_rank, flags, lora_file, lora_expected):
    requests, lora = [TEXT, EDIT], None
    if "tp_size" in flags:  # and an adapter on the packed linears, sliced per rank
        requests.append(TEXT.model_copy(update={"lora": (LoRARef(name="style"),)}))
        lora = ("style", lora_file)
    got = engine_images(dev_folder, flags, requests, lora=lora)
    for image, want in zip(got, [*one_rank, lora_expected][: len(got)], strict=True):
        assert image.shape == want.shape
        assert psnr(image, want) >= 40


@pytest.mark.slow
def test_klein_cfg_parallel_equals_pipeline(klein_folder, klein_expected):
    """Klein's two branches on two ranks (cfg 2): the empty-prompt branch runs on rank 1."""
    got = engine_images(klein_folder, {"cfg_parallel_size": 2}, [TEXT, EDIT])
    for image, want in zip(got, klein_expected, strict=True):
        assert psnr(image, want) >= 40


def test_serve_and_openai_client(dev_folder, dev_expected):
    import base64

    from openai import OpenAI

    server = ServeProcess("--model", str(dev_folder))
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        result = client.images.generate(
            model=dev_folder.name,
            prompt=TEXT.prompt,
            size="64x64",
            response_format="b64_json",
            extra_body={"num_inference_steps": 3, "seed": 3, "guidance_scale": 4.0},
        )
        got = png_pixels(base64.b64decode(result.data[0].b64_json))
        assert got.shape == (64, 64, 3)
        assert psnr(got, dev_expected[0]) >= 40
        # POST /v1/images/edits: the uploaded file is the reference image.
        edited = client.images.edit(
            model=dev_folder.name,
            image=("ref.png", REF, "image/png"),
            prompt=EDIT.prompt,
            size="64x64",
            response_format="b64_json",
            extra_body={"num_inference_steps": 3, "seed": 4, "guidance_scale": 2.5},
        )
        assert psnr(png_pixels(base64.b64decode(edited.data[0].b64_json)), dev_expected[1]) >= 40
    finally:
        assert server.stop() == 0, server.output()


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
    pipe = load(Flux2Pipeline, dev_folder)
    pipe.load_lora_weights(str(lora_file))
    return diffusers_image(pipe, TEXT)


def test_lora_per_request_equals_load_lora_weights(dev_folder, lora_file, lora_expected, dev_expected):
    want = lora_expected
    assert psnr(want, dev_expected[0]) < 30  # the adapter changes the image
    engine = Engine(EngineConfig(model=str(dev_folder))).start()
    try:
        engine.load_lora("style", str(lora_file))
        futures = [
            engine.submit(TEXT.model_copy(update={"lora": (LoRARef(name="style"),)})),
            engine.submit(TEXT),
        ]
        with_lora, without = (png_pixels(f.result(timeout=120).outputs[0]) for f in futures)
    finally:
        engine.shutdown()
    assert psnr(with_lora, want) >= 40
    assert psnr(without, dev_expected[0]) >= 40  # the same batch, no adapter
