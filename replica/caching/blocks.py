"""The shared forward with per-request step caching.

The first block of the transformer runs on every row. Its wrapper then decides, per request (per CFG
branch: each branch has its own ``RequestCache``), whether the request's rows must compute; it runs the
remaining blocks itself on the computing rows only (gathered, then scattered back) and adds each hit's
kept residual to its first-block output. The model's own loop then calls the remaining blocks, which pass
their inputs through for this forward. So the work saved in the blocks is the hits' share of rows.

Under sequence parallelism a request's rows are split over the sp group: the two sums of its metric are
all-reduced over that group before the comparison, so every rank decides the same; each rank sums its
shard without the sequence padding, and the tokens every rank holds alike (a joint stream's replicated
text) count on one rank only, so that the reduced sums are one rank's and the request decides as one rank
does (tensor-parallel ranks hold the same activations after each block's all-reduce and decide the same
without a collective).

Per-row state of the forward outside the block inputs (the LoRA manager's adapter segments) follows the
rows through ``relayout``: called with the computing rows before the remaining blocks, and with
``(None, None)`` after them.

The wrappers take each block's call slot (``Module.__call__`` runs ``_compiled_call_impl`` when it is set),
and run the block's own call inside: its compiled call under ``--compile`` (regional compilation sets that
slot first), else its eager one. So the decisions and the row bookkeeping never run inside a compiled
region (traced, they became guards on every request's cache state: a recompile per forward until dynamo's
recompile limit sent the block back to eager), and the blocks run compiled with caching too.

The remaining blocks see a row count that changes from forward to forward. The recompiles are bounded by
dynamo's automatic dynamic shapes, on purpose without marking the row dim ourselves: a frame compiles
static for the first row count it sees, once more with the row dim dynamic at the second count (every count
from 2 up then shares that graph) and once for a single row (dynamo specialises size 1): at most three
graphs per compiled frame (a block class's forward, or a piece of it between the LoRA path's graph breaks)
and LoRA mode, whatever the hit pattern, as continuous batching alone already gives the first block (its
full batch changes as requests join and leave). ``maybe_mark_dynamic`` on the
computing rows' inputs only would not save a graph: marked and unmarked inputs guard apart, so the full
batch's calls and the computing rows' would each keep their own graphs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel.hooks import ATTR as PARALLEL_ATTR
from .state import RequestCache

ATTR = "_ditserve_step_cache"


@dataclass
class ForwardPlan:
    """The row layout of one forward: (the request's cache or None when it does not cache, its rows)."""

    groups: list[tuple[RequestCache | None, int]]
    # False when the forward's per-row state (e.g. LoRA segments) describes every row: the remaining
    # blocks then run on all rows and the hits' outputs are replaced (correct, but nothing is saved).
    shrink: bool = True
    ran: bool = False


@dataclass
class StepCacheModel:
    """Left on the transformer as ``model._ditserve_step_cache``."""

    blocks: list[nn.Module]
    calls: list  # each block's own call: its compiled call (--compile) or its eager one (hooks included)
    entries: list  # the wrappers now in the blocks' call slots
    outputs: tuple[
        str, ...
    ]  # names of a block's outputs in order, e.g. ("encoder_hidden_states", "hidden_states")
    group: dist.ProcessGroup | None = None  # the sp group whose ranks split each row's tokens
    plan: ForwardPlan | None = None
    # Set by the runner (from the LoRA manager's owner): ``relayout(rows, offsets)`` with the computing rows
    # (row counts and their first rows in the forward) before the remaining blocks, ``(None, None)`` after.
    relayout: Callable[[list[int] | None, list[int] | None], None] | None = None
    names: list[str] = field(default_factory=list)

    def set_plan(self, groups: list[tuple[RequestCache | None, int]] | None, *, shrink: bool = True) -> None:
        active = groups is not None and any(c is not None for c, _ in groups)
        if active:
            # Module.compile() after apply_step_cache would take the slot back: the cache would do nothing
            assert all(b._compiled_call_impl is e for b, e in zip(self.blocks, self.entries, strict=True)), (
                "the blocks were compiled after step caching was applied to them"
            )
        self.plan = ForwardPlan(groups, shrink=shrink) if active else None


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def apply_step_cache(
    model: nn.Module,
    *,
    block_lists: Sequence[str],
    outputs: tuple[str, ...],
    group: dist.ProcessGroup | None = None,
) -> StepCacheModel:
    """Wrap the blocks of ``model`` (its ModuleLists named in ``block_lists``, in call order). ``outputs``
    names what a block returns, in order; each name is also the keyword of that input."""
    blocks = [b for name in block_lists for b in getattr(model, name, [])]
    assert len(blocks) >= 2, "step caching needs at least two transformer blocks"
    handle = StepCacheModel(
        blocks=blocks,
        calls=[b._compiled_call_impl or b._call_impl for b in blocks],
        entries=[],
        outputs=outputs,
        group=group,
    )
    # The hidden stream: ``hidden_states``, or a block's only output under another name (Z-Image's ``x``).
    hidden_name = "hidden_states" if "hidden_states" in outputs else outputs[0]
    hidden_index = outputs.index(hidden_name)
    # The class forward's signature: an instance forward left by another wrapper may take (*args, **kwargs).
    signatures = [inspect.signature(type(b).forward.__get__(b)) for b in blocks]

    def head_forward(*args, **kwargs):
        plan = handle.plan
        out = handle.calls[0](*args, **kwargs)
        if plan is None:
            return out
        bound = signatures[0].bind(*args, **kwargs)
        bound.apply_defaults()
        inputs = dict(bound.arguments)
        head = _as_tuple(out)
        residual = head[hidden_index] - inputs[hidden_name]
        measured = _measured(residual, getattr(model, PARALLEL_ATTR, None))
        # Per request: its partial sums over its rows on this rank, then one all-reduce for all requests.
        sums, offset = [], 0
        for cache, rows in plan.groups:
            part = None if cache is None else cache.partial_sums(measured[offset : offset + rows])
            sums.append(part)
            offset += rows
        present = [s for s in sums if s is not None]
        if present and handle.group is not None:
            flat = torch.stack(present)
            dist.all_reduce(flat, group=handle.group)
            it = iter(flat.unbind(0))
            sums = [None if s is None else next(it) for s in sums]
        compute_rows, hits, offset = [], [], 0
        for (cache, rows), s in zip(plan.groups, sums, strict=True):
            hit = cache is not None and cache.decide(s)
            (hits if hit else compute_rows).append((cache, offset, rows))
            offset += rows
        total = offset
        # The remaining blocks on the computing rows only.
        result = [t.clone() for t in head] if hits and plan.shrink else list(head)
        if compute_rows:
            shrunk = bool(hits) and plan.shrink
            if shrunk:
                index = torch.cat(
                    [torch.arange(o, o + r, device=residual.device) for _, o, r in compute_rows]
                )
                state = {k: _take_rows(v, index, total) for k, v in inputs.items()}
                current = tuple(t[index] for t in head)
            else:
                index, state, current = None, inputs, _as_tuple(out)
            first_out = current
            if shrunk and handle.relayout is not None:
                handle.relayout([rows for _, _, rows in compute_rows], [o for _, o, _ in compute_rows])
            try:
                for call in handle.calls[1:]:
                    step_in = dict(state)
                    step_in.update(zip(outputs, current, strict=True))
                    new = _as_tuple(call(**step_in))
                    # A block may end a stream (SD3's last block returns no text): its last value passes on.
                    current = tuple(c if n is None else n for c, n in zip(current, new, strict=True))
            finally:
                if shrunk and handle.relayout is not None:
                    handle.relayout(None, None)
            if index is None:
                result = list(current)
            else:
                for i, t in enumerate(current):
                    result[i][index] = t
            # Keep each computing request's residuals (its rows of the tail minus the head).
            position = 0
            for cache, offset, rows in compute_rows:
                if cache is not None:
                    sl = (
                        slice(position, position + rows)
                        if index is not None
                        else slice(offset, offset + rows)
                    )
                    cache.store(
                        measured[offset : offset + rows].detach().clone(),
                        tuple(
                            (c[sl] - f[sl]).detach().clone() for c, f in zip(current, first_out, strict=True)
                        ),
                    )
                position += rows
        for cache, offset, rows in hits:
            for i, kept in enumerate(cache.reuse()):
                result[i][offset : offset + rows] = head[i][offset : offset + rows] + kept
        plan.ran = True
        result = tuple(result)
        return result if isinstance(out, tuple) else result[0]

    def make_pass(i: int):
        def passthrough(*args, **kwargs):
            if handle.plan is None:
                return handle.calls[i](*args, **kwargs)
            bound = signatures[i].bind(*args, **kwargs)
            values = tuple(bound.arguments[name] for name in outputs)
            return values if len(values) > 1 else values[0]

        return passthrough

    handle.entries = [head_forward] + [make_pass(i) for i in range(1, len(blocks))]
    for block, entry in zip(blocks, handle.entries, strict=True):
        block._compiled_call_impl = entry
    setattr(model, ATTR, handle)
    return handle


def _measured(residual: torch.Tensor, parallel) -> torch.Tensor:
    """This rank's part of the tokens the metric sums, so that its all-reduce over the sp group gives the
    one-rank sums: the sequence shard without its padding (padding is a suffix of the global sequence: the
    tail of the last shards), and the tokens every sp rank holds alike (the replicated text of a joint
    stream: FLUX.2's single blocks hold the text then the shard, Z-Image's layers the shard then the
    caption) on the first sp rank only."""
    layout = None if parallel is None else parallel.state.layout
    if layout is None or layout.num_shards == 1 or residual.dim() < 2:
        return residual
    length, local = residual.shape[1], layout.num_local
    valid = max(0, min(local, layout.num_tokens - layout.shard_index * local))
    if length == local:
        return residual[:, :valid]
    text = parallel.state.num_text
    start = text if text and length == text + local else 0
    shard = residual[:, start : start + valid]
    if layout.shard_index != 0:
        return shard
    return torch.cat([residual[:, :start], shard, residual[:, start + local :]], dim=1)


def _take_rows(value, index: torch.Tensor, total: int):
    """The computing rows of a block input: tensors with one entry per row are gathered, others (rotary
    embeddings, shared ids, kwargs dicts) pass unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == total and total > 1:
        return value[index]
    return value
