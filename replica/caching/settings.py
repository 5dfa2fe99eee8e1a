"""What a request asks of the step cache, and what its cache keeps between steps.

``fbcache`` (first-block residual): after the first transformer block, the relative L1 distance between
this step's first-block residual (output minus input, image stream) and the one of the request's last
*computed* step is ``mean|r - r_prev| / mean|r_prev|``. Above ``threshold`` the remaining blocks run and
their residual (last block's output minus first block's output, per stream) is kept; at or below it the
kept residual is added to the first block's output instead. The first step always computes. This is the
rule of diffusers' ``FirstBlockCache`` applied to one request's rows only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CachePolicy = Literal["none", "fbcache"]


class CacheSettings(BaseModel):
    """A request's step cache: ``{"policy": "fbcache", "threshold": 0.1}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: CachePolicy = Field(
        default="none",
        description="Step cache: 'none' (every step runs every block) or 'fbcache' (skip the blocks after the "
        "first when its residual changed by at most `threshold` since the request's last computed step).",
    )
    threshold: float = Field(
        strict=True,  # a JSON true is not a threshold
        default=0.1,
        ge=0.0,
        le=10.0,
        description="fbcache: largest relative L1 change of the first block's residual that reuses the cache "
        "(0 never reuses; diffusers uses 0.05 to 0.2).",
    )

    @property
    def enabled(self) -> bool:
        return self.policy != "none"
