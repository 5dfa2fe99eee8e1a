"""Step caching per request inside a shared forward: ``settings`` (what a request asks, torch-free),
``state`` (what its cache keeps), ``blocks`` (the forward that skips blocks for the rows that hit)."""

from .settings import CachePolicy, CacheSettings

__all__ = ["CachePolicy", "CacheSettings"]
