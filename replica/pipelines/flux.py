"""Flux: text-to-image with packed 2×2 latents, distilled guidance and optional true CFG."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, request_scheduler, to_uint8


class FluxRunner(PipelineRunner):
    default_guidance = 3.5
    cache_blocks = ("transformer_blocks", "single_transformer_blocks")
    cache_outputs = ("encoder_hidden_states", "hidden_states")

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
        return out

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
        # Latents from a CPU generator: the same seed gives the same noise on every device and rank.
        generator = torch.Generator("cpu").manual_seed(params.seed)
        latents, image_ids = pipe.prepare_latents(
            n,
            pipe.transformer.config.in_channels // 4,
            params.height,
            params.width,
            self.dtype,
            self.device,
            generator,
        )
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
        if params.init_latents is not None:
            # img2img (diffusers' FluxImg2ImgPipeline): skip the first (1 - strength) of the schedule and
            # noise the given latents to the first remaining timestep.
            init = torch.from_numpy(params.init_latents).to(self.device, self.dtype)
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
        bucket = ("flux", params.height, params.width, 1)
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
        return self.pipe.transformer(
            hidden_states=latents,
            timestep=timesteps / 1000,
            guidance=inputs.get("guidance"),
            pooled_projections=inputs["pooled_projections"],
            encoder_hidden_states=inputs["encoder_hidden_states"],
            txt_ids=shared["txt_ids"],
            img_ids=shared["img_ids"],
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        pipe, p = self.pipe, state.params
        latents = pipe._unpack_latents(state.latents, p.height, p.width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
        return to_uint8(pipe.image_processor.postprocess(image, output_type="np"))
