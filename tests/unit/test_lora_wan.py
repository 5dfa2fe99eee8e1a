"""LoRA on Wan: adapter files in the layouts Wan LoRAs are published in (the original Wan key names, with
alphas and ``diff_b`` lora_B biases; musubi-tuner's kohya-style names) change the demo-wan transformer's
output exactly as diffusers' own ``load_lora_weights`` does, for the rows of the request that names the
adapter and for none of the others."""

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from safetensors.torch import load_file, save_file

from ditserve.replica.lora.manager import LoRAManager
from ditserve.replica.models.demo import ensure_demo_model
from ditserve.replica.request import LoRARef

RANK, ALPHA = 4, 2.0
DIM, FFN = 96, 64  # demo-wan: 8 heads × 12, ffn 64
# (original Wan name, in, out) of every adapted linear of block 0; musubi names replace "." by "_"
LINEARS = [(f"{attn}.{o}", DIM, DIM) for attn in ("self_attn", "cross_attn") for o in "qkvo"]
LINEARS += [("ffn.0", DIM, FFN), ("ffn.2", FFN, DIM)]
# lora_B biases (diff_b) in the original layout: on every linear (diffusers' PEFT path leaves the biases a
# file does not give on the meta device once any is given)
BIASED = tuple(name for name, _, _ in LINEARS)


def weights(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: (
            torch.randn(RANK, i, generator=g) * 0.5,
            torch.randn(o, RANK, generator=g) * 0.5,
            torch.randn(o, generator=g) * 0.3,
        )
        for name, i, o in LINEARS
    }


def write_original(path, w, biased=BIASED):
    tensors = {}
    for name, (a, b, bias) in w.items():
        key = f"diffusion_model.blocks.0.{name}"
        tensors.update(
            {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b, f"{key}.alpha": torch.tensor(ALPHA)}
        )
        if name in biased:
            tensors[f"{key}.diff_b"] = bias
    save_file(tensors, str(path))
    return path


def write_musubi(path, w):
    tensors = {}
    for name, (a, b, _) in w.items():
        key = "lora_unet_blocks_0_" + name.replace(".", "_")
        tensors.update(
            {f"{key}.lora_down.weight": a, f"{key}.lora_up.weight": b, f"{key}.alpha": torch.tensor(ALPHA)}
        )
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(2, 16, 2, 8, 8, generator=g),
        timestep=torch.tensor([700.0, 300.0]),
        encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
    )


def forward(transformer, inputs) -> torch.Tensor:
    with torch.no_grad():
        return transformer(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("layout", ["original", "musubi"])
def test_wan_lora_files_match_diffusers(tmp_path, inputs, layout):
    path = ensure_demo_model("demo-wan")
    file = {"original": write_original, "musubi": write_musubi}[layout](
        tmp_path / f"{layout}.safetensors", weights(1)
    )

    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
    base = forward(pipe.transformer, inputs)
    pipe.load_lora_weights(str(file))
    want = forward(pipe.transformer, inputs)

    transformer = WanTransformer3DModel.from_pretrained(path / "transformer", torch_dtype=torch.float32)
    manager = LoRAManager(transformer, "WanPipeline", max_loras=2, max_rank=8)
    info = manager.load("style", str(file))
    assert info["modules"] == len(LINEARS) and info["rank"] == RANK
    # row 0 names the adapter, row 1 does not: one forward, each row its own output
    manager.set_batch([(1, (LoRARef(name="style"),)), (1, ())])
    got = forward(transformer, inputs)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], base[1], atol=1e-5, rtol=1e-5)
    assert (want[0] - base[0]).abs().max() > 1e-2  # the adapter changes the output
    if layout == "original":
        # its lora_B biases count: without them diffusers gives another output (so dropping them fails above)
        pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
        pipe.load_lora_weights(str(write_original(tmp_path / "no_bias.safetensors", weights(1), biased=())))
        assert (forward(pipe.transformer, inputs)[0] - want[0]).abs().max() > 1e-3


def test_graph_key_waits_for_the_groups_and_follows_the_layout(tmp_path, inputs):
    """What --cuda-graphs keys adapter batches by: nothing until a forward with adapters has learned the
    linears that share an input (q, k, v here: learning moves their A buffers, which a graph would read),
    then the layout (rows, adapter and strength per request), the same for the same layout."""
    path = ensure_demo_model("demo-wan")
    transformer = WanTransformer3DModel.from_pretrained(path / "transformer", torch_dtype=torch.float32)
    manager = LoRAManager(transformer, "WanPipeline", max_loras=2, max_rank=8)
    manager.load("style", str(write_musubi(tmp_path / "style.safetensors", weights(1))))
    layout = [(1, (LoRARef(name="style"),)), (1, ())]
    manager.set_batch(layout)
    assert manager.graph_key() is None and not manager.groups
    forward(transformer, inputs)
    manager.set_batch(layout)
    assert manager.groups  # self-attention's q, k, v (and cross-attention's k, v) read one input each
    key, keep = manager.graph_key()
    assert keep is manager.batch
    forward(transformer, inputs)
    manager.set_batch(layout)
    assert manager.graph_key()[0] == key
    manager.set_batch([(1, (LoRARef(name="style", scale=0.5),)), (1, ())])
    assert manager.graph_key()[0] != key
    manager.set_batch([(1, ()), (1, (LoRARef(name="style"),))])
    assert manager.graph_key()[0] != key
    manager.set_batch([(2, ())])
    assert manager.graph_key() is None  # no adapters: the plain graphs
    manager.unload("style")
    manager.load("style", str(write_musubi(tmp_path / "style.safetensors", weights(1))))
    manager.set_batch(layout)
    assert manager.graph_key() is None  # slots changed: one forward without a graph first


def test_a_full_weight_delta_of_the_head_applies_as_diffusers_reads_it(tmp_path, inputs):
    """lightx2v's distilled Wan LoRAs carry the head's full weight delta (``head.head.diff``, with its bias
    ``diff_b``) beside their pairs; diffusers reads it as a pair on proj_out whose rank is the head's output
    width (64 on demo-wan). It draws as diffusers draws it, and under a smaller --max-lora-rank the refusal
    names the layer (it gave a rank of 64 for a file of rank-4 pairs, naming nothing)."""
    path = ensure_demo_model("demo-wan")
    g = torch.Generator().manual_seed(5)
    head = {
        "diffusion_model.head.head.diff": torch.randn(64, DIM, generator=g) * 0.05,
        "diffusion_model.head.head.diff_b": torch.randn(64, generator=g) * 0.05,
    }
    file = write_original(tmp_path / "lightx2v.safetensors", weights(1))
    save_file(dict(load_file(str(file))) | head, str(file))

    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
    base = forward(pipe.transformer, inputs)
    pipe.load_lora_weights(str(file))
    want = forward(pipe.transformer, inputs)

    transformer = WanTransformer3DModel.from_pretrained(path / "transformer", torch_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"has rank 64 \(at proj_out\), above --max-lora-rank 8$"):
        LoRAManager(transformer, "WanPipeline", max_loras=2, max_rank=8).load("style", str(file))
    manager = LoRAManager(transformer, "WanPipeline", max_loras=2, max_rank=64)
    assert manager.load("style", str(file))["modules"] == len(LINEARS) + 1
    manager.set_batch([(1, (LoRARef(name="style"),)), (1, ())])
    got = forward(transformer, inputs)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], base[1], atol=1e-5, rtol=1e-5)
