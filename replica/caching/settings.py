"""What a request asks of the step cache.

Two policies with different mechanisms, each applied to one request's rows inside a shared forward (the
first transformer block always runs; the policy decides whether the *remaining* blocks run):

``fbcache`` (first-block residual, a measured decision): the relative L1 distance between this step's
first-block residual (output minus input, image stream) and the one of the request's last *computed*
step is ``mean|r - r_prev| / mean|r_prev|``. Above ``threshold`` the remaining blocks run and their
residual (last block's output minus first block's output, per stream) is kept; at or below it the kept
residual is added to the first block's output instead. The first step always computes. This is the rule
of diffusers' ``FirstBlockCache`` applied to one request's rows only.

``taylorseer`` (a forecast on a schedule): the first ``warmup`` forwards compute, then one forward in
every ``interval``; in between, the remaining blocks' residual is *predicted* by a Taylor expansion of
order ``order`` around the last computed forward, its derivatives estimated by finite differences of the
residuals of the last computed forwards (TaylorSeer, Liu et al. 2025, applied to the tail residual as a
whole). The schedule depends only on the forward count, so every rank decides the same with no metric.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..jsonfields import json_int

CachePolicy = Literal["none", "fbcache", "taylorseer"]

# Each setting belongs to one policy; a setting of another policy has no effect (the schema allows every
# field with every policy, so refusing it would refuse schema-valid requests).
POLICY_OF = {"threshold": "fbcache", "interval": "taylorseer", "warmup": "taylorseer", "order": "taylorseer"}
DEFAULTS = {"threshold": 0.1, "interval": 3, "warmup": 2, "order": 1}


class CacheSettings(BaseModel):
    """A request's step cache: ``{"policy": "fbcache", "threshold": 0.1}`` or
    ``{"policy": "taylorseer", "interval": 3, "warmup": 2, "order": 1}``."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    policy: CachePolicy = Field(
        default="none",
        description="Step cache: 'none' (every step runs every block), 'fbcache' (skip the blocks after the "
        "first when its residual changed by at most `threshold` since the request's last computed step) or "
        "'taylorseer' (compute one step in `interval` after `warmup`, forecast the others).",
    )
    threshold: float | None = Field(
        strict=True,  # a JSON true is not a threshold
        default=None,
        ge=0.0,
        le=10.0,
        description="fbcache: largest relative L1 change of the first block's residual that reuses the cache "
        "(default 0.1; 0 never reuses; diffusers uses 0.05 to 0.2).",
    )
    interval: json_int(ge=1, le=100) | None = Field(
        default=None,
        description="taylorseer: one forward in `interval` computes after the warmup (default 3; 1 never "
        "forecasts).",
    )
    warmup: json_int(ge=1, le=1000) | None = Field(
        default=None,
        description="taylorseer: forwards computed first (default 2).",
    )
    order: json_int(ge=0, le=2) | None = Field(
        default=None,
        description="taylorseer: Taylor order of the forecast (default 1).",
    )

    @model_validator(mode="before")
    @classmethod
    def _policy_of_the_settings(cls, data):
        """Settings without a policy name it: ``{"threshold": 0.3}`` is fbcache's (it meant no cache), and
        settings of both policies without one are refused, naming ``policy``."""
        if isinstance(data, dict) and data.get("policy") is None:
            policies = sorted({POLICY_OF[k] for k, v in data.items() if k in POLICY_OF and v is not None})
            if len(policies) > 1:
                raise ValueError(
                    "policy: give the policy; the settings given belong to both fbcache (threshold) and "
                    "taylorseer (interval, warmup, order)"
                )
            if policies:
                data = {**data, "policy": policies[0]}
        return data

    def with_defaults(self, default: CacheSettings | None) -> CacheSettings | None:
        """This request's cache against the server's (``--cache-policy`` and its settings, or the model's
        recommended one): ``{}`` (nothing given) is the server's; settings left out of the server's policy are
        the server's (``{"policy": "fbcache"}`` on ``--cache-threshold 0.2`` is 0.2), else the defaults."""
        if not self.model_fields_set:
            return default
        if default is None or default.policy != self.policy:
            return self
        fill = {k: getattr(default, k) for k in POLICY_OF if getattr(self, k) is None}
        fill = {k: v for k, v in fill.items() if v is not None}
        return self.model_copy(update=fill) if fill else self

    def value(self, name: str):
        """A setting, or its default when the request left it out."""
        given = getattr(self, name)
        return DEFAULTS[name] if given is None else given

    @property
    def enabled(self) -> bool:
        return self.policy != "none"
