"""Parameter memory per GPU of a replica at ``--tp-size 2`` under each encoder layout, counted from the real
models' configs (no weights: every model is built on the ``meta`` device, bf16).

    python benchmarks/engine/encoder_memory.py            # FLUX.2 dev and Qwen-Image, --tp-size 2
    python benchmarks/engine/encoder_memory.py --tp-size 4 --out /tmp/results

Layouts: ``--encoder-placement all`` (every rank holds the whole text encoder), ``first`` (the default:
rank 0 holds it, the others none) and ``first --encoder-tp-size N`` (the first N ranks each hold their
shard, counted by the same plan that shards it, ``parallel/encoder_tp.py``). The transformer's share is
its family's TP plan at ``--tp-size``; every rank holds the whole VAE. Parameters only: activations, the
CUDA context and the allocator's cache come on top.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GB = 1e9

# black-forest-labs/FLUX.2-dev text_encoder/config.json (Mistral-Small-3.1-24B's Mistral3).
FLUX2_TEXT = dict(
    vocab_size=131072,
    hidden_size=5120,
    intermediate_size=32768,
    num_hidden_layers=40,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=1e9,
    rms_norm_eps=1e-5,
)
FLUX2_VISION = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    head_dim=64,
    image_size=1540,
    patch_size=14,
)
# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct).
QWEN_TEXT = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=128000,
    rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
)
QWEN_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    fullatt_block_indexes=[7, 15, 23, 31],
)


def flux2() -> tuple[nn.Module, nn.Module, nn.Module]:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    from tests.families.flux2 import DEV_TRANSFORMER

    config = Mistral3Config(
        text_config=MistralConfig(**FLUX2_TEXT),
        vision_config=PixtralVisionConfig(**FLUX2_VISION),
        image_token_index=10,
        spatial_merge_size=2,
        multimodal_projector_bias=False,
        tie_word_embeddings=False,  # its own lm_head (24.0 B parameters); Mistral3Config ties by default
    )
    return (
        Flux2Transformer2DModel(**DEV_TRANSFORMER),
        Mistral3ForConditionalGeneration(config),
        AutoencoderKLFlux2(),
    )


def qwenimage() -> tuple[nn.Module, nn.Module, nn.Module]:
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tests.families.qwenimage import REAL_TRANSFORMER, build_vae

    config = Qwen2_5_VLConfig(text_config=QWEN_TEXT, vision_config=QWEN_VISION, vocab_size=152064)
    return (
        QwenImageTransformer2DModel(**REAL_TRANSFORMER),
        Qwen2_5_VLForConditionalGeneration(config),
        build_vae(real=True),
    )


MODELS = {"FLUX.2 dev": ("flux2", flux2), "Qwen-Image": ("qwenimage", qwenimage)}


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def transformer_bytes(model: nn.Module, family: str, degree: int) -> int:
    """One rank's parameter bytes under the family's TP plan: a column-parallel linear keeps 1/degree of its
    weight and bias, a row-parallel one 1/degree of its weight and all of its bias."""
    from ditserve.replica.families import get_family

    plan = get_family(family).load("plan").tp_map(model)
    divisor: dict[int, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        for pattern, spec in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                mode = spec if isinstance(spec, str) else spec[0]
                divisor[id(module.weight)] = degree
                if mode == "column" and module.bias is not None:
                    divisor[id(module.bias)] = degree
                break
    return sum(p.numel() * p.element_size() // divisor.get(id(p), 1) for p in model.parameters())


def rows(name: str, tp: int) -> list[dict]:
    from ditserve.replica.parallel.encoder_tp import planned_param_bytes

    family, build = MODELS[name]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            transformer, encoder, vae = build()
    finally:
        torch.set_default_dtype(default)
    t_rank = transformer_bytes(transformer, family, tp)
    e_whole, v = nbytes(encoder), nbytes(vae)
    e_shard = planned_param_bytes(encoder, tp)
    base = {"model": name, "tp_size": tp, "transformer_GB": round(nbytes(transformer) / GB, 2)}
    base["text_encoder_GB"] = round(e_whole / GB, 2)

    def row(layout: str, encoders: list[int]) -> dict:
        per_rank = [(t_rank + e + v) / GB for e in encoders]
        return {
            **base,
            "layout": layout,
            "encoder_GB_per_rank": " / ".join(f"{e / GB:.1f}" for e in encoders),
            "params_GB_per_rank": " / ".join(f"{g:.1f}" for g in per_rank),
            "largest_rank_GB": round(max(per_rank), 1),
        }

    return [
        row("--encoder-placement all", [e_whole] * tp),
        row("--encoder-placement first (default)", [e_whole] + [0] * (tp - 1)),
        row(f"--encoder-tp-size {tp}", [e_shard] * tp),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=None, help="Results folder (default benchmarks/results).")
    args = parser.parse_args()
    from report import markdown_table, write_results

    records = [r for name in args.models for r in rows(name, args.tp_size)]
    md = [
        f"Parameter bytes per GPU at --tp-size {args.tp_size}, bf16, counted on the meta device from the "
        "public configs (rank 0 / rank 1 / ...). The transformer is cut by its family's TP plan; the VAE is "
        "whole on every rank. Activations and the CUDA context are not included.",
        "",
        markdown_table(records),
    ]
    write_results(
        "encoder_memory", "\n".join(md), records, out=args.out, baseline="--encoder-placement first"
    )


if __name__ == "__main__":
    main()
