"""LoRA files in the layouts people publish, per family, read as diffusers' ``load_lora_weights`` loads them:
for every file below, the adapter's weight deltas (B·A with its alpha / rank, and lora_B biases) are the
deltas of the PEFT layers diffusers builds, module for module, and keys diffusers' converters drop are dropped
here too (FLUX.2 kohya modulation weights, Wan's norm and weight diffs). How each module's delta is applied
per request is checked by the family tests (their images against the pipelines')."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ditserve.replica.lora.loader import read_lora_file
from tests.families.harness import single_thread  # noqa: F401 (a fixture, used by pytestmark)

pytestmark = pytest.mark.usefixtures("single_thread")


def pipeline(family: str):
    if family == "wan22":
        from tests.families.wan22 import build_tiny

        return build_tiny("a14b")
    if family == "wan_i2v":
        from tests.families.wan_i2v import build_tiny

        return build_tiny("wan21")
    if family == "flux2":
        from tests.families.flux2 import build_tiny

        return build_tiny()
    if family == "qwenimage":
        from tests.families.qwenimage import build_pipeline

        return build_pipeline()
    from tests.families.zimage import build_pipeline

    return build_pipeline()


def diffusers_deltas(pipe, file: Path, **kwargs) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Module → (delta weight, delta bias or None) of the PEFT layers ``load_lora_weights`` builds (the second
    expert's as ``transformer_2.<module>``); the model's own weights must stay as they were."""
    from peft.tuners.lora import LoraLayer

    experts = {
        c: getattr(pipe, c) for c in ("transformer", "transformer_2") if getattr(pipe, c, None) is not None
    }
    before = {c: {k: v.clone() for k, v in t.state_dict().items()} for c, t in experts.items()}
    pipe.load_lora_weights(str(file), adapter_name="x", **kwargs)
    out = {}
    try:
        for c, t in experts.items():
            after = {k.replace(".base_layer.", "."): v for k, v in t.state_dict().items() if "lora_" not in k}
            assert all(torch.equal(after[k], v) for k, v in before[c].items()), f"{file.name} changed {c}"
            for name, m in t.named_modules():
                if isinstance(m, LoraLayer) and "x" in m.lora_A:
                    bias = m.lora_B["x"].bias if m.lora_bias.get("x") else None
                    # a layer without a bias in the file: PEFT leaves it zero (or unmaterialised)
                    if bias is not None and (bias.is_meta or not bias.any()):
                        bias = None
                    key = name if c == "transformer" else f"transformer_2.{name}"
                    out[key] = (
                        m.get_delta_weight("x").float(),
                        None if bias is None else (bias * m.scaling["x"]).float(),
                    )
    finally:
        pipe.unload_lora_weights()
    return out


def assert_same_deltas(pipe, file: Path, target: str | None = None) -> int:
    ours = read_lora_file(file, type(pipe).__name__, target).modules
    kwargs = {"load_into_transformer_2": True} if target == "transformer_2" else {}
    theirs = diffusers_deltas(pipe, file, **kwargs)
    assert sorted(ours) == sorted(theirs), file.name
    for name, module in ours.items():
        delta, bias = theirs[name]
        torch.testing.assert_close(
            module.b @ module.a, delta, rtol=1e-5, atol=1e-6, msg=f"{file.name}: {name}"
        )
        assert (module.bias is None) == (bias is None), (file.name, name)
        if bias is not None:
            torch.testing.assert_close(module.bias, bias, rtol=1e-5, atol=1e-6)
    return len(ours)


def pairs(transformer, names: dict[str, str], key, down: str, up: str, alpha: bool, seed: int) -> dict:
    """A rank-2 pair per file module name (→ the transformer's module ``names[name]``), under ``key(name)``."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (name, module) in enumerate(names.items()):
        linear = transformer.get_submodule(module)
        k = key(name)
        tensors[f"{k}.{down}.weight"] = torch.randn(2, linear.in_features, generator=g)
        tensors[f"{k}.{up}.weight"] = torch.randn(linear.out_features, 2, generator=g) * 0.5
        if alpha:
            tensors[f"{k}.alpha"] = torch.tensor(float(1 + i % 4))
    return tensors


def wan_original_names(transformer) -> tuple[dict[str, str], dict[str, str]]:
    """(blocks, embedders): Wan's original linear names → the diffusers modules diffusers' Wan converter maps
    them to."""
    blocks = {}
    for i, block in enumerate(transformer.blocks):
        for attn, ours in (("self_attn", "attn1"), ("cross_attn", "attn2")):
            for o, c in zip("qkvo", ("to_q", "to_k", "to_v", "to_out.0"), strict=True):
                blocks[f"blocks.{i}.{attn}.{o}"] = f"blocks.{i}.{ours}.{c}"
        if block.attn2.add_k_proj is not None:
            blocks[f"blocks.{i}.cross_attn.k_img"] = f"blocks.{i}.attn2.add_k_proj"
            blocks[f"blocks.{i}.cross_attn.v_img"] = f"blocks.{i}.attn2.add_v_proj"
        blocks[f"blocks.{i}.ffn.0"] = f"blocks.{i}.ffn.net.0.proj"
        blocks[f"blocks.{i}.ffn.2"] = f"blocks.{i}.ffn.net.2"
    embedders = {
        "time_embedding.0": "condition_embedder.time_embedder.linear_1",
        "time_embedding.2": "condition_embedder.time_embedder.linear_2",
        "text_embedding.0": "condition_embedder.text_embedder.linear_1",
        "text_embedding.2": "condition_embedder.text_embedder.linear_2",
        "time_projection.1": "condition_embedder.time_proj",
    }
    if transformer.condition_embedder.image_embedder is not None:
        embedders["img_emb.proj.1"] = "condition_embedder.image_embedder.ff.net.0.proj"
        embedders["img_emb.proj.3"] = "condition_embedder.image_embedder.ff.net.2"
    return blocks, embedders


def wan_files(pipe, root: Path) -> dict[str, dict]:
    transformer = pipe.transformer
    blocks, embedders = wan_original_names(transformer)
    comfy = lambda n: f"diffusion_model.{n}"  # noqa: E731
    files = {
        # ComfyUI / lightx2v: lora_down / lora_up with alphas; lora_A / lora_B without
        "comfy_down_up_alpha": pairs(transformer, blocks, comfy, "lora_down", "lora_up", True, 1),
        "comfy_lora_a_b": pairs(transformer, blocks, comfy, "lora_A", "lora_B", False, 2),
        # musubi-tuner: lora_unet_<flattened original name> with alphas
        "musubi": pairs(transformer, blocks, lambda n: "lora_unet_" + n.replace(".", "_"), "lora_down", "lora_up", True, 3),
    }  # fmt: skip
    # the embedders' pairs and every module's bias delta (diff_b), as lora_B biases
    with_bias = pairs(transformer, blocks | embedders, comfy, "lora_A", "lora_B", False, 4)
    g = torch.Generator().manual_seed(5)
    for name, module in (blocks | embedders).items():
        with_bias[f"diffusion_model.{name}.diff_b"] = torch.randn(
            transformer.get_submodule(module).out_features, generator=g
        )
    files["comfy_embedders_diff_b"] = with_bias
    # lightx2v's distilled LoRAs: the head's full weight delta and bias delta (a pair as wide as the head)
    head = pairs(transformer, blocks, comfy, "lora_A", "lora_B", False, 6)
    proj = transformer.proj_out
    head["diffusion_model.head.head.diff"] = (
        torch.randn(proj.out_features, proj.in_features, generator=g) * 0.1
    )
    head["diffusion_model.head.head.diff_b"] = torch.randn(proj.out_features, generator=g) * 0.1
    files["lightx2v_head_diff"] = head
    # norm and full-weight diffs, which diffusers' converter drops (matched: dropped here too)
    dropped = pairs(transformer, blocks, comfy, "lora_down", "lora_up", True, 7)
    inner = transformer.blocks[0].attn1.to_q.in_features
    dropped["diffusion_model.blocks.0.norm3.diff"] = torch.randn(inner, generator=g)
    dropped["diffusion_model.blocks.0.norm3.diff_b"] = torch.randn(inner, generator=g)
    dropped["diffusion_model.blocks.0.self_attn.q.diff"] = torch.randn(inner, inner, generator=g)
    files["comfy_dropped_diffs"] = dropped
    return files


def every_linear(transformer) -> dict[str, str]:
    return {n: n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}


def qwen_zimage_files(pipe, root: Path) -> dict[str, dict]:
    transformer = pipe.transformer
    names = every_linear(transformer)
    return {
        "comfy_lora_a_b_alpha": pairs(transformer, names, lambda n: f"diffusion_model.{n}", "lora_A", "lora_B", True, 1),
        "comfy_down_up_alpha": pairs(transformer, names, lambda n: f"diffusion_model.{n}", "lora_down", "lora_up", True, 2),
        "kohya_alpha": pairs(transformer, names, lambda n: "lora_unet_" + n.replace(".", "_"), "lora_down", "lora_up", True, 3),
        "diffsynth_default": pairs(transformer, names, lambda n: n, "lora_A.default", "lora_B.default", False, 4),
    }  # fmt: skip


def flux2_files(pipe, root: Path) -> dict[str, dict]:
    transformer = pipe.transformer
    shape = {n: n for n in every_linear(transformer)}
    # BFL's original names → the diffusers modules a tensor of the right shape comes from
    bfl = {}
    for i in range(len(transformer.transformer_blocks)):
        for s, out, ff in (("img", "to_out.0", "ff"), ("txt", "to_add_out", "ff_context")):
            bfl[f"double_blocks.{i}.{s}_attn.proj"] = f"transformer_blocks.{i}.attn.{out}"
            bfl[f"double_blocks.{i}.{s}_mlp.0"] = f"transformer_blocks.{i}.{ff}.linear_in"
            bfl[f"double_blocks.{i}.{s}_mlp.2"] = f"transformer_blocks.{i}.{ff}.linear_out"
    for i in range(len(transformer.single_transformer_blocks)):
        bfl[f"single_blocks.{i}.linear1"] = f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj"
        bfl[f"single_blocks.{i}.linear2"] = f"single_transformer_blocks.{i}.attn.to_out"
    top = {
        "img_in": "x_embedder",
        "txt_in": "context_embedder",
        "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
        "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
        "final_layer.linear": "proj_out",
    }
    modulation = {
        "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
        "single_stream_modulation.lin": "single_stream_modulation.linear",
    }
    assert set(bfl.values()) | set(top.values()) | set(modulation.values()) <= set(shape)
    flat = lambda n: "lora_unet_" + n.replace(".", "_")  # noqa: E731
    aitk = lambda n: f"diffusion_model.{n}"  # noqa: E731
    files = {
        # sd-scripts: alphas folded in; diffusers' converter drops the modulation weights (matched)
        "kohya_alpha": pairs(transformer, bfl | top | modulation, flat, "lora_down", "lora_up", True, 1),
        # ai-toolkit (its qkv pairs split into q, k, v with one shared A) and PEFT's base_model.model. names
        "ai_toolkit": pairs(transformer, bfl | top | modulation, aitk, "lora_A", "lora_B", False, 2),
        "peft_base_model": pairs(transformer, bfl | top, lambda n: f"base_model.model.{n}", "lora_A", "lora_B", False, 3),
    }  # fmt: skip
    g = torch.Generator().manual_seed(4)
    inner = transformer.x_embedder.out_features
    for i in range(len(transformer.transformer_blocks)):
        for s in ("img", "txt"):
            for name, key in ((f"{s}_attn.qkv", "kohya_alpha"), (f"{s}_attn.qkv", "ai_toolkit")):
                prefix = (
                    flat(f"double_blocks.{i}.{name}")
                    if key == "kohya_alpha"
                    else aitk(f"double_blocks.{i}.{name}")
                )
                down, up = ("lora_down", "lora_up") if key == "kohya_alpha" else ("lora_A", "lora_B")
                files[key][f"{prefix}.{down}.weight"] = torch.randn(3, inner, generator=g)
                files[key][f"{prefix}.{up}.weight"] = torch.randn(3 * inner, 3, generator=g) * 0.5
                if key == "kohya_alpha":
                    files[key][f"{prefix}.alpha"] = torch.tensor(1.5)
    return files


FILES = {
    "wan22": wan_files,
    "wan_i2v": wan_files,
    "flux2": flux2_files,
    "qwenimage": qwen_zimage_files,
    "zimage": qwen_zimage_files,
}


@pytest.mark.parametrize("family", list(FILES))
def test_published_layouts_load_as_load_lora_weights_loads_them(family, tmp_path):
    pipe = pipeline(family)
    for name, tensors in FILES[family](pipe, tmp_path).items():
        file = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))
        assert assert_same_deltas(pipe, file) > 0, name
        if family == "wan22":  # Wan 2.2 A14B: the same file into the low-noise expert
            assert assert_same_deltas(pipe, file, target="transformer_2") > 0, name
