"""Parallel degrees of one engine replica, validated once at the edge.

`ParallelDims` is the whole layout of one replica as data: CFG × TP × Ulysses × (ring | K/V-gather).
Data parallelism is not in here: a "dp" replica is a whole engine, started by the cluster layer.
Every rule raises a `ValueError` that names the command-line flag(s) and says how to fix it, because the
person who reads it typed those flags.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Mesh axes, outermost first; rank = (((cfg·R + ring)·G + kv_gather)·U + ulysses)·T + tp.
AXES: tuple[str, ...] = ("cfg", "ring", "kv_gather", "ulysses", "tp")
# The sequence is split over these, in this order (shard index = slot rank · U + ulysses rank).
SP_AXES: tuple[str, ...] = ("ring", "kv_gather", "ulysses")

# Flag names as the CLI spells them; error messages use these so users can act on them.
FLAG_NAMES: dict[str, str] = {
    "cfg": "--cfg-parallel-size",
    "tp": "--tp-size",
    "ulysses": "--ulysses-degree",
    "ring": "--ring-degree",
    "kv_gather": "--kv-gather-degree",
    "sp_degree": "--sp-degree",
    "num_gpus": "--num-gpus",
    "dp_size": "--dp-size",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class ParallelDims(BaseModel):
    """Degrees of the parallel axes inside one replica; `world_size` ranks in all.

    Rank order, innermost first: tp, then ulysses, then ring or kv_gather, then cfg. TP innermost keeps
    its per-block all-reduce on the fastest links; Ulysses' all-to-all is next; the ring only talks to
    neighbours and overlaps with compute, so it can be strided; CFG talks once per step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cfg: int = Field(
        1, ge=1, le=2, description="CFG-parallel size: branch i (cond/uncond) runs on cfg rank i."
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel size: heads and MLP columns split across ranks.")
    ulysses: int = Field(1, ge=1, description="Ulysses degree: all-to-all swaps sequence and head shards.")
    ring: int = Field(1, ge=1, description="Ring-attention degree: K/V blocks passed around a P2P ring.")
    kv_gather: int = Field(1, ge=1, description="K/V-gather degree: K/V all-gathered once, local queries.")

    @model_validator(mode="after")
    def _one_slot_for_ring_or_gather(self) -> ParallelDims:
        if self.ring > 1 and self.kv_gather > 1:
            raise ValueError(
                f"--ring-degree {self.ring} and --kv-gather-degree {self.kv_gather} are alternatives for the "
                "same sequence-parallel slot; set one of them to 1 (e.g. --ring-degree "
                f"{self.ring * self.kv_gather} --kv-gather-degree 1)."
            )
        return self

    # ---- derived values -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks of one replica: the product of every degree."""
        return self.cfg * self.tp * self.ulysses * self.ring * self.kv_gather

    @property
    def sp_degree(self) -> int:
        """How many shards the image/video sequence is cut into."""
        return self.ulysses * self.ring * self.kv_gather

    @property
    def slot_degree(self) -> int:
        """Degree of the ring-or-gather slot (one of the two is 1)."""
        return self.ring * self.kv_gather

    def describe(self) -> str:
        """A short human string, e.g. ``cfg2×tp1×ulysses2×ring2`` (degree-1 axes after cfg are dropped)."""
        parts = [f"cfg{self.cfg}"]
        for name in ("tp", "ulysses", "ring", "kv_gather"):
            if getattr(self, name) > 1:
                parts.append(f"{name}{getattr(self, name)}")
        return "×".join(parts)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis` ("sp" = ring·kv_gather·ulysses) as lists of global ranks, sorted.

        Pure layout math, the same the DeviceMesh builds; used by docs, logs and the unit tests.
        """
        import torch

        full = torch.arange(self.world_size).reshape([getattr(self, a) for a in AXES])
        keep = SP_AXES if axis == "sp" else (axis,)
        if any(a not in AXES for a in keep):
            raise KeyError(f"unknown mesh axis {axis!r}; axes are {AXES + ('sp',)}")
        inner = [AXES.index(a) for a in keep]
        outer = [i for i in range(len(AXES)) if i not in inner]
        size = 1
        for i in inner:
            size *= int(full.shape[i])
        return sorted(full.permute(*outer, *inner).reshape(-1, size).tolist())

    # ---- model-dependent rules ----------------------------------------------------------------------
    def validate(
        self,
        *,
        num_heads: int,
        attention_supports_lse: bool = True,
        tp_features: Mapping[str, int] | None = None,
    ) -> None:
        """Check the layout against a model and an attention backend; raise `ValueError` if it cannot run.

        Why each rule: TP gives each rank `heads / tp` whole heads, and an even share of every feature dim
        its plan cuts (``tp_features``: a module → its features, e.g. an MLP's 10240 hidden features);
        Ulysses then gives each of its ranks whole heads of those; the ring merges partial softmaxes, which
        needs each block's log-sum-exp.
        """
        features = dict(tp_features or {})
        fits = [d for d in _divisors(num_heads) if all(f % d == 0 for f in features.values())]
        if num_heads % self.tp != 0:
            ok = ", ".join(str(d) for d in fits if d * self.cfg <= 64)
            also = (
                " and the features tensor parallelism splits" if len(fits) < len(_divisors(num_heads)) else ""
            )
            raise ValueError(
                f"--tp-size {self.tp} does not divide the model's {num_heads} attention heads; "
                f"choose a --tp-size that divides {num_heads}{also} ({ok})."
            )
        for module, size in features.items():
            if size % self.tp:
                raise ValueError(
                    f"--tp-size {self.tp} divides the model's {num_heads} attention heads but not the {size} "
                    f"features of {module}, which tensor parallelism splits; choose a --tp-size that divides "
                    f"both ({', '.join(map(str, fits))}), or give the rest of the degree to --ulysses-degree "
                    "/ --ring-degree."
                )
        heads_per_tp = num_heads // self.tp
        if heads_per_tp % self.ulysses != 0:
            ok = ", ".join(str(d) for d in _divisors(heads_per_tp))
            raise ValueError(
                f"{num_heads} heads / --tp-size {self.tp} = {heads_per_tp} heads per TP rank, which "
                f"--ulysses-degree {self.ulysses} does not divide; use a --ulysses-degree that divides "
                f"{heads_per_tp} ({ok}), a smaller --tp-size, or move the rest of the degree to "
                "--ring-degree / --kv-gather-degree."
            )
        if self.ring > 1 and not attention_supports_lse:
            raise ValueError(
                f"--ring-degree {self.ring} needs an attention backend that returns the softmax "
                "log-sum-exp to merge partial results, and the selected backend does not; use "
                f"--kv-gather-degree {self.ring} --ring-degree 1 instead, or pick a backend with LSE "
                "(torch math on CPU, cuDNN / flash SDPA on GPU)."
            )

    # ---- construction from CLI flags ------------------------------------------------------------
    @classmethod
    def from_flags(
        cls,
        *,
        num_gpus: int | None = None,
        dp_size: int = 1,
        cfg: int = 1,
        tp: int = 1,
        ulysses: int = 1,
        ring: int = 1,
        kv_gather: int = 1,
        sp_degree: int | None = None,
        num_heads: int | None = None,
        attention_supports_lse: bool = True,
        tp_features: Mapping[str, int] | None = None,
    ) -> ParallelDims:
        """Build the per-replica layout from serving flags (SGLang Diffusion semantics).

        `num_gpus` counts every GPU of the deployment, so each of the `dp_size` replicas gets
        `num_gpus / dp_size`; that must equal cfg × tp × ulysses × ring × kv_gather. Without `num_gpus`
        the deployment simply uses dp_size × that product. `sp_degree` alone picks the sequence-parallel
        kind: 2 → kv_gather 2 (one all-gather, cheapest at small degree), larger → Ulysses.

        With `num_heads` the layout is also checked against the model (`validate`). A layout that breaks a
        rule raises a `ValueError` ending in whole layouts that pass every rule checked here (counts, and
        heads when known), so a suggestion taken as written never leads to the next error.
        """
        flags = dict(num_gpus=num_gpus, dp_size=dp_size, cfg=cfg, tp=tp, ulysses=ulysses, ring=ring)
        flags.update(kv_gather=kv_gather, sp_degree=sp_degree)
        try:
            return _build(
                **flags,
                num_heads=num_heads,
                attention_supports_lse=attention_supports_lse,
                tp_features=tp_features,
            )
        except _FlagError:
            raise  # a value no layout can have (0, cfg 3, sp with explicit degrees): the message says it
        except ValueError as exc:
            message = _message(exc)
            if sp_degree is not None and sp_degree > 1 and (ulysses, ring, kv_gather) == (1, 1, 1):
                # the message names the degree --sp-degree became, a flag the user did not type
                runs_as = "--kv-gather-degree 2" if sp_degree == 2 else f"--ulysses-degree {sp_degree}"
                message = f"--sp-degree {sp_degree} runs as {runs_as}: {message}"
            legal = suggest_layouts(
                **flags,
                num_heads=num_heads,
                attention_supports_lse=attention_supports_lse,
                tp_features=tp_features,
            )
            if legal:
                message += " Legal layouts: " + " or ".join(f"`{format_flags(f)}`" for f in legal) + "."
            raise ValueError(message) from exc


class _FlagError(ValueError):
    """One flag's value is out of range whatever the others are."""


def _message(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
    return str(exc)


def _build(
    *,
    num_gpus: int | None,
    dp_size: int,
    cfg: int,
    tp: int,
    ulysses: int,
    ring: int,
    kv_gather: int,
    sp_degree: int | None,
    num_heads: int | None,
    attention_supports_lse: bool,
    tp_features: Mapping[str, int] | None = None,
) -> ParallelDims:
    """`ParallelDims.from_flags` without suggestions (they are checked with this)."""
    for name, value in (
        ("dp_size", dp_size),
        ("cfg", cfg),
        ("tp", tp),
        ("ulysses", ulysses),
        ("ring", ring),
        ("kv_gather", kv_gather),
    ):
        if value < 1:
            raise _FlagError(f"{FLAG_NAMES[name]} must be >= 1, got {value}; pass a positive integer.")
    if cfg > 2:
        raise _FlagError(
            f"--cfg-parallel-size {cfg} is not supported: classifier-free guidance has two branches; "
            "use --cfg-parallel-size 1 or 2."
        )
    if sp_degree is not None:
        if sp_degree < 1:
            raise _FlagError(f"--sp-degree must be >= 1, got {sp_degree}; pass a positive integer.")
        if (ulysses, ring, kv_gather) != (1, 1, 1):
            raise _FlagError(
                f"--sp-degree {sp_degree} cannot be combined with --ulysses-degree / --ring-degree / "
                "--kv-gather-degree; pass either --sp-degree alone or the explicit degrees."
            )
        if sp_degree == 2:
            kv_gather = 2
        elif sp_degree > 2:
            ulysses = sp_degree
    if num_gpus is not None and num_gpus < 1:
        raise _FlagError(f"--num-gpus must be >= 1, got {num_gpus}; pass a positive integer.")
    dims = ParallelDims(cfg=cfg, tp=tp, ulysses=ulysses, ring=ring, kv_gather=kv_gather)
    # The model's rules first: a count fixed around degrees the model cannot run would only move the error.
    if num_heads is not None:
        dims.validate(
            num_heads=num_heads, attention_supports_lse=attention_supports_lse, tp_features=tp_features
        )
    if num_gpus is not None:
        if num_gpus % dp_size != 0:
            raise ValueError(
                f"--num-gpus {num_gpus} is not divisible by --dp-size {dp_size}; every replica needs the "
                f"same number of GPUs, so pass a --num-gpus that is a multiple of {dp_size}."
            )
        per_replica = num_gpus // dp_size
        if per_replica != dims.world_size:
            # one replica (generate, or serve's default): no --dp-size to speak of
            share = (
                f"--num-gpus {num_gpus} / --dp-size {dp_size} = {per_replica} GPUs per replica"
                if dp_size > 1
                else f"--num-gpus {num_gpus} GPUs in the replica"
            )
            raise ValueError(
                f"{share}, but "
                f"--cfg-parallel-size {dims.cfg} × --tp-size {dims.tp} × --ulysses-degree {dims.ulysses} "
                f"× --ring-degree {dims.ring} × --kv-gather-degree {dims.kv_gather} = {dims.world_size}; "
                f"change --num-gpus or the degrees so that they agree."
            )
    return dims


# Flags of a suggested layout, in the order a user types them.
_LAYOUT_FLAGS = ("num_gpus", "dp_size", "cfg", "tp", "ulysses", "ring", "kv_gather")


def format_flags(layout: dict[str, int]) -> str:
    """``--num-gpus 4 --ulysses-degree 4``: the layout flags that differ from 1 (``--num-gpus`` always)."""
    parts = []
    for name in _LAYOUT_FLAGS:
        value = layout.get(name, 1)
        if name == "num_gpus" or value != 1:
            parts += [FLAG_NAMES[name], str(value)]
    return " ".join(parts)


def suggest_layouts(
    *,
    num_gpus: int | None,
    dp_size: int,
    cfg: int,
    tp: int,
    ulysses: int,
    ring: int,
    kv_gather: int,
    sp_degree: int | None = None,
    num_heads: int | None = None,
    attention_supports_lse: bool = True,
    tp_features: Mapping[str, int] | None = None,
    limit: int = 3,
) -> list[dict[str, int]]:
    """Up to `limit` whole layouts (flag name → value, see `format_flags`) that pass every rule checked
    here, closest to the flags given first: the GPUs asked for kept, then --cfg-parallel-size, then the
    fewest degrees changed."""
    if sp_degree is not None and (ulysses, ring, kv_gather) == (1, 1, 1):
        ulysses, kv_gather = (sp_degree, 1) if sp_degree > 2 else (1, sp_degree)
    cfg = min(max(cfg, 1), 2)
    wanted = dict(
        cfg=cfg, tp=max(tp, 1), ulysses=max(ulysses, 1), ring=max(ring, 1), kv_gather=max(kv_gather, 1)
    )
    world = math.prod(wanted.values())
    # The slot kind the user picked; the ring by default, K/V-gather where no backend gives the LSE.
    slot = "kv_gather" if kv_gather > 1 or (ring == 1 and not attention_supports_lse) else "ring"
    # Deployments to try: the GPUs asked for (split over --dp-size), then the degrees as given.
    targets: list[tuple[int, int]] = []
    if num_gpus is not None and num_gpus >= 1:
        if num_gpus % dp_size == 0:
            targets.append((num_gpus, dp_size))
        elif num_gpus % world == 0:
            targets.append((num_gpus, num_gpus // world))
    targets.append((dp_size * world, dp_size))
    found: list[tuple[tuple, dict[str, int]]] = []
    for gpus, dp in dict.fromkeys(targets):
        per_replica = gpus // dp
        for c in _divisors(per_replica):
            if c > 2:
                continue
            for t in _divisors(per_replica // c):
                for u in _divisors(per_replica // (c * t)):
                    s = per_replica // (c * t * u)
                    layout = dict(num_gpus=gpus, dp_size=dp, cfg=c, tp=t, ulysses=u, ring=1, kv_gather=1)
                    layout[slot] = s
                    try:
                        _build(**layout, sp_degree=None, num_heads=num_heads,
                               attention_supports_lse=attention_supports_lse, tp_features=tp_features)  # fmt: skip
                    except ValueError:
                        continue
                    changed = [k for k in wanted if layout[k] != wanted[k]]
                    distance = sum(abs(math.log2(layout[k] / wanted[k])) for k in wanted)
                    # CFG parallelism is a property of the guidance used: changed last.
                    score = (gpus != num_gpus, dp != dp_size, c != cfg, len(changed), distance, -u)
                    found.append((score, layout))
    found.sort(key=lambda item: item[0])
    return [layout for _, layout in found[:limit]]
