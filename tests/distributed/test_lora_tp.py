"""Multi-LoRA under tensor parallelism: two gloo ranks, each holding its shard of every linear and of the
adapters (column-parallel: all of A, its rows of B; row-parallel: its columns of A, all of B, the delta
added before the all-reduce), draw what diffusers draws with the same file, per request of a mixed batch."""

import torch

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.request import GenerationParams, LoRARef
from tests.helpers import png_pixels, psnr
from tests.unit.test_lora_engine import REQ, TARGETS, diffusers_image, weights, write_kohya, write_peft


def test_tensor_parallel_ranks_apply_each_requests_adapter(tmp_path):
    # the demo's targets span both kinds of shard: attn.to_out.0 and proj_out are row-parallel, ff.net.0.proj
    # column-parallel; and a second file on q, k, v (column-parallel, one group on one input)
    qkv = {
        f"transformer_blocks.0.attn.{p}": (
            torch.randn(4, 128, generator=g),
            3 * torch.randn(128, 4, generator=g),
        )
        for g in [torch.Generator().manual_seed(7)]
        for p in ("to_q", "to_k", "to_v")
    }
    a = write_kohya(tmp_path / "a.safetensors", weights(1))
    b = write_peft(tmp_path / "b.safetensors", qkv)
    config = EngineConfig(
        model="demo-flux",
        parallel=ParallelFlags(tp_size=2),
        max_loras=2,
        max_lora_rank=8,
        lora_roots=(str(tmp_path),),
    )
    engine = Engine(config).start()
    try:
        engine.load_lora("a", str(a))
        engine.load_lora("b", str(b))
        refs = [(LoRARef(name="a"),), (), (LoRARef(name="b"),)]
        futures = [engine.submit(GenerationParams(**REQ, lora=r)) for r in refs]  # one batch, one forward
        with_a, plain, with_b = (png_pixels(f.result(timeout=300).outputs[0]) for f in futures)
    finally:
        engine.shutdown()
    assert len(TARGETS) == 3
    assert psnr(with_a, diffusers_image(a)) >= 40
    assert psnr(with_b, diffusers_image(b)) >= 40
    assert psnr(with_a, plain) < 30 and psnr(with_b, plain) < 30  # each adapter visibly changes the picture
