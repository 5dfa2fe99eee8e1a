"""FLUX.1: text-to-image with packed 2×2 latents, distilled guidance and optional true CFG; image-to-image
from ``params.images[0]`` (as ``FluxImg2ImgPipeline``); and FLUX.1 Kontext folders (``FluxKontextPipeline``),
whose reference image's latent tokens follow the generated ones in the sequence, with their own ids."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, open_image, request_scheduler, to_uint8


class FluxRunner(PipelineRunner):
    default_guidance = 3.5
    cache_blocks = ("transformer_blocks", "single_transformer_blocks")
    cache_outputs = ("encoder_hidden_states", "hidden_states")

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
        if params.true_cfg_scale > 1 and params.negative_prompt is not None:
            neg_embeds, neg_pooled, _ = self._encode(params.negative_prompt, params.n)
            out["uncond"] = {"encoder_hidden_states": neg_embeds, "pooled_projections": neg_pooled}
        if params.images:
            if self.kontext:
                out["reference"] = self._encode_reference(open_image(params.images[0]))
            else:
                out |= self._encode_init_image(params)
        return out

    def _vae_latents(self, image: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Pixels in [-1, 1] → scaled, shifted VAE latents: a sample drawn with ``generator`` (img2img), or
        the mode without one (Kontext's reference)."""
        vae = self.pipe.vae
        image = image.to(self.device, vae.dtype)
        mode = "sample" if generator is not None else "argmax"
        latents = retrieve_latents(vae.encode(image), generator=generator, sample_mode=mode)
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def _encode_init_image(self, params: GenerationParams) -> dict:
        """Image-to-image as ``FluxImg2ImgPipeline``: the image resized to the requested size, VAE-encoded
        with a sample from the request's generator, which then draws the noise (in ``prepare``, from the
        generator state returned here)."""
        pipe = self.pipe
        image = pipe.image_processor.preprocess(
            open_image(params.images[0]), height=params.height, width=params.width
        ).to(torch.float32)
        generator = torch.Generator("cpu").manual_seed(params.seed)
        latents = self._vae_latents(image, generator).to(self.dtype)
        _, channels, height, width = latents.shape
        packed = pipe._pack_latents(latents, 1, channels, height, width)
        return {"init_latents": packed, "generator_state": generator.get_state()}

    def _encode_reference(self, image) -> dict:
        """Kontext's reference as ``FluxKontextPipeline`` prepares it: resized to the preferred Kontext
        resolution nearest its aspect ratio, VAE-encoded (the mode), packed; ids with first coordinate 1."""
        pipe = self.pipe
        multiple = pipe.vae_scale_factor * 2
        height, width = pipe.image_processor.get_default_height_width(image)
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        width, height = width // multiple * multiple, height // multiple * multiple
        image = pipe.image_processor.resize(image, height, width)
        pixels = pipe.image_processor.preprocess(image, height, width)
        latents = self._vae_latents(pixels, None).to(self.dtype)
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
        guidance_value = params.guidance_scale if params.guidance_scale is not None else self.default_guidance
        if pipe.transformer.config.guidance_embeds:
            guidance = torch.full((n,), guidance_value, device=self.device, dtype=torch.float32)
            cond["guidance"] = guidance
            if uncond is not None:
                uncond = {**uncond, "guidance": guidance}
        # Latents from a CPU generator: the same seed gives the same noise on every device and rank. After an
        # image-to-image encode, the generator goes on from where the VAE sample left it (as diffusers').
        generator = torch.Generator("cpu").manual_seed(params.seed)
        if "generator_state" in encoded:
            generator.set_state(encoded["generator_state"].cpu())
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
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        mu = calculate_shift(
            latents.shape[1],
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        start = 0
        init = encoded.get("init_latents")
        if init is None and params.init_latents is not None:
            init = torch.from_numpy(params.init_latents)
        if init is not None:
            # img2img (diffusers' FluxImg2ImgPipeline): skip the first (1 - strength) of the schedule and
            # noise the given latents to the first remaining timestep.
            init = init.to(self.device, self.dtype)
            if init.shape[0] == 1 and n > 1:  # one uploaded image for n outputs
                init = init.repeat(n, 1, 1)
            if init.shape != latents.shape:
                raise ValueError(f"init_latents: shape {tuple(init.shape)} != {tuple(latents.shape)}")
            if not hasattr(scheduler, "scale_noise"):
                raise ValueError(
                    f"init_latents: image-to-image needs a flow-matching scheduler, not {type(scheduler).__name__}"
                )
            start = int(max(steps - min(steps * params.strength, steps), 0))
            # At least one step runs; × order as diffusers' get_timesteps (1 for Euler).
            start = min(start, steps - 1) * scheduler.order
            scheduler.set_begin_index(start)
            latents = scheduler.scale_noise(init, timesteps[start : start + 1].repeat(n), latents)
        else:
            scheduler.set_begin_index(0)
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
            extra={"shared": {"txt_ids": text_ids, "img_ids": image_ids}},
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
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
        return to_uint8(pipe.image_processor.postprocess(image, output_type="np"))
