"""Stable Diffusion 3 / 3.5: text-to-image with classifier-free guidance (an uncond branch whenever
guidance_scale > 1, as StableDiffusion3Pipeline decides, run in one forward with the cond rows),
FlowMatchEuler with the scheduler's shift; image-to-image from ``params.images[0]`` and ``strength``
(``StableDiffusion3Img2ImgPipeline``'s arithmetic)."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, request_scheduler
from .img2img import (
    encode_start,
    inpainting,
    latent_mask,
    noised_start,
    request_generator,
    scaled_vae_latents,
    start_pixels,
)
from .schedule import image_seq_shift
from .vae import decode_images, unscale_latents


class SD3Runner(PipelineRunner):
    default_guidance = 7.0  # StableDiffusion3Pipeline's default guidance_scale
    # T5 tokens per prompt: the pipeline's default (SD3 was trained with 256) unless --max-sequence-length
    # says otherwise, up to the pipeline's limit, 512.
    text_length = 256
    most_text_length = 512
    cache_blocks = ("transformer_blocks",)
    cache_outputs = ("encoder_hidden_states", "hidden_states")
    # StableDiffusion3Pipeline runs the uncond and cond rows as one batch: so do we (one launch of each
    # kernel per step, and the pipeline's GEMM shapes, hence its bf16 numbers).
    batch_cfg = True
    prompt_tokenizer = "tokenizer_3"  # T5's (CLIP's when the folder has no T5)

    def text_token_limit(self) -> int:
        given = self.max_sequence_length_given
        return self.text_length if given is None else min(given, self.most_text_length)

    def _guidance(self, params: GenerationParams) -> float:
        return params.guidance_scale if params.guidance_scale is not None else self.default_guidance

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        do_cfg = self._guidance(params) > 1.0
        embeds, neg_embeds, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=params.prompt,
            prompt_2=None,
            prompt_3=None,
            negative_prompt=params.negative_prompt,
            do_classifier_free_guidance=do_cfg,
            num_images_per_prompt=params.n,
            max_sequence_length=self.text_token_limit(),
            device=self.device,
        )
        out = {
            "cond": {
                "encoder_hidden_states": embeds.to(self.dtype),
                "pooled_projections": pooled.to(self.dtype),
            }
        }
        if do_cfg:
            out["uncond"] = {
                "encoder_hidden_states": neg_embeds.to(self.dtype),
                "pooled_projections": neg_pooled.to(self.dtype),
            }
        if params.images:  # image-to-image: the start image's latents, sampled with the request's generator
            vae = self.pipe.vae
            out |= encode_start(
                params, lambda g: scaled_vae_latents(vae, start_pixels(self.pipe, params), g).to(self.dtype)
            )
            if params.mask is not None:  # StableDiffusion3InpaintPipeline's mask, at the latents' size
                factor = self.pipe.vae_scale_factor
                out["mask"] = latent_mask(params, params.height // factor, params.width // factor)
        return out

    def _check_size(self, params: GenerationParams) -> None:
        """PatchEmbed crops a learned position table: larger latents have no positions (checked here, per
        request, rather than failing the batch's forward)."""
        config = self.pipe.transformer.config
        largest = config.pos_embed_max_size
        if largest is None:
            return
        px = largest * config.patch_size * self.pipe.vae_scale_factor
        if params.height > px or params.width > px:
            raise ValueError(f"size: {params.width}x{params.height} is above this model's largest side {px}")

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        pipe, n = self.pipe, params.n
        self._check_size(params)
        # Noise from the request's CPU generator in the model's dtype, as the pipelines draw it.
        generator = request_generator(params, encoded)
        latents = pipe.prepare_latents(
            n,
            pipe.transformer.config.in_channels,
            params.height,
            params.width,
            self.dtype,
            self.device,
            generator,
        )
        scheduler = request_scheduler(pipe)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", None):
            patch = pipe.transformer.config.patch_size
            seq_len = (latents.shape[2] // patch) * (latents.shape[3] // patch)
            # the SD3 pipeline's default bound, not Flux's 1.15
            kwargs["mu"] = image_seq_shift(scheduler, seq_len, max_shift=1.16)
        timesteps, _ = retrieve_timesteps(scheduler, params.num_inference_steps, self.device, **kwargs)
        # Image-to-image (StableDiffusion3Img2ImgPipeline): the start latents noised to strength's timestep.
        inpaint = inpainting(params, encoded, latents)
        latents, start = noised_start(scheduler, timesteps, latents, params, encoded)
        return RequestState(
            req_id=req_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            cond=encoded["cond"],
            uncond=encoded.get("uncond"),
            cfg_scale=self._guidance(params),
            bucket=("sd3", params.height, params.width, 1),
            step_index=start,
            extra={"shared": {}, **inpaint},
        )

    def timestep_rows(self, state: RequestState) -> torch.Tensor:
        # fp32 timesteps as the pipeline passes them (bf16 would round 1000-scale timesteps)
        return state.timesteps[state.step_index].expand(state.rows)

    def model_forward(self, latents, timesteps, inputs, shared):
        return self.pipe.transformer(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=inputs["encoder_hidden_states"],
            pooled_projections=inputs["pooled_projections"],
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        return decode_images(self.pipe, unscale_latents(self.pipe.vae, state.latents))
