"""FLUX.1: text-to-image with packed 2×2 latents, distilled guidance and optional true CFG; image-to-image
from ``params.images[0]`` (as ``FluxImg2ImgPipeline``), inpainting with ``params.mask`` (as
``FluxInpaintPipeline``); and FLUX.1 Kontext folders (``FluxKontextPipeline``),
whose reference image's latent tokens follow the generated ones in the sequence, with their own ids; with a
mask, the reference is also the start image (``FluxKontextInpaintPipeline``)."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, open_image, request_scheduler, true_cfg_branch
from .img2img import (
    encode_start,
    inpainting,
    latent_mask,
    noised_start,
    request_generator,
    scaled_vae_latents,
    start_pixels,
)
from .schedule import flow_sigmas, image_seq_shift
from .vae import decode_images, unscale_latents


class FluxRunner(PipelineRunner):
    default_guidance = 3.5
    # FluxImg2ImgPipeline's and FluxInpaintPipeline's default guidance_scale (FluxPipeline's and Kontext's: 3.5)
    img2img_guidance = 7.0
    cache_blocks = ("transformer_blocks", "single_transformer_blocks")
    cache_outputs = ("encoder_hidden_states", "hidden_states")
    prompt_tokenizer = "tokenizer_2"  # T5's sequence; CLIP gives only the pooled vector

    @property
    def kontext(self) -> bool:
        """A FLUX.1 Kontext folder: the uploaded image is a reference, not a start image."""
        return type(self.pipe).__name__ == "FluxKontextPipeline"

    def _encode(self, prompt: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        max_len = min(self.max_sequence_length, self.pipe.tokenizer_2.model_max_length)
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=n,
            max_sequence_length=max_len,
        )
        return embeds.to(self.dtype), pooled.to(self.dtype), text_ids

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        embeds, pooled, text_ids = self._encode(params.prompt, params.n)
        out = {"cond": {"encoder_hidden_states": embeds, "pooled_projections": pooled}, "text_ids": text_ids}
        if true_cfg_branch(params):
            neg_embeds, neg_pooled, _ = self._encode(params.negative_prompt, params.n)
            out["uncond"] = {"encoder_hidden_states": neg_embeds, "pooled_projections": neg_pooled}
        if params.images:
            if self.kontext and params.mask is not None:
                out |= self._encode_masked_reference(params)
            elif self.kontext:
                out["reference"] = self._encode_reference(open_image(params.images[0]))
            else:
                out |= self._encode_init_image(params)
        return out

    def _packed_mask(self, params: GenerationParams, channels: int) -> torch.Tensor:
        """``params.mask`` at the latents' size, one copy per latent channel, packed as the latents."""
        pipe = self.pipe
        lat_h, lat_w = (
            2 * (params.height // (pipe.vae_scale_factor * 2)),
            2 * (params.width // (pipe.vae_scale_factor * 2)),
        )
        mask = latent_mask(params, lat_h, lat_w).repeat(1, channels, 1, 1)
        return pipe._pack_latents(mask, 1, channels, lat_h, lat_w)

    def _encode_init_image(self, params: GenerationParams) -> dict:
        """Image-to-image as ``FluxImg2ImgPipeline``: the image at the requested size, VAE-encoded with a
        sample from the request's generator, packed (the noise is drawn in ``prepare``)."""
        pipe = self.pipe

        def packed(generator: torch.Generator) -> torch.Tensor:
            latents = scaled_vae_latents(pipe.vae, start_pixels(pipe, params), generator).to(self.dtype)
            _, channels, height, width = latents.shape
            return pipe._pack_latents(latents, 1, channels, height, width)

        out = encode_start(params, packed)
        if params.mask is not None:
            out["mask"] = self._packed_mask(params, out["init_latents"].shape[2] // 4)
        return out

    def _encode_masked_reference(self, params: GenerationParams) -> dict:
        """A Kontext edit with a mask, as ``FluxKontextInpaintPipeline``: the image at the output size,
        VAE-encoded (the mode, so the noise's generator is untouched), packed, is both the reference (its
        tokens after the generated ones, ids with first coordinate 1) and the start latents the mask keeps."""
        pipe = self.pipe
        latents = scaled_vae_latents(pipe.vae, start_pixels(pipe, params), None).to(self.dtype)
        _, channels, lat_h, lat_w = latents.shape
        packed = pipe._pack_latents(latents, 1, channels, lat_h, lat_w)
        ids = pipe._prepare_latent_image_ids(1, lat_h // 2, lat_w // 2, self.device, self.dtype)
        ids[..., 0] = 1
        return {
            "reference": {"latents": packed, "ids": ids},
            "init_latents": packed,
            "mask": self._packed_mask(params, channels),
        }

    def _encode_reference(self, image) -> dict:
        """Kontext's reference as ``FluxKontextPipeline`` prepares it: resized to the preferred Kontext
        resolution nearest its aspect ratio, VAE-encoded (the mode), packed; ids with first coordinate 1."""
        pipe = self.pipe
        multiple = pipe.vae_scale_factor * 2
        if min(image.size) < multiple:  # diffusers rounds its sides down to the multiple: nothing is left
            raise ValueError(
                f"image: the reference is {image.width}x{image.height}; FLUX.1 Kontext takes references of at "
                f"least {multiple} pixels a side"
            )
        height, width = pipe.image_processor.get_default_height_width(image)
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        width, height = width // multiple * multiple, height // multiple * multiple
        image = pipe.image_processor.resize(image, height, width)
        pixels = pipe.image_processor.preprocess(image, height, width)
        latents = scaled_vae_latents(pipe.vae, pixels, None).to(self.dtype)
        _, channels, lat_h, lat_w = latents.shape
        packed = pipe._pack_latents(latents, 1, channels, lat_h, lat_w)
        ids = pipe._prepare_latent_image_ids(1, lat_h // 2, lat_w // 2, self.device, self.dtype)
        ids[..., 0] = 1
        return {"latents": packed, "ids": ids}

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        pipe, n = self.pipe, params.n
        text_ids = encoded["text_ids"]
        cond, uncond = dict(encoded["cond"]), encoded.get("uncond")
        default = self.img2img_guidance if params.images and not self.kontext else self.default_guidance
        guidance_value = params.guidance_scale if params.guidance_scale is not None else default
        if pipe.transformer.config.guidance_embeds:
            guidance = torch.full((n,), guidance_value, device=self.device, dtype=torch.float32)
            cond["guidance"] = guidance
            if uncond is not None:
                uncond = {**uncond, "guidance": guidance}
        # Latents from the request's CPU generator (after an image-to-image encode, from where the VAE
        # sample left it, as diffusers').
        generator = request_generator(params, encoded)
        latent_args = (n, pipe.transformer.config.in_channels // 4, params.height, params.width)
        if self.kontext:
            latents, _, image_ids, _ = pipe.prepare_latents(
                None, *latent_args, self.dtype, self.device, generator
            )
        else:
            latents, image_ids = pipe.prepare_latents(*latent_args, self.dtype, self.device, generator)
        reference = encoded.get("reference")
        if reference is not None:
            # Kontext: the reference tokens follow the generated ones (a per-row input), their ids too.
            cond["reference_latents"] = reference["latents"].to(self.device, self.dtype).repeat(n, 1, 1)
            if uncond is not None:
                uncond = {**uncond, "reference_latents": cond["reference_latents"]}
            image_ids = torch.cat([image_ids, reference["ids"].to(self.device, image_ids.dtype)])
        scheduler = request_scheduler(pipe)  # timesteps below as FluxPipeline sets them
        steps = params.num_inference_steps
        sigmas = None if getattr(scheduler.config, "use_flow_sigmas", False) else flow_sigmas(steps)
        mu = image_seq_shift(scheduler, latents.shape[1])
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        # img2img (FluxImg2ImgPipeline): the start latents noised to strength's first timestep.
        inpaint = inpainting(params, encoded, latents)  # FluxInpaintPipeline: the masked start's blend
        latents, start = noised_start(scheduler, timesteps, latents, params, encoded)
        # Rows of one forward share the sequence: Kontext requests batch only with the same reference length.
        num_reference = 0 if reference is None else reference["latents"].shape[1]
        bucket = ("flux", params.height, params.width, 1, num_reference)
        return RequestState(
            req_id=req_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            cond=cond,
            uncond=uncond,
            cfg_scale=params.true_cfg_scale,
            bucket=bucket,
            step_index=start,
            extra={"shared": {"txt_ids": text_ids, "img_ids": image_ids}, **inpaint},
        )

    def model_forward(self, latents, timesteps, inputs, shared):
        hidden = latents
        if "reference_latents" in inputs:
            hidden = torch.cat([latents, inputs["reference_latents"]], dim=1)
        pred = self.pipe.transformer(
            hidden_states=hidden,
            timestep=timesteps / 1000,
            guidance=inputs.get("guidance"),
            pooled_projections=inputs["pooled_projections"],
            encoder_hidden_states=inputs["encoder_hidden_states"],
            txt_ids=shared["txt_ids"],
            img_ids=shared["img_ids"],
            return_dict=False,
        )[0]
        return pred[:, : latents.shape[1]]  # the reference tokens' predictions are not used

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        pipe, p = self.pipe, state.params
        latents = pipe._unpack_latents(state.latents, p.height, p.width, pipe.vae_scale_factor)
        return decode_images(pipe, unscale_latents(pipe.vae, latents))

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        pipe, p = self.pipe, state.params
        return pipe._unpack_latents(state.latents[:1], p.height, p.width, pipe.vae_scale_factor)[0]
