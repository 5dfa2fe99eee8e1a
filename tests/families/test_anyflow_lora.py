"""AnyFlow-FAR adapters, per request: whole videos drawn with a diffusers/PEFT file and with a file in Wan's
original layout (``diffusion_model.`` names, lora_down / lora_up with alphas, as ComfyUI and musubi-tuner save
them), each at its own scale and beside a request without adapters in the engine, give the videos
``AnyFlowFARPipeline`` draws after ``load_lora_weights`` + ``set_adapters``: every forward of a request's
chunks and of its K/V cache encodings carries its adapter, and none other's."""

import numpy as np
import pytest
import torch
from diffusers import AnyFlowFARPipeline
from safetensors.torch import save_file

from ditserve.kernels import _dispatch as dispatch
from ditserve.replica.config import EngineConfig
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.rank_control import ServingRankWorker
from ditserve.replica.request import GenerationParams, LoRARef
from tests.families.anyflow import build_folder
from tests.families.harness import (
    frames,
    layout_id,
    load_pipeline,
    running_engine,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.families.lora import save_random_lora
from tests.helpers import psnr

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_LEN = 32
# 2 chunks of latent frames [1, 2] (the engine's partition of the tiny folder's 3 latent frames): the second
# attends to the K/V cache of the first
PARTITION = [1, 2]
FRAMES = 9
PLAIN = GenerationParams(
    prompt="a red fox running", width=64, height=64, num_frames=FRAMES, num_inference_steps=2, seed=7
)
STYLE = PLAIN.model_copy(
    update={
        "guidance_scale": 3.0,
        "negative_prompt": "blurry",
        "seed": 8,
        "lora": (LoRARef(name="style", scale=0.3),),
    }
)
INK = PLAIN.model_copy(update={"lora": (LoRARef(name="ink"),)})  # PLAIN with an adapter
# Wan's original module names (diffusion_model.<name>) of the tiny transformer's linears, as diffusers' Wan
# converter maps them
ORIGINAL = {
    **{
        f"blocks.{i}.{attn}.{o}": f"blocks.{i}.{ours}.{c}"
        for i in range(2)
        for attn, ours in (("self_attn", "attn1"), ("cross_attn", "attn2"))
        for o, c in zip("qkvo", ("to_q", "to_k", "to_v", "to_out.0"), strict=True)
    },
    **{f"blocks.{i}.ffn.0": f"blocks.{i}.ffn.net.0.proj" for i in range(2)},
    **{f"blocks.{i}.ffn.2": f"blocks.{i}.ffn.net.2" for i in range(2)},
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("anyflow-lora") / "tiny-anyflow-far")


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory) -> dict:
    """``style``: a PEFT file on every linear of the transformer (the time, delta and text embedders too),
    saved by the pipeline's save_lora_weights; ``ink``: Wan's original layout with alphas."""
    root = tmp_path_factory.mktemp("anyflow-loras")
    transformer = AnyFlowFARPipeline.from_pretrained(folder).transformer
    linears = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    style = save_random_lora(AnyFlowFARPipeline, transformer, linears, root / "style", rank=2)
    g = torch.Generator().manual_seed(3)
    ink = {}
    for original, module in ORIGINAL.items():
        linear = transformer.get_submodule(module)
        key = f"diffusion_model.{original}"
        ink[f"{key}.lora_down.weight"] = torch.randn(4, linear.in_features, generator=g)
        ink[f"{key}.lora_up.weight"] = torch.randn(linear.out_features, 4, generator=g) * 0.5
        ink[f"{key}.alpha"] = torch.tensor(2.0)
    save_file(ink, str(root / "ink.safetensors"))
    return {"style": style, "ink": root / "ink.safetensors"}


def pipeline_video(pipe, p: GenerationParams) -> np.ndarray:
    guided = p.guidance_scale is not None and p.guidance_scale > 1
    out = pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt if guided else None,
        guidance_scale=p.guidance_scale if guided else 1.0,
        height=p.height,
        width=p.width,
        num_frames=p.num_frames,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=MAX_LEN,
        chunk_partition=PARTITION,
        output_type="np",
    )
    return to_uint8(np.asarray(out.frames))[0]


@pytest.fixture(scope="module")
def expected(folder, files) -> list[np.ndarray]:
    pipe = load_pipeline(AnyFlowFARPipeline, folder)
    plain = pipeline_video(pipe, PLAIN)
    pipe.load_lora_weights(str(files["style"]), adapter_name="style")
    pipe.load_lora_weights(str(files["ink"]), adapter_name="ink")
    pipe.set_adapters("style", 0.3)
    style = pipeline_video(pipe, STYLE)
    pipe.set_adapters("ink", 1.0)
    return [plain, style, pipeline_video(pipe, INK)]


def test_adapters_per_request_equal_load_lora_weights(folder, files, expected, monkeypatch):
    """Three whole videos stepped together (one guided), the adapters loaded as POST /v1/loras and --lora-path
    load them: each equals the pipeline's with its adapter. Every adapter load on AnyFlow-FAR was refused
    ('takes no adapters'), though diffusers' pipeline has Wan's LoRA loader."""
    assert resolve_model(str(folder)).takes_adapters
    # the LoRA path a CPU user runs (torch), not the Triton interpreter this process turns on for its kernel
    # tests (tests.helpers.user_env: ten times slower)
    monkeypatch.setattr(dispatch, "_INTERPRET_AT_IMPORT", False)
    worker = ServingRankWorker(EngineConfig(model=str(folder), max_sequence_length=MAX_LEN))
    for name, file in files.items():
        worker.lora_load(name, str(file))
    requests = {"plain": PLAIN, "style": STYLE, "ink": INK}
    for req_id, p in requests.items():
        worker.add(req_id, p)
    while not all(worker.states[r].done for r in requests):
        worker.step(list(requests))
    got = [worker.finish(r)["pixels"][0] for r in requests]
    for name, g, w in zip(requests, got, expected, strict=True):
        assert g.shape == w.shape, name
        assert psnr(g, w) >= 40, (name, psnr(g, w))
    assert psnr(got[2], got[0]) < 30  # the adapter changes the video it is drawn beside
    # a realtime session's chunks take none (POST /v1/realtime, /v1/sessions): refused naming lora
    with pytest.raises(ValueError, match="^lora: realtime sessions of AnyFlow-FAR take no adapters"):
        worker.add_chunk("c", "s", 0, INK.model_copy(update={"num_frames": 8}), 2)


@pytest.mark.slow  # three engines (~1 min); the adapters' one-rank videos are checked against diffusers above
@pytest.mark.parametrize("flags", [{"ulysses_degree": 2}, {"ring_degree": 2}], ids=layout_id)
def test_sequence_parallel_adapters_equal_one_rank(folder, files, flags, monkeypatch):
    """Under Ulysses and ring each rank's LoRA layers see its share of a request's tokens (and of its K/V
    cache encodings): the served videos are the one-rank engine's."""
    monkeypatch.setattr(dispatch, "_INTERPRET_AT_IMPORT", False)
    with running_engine(folder, {}, files, max_sequence_length=MAX_LEN) as engine:
        want = frames(engine, [PLAIN, STYLE, INK])
    with running_engine(folder, flags, files, max_sequence_length=MAX_LEN) as engine:
        got = frames(engine, [PLAIN, STYLE, INK])
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)
    assert psnr(got[2], got[0]) < 30
