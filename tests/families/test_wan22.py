"""Wan 2.2 through the engine's step loop: A14B's two experts (switching at boundary_ratio, each with its
own CFG scale) and TI2V-5B's per-token timesteps give diffusers' own pipelines' videos, alone and in one
batch whose requests sit on different experts; the sharded layouts give the single-rank videos."""

import shutil

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.pipelines.wan import WanRunner
from ditserve.replica.request import GenerationParams
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


def test_adapter_for_the_second_expert_is_refused(tmp_path):
    from safetensors.torch import save_file

    from ditserve.replica.lora.loader import read_lora_file

    # LoRA applies to the first expert (diffusers' default, load_into_transformer_2=False); a file that
    # also holds transformer_2 weights is refused rather than half-applied.
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    state = {
        f"{m}.blocks.0.attn1.to_q.lora_{x}.weight": w.clone()
        for m in ("transformer", "transformer_2")
        for x, w in zip("AB", (a, b), strict=True)
    }
    save_file(state, tmp_path / "both.safetensors")
    with pytest.raises(ValueError, match="second expert"):
        read_lora_file(tmp_path / "both.safetensors", "WanPipeline")


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
def test_a14b_weights_update_loads_both_experts_and_gives_the_pipelines_video(a14b_folder, tmp_path):
    """A weights update of a two-expert model was refused outright; it now reads both experts from the
    pipeline folder (a folder with one of them is refused naming the other), and the next video is
    WanPipeline's on the new folder, high-noise steps and low-noise steps alike."""
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
