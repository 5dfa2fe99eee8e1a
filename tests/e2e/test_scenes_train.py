"""A few CPU training steps write a diffusers folder that FluxPipeline loads and samples from."""

from __future__ import annotations

import argparse
import json

import torch

from ditserve.replica.models import train_demo
from ditserve.replica.models.scenes import scenes_model_path


def test_add_arguments_defaults() -> None:
    parser = argparse.ArgumentParser()
    train_demo.add_arguments(parser)
    args = parser.parse_args(["--out", "x"])
    assert (args.steps, args.vae_steps, args.batch_size, args.seed) == (4000, 1500, 512, 0)


def test_train_smoke_writes_loadable_pipeline(tmp_path) -> None:
    from diffusers import FluxPipeline

    out = train_demo.main(
        [
            "--out", str(tmp_path / "scenes"),
            "--steps", "3", "--vae-steps", "2", "--decoder-steps", "2", "--batch-size", "2", "--vae-batch-size", "2",
            "--pool-size", "8", "--device", "cpu", "--eval-scenes", "0",
        ]
    )  # fmt: skip
    assert (out / "model_index.json").is_file()
    card = (out / "README.md").read_text()
    assert "ditserve train-demo --out" in card and "--steps 3" in card
    vae_config = json.loads((out / "vae" / "config.json").read_text())
    assert vae_config["scaling_factor"] != 1.0  # measured on the trained VAE's latents

    pipe = FluxPipeline.from_pretrained(out, dtype=torch.float32)
    assert pipe.transformer.config.guidance_embeds is False
    # Served from its folder, a request without a size gets the size trained on (not FLUX's 1024²), with the
    # model card's CFG.
    from ditserve.replica.models.registry import resolve_model

    spec = resolve_model(str(out))
    assert spec.default_size == (64, 64) and spec.guidance_defaults(None, None) == ("", 3.0)
    # Both tokenizers read a prompt as the captions are written (case, punctuation, "an"), also in diffusers.
    index = json.loads((out / "model_index.json").read_text())
    assert index["tokenizer"] == index["tokenizer_2"] == ["transformers", "PreTrainedTokenizerFast"]
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_2):
        caption = tokenizer("a orange circle on a blue background").input_ids
        assert tokenizer("An Orange Circle on a Blue Background.").input_ids == caption
        assert tokenizer("on a blue background, a small orange circle, 4k").input_ids == caption
    # ... as the shipped demo-scenes reads it: a retrained folder ships the same normalizer.
    for name in ("tokenizer", "tokenizer_2"):
        shipped = json.loads((scenes_model_path() / name / "tokenizer.json").read_text())["normalizer"]
        assert json.loads((out / name / "tokenizer.json").read_text())["normalizer"] == shipped, name
    image = pipe(
        prompt="a red circle on a blue background",
        negative_prompt="",
        true_cfg_scale=3.0,
        num_inference_steps=2,
        height=64,
        width=64,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.size == (64, 64)
