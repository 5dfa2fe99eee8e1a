"""Demo models: built offline, written in diffusers format, loaded through from_pretrained."""

import json

import numpy as np
import torch
from diffusers import FluxPipeline

from ditserve.replica.models.demo import ensure_demo_model
from ditserve.replica.models.registry import resolve_model
from ditserve.replica.models.tokenizers import build_clip_tokenizer, build_t5_tokenizer


def test_tokenizers_handle_any_prompt():
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    for prompt in ["a red fox", "Ünïcode ✓ and digits 123", "x" * 300]:
        ids = clip(prompt, truncation=True, max_length=77).input_ids
        assert clip.unk_token_id not in ids[1:-1]
        assert len(t5(prompt).input_ids) > 1
    # Known words are single tokens, so different captions give different token sequences.
    assert len(clip("a red circle").input_ids) == 5
    assert clip("a red circle").input_ids != clip("a blue circle").input_ids
    # Every demo word (colours such as "orange" too, whose letters overlap earlier words) is one token.
    from ditserve.replica.models.tokenizers import DEMO_WORDS

    for word in DEMO_WORDS:
        assert len(clip.tokenize(word)) == len(t5.tokenize(word)) == 1, word


def test_demo_flux_folder_is_diffusers_format_and_legal_for_8_ranks():
    path = ensure_demo_model("demo-flux")
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    spec = resolve_model("demo-flux")
    assert spec.kind == "image" and spec.num_attention_heads >= 8 and spec.size_multiple == 16
    wan = resolve_model("demo-wan")
    assert wan.kind == "video" and wan.num_attention_heads >= 8 and wan.frame_multiple == 4


def test_demo_flux_is_deterministic_through_from_pretrained():
    pipe = FluxPipeline.from_pretrained(ensure_demo_model("demo-flux"))
    kwargs = dict(height=64, width=64, num_inference_steps=2, max_sequence_length=32, output_type="np")
    a = pipe("a red fox", generator=torch.Generator().manual_seed(1), **kwargs).images
    b = pipe("a red fox", generator=torch.Generator().manual_seed(1), **kwargs).images
    c = pipe("a red fox", generator=torch.Generator().manual_seed(2), **kwargs).images
    assert a.shape == (1, 64, 64, 3)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_an_empty_ditserve_home_means_the_default_cache(monkeypatch, tmp_path):
    """``DITSERVE_HOME=`` (set, empty) wrote the demo models under the folder the command ran in."""
    from pathlib import Path

    from ditserve.replica.models.demo import ditserve_home

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DITSERVE_HOME", "")
    assert ditserve_home() == Path(tmp_path) / ".cache" / "ditserve"
    monkeypatch.setenv("DITSERVE_HOME", str(tmp_path / "home"))
    assert ditserve_home() == tmp_path / "home"


def test_every_embedded_model_has_the_components_its_pipeline_needs():
    # `ditserve serve` skips this check (and its diffusers import) for embedded models before Ray starts.
    from ditserve.replica.models.registry import embedded_model_names
    from ditserve.replica.worker import refuse_missing_components

    for name in embedded_model_names():
        refuse_missing_components(resolve_model(name))
