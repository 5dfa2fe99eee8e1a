"""A family's parallel plan as data, and the one ``parallelize`` that applies any plan in place.

A plan says, for one diffusers transformer class:

- ``tp``: which linears are column- and which row-parallel (name globs → ``"column"`` / ``"row"`` /
  ``("row", packed input blocks)``), or a function of the model returning that map; ``after_tp`` fixes
  what TP leaves inconsistent (e.g. RMSNorms over all heads);
- ``attention`` + ``processor``: the attention modules (a name glob) and the processor that runs them over
  the sharded sequence with the replicated tokens (text) beside it;
- where the sequence is sharded: ``tokens`` counts the image/video tokens of a forward (to plan the
  padding); ``split_inputs`` are forward arguments split at the model's entry (name → sequence dim);
  ``split_outputs`` are submodules whose outputs are split (e.g. a rotary embedding built for the full
  sequence); ``split_block_inputs`` are submodules whose first input is split (where the sequence first
  exists inside the model);
- where it ends: ``gather`` submodules whose output is all-gathered and unpadded (the final projection);
- ``extra_hooks``: hooks a family registers itself (what the fields above cannot express);
- ``on_forward``: family bookkeeping at the start of every forward (e.g. the text length a single-stream
  block needs; refusing inputs the plan does not shard).

Everything not named stays replicated on every rank.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .hooks import ForwardState, begin_parallelize, bind_forward_args
from .mesh import ParallelMesh
from .sequence import SequenceLayout, gather_sequence, shard_sequence


def _default_heads(model: nn.Module) -> int:
    return int(model.config.num_attention_heads)


@dataclass(frozen=True)
class ParallelPlan:
    family: str
    tp: Mapping[str, Any] | Callable[[nn.Module], Mapping[str, Any]]
    attention: str | tuple[str, ...]
    processor: Callable[[ParallelMesh, ForwardState], Any]
    tokens: Callable[[nn.Module, dict[str, Any]], int]
    split_inputs: Mapping[str, int] = field(default_factory=dict)
    split_outputs: Mapping[str, int] = field(default_factory=dict)
    split_block_inputs: Mapping[str, int] = field(default_factory=dict)
    gather: Mapping[str, int] = field(default_factory=lambda: {"proj_out": 1})
    after_tp: Callable[[nn.Module], None] | None = None
    on_forward: Callable[[nn.Module, dict[str, Any], ForwardState], None] | None = None
    heads: Callable[[nn.Module], int] = _default_heads
    # Hooks a family registers itself after the generic ones, for what the fields above cannot say (e.g.
    # Z-Image gathers only the image part of a final layer whose output also holds the caption tokens).
    extra_hooks: Callable[[nn.Module, ParallelMesh, ForwardState], list[RemovableHandle]] | None = None
    # One rank (no plan applied) with --fused-epilogues: subclasses of diffusers' attention processors that
    # compute the same arithmetic in fewer passes over memory (e.g. q/k norm and rotary in one kernel);
    # `fuse_one_rank_processors` swaps each in for processors of exactly its base class.
    one_rank_processors: tuple[type, ...] = ()

    def tp_map(self, model: nn.Module) -> Mapping[str, Any]:
        return self.tp(model) if callable(self.tp) else self.tp


def joint_attention_tp(attn: str) -> dict[str, str]:
    """TP of a dual-stream block's joint attention ``attn`` (a name glob): q/k/v of both streams
    column-parallel, both output projections row-parallel (one column → row pair per stream)."""
    return {
        f"{attn}.to_[qkv]": "column",
        f"{attn}.add_[qkv]_proj": "column",
        f"{attn}.to_out.0": "row",
        f"{attn}.to_add_out": "row",
    }


def feed_forward_tp(*ffs: str) -> dict[str, str]:
    """TP of diffusers ``FeedForward`` modules (name globs): the input projection column-parallel, the
    output row-parallel."""
    plan = {}
    for ff in ffs:
        plan[f"{ff}.net.0.proj"] = "column"
        plan[f"{ff}.net.2"] = "row"
    return plan


def _split(value: Any, layout: SequenceLayout, dim: int) -> Any:
    """Shard a tensor (or each tensor of a tuple) along ``dim``; tensors without that dim pass through
    (e.g. a per-request timestep where a per-token one would be split)."""
    if isinstance(value, torch.Tensor):
        return shard_sequence(value, layout, dim=dim) if value.ndim > dim else value
    if isinstance(value, tuple | list):
        return type(value)(_split(v, layout, dim) for v in value)
    return value


def parallelize(model: nn.Module, plan: ParallelPlan, *, mesh: ParallelMesh) -> nn.Module:
    """Shard ``model`` over ``mesh`` in place following ``plan``; every rank then calls it with full inputs
    and gets the full output. Build a fresh model per layout (nothing here is undone)."""
    from .tp import apply_tp_plan

    handle = begin_parallelize(model, mesh, plan.family, num_heads=plan.heads(model))
    state = handle.state

    tp_group = mesh.get_group("tp")
    if tp_group is not None:
        handle.tp_modules = apply_tp_plan(model, plan.tp_map(model), group=tp_group)
        if plan.after_tp is not None:
            plan.after_tp(model)

    processor = plan.processor(mesh, state)
    patterns = (plan.attention,) if isinstance(plan.attention, str) else plan.attention
    matched = 0
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            module.set_processor(processor)
            matched += 1
    if not matched:
        raise ValueError(f"{plan.family} plan: no attention module matches {patterns}")

    def on_entry(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = bind_forward_args(module.forward, args, kwargs)
        if plan.on_forward is not None:
            plan.on_forward(module, bound, state)
        state.layout = SequenceLayout.plan(plan.tokens(module, bound), mesh)
        for name, dim in plan.split_inputs.items():
            if bound.get(name) is not None:
                bound[name] = _split(bound[name], state.layout, dim)
        return (), bound

    # Always registered (the identity at sp 1) so that the state is set for the processors.
    handle.hooks.append(model.register_forward_pre_hook(on_entry, with_kwargs=True))

    for name, dim in plan.split_outputs.items():

        def split_output(module, args, output, dim=dim):
            return _split(output, state.require_layout(), dim)

        handle.hooks.append(model.get_submodule(name).register_forward_hook(split_output))

    for name, dim in plan.split_block_inputs.items():

        def split_input(module, args, kwargs, dim=dim):
            layout = state.require_layout()
            if args:
                return (_split(args[0], layout, dim), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": _split(kwargs["hidden_states"], layout, dim)}

        handle.hooks.append(
            model.get_submodule(name).register_forward_pre_hook(split_input, with_kwargs=True)
        )

    for name, dim in plan.gather.items():

        def gather_output(module, args, output, dim=dim):
            return gather_sequence(output, state.require_layout(), mesh, dim=dim)

        handle.hooks.append(model.get_submodule(name).register_forward_hook(gather_output))
    if plan.extra_hooks is not None:
        handle.hooks.extend(plan.extra_hooks(model, mesh, state))
    return model


def fuse_one_rank_processors(model: nn.Module, plan: ParallelPlan) -> int:
    """``--fused-epilogues`` on one rank: every attention processor of exactly the base class of one of the
    plan's ``one_rank_processors`` becomes that one (keeping its attention backend); returns how many were
    swapped, 0 when the family declares none. Processors of other classes (a sharded plan's, a user's) stay."""
    return _swap_processors(model, {cls.__mro__[1]: cls for cls in plan.one_rank_processors})


def unfuse_one_rank_processors(model: nn.Module, plan: ParallelPlan) -> int:
    """The reverse of `fuse_one_rank_processors`: each of the plan's one-rank processors becomes the diffusers
    processor it subclasses again (the benchmarks' rows with diffusers' processors); returns how many."""
    return _swap_processors(model, {cls: cls.__mro__[1] for cls in plan.one_rank_processors})


def _swap_processors(model: nn.Module, swaps: dict[type, type]) -> int:
    """Every attention processor of exactly a key class of ``swaps`` becomes a new one of its value class,
    keeping the old one's attention backend and parallel config; returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        processor = getattr(module, "processor", None)
        cls = swaps.get(type(processor))
        if cls is None or not hasattr(module, "set_processor"):
            continue
        new = cls()
        new._attention_backend = getattr(processor, "_attention_backend", None)
        new._parallel_config = getattr(processor, "_parallel_config", None)
        module.set_processor(new)
        swapped += 1
    return swapped
