"""Wan text-to-video (``WanPipeline``): Wan 2.1, Wan 2.2 A14B (two experts) and Wan 2.2 TI2V-5B.

- **CFG**: an uncond branch whenever ``guidance_scale`` > 1, as ``WanPipeline``.
- **Two experts** (Wan 2.2 A14B: ``transformer_2`` + ``boundary_ratio``): steps with
  t ≥ boundary_ratio · num_train_timesteps run ``transformer`` (high noise) with ``guidance_scale``, the
  later ones ``transformer_2`` with ``guidance_scale_2`` (default: ``guidance_scale``). Requests of one
  batch may sit on either side of their boundary, so a step runs one forward per expert.
- **Per-token timesteps** (``expand_timesteps``, TI2V-5B): every video token gets its own timestep; with a
  first frame (``params.images[0]``) the first latent frame is the encoded image, held fixed (timestep 0)
  through the denoising, as ``WanImageToVideoPipeline`` does for this model.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, open_image, request_scheduler
from .vae import channel_normalization, decode_video

# Decoded frames above this many pixels decode in spatial tiles (diffusers' AutoencoderKLWan tiling:
# 256-px tiles, blended overlaps): the activations of one latent frame's decoder pass then stay bounded.
# The Wan VAE already decodes one latent frame at a time (causal cache), so length is never the cliff.
TILED_DECODE_PIXELS = 1280 * 720


def first_frame_image(params: GenerationParams):
    """The request's first frame (``images[0]``, checked at the ingress) as diffusers' ``load_image``
    gives it: EXIF orientation applied, RGB (a 16-bit greyscale PNG scaled to 8 bits, not clipped)."""
    return open_image(params.images[0])


def image_condition(pipe, params: GenerationParams, device: torch.device) -> dict[str, torch.Tensor]:
    """``WanImageToVideoPipeline.prepare_latents``' conditioning for the first frame, on the encoder rank:
    ``condition`` (normalised VAE latents: Wan 2.1/2.2 I2V prepend the 4-channel frame mask; TI2V-5B keeps
    the first latent frame alone) and, for TI2V, ``first_frame_mask``. The noise it also draws is dropped
    (every rank draws its own from the seed)."""
    from diffusers import WanImageToVideoPipeline

    image = pipe.video_processor.preprocess(
        first_frame_image(params), height=params.height, width=params.width
    )
    # diffusers' own arithmetic (resize, VAE encode with argmax, normalisation, masks). A WanPipeline-class
    # TI2V folder has everything the method reads (vae, scale factors, config.expand_timesteps).
    out = WanImageToVideoPipeline.prepare_latents(
        pipe,
        image.to(device, dtype=torch.float32),
        params.n,
        pipe.vae.config.z_dim,
        params.height,
        params.width,
        params.num_frames,
        torch.float32,
        device,
        torch.Generator("cpu").manual_seed(params.seed),
    )
    if len(out) == 3:
        return {"condition": out[1], "first_frame_mask": out[2]}
    return {"condition": out[1]}


class WanRunner(PipelineRunner):
    cache_blocks = ("blocks",)
    default_guidance = 5.0

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        self._expert = 0  # the expert of the forward being run (step caching reads it)

    # -- what the folder is ---------------------------------------------------------------------------------
    @property
    def boundary_ratio(self) -> float | None:
        if getattr(self.pipe, "transformer_2", None) is None:
            return None
        return getattr(self.pipe.config, "boundary_ratio", None)

    @property
    def expand_timesteps(self) -> bool:
        return bool(getattr(self.pipe.config, "expand_timesteps", False))

    def expert_model(self, expert: int) -> torch.nn.Module:
        # Read from the pipeline each time: a weights update replaces its modules.
        return self.pipe.transformer if expert == 0 else self.pipe.transformer_2

    def _guidance(self, params: GenerationParams) -> tuple[float, float]:
        first = params.guidance_scale if params.guidance_scale is not None else self.default_guidance
        second = params.guidance_scale_2 if params.guidance_scale_2 is not None else first
        return first, second

    def num_latent_channels(self) -> int:
        return self.pipe.transformer.config.in_channels

    # -- encoders (encoder rank only) ------------------------------------------------------------------------
    def text_length(self) -> int:
        return min(self.max_sequence_length, self.pipe.tokenizer.model_max_length)

    @torch.no_grad()
    def encode_text(self, params: GenerationParams) -> dict:
        pipe = self.pipe
        do_cfg = self._guidance(params)[0] > 1.0  # WanPipeline: the first expert's scale decides
        embeds, neg_embeds = pipe.encode_prompt(
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            do_classifier_free_guidance=do_cfg,
            num_videos_per_prompt=params.n,
            max_sequence_length=self.text_length(),
            device=self.device,
        )
        out = {"cond": {"encoder_hidden_states": embeds.to(self.dtype)}}
        if do_cfg:
            out["uncond"] = {"encoder_hidden_states": neg_embeds.to(self.dtype)}
        return out

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        out = self.encode_text(params)
        if params.images:  # TI2V-5B's first frame (the engine refuses images for the other folders)
            out.update(image_condition(self.pipe, params, self.device))
        return out

    # -- per request (every rank) ----------------------------------------------------------------------------
    def _row_inputs(self, encoded: dict, params: GenerationParams) -> tuple[dict, dict | None, dict]:
        """Per-row model inputs of both branches, and the request's extra state."""
        cond, uncond = dict(encoded["cond"]), encoded.get("uncond")
        uncond = None if uncond is None else dict(uncond)
        extra: dict = {}
        if not self.expand_timesteps:
            return cond, uncond, extra
        # Per-token timesteps: (1 - mask)·condition + mask·latents is the model input; the mask (0 on the
        # first latent frame of an image request, 1 elsewhere) also scales each token's timestep. A text
        # request gets mask 1 and condition 0, which is exactly its latents (every request of a batch
        # carries the same inputs).
        lat_f, lat_h, lat_w = self._latent_shape(params)
        mask = encoded.get("first_frame_mask")
        if mask is None:
            mask = torch.ones(1, 1, lat_f, lat_h, lat_w, dtype=torch.float32, device=self.device)
            condition = torch.zeros(
                params.n, self.num_latent_channels(), 1, lat_h, lat_w, dtype=torch.float32, device=self.device
            )
        else:
            condition = encoded["condition"]
        # WanPipeline: mask[0][0][:, ::2, ::2] (the patch grid) flattened, times t.
        extra["token_mask"] = mask[0][0][:, ::2, ::2].flatten()
        extra["first_frame_mask"] = mask
        extra["condition"] = condition
        rows = {"condition": condition, "first_frame_mask": mask.expand(params.n, -1, -1, -1, -1)}
        cond.update(rows)
        if uncond is not None:
            uncond.update(rows)
        return cond, uncond, extra

    def _latent_shape(self, params: GenerationParams) -> tuple[int, int, int]:
        pipe = self.pipe
        return (
            (params.num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
            params.height // pipe.vae_scale_factor_spatial,
            params.width // pipe.vae_scale_factor_spatial,
        )

    def _check_positions(self, params: GenerationParams) -> None:
        """The transformer's rotary table has ``rope_max_seq_len`` positions per axis: a video of more latent
        frames has none (refused per request rather than failing the batch's forward in the rotary embedding;
        rows and columns: the family's ``refuse_size``, before queueing)."""
        config = self.pipe.transformer.config
        limit, p_t = config.rope_max_seq_len, config.patch_size[0]
        temporal = self.pipe.vae_scale_factor_temporal
        lat_f = self._latent_shape(params)[0]
        if lat_f > limit * p_t:
            raise ValueError(
                f"num_frames: {params.num_frames} is above this model's most {(limit * p_t - 1) * temporal + 1}"
            )

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        self._check_positions(params)
        guidance = self._guidance(params)
        cond, uncond, extra = self._row_inputs(encoded, params)
        scheduler = request_scheduler(self.pipe)  # the folder's scheduler (Wan 2.1's UniPC, its flow shift)
        scheduler.set_timesteps(params.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        ratio = self.boundary_ratio
        # WanPipeline's prepare_latents: fp32 noise from the request's CPU generator, on the device.
        latents = randn_tensor(
            (params.n, self.num_latent_channels(), *self._latent_shape(params)),
            generator=torch.Generator("cpu").manual_seed(params.seed),
            device=self.device,
            dtype=torch.float32,
        )
        extra.update(
            shared={"expert": 0},
            guidance=guidance,
            boundary=None if ratio is None else ratio * scheduler.config.num_train_timesteps,
        )
        return RequestState(
            req_id=req_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            cond=cond,
            uncond=uncond,
            cfg_scale=guidance[0],
            bucket=("wan", params.height, params.width, params.num_frames),
            extra=extra,
        )

    # -- one step ----------------------------------------------------------------------------------------------
    def expert_of(self, state: RequestState) -> int:
        """0: ``transformer`` (Wan 2.1, or Wan 2.2's high-noise steps), 1: ``transformer_2``."""
        boundary = state.extra["boundary"]
        t = state.timesteps[state.step_index]
        return 0 if boundary is None or t >= boundary else 1

    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        """One step of every request, one forward (per CFG branch) per expert the batch needs. Every rank
        holds the same states, so every rank runs the same forwards in the same order."""
        groups: dict[int, list[RequestState]] = {}
        for s in states:
            groups.setdefault(self.expert_of(s), []).append(s)
        for expert, group in sorted(groups.items()):
            for s in group:
                s.cfg_scale = s.extra["guidance"][expert]
                # Shared by every row of the forward; part of a CUDA graph's key, so each expert has its own.
                s.extra["shared"] = {"expert": expert}
            self._expert = expert
            try:
                super().step(group)
            finally:
                self._expert = 0

    def timestep_rows(self, state: RequestState) -> torch.Tensor:
        t = state.timesteps[state.step_index]
        mask = state.extra.get("token_mask")
        if mask is None:
            return t.expand(state.rows)
        return (mask * t).unsqueeze(0).expand(state.rows, -1)  # (rows, video tokens)

    def model_input(self, latents: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if "first_frame_mask" in inputs:
            mask = inputs["first_frame_mask"]
            return ((1 - mask) * inputs["condition"] + mask * latents).to(self.dtype)
        if "condition" in inputs:  # I2V: mask + image latents as extra channels
            return torch.cat([latents, inputs["condition"]], dim=1).to(self.dtype)
        return latents.to(self.dtype)

    def model_forward(self, latents, timesteps, inputs, shared):
        model = self.expert_model(shared.get("expert", 0))
        kwargs = {}
        if "encoder_hidden_states_image" in inputs:
            kwargs["encoder_hidden_states_image"] = inputs["encoder_hidden_states_image"]
        return model(
            hidden_states=self.model_input(latents, inputs),
            timestep=timesteps,
            encoder_hidden_states=inputs["encoder_hidden_states"],
            return_dict=False,
            **kwargs,
        )[0]

    # -- step caching: one cache per expert (one expert's residuals say nothing of the other's) -------------
    def step_cache(self):
        return self.step_cache_of(self.expert_model(self._expert))

    def request_cache(self, state: RequestState, branch: str):
        if self._expert == 0:
            return super().request_cache(state, branch)
        settings = state.params.cache
        if settings is None or not settings.enabled or (branch == "uncond" and state.uncond is None):
            return None
        from ..caching.state import RequestCache

        return state.extra.setdefault("cache", {}).setdefault(
            f"{branch}:expert{self._expert}", RequestCache(settings)
        )

    # -- decode (rank 0) -------------------------------------------------------------------------------------
    def final_latents(self, state: RequestState) -> torch.Tensor:
        if "condition" in state.extra:  # TI2V: the first latent frame is the image's (as the pipeline ends)
            mask = state.extra["first_frame_mask"]
            return (1 - mask) * state.extra["condition"] + mask * state.latents
        return state.latents

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        vae = self.pipe.vae
        latents = self.final_latents(state).to(vae.dtype)
        mean, inv_std = channel_normalization(vae, latents)
        p = state.params
        if p.width * p.height > TILED_DECODE_PIXELS:
            vae.enable_tiling()
        else:
            vae.disable_tiling()
        return decode_video(self.pipe, latents / inv_std + mean)
