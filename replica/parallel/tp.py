"""Tensor parallelism with two small modules of ours instead of DTensor: easy to read, easy on gloo.

`ColumnParallelLinear` keeps a slice of the output features (no comm); `RowParallelLinear` keeps the
matching slice of the input features and all-reduces the partial sums. A column → row pair costs one
all-reduce. Each module records how it was cut, for LoRA under TP:

* ``tp_mode``   "column" | "row"
* ``tp_rank``, ``tp_size``, ``tp_group``
* ``tp_slices`` list of (start, stop) ranges of the *full* weight's sharded dim that this rank holds,
  concatenated in order (out features for column, in features for row). Usually one range; a packed
  input such as Flux's single-block ``proj_out`` (cat(attention, mlp)) has one range per packed block.

A LoRA-aware linear slices B's rows (column) or A's columns (row) with the same ranges and, for row
mode, adds its delta inside `forward_partial`, i.e. before the all-reduce, so it is reduced together
with the base output.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def shard_ranges(blocks: Sequence[int], rank: int, size: int) -> list[tuple[int, int]]:
    """Ranges of a dim made of packed `blocks` that rank `rank` of `size` holds (each block cut evenly)."""
    ranges, start = [], 0
    for block in blocks:
        if block % size != 0:
            raise ValueError(f"a block of {block} features cannot be split over --tp-size {size}")
        part = block // size
        ranges.append((start + rank * part, start + (rank + 1) * part))
        start += block
    return ranges


def _take(t: torch.Tensor, ranges: Sequence[tuple[int, int]], dim: int) -> torch.Tensor:
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


class _ParallelLinear(nn.Module):
    tp_mode: str

    def __init__(
        self,
        linear: nn.Linear,
        *,
        group: dist.ProcessGroup,
        blocks: Sequence[int] | None,
        shard_dim: int,
    ) -> None:
        super().__init__()
        self.tp_group = group
        self.tp_rank = dist.get_rank(group)
        self.tp_size = dist.get_world_size(group)
        self.full_in_features = linear.in_features
        self.full_out_features = linear.out_features
        full = linear.weight.shape[shard_dim]
        self.tp_slices = shard_ranges(list(blocks) if blocks else [full], self.tp_rank, self.tp_size)
        with torch.no_grad():
            self.weight = nn.Parameter(_take(linear.weight.detach(), self.tp_slices, shard_dim))
        self.out_features, self.in_features = self.weight.shape

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}/{self.full_in_features}, out={self.out_features}/{self.full_out_features}, "
            f"tp={self.tp_rank}/{self.tp_size}, slices={self.tp_slices}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """y[..., slices] = x W[slices]ᵀ + b[slices]; input replicated, output sharded, no comm."""

    tp_mode = "column"

    def __init__(
        self, linear: nn.Linear, *, group: dist.ProcessGroup, blocks: Sequence[int] | None = None
    ) -> None:
        super().__init__(linear, group=group, blocks=blocks, shard_dim=0)
        bias = None
        if linear.bias is not None:
            bias = nn.Parameter(_take(linear.bias.detach(), self.tp_slices, 0))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """y = all_reduce(x[..., slices] W[:, slices]ᵀ) + b; input sharded, output replicated."""

    tp_mode = "row"

    def __init__(
        self, linear: nn.Linear, *, group: dist.ProcessGroup, blocks: Sequence[int] | None = None
    ) -> None:
        super().__init__(linear, group=group, blocks=blocks, shard_dim=1)
        # the bias is added once, after the reduction
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce and without bias (LoRA adds here)."""
        return F.linear(x, self.weight)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_partial(x)
        dist.all_reduce(y, group=self.tp_group)
        return self.add_bias(y)


def fused_row_parallel(
    modules: Sequence[RowParallelLinear], inputs: Sequence[torch.Tensor], seq_dim: int = 1
) -> list[torch.Tensor]:
    """Several row-parallel linears of one block with a single all-reduce (Flux image + text outputs).

    The partial outputs must share every dim but `seq_dim`; they are concatenated, reduced once, split.
    """
    parts = [m.forward_partial(x) for m, x in zip(modules, inputs, strict=True)]
    sizes = [p.shape[seq_dim] for p in parts]
    joined = torch.cat(parts, dim=seq_dim)
    dist.all_reduce(joined, group=modules[0].tp_group)
    return [m.add_bias(p) for m, p in zip(modules, joined.split(sizes, dim=seq_dim), strict=True)]


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a feature dim that TP has split (Wan normalises q/k across all heads).

    Each rank sums squares of its slice, one all-reduce gives the full sum, then the weight slice scales.
    """

    def __init__(
        self, norm: nn.RMSNorm, *, group: dist.ProcessGroup, ranges: Sequence[tuple[int, int]]
    ) -> None:
        super().__init__()
        self.tp_group = group
        self.full_dim = int(norm.normalized_shape[-1])
        self.eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        self.tp_slices = list(ranges)
        weight = None
        if norm.weight is not None:
            weight = nn.Parameter(_take(norm.weight.detach(), self.tp_slices, 0))
        self.weight = weight

    def sum_squares(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().pow(2).sum(-1, keepdim=True)

    def normalize(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        y = (x.float() * torch.rsqrt(total / self.full_dim + self.eps)).to(x.dtype)
        return y if self.weight is None else y * self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.sum_squares(x)
        dist.all_reduce(total, group=self.tp_group)
        return self.normalize(x, total)


def sharded_rms_norm_many(norms: Sequence[ShardedRMSNorm], xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Apply several ShardedRMSNorms (Wan's norm_q and norm_k) with one all-reduce of their statistics."""
    totals = [n.sum_squares(x) for n, x in zip(norms, xs, strict=True)]
    flat = torch.cat([t.flatten() for t in totals])
    dist.all_reduce(flat, group=norms[0].tp_group)
    out, offset = [], 0
    for n, x, t in zip(norms, xs, totals, strict=True):
        out.append(n.normalize(x, flat[offset : offset + t.numel()].view_as(t)))
        offset += t.numel()
    return out


# ---- applying a plan ------------------------------------------------------------------------------
# A plan maps fnmatch patterns of module names to "column", "row", or ("row" | "column", blocks) where
# blocks lists the packed sizes of the sharded dim. It is data, like diffusers' `_tp_plan`.
TPPlan = Mapping[str, str | tuple[str, Sequence[int]]]


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def apply_tp_plan(model: nn.Module, plan: TPPlan, *, group: dist.ProcessGroup) -> list[str]:
    """Replace every nn.Linear whose name matches a plan pattern; returns the names replaced."""
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        for pattern, spec in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                mode, blocks = (spec, None) if isinstance(spec, str) else spec
                cls = ColumnParallelLinear if mode == "column" else RowParallelLinear
                _set_submodule(model, name, cls(module, group=group, blocks=blocks))
                replaced.append(name)
                break
    return replaced


def sharded_blocks(model: nn.Module, plan: TPPlan) -> dict[str, list[int]]:
    """What `apply_tp_plan` would cut, without cutting: each matched linear's name → the sizes of the packed
    blocks of its sharded dim (out features for column, in features for row). Works on a meta-device model."""
    cut: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        for pattern, spec in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                mode, blocks = (spec, None) if isinstance(spec, str) else spec
                full = module.out_features if mode == "column" else module.in_features
                cut[name] = list(blocks) if blocks else [full]
                break
    return cut


def tp_features(folder, family) -> dict[str, int]:
    """Each feature size the family's TP plan cuts in the folder's transformer(s), with the first module of
    that size (``"the transformer's layers.0.feed_forward.w1" → 10240``): what --tp-size must divide beside the
    heads, checked before anything loads (Z-Image's SwiGLU at --tp-size 3 passed the heads check and failed in
    every rank while sharding the loaded weights). The transformer is built from its config on the meta
    device (no memory, no weights). ``folder``: a families.Folder; ``family``: a Family."""
    import diffusers

    plan = family.load("plan")
    sizes: dict[int, str] = {}
    for component in ("transformer", "transformer_2"):
        config = folder.config(component)
        if not hasattr(diffusers, config.get("_class_name", "")):
            continue
        try:
            with torch.device("meta"):
                model = getattr(diffusers, config["_class_name"]).from_config(dict(config))
        except Exception:  # noqa: BLE001 - a config diffusers cannot build: loading says why; the ranks check TP
            continue
        for name, blocks in sharded_blocks(model, plan.tp_map(model)).items():
            for block in blocks:
                sizes.setdefault(block, f"its {component}'s {name}")
    return {module: size for size, module in sizes.items()}
