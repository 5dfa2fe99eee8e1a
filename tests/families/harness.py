"""What the family tests share: one thread for tiny models, engines per layout (started once per module),
images and frames from results, the step loop driven by hand, ``ditserve generate`` and ``ditserve serve``
with the openai client, and the layout matrix (every axis in two 4-rank engines by default, each axis alone
with ``-m slow``)."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.media import decode_mp4
from ditserve.replica.pipelines.base import to_uint8
from ditserve.replica.request import GenerationParams, GenerationResult
from tests.helpers import ServeProcess, png_pixels, user_env

# Every parallel axis in two 4-rank engines (the default run); each axis alone is redundant with them (slow).
LAYOUTS = [
    {"ulysses_degree": 2, "ring_degree": 2},
    {"tp_size": 2, "cfg_parallel_size": 2},
    pytest.param({"ulysses_degree": 2}, marks=pytest.mark.slow),
    pytest.param({"ring_degree": 2}, marks=pytest.mark.slow),
    pytest.param({"tp_size": 2}, marks=pytest.mark.slow),
    pytest.param({"cfg_parallel_size": 2}, marks=pytest.mark.slow),
]


def layout_id(flags: dict) -> str:
    """``ulysses2-ring2`` for ``{"ulysses_degree": 2, "ring_degree": 2}``."""
    return "-".join(f"{k.split('_')[0]}{v}" for k, v in flags.items())


# OMP_NUM_THREADS as it was outside each one_thread (innermost last)
_OUTSIDE_ONE_THREAD: list[str | None] = []


def _set_threads_env(value: str | None) -> None:
    if value is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = value


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread here and in the servers and CLI runs started meanwhile (they read OMP_NUM_THREADS):
    the models are a few kilobytes wide, and on a shared 2-core machine more threads only contend. Engines
    started by ``running_engine`` meanwhile see the environment as it was outside (see there)."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    _OUTSIDE_ONE_THREAD.append(env)
    try:
        yield
    finally:
        _OUTSIDE_ONE_THREAD.pop()
        torch.set_num_threads(threads)
        _set_threads_env(env)


@contextlib.contextmanager
def _environment_outside_one_thread() -> Iterator[None]:
    """The environment as it was outside ``one_thread`` while an engine starts. Local ranks fork from the
    process's one fork server only while the environment is the one it started with; a launch from another
    spawns fresh interpreters (seconds of imports per rank). With one_thread's variable in place, this
    module's engines spawned whenever another test file had started the fork server in the same test
    process first (and every later file's engines did when one of these started it). The ranks split the
    fork server's threads over the world size: one each on a 2-core machine, as with the variable."""
    if not _OUTSIDE_ONE_THREAD:
        yield
        return
    inside = os.environ.get("OMP_NUM_THREADS")
    _set_threads_env(_OUTSIDE_ONE_THREAD[0])
    try:
        yield
    finally:
        _set_threads_env(inside)


@pytest.fixture(scope="module")
def single_thread():
    """``one_thread`` for a whole module (import it into the module and name it, or use it autouse)."""
    with one_thread():
        yield


@contextlib.contextmanager
def running_engine(
    folder: Path, flags: dict | None = None, loras: dict[str, Path] | None = None, **config
) -> Iterator[Engine]:
    """An engine on ``folder`` with the layout ``flags`` and the named adapters loaded; shut down after."""
    parallel = ParallelFlags(**(flags or {}))
    with _environment_outside_one_thread():
        engine = Engine(EngineConfig(model=str(folder), parallel=parallel, **config)).start()
    try:
        for name, file in (loras or {}).items():
            engine.load_lora(name, str(file))
        yield engine
    finally:
        engine.shutdown()


def results(
    engine: Engine, requests: Sequence[GenerationParams], timeout: float = 300
) -> list[GenerationResult]:
    """The requests submitted together (they share steps), their results in order."""
    futures = [engine.submit(p) for p in requests]
    return [f.result(timeout=timeout) for f in futures]


def images(engine: Engine, requests: Sequence[GenerationParams], timeout: float = 300) -> list[np.ndarray]:
    """Each request's (first) image as uint8 pixels, the requests submitted together."""
    return [png_pixels(r.outputs[0]) for r in results(engine, requests, timeout)]


def frames(engine: Engine, requests: Sequence[GenerationParams], timeout: float = 300) -> list[np.ndarray]:
    """Each request's video frames (decoded MP4), the requests submitted together."""
    return [decode_mp4(r.outputs[0]) for r in results(engine, requests, timeout)]


def engine_images(folder: Path, flags: dict, requests, loras=None, **config) -> list[np.ndarray]:
    """One engine started for one batch of requests (a layout used by one test only)."""
    with running_engine(folder, flags, loras, **config) as engine:
        return images(engine, requests)


def load_pipeline(cls, folder: Path, **kwargs):
    pipe = cls.from_pretrained(folder, dtype=torch.float32, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_runner(runner, requests: Sequence[GenerationParams]) -> list[np.ndarray]:
    """The requests stepped to the end by hand, those of one bucket (size, references) batched together."""
    states = [runner.add(f"r{i}", p) for i, p in enumerate(requests)]
    while not all(s.done for s in states):
        for bucket in dict.fromkeys(s.bucket for s in states if not s.done):
            runner.step([s for s in states if s.bucket == bucket and not s.done])
    return [runner.decode(s)[0] for s in states]


SAMPLING = ("negative_prompt", "guidance_scale", "true_cfg_scale", "num_inference_steps", "seed", "strength")


def picture(width: int, height: int, seed: int) -> bytes:
    """Smooth colours plus noise, as PNG bytes (an uploaded image)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x / width, y / height, 1 - x * y / (width * height)], -1) * 200
    pixels = pixels + rng.integers(0, 55, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def img2img_image(pipe_cls, pipe, p: GenerationParams, **kwargs) -> np.ndarray:
    """diffusers' image-to-image pipeline ``pipe_cls`` (on ``pipe``'s components) for ``p``: its start image
    ``p.images[0]``, strength, size, steps, seed and the guidance fields it sets."""
    i2i = pipe_cls.from_pipe(pipe)
    i2i.set_progress_bar_config(disable=True)
    guidance = {k: getattr(p, k) for k in ("negative_prompt", "guidance_scale", "true_cfg_scale")}
    guidance = {k: v for k, v in guidance.items() if k in p.model_fields_set}
    return pipeline_output(i2i, p, strength=p.strength, **guidance, **kwargs)


def pipeline_output(pipe, p: GenerationParams, **kwargs) -> np.ndarray:
    """diffusers' ``pipe`` for ``p`` (prompt, size, steps, a CPU generator seeded ``p.seed``; its first start
    image as ``image``, and ``kwargs``): the uint8 image (H, W, 3) or frames (F, H, W, 3)."""
    from PIL import Image

    if p.images:
        kwargs.setdefault("image", Image.open(io.BytesIO(p.images[0])).convert("RGB"))
    out = pipe(
        prompt=p.prompt,
        width=p.width,
        height=p.height,
        num_inference_steps=p.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(p.seed),
        output_type="np",
        **kwargs,
    )
    frames = getattr(out, "frames", None)
    return to_uint8(np.asarray(frames if frames is not None else out.images))[0]


def sampling_body(p: GenerationParams) -> dict:
    """``p``'s sampling fields that are set, as the openai client's ``extra_body``."""
    return {k: getattr(p, k) for k in SAMPLING if k in p.model_fields_set}


def generate_args(p: GenerationParams) -> list[str]:
    """``p``'s size and set sampling fields as ``ditserve generate`` flags (the prompt not included)."""
    body = {"width": p.width, "height": p.height, **sampling_body(p)}
    return [arg for k, v in body.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


def cli_generate(prompt: str, folder: Path, out: Path, *args: str, timeout: float = 300) -> np.ndarray:
    """``ditserve generate PROMPT --model FOLDER ARGS -o OUT``; the written image's pixels."""
    cmd = [str(Path(sys.executable).with_name("ditserve")), "generate", prompt, "--model", str(folder)]
    done = subprocess.run(
        [*cmd, *args, "-o", str(out)], capture_output=True, text=True, timeout=timeout, env=user_env()
    )
    assert done.returncode == 0, done.stderr
    return png_pixels(out.read_bytes())


@contextlib.contextmanager
def served(*args: str, **kwargs) -> Iterator[ServeProcess]:
    """``ditserve serve ARGS``; on leaving, Ctrl-C must end it cleanly (exit status 0)."""
    server = ServeProcess(*args, **kwargs)
    try:
        yield server
    finally:
        assert server.stop() == 0, server.output()


def openai_client(server: ServeProcess, timeout: float = 120):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def b64_pixels(response) -> np.ndarray:
    """The first image of an openai ``ImagesResponse`` (b64_json) as uint8 pixels."""
    return png_pixels(base64.b64decode(response.data[0].b64_json))
