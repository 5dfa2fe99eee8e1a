"""Wan 2.2 through the engine's step loop: A14B's two experts (switching at boundary_ratio, each with its
own CFG scale) and TI2V-5B's per-token timesteps give diffusers' own pipelines' videos, alone and in one
batch whose requests sit on different experts; the sharded layouts give the single-rank videos; LoRA
adapters load into either expert (a Wan 2.2 LoRA pair, or one file with both experts' weights) and give
diffusers' ``load_lora_weights(..., load_into_transformer_2=True)`` videos, per request in one batch."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import WanImageToVideoPipeline

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.wan import WanRunner
from ditserve.replica.request import GenerationParams, LoRARef
from tests.families.harness import openai_client, served
from tests.families.lora import save_random_lora
from tests.families.wan22 import TEXT_LENGTH, build_folder, build_tiny
from tests.helpers import psnr

# Timesteps (UniPC, flow shift 3): 2 steps 999, 750; 4 steps 999, 900, 750, 500. The boundary is 875,
# so at the second step the 2-step request runs transformer_2 while the 4-step one runs transformer.
A14B = [
    GenerationParams(
        prompt="waves on a beach",
        negative_prompt="blurry",
        width=64,
        height=48,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=4.0,
        guidance_scale_2=2.0,
        seed=11,
    ),
    GenerationParams(
        prompt="a red fox running",
        width=64,
        height=48,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=3.0,
        seed=12,
    ),
]


def red_square_png() -> bytes:
    import io

    from PIL import Image

    image = Image.new("RGB", (80, 60), (30, 60, 90))
    image.paste((220, 40, 20), (20, 10, 60, 50))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def diffusers_video(pipe, p: GenerationParams, image=None) -> tuple[np.ndarray, torch.Tensor]:
    """The pipeline's uint8 frames and final latents for ``p`` (the latents as they are decoded)."""
    final = {}

    def keep(_pipe, i, t, kwargs):
        final["latents"] = kwargs["latents"].clone()
        return {}

    kwargs = {} if image is None else {"image": image}
    out = pipe(
        prompt=p.prompt,
        negative_prompt=p.negative_prompt,
        height=p.height,
        width=p.width,
        num_frames=p.num_frames,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        guidance_scale_2=p.guidance_scale_2,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        max_sequence_length=TEXT_LENGTH,
        output_type="np",
        callback_on_step_end=keep,
        **kwargs,
    )
    return to_uint8(np.asarray(out.frames))[0], final["latents"]


def run_alone(runner, p: GenerationParams, req_id: str = "r"):
    state = runner.add(req_id, p)
    while not state.done:
        runner.step([state])
    return state


def assert_matches(runner, state, want) -> None:
    frames, latents = want
    assert torch.allclose(state.latents, latents, atol=1e-5, rtol=0), (state.latents - latents).abs().max()
    got = runner.decode(state)[0]
    assert got.shape == frames.shape
    assert psnr(got, frames) >= 40


@pytest.fixture(scope="module")
def a14b():
    pipe = build_tiny("a14b")
    pipe.set_progress_bar_config(disable=True)
    runner = WanRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=TEXT_LENGTH)
    return pipe, runner, [diffusers_video(pipe, p) for p in A14B]


def test_a14b_alone_matches_wan_pipeline(a14b):
    pipe, runner, reference = a14b
    state = runner.add("a", A14B[0])
    assert [runner.expert_of(s) for s in [state]] == [0]
    experts = []
    while not state.done:
        experts.append(runner.expert_of(state))
        runner.step([state])
    assert experts == [0, 1]  # high-noise expert, then the low-noise one
    assert_matches(runner, state, reference[0])


def test_a14b_batch_on_two_experts_matches_each_alone(a14b):
    pipe, runner, reference = a14b
    states = [runner.add(f"r{i}", p) for i, p in enumerate(A14B)]
    mixed = False
    while not all(s.done for s in states):
        live = [s for s in states if not s.done]
        mixed |= len({runner.expert_of(s) for s in live}) == 2
        runner.step(live)
    assert mixed  # one step split the batch by expert
    for state, want in zip(states, reference, strict=True):
        assert_matches(runner, state, want)


def test_a14b_second_expert_guidance_changes_the_video(a14b):
    pipe, runner, reference = a14b
    other = run_alone(runner, A14B[0].model_copy(update={"guidance_scale_2": 6.0}))
    assert not torch.allclose(other.latents, reference[0][1], atol=1e-3)


def test_a14b_step_cache_is_per_expert(a14b):
    from ditserve.replica.caching import CacheSettings
    from ditserve.replica.pipelines.base import usage

    _, runner, _ = a14b
    params = A14B[1].model_copy(
        update={"cache": CacheSettings(policy="fbcache", threshold=0.5), "num_inference_steps": 6}
    )
    state = run_alone(runner, params)
    # one cache per branch and expert: the low-noise expert never reuses the high-noise one's residuals
    assert sorted(state.extra["cache"]) == ["cond", "cond:expert1", "uncond", "uncond:expert1"]
    # each expert's first forward computes (nothing of its own to reuse yet)
    assert all(c.decisions[0] is False for c in state.extra["cache"].values())
    assert 0 < usage(state)["cached_forwards"] < usage(state)["transformer_forwards"] == 12


@pytest.fixture(scope="module")
def ti2v():
    pipe = build_tiny("ti2v")
    pipe.set_progress_bar_config(disable=True)
    runner = WanRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=TEXT_LENGTH)
    return pipe, runner


TI2V = GenerationParams(
    prompt="a red kite",
    negative_prompt="dark",
    width=64,
    height=64,
    num_frames=5,
    num_inference_steps=2,
    seed=5,
    guidance_scale=5.0,
)


def test_ti2v_text_matches_wan_pipeline(ti2v):
    pipe, runner = ti2v
    state = run_alone(runner, TI2V)
    assert state.extra["token_mask"].shape == (2 * 2 * 2,)  # 2 latent frames × 2×2 patches
    assert_matches(runner, state, diffusers_video(pipe, TI2V))


def test_ti2v_first_frame_matches_image_to_video_pipeline(ti2v):
    from PIL import Image

    pipe, runner = ti2v
    i2v = WanImageToVideoPipeline(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        scheduler=pipe.scheduler,
        transformer=pipe.transformer,
        expand_timesteps=True,
    )
    i2v.set_progress_bar_config(disable=True)
    import io

    params = TI2V.model_copy(update={"images": (red_square_png(),)})
    frames, _ = diffusers_video(i2v, params, image=Image.open(io.BytesIO(params.images[0])).convert("RGB"))
    # batched with a text-only request: per-token timesteps of both in one forward
    states = [runner.add("img", params), runner.add("txt", TI2V)]
    while not states[0].done:
        runner.step(states)
    got = runner.decode(states[0])[0]
    assert got.shape == frames.shape and psnr(got, frames) >= 40
    assert psnr(runner.decode(states[1])[0], diffusers_video(pipe, TI2V)[0]) >= 40


def test_inconsistent_two_expert_folders_are_refused(tmp_path):
    import json
    import shutil

    folder = build_folder(tmp_path / "a14b")
    assert resolve_model(str(folder)).family == "wan"
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    index = json.loads((broken / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="transformer_2 and boundary_ratio come together"):
        resolve_model(str(broken))


# -- the engine: sharded layouts against one rank, two experts, a batch on both ----------------------------
@pytest.fixture(scope="module")
def a14b_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("wan22") / "a14b")


def engine_latents(folder, flags: dict) -> list[np.ndarray]:
    engine = Engine(
        EngineConfig(model=str(folder), parallel=ParallelFlags(**flags), max_sequence_length=TEXT_LENGTH)
    ).start()
    try:
        if not flags:  # a text-to-video model takes no first frame
            with pytest.raises(ValueError, match="^input_reference: .* text-to-video"):
                engine.submit(A14B[0].model_copy(update={"images": (b"png",)}))
            # WanPipeline runs no CFG at guidance_scale 1: the second expert's scale would be dropped
            with pytest.raises(
                ValueError, match="^guidance_scale_2: 3 would do nothing with guidance_scale 1"
            ):
                engine.submit(A14B[0].model_copy(update={"guidance_scale": 1.0, "guidance_scale_2": 3.0}))
        futures = [engine.submit(p.model_copy(update={"return_latents": True})) for p in A14B]
        return [f.result(timeout=300).latents for f in futures]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def one_rank(a14b_folder):
    return engine_latents(a14b_folder, {})


def test_engine_one_rank_matches_runner(a14b, one_rank):
    _, _, reference = a14b
    for got, (_, latents) in zip(one_rank, reference, strict=True):
        np.testing.assert_allclose(got, latents.numpy(), atol=1e-5)


def test_a_video_past_the_rotary_table_is_refused_and_its_batch_served(a14b_folder, one_rank):
    """The tiny transformer's rope_max_seq_len (64 positions of 2×8 px, 64 latent frames) ends at 1024 px and
    253 frames: a larger request is refused naming size / num_frames (it failed the shared forward in the
    rotary embedding), the size before it is queued (POST /v1/videos answers 400); the request submitted
    beside them is served."""
    from ditserve.replica.config import Limits

    wide = A14B[0].model_copy(update={"width": 1040})
    long = A14B[0].model_copy(update={"num_frames": 257})
    config = EngineConfig(
        model=str(a14b_folder), max_sequence_length=TEXT_LENGTH, limits=Limits(max_frames=257)
    )
    engine = Engine(config).start()
    try:
        with pytest.raises(ValueError, match=r"^size: 1040x48 is above this model's largest 1024x1024$"):
            engine.submit(wide)
        futures = [engine.submit(p.model_copy(update={"return_latents": True})) for p in (long, A14B[0])]
        with pytest.raises(ValueError, match=r"^num_frames: 257 is above this model's most 253$"):
            futures[0].result(timeout=300)
        np.testing.assert_allclose(futures[1].result(timeout=300).latents, one_rank[0], atol=1e-5)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "flags",
    [
        # CFG and Ulysses in one 4-rank run; ring + TP and each axis alone with -m slow (test budget)
        {"cfg_parallel_size": 2, "ulysses_degree": 2},
        pytest.param({"ring_degree": 2, "tp_size": 2}, marks=pytest.mark.slow),
        pytest.param({"ulysses_degree": 2}, marks=pytest.mark.slow),
        pytest.param({"ring_degree": 2}, marks=pytest.mark.slow),
        pytest.param({"cfg_parallel_size": 2}, marks=pytest.mark.slow),
        pytest.param({"tp_size": 2}, marks=pytest.mark.slow),
    ],
    ids=lambda f: "-".join(f"{k.split('_')[0]}{v}" for k, v in f.items()),
)
def test_a14b_layouts_match_one_rank(a14b_folder, one_rank, flags):
    for got, want in zip(engine_latents(a14b_folder, flags), one_rank, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.slow
def test_ti2v_ulysses2_matches_one_rank(tmp_path):
    # per-token timesteps (2-D) are split with the video tokens; a text and a first-frame request together
    folder = build_folder(tmp_path / "ti2v", "ti2v")
    requests = [TI2V.model_copy(update={"images": (red_square_png(),)}), TI2V]

    def run(flags):
        engine = Engine(EngineConfig(model=str(folder), parallel=ParallelFlags(**flags))).start()
        try:
            futures = [engine.submit(p.model_copy(update={"return_latents": True})) for p in requests]
            return [f.result(timeout=300).latents for f in futures]
        finally:
            engine.shutdown()

    for got, want in zip(run({"ulysses_degree": 2}), run({}), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


# -- weights update ------------------------------------------------------------------------------------------
def test_a14b_weights_update_loads_both_experts_and_gives_the_pipelines_video(
    a14b_folder, expert_loras, tmp_path
):
    """A weights update of a two-expert model was refused outright; it now reads both experts from the
    pipeline folder (a folder with one of them is refused naming the other), and the next video is
    WanPipeline's on the new folder, high-noise steps and low-noise steps alike. An adapter loaded into the
    second expert before the update stays there, on the new weights."""
    from diffusers import WanPipeline
    from safetensors.torch import load_file, save_file

    from ditserve.replica.rank_control import ServingRankWorker

    new = tmp_path / "new"
    shutil.copytree(a14b_folder, new)
    generator = torch.Generator().manual_seed(0)
    for expert in ("transformer", "transformer_2"):
        for file in (new / expert).glob("*.safetensors"):
            tensors = load_file(file)
            save_file(
                {k: v + 0.2 * torch.randn(v.shape, generator=generator) for k, v in tensors.items()}, file
            )
    worker = ServingRankWorker(EngineConfig(model=str(a14b_folder), max_sequence_length=TEXT_LENGTH))
    with pytest.raises(ValueError, match=r"^path: .*/new/transformer lacks transformer/, transformer_2/"):
        worker.stage_weights(str(new / "transformer"), "v1")
    one_expert = tmp_path / "one-expert"
    shutil.copytree(new, one_expert, ignore=shutil.ignore_patterns("transformer_2"))
    with pytest.raises(
        ValueError, match=r"^path: .*/one-expert lacks transformer_2/: the served model has two"
    ):
        worker.stage_weights(str(one_expert), "v1")
    worker.lora_load("low", str(expert_loras["low"]), 1.0, "transformer_2")
    worker.stage_weights(str(new), "v2")
    worker.commit_weights("v2")
    p = A14B[0]  # two steps: the first on transformer, the second on transformer_2
    worker.add("r", p)
    while not worker.states["r"].done:
        worker.step(["r"])
    got = worker.finish("r")["pixels"][0]
    pipe = WanPipeline.from_pretrained(str(new))
    pipe.set_progress_bar_config(disable=True)
    want, _ = diffusers_video(pipe, p)
    assert got.shape == want.shape
    assert psnr(got, want) >= 40
    old, _ = diffusers_video(WanPipeline.from_pretrained(str(a14b_folder)), p)
    assert psnr(got, old) < 30  # the new weights draw another video
    worker.add("low", p.model_copy(update={"lora": (LoRARef(name="low"),)}))
    while not worker.states["low"].done:
        worker.step(["low"])
    got = worker.finish("low")["pixels"][0]
    pipe.load_lora_weights(str(expert_loras["low"]), adapter_name="low", load_into_transformer_2=True)
    assert psnr(got, diffusers_video(pipe, p)[0]) >= 40


# -- LoRA adapters on either expert ---------------------------------------------------------------------------
LORA_TARGETS = ["to_q", "to_v", "ffn.net.2"]
FPS = 16


@pytest.fixture(scope="module")
def expert_loras(a14b_folder, tmp_path_factory) -> dict[str, Path]:
    """A Wan 2.2 A14B LoRA pair as they are published: a high-noise and a low-noise file, each saved from its
    expert with the pipeline's own save_lora_weights (``transformer.`` keys both); and "both", one file with
    the high-noise weights under ``transformer.`` and the low-noise ones under ``transformer_2.``."""
    from diffusers import WanPipeline
    from safetensors import safe_open
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("wan22-loras")
    pipe = WanPipeline.from_pretrained(str(a14b_folder))
    files = {
        "high": save_random_lora(WanPipeline, pipe.transformer, LORA_TARGETS, root / "high", seed=21),
        "low": save_random_lora(WanPipeline, pipe.transformer_2, LORA_TARGETS, root / "low", seed=22),
    }
    tensors, config = {}, {}
    for expert, name in (("transformer", "high"), ("transformer_2", "low")):
        with safe_open(str(files[name]), "pt") as f:
            tensors |= {expert + k.removeprefix("transformer"): f.get_tensor(k) for k in f.keys()}
            saved = json.loads(f.metadata()["lora_adapter_metadata"])
            config |= {expert + k.removeprefix("transformer"): v for k, v in saved.items()}
    files["both"] = root / "both.safetensors"
    save_file(tensors, files["both"], metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    return files


@pytest.fixture(scope="module")
def lora_reference(a14b_folder, expert_loras) -> dict:
    """diffusers' (frames, latents): "low", A14B[0] with the low-noise file loaded by
    ``load_lora_weights(..., load_into_transformer_2=True)``; "both", A14B[1] with the high-noise file in the
    first expert as well. A14B[0] runs one step per expert, A14B[1] two."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(a14b_folder))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(expert_loras["low"]), adapter_name="low", load_into_transformer_2=True)
    low = diffusers_video(pipe, A14B[0])
    pipe.load_lora_weights(str(expert_loras["high"]), adapter_name="high")
    return {"low": low, "both": diffusers_video(pipe, A14B[1])}


def test_a_file_of_the_second_expert_goes_there_and_one_transformer_refuses_it(expert_loras, tmp_path):
    """A file with transformer_2. keys only loads into the second expert without a target; a model with one
    transformer (TI2V-5B) refuses it naming path, and a target of transformer_2 naming target."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ditserve.replica.lora.manager import LoRAManager
    from tests.families.wan22 import tiny_transformer

    with safe_open(str(expert_loras["both"]), "pt") as f:
        second = {k: f.get_tensor(k) for k in f.keys() if k.startswith("transformer_2.")}
    save_file(second, tmp_path / "second.safetensors")
    experts = LoRAManager(
        tiny_transformer(1), "WanPipeline", max_loras=2, max_rank=8, transformer_2=tiny_transformer(2)
    )
    info = experts.load("low", str(tmp_path / "second.safetensors"))
    assert info["target"] is None and all(name.startswith("transformer_2.") for name in experts.layers)
    assert len(experts.layers) == info["modules"] == 2 * 5  # per block: to_q, to_v of 2 attentions, ffn.net.2
    one = LoRAManager(tiny_transformer(1), "WanPipeline", max_loras=2, max_rank=8)
    with pytest.raises(ValueError, match=r"^path: adapter 'low' holds weights for a second expert"):
        one.load("low", str(tmp_path / "second.safetensors"))
    with pytest.raises(
        ValueError, match=r"^target: transformer_2 names a second expert, which this WanPipeline"
    ):
        one.load("low", str(expert_loras["low"]), target="transformer_2")
    assert not one.layers  # nothing was loaded


def as_mp4(frames: np.ndarray) -> np.ndarray:
    """``frames`` as they come back from the MP4 the server writes for them (H.264 is lossy)."""
    from ditserve.replica.media import decode_mp4, encode_mp4

    return decode_mp4(encode_mp4(frames, fps=FPS))


def test_a14b_adapters_load_into_either_expert_and_batch_per_request(
    a14b, a14b_folder, expert_loras, lora_reference
):
    """The low-noise file loaded into transformer_2 and the two-expert file give diffusers' videos, alone and
    in one batch (each request its own adapter, on whichever expert runs its step); a two-expert file given
    one target is refused naming target, and so is a file whose keys do not fit the expert."""
    _, _, plain = a14b
    engine = Engine(EngineConfig(model=str(a14b_folder), max_sequence_length=TEXT_LENGTH)).start()

    def run(*requests: tuple[GenerationParams, str]) -> list[np.ndarray]:
        futures = [
            engine.submit(p.model_copy(update={"return_latents": True, "lora": (LoRARef(name=name),)}))
            for p, name in requests
        ]
        return [f.result(timeout=300).latents for f in futures]

    try:
        low = engine.load_lora("low", str(expert_loras["low"]), target="transformer_2")
        both = engine.load_lora("both", str(expert_loras["both"]))
        assert low["target"] == "transformer_2" and both["modules"] == 2 * low["modules"]
        with pytest.raises(ValueError, match=r"^target: .*both.safetensors holds adapters for both experts"):
            engine.load_lora("one", str(expert_loras["both"]), target="transformer_2")
        alone = [run((A14B[0], "low"))[0], run((A14B[1], "both"))[0]]
        for got, name, (_, without) in zip(alone, ("low", "both"), plain, strict=True):
            np.testing.assert_allclose(got, lora_reference[name][1].numpy(), atol=1e-4)
            assert not np.allclose(got, without.numpy(), atol=1e-2)  # the adapter changed the video
        steps = engine.steps_run
        batched = run((A14B[0], "low"), (A14B[1], "both"))
        assert engine.steps_run - steps < 2 + 4  # they shared forwards
        for got, want in zip(batched, alone, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        engine.shutdown()


def test_generate_loads_a_lora_pair_into_the_two_experts(
    a14b, a14b_folder, expert_loras, lora_reference, tmp_path
):
    """``ditserve generate --lora high=FILE --lora low@transformer_2=FILE``: the pair as diffusers loads it."""
    p = A14B[1]
    out = tmp_path / "fox.mp4"
    cmd = [str(Path(sys.executable).with_name("ditserve")), "generate", p.prompt, "--model", str(a14b_folder)]
    cmd += [
        "--width",
        "64",
        "--height",
        "48",
        "--num-frames",
        "5",
        "--num-inference-steps",
        "4",
        "--fps",
        "16",
    ]
    cmd += ["--guidance-scale", "3", "--seed", "12", "-o", str(out)]
    cmd += ["--lora", f"high={expert_loras['high']}", "--lora", f"low@transformer_2={expert_loras['low']}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from ditserve.replica.media import decode_mp4

    got = decode_mp4(out.read_bytes())
    assert psnr(got, as_mp4(lora_reference["both"][0])) >= 40
    assert psnr(got, as_mp4(a14b[2][1][0])) < 35  # the video without adapters is another one
    bad = subprocess.run(
        [*cmd, "--lora", f"x@transformer_3={expert_loras['low']}"], capture_output=True, text=True
    )
    assert (
        bad.returncode == 2
        and "TARGET 'transformer_3' must be one of transformer, transformer_2" in bad.stderr
    )


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_serve_loads_adapters_into_either_expert(a14b, a14b_folder, expert_loras, lora_reference):
    """``serve --lora-path low@transformer_2=FILE``, the two-expert file by POST /v1/loras, a target by gRPC's
    LoadLoRA: the videos API gives diffusers' videos, two requests with different adapters at once."""
    import grpc

    from ditserve.cluster.client import Client
    from ditserve.replica.media import decode_mp4

    limits = ["--max-frames", "9", "--max-width", "64", "--max-height", "64"]
    with served(
        "--model", str(a14b_folder), "--lora-path", f"low@transformer_2={expert_loras['low']}", *limits
    ) as server:
        url = f"{server.base_url}/v1/loras"
        r = httpx.post(url, json={"name": "both", "path": str(expert_loras["both"])}, timeout=120)
        assert r.status_code == 200, r.text
        r = httpx.post(
            url, json={"name": "x", "path": str(expert_loras["both"]), "target": "transformer_2"}, timeout=120
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "target", r.text
        assert "holds adapters for both experts" in r.json()["error"]["message"]
        with Client(f"127.0.0.1:{server.grpc_port}") as client:
            client.load_lora("low2", str(expert_loras["low"]), target="transformer_2")
            with pytest.raises(grpc.RpcError) as err:
                client.load_lora("bad", str(expert_loras["low"]), target="transformer_3")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "target" in err.value.details()
            listed = {a.name: a.target if a.HasField("target") else None for a in client.list_loras().data}
        assert listed == {"low": "transformer_2", "both": None, "low2": "transformer_2"}
        assert httpx.get(url, timeout=60).json()["data"][0]["target"] == "transformer_2"
        videos = openai_client(server).videos
        with pytest.raises(openai.BadRequestError) as err:  # without CFG, guidance_scale_2 would do nothing
            videos.create(prompt="a", size="64x48", extra_body={"guidance_scale": 1, "guidance_scale_2": 3})
        assert err.value.body["param"] == "guidance_scale_2", err.value.body
        jobs = {}
        for name, p in (("low", A14B[0]), ("both", A14B[1])):  # together: one batch, an adapter each
            fields = {
                "num_frames": 5,
                "num_inference_steps": p.num_inference_steps,
                "seed": p.seed,
                "fps": FPS,
            }
            fields |= {"guidance_scale": p.guidance_scale, "guidance_scale_2": p.guidance_scale_2}
            # the client sends a multipart form: the adapters as JSON text
            fields |= {"negative_prompt": p.negative_prompt, "lora": json.dumps([{"name": name}])}
            fields = {k: v for k, v in fields.items() if v is not None}
            jobs[name] = videos.create(prompt=p.prompt, size="64x48", extra_body=fields)
        for (name, job), (plain, _) in zip(jobs.items(), a14b[2], strict=True):
            job = videos.poll(job.id, poll_interval_ms=200)
            assert job.status == "completed", job
            got = decode_mp4(videos.download_content(job.id).read())
            assert psnr(got, as_mp4(lora_reference[name][0])) >= 40, name
            assert psnr(got, as_mp4(plain)) < 35, name  # the video without adapters is another one


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{"tp_size": 2}, {"ulysses_degree": 2}], ids=["tp2", "ulysses2"])
def test_a14b_adapters_on_both_experts_under_layouts_match_one_rank(a14b_folder, expert_loras, flags):
    """The two-expert file under tensor parallelism (each rank its shard of both experts' adapters) and
    Ulysses gives the one-rank latents."""

    def run(layout: dict) -> list[np.ndarray]:
        config = EngineConfig(
            model=str(a14b_folder), parallel=ParallelFlags(**layout), max_sequence_length=TEXT_LENGTH
        )
        engine = Engine(config).start()
        try:
            engine.load_lora("both", str(expert_loras["both"]))
            update = {"return_latents": True, "lora": (LoRARef(name="both"),)}
            futures = [engine.submit(p.model_copy(update=update)) for p in A14B]
            return [f.result(timeout=300).latents for f in futures]
        finally:
            engine.shutdown()

    for got, want in zip(run(flags), run({}), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
