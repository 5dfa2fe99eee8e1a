"""Step caching under sharded layouts: every rank takes the same decision per request (a diverging rank
would hang the next collective, failing the run) and the images equal the single-rank ones."""

import pytest

from ditserve.replica.caching import CacheSettings
from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.request import GenerationParams
from tests.helpers import png_pixels, psnr

FB = CacheSettings(policy="fbcache", threshold=0.45)
REQUESTS = [
    GenerationParams(prompt="a red fox", width=64, height=64, num_inference_steps=6, seed=1, cache=FB),
    GenerationParams(prompt="a blue cat", width=64, height=64, num_inference_steps=4, seed=2),
    GenerationParams(
        prompt="a grey owl",
        negative_prompt="red",
        true_cfg_scale=2.0,
        width=64,
        height=64,
        num_inference_steps=5,
        seed=3,
        cache=FB,
    ),
]


def run(
    flags: dict, requests: list[GenerationParams] = REQUESTS, model: str = "demo-flux"
) -> tuple[list, list]:
    """Each request's image and its usage (forwards, cached forwards)."""
    engine = Engine(EngineConfig(model=model, parallel=ParallelFlags(**flags))).start()
    try:
        futures = [engine.submit(p) for p in requests]  # submitted together: they share steps
        results = [f.result(timeout=300) for f in futures]
    finally:
        engine.shutdown()
    usage = [(r.usage["transformer_forwards"], r.usage["cached_forwards"]) for r in results]
    return [png_pixels(r.outputs[0]) for r in results], usage


@pytest.fixture(scope="module")
def reference():
    uncached = REQUESTS[0].model_copy(update={"cache": None})
    (*images, plain), (*usage, _) = run({}, [*REQUESTS, uncached])
    # The cache did skip blocks for the first request (its image is not the uncached one) and the guided one.
    assert (images[0] != plain).any()
    assert usage[0][1] > 0 and usage[2][1] > 0, usage
    return images, usage


@pytest.mark.parametrize(
    "flags",
    [{"ulysses_degree": 2}, {"ring_degree": 2}, {"tp_size": 2}, {"cfg_parallel_size": 2}],
    ids=lambda f: "-".join(f"{k.split('_')[0]}{v}" for k, v in f.items()),
)
def test_cached_batch_under_layout_matches_one_rank(reference, flags):
    """The images, and the usage each request reports: under CFG parallelism each cfg rank keeps its own
    branch's cache, and the guided request's cached forwards are both branches' (they were the cond
    branch's alone)."""
    images, usage = run(flags)
    for ours, ref in zip(images, reference[0], strict=True):
        assert psnr(ours, ref) >= 40
    assert usage == reference[1]


# 80x48: 15 image tokens, padded to 16 under sp 2. On one rank the first step-to-step distance of this
# request is 0.3750: thresholds on either side of it and of another distance (0.3273) give 0, 1, 2, 3 hits.
PADDED = [
    GenerationParams(
        prompt="a red fox",
        width=80,
        height=48,
        num_inference_steps=10,
        seed=1,
        cache=CacheSettings(policy="fbcache", threshold=threshold),
    )
    for threshold in (0.3265, 0.3280, 0.3740, 0.3760)
]


@pytest.fixture(scope="module")
def padded_reference():
    return run({}, PADDED)


@pytest.mark.parametrize(
    "flags",
    [{"ulysses_degree": 2}, {"ring_degree": 2}],
    ids=lambda f: "-".join(f"{k.split('_')[0]}{v}" for k, v in f.items()),
)
def test_sequence_padding_is_not_measured(padded_reference, flags):
    """A sequence padded to the sp degree decides as one rank does: the padding tokens' residual was part
    of the metric, which moved it across the threshold (2 hits where one rank has 3)."""
    images, usage = run(flags, PADDED)
    assert [cached for _, cached in padded_reference[1]] == [0, 1, 2, 3]
    assert usage == padded_reference[1]
    for ours, ref in zip(images, padded_reference[0], strict=True):
        assert psnr(ours, ref) >= 40


# Joint streams whose replicated tokens every sp rank holds (FLUX.2's single blocks: the text, then the
# shard; Z-Image's layers: the shard, then the caption), at 80x48 (no sequence padding on 2 ranks):
# thresholds on either side of two of the request's one-rank distances, and the hits they give.
JOINT = {
    "flux2": ((0.5108, 0.5124, 0.7629, 0.7645), [0, 1, 4, 4]),
    "zimage": ((0.5654, 0.5670, 0.5729, 0.5745), [0, 1, 1, 2]),
}


@pytest.mark.parametrize("family", JOINT)
def test_replicated_tokens_are_measured_once(family, tmp_path):
    """Under Ulysses a joint stream's text (or caption) is measured once over the sp group, as on one rank;
    every rank summed it, so the metric counted it twice (FLUX.2: 1 hit where one rank has none)."""
    from tests.families import flux2, zimage

    folder = str({"flux2": flux2, "zimage": zimage}[family].build_folder(tmp_path / family))
    thresholds, hits = JOINT[family]
    requests = [
        GenerationParams(
            prompt="a red fox",
            width=80,
            height=48,
            num_inference_steps=8,
            seed=1,
            cache=CacheSettings(policy="fbcache", threshold=threshold),
        )
        for threshold in thresholds
    ]
    one_images, one_usage = run({}, requests, folder)
    assert [cached for _, cached in one_usage] == hits
    images, usage = run({"ulysses_degree": 2}, requests, folder)
    assert usage == one_usage
    for ours, ref in zip(images, one_images, strict=True):
        assert psnr(ours, ref) >= 40


def lora_batch_rank(rank: int, world_size: int, flags: dict, root: str, port: int):
    """One rank of a layout: the worker the engine runs there, driving the LoRA batch of the step-cache
    unit tests; its decisions, the rows its last block's adapted linear got, its images (rank 0)."""
    from pathlib import Path

    import torch.distributed as dist

    from ditserve.replica.config import ParallelFlags
    from tests.unit.test_step_cache import drive, lora_batch, lora_worker

    dist.destroy_process_group()  # the worker starts its own, as a replica's rank does
    worker = lora_worker(
        Path(root),
        rank=rank,
        world_size=world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        parallel=ParallelFlags(**flags),
    )
    return drive(worker, lora_batch())


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    from tests.unit.test_step_cache import drive, lora_batch, lora_worker

    root = tmp_path_factory.mktemp("loras")
    worker = lora_worker(root)
    try:
        return root, drive(worker, lora_batch())
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    "flags",
    [{"ulysses_degree": 2}, {"tp_size": 2}],
    ids=lambda f: "-".join(f"{k.split('_')[0]}{v}" for k, v in f.items()),
)
def test_lora_batch_with_hits_under_layout_shrinks_alike_on_every_rank(lora_reference, flags):
    """Per-request LoRA with hits under sequence or tensor parallelism: every rank takes the same
    decisions and gives the remaining blocks the same computing rows (fewer than the batch's, each with its
    adapters), and the images equal one rank's."""
    from ditserve.replica.parallel.testing import _free_port, run_distributed
    from tests.unit.test_step_cache import computing_rows, lora_batch

    root, (ref_images, _, _) = lora_reference
    ranks = run_distributed(lora_batch_rank, 2, flags, str(root), _free_port(), timeout_s=300)
    (images, decisions, rows_seen), (_, other_decisions, other_rows) = ranks
    assert other_decisions == decisions and other_rows == rows_seen
    computing, total = computing_rows(lora_batch(), decisions)
    assert rows_seen == computing and any(c < t for c, t in zip(computing, total, strict=True))
    for image, ref in zip(images, ref_images, strict=True):
        assert psnr(image, ref) >= 40
