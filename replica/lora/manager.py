"""Adapter slots on the device and LoRA-aware linears: a different adapter per request in one forward.

Each targeted linear gets slot buffers ``a [1, max_loras, max_rank, in_local]`` and
``b [max_loras, out_local, max_rank]`` (the layout of ``ditserve.kernels.lora``). Before every transformer
call the runner tells the manager which rows belong to which request; each request's adapters become
segments of the segmented kernels. A request with several adapters (a style and a character) is handled
as several "positions": position p applies every request's p-th adapter in one kernel pass.

Tensor parallelism: a column-parallel linear keeps all of A and its rows of B; a row-parallel linear keeps
its columns of A and all of B and adds the delta in ``forward_partial``, before the all-reduce.

Fused path (``fused=True``, where Triton runs): a plain or column-parallel linear computes ``lora_linear``
for the first adapter position — the shrink, then one GEMM whose tiles add the expand before y is stored —
instead of the base GEMM followed by an in-place expand (which reads and writes y once more); further
positions (requests with several adapters) add theirs as in-place expands after it.

Shared shrinks (``share_shrink=True``): linears called one after another on the same input tensor (a
block's q, k, v projections; Flux single blocks' proj_mlp, q, k, v) are learned as a group from the calls
of one forward. From then on their A buffers are slices of one ``[group, max_loras, max_rank, in]``
buffer, and the first of the group runs one multi-slice shrink for all of them (x read once instead of
once per linear; in the fused path and in the unfused one, which FP8 linears and requests with several
adapters take, once per adapter position); the others take their slice of s if they are called with that
same, unmodified tensor, and otherwise shrink on their own.

CUDA graphs (``--cuda-graphs``): ``graph_key`` gives the runner a forward's adapter layout as part of the
graph key, from the second forward with adapters after a load or unload on (the first learns the groups,
which moves A buffers that a captured graph would read); no group forms while a graph is captured.

Step caching (``relayout``): when some requests of a forward reuse their cache, the blocks after the first
run on the other requests' rows only; for those blocks the layout is narrowed to those rows (each keeps its
adapters and scales), then the forward's full layout comes back. A narrowed forward is still one forward:
it neither counts towards the settling that ``graph_key`` waits for (its later blocks saw only some
adapters, so groups of the others may still be unlearned) nor changes any key.

Two experts (Wan 2.2 A14B): the second expert's linears are layers too, named ``transformer_2.<module>``;
an adapter's slot is the same in both, holding each expert's own weights (or none). A forward runs one
expert, so a request's adapter applies to whichever expert runs its step, and an adapter with weights for
one expert only leaves the other's steps as they are.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ditserve.kernels._dispatch import use_triton
from ditserve.kernels.lora import LoRABatchMeta, apply_lora, lora_expand, lora_linear, lora_shrink
from ditserve.kernels.lora_linear.op import lora_linear_op

from .loader import SECOND, LoRAFile, LoRAModule, second_expert_refusal


def _take(t: torch.Tensor, ranges, dim: int) -> torch.Tensor:
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def _is_linear(module: nn.Module) -> bool:
    """A linear layer (plain, tensor-parallel or FP8): what LoRALayer can wrap."""
    return hasattr(module, "weight") and hasattr(module, "in_features")


def _dead() -> None:
    """A weak reference to nothing."""
    return None


def _version(t: torch.Tensor) -> int:
    """t's in-place modification counter (-1 for inference-mode tensors, which keep none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class LoRALayer:
    """Slot buffers of one linear, and the forward that adds the batch's LoRA deltas to its output."""

    def __init__(self, name: str, module: nn.Module, manager: LoRAManager):
        self.name = name
        self.module = module
        self.manager = manager
        self.mode = getattr(module, "tp_mode", None)  # None | "column" | "row"
        weight = module.weight
        dtype = getattr(module, "compute_dtype", weight.dtype)  # an FP8 linear keeps its adapters in bf16
        self.in_features, self.out_features = module.in_features, module.out_features
        self.full_in = getattr(module, "full_in_features", self.in_features)
        self.full_out = getattr(module, "full_out_features", self.out_features)
        m = manager
        self.a = torch.zeros(1, m.max_loras, m.max_rank, self.in_features, device=weight.device, dtype=dtype)
        self.b = torch.zeros(m.max_loras, self.out_features, m.max_rank, device=weight.device, dtype=dtype)
        self.bias = torch.zeros(m.max_loras, self.out_features, device=weight.device, dtype=torch.float32)
        self.has_bias = [False] * m.max_loras
        self.used: set[int] = set()  # slots with weights here: layers no active adapter targets are skipped
        # the input's rows are the batch's rows this many times over, one copy after another (a model that
        # runs its timestep embedding on [t; 0], say): the layout's rows repeated as often
        self.copies = manager.row_copies.get(name, 1)
        # in a group of linears on one input (LoRAManager.groups): the group's A, of which a is a slice
        self.a_group: torch.Tensor | None = None
        if self.mode == "row":
            base_partial = module.forward_partial

            def forward_partial(x: torch.Tensor) -> torch.Tensor:
                y = base_partial(x)
                return self._add_delta(x, y) if self.manager.active else y

            module.forward_partial = forward_partial  # delta joins the partial sum before the all-reduce
        else:
            self._base_forward = module.forward
            module.forward = self.forward

    def detach(self) -> None:
        """Give the module back its own forward (LoRA no longer applied)."""
        for attr in ("forward", "forward_partial"):
            self.module.__dict__.pop(attr, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.compile the plain bool is a guard: one graph for steps without LoRA (the linear as
        # compiled), and for steps with LoRA a graph that calls the eager LoRA path below at this linear.
        if not self.manager.active:
            return self._base_forward(x)
        return self._forward_lora(x)

    @torch.compiler.disable
    def _forward_lora(self, x: torch.Tensor) -> torch.Tensor:
        """The linear plus the batch's LoRA deltas: inside the GEMM where possible, else added after it.

        Never traced: the batch layout is per-step Python state, and the kernels are opaque anyway."""
        batch = self._layout()
        if batch is None or not (batch.slots & self.used):
            return self._base_forward(x)
        self.manager.note_input(self, x)
        if (
            self.manager.fused
            and use_triton(x)
            and x.dtype == self.a.dtype == self.module.weight.dtype  # not FP8 linears: delta after the GEMM
            and x.numel() > 0
        ):
            x2 = x.reshape(-1, self.in_features)
            meta, segments = batch.meta(0, self._row_tokens(batch, x2.shape[0]))
            if meta is not None and not any(self.has_bias[slot] for _, _, slot, _ in segments):
                # every request's first adapter inside the GEMM; further ones (a style and a character on
                # one request) as in-place expands after it
                lead: dict[str, torch.Tensor] = {}

                def shrink_and_gemm(a_group: torch.Tensor) -> torch.Tensor:
                    # a group's first linear: its GEMM computes the whole group's s in the same launch
                    lead["y"], s_all = lora_linear_op(
                        x2, self.module.weight, self.module.bias, a_group, self.b, meta.token_seg,
                        meta.seg_start, meta.seg_len, meta.seg_slot, meta.seg_scale, meta.slot_rank,
                        meta.max_rank, [self.out_features], meta.seg_align,
                    )  # fmt: skip
                    return s_all

                s = self.manager.shared_shrink(self, x, x2, meta, scaled=True, shrink=shrink_and_gemm)
                y = lead.get("y")
                if y is None:
                    y = lora_linear(
                        x2,
                        self.module.weight,
                        self.module.bias,
                        self.a,
                        self.b,
                        meta,
                        [self.out_features],
                        s=s,
                    )
                y = y.view(*x.shape[:-1], self.out_features)
                return self._add_delta(x, y, first_position=1) if len(batch.positions) > 1 else y
        return self._add_delta(x, self._base_forward(x))

    def check(self, w: LoRAModule) -> None:
        rank = w.a.shape[0]
        if tuple(w.a.shape) != (rank, self.full_in) or tuple(w.b.shape) != (self.full_out, rank):
            raise ValueError(
                f"path: the adapter's shapes of {self.name} do not match the model: A {tuple(w.a.shape)}, B {tuple(w.b.shape)}, "
                f"expected A [r, {self.full_in}] and B [{self.full_out}, r]"
            )

    def write(self, slot: int, w: LoRAModule | None) -> None:
        self.a[:, slot].zero_()
        self.b[slot].zero_()
        self.bias[slot].zero_()
        self.has_bias[slot] = False
        self.used.discard(slot)
        if w is None:
            return
        self.used.add(slot)
        a, b, bias = w.a, w.b, w.bias
        ranges = getattr(self.module, "tp_slices", None)
        if self.mode == "column":
            b = _take(b, ranges, 0)
            bias = None if bias is None else _take(bias, ranges, 0)
        elif self.mode == "row":
            a = _take(a, ranges, 1)
            if bias is not None and getattr(self.module, "tp_rank", 0) != 0:
                bias = None  # the bias is reduced once: only rank 0 adds it
        rank = a.shape[0]
        self.a[0, slot, :rank] = a.to(self.a)
        self.b[slot, :, :rank] = b.to(self.b)
        if bias is not None:
            self.bias[slot] = bias
            self.has_bias[slot] = True

    def _row_tokens(self, batch: BatchLayout, tokens: int) -> int | tuple[int, ...]:
        """The tokens of each row of this call's input: one count for all (``tokens`` over the rows), or each
        row's own where the model gives them (``lora_row_tokens`` on the linear, set for the call: rows of
        different lengths one after another, e.g. Z-Image's caption embedder on every row's caption)."""
        counts = getattr(self.module, "lora_row_tokens", None)
        if counts is None:
            return tokens // batch.total_rows
        if len(counts) != batch.total_rows or sum(counts) != tokens:
            raise RuntimeError(
                f"{self.name}: lora_row_tokens {tuple(counts)} do not describe an input of {tokens} tokens in "
                f"{batch.total_rows} rows"
            )
        return tuple(counts)

    def _layout(self) -> BatchLayout | None:
        """The batch layout of this linear's input rows."""
        batch = self.manager.batch
        return batch if batch is None or self.copies == 1 else batch.repeated(self.copies)

    @torch.compiler.disable
    def _add_delta(self, x: torch.Tensor, y: torch.Tensor, first_position: int = 0) -> torch.Tensor:
        batch = self._layout()
        if batch is None or not (batch.slots & self.used):
            return y
        y2 = y.reshape(-1, self.out_features)
        x2 = x.reshape(-1, self.in_features)
        tokens_per_row = self._row_tokens(batch, x2.shape[0])
        for position in range(first_position, len(batch.positions)):
            meta, segments = batch.meta(position, tokens_per_row)
            if meta is None:
                continue
            x2a = x2.to(self.a.dtype)
            s = None if self.mode == "row" else self.manager.shared_shrink(self, x, x2a, meta, scaled=False)
            if s is None:
                apply_lora(y2, x2a, self.a, self.b, meta, [self.out_features])
            else:
                lora_expand(y2, s, self.b, meta, [self.out_features])
            for start, length, slot, scale in segments:
                if self.has_bias[slot]:
                    y2[start : start + length] += (scale * self.bias[slot]).to(y2.dtype)
        return y2.view_as(y)


@dataclass
class BatchLayout:
    """Which adapter (slot, scale) applies to which rows, for one transformer call."""

    groups: list[tuple[int, list[tuple[int, float]]]]  # (rows, [(slot, scale) per position])
    slot_ranks: list[int]
    device: torch.device
    _cache: dict = field(default_factory=dict)

    @property
    def slots(self) -> set[int]:
        return {slot for _, adapters in self.groups for slot, _ in adapters}

    @property
    def total_rows(self) -> int:
        return sum(rows for rows, _ in self.groups)

    @property
    def positions(self) -> range:
        return range(max((len(a) for _, a in self.groups), default=0))

    def select(self, rows: list[int], offsets: list[int]) -> BatchLayout:
        """The layout of some of these rows, in order: ``rows[i]`` rows from row ``offsets[i]``; every row
        keeps its request's adapters and scales."""
        picked, start = [], 0
        bounds = []
        for count, adapters in self.groups:
            bounds.append((start, start + count, adapters))
            start += count
        for count, offset in zip(rows, offsets, strict=True):
            for lo, hi, adapters in bounds:
                a, b = max(lo, offset), min(hi, offset + count)
                if a < b:
                    picked.append((b - a, adapters))
        return BatchLayout(picked, self.slot_ranks, self.device)

    def repeated(self, copies: int) -> BatchLayout:
        """The layout of ``copies`` copies of these rows, one after another (kept with this layout)."""
        key = ("repeated", copies)
        if key not in self._cache:
            self._cache[key] = BatchLayout(self.groups * copies, self.slot_ranks, self.device)
        return self._cache[key]

    def meta(self, position: int, tokens_per_row: int | tuple[int, ...]):
        """The segments of adapter ``position`` of every request: ``tokens_per_row`` tokens in each row, or
        per row (a tuple, one count per row in order)."""
        key = (position, tokens_per_row)
        if key not in self._cache:
            requests, scales, segments, start, row = [], [], [], 0, 0
            for rows, adapters in self.groups:
                slot, scale = adapters[position] if position < len(adapters) else (-1, 0.0)
                if isinstance(tokens_per_row, tuple):
                    length = sum(tokens_per_row[row : row + rows])
                else:
                    length = rows * tokens_per_row
                row += rows
                requests.append((length, slot))
                scales.append(scale)
                if slot >= 0:
                    segments.append((start, length, slot, scale))
                start += length
            if not segments:
                self._cache[key] = (None, [])
            else:
                meta = LoRABatchMeta.build(requests, self.slot_ranks, scales, device=self.device)
                self._cache[key] = (meta, segments)
        return self._cache[key]


class LoRAManager:
    """Slots, names and the per-call batch layout of one rank's transformer."""

    def __init__(
        self,
        transformer: nn.Module,
        pipeline_class: str,
        *,
        max_loras: int,
        max_rank: int,
        fused: bool = True,
        transformer_2: nn.Module | None = None,
    ):
        self.transformer = transformer
        self.transformer_2 = transformer_2  # Wan 2.2 A14B's second (low-noise) expert
        self.fused = fused
        # linears whose input rows are the batch's rows k times over (name → k), as the model declares them
        self.row_copies: dict[str, int] = dict(getattr(transformer, "lora_row_copies", {}))
        if transformer_2 is not None:
            copies = getattr(transformer_2, "lora_row_copies", {})
            self.row_copies |= {SECOND + name: k for name, k in copies.items()}
        self.pipeline_class = pipeline_class
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = next(transformer.parameters()).device
        self.layers: dict[str, LoRALayer] = {}
        self.slots: dict[str, int] = {}  # adapter name → slot
        self.ranks = [0] * max_loras
        self.info: dict[str, dict[str, Any]] = {}
        self.batch: BatchLayout | None = None
        self.active = False  # self.batch is not None, as a plain bool (a torch.compile guard)
        self.share_shrink = True
        self.groups: dict[str, tuple[LoRALayer, ...]] = {}  # first layer's name → the layers of its group
        # the input tensors are held weakly: nothing here keeps an activation alive
        self._run: tuple[Any, int, list[LoRALayer]] = (_dead, 0, [])  # linears called in a row on one input
        # a group's s slices for the other linears: {(id(meta), scaled): {layer name: s}} for one input
        self._shared: tuple[Any, int, dict] = (_dead, 0, {})
        # CUDA graphs (graph_key): forwards with adapters since slots or groups last changed (a new group moves
        # its layers' A buffers, which a captured graph would still read; groups are only ever added, so their
        # count tells the generations apart in the key)
        self._settled = 0
        # step caching (relayout): the forward's own (batch, active) while its later blocks run on some rows,
        # and whether this forward was narrowed (then it does not count towards _settled)
        self._full: tuple[BatchLayout | None, bool] | None = None
        self._narrowed = False

    def _submodule(self, name: str) -> nn.Module:
        """A module of the first expert (``name``) or the second (``transformer_2.<module>``)."""
        if name.startswith(SECOND) and self.transformer_2 is not None:
            return self.transformer_2.get_submodule(name.removeprefix(SECOND))
        return self.transformer.get_submodule(name)

    def _layer(self, name: str) -> LoRALayer:
        if name not in self.layers:
            module = self._submodule(name)
            if not _is_linear(module):
                raise ValueError(f"path: {name} is not a linear layer of the model")
            self.layers[name] = LoRALayer(name, module, self)
        return self.layers[name]

    def strength(self, ref) -> float:
        """A request's adapter strength: its own scale when it gives one (it replaces, never multiplies, the
        load-time scale, as diffusers' ``set_adapters`` weights do), else the scale the adapter was loaded with."""
        return float(ref.scale) if ref.scale is not None else self.info[ref.name]["scale"]

    def load(self, name: str, path: str, scale: float = 1.0, target: str | None = None) -> dict[str, Any]:
        """Load ``path`` into a slot as ``name``; ``scale`` is the strength of requests that give none;
        ``target`` the expert the file loads into (None: each expert's weights into that expert)."""
        from .loader import read_lora_file

        if target == "transformer_2" and self.transformer_2 is None:
            raise ValueError(second_expert_refusal(self.pipeline_class))
        lora = read_lora_file(Path(path), self.pipeline_class, target)
        return self.load_weights(name, lora, scale, source=str(path), target=target)

    def load_weights(
        self, name: str, lora: LoRAFile, scale: float = 1.0, source: str = "", target: str | None = None
    ) -> dict[str, Any]:
        """Put already-read adapter weights into a slot (all checks first: all layers or none)."""
        if "transformer_2" in lora.experts and self.transformer_2 is None:
            raise ValueError(
                f"path: adapter {name!r} holds weights for a second expert (transformer_2. keys), which this "
                f"{self.pipeline_class} model does not have (Wan 2.2 A14B has one)"
            )
        if lora.rank > self.max_rank:
            # named by module: a rank the file's pairs do not show, e.g. diffusers' reading of a full weight
            # delta (Wan's head.head.diff) as a pair whose rank is the layer's output width
            above = [m for m, w in lora.modules.items() if w.a.shape[0] > self.max_rank]
            raise ValueError(
                f"path: adapter {name!r} has rank {lora.rank} (at {', '.join(above[:3])}), above "
                f"--max-lora-rank {self.max_rank}"
            )
        replacing = name in self.slots
        if not replacing and len(self.slots) >= self.max_loras:
            raise ValueError(
                f"lora: all {self.max_loras} adapter slots are in use ({sorted(self.slots)}); unload one first"
            )
        missing = [m for m in lora.modules if not self._has_module(m)]
        if missing and len(missing) == len(lora.modules):
            # e.g. a Wan or Qwen-Image file given to a FLUX model: nothing of it names a layer here
            raise ValueError(
                f"path: adapter {name!r} names none of this {self.pipeline_class} model's layers (it targets "
                f"{missing[:3]}{', ...' if len(missing) > 3 else ''}): a file for another model, or in a layout "
                "diffusers' loader of this model does not convert?"
            )
        if missing:
            raise ValueError(f"path: adapter {name!r} targets modules the model does not have: {missing[:5]}")
        not_linear = [m for m in lora.modules if not _is_linear(self._submodule(m))]
        if not_linear:  # a convolution (a patch embedding), a norm: the slots and kernels are for linears
            raise ValueError(
                f"path: adapter {name!r} targets layers that are not linear: {not_linear[:5]}; adapters apply "
                "to the model's linear layers only"
            )
        layers = {m: self._layer(m) for m in lora.modules}
        for module_name, weights in lora.modules.items():
            layers[module_name].check(weights)  # every check before any write: all or nothing
        slot = (
            self.slots[name]
            if replacing
            else next(i for i in range(self.max_loras) if i not in self.slots.values())
        )
        for layer in self.layers.values():
            layer.write(slot, lora.modules.get(layer.name))
        self.slots[name] = slot
        self.ranks[slot] = lora.rank
        self._settled = 0  # new layers may form groups in the next forward
        self.info[name] = {
            "name": name,
            "path": source,
            "scale": float(scale),
            "rank": lora.rank,
            "modules": len(lora.modules),
            "target": target,
        }
        return self.info[name]

    def _has_module(self, name: str) -> bool:
        try:
            self._submodule(name)
            return True
        except AttributeError:
            return False

    def unload(self, name: str) -> None:
        if name not in self.slots:
            raise KeyError(name)
        slot = self.slots.pop(name)
        for layer in self.layers.values():
            layer.write(slot, None)
        self.ranks[slot] = 0
        self._settled = 0
        self.info.pop(name, None)

    def shared_shrink(
        self,
        layer: LoRALayer,
        x: torch.Tensor,
        x2: torch.Tensor,
        meta: LoRABatchMeta,
        scaled: bool,
        shrink: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """``lora_shrink(x2, layer.a, meta, scaled=scaled)`` (x2: the layer's input x as [tokens, in]) if its
        group's shrink has it, running that shrink when ``layer`` leads a group (``shrink(a_group)`` instead
        of ``lora_shrink`` when given: the leader's fused GEMM computes it); None: the layer shrinks on its
        own. The input is recognised by identity (the tensor object the module was called with), the batch
        position by its meta."""
        if not self.share_shrink:
            return None
        sx, version, cache = self._shared
        if sx() is not x or version != _version(x):
            cache = {}
        parts = cache.get((id(meta), scaled))
        if parts is not None and layer.name in parts:
            return parts.pop(layer.name)
        group = self.groups.get(layer.name)
        if group is None or not any(self.batch.slots & member.used for member in group[1:]):
            return None  # no group, or no other linear of it has an adapter of this batch
        # [len(group), tokens, cols]
        s_all = shrink(group[0].a_group) if shrink else lora_shrink(x2, group[0].a_group, meta, scaled=scaled)
        cache[(id(meta), scaled)] = {g.name: s_all[i : i + 1] for i, g in enumerate(group) if i}
        self._shared = (weakref.ref(x), _version(x), cache)
        return s_all[:1]

    def note_input(self, layer: LoRALayer, x: torch.Tensor) -> None:
        """Learn groups: linears called in a row on the same tensor, not yet in a group, with A buffers of
        one shape and dtype (≤ 4: the shrink's slice limit)."""
        if not self.share_shrink:
            return
        rx, version, run = self._run
        if rx() is x and version == _version(x):
            run.append(layer)
            return
        self._close_run()
        self._run = (weakref.ref(x), _version(x), [layer])

    def _close_run(self) -> bool:
        """Make the run of linears on one input a group if it can be one; whether it became one."""
        run: list[LoRALayer] = []
        for layer in self._run[2]:
            if layer in run:  # a linear called twice on one input: the group ends before it
                break
            if layer.a_group is None:
                run.append(layer)
        self._run = (_dead, 0, [])
        if len(run) < 2:
            return False
        run = run[:4]
        first = run[0].a
        if any(layer.a.shape != first.shape or layer.a.dtype != first.dtype for layer in run):
            return False
        if first.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # no group while a CUDA graph is captured: it would move A buffers the graph reads
        a_group = torch.cat([layer.a for layer in run])  # [len(run), max_loras, max_rank, in]
        for i, layer in enumerate(run):
            layer.a = a_group[i : i + 1]  # writes to the layer's slots now land in the group buffer
            layer.a_group = a_group
        self.groups[run[0].name] = tuple(run)
        self._settled = 0
        return True

    def set_batch(self, groups: list[tuple[int, tuple]]) -> None:
        """``groups``: (rows, request's LoRARefs) in row order of the next transformer call."""
        layout = []
        for rows, refs in groups:
            layout.append((rows, [(self.slots[r.name], self.strength(r)) for r in refs]))
        has_lora = any(adapters for _, adapters in layout)
        # the previous call was a forward with adapters (its own layout, even if it ended narrowed)
        ran_lora = self.active if self._full is None else self._full[1]
        narrowed, self._full, self._narrowed = self._narrowed, None, False
        self.batch = BatchLayout(layout, list(self.ranks), self.device) if has_lora else None
        self.active = has_lora
        # the previous call's last run of linears on one input
        if not self._close_run() and ran_lora and not narrowed:
            self._settled += 1
        self._shared = (_dead, 0, {})

    def relayout(self, rows: list[int] | None, offsets: list[int] | None) -> None:
        """Step caching, inside one forward: from now on only ``rows[i]`` rows from row ``offsets[i]`` of
        this forward's layout (in order) reach the linears, each with its request's adapters; ``(None,
        None)`` gives the forward's full layout back (the layers after the blocks see every row again).

        Every rank of a tensor- or sequence-parallel group takes the same decisions, hence the same
        narrowed layout; a narrowed layout's tokens per row are counted as the full one's are (rows ×
        this rank's tokens), so sequence-sharded rows need nothing more."""
        if rows is None:
            if self._full is not None:
                self.batch, self.active = self._full
                self._full = None
        else:
            assert offsets is not None and self._full is None, "relayout: the full layout first"
            self._full = (self.batch, self.active)
            self._narrowed = True
            sub = None if self.batch is None else self.batch.select(rows, offsets)
            self.batch = sub if sub is not None and sub.slots else None
            self.active = self.batch is not None  # no adapter on those rows: the linears' plain path
        # a shared shrink's slices belong to the rows they were computed for
        self._shared = (_dead, 0, {})

    def graph_key(self) -> tuple[tuple, BatchLayout] | None:
        """For ``--cuda-graphs``: this call's adapter layout as part of a graph key (rows, slot and scale per
        request and position; slot ranks; the group generation; the path switches) and the layout to keep
        alive with a graph captured for it (its segment tensors on the device, which the captured kernels
        read); None while the forward must run without a graph: no adapters, or no forward with adapters
        yet since the slots changed (the first one learns the groups, which moves A buffers)."""
        if self.batch is None or self._settled < 1:
            return None
        layout = tuple((rows, tuple(adapters)) for rows, adapters in self.batch.groups)
        key = (layout, tuple(self.batch.slot_ranks), len(self.groups), self.fused, self.share_shrink)
        return key, self.batch
