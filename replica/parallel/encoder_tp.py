"""Tensor parallelism of a replica's text encoders (``--encoder-tp-size N``): the encoders run once per
replica, sharded over its first N ranks, instead of whole on one rank or on every rank.

The plan is data, read from the encoder's config (the same rules transformers' ``base_model_tp_plan``
states for these models; our modules from ``tp.py`` apply it):

=========================================  ============  ==================================================
module (name glob)                          cut           what each of N ranks holds
=========================================  ============  ==================================================
LLaMA-like decoders (Mistral3's Mistral, Qwen2.5-VL's text model, Qwen3):
``*layers.*.self_attn.{q,k,v}_proj``        column        H/N query heads, KV/N key/value heads
``*layers.*.self_attn.o_proj``              row           the same heads' inputs; one all-reduce
``*layers.*.mlp.{gate,up}_proj``            column        1/N of the MLP's features
``*layers.*.mlp.down_proj``                 row           their inputs; one all-reduce
T5 / UMT5 encoders:
``*.SelfAttention.{q,k,v}`` / ``.o``        column / row  H/N heads (and H/N of the relative position bias)
``*.DenseReluDense.wi*`` / ``.wo``          column / row  1/N of the feed-forward features
both:
input embedding                             vocab rows    V/N rows; a masked lookup and one all-reduce
output embedding (``lm_head``)              vocab rows    V/N logits, all-gathered (the pipelines read hidden
                                                          states, but the forward still returns logits)
=========================================  ============  ==================================================

Query heads are cut into N contiguous blocks and key/value heads likewise, so a rank's query heads use
exactly its key/value heads (grouped-query attention keeps its grouping). The attention modules infer their
head count from the projections' widths (T5's ``n_heads`` is set to the local count). Vision towers
(Pixtral, Qwen2.5-VL's ViT) and CLIP encoders are small and stay whole on every encoder rank. An embedding
whose vocabulary does not divide N stays whole too; heads, KV heads or MLP features that do not divide N
are refused, naming ``--encoder-tp-size``.

Example: FLUX.2 dev at ``--tp-size 2 --encoder-tp-size 2``: ranks 0 and 1 each hold 16 of Mistral's 32
query heads, 4 of its 8 KV heads, half of every MLP and half the vocabulary; both run every prompt, rank 0
sends the embeddings on (to ranks 2.. of a larger replica, as ``--encoder-placement first`` does).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .tp import ColumnParallelLinear, RowParallelLinear, TPPlan

FLAG = "--encoder-tp-size"

DECODER_PLAN: TPPlan = {
    "*layers.*.self_attn.[qkv]_proj": "column",
    "*layers.*.self_attn.o_proj": "row",
    "*layers.*.mlp.gate_proj": "column",
    "*layers.*.mlp.up_proj": "column",
    "*layers.*.mlp.down_proj": "row",
}
T5_PLAN: TPPlan = {
    "*.SelfAttention.[qkv]": "column",
    "*.SelfAttention.o": "row",
    "*.DenseReluDense.wi*": "column",
    "*.DenseReluDense.wo": "row",
}
T5_TYPES = ("t5", "mt5", "umt5")

Kind = Literal["decoder", "t5"]
Cut = Literal["column", "row", "vocab", "vocab_gather", "heads"]


# ---- the config rules (also read from a folder's config.json before any rank starts) -----------------
def encoder_kind(config: Mapping[str, Any]) -> Kind | None:
    """Which plan an encoder config takes: a LLaMA-like decoder (its text config has KV heads), T5, or
    None (kept whole: CLIP, vision-only encoders)."""
    if config.get("model_type") in T5_TYPES:
        return "t5"
    text = config.get("text_config") or config
    if "num_key_value_heads" in text and "intermediate_size" in text:
        return "decoder"
    return None


def _sizes(config: Mapping[str, Any], kind: Kind) -> dict[str, int]:
    if kind == "t5":
        return {
            "attention heads": int(config["num_heads"]),
            "feed-forward features": int(config["d_ff"]),
        }
    text = config.get("text_config") or config
    heads = int(text["num_attention_heads"])
    return {
        "attention heads": heads,
        "key/value heads": int(text.get("num_key_value_heads") or heads),
        "MLP features": int(text["intermediate_size"]),
    }


def vocab_size(config: Mapping[str, Any]) -> int:
    text = config if config.get("model_type") in T5_TYPES else (config.get("text_config") or config)
    return int(text.get("vocab_size") or 0)


def check_encoder_tp(config: Mapping[str, Any], degree: int, component: str) -> Kind | None:
    """Raise ValueError naming the flag when ``degree`` does not divide what the plan splits; returns the
    encoder's kind (None: kept whole on every encoder rank)."""
    kind = encoder_kind(config)
    if kind is None or degree == 1:
        return kind
    sizes = _sizes(config, kind)
    for what, size in sizes.items():
        if size % degree:
            divisors = [d for d in range(1, 9) if all(s % d == 0 for s in sizes.values())]
            raise ValueError(
                f"{FLAG} {degree} does not divide the {size} {what} of the {component} "
                f"({config.get('model_type', '?')}); choose one of {divisors}"
            )
    return kind


def encoder_components(index: Mapping[str, Any]) -> list[str]:
    """A pipeline's encoder models, from its ``model_index.json``: its ``transformers`` components that are
    models (text encoders, image encoders), not tokenizers or processors."""
    skip = ("Tokenizer", "TokenizerFast", "Processor", "ImageProcessor", "FeatureExtractor")
    out = []
    for name, entry in index.items():
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == "transformers" and entry[1]:
            if not entry[1].endswith(skip):
                out.append(name)
    return out


# ---- which module gets which cut ------------------------------------------------------------------
def _config_dict(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    return config.to_dict() if config is not None else {}


def shard_plan(model: nn.Module, degree: int, component: str = "text encoder") -> dict[str, Cut]:
    """Module name → cut for ``model`` at ``degree`` (empty: kept whole). The one source of what is
    sharded: :func:`apply_encoder_tp` applies it, :func:`planned_param_bytes` counts it."""
    config = _config_dict(model)
    kind = check_encoder_tp(config, degree, component)
    if kind is None or degree == 1:
        return {}
    linear_plan = T5_PLAN if kind == "t5" else DECODER_PLAN
    cuts: dict[str, Cut] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            for pattern, mode in linear_plan.items():
                if fnmatch.fnmatchcase(name, pattern):
                    cuts[name] = mode  # type: ignore[assignment]
                    break
        elif kind == "t5" and name.endswith("relative_attention_bias"):
            cuts[name] = "heads"
    if not any(c == "row" for c in cuts.values()):
        raise ValueError(
            f"{FLAG} {degree}: no linears of the {component} ({type(model).__name__}) match the "
            f"{kind} plan; run it whole ({FLAG} 1)"
        )
    if vocab_size(config) % degree == 0:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if isinstance(embedding, nn.Embedding) and embedding.num_embeddings % degree == 0:
            # every embedding module on that weight (T5's ``shared`` and ``encoder.embed_tokens``)
            for name, module in model.named_modules(remove_duplicate=False):
                if isinstance(module, nn.Embedding) and module.weight is embedding.weight:
                    cuts[name] = "vocab"
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(head, nn.Linear) and head.out_features % degree == 0:
            for name, module in model.named_modules(remove_duplicate=False):
                if module is head:
                    cuts[name] = "vocab_gather"
    return cuts


# ---- the sharded modules -------------------------------------------------------------------------
def _rows(n: int, group: dist.ProcessGroup) -> tuple[int, int]:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    part = n // size
    return rank * part, (rank + 1) * part


class VocabParallelEmbedding(nn.Module):
    """A slice of an embedding's rows: ids outside it look up zeros, one all-reduce sums the slices."""

    def __init__(self, embedding: nn.Embedding, *, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.tp_group = group
        self.num_embeddings, self.embedding_dim = embedding.weight.shape
        self.start, self.stop = _rows(self.num_embeddings, group)
        with torch.no_grad():
            self.weight = nn.Parameter(embedding.weight.detach()[self.start : self.stop].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.tp_group)
        return out

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.stop} of {self.num_embeddings}, dim={self.embedding_dim}"


class GatheredColumnLinear(ColumnParallelLinear):
    """A column-parallel linear whose output slices are all-gathered (logits over the whole vocabulary)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local, group=self.tp_group)
        return torch.cat(parts, dim=-1)


def _shard_heads(embedding: nn.Embedding, group: dist.ProcessGroup) -> nn.Embedding:
    """T5's relative position bias: an embedding of one value per head, cut by heads."""
    start, stop = _rows(embedding.embedding_dim, group)
    out = nn.Embedding(embedding.num_embeddings, stop - start, dtype=embedding.weight.dtype)
    with torch.no_grad():
        out.weight = nn.Parameter(embedding.weight.detach()[:, start:stop].clone())
    return out


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


@torch.no_grad()
def apply_encoder_tp(
    model: nn.Module, *, group: dist.ProcessGroup, component: str = "text encoder"
) -> dict[str, int]:
    """Shard ``model`` in place over ``group`` (every rank of it calls this with the same whole model and
    then calls the model with the same inputs, getting the whole output). Returns how many modules of each
    cut were replaced. Build on the host and move to the device afterwards: the whole weights then never
    reach the device, and they are freed here."""
    degree = dist.get_world_size(group)
    cuts = shard_plan(model, degree, component)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # Tied input/output embeddings (Qwen3's small models): both cut to the same rows, kept one weight.
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    # One new module per (cut, weight): modules that share a weight share the shard.
    done: dict[tuple[str, int], nn.Module] = {}
    for name, cut in cuts.items():
        module = model.get_submodule(name)
        key = (cut, id(module.weight))
        if key not in done:
            if cut == "column":
                done[key] = ColumnParallelLinear(module, group=group)
            elif cut == "row":
                done[key] = RowParallelLinear(module, group=group)
            elif cut == "vocab":
                done[key] = VocabParallelEmbedding(module, group=group)
            elif cut == "vocab_gather":
                done[key] = GatheredColumnLinear(module, group=group)
            else:
                done[key] = _shard_heads(module, group)
        _replace(model, name, done[key])
    if tied:
        vocab, gather = done.get(("vocab", id(head.weight))), done.get(("vocab_gather", id(head.weight)))
        if vocab is not None and gather is not None:
            gather.weight = vocab.weight
    if any(c == "heads" for c in cuts.values()):
        for module in model.modules():
            if hasattr(module, "n_heads") and hasattr(module, "inner_dim"):  # T5Attention
                module.n_heads //= degree
                module.inner_dim //= degree
    counts: dict[str, int] = {}
    for cut, _ in done:
        counts[cut] = counts.get(cut, 0) + 1
    return counts


# ---- bytes per rank, without a process group (a model on the meta device will do) --------------------
def planned_param_bytes(model: nn.Module, degree: int, component: str = "text encoder") -> int:
    """The parameter bytes one rank holds after :func:`apply_encoder_tp` at ``degree`` (rank-independent:
    every cut is even); ``model`` may live on the meta device."""
    cuts = shard_plan(model, degree, component)
    divisor: dict[int, int] = {}
    for name, cut in cuts.items():
        module = model.get_submodule(name)
        divisor[id(module.weight)] = degree
        if cut == "column" and getattr(module, "bias", None) is not None:
            divisor[id(module.bias)] = degree
    return sum(p.numel() * p.element_size() // divisor.get(id(p), 1) for p in model.parameters())
