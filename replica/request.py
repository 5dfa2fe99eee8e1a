"""What the engine is asked to do, and what it answers. Validated at the ingress; the engine re-checks
only what depends on the model (shape multiples, limits)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .caching.settings import CacheSettings


class LoRARef(BaseModel):
    """One adapter applied to a request: a loaded adapter's name and its strength."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, description="Name of a loaded LoRA adapter.")
    scale: float | None = Field(
        strict=True,
        default=None,
        ge=-10.0,
        le=10.0,
        description="The adapter's strength for this request (1.0: as trained, 0: off). Absent: the scale it "
        "was loaded with (POST /v1/loras `scale`, --lora-path NAME=PATH:SCALE; default 1.0).",
    )


class GenerationParams(BaseModel):
    """One generation request as the engine sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    prompt: str = Field(min_length=1)
    negative_prompt: str | None = None
    width: int = Field(default=64, ge=16)
    height: int = Field(default=64, ge=16)
    num_frames: int = Field(default=1, ge=1, description="Video frames (video models only).")
    num_inference_steps: int = Field(default=20, ge=1)
    # Guidance bounds are the API's (0..100, finite), so that every caller (generate too) is refused alike.
    guidance_scale: float | None = Field(
        default=None,
        ge=0,
        le=100,
        allow_inf_nan=False,
        description="The pipeline's guidance_scale: distilled guidance (FLUX.1, FLUX.2 dev), else the CFG scale "
        "(SD3, Z-Image, FLUX.2 Klein, Wan, HunyuanVideo 1.5).",
    )
    guidance_scale_2: float | None = Field(
        default=None,
        ge=0,
        le=100,
        allow_inf_nan=False,
        description="Two-expert models (Wan 2.2 A14B): the low-noise expert's CFG scale (None: guidance_scale).",
    )
    true_cfg_scale: float = Field(
        default=1.0,
        ge=0.0,
        le=100,
        allow_inf_nan=False,
        description="True CFG (FLUX.1, Qwen-Image) with a negative prompt when > 1.",
    )
    seed: int = Field(default_factory=lambda: secrets.randbits(31), ge=0, lt=2**63)
    n: int = Field(default=1, ge=1, description="Outputs per request.")
    lora: tuple[LoRARef, ...] = ()
    fps: int = Field(default=16, ge=1, le=120)
    # img2img / realtime sessions: start from these (packed) latents noised to ``strength``.
    init_latents: np.ndarray | None = Field(
        default=None, description="Latents to refine (as returned in GenerationResult.latents)."
    )
    strength: float = Field(
        default=1.0, gt=0.0, le=1.0, description="With init_latents: 1 = start from noise, small = keep."
    )
    # Reference images, encoded (PNG / JPEG / WebP bytes, as uploaded): the edit families' references
    # (POST /v1/images/edits), image-to-image's start image with ``strength`` for the other image families,
    # image-to-video's first frame (POST /v1/videos input_reference). Checked at the ingress (decodable,
    # size, count); resized by the family's own image processor as its diffusers pipeline does.
    images: tuple[bytes, ...] = Field(default=(), description="Reference images (encoded image files).")
    mask: bytes | None = Field(
        default=None, description="Inpainting mask (encoded image; white = repaint) where the family has one."
    )
    return_latents: bool = Field(default=False, description="Also return the final latents.")
    cache: CacheSettings | None = Field(
        default=None, description="Step cache of this request; None: the server's default (--cache-policy)."
    )


@dataclass
class GenerationResult:
    """Encoded outputs: PNG bytes per image, or one MP4 per video."""

    outputs: list[bytes]
    media_type: str  # "image/png" or "video/mp4"
    seed: int
    width: int
    height: int
    num_frames: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    latents: np.ndarray | None = None  # final latents when params.return_latents
    # transformer_forwards, cached_forwards (ints) and cache_policy: what the request cost
    usage: dict[str, Any] = field(default_factory=dict)
