"""FLUX.2: text-to-image and multi-reference editing with packed latents (the VAE's 2×2 patches as
channels, batch-norm normalised), 4-axis rotary ids and Flux2Transformer2DModel.

Two pipelines, one step loop:

- ``Flux2Pipeline`` (FLUX.2 dev): Mistral3 text encoder, distilled guidance as an embedding (one branch).
- ``Flux2KleinPipeline``: Qwen3 text encoder, no guidance embedding; true classifier-free guidance with
  the empty prompt as negative when ``guidance_scale > 1`` and the folder is not step-distilled
  (``is_distilled``), no user negative prompt. With a ``mask`` it draws what ``Flux2KleinInpaintPipeline``
  draws: the first image is both the start image (noised to ``strength``, the unmasked latents put back
  after every step) and the first reference, a second image is its ``image_reference``.

Reference images (``GenerationParams.images``) are encoded by the VAE in ``encode`` (on the encoder rank)
and their packed tokens are appended after the image tokens every step, with their own ids (time
coordinate 10, 20, …), as the diffusers pipelines do; the prediction keeps the image tokens only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, open_image, request_scheduler
from .img2img import inpainting, mask_picture, noised_start
from .schedule import flow_sigmas
from .vae import decode_images

# Reference images above this area are resized down to it first (both pipelines' rule).
MAX_REFERENCE_AREA = 1024 * 1024


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a build that does not match torch fails with several types
        return False
    return True


class TextProcessor:
    """What Flux2Pipeline asks of its ``PixtralProcessor`` (the folder's ``tokenizer``): the chat template
    applied to text-only conversations (system message + prompt), done as transformers' processors do it:
    render, then tokenize, adding special tokens only when the rendered text does not start with BOS.

    transformers builds PixtralProcessor only with torchvision; this needs its tokenizer alone."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(
        self,
        conversations,
        *,
        tokenize: bool = True,
        return_dict: bool = False,
        return_tensors: str | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ):
        text = self.tokenizer.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not tokenize:
            return text
        first = text[0] if isinstance(text, list) else text
        bos = self.tokenizer.bos_token
        out = self.tokenizer(
            text,
            add_special_tokens=not (bos is not None and first.startswith(bos)),
            return_tensors=return_tensors,
            **kwargs,
        )
        return out if return_dict else out["input_ids"]


def text_processor(folder: Path) -> TextProcessor:
    """A processor folder's tokenizer (and its chat template) as a :class:`TextProcessor`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:  # a processor may keep it in chat_template.json only
        saved = folder / "chat_template.json"
        if saved.is_file():
            tokenizer.chat_template = json.loads(saved.read_text())["chat_template"]
    return TextProcessor(tokenizer)


class Flux2Runner(PipelineRunner):
    """``Flux2Pipeline`` (FLUX.2 dev)."""

    default_guidance = 4.0
    # Double blocks carry (text, image) streams and single blocks one joined stream, so one cached run
    # spans the single blocks only: the first single block decides, the others (47 of 56 blocks in
    # FLUX.2 dev) are skipped on a hit.
    cache_blocks = ("single_transformer_blocks",)
    cache_outputs = ("hidden_states",)

    def __init__(self, pipe, **kwargs: Any) -> None:
        super().__init__(pipe, **kwargs)
        if pipe.tokenizer is None:  # left out by pipeline_components: the processor's tokenizer instead
            pipe.tokenizer = text_processor(Path(pipe.config._name_or_path) / "tokenizer")

    @classmethod
    def pipeline_components(cls, folder: Path) -> dict[str, Any]:
        """FLUX.2 dev's tokenizer is a PixtralProcessor, which transformers builds only with torchvision
        (and diffusers refuses any other object in its place): without torchvision it is not loaded, and
        ``__init__`` puts its tokenizer in a :class:`TextProcessor` there (the pipeline never gives the
        processor images)."""
        entry = json.loads((Path(folder) / "model_index.json").read_text()).get("tokenizer")
        if isinstance(entry, list) and entry[-1] == "PixtralProcessor" and not _torchvision_loads():
            return {"tokenizer": None}
        return {}

    def text_token_limit(self) -> int:
        tokenizer = getattr(self.pipe.tokenizer, "tokenizer", self.pipe.tokenizer)  # a processor holds one
        return min(self.max_sequence_length, self.pipe.tokenizer_max_length, tokenizer.model_max_length)

    def _encode_prompt(self, prompt: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, text_ids = self.pipe.encode_prompt(
            prompt=prompt,
            device=self.device,
            num_images_per_prompt=n,
            max_sequence_length=self.text_token_limit(),
        )
        return embeds.to(self.dtype), text_ids

    def _check(self, params: GenerationParams) -> None:
        if params.negative_prompt is not None or params.true_cfg_scale > 1:
            raise ValueError(
                f"negative_prompt: {type(self.pipe).__name__} takes no negative prompt or true_cfg_scale "
                "(FLUX.2 dev's guidance is distilled: set guidance_scale)"
            )

    def _reference_pixels(self, data: bytes, i: int) -> torch.Tensor:
        """Reference ``i`` (0-based) as the pipelines preprocess it: at most 1024² pixels, its sides floored
        to the size multiple, center-cropped to them; in [-1, 1], (1, 3, height, width)."""
        pipe = self.pipe
        multiple = pipe.vae_scale_factor * 2
        try:
            img = open_image(data)  # as diffusers' load_image gives it: upright, RGB
        except (OSError, ValueError, PIL.Image.DecompressionBombError) as exc:
            raise ValueError(f"image: reference {i + 1} is not a readable image ({exc})") from None
        try:
            pipe.image_processor.check_image_input(img)  # at least 64 px a side, aspect up to 8:1
        except ValueError as exc:
            raise ValueError(f"image: reference {i + 1}: {exc}") from None
        width, height = img.size
        if width * height > MAX_REFERENCE_AREA:
            img = pipe.image_processor._resize_to_target_area(img, MAX_REFERENCE_AREA)
            width, height = img.size
        width, height = width // multiple * multiple, height // multiple * multiple
        return pipe.image_processor.preprocess(img, height=height, width=width, resize_mode="crop")

    def _references(self, params: GenerationParams) -> dict[str, torch.Tensor] | None:
        """The reference images' packed VAE latents [n, R, C], their ids [R, 4] (as the pipeline makes them)
        and their token grids [(h, w), ...]."""
        if not params.images:
            return None
        pipe = self.pipe
        multiple = pipe.vae_scale_factor * 2
        images = [self._reference_pixels(data, i) for i, data in enumerate(params.images)]
        sizes = [(image.shape[2] // multiple, image.shape[3] // multiple) for image in images]
        # VAE modes (no sampling): the generator is not drawn from.
        latents, ids = pipe.prepare_image_latents(
            images=images, batch_size=params.n, generator=None, device=self.device, dtype=pipe.vae.dtype
        )
        return {"latents": latents, "ids": ids[0], "sizes": sizes}

    def _image_inputs(self, params: GenerationParams) -> dict:
        """``encode``'s part from the uploaded images: the references."""
        return {"references": self._references(params)}

    def _guidance(self, params: GenerationParams) -> float:
        return params.guidance_scale if params.guidance_scale is not None else self.default_guidance

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        self._check(params)
        embeds, text_ids = self._encode_prompt(params.prompt, params.n)
        return {
            "cond": {"encoder_hidden_states": embeds},
            "text_ids": text_ids[0],
            **self._image_inputs(params),
        }

    def _branches(self, params: GenerationParams, encoded: dict) -> tuple[dict, dict | None, float]:
        """(cond inputs, uncond inputs or None, CFG scale) without the reference latents."""
        cond = dict(encoded["cond"])
        if self.pipe.transformer.config.guidance_embeds:
            cond["guidance"] = torch.full((params.n,), self._guidance(params), device=self.device)
        return cond, None, 1.0

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        pipe, n = self.pipe, params.n
        cond, uncond, cfg_scale = self._branches(params, encoded)
        # Latents from a CPU generator: the same seed gives the same noise on every device and rank.
        generator = torch.Generator("cpu").manual_seed(params.seed)
        latents, latent_ids = pipe.prepare_latents(
            batch_size=n,
            num_latents_channels=pipe.transformer.config.in_channels // 4,
            height=params.height,
            width=params.width,
            dtype=self.dtype,
            device=self.device,
            generator=generator,
        )
        image_ids = latent_ids[0]
        references = encoded.get("references")
        if references is not None:
            cond["image_latents"] = references["latents"]
            if uncond is not None:
                uncond["image_latents"] = references["latents"]
            image_ids = torch.cat([image_ids, references["ids"]])
        scheduler = request_scheduler(pipe)  # timesteps below as Flux2Pipeline sets them
        steps = params.num_inference_steps
        sigmas = None if getattr(scheduler.config, "use_flow_sigmas", False) else flow_sigmas(steps)
        mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=steps)
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        # A masked Klein edit (Flux2KleinInpaintPipeline): its start image noised to strength's first
        # timestep, the unmasked latents put back after every step; text and references begin at step 0.
        inpaint = inpainting(params, encoded, latents)
        if inpaint:
            latents, start = noised_start(scheduler, timesteps, latents, params, encoded)
        else:
            scheduler.set_begin_index(0)
            start = 0
        return RequestState(
            req_id=req_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            cond=cond,
            uncond=uncond,
            cfg_scale=cfg_scale,
            # rows share the ids: requests batch only with the same reference sizes (the ids follow from them)
            bucket=("flux2", params.height, params.width, tuple(references["sizes"]) if references else ()),
            step_index=start,
            extra={
                "shared": {"txt_ids": encoded["text_ids"], "img_ids": image_ids},
                "latent_ids": latent_ids,
                **inpaint,
            },
        )

    def model_forward(self, latents, timesteps, inputs, shared):
        hidden = latents
        if "image_latents" in inputs:
            hidden = torch.cat([latents, inputs["image_latents"].to(latents.dtype)], dim=1)
        out = self.pipe.transformer(
            hidden_states=hidden.to(self.dtype),
            timestep=timesteps / 1000,
            guidance=inputs.get("guidance"),
            encoder_hidden_states=inputs["encoder_hidden_states"],
            txt_ids=shared["txt_ids"],
            img_ids=shared["img_ids"],
            return_dict=False,
        )[0]
        return out[:, : latents.shape[1]]

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        pipe = self.pipe
        latents = pipe._unpack_latents_with_ids(state.latents, state.extra["latent_ids"])
        bn = pipe.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        return decode_images(pipe, pipe._unpatchify_latents(latents * std + mean))

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        pipe = self.pipe
        latents = pipe._unpack_latents_with_ids(state.latents[:1], state.extra["latent_ids"][:1])
        return pipe._unpatchify_latents(latents)[0]


class Flux2KleinRunner(Flux2Runner):
    """``Flux2KleinPipeline``: true CFG against the empty prompt (no user negative prompt); with a mask,
    ``Flux2KleinInpaintPipeline``."""

    # Flux2KleinInpaintPipeline's default guidance_scale (Flux2KleinPipeline's: 4.0)
    inpaint_guidance = 8.0

    def _guidance(self, params: GenerationParams) -> float:
        if params.guidance_scale is not None:
            return params.guidance_scale
        return self.inpaint_guidance if params.mask is not None else self.default_guidance

    def _image_inputs(self, params: GenerationParams) -> dict:
        if params.mask is None:
            return super()._image_inputs(params)
        return self._masked_inputs(params)

    def _masked_inputs(self, params: GenerationParams) -> dict:
        """A masked edit as ``Flux2KleinInpaintPipeline`` prepares it: the first image (brought down to 1024²
        pixels where it has more) at the output size, VAE-encoded (the mode: the noise's generator is
        untouched), batch-norm normalised and packed, is the start latents the mask keeps and the first
        reference (ids at time 10); a second image is the pipeline's ``image_reference`` (time 20), taken
        as any reference. The mask: binarised at the output size, then bilinear to the packed token grid
        (soft at its edges, as the pipeline leaves it), one value per token."""
        pipe = self.pipe
        if len(params.images) > 2:
            raise ValueError(
                f"image: a masked FLUX.2 Klein edit takes the image it inpaints and at most one reference "
                f"image (Flux2KleinInpaintPipeline's image_reference), not {len(params.images)} images"
            )
        try:
            image = open_image(params.images[0])
        except (OSError, ValueError, PIL.Image.DecompressionBombError) as exc:
            raise ValueError(f"image: the image is not a readable image ({exc})") from None
        width, height = image.size
        if width * height > MAX_REFERENCE_AREA:
            scale = math.sqrt(MAX_REFERENCE_AREA / (width * height))
            image = pipe.image_processor.resize(image, int(height * scale), int(width * scale))
        pixels = pipe.image_processor.preprocess(image, params.height, params.width)
        vae = pipe.vae
        start = pipe._encode_vae_image(pixels.to(vae.device, vae.dtype), generator=None)
        grids = [start]
        if len(params.images) == 2:
            reference = self._reference_pixels(params.images[1], 1)
            grids.append(pipe._encode_vae_image(reference.to(vae.device, vae.dtype), generator=None))
        packed = [pipe._pack_latents(grid) for grid in grids]
        ids = pipe._prepare_image_ids(grids)[0].to(self.device)
        references = torch.cat(packed, dim=1).to(self.device).repeat(params.n, 1, 1)
        processor = Flux2ImageProcessor(
            vae_scale_factor=pipe.vae_scale_factor * 2,
            vae_latent_channels=vae.config.latent_channels,
            do_normalize=False,
            do_binarize=True,
            do_convert_rgb=False,
            do_convert_grayscale=True,
        )
        mask = processor.preprocess(mask_picture(params.mask), height=params.height, width=params.width)
        mask = torch.nn.functional.interpolate(mask.float(), size=tuple(start.shape[2:]), mode="bilinear")
        return {
            "references": {
                "latents": references,
                "ids": ids,
                "sizes": [(grid.shape[2], grid.shape[3]) for grid in grids],
            },
            "init_latents": packed[0].to(self.dtype),
            "mask": pipe._pack_latents(mask),
        }

    def _check(self, params: GenerationParams) -> None:
        if params.negative_prompt is not None or params.true_cfg_scale > 1:
            raise ValueError(
                "negative_prompt: FLUX.2 Klein takes no negative prompt (its guidance runs against the empty "
                "prompt when guidance_scale > 1)"
            )

    def _cfg(self, params: GenerationParams) -> bool:
        return self._guidance(params) > 1 and not self.pipe.config.is_distilled

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        out = super().encode(params)
        if self._cfg(params):
            neg, _ = self._encode_prompt("", params.n)
            out["uncond"] = {"encoder_hidden_states": neg}
        return out

    def _branches(self, params: GenerationParams, encoded: dict) -> tuple[dict, dict | None, float]:
        cond = dict(encoded["cond"])
        if "uncond" not in encoded:
            return cond, None, 1.0
        return cond, dict(encoded["uncond"]), self._guidance(params)
