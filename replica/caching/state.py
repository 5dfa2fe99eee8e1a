"""What a request's cache keeps between steps, and its decision (the rule is in ``settings.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .settings import CacheSettings


@dataclass
class RequestCache:
    """One request's cache for one CFG branch (cond and uncond never share one)."""

    settings: CacheSettings
    head_residual: torch.Tensor | None = None  # first block's residual at the last computed step
    tail_residuals: tuple[torch.Tensor, ...] | None = None  # per block output: last block minus first
    forwards: int = 0
    cached: int = 0
    decisions: list[bool] = field(default_factory=list)  # True = cached, one per forward
    distances: list[float] = field(default_factory=list)  # relative L1 per forward (inf: first step)

    def partial_sums(self, residual: torch.Tensor) -> torch.Tensor | None:
        """[sum|r - r_prev|, sum|r_prev|] over this rank's part of the rows (None on the first step)."""
        if self.head_residual is None:
            return None
        prev = self.head_residual.float()
        return torch.stack([(residual.float() - prev).abs().sum(), prev.abs().sum()])

    def decide(self, sums: torch.Tensor | None) -> bool:
        """True when the remaining blocks can be skipped; ``sums`` reduced over every rank of the rows."""
        distance = float("inf")
        if sums is not None and self.tail_residuals is not None:
            num, den = (float(v) for v in sums)
            distance = num / den if den > 0 else float("inf")
        hit = distance <= self.settings.threshold
        self.distances.append(distance)
        self.forwards += 1
        self.cached += int(hit)
        self.decisions.append(hit)
        return hit
