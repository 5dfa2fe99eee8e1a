"""AnyFlow-FAR on CPU: the engine's chunks (a realtime session, one chunk at a time through the step loop)
and its whole videos equal diffusers' ``AnyFlowFARPipeline`` for the same seed and chunk partition; a prompt
change moves only the chunks after it; Ulysses, ring and both shard a session's forwards and its K/V cache
and give the one-rank chunks and videos; the other layouts are refused naming the flags."""

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AnyFlowFARPipeline
from PIL import Image
from torch.overrides import TorchFunctionMode

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import validate_layout
from ditserve.replica.media import decode_mp4
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.pipelines.anyflow import kv_cache_bytes
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.request import GenerationParams
from tests.families.anyflow import build_folder
from tests.families.harness import (
    layout_id,
    load_pipeline,
    results,
    running_engine,
    single_thread,  # noqa: F401 (a fixture, used by pytestmark)
)
from tests.helpers import psnr

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_LEN = 32
FRAMES_PER_CHUNK = 8  # 2 latent frames per chunk after the first chunk's one frame
CHUNKS = 4  # past full_chunk_limit (3): the oldest chunk goes through the compressed patches
SETTINGS = dict(prompt="a red fox running", width=64, height=64, num_inference_steps=2, seed=7)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("anyflow") / "tiny-anyflow-far")


@pytest.fixture(scope="module")
def pipe(folder):
    return load_pipeline(AnyFlowFARPipeline, folder)


@pytest.fixture(scope="module")
def engine(folder):
    with running_engine(folder, device="cpu", dtype="float32", max_sequence_length=MAX_LEN) as engine:
        yield engine


def diffusers_frames(pipe, prompt: str, chunks: int, guidance_scale: float = 1.0, video=None) -> np.ndarray:
    partition = [1] + [FRAMES_PER_CHUNK // 4] * (chunks - 1)
    out = pipe(
        prompt=prompt,
        video=video,
        height=SETTINGS["height"],
        width=SETTINGS["width"],
        num_frames=(sum(partition) - 1) * 4 + 1,
        num_inference_steps=SETTINGS["num_inference_steps"],
        guidance_scale=guidance_scale,
        negative_prompt="blurry" if guidance_scale > 1 else None,
        generator=torch.Generator("cpu").manual_seed(SETTINGS["seed"]),
        max_sequence_length=MAX_LEN,
        chunk_partition=partition,
        output_type="np",
    )
    return to_uint8(np.asarray(out.frames))[0]


def session(engine, sid: str, prompts: list[str], max_chunks: int | None, **extra) -> list[np.ndarray]:
    """A realtime session's chunks as the server streams them (chunk k uses ``prompts[k]``): chunk k + 1 is
    queued as soon as chunk k is denoised, while chunk k's frames are still being decoded."""
    frames = []
    for k, prompt in enumerate(prompts):
        params = GenerationParams(**{**SETTINGS, "prompt": prompt, **extra}, num_frames=FRAMES_PER_CHUNK)
        chunk = engine.submit_chunk(sid, k, params, max_chunks)
        chunk.denoised.result(timeout=120)
        frames.append(chunk.frames)
    out = [f.result(timeout=120) for f in frames]
    engine.close_session(sid).result(timeout=30)
    return out


@pytest.fixture(scope="module")
def solo(engine):
    """A session's chunks with the engine doing nothing else."""
    return session(engine, "r1.a", [SETTINGS["prompt"]] * CHUNKS, max_chunks=CHUNKS)


def test_session_chunks_equal_the_pipeline(solo, pipe):
    want = diffusers_frames(pipe, SETTINGS["prompt"], CHUNKS)
    chunks = solo
    assert [c.shape[0] for c in chunks] == [1] + [FRAMES_PER_CHUNK] * (CHUNKS - 1)
    assert all(c.shape[1:] == (64, 64, 3) and c.dtype == np.uint8 for c in chunks)
    got = np.concatenate(chunks)
    assert got.shape == want.shape
    assert psnr(got, want) >= 40, psnr(got, want)


def test_whole_video_with_cfg_equals_the_pipeline(engine, pipe):
    """A batch request (POST /v1/videos): every chunk in one job, guided (an uncond branch)."""
    want = diffusers_frames(pipe, SETTINGS["prompt"], 3, guidance_scale=3.0)
    runner = engine.launcher.worker.runner
    params = GenerationParams(
        **SETTINGS, num_frames=want.shape[0], guidance_scale=3.0, negative_prompt="blurry"
    )
    state = runner.add("whole", params)
    steps = 0
    while not state.done:
        runner.step([state])
        steps += 1
    assert steps == 3 * SETTINGS["num_inference_steps"]
    got = runner.decode(state)[0]
    assert got.shape == want.shape and psnr(got, want) >= 40, psnr(got, want)


def test_prompt_change_moves_only_later_chunks_and_endless_sessions_repeat(engine):
    base = session(engine, "r1.b", ["a red fox"] * 3, max_chunks=None)
    again = session(engine, "r2.c", ["a red fox"] * 3, max_chunks=None)
    changed = session(engine, "r1.d", ["a red fox", "a red fox", "a blue whale at night"], max_chunks=None)
    for a, b in zip(base, again, strict=True):
        np.testing.assert_array_equal(a, b)  # the same init on another session (or replica): the same frames
    np.testing.assert_array_equal(changed[0], base[0])
    np.testing.assert_array_equal(changed[1], base[1])
    assert not np.array_equal(changed[2], base[2])  # (a tiny random model: the text moves pixels a little)


def test_chunk_out_of_order_and_bad_sizes_are_refused(engine):
    params = GenerationParams(**SETTINGS, num_frames=FRAMES_PER_CHUNK)
    with pytest.raises(ValueError, match="^chunk_index"):
        engine.submit_chunk("r1.e", 1, params, None).frames.result(timeout=60)
    with pytest.raises(ValueError, match="^size"):
        engine.submit_chunk("r1.e", 0, params.model_copy(update={"width": 72}), None)
    with pytest.raises(ValueError, match="^num_frames"):
        engine.submit_chunk("r1.e", 0, params.model_copy(update={"num_frames": 6}), None)
    runner = engine.launcher.worker.runner
    with pytest.raises(ValueError, match="^cache"):  # not silently ignored by the chunk loop
        runner.add("cached", GenerationParams(**SETTINGS, num_frames=9, cache={"policy": "fbcache"}))


def test_a_video_too_small_for_its_compressed_chunks_is_refused_naming_size(engine):
    """Past full_chunk_limit (3) chunks the oldest are kept as 4×4 latent patches, 32 px here: a 16x16 video
    of 4 chunks (29 frames: latent chunks 1, 3, 3, 1) failed in the transformer after its third chunk; it is
    refused before it is queued, naming size, and the same size in 3 chunks is made."""
    small = GenerationParams(**{**SETTINGS, "width": 16, "height": 16}, num_frames=29)
    with pytest.raises(ValueError, match="^size: 16x16 is too small past 3 chunks: .* at least 32"):
        engine.submit(small)
    video = engine.submit(small.model_copy(update={"num_frames": 21})).result(timeout=300).outputs[0]
    assert decode_mp4(video).shape == (21, 16, 16, 3)


def test_layouts_other_than_ulysses_and_ring_are_refused_naming_the_flags(folder):
    spec = resolve_model(str(folder))
    for flags, named in (
        ({"tp_size": 2}, "--tp-size 2"),
        ({"cfg_parallel_size": 2}, "--cfg-parallel-size 2"),
        # --sp-degree 2 picks K/V-gather: named as typed ('--kv-gather-degree (or --sp-degree 2) 2' was)
        ({"sp_degree": 2}, r"--sp-degree 2 \(runs as --kv-gather-degree 2\)"),
    ):
        config = EngineConfig(
            model=str(folder), device="cpu", dtype="float32", parallel=ParallelFlags(**flags)
        )
        with pytest.raises(
            ValueError, match=f"^{named}.*shards over --ulysses-degree, --ring-degree only"
        ) as err:
            validate_layout(config, spec)
        assert "--dp-size" in str(err.value)
    for flags, world in (
        ({"ulysses_degree": 2}, 2),
        ({"ring_degree": 2}, 2),
        ({"ulysses_degree": 2, "ring_degree": 2}, 4),
    ):
        config = EngineConfig(
            model=str(folder), device="cpu", dtype="float32", parallel=ParallelFlags(**flags)
        )
        assert validate_layout(config, spec) == world


def test_ulysses_2_session_equals_one_rank(folder, engine, solo):
    """Ranks in processes (gloo): each forward's tokens split over 2 ranks, each rank caching half the
    heads; the chunks (past full_chunk_limit: the compressed cache too) equal the one-rank chunks; a longer
    session at a size whose token counts do not divide by 2, whose later cache forwards keep the oldest
    chunks' K/V (their tokens after the kept ones, padded), too."""
    flags = {"ulysses_degree": 2}
    prompts = [SETTINGS["prompt"]] * (CHUNKS + 2)
    want = session(engine, "r1.u", prompts, max_chunks=None, **UNEVEN)
    with running_engine(folder, flags, device="cpu", dtype="float32", max_sequence_length=MAX_LEN) as sharded:
        chunks = session(sharded, "r3.u", [SETTINGS["prompt"]] * CHUNKS, max_chunks=CHUNKS)
        longer = session(sharded, "r3.v", prompts, max_chunks=None, **UNEVEN)
    for got, ref in zip(chunks, solo, strict=True):
        assert got.shape == ref.shape and psnr(got, ref) >= 40, psnr(got, ref)
    assert_same_chunks(longer, want)


def assert_same_chunks(chunks: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Chunk by chunk, the one-rank frames up to fp32 rounding (a pixel level here and there: 90 dB and up
    here). The tiny random model moves pixels little when attention changes: a pad key counted twice
    still gives 56-66 dB, so 40 dB would not tell."""
    for got, ref in zip(chunks, want, strict=True):
        assert got.shape == ref.shape and psnr(got, ref) >= 75, psnr(got, ref)


# 80x48: 15 tokens per latent frame (2 compressed), so the first chunk (15 tokens), the others (30) and the
# cache forwards (15, 45, 62 tokens) do not split evenly over 2 or 4 ranks: the sequence is padded.
UNEVEN = {"width": 80, "height": 48}


@pytest.fixture(scope="module")
def solo_uneven(engine):
    return session(engine, "r1.h", [SETTINGS["prompt"]] * CHUNKS, max_chunks=CHUNKS, **UNEVEN)


@pytest.fixture(scope="module")
def ring_engine(folder):
    with running_engine(
        folder, {"ring_degree": 2}, device="cpu", dtype="float32", max_sequence_length=MAX_LEN
    ) as engine:
        yield engine


def test_ring_2_session_equals_one_rank_chunk_by_chunk(ring_engine, solo, solo_uneven):
    """Ranks in processes (gloo): each forward's tokens in two contiguous halves, each rank caching its half
    of every cached chunk (the cache forward sharded too), attention over [cache | chunk | pad keys] by ring
    passes; over 4 chunks (the oldest through the compressed patches at the last one), at a size whose
    token counts divide by 2 and at one whose first chunk has an odd count (padded)."""
    chunks = session(ring_engine, "r4.a", [SETTINGS["prompt"]] * CHUNKS, max_chunks=CHUNKS)
    uneven = session(ring_engine, "r4.b", [SETTINGS["prompt"]] * CHUNKS, max_chunks=CHUNKS, **UNEVEN)
    assert_same_chunks(chunks + uneven, solo + solo_uneven)


def test_ring_2_whole_video_with_cfg_equals_one_rank(ring_engine, engine):
    """A batch request (every chunk in one job), guided (two rows in each forward)."""
    params = GenerationParams(
        **SETTINGS, num_frames=33, guidance_scale=3.0, negative_prompt="blurry", return_latents=True
    )
    [want] = results(engine, [params])
    [got] = results(ring_engine, [params])
    np.testing.assert_allclose(got.latents, want.latents, rtol=0, atol=1e-4)  # the last chunk's
    want, got = decode_mp4(want.outputs[0]), decode_mp4(got.outputs[0])
    assert want.shape[0] == 33  # 9 latent frames: chunks of 1, 3, 3, 2 (the first one compressed at the last)
    assert got.shape == want.shape and psnr(got, want) >= 40, psnr(got, want)


@pytest.mark.parametrize(
    "flags", [{"ulysses_degree": 2, "ring_degree": 2}, {"ring_degree": 4}], ids=layout_id
)
def test_4_rank_sessions_equal_one_rank(folder, solo_uneven, flags):
    """4 ranks at the size whose token counts do not divide by 4: Ulysses pairs inside ring pairs (each rank
    caches half the heads of half the tokens), and a ring of 4 (blocks pass through both receive buffers;
    the first chunk's 15 tokens are blocks of 4, 4, 4 and 3)."""
    with running_engine(folder, flags, device="cpu", dtype="float32", max_sequence_length=MAX_LEN) as engine:
        chunks = session(engine, "r5.a", [SETTINGS["prompt"]] * CHUNKS, max_chunks=CHUNKS, **UNEVEN)
    assert_same_chunks(chunks, solo_uneven)


def test_kv_cache_bytes_are_what_a_rank_holds(engine, folder):
    """The session's K/V memory (the realtime open answer's ``kv_cache_bytes``) is what one rank allocates:
    exactly the one-rank runner's buffers; over ring 2 about half of them, and half again under Ulysses 2."""
    params = GenerationParams(**SETTINGS, num_frames=FRAMES_PER_CHUNK)
    engine.submit_chunk("r1.k", 0, params, CHUNKS).frames.result(timeout=120)
    rollout = engine.launcher.worker.runner.sessions["r1.k"]
    held = sum(layer.kv.numel() * layer.kv.element_size() for layer in rollout.kv_cache.values())
    engine.close_session("r1.k").result(timeout=30)
    config = SimpleNamespace(**resolve_model(str(folder)).transformer_config())
    sizes = dict(rows=1, partition=rollout.partition, height=8, width=8, dtype_bytes=4)
    assert held == kv_cache_bytes(config, **sizes)
    # The released 1.3B transformer at 480p, 3 latent frames per chunk, 8 chunks, bf16.
    real = SimpleNamespace(
        patch_size=(1, 2, 2),
        compressed_patch_size=(1, 4, 4),
        full_chunk_limit=3,
        num_attention_heads=12,
        attention_head_dim=128,
        num_layers=30,
    )
    sizes = dict(rows=1, partition=[1] + [3] * 7, height=60, width=104, dtype_bytes=2)
    one = kv_cache_bytes(real, **sizes)
    ring = kv_cache_bytes(real, **sizes, ring=2)
    both = kv_cache_bytes(real, **sizes, ring=2, ulysses=2)
    assert 0.49 * one < ring <= 0.5 * one  # (and no room for the pad keys: they are not stored)
    assert 0.5 * ring <= both < 0.51 * ring


def test_chunks_interleaved_with_a_batch_video_are_unchanged(engine, solo):
    """A whole video (POST /v1/videos) and a session's chunks share the step loop: the realtime bucket and
    the video's bucket take turns step by step; neither changes the other's output."""
    video = engine.submit(GenerationParams(**SETTINGS, num_frames=17))
    chunks = session(engine, "r2.f", [SETTINGS["prompt"]] * CHUNKS, max_chunks=CHUNKS)
    result = video.result(timeout=120)
    assert result.media_type == "video/mp4" and result.num_frames == 17
    for got, want in zip(chunks, solo, strict=True):
        np.testing.assert_array_equal(got, want)


def test_first_frame_session_equals_the_pipeline_image_to_video(engine, pipe):
    pixels = (np.random.default_rng(3).random((64, 64, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    video = torch.from_numpy(pixels / 255.0).float().permute(2, 0, 1)[None, None]
    want = diffusers_frames(pipe, SETTINGS["prompt"], 3, video=video)
    chunks = session(engine, "r1.g", [SETTINGS["prompt"]] * 3, max_chunks=3, images=(buffer.getvalue(),))
    got = np.concatenate(chunks)
    assert got.shape == want.shape and psnr(got, want) >= 40, psnr(got, want)


def test_a_turned_or_16_bit_first_frame_is_drawn_as_its_upright_8_bit_twin(engine):
    """A first frame is read as diffusers' ``load_image`` gives it: a PNG stored turned with an EXIF
    orientation (as phones save photos) draws what the upright picture draws, a 16-bit greyscale PNG what its
    8-bit twin draws. The first was drawn turned a quarter, the second clipped nearly white (the ingress
    checks the shown size; the runner read the stored pixels)."""
    pixels = (np.random.default_rng(4).random((64, 64, 3)) * 255).astype(np.uint8)
    levels = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned a quarter clockwise from how it is stored
    pictures = [
        (Image.fromarray(pixels), {}),
        (Image.fromarray(pixels).transpose(Image.Transpose.ROTATE_90), {"exif": exif}),
        (Image.fromarray(levels), {}),
        (Image.fromarray((levels / 257).round().astype(np.uint8)), {}),
    ]
    files = []
    for picture, kwargs in pictures:
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG", **kwargs)
        files.append(buffer.getvalue())
    upright, turned, deep, shallow = (
        np.concatenate(session(engine, f"r1.t{i}", [SETTINGS["prompt"]], max_chunks=1, images=(f,)))
        for i, f in enumerate(files)
    )
    np.testing.assert_array_equal(turned, upright)
    np.testing.assert_array_equal(deep, shallow)


def worker_session(worker, sid: str, chunks: int) -> list[np.ndarray]:
    """A session's chunks driven on one rank worker directly (as the engine's loop does)."""
    out = []
    for k in range(chunks):
        params = GenerationParams(**SETTINGS, num_frames=FRAMES_PER_CHUNK)
        steps = worker.add_chunk(f"{sid}.{k}", sid, k, params, chunks)
        for _ in range(steps):
            worker.step([f"{sid}.{k}"])
        out.append(worker.finish(f"{sid}.{k}")["pixels"][0])
    worker.close_session(sid)
    return out


def test_compiled_sessions_reach_a_steady_state_without_recompiling(tmp_path):
    """--compile: what changes from chunk to chunk (cached lengths, the cache forward's chunk spans, the
    rotary table's length) stays out of the compiled blocks, so a longer session after a first one compiles
    no new graph (its later chunk indices were never seen) and dynamo never reaches its recompile limit,
    neither in the blocks nor in the decoder's norms (a VAE with Wan 2.1's stages: norms of several widths
    and frame counts); the chunks are the pipeline's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ditserve.replica.worker import RankWorker

    folder = build_folder(tmp_path / "stages", vae_stages=True)
    torch._dynamo.reset()  # graphs of other tests' compiled blocks do not count here
    config = EngineConfig(
        model=str(folder), device="cpu", dtype="float32", compile=True, max_sequence_length=MAX_LEN
    )
    worker = RankWorker(config)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            first = worker_session(worker, "c.a", CHUNKS)
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0  # the blocks did compile
            worker_session(worker, "c.b", CHUNKS + 3)
            assert counters["stats"]["unique_graphs"] == graphs
    finally:
        worker.shutdown()
    assert_same_chunks_as(
        first, diffusers_frames(load_pipeline(AnyFlowFARPipeline, folder), SETTINGS["prompt"], CHUNKS)
    )


def test_long_session_re_encodes_only_the_recent_chunks_and_equals_the_pipeline(engine, pipe):
    """A chunk runs one cache forward, its flow-map steps over its own frames and a decode of its own frames.
    The cache forward re-encodes the finished chunks; the oldest ones, compressed before and now with the
    same prompt, keep the keys and values the previous forward wrote, so its frames stop growing with the
    session (diffusers: every finished chunk, every time) while the chunks' latents still equal the
    pipeline's to fp32 rounding (keeping one chunk too many: off by 1e-2); a prompt change re-encodes every
    chunk once."""
    chunks = 7
    forwards: list[tuple[str, int]] = []  # ("cache" | "step", latent frames) of each transformer forward
    decoded: list[int] = []  # latent frames of each decoder call

    def count(module, args, kwargs):
        kind = "cache" if kwargs["kv_cache_flag"]["is_cache_step"] else "step"
        forwards.append((kind, kwargs["hidden_states"].shape[1]))

    worker = engine.launcher.worker
    runner = worker.runner
    hooks = [
        runner.pipe.transformer.register_forward_pre_hook(count, with_kwargs=True),
        runner.pipe.vae.decoder.register_forward_pre_hook(
            lambda module, args: decoded.append(args[0].shape[2])
        ),
    ]
    census = []
    try:
        params = GenerationParams(**SETTINGS, num_frames=FRAMES_PER_CHUNK)
        for k in range(chunks):
            forwards.clear()
            decoded.clear()
            steps = worker.add_chunk(f"long.{k}", "long", k, params, chunks)
            for _ in range(steps):
                worker.step([f"long.{k}"])
            worker.finish_chunk(f"long.{k}")
            worker.wait_decodes()
            census.append((list(forwards), sum(decoded)))
        worker.decoded()
        got = torch.cat(runner.sessions["long"].outputs, dim=1)  # (1, frames, C, h, w)
        worker.close_session("long")
        forwards.clear()
        session(engine, "r1.long", [SETTINGS["prompt"]] * 5 + ["a blue whale at night"] * 2, max_chunks=None)
        changed = [frames for kind, frames in forwards if kind == "cache"]
    finally:
        for hook in hooks:
            hook.remove()
    # Each chunk: one cache forward (none before the first), its flow-map steps over its own latent frames
    # (1, then 2), and a decode of those frames only.
    steps = [("step", 1)] * SETTINGS["num_inference_steps"]
    assert census[0] == (steps, 1), census[0]
    for k, (calls, frames) in enumerate(census[1:], start=1):
        assert [kind for kind, _ in calls] == ["cache"] + ["step"] * SETTINGS["num_inference_steps"], calls
        assert all(f == 2 for _, f in calls[1:]) and frames == 2, (k, calls, frames)
    steady = [calls[0][1] for calls, _ in census[1:]]
    # The cache forward's latent frames: full_chunk_limit 3, the last two finished chunks stay full.
    assert steady == [1, 3, 5, 6, 6, 6], steady  # diffusers: 1, 3, 5, 7, 9, 11
    assert changed == [1, 3, 5, 6, 9, 6], changed  # chunk 5's new prompt: every finished chunk once
    partition = [1] + [FRAMES_PER_CHUNK // 4] * (chunks - 1)
    want = pipe(
        prompt=SETTINGS["prompt"],
        height=SETTINGS["height"],
        width=SETTINGS["width"],
        num_frames=(sum(partition) - 1) * 4 + 1,
        num_inference_steps=SETTINGS["num_inference_steps"],
        guidance_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(SETTINGS["seed"]),
        max_sequence_length=MAX_LEN,
        chunk_partition=partition,
        output_type="latent",
    ).frames  # (1, C, frames, h, w)
    torch.testing.assert_close(got.permute(0, 2, 1, 3, 4), want, rtol=0, atol=1e-5)


def assert_same_chunks_as(chunks: list[np.ndarray], want: np.ndarray) -> None:
    got = np.concatenate(chunks)
    assert got.shape == want.shape and psnr(got, want) >= 40, psnr(got, want)


class DeviceReads(TorchFunctionMode):
    """Counts the tensor methods that read a value back to the host (on a GPU, each waits for the device)."""

    READS = {"item", "__bool__", "tolist", "__int__", "__float__", "cpu", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_chunk_steps_never_read_back_from_the_device_and_step_as_the_scheduler(engine):
    """A chunk's steps (its cache forward, its flow-map steps) queue work without waiting for the device:
    no value is read back (the pipeline's ``t == r`` and ``scheduler.step`` read the timestep back four
    times a step); the step is the scheduler's arithmetic exactly."""
    from diffusers import FlowMapEulerDiscreteScheduler

    from ditserve.replica.pipelines.anyflow import flow_map_step

    worker = engine.launcher.worker
    params = GenerationParams(**SETTINGS, num_frames=FRAMES_PER_CHUNK)
    reads = []
    for k in range(3):
        steps = worker.add_chunk(f"reads.{k}", "reads", k, params, 3)
        with DeviceReads() as mode:
            for _ in range(steps):
                worker.step([f"reads.{k}"])
        reads.append(mode.reads)
        worker.finish_chunk(f"reads.{k}")
    worker.wait_decodes()
    worker.decoded()
    worker.close_session("reads")
    assert reads == [[], [], []], reads

    scheduler = FlowMapEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(4)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn((1, 2, 16, 8, 8), generator=generator).to(torch.bfloat16)
    for i, t in enumerate(scheduler.timesteps):
        pred = torch.randn(sample.shape, generator=generator).to(torch.bfloat16)
        want = scheduler.step(pred, t, sample, return_dict=False)[0]
        got = flow_map_step(pred, scheduler.sigmas, i, sample)
        assert got.dtype == want.dtype and torch.equal(got, want)
        sample = want
