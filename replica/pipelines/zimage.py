"""Z-Image: text-to-image from a Qwen3 caption of its own length per prompt, guidance as ZImagePipeline
does it (an uncond branch whenever guidance_scale > 0; ``cond + scale·(cond − uncond)``, optionally capped
in norm and switched off late in the schedule), FlowMatchEuler with the pipeline's sigmas and shift;
image-to-image from ``params.images[0]`` and ``strength`` (``ZImageImg2ImgPipeline``'s arithmetic, the start
image resized to the requested size)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas, retrieve_timesteps

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, request_scheduler
from .img2img import (
    encode_start,
    inpainting,
    latent_mask,
    noised_start,
    request_generator,
    scaled_vae_latents,
    start_latents,
    start_pixels,
)
from .schedule import image_seq_shift
from .vae import decode_images, unscale_latents


class ZImageRunner(PipelineRunner):
    cache_blocks = ("layers",)
    cache_outputs = ("x",)  # ZImageTransformerBlock takes and returns ``x``

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        # A forward turns each row's caption length into Python lists (the model pads per batch): a
        # captured graph would keep one batch's lengths for another with the same shapes.
        self.graphs = None
        # A caption takes rotary rows 1..its length padded to SEQ_MULTI_OF on the first axis, the image the row
        # after: a longer caption than the table holds failed the batch's forward with an IndexError. Prompts
        # are cut there as at max_sequence_length (Z-Image's 1536 rows hold the pipeline's 512 tokens; a
        # larger --max-sequence-length, or a folder with a shorter table, reaches the end).
        rows = int(pipe.transformer.config.axes_lens[0])
        self.max_sequence_length = min(self.max_sequence_length, (rows - 2) // SEQ_MULTI_OF * SEQ_MULTI_OF)
        # The pipeline's defaults, or the folder's recommendation (ditserve.json "sampling"): Z-Image-Turbo
        # is meant for guidance_scale 0.
        sampling = {}
        extra = Path(getattr(pipe, "name_or_path", "") or "") / "ditserve.json"
        if extra.is_file():
            sampling = json.loads(extra.read_text()).get("sampling", {})
        self.default_guidance = float(sampling.get("guidance_scale", 5.0))
        self.cfg_normalization = float(sampling.get("cfg_normalization", 0.0))
        self.cfg_truncation = float(sampling.get("cfg_truncation", 1.0))

    def _guidance(self, params: GenerationParams) -> float:
        return params.guidance_scale if params.guidance_scale is not None else self.default_guidance

    def _captions(self, embeds: list[torch.Tensor], n: int) -> dict[str, torch.Tensor]:
        (caption,) = embeds  # one prompt: (its own length, features)
        rows = caption.to(self.dtype).unsqueeze(0).expand(n, -1, -1).contiguous()
        return {"cap_feats": rows}  # each request's captions at their own length: concat_inputs reads it

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        do_cfg = self._guidance(params) > 0
        embeds, neg_embeds = self.pipe.encode_prompt(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            do_classifier_free_guidance=do_cfg,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        out = {"cond": self._captions(embeds, params.n)}
        if do_cfg:
            out["uncond"] = self._captions(neg_embeds, params.n)
        if params.images:  # image-to-image: the start image's latents, sampled with the request's generator
            vae = self.pipe.vae
            out |= encode_start(
                params, lambda g: scaled_vae_latents(vae, start_pixels(self.pipe, params), g).to(self.dtype)
            )
            if params.mask is not None:  # ZImageInpaintPipeline's mask, at the latents' size
                factor = self.pipe.vae_scale_factor * 2
                out["mask"] = latent_mask(params, 2 * (params.height // factor), 2 * (params.width // factor))
        return out

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        pipe, n = self.pipe, params.n
        generator = request_generator(params, encoded)
        # ZImagePipeline draws its noise in fp32, ZImageImg2ImgPipeline in the model's dtype.
        noise_dtype = torch.float32 if start_latents(params, encoded) is None else self.dtype
        latents = pipe.prepare_latents(
            n,
            pipe.transformer.in_channels,
            params.height,
            params.width,
            noise_dtype,
            self.device,
            generator,
        )
        scheduler = request_scheduler(pipe)
        mu = image_seq_shift(scheduler, (latents.shape[2] // 2) * (latents.shape[3] // 2))
        sigmas = get_default_z_image_sigmas(params.num_inference_steps)
        timesteps, _ = retrieve_timesteps(
            scheduler, params.num_inference_steps, self.device, sigmas=sigmas, mu=mu
        )
        # Image-to-image: the start latents noised to strength's timestep; the pipelines step in fp32.
        inpaint = inpainting(params, encoded, latents)
        latents, start = noised_start(scheduler, timesteps, latents, params, encoded)
        latents = latents.float()
        uncond = encoded.get("uncond")
        # CFG truncation: guidance off at the steps whose normalised time (1000 - t) / 1000 is past it.
        guided_steps = [uncond is not None] * len(timesteps)
        if uncond is not None and self.cfg_truncation <= 1:
            guided_steps = [t <= self.cfg_truncation for t in ((1000 - timesteps.float()) / 1000).tolist()]
        return RequestState(
            req_id=req_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            cond=encoded["cond"],
            uncond=uncond,
            cfg_scale=self._guidance(params),
            bucket=("zimage", params.height, params.width, 1),
            step_index=start,
            extra={"shared": {}, "guided_steps": guided_steps, **inpaint},
        )

    def concat_inputs(self, inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        # Captions of different lengths, padded to the longest; each row's own length travels beside it as
        # host ints (read from the shapes: a length on the device would make every forward wait for the GPU).
        longest = max(x["cap_feats"].shape[1] for x in inputs)
        feats = [F.pad(x["cap_feats"], (0, 0, 0, longest - x["cap_feats"].shape[1])) for x in inputs]
        lengths = tuple(x["cap_feats"].shape[1] for x in inputs for _ in range(x["cap_feats"].shape[0]))
        return {"cap_feats": torch.cat(feats), "cap_len": lengths}

    def needs_uncond(self, state: RequestState) -> bool:
        return state.uncond is not None and state.extra["guided_steps"][state.step_index]

    def guide(self, state: RequestState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """ZImagePipeline's CFG: ``cond + scale·(cond − uncond)``, each image's prediction scaled back to
        ``cfg_normalization`` × the cond prediction's norm when it is longer."""
        pred = cond + state.cfg_scale * (cond - uncond)
        if self.cfg_normalization > 0:
            rows = []
            for p, c in zip(pred, cond, strict=True):
                cap = torch.linalg.vector_norm(c) * self.cfg_normalization
                norm = torch.linalg.vector_norm(p)
                rows.append(p * (cap / norm) if norm > cap else p)
            pred = torch.stack(rows)
        return pred

    def model_forward(self, latents, timesteps, inputs, shared):
        images = list(latents.to(self.dtype).unsqueeze(2).unbind(0))  # (C, 1, H, W) per row
        lengths = inputs["cap_len"]
        captions = [feats[:length] for feats, length in zip(inputs["cap_feats"], lengths, strict=True)]
        # The caption embedder runs on every row's caption, each padded to SEQ_MULTI_OF, one after another:
        # its per-request adapters need each row's count (the LoRA layer reads it for this call)
        self.pipe.transformer.cap_embedder[-1].lora_row_tokens = tuple(
            n + (-n) % SEQ_MULTI_OF for n in lengths
        )
        out = self.pipe.transformer(images, (1000 - timesteps) / 1000, captions, return_dict=False)[0]
        # The pipeline steps with the negated fp32 prediction (negation commutes with its CFG arithmetic).
        return -torch.stack([o.float() for o in out]).squeeze(2)

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        vae = self.pipe.vae
        return decode_images(self.pipe, unscale_latents(vae, state.latents.to(vae.dtype)))
