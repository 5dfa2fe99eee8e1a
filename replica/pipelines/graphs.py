"""``--cuda-graphs``: the transformer forward replayed as a CUDA graph, one graph per input signature.

A denoising step launches thousands of kernels (FLUX: 57 blocks, each tens of kernels, more with FP8
activation quantization); when the GPU work per kernel is small (512², small batches) the host cannot
launch them as fast as the GPU runs them. A CUDA graph records the whole forward once and replays it with
one launch. Shapes must not change between replays, so there is one graph per signature (the shapes,
dtypes and non-tensor values of every input), as a serving engine with fixed resolution buckets has few.

The first call of a signature runs the forward normally (on a side stream, which also finishes any
``torch.compile`` work for those shapes) and returns that result; then it captures the graph on static
copies of the inputs. Later calls copy their inputs into those copies, replay, and return a clone of the
output (the next replay overwrites it: CFG runs the cond and uncond rows through the same graph).

Graphs share one memory pool. That is safe here because replays never overlap and every output is cloned
before another graph runs. A signature whose capture fails (an operation that syncs with the host) runs
normally from then on. The caller clears the cache when the model changes (weights update, adapter load or
unload).

Batches with adapters replay too: the caller adds their layout (rows, slots and scales per request) to the
key, and hands over what the captured kernels read besides the inputs (the layout's segment tensors on the
device), which the entry keeps alive: a replay reads those tensors, not the ones built for its own step,
which hold the same values because the layout is the same.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_inputs: list  # same layout as the flattened call arguments; tensors are the capture's copies
    output: torch.Tensor
    keep: object = None  # what the captured kernels read besides the inputs (kept alive with the graph)


def signature(leaves: list, spec) -> tuple:
    """Hashable description of one call: the argument structure, then per leaf (shape, dtype, device) for
    a tensor or the value itself (None, numbers, strings)."""
    return (
        str(spec),
        tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x for x in leaves),
    )


class StepGraphs:
    """Calls ``forward(*args)`` through CUDA graphs keyed by :func:`signature` (at most ``max_graphs``,
    least recently used evicted). ``forward`` must return one tensor."""

    def __init__(self, forward: Callable[..., torch.Tensor], device: torch.device, max_graphs: int = 8):
        assert device.type == "cuda", "CUDA graphs need a CUDA device"
        self.forward = forward
        self.device = device
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.uncapturable: set[tuple] = set()
        self.pool = None
        self.captures = 0
        self.replays = 0

    def clear(self) -> None:
        """Forget every graph (the model changed); their memory goes back to the allocator."""
        self.graphs.clear()
        self.uncapturable.clear()
        self.pool = None

    def __call__(self, *args, extra: tuple = (), keep: object = None) -> torch.Tensor:
        """``extra``: more of the key (state the forward reads besides its arguments, e.g. the adapter layout);
        ``keep``: kept alive with a graph captured for this call."""
        leaves, spec = pytree.tree_flatten(args)
        key = (signature(leaves, spec), extra)
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            for static, value in zip(entry.static_inputs, leaves, strict=True):
                if isinstance(value, torch.Tensor):
                    static.copy_(value)
            entry.graph.replay()
            self.replays += 1
            return entry.output.clone()
        if key in self.uncapturable:
            return self.forward(*args)
        return self._first_call(key, leaves, spec, keep)

    def _first_call(self, key: tuple, leaves: list, spec, keep: object = None) -> torch.Tensor:
        static = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        static_args = pytree.tree_unflatten(static, spec)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            result = self.forward(*static_args)  # warm-up on the capture's own inputs (compiles if needed)
        current.wait_stream(side)
        result.record_stream(current)  # made on the side stream, used on the caller's
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                output = self.forward(*static_args)
        except Exception as exc:  # noqa: BLE001 — a forward that cannot be captured still runs
            logger.warning("CUDA graph capture failed for %s; running it without a graph: %s", key, exc)
            self.uncapturable.add(key)
            torch.cuda.synchronize(self.device)
            return result
        self.pool = graph.pool()
        self.graphs[key] = _Graph(graph, static, output, keep)
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return result
