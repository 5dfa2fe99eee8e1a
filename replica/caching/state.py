"""What a request's cache keeps between steps, and its decisions (the rules are in ``settings.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .settings import CacheSettings


@dataclass
class RequestCache:
    """One request's cache for one CFG branch (cond and uncond never share one)."""

    settings: CacheSettings
    head_residual: torch.Tensor | None = None  # fbcache: first block's residual at the last computed step
    tail_residuals: tuple[torch.Tensor, ...] | None = None  # per block output: last block minus first
    # taylorseer: per output, the residual's derivatives [f, f', f'', ...] at the last computed forward
    factors: list[list[torch.Tensor]] | None = None
    last_computed: int = -1  # forward index of the last computed forward
    forwards: int = 0
    cached: int = 0
    decisions: list[bool] = field(default_factory=list)  # True = cached, one per forward
    distances: list[float] = field(default_factory=list)  # fbcache: relative L1 per forward (inf: first)

    @property
    def measured(self) -> bool:
        """Whether the decision needs the first block's residual (reduced over the ranks of the rows)."""
        return self.settings.policy == "fbcache"

    def partial_sums(self, residual: torch.Tensor) -> torch.Tensor | None:
        """[sum|r - r_prev|, sum|r_prev|] over this rank's part of the rows (None when not measured or on
        the first step)."""
        if not self.measured or self.head_residual is None:
            return None
        prev = self.head_residual.float()
        return torch.stack([(residual.float() - prev).abs().sum(), prev.abs().sum()])

    def decide(self, sums: torch.Tensor | None) -> bool:
        """True when the remaining blocks can be skipped; ``sums`` (fbcache) reduced over every rank of
        the rows."""
        if self.settings.policy == "taylorseer":
            hit = self._scheduled_hit()
        else:
            distance = float("inf")
            if sums is not None and self.tail_residuals is not None:
                num, den = (float(v) for v in sums)
                distance = num / den if den > 0 else float("inf")
            hit = distance <= self.settings.value("threshold")
            self.distances.append(distance)
        self.forwards += 1
        self.cached += int(hit)
        self.decisions.append(hit)
        return hit

    def _scheduled_hit(self) -> bool:
        index, warmup = self.forwards, self.settings.value("warmup")
        if index < warmup or self.factors is None:
            return False
        return (index - warmup) % self.settings.value("interval") != 0

    def store(self, head_residual: torch.Tensor, tails: tuple[torch.Tensor, ...]) -> None:
        """After a computed forward: keep what the next decisions and reuses need."""
        index = self.forwards - 1
        if self.settings.policy == "taylorseer":
            order = self.settings.value("order")
            if self.factors is None:
                self.factors = [[t] for t in tails]
            else:
                gap = index - self.last_computed
                new = []
                for old, tail in zip(self.factors, tails, strict=True):
                    row = [tail]
                    for k in range(min(order, len(old))):
                        row.append((row[k] - old[k]) / gap)
                    new.append(row)
                self.factors = new
        else:
            self.head_residual = head_residual
            self.tail_residuals = tails
        self.last_computed = index

    def reuse(self) -> tuple[torch.Tensor, ...]:
        """For a hit: the remaining blocks' residual per output (kept, or forecast)."""
        if self.settings.policy != "taylorseer":
            assert self.tail_residuals is not None
            return self.tail_residuals
        assert self.factors is not None
        distance = (self.forwards - 1) - self.last_computed
        out = []
        for row in self.factors:
            value = row[0]
            for k in range(1, len(row)):
                value = value + row[k] * (distance**k / math.factorial(k))
            out.append(value)
        return tuple(out)
