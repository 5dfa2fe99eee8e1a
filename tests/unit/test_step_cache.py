"""Step caching: our per-request fbcache against diffusers' own FirstBlockCache hook, and inside a batch."""

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from diffusers.hooks import FirstBlockCacheConfig
from pydantic import ValidationError

from ditserve.replica.caching import CacheSettings
from ditserve.replica.models.demo import ensure_demo_model
from ditserve.replica.pipelines.flux import FluxRunner
from ditserve.replica.request import GenerationParams
from tests.helpers import psnr

STEPS = 8


@pytest.fixture(scope="module")
def pipe():
    return FluxPipeline.from_pretrained(str(ensure_demo_model("demo-flux")), torch_dtype=torch.float32)


def tail_calls(pipe) -> list[int]:
    """Counts forwards that ran the last block (the blocks a cache hit skips)."""
    calls = [0]
    block = pipe.transformer.single_transformer_blocks[-1]
    handle = block.proj_out.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


def run_ours(pipe, params_list: list[GenerationParams]) -> tuple[list[np.ndarray], list]:
    runner = FluxRunner(pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=32)
    states = [runner.add(f"r{i}", p) for i, p in enumerate(params_list)]
    running = list(states)
    while running:
        runner.step(running)
        running = [s for s in running if not s.done]
    return [runner.decode(s)[0] for s in states], states


def test_fbcache_on_one_request_skips_what_diffusers_first_block_cache_skips(pipe):
    threshold = 0.45
    kwargs = dict(prompt="a red fox", height=64, width=64, num_inference_steps=STEPS, guidance_scale=3.5)
    # Reference: diffusers' own hook on the whole pipeline.
    calls, handle = tail_calls(pipe)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        ref = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(5), output_type="np").images[0]
    finally:
        pipe.transformer.disable_cache()
    ref_computed = calls[0]
    calls[0] = 0
    cache = CacheSettings(policy="fbcache", threshold=threshold)
    (ours,), (state,) = run_ours(pipe, [GenerationParams(**kwargs, seed=5, cache=cache)])
    handle.remove()
    record = state.extra["cache"]["cond"]
    assert 0 < ref_computed < STEPS, (
        "the threshold must give a mixed hit pattern for this check to mean anything"
    )
    assert calls[0] == ref_computed == STEPS - record.cached
    assert record.forwards == STEPS
    assert psnr(ours, (ref * 255).round().clip(0, 255).astype("uint8")) >= 40


def test_mixed_batch_each_request_equals_its_solo_run(pipe):
    base = dict(height=64, width=64, guidance_scale=3.5)
    params = [
        GenerationParams(
            prompt="a red fox",
            num_inference_steps=8,
            seed=1,
            cache=CacheSettings(policy="fbcache", threshold=0.45),
            **base,
        ),
        GenerationParams(prompt="a blue cat", num_inference_steps=5, seed=2, **base),
        GenerationParams(
            prompt="a green dog",
            num_inference_steps=6,
            seed=3,
            cache=CacheSettings(policy="fbcache", threshold=0.35),
            **base,
        ),
        GenerationParams(
            prompt="a grey owl",
            negative_prompt="red",
            true_cfg_scale=2.0,
            num_inference_steps=7,
            seed=4,
            cache=CacheSettings(policy="fbcache", threshold=0.45),
            **base,
        ),
    ]
    solo = [run_ours(pipe, [p]) for p in params]
    together, states = run_ours(pipe, params)
    for ((want,), (solo_state,)), got, state in zip(solo, together, states, strict=True):
        assert psnr(got, want) >= 40
        for branch, rec in state.extra.get("cache", {}).items():
            assert rec.decisions == solo_state.extra["cache"][branch].decisions
    assert any(any(r.decisions) for s in states for r in s.extra.get("cache", {}).values())


def test_bad_cache_values_name_the_field():
    with pytest.raises(ValidationError, match="policy"):
        CacheSettings(policy="teacache")
    with pytest.raises(ValidationError, match="threshold"):
        CacheSettings(policy="fbcache", threshold=-1)


def test_engine_batch_with_lora_and_cached_requests_equals_solo_runs(tmp_path):
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.engine import Engine
    from ditserve.replica.request import LoRARef
    from tests.helpers import png_pixels
    from tests.unit.test_lora_engine import weights, write_kohya

    path = write_kohya(tmp_path / "a.safetensors", weights(1))
    config = EngineConfig(model="demo-flux", max_loras=1, max_lora_rank=8, lora_roots=(str(tmp_path),))
    engine = Engine(config).start()
    try:
        engine.load_lora("a", str(path))
        fb = CacheSettings(policy="fbcache", threshold=0.45)
        base = dict(height=64, width=64, guidance_scale=3.5)
        params = [
            GenerationParams(prompt="a red fox", num_inference_steps=8, seed=1, cache=fb, **base),
            GenerationParams(
                prompt="a blue cat", num_inference_steps=5, seed=2, lora=(LoRARef(name="a"),), **base
            ),
            GenerationParams(
                prompt="a green dog",
                num_inference_steps=6,
                seed=3,
                cache=fb,
                lora=(LoRARef(name="a"),),
                **base,
            ),
        ]
        alone = [png_pixels(engine.generate(p, timeout=120).outputs[0]) for p in params]
        steps_before = engine.steps_run
        futures = [engine.submit(p) for p in params]
        together = [png_pixels(f.result(timeout=120).outputs[0]) for f in futures]
        assert engine.steps_run - steps_before < sum(p.num_inference_steps for p in params)
        for got, want in zip(together, alone, strict=True):
            assert psnr(got, want) >= 40
    finally:
        engine.shutdown()


def test_settings_default_per_policy_and_another_policys_setting_has_no_effect():
    assert CacheSettings(policy="taylorseer").value("interval") == 3
    assert CacheSettings(policy="fbcache").value("threshold") == 0.1
    with pytest.raises(ValidationError) as exc:
        CacheSettings(policy="taylorseer", interval=0)
    assert exc.value.errors()[0]["loc"] == ("interval",)


def test_taylorseer_forecasts_on_its_schedule_inside_a_batch(pipe):
    """taylorseer: warmup forwards compute, then one in `interval`; the others are forecast. In a batch with an
    uncached request (and a cached one at another interval) each request equals its solo run, and the forecast
    (order 1) is not the plain reuse of the last residual (order 0)."""
    base = dict(height=64, width=64, guidance_scale=3.5, num_inference_steps=STEPS)
    ts = CacheSettings(policy="taylorseer", interval=3, warmup=2, order=1)
    params = [
        GenerationParams(prompt="a red fox", seed=1, cache=ts, **base),
        GenerationParams(prompt="a blue cat", seed=2, **base),
        GenerationParams(
            prompt="a green dog", seed=3, cache=CacheSettings(policy="taylorseer", interval=2), **base
        ),
    ]
    together, states = run_ours(pipe, params)
    for p, image, state in zip(params, together, states, strict=True):
        (solo,), (solo_state,) = run_ours(pipe, [p])
        assert psnr(image, solo) >= 40
        if p.cache is not None:
            assert state.extra["cache"]["cond"].decisions == solo_state.extra["cache"]["cond"].decisions
    decisions = states[0].extra["cache"]["cond"].decisions
    # forwards 0, 1 (warmup) and 2, 5 (every 3rd after it) compute; the rest are forecast
    assert decisions == [False, False, False, True, True, False, True, True]
    from ditserve.replica.pipelines.base import usage

    assert usage(states[0]) == {"transformer_forwards": STEPS, "cached_forwards": 4}
    assert usage(states[1]) == {"transformer_forwards": STEPS, "cached_forwards": 0}
    (order0,), _ = run_ours(
        pipe, [params[0].model_copy(update={"cache": ts.model_copy(update={"order": 0})})]
    )
    uncached = run_ours(pipe, [params[0].model_copy(update={"cache": None})])[0][0]
    assert (order0 != together[0]).any() and (uncached != together[0]).any()


# -- per-request LoRA in a batch whose hits leave the remaining blocks --------------------------------------
TAIL_LORA = "single_transformer_blocks.0.proj_out"  # demo-flux's last block, targeted by weights() adapters


def lora_batch(steps_scale: int = 1) -> list[GenerationParams]:
    """Four requests of one bucket: a taylorseer one with adapter a (hits by schedule: forwards 3, 5, 7),
    an uncached one with adapter b at 0.7, an fbcache one without adapter, and an fbcache one with true CFG
    and both adapters (two adapter positions)."""
    from ditserve.replica.request import LoRARef

    base = dict(height=64, width=64, guidance_scale=3.5)
    return [
        GenerationParams(
            prompt="a red fox",
            num_inference_steps=8,
            seed=1,
            cache=CacheSettings(policy="taylorseer", interval=2, warmup=2),
            lora=(LoRARef(name="a"),),
            **base,
        ),
        GenerationParams(
            prompt="a blue cat",
            num_inference_steps=5,
            seed=2,
            lora=(LoRARef(name="b", scale=0.7),),
            **base,
        ),
        GenerationParams(
            prompt="a green dog",
            num_inference_steps=6,
            seed=3,
            cache=CacheSettings(policy="fbcache", threshold=0.45),
            **base,
        ),
        GenerationParams(
            prompt="a grey owl",
            negative_prompt="red",
            true_cfg_scale=2.0,
            num_inference_steps=7,
            seed=4,
            cache=CacheSettings(policy="fbcache", threshold=0.45),
            lora=(LoRARef(name="a", scale=0.5), LoRARef(name="b")),
            **base,
        ),
    ]


def write_adapters(root) -> None:
    """Adapters a and b (demo-flux linears of both blocks, the last block's proj_out among them)."""
    from tests.unit.test_lora_engine import weights, write_kohya

    for name, seed in (("a", 1), ("b", 2)):
        write_kohya(root / f"{name}.safetensors", weights(seed))


def lora_worker(root, *, rank: int = 0, world_size: int = 1, init_method: str | None = None, **config):
    """A worker (the engine's per-rank object: runner, LoRA manager and their wiring) with adapters a and
    b of ``root`` loaded (written there first on one rank)."""
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.worker import RankWorker

    if world_size == 1:
        write_adapters(root)
    config = EngineConfig(model="demo-flux", max_loras=2, max_lora_rank=8, lora_roots=(str(root),), **config)
    worker = RankWorker(config, rank=rank, world_size=world_size, init_method=init_method)
    for name in ("a", "b"):
        worker.lora_load(name, str(root / f"{name}.safetensors"))
    return worker


def drive(worker, params: list[GenerationParams], tag: str = "") -> tuple[list, list[dict], list[int]]:
    """The requests in one continuous batch, as the engine steps them (all join at the first step, each
    leaves when done): (images, each request's decisions per CFG branch, the rows that reached the last
    block's adapted linear, one entry per forward that ran it). Rank 0 returns the images, others None."""
    rows_seen: list[int] = []
    module = worker.pipe.transformer.get_submodule(TAIL_LORA)
    hook = module.register_forward_pre_hook(lambda _, args: rows_seen.append(args[0].shape[0]))
    ids = [f"{tag}r{i}" for i in range(len(params))]
    try:
        for rid, p in zip(ids, params, strict=True):
            worker.add(rid, p)
        running, images, decisions = list(ids), {}, {}
        while running:
            worker.step(running)
            for rid in [r for r in running if worker.states[r].done]:
                caches = worker.states[rid].extra.get("cache", {})
                decisions[rid] = {branch: list(c.decisions) for branch, c in caches.items()}
                done = worker.finish(rid)
                images[rid] = None if done is None else done["pixels"][0]
                running.remove(rid)
    finally:
        hook.remove()
    return [images[r] for r in ids], [decisions[r] for r in ids], rows_seen


def computing_rows(params: list[GenerationParams], decisions: list[dict]) -> tuple[list[int], list[int]]:
    """From the decisions: per forward that runs the remaining blocks, (the rows that compute, all rows),
    in the runner's order (each step: the cond forward, then the uncond one of the requests with true CFG)."""
    computing, total = [], []
    for k in range(max(p.num_inference_steps for p in params)):
        running = [(p, d) for p, d in zip(params, decisions, strict=True) if k < p.num_inference_steps]
        for branch in ("cond", "uncond"):
            rows = [d for p, d in running if branch == "cond" or p.negative_prompt]
            hit = [bool(d.get(branch, [False] * (k + 1))[k]) for d in rows]
            if rows and not all(hit):
                computing.append(hit.count(False))
                total.append(len(rows))
    return computing, total


@pytest.fixture(scope="module")
def eager_lora(tmp_path_factory):
    """The LoRA batch through an eager worker, and each request alone through it."""
    worker = lora_worker(tmp_path_factory.mktemp("loras"))
    try:
        params = lora_batch()
        together = drive(worker, params, "batch")
        alone = [drive(worker, [p], f"solo{i}") for i, p in enumerate(params)]
        yield params, together, alone
    finally:
        worker.shutdown()


def test_lora_batch_with_hits_runs_the_remaining_blocks_on_the_computing_rows_only(eager_lora):
    """Hits leave the batch for the remaining blocks with LoRA too: the last block's adapted linear gets
    only the computing rows (each with its own adapters), and every request equals its solo run."""
    params, (images, decisions, rows_seen), alone = eager_lora
    for image, decided, (solo_image, solo_decided, _) in zip(images, decisions, alone, strict=True):
        assert psnr(image, solo_image[0]) >= 40
        assert decided == solo_decided[0]
    computing, total = computing_rows(params, decisions)
    assert rows_seen == computing
    # a forward where a request with an adapter hit while others with adapters computed
    assert any(c < t for c, t in zip(computing, total, strict=True))
    assert decisions[0]["cond"] == [False, False, False, True, False, True, False, True]
    assert any(any(d) for d in decisions[3].values())  # the CFG request with two adapters hit too


def test_compiled_blocks_with_lora_and_hits_compile_a_bounded_number_of_graphs(eager_lora, tmp_path):
    """--compile: the remaining blocks see a row count that changes from forward to forward (and adapters
    on some of those rows): the blocks run compiled, dynamo never reaches its recompile limit (it would
    raise here rather than fall back to eager), a second batch with other row counts compiles nothing new,
    and the images are the eager worker's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    params, (eager_images, eager_decisions, _), _ = eager_lora
    torch._dynamo.reset()  # graphs of other tests' compiled blocks do not count here
    worker = lora_worker(tmp_path, compile=True)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            images, decisions, rows_seen = drive(worker, params)
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0  # the blocks did compile
            # other requests, rows and hits: every row count was seen, so nothing compiles again
            other = [p.model_copy(update={"seed": p.seed + 10}) for p in params[1:]]
            drive(worker, other, "again")
            assert counters["stats"]["unique_graphs"] == graphs
    finally:
        worker.shutdown()
    assert rows_seen == computing_rows(params, decisions)[0]
    for image, want in zip(images, eager_images, strict=True):
        assert psnr(image, want) >= 40


def test_narrowed_layout_keeps_each_requests_adapters_and_is_no_settled_forward(tmp_path):
    """The LoRA manager under relayout: the computing rows keep their adapters and scales (the rows of a
    request without adapters switch the linears to their plain path), the full layout comes back after,
    and a narrowed forward is not taken for a settled one (no CUDA graph key from it)."""
    from ditserve.replica.lora.manager import LoRAManager
    from ditserve.replica.request import LoRARef

    transformer = FluxPipeline.from_pretrained(str(ensure_demo_model("demo-flux"))).transformer
    manager = LoRAManager(transformer, "FluxPipeline", max_loras=2, max_rank=8)
    write_adapters(tmp_path)
    for name in ("a", "b"):
        manager.load(name, str(tmp_path / f"{name}.safetensors"))
    a, b = manager.slots["a"], manager.slots["b"]
    layout = [(1, (LoRARef(name="a"),)), (2, ()), (1, (LoRARef(name="b", scale=0.5),))]
    manager.set_batch(layout)
    full = manager.batch.groups
    manager.relayout([2, 1], [1, 3])  # the rows without adapters and b's row compute
    assert manager.batch.groups == [(2, []), (1, [(b, 0.5)])] and manager.active
    manager.relayout(None, None)
    manager.relayout([2], [1])  # only the rows without adapters
    assert manager.batch is None and not manager.active
    manager.relayout(None, None)
    assert manager.batch.groups == full == [(1, [(a, 1.0)]), (2, []), (1, [(b, 0.5)])] and manager.active
    manager.set_batch(layout)  # after a narrowed forward: still not settled
    assert manager.graph_key() is None
    manager.set_batch(layout)  # after a full one
    key, _ = manager.graph_key()
    assert key[0] == tuple((rows, tuple(adapters)) for rows, adapters in full)


def test_a_weights_update_keeps_caching_on_the_new_transformer():
    """After a weights update the new transformer skips blocks on hits like the one it replaced."""
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.rank_control import ServingRankWorker

    worker = ServingRankWorker(EngineConfig(model="demo-flux"))
    params = GenerationParams(
        prompt="a red fox", width=64, height=64, num_inference_steps=STEPS, seed=3,
        cache=CacheSettings(policy="taylorseer", interval=2, warmup=2),
    )  # fmt: skip

    def generate(tag: str):
        calls, hook = tail_calls(worker.pipe)
        try:
            worker.add(tag, params)
            while not worker.states[tag].done:
                worker.step([tag])
            done = worker.finish(tag)
        finally:
            hook.remove()
        return done["pixels"][0], done["usage"], calls[0]

    before, usage_before, tail_before = generate("before")
    assert 0 < usage_before["cached_forwards"] and tail_before == STEPS - usage_before["cached_forwards"]
    old = worker.pipe.transformer
    worker.stage_weights(str(ensure_demo_model("demo-flux")), "v2")
    worker.commit_weights("v2")
    assert worker.pipe.transformer is not old
    after, usage_after, tail_after = generate("after")
    assert usage_after == usage_before
    assert tail_after == tail_before  # the new transformer's remaining blocks ran only on computed steps
    assert psnr(after, before) >= 40  # the same weights folder: the same image


def test_settings_without_a_policy_name_it_and_both_policies_are_refused():
    assert CacheSettings.model_validate({"threshold": 0.3}).policy == "fbcache"
    assert CacheSettings.model_validate({"interval": 2, "order": 2}).policy == "taylorseer"
    with pytest.raises(ValidationError, match="policy: give the policy"):
        CacheSettings.model_validate({"threshold": 0.3, "interval": 2})


def test_a_requests_cache_takes_what_it_leaves_out_from_the_servers():
    """``--cache-policy fbcache --cache-threshold 10`` (every step after the first reuses the cache): a
    request's ``{"policy": "fbcache"}`` and ``{}`` cache as the server's default does; its own threshold wins;
    on a server without a default, ``{"threshold": 10}`` is fbcache (it meant no cache at all)."""
    from ditserve.replica.config import EngineConfig
    from ditserve.replica.engine import Engine

    def cached(engine, cache: dict | None) -> tuple[str, int]:
        p = GenerationParams(
            prompt="a red fox",
            height=64,
            width=64,
            num_inference_steps=4,
            seed=1,
            cache=None if cache is None else CacheSettings.model_validate(cache),
        )
        usage = engine.generate(p, timeout=120).usage
        return usage["cache_policy"], usage["cached_forwards"]

    engine = Engine(EngineConfig(model="demo-flux", cache_policy="fbcache", cache_threshold=10.0)).start()
    try:
        assert cached(engine, None) == ("fbcache", 3)
        assert cached(engine, {"policy": "fbcache"}) == ("fbcache", 3)
        assert cached(engine, {}) == ("fbcache", 3)
        assert cached(engine, {"policy": "fbcache", "threshold": 0}) == ("fbcache", 0)
        assert cached(engine, {"policy": "none"}) == ("none", 0)
    finally:
        engine.shutdown()
    engine = Engine(EngineConfig(model="demo-flux", cache_policy="none")).start()
    try:
        assert cached(engine, {"threshold": 10}) == ("fbcache", 3)
        assert cached(engine, {}) == ("none", 0)
    finally:
        engine.shutdown()
