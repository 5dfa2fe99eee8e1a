"""Timestep schedules the flow-matching families set up the way their diffusers pipelines do."""

from __future__ import annotations

import numpy as np
from diffusers.pipelines.flux.pipeline_flux import calculate_shift


def flow_sigmas(steps: int) -> np.ndarray:
    """The sigmas FLUX.1, FLUX.2 and Qwen-Image's pipelines pass: ``linspace(1, 1 / steps, steps)``."""
    return np.linspace(1.0, 1 / steps, steps)


def image_seq_shift(scheduler, image_seq_len: int, *, max_shift: float = 1.15) -> float:
    """The dynamic shift ``mu`` for ``image_seq_len`` image tokens, from the scheduler's config where it
    sets the bounds; ``max_shift`` is the pipeline's own default (SD3's 1.16, 1.15 elsewhere)."""
    config = scheduler.config
    return calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", max_shift),
    )
