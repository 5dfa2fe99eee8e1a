"""Multi-LoRA in the engine: the image diffusers gives for the same file, mixed batches, clear refusals."""

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from safetensors.torch import load_file, save_file

from ditserve.replica.config import EngineConfig
from ditserve.replica.engine import AdapterDraining, Engine
from ditserve.replica.models.demo import ensure_demo_model
from ditserve.replica.request import GenerationParams, LoRARef
from tests.helpers import png_pixels, psnr

# (kohya name, diffusers module, in, out) of three demo-flux linears
TARGETS = [
    ("lora_unet_double_blocks_0_img_attn_proj", "transformer_blocks.0.attn.to_out.0", 128, 128),
    ("lora_unet_double_blocks_0_img_mlp_0", "transformer_blocks.0.ff.net.0.proj", 128, 512),
    ("lora_unet_single_blocks_0_linear2", "single_transformer_blocks.0.proj_out", 640, 128),
]
RANK, ALPHA = 4, 2.0
REQ = dict(prompt="a red fox", width=64, height=64, num_inference_steps=3, seed=3)


def weights(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        m: (torch.randn(RANK, i, generator=g), torch.randn(o, RANK, generator=g)) for _, m, i, o in TARGETS
    }


def write_peft(path, w, rank=RANK):
    tensors = {}
    for module, (a, b) in w.items():
        tensors[f"transformer.{module}.lora_A.weight"] = a[:rank].contiguous()
        tensors[f"transformer.{module}.lora_B.weight"] = b[:, :rank].contiguous()
    # network alphas the way diffusers reads them for Flux PEFT files
    tensors.update({f"transformer.{m}.alpha": torch.tensor(ALPHA) for m in w})
    save_file(tensors, str(path))
    return path


def write_kohya(path, w):
    names = {m: k for k, m, _, _ in TARGETS}
    tensors = {}
    for module, (a, b) in w.items():
        tensors[f"{names[module]}.lora_down.weight"] = a.contiguous()
        tensors[f"{names[module]}.lora_up.weight"] = b.contiguous()
        tensors[f"{names[module]}.alpha"] = torch.tensor(ALPHA)
    save_file(tensors, str(path))
    return path


def write_xlabs(path, seed: int, rank=RANK):
    """XLabs' Flux layout: one down/up pair for a block's fused qkv (the up rows q, k, v stacked) and one for
    its output projection, no alphas (scale 1); image stream (…1), text stream (…2) and a single block."""
    g = torch.Generator().manual_seed(seed)
    hidden = TARGETS[0][2]

    def pair(out):
        return torch.randn(rank, hidden, generator=g), torch.randn(out, rank, generator=g) * 0.5

    tensors = {}
    for key, out in [("double_blocks.0.processor.qkv_lora1", 3 * hidden), ("double_blocks.0.processor.proj_lora1", hidden),
                     ("double_blocks.0.processor.qkv_lora2", 3 * hidden), ("single_blocks.0.processor.qkv_lora", 3 * hidden)]:  # fmt: skip
        down, up = pair(out)
        tensors[f"{key}.down.weight"], tensors[f"{key}.up.weight"] = down, up
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    w_a, w_b = weights(1), weights(2)
    return {
        "root": root,
        "a_kohya": write_kohya(root / "a_kohya.safetensors", w_a),
        "a_peft": write_peft(root / "a_peft.safetensors", w_a),
        "b": write_kohya(root / "b.safetensors", w_b),
        "xlabs": write_xlabs(root / "xlabs.safetensors", 3),
    }


@pytest.fixture(scope="module")
def engine(files):
    config = EngineConfig(model="demo-flux", max_loras=3, max_lora_rank=8, lora_roots=(str(files["root"]),))
    engine = Engine(config).start()
    yield engine
    engine.shutdown()


def image(engine, *refs) -> np.ndarray:
    return png_pixels(engine.generate(GenerationParams(**REQ, lora=refs), timeout=120).outputs[0])


def diffusers_image(path, *more) -> np.ndarray:
    """diffusers' own image with the adapter file at path; with ``more`` = (path, weight) pairs, all of
    them at once (``set_adapters`` with path's weight 1)."""
    pipe = FluxPipeline.from_pretrained(ensure_demo_model("demo-flux"))
    if more:
        names = [f"l{i}" for i in range(len(more) + 1)]
        for name, p in zip(names, [path, *(p for p, _ in more)], strict=True):
            pipe.load_lora_weights(str(p), adapter_name=name)
        pipe.set_adapters(names, adapter_weights=[1.0, *(w for _, w in more)])
    else:
        pipe.load_lora_weights(str(path))
    return draw(pipe)


def draw(pipe) -> np.ndarray:
    """The pipeline's image for REQ."""
    out = pipe(
        REQ["prompt"],
        height=64,
        width=64,
        num_inference_steps=3,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(REQ["seed"]),
        output_type="np",
    ).images[0]
    return (out * 255).round().astype("uint8")


@pytest.mark.parametrize("kind", ["a_kohya", "a_peft"])
def test_engine_matches_diffusers_load_lora_weights(engine, files, kind):
    engine.load_lora(kind, str(files[kind]))
    ours = image(engine, LoRARef(name=kind))
    assert psnr(ours, diffusers_image(files[kind])) >= 40
    assert psnr(ours, image(engine)) < 30  # the adapter visibly changes the picture
    engine.unload_lora(kind)


def test_xlabs_file_matches_diffusers(files):
    """XLabs' layout targets q, k, v through one fused pair: its own engine, so the groups of linears on one
    input that it teaches (q, k, v without proj_mlp in the single block) do not carry into the other tests."""
    config = EngineConfig(model="demo-flux", max_loras=1, max_lora_rank=8, lora_roots=(str(files["root"]),))
    engine = Engine(config).start()
    try:
        engine.load_lora("xlabs", str(files["xlabs"]))
        ours = image(engine, LoRARef(name="xlabs"))
        assert psnr(ours, image(engine)) < 30  # the adapter visibly changes the picture
    finally:
        engine.shutdown()
    assert psnr(ours, diffusers_image(files["xlabs"])) >= 40


def test_alphas_for_some_modules_scale_the_others_as_diffusers_does(engine, files):
    """A FLUX PEFT file with alpha tensors beside some of its pairs only: diffusers' load_lora_weights gives
    the others the config's lora_alpha, the first alpha in the file (here 3 on a rank-4 pair: scale 3/4); the
    engine drew them at scale 1 (alpha = rank) and the image differed from diffusers'."""
    w = weights(1)
    path = files["root"] / "some_alphas.safetensors"
    tensors = {}
    for module, (a, b) in w.items():
        tensors[f"transformer.{module}.lora_A.weight"], tensors[f"transformer.{module}.lora_B.weight"] = (
            a,
            b * 2,
        )
    first, second, _ = sorted(w)  # the file's order
    tensors[f"transformer.{first}.alpha"] = torch.tensor(3.0)
    tensors[f"transformer.{second}.alpha"] = torch.tensor(8.0)
    save_file(tensors, str(path))
    engine.load_lora("some_alphas", str(path))
    try:
        ours = image(engine, LoRARef(name="some_alphas"))
    finally:
        engine.unload_lora("some_alphas")
    assert psnr(ours, diffusers_image(path)) >= 40


def test_peft_metadata_rank_and_alpha_patterns(engine, files):
    """A file saved the way diffusers saves one (``save_lora_weights`` with the adapter's LoraConfig in the
    safetensors metadata): a default lora_alpha, one module at another rank (rank_pattern) and one at another
    alpha (alpha_pattern), no alpha tensors. The engine scales each module as diffusers does."""
    w = weights(4)
    ranks = {"single_transformer_blocks.0.proj_out": 2}
    layers = {}
    for module, (a, b) in w.items():
        r = ranks.get(module, RANK)
        layers[f"{module}.lora_A.weight"] = a[:r].contiguous()
        layers[f"{module}.lora_B.weight"] = b[:, :r].contiguous()
    metadata = {
        "r": RANK,
        "lora_alpha": 8.0,
        "rank_pattern": {"single_transformer_blocks.0.proj_out": 2},
        "alpha_pattern": {"ff.net.0.proj": 1.0},
        "target_modules": [m for _, m, _, _ in TARGETS],
    }
    FluxPipeline.save_lora_weights(
        str(files["root"]),
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata=metadata,
        weight_name="patterns.safetensors",
    )
    path = files["root"] / "patterns.safetensors"
    info = engine.load_lora("patterns", str(path))
    try:
        assert info["rank"] == RANK
        ours = image(engine, LoRARef(name="patterns"))
    finally:
        engine.unload_lora("patterns")
    assert psnr(ours, diffusers_image(path)) >= 40


def test_alpha_pattern_keys_are_regular_expressions_as_in_peft(engine, files):
    """PEFT matches an alpha_pattern key as a regular expression on a module name's dotted suffix (``^`` for
    the whole name): a file saved from a config with such keys is scaled as diffusers scales it. The engine
    matched them as plain suffixes or globs, so these fell back to lora_alpha."""
    layers = {}
    for module, (a, b) in weights(7).items():
        layers[f"{module}.lora_A.weight"], layers[f"{module}.lora_B.weight"] = a, b
    metadata = {
        "r": RANK,
        "lora_alpha": 1.0,
        "alpha_pattern": {
            r"transformer_blocks\.\d+\.ff\.net\.0\.proj": 16.0,
            "^single_transformer_blocks.0.proj_out": 12.0,
        },
        "target_modules": [m for _, m, _, _ in TARGETS],
    }
    FluxPipeline.save_lora_weights(
        str(files["root"]),
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata=metadata,
        weight_name="regex.safetensors",
    )
    path = files["root"] / "regex.safetensors"
    engine.load_lora("regex", str(path))
    try:
        ours = image(engine, LoRARef(name="regex"))
    finally:
        engine.unload_lora("regex")
    assert psnr(ours, diffusers_image(path)) >= 40


def test_rslora_metadata_scales_by_the_square_root_of_the_rank(engine, files):
    """A file saved from a LoraConfig with ``use_rslora`` (its metadata says so): PEFT scales each module by
    alpha / sqrt(rank), as diffusers' load_lora_weights does. The engine scaled by alpha / rank, drawing it at
    half its strength here (rank 4)."""
    layers = {}
    for module, (a, b) in weights(5).items():
        layers[f"{module}.lora_A.weight"] = a
        layers[f"{module}.lora_B.weight"] = b * 0.5
    metadata = {
        "r": RANK,
        "lora_alpha": 4.0,
        "use_rslora": True,
        "target_modules": [m for _, m, _, _ in TARGETS],
    }
    FluxPipeline.save_lora_weights(
        str(files["root"]),
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata=metadata,
        weight_name="rslora.safetensors",
    )
    path = files["root"] / "rslora.safetensors"
    engine.load_lora("rslora", str(path))
    try:
        ours, at_half = (
            image(engine, LoRARef(name="rslora")),
            image(engine, LoRARef(name="rslora", scale=0.5)),
        )
    finally:
        engine.unload_lora("rslora")
    want = diffusers_image(path)
    assert psnr(ours, want) >= 40
    assert psnr(at_half, want) < 35  # alpha / rank: half the strength, another image


def test_a_peft_file_without_the_transformer_prefix_is_the_transformers(engine, files):
    """A file saved from the transformer itself (peft's get_peft_model_state_dict and save_file): module names
    without ``transformer.``. diffusers' load_lora_weights loads nothing from it (the plain image); the engine
    refused it as holding no LoRA weights for the transformer. It is read as diffusers'
    ``transformer.load_lora_adapter(file, prefix=None)`` reads it."""
    path = files["root"] / "unprefixed.safetensors"
    tensors = {}
    for module, (a, b) in weights(6).items():
        tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = a, b
    save_file(tensors, str(path))
    engine.load_lora("unprefixed", str(path))
    try:
        ours = image(engine, LoRARef(name="unprefixed"))
    finally:
        engine.unload_lora("unprefixed")
    pipe = FluxPipeline.from_pretrained(ensure_demo_model("demo-flux"))
    pipe.transformer.load_lora_adapter(str(path), prefix=None)
    assert psnr(ours, draw(pipe)) >= 40
    assert psnr(ours, image(engine)) < 30  # the adapter visibly changes the picture


def test_a_layout_the_pipelines_loader_does_not_convert_is_refused_as_such(files):
    """A kohya file for a pipeline class whose diffusers loader reads no kohya (SD3): its keys come back
    unconverted; the refusal says that no LoRA weights are in a layout that loader reads, naming a key (it
    said the file held transformer tensors that are no LoRA weights, naming lora_down weights)."""
    from ditserve.replica.lora.loader import read_lora_file

    pattern = (
        r"^path: .* has no LoRA weights for the transformer in a layout diffusers' StableDiffusion3Pipeline"
    )
    with pytest.raises(ValueError, match=pattern + r" loader reads \(keys such as 'lora_unet_"):
        read_lora_file(files["a_kohya"], "StableDiffusion3Pipeline")


@pytest.mark.parametrize(
    "pipeline", ["StableDiffusion3Pipeline", "WanPipeline", "Flux2Pipeline", "FluxPipeline"]
)
def test_peft_adapter_named_keys_the_loader_keeps_are_refused_as_an_unconverted_layout(files, pipeline):
    """DiffSynth-style keys (``<module>.lora_A.default.weight``), which the Qwen-Image and Z-Image loaders
    convert and these classes' loaders keep as they are (load_lora_weights loads nothing of them): refused
    naming the layout and a key; the refusal said the file held transformer tensors that are no LoRA
    weights."""
    from ditserve.replica.lora.loader import read_lora_file

    path = files["root"] / "default_named.safetensors"
    save_file(
        {
            f"{m}.lora_{x}.default.weight": t
            for m, (a, b) in weights(1).items()
            for x, t in (("A", a), ("B", b))
        },
        str(path),
    )
    pattern = (
        rf"^path: .* holds LoRA weights in a layout diffusers' {pipeline} loader does not convert \(keys such as "
        r"'[\w.]+\.lora_A\.default\.weight'\)"
    )
    with pytest.raises(ValueError, match=pattern):
        read_lora_file(path, pipeline)


@pytest.mark.parametrize(
    "pipeline",
    ["StableDiffusion3Pipeline", "WanPipeline", "Flux2Pipeline", "QwenImagePipeline", "ZImagePipeline"],
)
def test_alpha_tensors_beside_peft_keys_scale_every_family_as_flux(files, pipeline):
    """PEFT keys with kohya's per-module alpha tensors (the a_peft file): FLUX's loader returns the alphas and
    each module draws at alpha / rank. The other classes' loaders leave them in the state dict, where they
    were dropped: the adapter drew at scale 1 (here twice its strength). They scale every family alike.
    Qwen-Image's and Z-Image's converters fold the alphas in but name the modules transformer.transformer.*,
    which were refused as modules the model does not have."""
    from ditserve.replica.lora.loader import read_lora_file

    got = read_lora_file(files["a_peft"], pipeline)
    assert sorted(got.modules) == sorted(weights(1))
    for module, (a, b) in weights(1).items():
        delta = got.modules[module].b @ got.modules[module].a
        assert torch.allclose(delta, b @ a * ALPHA / RANK, rtol=1e-5, atol=1e-6)


def test_a_file_saved_from_a_dora_config_is_refused_as_dora(files):
    """A file whose metadata says use_dora but that holds no magnitude vectors: PEFT builds DoRA layers for it
    (diffusers' load_lora_weights fails on it); the engine served it as a plain LoRA."""
    from ditserve.replica.lora.loader import read_lora_file

    layers = {}
    for module, (a, b) in weights(1).items():
        layers[f"{module}.lora_A.weight"], layers[f"{module}.lora_B.weight"] = a, b
    metadata = {
        "r": RANK,
        "lora_alpha": 4.0,
        "use_dora": True,
        "target_modules": [m for _, m, _, _ in TARGETS],
    }
    FluxPipeline.save_lora_weights(
        str(files["root"]),
        transformer_lora_layers=layers,
        transformer_lora_adapter_metadata=metadata,
        weight_name="dora_config.safetensors",
    )
    with pytest.raises(ValueError, match=r"^path: .* is a DoRA adapter; DoRA is not supported"):
        read_lora_file(files["root"] / "dora_config.safetensors", "FluxPipeline")


def test_mixed_batch_gives_each_request_its_own_image(engine, files):
    engine.load_lora("a", str(files["a_kohya"]))
    engine.load_lora("b", str(files["b"]))
    alone = [image(engine, LoRARef(name="a")), image(engine), image(engine, LoRARef(name="b", scale=0.7))]
    steps_before = engine.steps_run
    futures = [
        engine.submit(GenerationParams(**REQ, lora=refs))
        for refs in [(LoRARef(name="a"),), (), (LoRARef(name="b", scale=0.7),)]
    ]
    mixed = [png_pixels(f.result(timeout=120).outputs[0]) for f in futures]
    assert engine.steps_run - steps_before < 3 * REQ["num_inference_steps"]  # they shared forwards
    for got, want in zip(mixed, alone, strict=True):
        assert psnr(got, want) >= 40
    # two adapters on one request (style + character) differ from either alone
    both = image(engine, LoRARef(name="a"), LoRARef(name="b", scale=0.7))
    assert psnr(both, alone[0]) < 35 and psnr(both, alone[2]) < 35
    engine.unload_lora("a")
    engine.unload_lora("b")


def spy_kernels(monkeypatch) -> dict:
    """Counts the fused GEMM launches (`lora_gemm`, with or without the shrink inside) and records the slice
    count of every shrink, whether its own kernel or inside a GEMM launch."""
    import ditserve.kernels.lora_gemm.op as gemm_op
    import ditserve.kernels.lora_linear.op as linear_op
    import ditserve.kernels.lora_shrink.op as shrink_op

    seen = {"gemm": 0, "slices": []}
    real_gemm, real_shrink = gemm_op.launch_lora_gemm, shrink_op.launch_lora_shrink

    def gemm(*a, **k):
        seen["gemm"] += 1
        if k.get("a_stacked") is not None:
            seen["slices"].append(k["a_stacked"].shape[0])
        return real_gemm(*a, **k)

    def shrink(x, a, *r, **k):
        seen["slices"].append(a.shape[0])
        return real_shrink(x, a, *r, **k)

    for mod in (gemm_op, linear_op):
        monkeypatch.setattr(mod, "launch_lora_gemm", gemm)
    for mod in (shrink_op, linear_op):
        monkeypatch.setattr(mod, "launch_lora_shrink", shrink)
    return seen


def test_two_adapters_on_one_request_match_diffusers(engine, files, monkeypatch):
    """A style and a character on one request: the first adapter inside the GEMM, the second as an in-place
    expand after it; the image is diffusers' with both adapters active (``set_adapters`` with the same
    weights), and the unfused path's."""
    import ditserve.kernels.lora as lora_api

    calls = spy_kernels(monkeypatch)
    calls["expand"] = 0
    real_expand = lora_api.lora_expand_op

    def expand(*a, **k):
        calls["expand"] += 1
        return real_expand(*a, **k)

    monkeypatch.setattr(lora_api, "lora_expand_op", expand)
    manager = engine.launcher.worker.lora
    engine.load_lora("a", str(files["a_kohya"]))
    engine.load_lora("b", str(files["b"]))
    try:
        both = image(engine, LoRARef(name="a"), LoRARef(name="b", scale=0.7))
        assert calls["gemm"] and calls["expand"] == calls["gemm"]  # one expand after each fused GEMM
        manager.fused = False
        unfused = image(engine, LoRARef(name="a"), LoRARef(name="b", scale=0.7))
    finally:
        manager.fused = True
        engine.unload_lora("a")
        engine.unload_lora("b")
    assert psnr(both, diffusers_image(files["a_kohya"], (files["b"], 0.7))) >= 40
    assert psnr(both, unfused) >= 40
    assert psnr(both, diffusers_image(files["a_kohya"])) < 35


def test_refusals_name_the_problem_and_leave_others_working(engine, files):
    root = files["root"]
    engine.load_lora("keep", str(files["b"]))
    want = image(engine, LoRARef(name="keep"))
    with pytest.raises(ValueError, match="'ghost' is not loaded"):
        engine.submit(GenerationParams(**REQ, lora=(LoRARef(name="ghost"),)))
    # one adapter twice would add its scales (1.0 + 0.5 drew as 1.5): refused, naming it
    with pytest.raises(ValueError, match=r"^lora: adapter\(s\) \['keep'\] given more than once"):
        engine.submit(GenerationParams(**REQ, lora=(LoRARef(name="keep"), LoRARef(name="keep", scale=0.5))))
    (root / "junk.safetensors").write_bytes(b"this is not a tensor file at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        engine.load_lora("junk", str(root / "junk.safetensors"))
    # a download cut short (inside the tensors, or inside the header) was refused as a layout diffusers cannot
    # read, or as no safetensors file: the user looked for a wrong format instead of fetching it again
    whole = files["b"].read_bytes()
    for cut in (len(whole) // 2, 40):
        (root / "cut.safetensors").write_bytes(whole[:cut])
        with pytest.raises(
            ValueError, match=r"^path: .*cut\.safetensors is truncated: .*fetch the file again"
        ):
            engine.load_lora("cut", str(root / "cut.safetensors"))
    # a Wan file (its original layout) on this FLUX model: said to be for another model, not only which
    # modules are missing
    wan = root / "wan.safetensors"
    save_file(
        {f"diffusion_model.blocks.0.self_attn.q.lora_{x}.weight": torch.zeros(4, 4) for x in "AB"}, str(wan)
    )
    with pytest.raises(
        ValueError, match=r"^path: .* names none of this FluxPipeline model's layers .*another model"
    ):
        engine.load_lora("wan", str(wan))
    bad = {m: (torch.zeros(RANK, 7), torch.zeros(o, RANK)) for _, m, _, o in TARGETS}
    with pytest.raises(ValueError, match="do not match the model"):
        engine.load_lora("bad", str(write_peft(root / "bad.safetensors", bad)))
    # a layer that is no linear (here a norm) was refused naming no field: a 400 without param "path"
    norm = {"transformer_blocks.0.attn.norm_q": (torch.zeros(RANK, 16), torch.zeros(16, RANK))}
    with pytest.raises(ValueError, match=r"^path: .* not linear: \['transformer_blocks.0.attn.norm_q'\]"):
        engine.load_lora("norm", str(write_peft(root / "norm.safetensors", norm)))
    big = {m: (torch.zeros(16, i), torch.zeros(o, 16)) for _, m, i, o in TARGETS}
    with pytest.raises(ValueError, match="above --max-lora-rank 8"):
        engine.load_lora("big", str(write_peft(root / "big.safetensors", big, rank=16)))
    dora = root / "dora.safetensors"
    save_file(
        {
            "transformer.x.lora_A.weight": torch.zeros(2, 2),
            "transformer.x.lora_magnitude_vector": torch.zeros(2),
        },
        str(dora),
    )
    with pytest.raises(ValueError, match="DoRA"):
        engine.load_lora("dora", str(dora))
    # NaN weights drew every image of the adapter black; a rank-0 file failed with ZeroDivisionError (500)
    nan = {m: (torch.full((RANK, i), float("nan")), torch.zeros(o, RANK)) for _, m, i, o in TARGETS}
    with pytest.raises(ValueError, match="^path: .*NaN or infinite weights"):
        engine.load_lora("nan", str(write_peft(root / "nan.safetensors", nan)))
    empty = {m: (torch.zeros(0, i), torch.zeros(o, 0)) for _, m, i, o in TARGETS}
    with pytest.raises(ValueError, match="^path: .*rank 0"):
        engine.load_lora("empty", str(write_peft(root / "empty.safetensors", empty)))
    with pytest.raises(ValueError, match="home directory that does not exist"):
        engine.load_lora("tilde", "~no-such-user-here/adapter.safetensors")
    with pytest.raises(ValueError, match="outside the allowed LoRA roots"):
        engine.load_lora("escape", str(root / ".." / "elsewhere.safetensors"))
    engine.load_lora("s2", str(files["a_kohya"]))
    engine.load_lora("s3", str(files["a_peft"]))
    with pytest.raises(ValueError, match="all 3 adapter slots are in use"):
        engine.load_lora("s4", str(files["b"]))
    assert np.array_equal(image(engine, LoRARef(name="keep")), want)  # unaffected by all of the above
    for name in ("keep", "s2", "s3"):
        engine.unload_lora(name)


def test_a_kohya_file_with_text_encoder_weights_is_refused_naming_them(engine, files):
    """kohya files trained with the text encoder hold ``lora_te1_*`` weights that diffusers' load_lora_weights
    applies to CLIP; a per-request adapter changes the transformer only, so the file is refused (it loaded
    and drew another image than diffusers, silently) and the engine keeps serving."""
    path = files["root"] / "with_te.safetensors"
    tensors = dict(load_file(str(files["a_kohya"])))
    te = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    tensors |= {f"{te}.lora_down.weight": torch.ones(RANK, 32), f"{te}.lora_up.weight": torch.ones(32, RANK)}
    save_file(tensors | {f"{te}.alpha": torch.tensor(ALPHA)}, str(path))
    with pytest.raises(ValueError, match=r"^path: .* holds LoRA weights for text_encoder; adapters apply to"):
        engine.load_lora("te", str(path))
    assert "te" not in [a["name"] for a in engine.lora_list()]
    assert image(engine).shape == (64, 64, 3)  # still serving
    # saved untrained (lora_up / lora_B zero, as LoRA starts; the down factor random): the text encoder's part
    # adds nothing, and it was refused all the same. kohya's layout draws the transformer's adapter alone
    # (diffusers' load_lora_weights fails on FLUX kohya text-encoder keys: compared without them); diffusers'
    # own layout as its load_lora_weights draws it, the zero deltas on CLIP included
    down = torch.randn(RANK, 32, generator=torch.Generator().manual_seed(0))
    kohya = files["root"] / "untrained_te_kohya.safetensors"
    tensors |= {f"{te}.lora_down.weight": down, f"{te}.lora_up.weight": torch.zeros(32, RANK)}
    save_file(tensors | {f"{te}.alpha": torch.tensor(ALPHA)}, str(kohya))
    clip = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    peft = files["root"] / "untrained_te_peft.safetensors"
    save_file(
        load_file(str(files["a_peft"]))
        | {f"{clip}.lora_A.weight": down, f"{clip}.lora_B.weight": torch.zeros(32, RANK)},
        str(peft),
    )
    for name, path, want in (("k", kohya, files["a_kohya"]), ("p", peft, peft)):
        engine.load_lora(name, str(path))
        assert psnr(image(engine, LoRARef(name=name)), diffusers_image(want)) >= 40
        engine.unload_lora(name)


def test_a_file_with_norm_weights_is_refused_naming_them(engine, files):
    """A FLUX Control LoRA carries the attention norms' scales (``norm_q.weight`` ...) beside its LoRA pairs;
    diffusers' load_lora_weights writes them into the model. A per-request adapter cannot, so the file is
    refused: it loaded, its norms were dropped and every image differed from diffusers'."""
    path = files["root"] / "with_norms.safetensors"
    tensors = dict(load_file(str(files["a_peft"])))
    tensors["transformer.transformer_blocks.0.attn.norm_q.weight"] = torch.full((16,), 5.0)
    save_file(tensors, str(path))
    pipe = FluxPipeline.from_pretrained(ensure_demo_model("demo-flux"))
    pipe.load_lora_weights(str(path))
    assert pipe.transformer.transformer_blocks[0].attn.norm_q.weight[0] == 5.0  # diffusers applies it
    with pytest.raises(
        ValueError, match=r"^path: .* no LoRA weights \(transformer_blocks.0.attn.norm_q.weight\)"
    ):
        engine.load_lora("norms", str(path))
    assert "norms" not in [a["name"] for a in engine.lora_list()]
    assert image(engine).shape == (64, 64, 3)  # still serving


def test_a_request_scale_is_the_strength_and_the_load_scale_its_default(engine, files):
    engine.load_lora("at08", str(files["b"]), 0.8)
    engine.load_lora("at10", str(files["b"]), 1.0)
    try:
        # A request's scale replaces the load-time scale (never multiplies it) ...
        assert np.array_equal(
            image(engine, LoRARef(name="at08", scale=1.0)), image(engine, LoRARef(name="at10"))
        )
        # ... and a request that gives none draws with the load-time scale.
        assert np.array_equal(
            image(engine, LoRARef(name="at08")), image(engine, LoRARef(name="at10", scale=0.8))
        )
        assert not np.array_equal(image(engine, LoRARef(name="at08")), image(engine, LoRARef(name="at10")))
    finally:
        engine.unload_lora("at08")
        engine.unload_lora("at10")


def test_unloading_an_adapter_in_use_lets_its_requests_finish(engine, files):
    engine.load_lora("busy", str(files["b"]))
    want = image(engine, LoRARef(name="busy"))
    running = engine.submit(
        GenerationParams(**{**REQ, "num_inference_steps": 40}, lora=(LoRARef(name="busy"),))
    )
    first = GenerationParams(**REQ, lora=(LoRARef(name="busy"),))
    queued = engine.submit(first)
    engine.unload_lora("busy")  # answers at once: no error although two requests use it
    with pytest.raises(ValueError, match="'busy' is not loaded"):
        engine.submit(GenerationParams(**REQ, lora=(LoRARef(name="busy"),)))
    got = png_pixels(queued.result(timeout=120).outputs[0])  # drawn with the adapter (batched: not bitwise)
    assert psnr(got, want) >= 40 and psnr(got, want) > psnr(got, image(engine)) + 10
    running.result(timeout=120)
    # Unloaded once its last request finished: the name can be loaded again.
    engine.run_control(lambda: None).result(timeout=60)  # one loop pass after the last step
    assert "busy" not in {a["name"] for a in engine.lora_list()}
    engine.load_lora("busy", str(files["b"]))
    engine.unload_lora("busy")


def test_replacing_an_adapter_in_use_is_refused_until_its_requests_are_done(engine, files):
    """Loading a name again replaces its adapter between two steps; while queued or running requests use it,
    that drew their images part with each file (14 dB from either here). The load is refused (409 at the
    server: retry), the requests get the adapter they were accepted with, and the same load succeeds after."""
    engine.load_lora("swap", str(files["a_kohya"]))
    want = image(engine, LoRARef(name="swap"))
    running = engine.submit(GenerationParams(**REQ, lora=(LoRARef(name="swap"),)))
    with pytest.raises(
        AdapterDraining, match=r"^name: adapter 'swap' is used by 1 queued or running request"
    ):
        engine.load_lora("swap", str(files["b"]))
    assert np.array_equal(png_pixels(running.result(timeout=120).outputs[0]), want)
    engine.load_lora("swap", str(files["b"]))  # nothing uses it now
    try:
        assert psnr(image(engine, LoRARef(name="swap")), want) < 30
    finally:
        engine.unload_lora("swap")


def test_lora_inside_the_gemm_draws_what_the_unfused_path_draws(engine, files, monkeypatch):
    calls = spy_kernels(monkeypatch)
    manager = engine.launcher.worker.lora
    engine.load_lora("a", str(files["a_kohya"]))
    try:
        manager.fused = False
        unfused = image(engine, LoRARef(name="a"))
        assert not calls["gemm"]
        manager.fused = True
        fused = image(engine, LoRARef(name="a"))
        assert calls["gemm"]  # the LoRA went through the fused GEMM (Triton interpreter here, GPU in serving)
    finally:
        manager.fused = True
        engine.unload_lora("a")
    assert psnr(fused, unfused) >= 40
    assert psnr(fused, image(engine)) < 30


def test_compiled_engine_serves_lora_and_plain_requests_like_eager(engine, files):
    """--compile: the blocks are compiled; steps with LoRA call the adapter path at each adapted linear."""
    config = EngineConfig(
        model="demo-flux", max_loras=2, max_lora_rank=8, lora_roots=(str(files["root"]),), compile=True
    )
    compiled = Engine(config).start()
    try:
        plain_before = image(compiled, *())
        for e in (engine, compiled):
            e.load_lora("a", str(files["a_kohya"]))
        want = [image(engine, LoRARef(name="a", scale=s)) for s in (1.0, 0.5)] + [image(engine)]
        futures = [
            compiled.submit(GenerationParams(**REQ, lora=refs))
            for refs in [(LoRARef(name="a"),), (LoRARef(name="a", scale=0.5),), ()]
        ]
        got = [png_pixels(f.result(timeout=300).outputs[0]) for f in futures]
        for g, w in zip(got, want, strict=True):
            assert psnr(g, w) >= 40
        assert psnr(got[0], got[2]) < 30  # the adapter is applied under compile
        assert psnr(plain_before, want[2]) >= 40
    finally:
        engine.unload_lora("a")
        compiled.shutdown()


SIBLINGS = {  # module → (in, out): linears that read the same tensor in a demo-flux forward
    **{f"transformer_blocks.0.attn.{n}": (128, 128) for n in ("to_q", "to_k", "to_v")},
    **{f"transformer_blocks.0.attn.{n}": (128, 128) for n in ("add_q_proj", "add_k_proj", "add_v_proj")},
    "single_transformer_blocks.0.proj_mlp": (128, 512),
    **{f"single_transformer_blocks.0.attn.{n}": (128, 128) for n in ("to_q", "to_k", "to_v")},
}


def test_linears_on_one_input_share_one_shrink(engine, files, monkeypatch):
    """q, k, v of each stream (and a single block's proj_mlp, which reads the same normed tensor) are learned
    as groups from one forward; from then on each group runs one multi-slice shrink (x read once), in the
    fused and the unfused path and per adapter position, and the image is the one each linear's own shrink
    gives, and the one diffusers gives for the same file."""
    g = torch.Generator().manual_seed(5)
    w = {
        m: (torch.randn(RANK, i, generator=g), torch.randn(o, RANK, generator=g))
        for m, (i, o) in SIBLINGS.items()
    }
    path = write_peft(files["root"] / "qkv.safetensors", w)
    w2 = {
        m: (torch.randn(RANK, i, generator=g), torch.randn(o, RANK, generator=g))
        for m, (i, o) in SIBLINGS.items()
    }
    path2 = write_peft(files["root"] / "qkv2.safetensors", w2)
    slices = spy_kernels(monkeypatch)["slices"]
    manager = engine.launcher.worker.lora
    engine.load_lora("qkv", str(path))
    try:
        manager.share_shrink = False
        alone = image(engine, LoRARef(name="qkv"))
        assert slices and set(slices) == {1}  # one shrink per linear
        manager.share_shrink = True
        image(engine, LoRARef(name="qkv"))  # learns the groups
        groups = {name: tuple(layer.name for layer in group) for name, group in manager.groups.items()}
        block, single = "transformer_blocks.0.attn.", "single_transformer_blocks.0."
        assert groups == {
            block + "to_q": tuple(block + n for n in ("to_q", "to_k", "to_v")),
            block + "add_q_proj": tuple(block + n for n in ("add_q_proj", "add_k_proj", "add_v_proj")),
            single + "proj_mlp": (
                single + "proj_mlp",
                *(single + "attn." + n for n in ("to_q", "to_k", "to_v")),
            ),
        }
        slices.clear()
        shared = image(engine, LoRARef(name="qkv"))
        assert sorted(set(slices)) == [3, 4]  # one shrink per group, none per linear
        manager.fused = False  # the base GEMM, then the expand in place: the same groups
        slices.clear()
        unfused = image(engine, LoRARef(name="qkv"))
        assert sorted(set(slices)) == [3, 4]
        manager.fused = True
        # an adapter loaded after the groups were formed is written into the groups' A buffers; a request
        # with two adapters (two positions, each its own group shrinks) equals the unshared path
        engine.load_lora("qkv2", str(path2))
        both = (LoRARef(name="qkv"), LoRARef(name="qkv2"))
        slices.clear()
        both_shared = image(engine, *both)
        assert sorted(set(slices)) == [3, 4]
        manager.share_shrink = False
        both_alone = image(engine, *both)
        manager.share_shrink = True
        engine.unload_lora("qkv")
        later = image(engine, LoRARef(name="qkv2"))
        # an adapter on the first linear of a group only: that linear shrinks alone
        engine.unload_lora("qkv2")
        path3 = write_peft(files["root"] / "q.safetensors", {block + "to_q": w[block + "to_q"]})
        engine.load_lora("q", str(path3))
        slices.clear()
        only_q = image(engine, LoRARef(name="q"))
        assert slices and set(slices) == {1}
    finally:
        manager.share_shrink = manager.fused = True
        for name in ("qkv", "qkv2", "q"):
            if name in manager.slots:
                engine.unload_lora(name)
    assert psnr(shared, alone) >= 40 and psnr(unfused, alone) >= 40
    assert psnr(both_shared, both_alone) >= 40 and psnr(both_shared, shared) < 30
    assert psnr(shared, diffusers_image(path)) >= 40
    assert psnr(later, diffusers_image(path2)) >= 40
    assert psnr(shared, image(engine)) < 30  # the adapter visibly changes the picture
    assert psnr(later, shared) < 30
    assert psnr(only_q, diffusers_image(path3)) >= 40


def test_a_relative_adapter_path_is_read_under_the_root_never_the_working_directory(tmp_path, monkeypatch):
    from pathlib import Path

    from ditserve.replica.lora.loader import inspect_adapter

    root, cwd = tmp_path / "root", tmp_path / "cwd"
    root.mkdir()
    cwd.mkdir()
    write_kohya(cwd / "a.safetensors", weights(1))  # the same name in the working directory: never read
    write_kohya(root / "a.safetensors", weights(2))
    monkeypatch.chdir(cwd)
    assert inspect_adapter("a.safetensors", (str(root),), 128) == (root / "a.safetensors").resolve()
    refusals = {
        "outside": ("../cwd/a.safetensors", (str(root),), 128),
        "relative": ("a.safetensors", (), 128),  # no root: a relative path has no meaning on the server
        "rank": ("a.safetensors", (str(root),), 2),
        "does not exist": ("b.safetensors", (str(root),), 128),
    }
    for expected, (path, roots, max_rank) in refusals.items():
        with pytest.raises(ValueError) as refused:
            inspect_adapter(path, roots, max_rank)
        message = str(refused.value)
        assert message.startswith("path: ") and expected in message, message
        assert str(Path.cwd()) not in message, message


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_a_lycoris_lokr_or_loha_file_is_refused_as_such(files, kind):
    """ai-toolkit's LoKr files (Kronecker factors, keys ``diffusion_model.<module>.lokr_w1``), which diffusers'
    Z-Image and FLUX.2 loaders read, and LyCORIS LoHa files: no low-rank pairs a request's adapter applies. The
    frontend's check and the replicas' read refuse them naming the format (they said the file held no
    lora_A / lora_down and was no adapter at all)."""
    from diffusers import ZImagePipeline

    from ditserve.replica.lora.loader import inspect_adapter, read_lora_file

    module = "diffusion_model.layers.0.attention.to_q"
    if kind == "lokr":
        tensors = {f"{module}.lokr_w1": torch.randn(4, 4), f"{module}.lokr_w2": torch.randn(8, 8)}
        # diffusers takes it as a LoKr adapter for the transformer
        assert all(".lokr_w" in k for k in ZImagePipeline.lora_state_dict(str(_save(files, kind, tensors))))
    else:  # LyCORIS' kohya-style names
        module = "lora_unet_layers_0_attention_to_q"
        shapes = {"hada_w1_a": (32, 4), "hada_w1_b": (4, 32), "hada_w2_a": (32, 4), "hada_w2_b": (4, 32)}
        tensors = {f"{module}.{name}": torch.randn(*shape) for name, shape in shapes.items()}
    path = _save(files, kind, tensors | {f"{module}.alpha": torch.tensor(4.0)})
    label = {"lokr": "LoKr", "loha": "LoHa"}[kind]
    pattern = (
        rf"^path: .*{kind}.safetensors is a LyCORIS {label} adapter \(.*\.(lokr|hada)_w.*\); {label} is not"
    )
    with pytest.raises(ValueError, match=pattern):
        inspect_adapter(str(path), (), 64)
    with pytest.raises(ValueError, match=pattern):
        read_lora_file(path, "ZImagePipeline")


def _save(files, name: str, tensors: dict) -> Path:
    path = files["root"] / f"{name}.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(
    "pipeline, module",
    [("QwenImagePipeline", "transformer_blocks_0_attn_to_q"), ("ZImagePipeline", "layers_0_attention_to_q")],
)
def test_kohya_text_encoder_weights_are_refused_where_diffusers_has_no_text_encoder_for_them(
    files, pipeline, module
):
    """An sd-scripts file trained with the text encoder (``lora_te1_*`` beside ``lora_unet_*``) for a class
    whose converter maps no text encoder: diffusers makes transformer module names of the text encoder's
    keys (that load_lora_weights skips), so its image lacks them. The file is refused naming the text
    encoder's weights (it read them as transformer modules, refused as modules the model does not have)."""
    import diffusers

    from ditserve.replica.lora.loader import read_lora_file

    te = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    tensors = {}
    for key, i, o in ((f"lora_unet_{module}", 32, 32), (te, 16, 16)):
        tensors |= {
            f"{key}.lora_down.weight": torch.randn(RANK, i),
            f"{key}.lora_up.weight": torch.randn(o, RANK),
        }
        tensors[f"{key}.alpha"] = torch.tensor(ALPHA)
    path = _save(files, f"te_{pipeline}", tensors)
    converted = getattr(diffusers, pipeline).lora_state_dict(str(path))
    assert len(converted) == 4 and all(k.startswith("transformer.") for k in converted)
    with pytest.raises(
        ValueError, match=r"^path: .* holds LoRA weights for the text encoder \(lora_te1_\*\); "
    ):
        read_lora_file(path, pipeline)


def test_refusals_of_layouts_diffusers_cannot_convert_name_what_failed(files):
    """A kohya FLUX file whose single blocks' linear1 does not have FLUX.1-dev's widths fails a bare assert
    in diffusers' converter, and a FLUX.2 file in BFL names with lora_down / lora_up (ComfyUI's) goes to diffusers' kohya
    converter, which keeps none of it: the refusals said 'for FluxPipeline: ' with nothing after, and
    'keys such as 'none''; they name the failed check and a key of the file."""
    from ditserve.replica.lora.loader import read_lora_file

    # demo-flux's linear1: q, k, v and the MLP's input, 3 × 128 + 512 rows (FLUX.1-dev: 3 × 3072 + 12288)
    linear1 = "lora_unet_single_blocks_0_linear1"
    kohya = {
        f"{linear1}.lora_down.weight": torch.randn(RANK, 128),
        f"{linear1}.lora_up.weight": torch.randn(896, RANK),
    }
    with pytest.raises(ValueError, match=r"for FluxPipeline: AssertionError in diffusers' _convert_\w+$"):
        read_lora_file(_save(files, "kohya_linear1", kohya), "FluxPipeline")
    key = "diffusion_model.double_blocks.0.img_attn.proj"
    comfy = {f"{key}.lora_down.weight": torch.randn(RANK, 64), f"{key}.lora_up.weight": torch.randn(64, RANK)}
    with pytest.raises(
        ValueError, match=rf"Flux2KleinPipeline loader reads \(keys such as '{key}.lora_\w+.weight'\)$"
    ):
        read_lora_file(_save(files, "flux2_comfy", comfy), "Flux2KleinPipeline")


def test_comfyui_t5_weights_are_refused_unless_all_zero(files):
    """ComfyUI's FLUX files (``diffusion_model.<BFL name>`` pairs) may carry T5 weights
    (``text_encoders.t5xxl.transformer.*``); diffusers' converter drops them, so neither the text encoder nor
    the transformer gets them, and the adapter loaded without a word. They are refused as text-encoder
    weights like kohya's ``lora_te1_*``; all-zero ones (saved untrained) change nothing and load."""
    from diffusers import FluxPipeline

    from ditserve.replica.lora.loader import read_lora_file

    bfl = [
        "double_blocks.0.img_attn.proj",
        "double_blocks.0.img_mlp.0",
        "single_blocks.0.linear2",
    ]  # TARGETS'
    names = {kohya: f"diffusion_model.{name}" for (kohya, *_), name in zip(TARGETS, bfl, strict=True)}
    comfy = {}
    for key, value in load_file(str(files["a_kohya"])).items():
        name, suffix = key.split(".", 1)
        comfy[f"{names[name]}.{suffix}"] = value
    t5 = "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q"
    for fill in (0.0, 1.0):
        tensors = comfy | {f"{t5}.lora_down.weight": torch.full((RANK, 32), fill)}
        path = _save(
            files, f"comfy_t5_{fill}", tensors | {f"{t5}.lora_up.weight": torch.full((32, RANK), fill)}
        )
        assert not any("t5" in k or "text" in k for k in FluxPipeline.lora_state_dict(str(path)))
        if fill:
            with pytest.raises(
                ValueError, match=r"holds LoRA weights for the text encoder \(text_encoders.t5xxl.\*\)"
            ):
                read_lora_file(path, "FluxPipeline")
        else:
            got = read_lora_file(path, "FluxPipeline").modules
            want = read_lora_file(files["a_kohya"], "FluxPipeline").modules
            assert got.keys() == want.keys() == {m for _, m, _, _ in TARGETS}
            assert all(torch.equal(got[m].b @ got[m].a, want[m].b @ want[m].a) for m in got)
