"""--encoder-tp-size: the text encoders sharded over the replica's first ranks (column-parallel q/k/v and
gate/up, row-parallel o/down, the vocabulary cut by rows) give the prompt embeddings and the images of
one rank, each rank holding about half the encoder; degrees the encoder cannot take are refused naming
the flag before any rank starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from ditserve.replica.config import EngineConfig, ParallelFlags
from ditserve.replica.engine import Engine
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.parallel.encoder_tp import apply_encoder_tp, encoder_components, planned_param_bytes
from ditserve.replica.parallel.testing import run_distributed
from ditserve.replica.request import GenerationParams
from ditserve.replica.worker import load_pipeline
from tests.families.harness import images, running_engine, single_thread  # noqa: F401
from tests.helpers import psnr

pytestmark = pytest.mark.usefixtures("single_thread")

FLUX2 = GenerationParams(prompt="a red fox on a hill", width=64, height=64, num_inference_steps=2, seed=3)
QWEN = GenerationParams(
    prompt="a red fox",
    negative_prompt="blue",
    true_cfg_scale=2.0,
    width=64,
    height=64,
    num_inference_steps=2,
    seed=5,
)


def _padded(n: int, multiple: int = 8) -> int:
    """A vocabulary rounded up as real checkpoints round theirs (so the embedding rows divide the degree)."""
    return -(-n // multiple) * multiple


# ---- tiny encoders whose heads divide 2: GQA (4 heads over 2 KV heads), biases, tied embeddings, T5 -----
def mistral3(vocab: int = 200):
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    from tests.families.flux2 import TEXT_HIDDEN

    text = MistralConfig(
        vocab_size=vocab,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=8,
        num_hidden_layers=30,  # FLUX.2 dev reads hidden states 10, 20, 30
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )
    vision = PixtralVisionConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
        image_size=32, patch_size=16,
    )  # fmt: skip
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=vocab - 1)
    return Mistral3ForConditionalGeneration(config).eval()


def qwen25vl(vocab: int = 200):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096,
            rope_scaling={"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
        vocab_size=vocab,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen3_causal(vocab: int = 200):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def t5(vocab: int = 200):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
    )  # fmt: skip
    return T5EncoderModel(config).eval()


ENCODERS = {"mistral3": mistral3, "qwen2.5-vl": qwen25vl, "qwen3": qwen3_causal, "t5": t5}


def _whole_and_sharded(rank: int, world_size: int) -> dict:
    """Each encoder's last and middle hidden states, whole and sharded over the 2 ranks; bytes per rank."""
    group = torch.distributed.new_group([0, 1])
    ids = torch.randint(0, 200, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded prompt
    out = {}
    for name, build in ENCODERS.items():
        torch.manual_seed(0)
        model = build()
        with torch.no_grad():
            whole = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            planned = planned_param_bytes(model, 2)
            cuts = apply_encoder_tp(model, group=group)
            sharded = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        states = [
            (whole.hidden_states[k], sharded.hidden_states[k]) for k in (-1, len(whole.hidden_states) // 2)
        ]
        logits = getattr(whole, "logits", None)
        if logits is not None:
            states.append((logits, sharded.logits))
        out[name] = {
            "error": max((a - b).abs().max().item() for a, b in states),
            "scale": max(a.abs().max().item() for a, _ in states),
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "whole_bytes": whole_bytes,
            "planned_bytes": planned,
            "cuts": cuts,
        }
    return out


def test_sharded_encoders_give_one_ranks_hidden_states_with_half_the_bytes():
    ranks = run_distributed(_whole_and_sharded, 2, timeout_s=120)
    for name in ENCODERS:
        r0, r1 = ranks[0][name], ranks[1][name]
        assert r0["error"] <= 1e-5 * max(1.0, r0["scale"]), (name, r0)
        assert r1["error"] <= 1e-5 * max(1.0, r1["scale"]), (name, r1)
        assert r0["bytes"] == r1["bytes"] == r0["planned_bytes"], (name, r0, r1)
        assert r0["cuts"].get("row", 0) > 0 and r0["cuts"].get("vocab") == 1, (name, r0["cuts"])
    # every decoder layer's two row-parallel linears, T5's attention output and feed-forward out
    assert ranks[0]["mistral3"]["cuts"]["row"] == 2 * 30
    # each rank holds about half; what stays whole (norms, the tiny vision towers) is a larger share here
    # than in the real models (FLUX.2 dev's Mistral: 0.51, benchmarks/engine/encoder_memory.py)
    for name, most in {"mistral3": 0.62, "qwen3": 0.52, "t5": 0.52, "qwen2.5-vl": 0.76}.items():
        assert ranks[0][name]["bytes"] < most * ranks[0][name]["whole_bytes"], name


# ---- the engine: FLUX.2 and Qwen-Image folders whose encoders take a degree of 2 --------------------------
@pytest.fixture(scope="module")
def flux2_folder(tmp_path_factory) -> Path:
    from diffusers import Flux2Pipeline

    from tests.families.flux2 import build_tiny

    torch.manual_seed(0)
    tiny = build_tiny()
    encoder = mistral3(_padded(len(tiny.tokenizer)))
    pipe = Flux2Pipeline(tiny.scheduler, tiny.vae, encoder, tiny.tokenizer, tiny.transformer)
    path = tmp_path_factory.mktemp("flux2-encoder-tp")
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwenimage_folder(tmp_path_factory) -> Path:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.families.qwenimage import build_pipeline

    pipe = build_pipeline("tiny")
    config = pipe.text_encoder.config
    config.vocab_size = config.text_config.vocab_size = _padded(config.text_config.vocab_size)
    torch.manual_seed(1)
    pipe.register_modules(text_encoder=Qwen2_5_VLForConditionalGeneration(config).eval())
    path = tmp_path_factory.mktemp("qwenimage-encoder-tp")
    pipe.save_pretrained(path)
    return path


def _saved_with_encoder(pipe, path: Path, name: str, **config) -> Path:
    """``pipe`` saved to ``path`` with its encoder ``name`` rebuilt at random from its own config changed by
    ``config`` and its vocabulary padded (the tiny family encoders have one KV head, which a degree of 2
    cannot cut)."""
    model = getattr(pipe, name)
    tokenizer = getattr(pipe, name.replace("text_encoder", "tokenizer"))
    config = {**model.config.to_dict(), **config, "vocab_size": _padded(len(tokenizer))}
    torch.manual_seed(2)
    pipe.register_modules(**{name: type(model)(type(model.config).from_dict(config)).eval()})
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def zimage_folder(tmp_path_factory) -> Path:
    from tests.families.zimage import build_pipeline

    path = tmp_path_factory.mktemp("zimage-encoder-tp")
    return _saved_with_encoder(build_pipeline("tiny"), path, "text_encoder", num_key_value_heads=2)


@pytest.fixture(scope="module")
def klein_folder(tmp_path_factory) -> Path:
    from tests.families.flux2 import build_tiny

    path = tmp_path_factory.mktemp("klein-encoder-tp")
    return _saved_with_encoder(build_tiny(klein=True), path, "text_encoder", num_key_value_heads=2)


@pytest.fixture(scope="module")
def sd3_folder(tmp_path_factory) -> Path:
    from tests.families.sd3 import build_pipeline

    # T5 (2 heads) sharded, both CLIPs kept whole
    path = tmp_path_factory.mktemp("sd3-encoder-tp")
    return _saved_with_encoder(build_pipeline("tiny"), path, "text_encoder_3")


FAMILY_PARAMS = {
    "flux2": FLUX2,
    "qwenimage": QWEN,
    "zimage": QWEN.model_copy(update={"true_cfg_scale": None, "guidance_scale": 3.0}),
    "klein": FLUX2.model_copy(update={"guidance_scale": 3.0}),
    "sd3": QWEN.model_copy(update={"true_cfg_scale": None, "guidance_scale": 4.0}),
}


def _encoder_bytes(pipe, names: list[str], planned_degree: int | None = None) -> int:
    """Parameter bytes of the pipeline's encoder models ``names`` (as one rank of ``planned_degree`` holds
    them, if given)."""
    total = 0
    for name in names:
        model = getattr(pipe, name, None)
        if model is None:
            continue
        if planned_degree is None:
            total += sum(p.numel() * p.element_size() for p in model.parameters())
        else:
            total += planned_param_bytes(model, planned_degree, name)
    return total


def _encode(rank: int, world_size: int, folder: str, params: GenerationParams) -> tuple[dict, int]:
    """The request's embeddings from encoders loaded through the engine's path and sharded over 2 ranks."""
    spec = resolve_model(folder)
    group = torch.distributed.new_group([0, 1]) if world_size > 1 else None
    pipe = load_pipeline(spec, torch.float32, torch.device("cpu"), encoder_group=group)
    runner = spec.family_spec.load("runner")(
        pipe, device=torch.device("cpu"), dtype=torch.float32, max_sequence_length=512, mesh=None,
        cuda_graphs=False,
    )  # fmt: skip
    names = encoder_components(spec.folder.index)
    nbytes = _encoder_bytes(pipe, names)
    if world_size == 1:  # the whole encoders: what a rank of 2 should hold
        nbytes = (nbytes, _encoder_bytes(pipe, names, 2))
    return runner.encode(params), nbytes


def _tensors(value, prefix=""):
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{prefix}[{i}]")


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_prompt_embeddings_match_one_rank(family, request):
    folder = str(request.getfixturevalue(f"{family}_folder"))
    params = FAMILY_PARAMS[family]
    one, (whole_bytes, planned_bytes) = _encode(0, 1, folder, params)
    ranks = run_distributed(_encode, 2, folder, params, timeout_s=120)
    expected = dict(_tensors(one))
    assert expected, one
    for encoded, nbytes in ranks:
        got = dict(_tensors(encoded))
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)
        # the CLIPs beside SD3's T5 stay whole on both ranks
        bound = {"flux2": 0.62, "qwenimage": 0.76, "sd3": 0.9}.get(family, 0.7)
        assert nbytes == planned_bytes < bound * whole_bytes


@pytest.mark.parametrize("family", ["flux2", "qwenimage"])
def test_images_match_one_rank_and_each_rank_holds_half_the_encoder(family, request):
    folder = request.getfixturevalue(f"{family}_folder")
    params = FLUX2 if family == "flux2" else QWEN
    with running_engine(folder) as engine:
        (one,) = images(engine, [params])
        (whole,) = engine.run_control(lambda: engine.call_ranks("memory")).result(timeout=120)
    with running_engine(folder, {"tp_size": 2}, encoder_tp_size=2) as engine:
        (sharded,) = images(engine, [params])
        memory = engine.run_control(lambda: engine.call_ranks("memory")).result(timeout=120)
    assert psnr(sharded, one) >= 40
    assert [m["rank"] for m in memory] == [0, 1]
    assert memory[0]["encoder_bytes"] == memory[1]["encoder_bytes"]
    assert 0 < memory[0]["encoder_bytes"] < (0.62 if family == "flux2" else 0.76) * whole["encoder_bytes"]


def test_degrees_the_encoder_cannot_take_are_refused_naming_the_flag(
    flux2_folder, qwenimage_folder, tmp_path
):
    # 4 does not divide the Mistral's 2 KV heads (its 4 query heads it does), nor Qwen's 2 heads
    with pytest.raises(ValueError, match=r"--encoder-tp-size 4 does not divide the 2 key/value heads"):
        Engine(
            EngineConfig(model=str(flux2_folder), encoder_tp_size=4, parallel=ParallelFlags(ulysses_degree=4))
        )
    with pytest.raises(ValueError, match=r"--encoder-tp-size 4 does not divide the 2 attention heads"):
        Engine(
            EngineConfig(
                model=str(qwenimage_folder), encoder_tp_size=4, parallel=ParallelFlags(ulysses_degree=4)
            )
        )
    # SD3 saved without T5: CLIPs only, which stay whole (the flag only loaded a whole copy on more ranks)
    from tests.families import sd3

    no_t5 = sd3.build_folder(tmp_path / "sd3", t5=False)
    with pytest.raises(
        ValueError, match=r"^--encoder-tp-size 2: none of sd3's encoders \(text_encoder, text_enc"
    ):
        Engine(EngineConfig(model=str(no_t5), encoder_tp_size=2, parallel=ParallelFlags(tp_size=2)))
    with pytest.raises(ValidationError, match=r"--encoder-tp-size 4 is larger than the replica's 2 rank"):
        EngineConfig(model=str(flux2_folder), encoder_tp_size=4, parallel=ParallelFlags(tp_size=2))
    with pytest.raises(ValidationError, match=r"--encoder-placement all"):
        EngineConfig(encoder_tp_size=2, encoder_placement="all", parallel=ParallelFlags(tp_size=2))


def test_generate_refuses_a_bad_degree_naming_the_flag(flux2_folder, tmp_path):
    cmd = [str(Path(sys.executable).with_name("ditserve")), "generate", "a fox", "--model", str(flux2_folder)]
    flags = ["--tp-size", "2", "--encoder-tp-size", "3", "-o", str(tmp_path / "out.png")]
    done = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--encoder-tp-size 3 is larger than the replica's 2 rank" in done.stderr
    assert not (tmp_path / "out.png").exists()


def test_flux1_t5_sharded_beside_a_whole_clip_gives_the_same_image():
    # demo-flux: CLIP (kept whole on both encoder ranks) and a 4-head T5 (sharded), true CFG on
    request = QWEN.model_copy(update={"seed": 7})
    with running_engine("demo-flux", {"ulysses_degree": 2}) as engine:
        (first,) = images(engine, [request])
        placed = engine.run_control(lambda: engine.call_ranks("memory")).result(timeout=120)
    with running_engine("demo-flux", {"ulysses_degree": 2}, encoder_tp_size=2) as engine:
        (sharded,) = images(engine, [request])
        memory = engine.run_control(lambda: engine.call_ranks("memory")).result(timeout=120)
    assert psnr(sharded, first) >= 40
    assert placed[1]["encoder_bytes"] == 0
    assert memory[0]["encoder_bytes"] == memory[1]["encoder_bytes"] < placed[0]["encoder_bytes"]
