"""Step-level continuous batching: joining mid-flight changes nothing, the queue is bounded, cancels free slots."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from ditserve.replica.config import EngineConfig
from ditserve.replica.engine import Engine
from ditserve.replica.request import GenerationParams
from ditserve.replica.scheduler import QueueFullError
from tests.helpers import png_pixels, psnr


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(model="demo-flux", max_batch_size=8, max_queue=64)).start()
    yield engine
    engine.shutdown()


def pixels(engine, params) -> np.ndarray:
    return png_pixels(engine.generate(params, timeout=120).outputs[0])


def test_joining_a_running_batch_mid_flight_gives_the_image_of_running_alone(engine):
    long = GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=12, seed=1)
    joiners = [
        GenerationParams(
            prompt="a blue cat", width=64, height=64, num_inference_steps=4, seed=2, guidance_scale=7.0
        ),
        GenerationParams(
            prompt="a green dog",
            negative_prompt="red",
            true_cfg_scale=2.5,
            width=64,
            height=64,
            num_inference_steps=6,
            seed=3,
        ),
        GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=4, n=2),
    ]
    alone = [pixels(engine, p) for p in [long, *joiners]]
    three_steps_done = threading.Event()
    steps_before = engine.steps_run
    first = engine.submit(long, on_progress=lambda done, total: done >= 3 and three_steps_done.set())
    assert three_steps_done.wait(60)
    later = [engine.submit(p) for p in joiners]  # they join at the next step boundary
    together = [png_pixels(f.result(timeout=120).outputs[0]) for f in [first, *later]]
    total_steps = sum(p.num_inference_steps for p in [long, *joiners])
    assert engine.steps_run - steps_before < total_steps  # forwards were shared
    for got, want in zip(together, alone, strict=True):
        assert got.shape == want.shape and psnr(got, want) >= 40


def test_full_queue_refuses_with_queue_full_and_recovers():
    engine = Engine(EngineConfig(model="demo-flux", max_batch_size=1, max_queue=2)).start()
    try:
        slow = GenerationParams(prompt="a fox", width=64, height=64, num_inference_steps=30, seed=0)
        accepted, refused = [], 0
        for _ in range(6):
            try:
                accepted.append(engine.submit(slow))
            except QueueFullError as exc:
                refused += 1
                assert "queue full" in str(exc) and exc.retry_after_s > 0
        assert refused >= 3 and len(accepted) <= 3
        for future in accepted:
            assert future.result(timeout=120).outputs
        assert engine.generate(slow.model_copy(update={"num_inference_steps": 2}), timeout=60).outputs
    finally:
        engine.shutdown()


def test_cancel_frees_the_slot_at_the_next_step(engine):
    started = threading.Event()
    params = GenerationParams(prompt="a fox", width=64, height=64, num_inference_steps=100, seed=0)
    future = engine.submit(params, on_progress=lambda done, total: started.set())
    assert started.wait(60)
    assert future.cancel()
    deadline = time.monotonic() + 60  # polled: a step of a loaded machine can take seconds
    while engine.scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.scheduler.num_running == 0
    assert engine.call_ranks("ping")["rank"] == 0
    assert not engine.launcher.worker.states  # the rank forgot the request's latents
    assert engine.generate(params.model_copy(update={"num_inference_steps": 2}), timeout=60).outputs


def test_start_callback_runs_once_when_the_request_leaves_the_queue(engine):
    """on_start comes before the request's inputs are encoded and its first step runs (a video job is
    in_progress from then; it read queued until its first step was done)."""
    events = []
    params = GenerationParams(prompt="a fox", width=64, height=64, num_inference_steps=3, seed=0)
    future = engine.submit(
        params, on_progress=lambda done, total: events.append(done), on_start=lambda: events.append("start")
    )
    assert future.result(timeout=60).outputs
    assert events == ["start", 1, 2, 3]


def test_fifty_concurrent_clients_each_get_their_own_image_once(engine):
    params = [
        GenerationParams(prompt=f"a fox number {i}", width=64, height=64, num_inference_steps=2, seed=i)
        for i in range(50)
    ]
    completed_before = engine.steps_run
    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(lambda p: engine.generate(p, timeout=300), params))
    assert [r.seed for r in results] == list(range(50))
    assert engine.steps_run - completed_before < 50 * 2  # batched
    # spot-check that each answer is its own request's image (not a neighbour's)
    for i in (0, 17, 49):
        assert psnr(png_pixels(results[i].outputs[0]), pixels(engine, params[i])) >= 40
    assert len({r.outputs[0] for r in results}) == 50
