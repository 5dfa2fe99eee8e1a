"""VAE latents back to pixels, as the families' diffusers pipelines end."""

from __future__ import annotations

import numpy as np
import torch

from .base import to_uint8


def unscale_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """An ``AutoencoderKL``'s scaled, shifted latents back to its own (the inverse of encoding's
    ``(latents - shift_factor) * scaling_factor``)."""
    return latents / vae.config.scaling_factor + vae.config.shift_factor


def channel_normalization(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Wan-style VAE's per-channel latent mean and 1 / std (``latents_mean`` / ``latents_std``), shaped
    (1, z, 1, 1, 1) and typed like ``like``."""
    config = vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(like)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(like)
    return mean, inv_std


def decode_images(pipe, latents: torch.Tensor) -> np.ndarray:
    """uint8 images [n, H, W, 3] of the pipeline's image VAE for its unscaled ``latents``."""
    vae = pipe.vae
    image = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    return to_uint8(pipe.image_processor.postprocess(image, output_type="np"))


def decode_video(pipe, latents: torch.Tensor) -> np.ndarray:
    """uint8 videos [n, F, H, W, 3] of the pipeline's video VAE for its unnormalised ``latents``."""
    vae = pipe.vae
    video = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    return to_uint8(pipe.video_processor.postprocess_video(video, output_type="np"))
