"""Wan: text-to-video with classifier-free guidance (an uncond branch whenever guidance > 1)."""

from __future__ import annotations

import numpy as np
import torch

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, request_scheduler, to_uint8


class WanRunner(PipelineRunner):
    cache_blocks = ("blocks",)
    default_guidance = 5.0

    def _guidance(self, params: GenerationParams) -> float:
        return params.guidance_scale if params.guidance_scale is not None else self.default_guidance

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        pipe = self.pipe
        do_cfg = self._guidance(params) > 1.0
        max_len = min(self.max_sequence_length, pipe.tokenizer.model_max_length)
        embeds, neg_embeds = pipe.encode_prompt(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            do_classifier_free_guidance=do_cfg,
            num_videos_per_prompt=params.n,
            max_sequence_length=max_len,
            device=self.device,
        )
        out = {"cond": {"encoder_hidden_states": embeds.to(self.dtype)}}
        if do_cfg:
            out["uncond"] = {"encoder_hidden_states": neg_embeds.to(self.dtype)}
        return out

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        pipe, n = self.pipe, params.n
        guidance = self._guidance(params)
        cond, uncond = encoded["cond"], encoded.get("uncond")
        scheduler = request_scheduler(pipe)  # Wan2.1's UniPC with its flow shift, set up as WanPipeline does
        scheduler.set_timesteps(params.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        generator = torch.Generator("cpu").manual_seed(params.seed)
        latents = pipe.prepare_latents(
            n,
            pipe.transformer.config.in_channels,
            params.height,
            params.width,
            params.num_frames,
            torch.float32,
            self.device,
            generator,
        )
        return RequestState(
            req_id=req_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            cond=cond,
            uncond=uncond,
            cfg_scale=guidance,
            bucket=("wan", params.height, params.width, params.num_frames),
            extra={"shared": {}},
        )

    def timestep_rows(self, state: RequestState) -> torch.Tensor:
        return state.timesteps[state.step_index].expand(state.rows)

    def model_forward(self, latents, timesteps, inputs, shared):
        return self.pipe.transformer(
            hidden_states=latents.to(self.dtype),
            timestep=timesteps,
            encoder_hidden_states=inputs["encoder_hidden_states"],
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        vae = self.pipe.vae
        latents = state.latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        return to_uint8(self.pipe.video_processor.postprocess_video(video, output_type="np"))
