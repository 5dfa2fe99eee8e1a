"""--cuda-graphs: forwards replay a captured CUDA graph per input shape (and adapter layout) and draw what the
engine draws without graphs; adapter batches, memory release and weight changes stay correct."""

import numpy as np
import pytest
import torch

from ditserve.cluster.cli import main
from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.request import GenerationParams, LoRARef
from tests.helpers import psnr

REQ = dict(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=3)


def test_cuda_graphs_need_one_cuda_device(capsys):
    with pytest.raises(ValueError, match="--cuda-graphs needs --device cuda"):
        EngineConfig(model="demo-flux", device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="--cuda-graphs runs replicas of one GPU"):
        EngineConfig(
            model="demo-flux", device="cuda", cuda_graphs=True, parallel=ParallelFlags(ulysses_degree=2)
        )
    # unset: on for a one-GPU CUDA replica only (flags off or on override it)
    assert EngineConfig(model="demo-flux", device="cuda").use_cuda_graphs
    assert not EngineConfig(model="demo-flux", device="cuda", cuda_graphs=False).use_cuda_graphs
    assert not EngineConfig(model="demo-flux", device="cpu").use_cuda_graphs
    assert not EngineConfig(
        model="demo-flux", device="cuda", parallel=ParallelFlags(tp_size=2)
    ).use_cuda_graphs
    if not torch.cuda.is_available():  # the CLI refuses it on this machine with one line naming the flag
        code = main(["generate", "a fox", "--model", "demo-flux", "--cuda-graphs", "--device", "cpu"])
        assert code != 0 and "--cuda-graphs needs --device cuda" in capsys.readouterr().err


def _worker(model="demo-flux", **flags):
    from ditserve.replica.rank_control import ServingRankWorker

    config = EngineConfig(model=model, device="cuda", dtype="bfloat16", **flags)
    return ServingRankWorker(config)


def _images(worker, params: list[GenerationParams]) -> list[np.ndarray]:
    """Run ``params`` as one batch to the end; the images in order."""
    ids = [f"r{i}" for i in range(len(params))]
    for rid, p in zip(ids, params, strict=True):
        worker.add(rid, p)
    while not all(worker.states[r].done for r in ids):
        worker.step([r for r in ids if not worker.states[r].done])
    return [worker.finish(r)[0] for r in ids]


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_graphs_draw_the_plain_engine_image(compile):
    plain, graphed = _worker(compile=compile, cuda_graphs=False), _worker(compile=compile, cuda_graphs=True)
    guided = GenerationParams(**REQ, negative_prompt="blurry", true_cfg_scale=4.0)
    want = _images(plain, [guided])[0]
    got = _images(graphed, [guided])[0]
    graphs = graphed.runner.graphs
    # cond and uncond rows share one graph: 3 steps × 2 forwards = 1 capture call + 5 replays
    assert (graphs.captures, graphs.replays) == (1, 5)
    assert psnr(got, want) >= 40
    other = _images(
        graphed, [GenerationParams(**{**REQ, "seed": 4}, negative_prompt="blurry", true_cfg_scale=4)]
    )
    assert psnr(other[0], got) < 30 and graphs.captures == 1  # a replay follows its new inputs
    # a second size is a second graph
    _images(graphed, [GenerationParams(**{**REQ, "width": 128})])
    assert graphs.captures == 2


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_adapter_batches_replay_graphs_and_release_resume_recaptures(tmp_path, compile):
    from tests.unit.test_lora_engine import weights, write_kohya

    path = write_kohya(tmp_path / "a.safetensors", weights(1))
    other = write_kohya(tmp_path / "b.safetensors", weights(2))
    plain, graphed = _worker(cuda_graphs=False, compile=compile), _worker(cuda_graphs=True, compile=compile)
    batch = [GenerationParams(**REQ, lora=(LoRARef(name="a"),)), GenerationParams(**REQ)]
    for w in (plain, graphed):
        w.lora_load("a", str(path))
        w.lora_load("b", str(other))
    want = _images(plain, batch)
    got = _images(graphed, batch)
    graphs = graphed.runner.graphs
    # the first forward with adapters learns the linears that share an input (it moves their A buffers),
    # so it runs without a graph; the second captures one for this layout, the third replays it
    assert (graphs.captures, graphs.replays) == (1, 1)
    for g, w in zip(got, want, strict=True):
        assert psnr(g, w) >= 40
    assert psnr(want[0], want[1]) < 30  # the adapter shows

    # another layout (the other adapter, another strength, the rows swapped) is another graph; the graph of
    # the first layout replays the first layout's adapter even after it
    swapped = [GenerationParams(**REQ), GenerationParams(**REQ, lora=(LoRARef(name="b", scale=0.6),))]
    want2, got2 = _images(plain, swapped), _images(graphed, swapped)
    assert (graphs.captures, graphs.replays) == (2, 3)
    for g, w in zip(got2, want2, strict=True):
        assert psnr(g, w) >= 40
    again = _images(graphed, batch)
    assert graphs.replays == 6 and all(psnr(g, w) >= 40 for g, w in zip(again, want, strict=True))

    alone = _images(graphed, [GenerationParams(**REQ)])[0]
    assert graphs.replays == 8 and psnr(alone, want[1]) >= 40
    graphed.release_memory()
    graphed.resume_memory()  # the weights come back at other addresses: the graphs must go
    assert not graphed.runner.graphs.graphs
    again = _images(graphed, [GenerationParams(**REQ)])[0]
    assert psnr(again, want[1]) >= 40


@pytest.mark.gpu
def test_wan_video_with_graphs_by_default():
    """Unset, the flag is on for one GPU: a Wan video (CFG: cond and uncond forwards) comes out the same."""
    plain, default = _worker("demo-wan", cuda_graphs=False), _worker("demo-wan")
    p = GenerationParams(prompt="waves on a beach", negative_prompt="blurry", num_frames=5, width=64, height=64,
                         num_inference_steps=3, guidance_scale=5.0, seed=11)  # fmt: skip
    want, got = _images(plain, [p])[0], _images(default, [p])[0]
    assert default.runner.graphs is not None and default.runner.graphs.replays > 0
    assert got.shape == want.shape and psnr(got, want) >= 40
