"""Image-to-image for the flow-matching image families, as diffusers' img2img pipelines do it
(``FluxImg2ImgPipeline``, ``StableDiffusion3Img2ImgPipeline``, ``ZImageImg2ImgPipeline``,
``QwenImageImg2ImgPipeline`` share this arithmetic):

1. the start image resized to the requested size and VAE-encoded with a *sample* drawn from the request's
   seeded CPU generator (``encode``, where the VAE is);
2. the same generator, continuing from there, draws the noise in the family's own latent preparation
   (``prepare``, on every rank: the generator's state travels with the encoded request);
3. the schedule is computed for all ``num_inference_steps``, its first ``1 - strength`` skipped, and the
   start latents are noised to the first remaining timestep (``scheduler.scale_noise``).

A realtime session's previous latents (``params.init_latents``) take the start image's place in step 3.

Inpainting (``params.mask``, as ``FluxInpaintPipeline`` / ``StableDiffusion3InpaintPipeline`` do it with a
transformer of the plain latent channels): the mask at the requested size, binarised, at the latents' size
(``latent_mask``); after every scheduler step the latents outside the mask are put back to the start
latents noised to the next timestep with the request's noise, the clean start latents after the last
(``keep_unmasked``, in ``base``: the step loop calls it, and this module imports ``base``).

Each family keeps its own parts: its VAE's normalisation, its latent layout (packed 2×2 or not), its
noise preparation; this module holds what they share.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from PIL import Image, ImageOps

from ..request import GenerationParams
from .base import open_image


def start_pixels(pipe, params: GenerationParams) -> torch.Tensor:
    """The uploaded start image (``params.images[0]``) as the img2img pipelines preprocess it: resized to
    the requested size, in [-1, 1], fp32, (1, 3, height, width)."""
    image = open_image(params.images[0])
    pixels = pipe.image_processor.preprocess(image, height=params.height, width=params.width)
    return pixels.to(torch.float32)


def mask_picture(data: bytes) -> Image.Image:
    """An uploaded mask as greyscale, 255 where the image is repainted. A mask with transparency is read as
    OpenAI's (its fully transparent pixels are repainted); one without (or fully opaque) as diffusers' (white
    repaints, black keeps)."""
    from ditserve.replica.media import to_rgb

    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        alpha = image.convert("RGBA").getchannel("A")
        if alpha.getextrema()[0] < 255:
            return alpha.point(lambda a: 255 if a == 0 else 0)
    return to_rgb(image).convert("L")


def latent_mask(params: GenerationParams, latent_height: int, latent_width: int) -> torch.Tensor:
    """``params.mask`` as the inpaint pipelines make it: resized to the requested size, binarised at 0.5,
    then (nearest) to the latents' height and width; (1, 1, latent_height, latent_width) in {0, 1}, fp32."""
    assert params.mask is not None
    processor = VaeImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    mask = processor.preprocess(mask_picture(params.mask), height=params.height, width=params.width)
    return torch.nn.functional.interpolate(mask.to(torch.float32), size=(latent_height, latent_width))


def scaled_vae_latents(vae, pixels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Pixels in [-1, 1] → an ``AutoencoderKL``'s shifted, scaled latents: a sample drawn with
    ``generator`` (image-to-image), or the distribution's mode without one (a reference image)."""
    mode = "sample" if generator is not None else "argmax"
    latents = retrieve_latents(
        vae.encode(pixels.to(vae.device, vae.dtype)), generator=generator, sample_mode=mode
    )
    return (latents - vae.config.shift_factor) * vae.config.scaling_factor


def encode_start(
    params: GenerationParams, encode: Callable[[torch.Generator], torch.Tensor]
) -> dict[str, Any]:
    """An image-to-image request's part of ``encode``'s result: the start latents ``encode(generator)``
    draws from the request's seeded CPU generator, and that generator's state afterwards (the noise goes on
    from there, as in diffusers, where one generator serves both)."""
    generator = torch.Generator("cpu").manual_seed(params.seed)
    latents = encode(generator)
    return {"init_latents": latents, "generator_state": generator.get_state()}


def request_generator(params: GenerationParams, encoded: dict[str, Any]) -> torch.Generator:
    """The CPU generator that draws the request's noise: seeded with ``params.seed``, or, after a start
    image's VAE sample, where that sample left it. A CPU generator gives the same noise on every device and
    rank."""
    generator = torch.Generator("cpu").manual_seed(params.seed)
    if "generator_state" in encoded:
        generator.set_state(encoded["generator_state"].cpu())
    return generator


def start_latents(params: GenerationParams, encoded: dict[str, Any]) -> torch.Tensor | None:
    """The latents an image-to-image request starts from (its uploaded image's, or a session's previous
    ones); None for text-to-image."""
    init = encoded.get("init_latents")
    if init is None and params.init_latents is not None:
        init = torch.from_numpy(params.init_latents)
    return init


def first_step(steps: int, strength: float, order: int = 1) -> int:
    """The index of the first timestep image-to-image runs: diffusers' ``get_timesteps`` (the first
    ``1 - strength`` of the schedule skipped), keeping at least one step where diffusers would run none."""
    start = int(max(steps - min(steps * strength, steps), 0))
    return min(start, steps - 1) * order


def inpainting(params: GenerationParams, encoded: dict[str, Any], noise: torch.Tensor) -> dict[str, Any]:
    """A masked request's part of its state's ``extra`` (``{}`` otherwise): the start latents (one per
    output), the noise they are noised with, and ``encoded["mask"]`` (the family's latent layout, 1 where
    the model paints), all in ``noise``'s layout, device and dtype. Call with the noise before
    ``noised_start``."""
    mask = encoded.get("mask")
    if mask is None:
        return {}
    init = encoded["init_latents"].to(noise.device, noise.dtype)
    n = noise.shape[0]
    init = init.repeat(n // init.shape[0], *([1] * (init.dim() - 1)))
    mask = mask.to(noise.device, noise.dtype)
    return {"inpaint": {"init": init, "noise": noise, "mask": mask}}


def noised_start(
    scheduler, timesteps: torch.Tensor, noise: torch.Tensor, params: GenerationParams, encoded: dict[str, Any]
) -> tuple[torch.Tensor, int]:
    """The request's first latents and step index. Text-to-image: ``noise`` from the first step. Image-to-
    image: the start latents (one for the ``n`` outputs, or one each) noised to the first timestep that
    ``params.strength`` keeps, ``scheduler`` set to begin there. ``noise`` is in the family's latent layout;
    the start latents must be in the same."""
    init = start_latents(params, encoded)
    if init is None:
        scheduler.set_begin_index(0)
        return noise, 0
    init = init.to(noise.device, noise.dtype)
    n = noise.shape[0]
    if init.shape[0] == 1 and n > 1:  # one uploaded image for n outputs
        init = init.repeat(n, *([1] * (init.dim() - 1)))
    if init.shape != noise.shape:
        raise ValueError(f"init_latents: shape {tuple(init.shape)} != {tuple(noise.shape)}")
    if not hasattr(scheduler, "scale_noise"):
        raise ValueError(
            f"init_latents: image-to-image needs a flow-matching scheduler, not {type(scheduler).__name__}"
        )
    start = first_step(params.num_inference_steps, params.strength, scheduler.order)
    scheduler.set_begin_index(start)
    return scheduler.scale_noise(init, timesteps[start : start + 1].repeat(n), noise), start
