"""HunyuanVideo 1.5: text-to-video and image-to-video with classifier-free guidance.

Follows ``HunyuanVideo15Pipeline`` / ``HunyuanVideo15ImageToVideoPipeline`` (diffusers 0.42):

- text: Qwen2.5-VL (the chat-templated prompt, hidden states of the third-last layer, the template's
  first 108 tokens cropped, padded to 1000 with a mask) and byT5 on the prompt's quoted glyph text
  (zeros and an all-false mask when there is none), each with its mask; the negative prompt ("" when
  absent) the same way. Guidance is the pipeline's ``ClassifierFreeGuidance``: a second branch whenever
  its scale is not 1 (the CFG-distilled checkpoints ship scale 1), ``uncond + scale · (cond - uncond)``;
- the transformer reads [noisy latents; conditioning latents; mask] on the channel dim: zeros for
  text-to-video, the first frame's VAE latents and a first-frame mask for image-to-video, plus SigLIP
  image embeddings (zeros for text-to-video, which the model recognises and masks out);
- flow-matching Euler with sigmas ``linspace(1, 0, steps + 1)[:-1]`` and the scheduler's shift;
- the VAE decodes ``latents / scaling_factor``.

Not diffusers' arithmetic to the letter but exactly its result: the context padding (masked as query and
key everywhere, so it never reaches a video token) is cut before the model and inside it, and attention
takes only each row's valid context tokens without building the model's per-block S×S mask.

Image-to-video: diffusers picks the output size from the image's aspect ratio (a bucket near the model's
``target_size``); here the request's width × height is the size and the image is resized and
centre-cropped to it as the pipeline does, so both agree whenever the request asks for that bucket.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

from ..request import GenerationParams
from .base import PipelineRunner, RequestState, open_image, request_scheduler
from .vae import decode_video

I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
# Videos of more latent positions (frames × rows × columns) than this decode in spatial tiles, as diffusers'
# HunyuanVideo 1.5 examples decode (``pipe.vae.enable_tiling()``): the VAE's mid-block attention builds a
# causal mask of positions² entries (512 MiB in bf16 here; at 720p and 121 frames, 111,600 positions: 23 GiB)
# and fills it one row at a time. Below it (480p and 33 frames: 14,310), the pipeline's default untiled decode.
TILED_DECODE_POSITIONS = 16384

_BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis")


class ContextTrim:
    """A pre-hook on every dual-stream block that drops the context padding all rows share.

    The model orders each row's context as [valid image, valid glyph, valid text, padding] and masks the
    padding as query and key, so no video token ever sees it: cutting the context after the longest row's
    valid tokens leaves the video exactly as it was and spares the blocks ~1985 - (valid) context tokens
    per row (729 image + 256 glyph + 1000 text slots, of which a prompt fills a few hundred at most).
    The model passes one mask tensor to every block of a forward: its length is read to the host once.
    """

    def __init__(self) -> None:
        self._mask: torch.Tensor | None = None
        self._keep = 0

    def __call__(self, module, args: tuple, kwargs: dict):
        values = {**dict(zip(_BLOCK_ARGS, args, strict=False)), **kwargs}
        mask = values.get("attention_mask")
        if mask is None or len(args) > len(_BLOCK_ARGS):
            return None
        if mask is not self._mask:
            self._mask, self._keep = mask, max(1, int(mask.bool().sum(dim=1).max()))
        if self._keep >= mask.shape[1]:
            return None
        values["attention_mask"] = mask[:, : self._keep]
        values["encoder_hidden_states"] = values["encoder_hidden_states"][:, : self._keep]
        return (), values


def apply_valid_context(transformer) -> None:
    """Install `ContextTrim` on ``transformer``'s blocks and, where the model is not sharded (a sharded
    one has the parallel plan's processor already), the one-rank valid-context attention processor.
    Once per model object (a weights update brings a new one)."""
    if getattr(transformer, "_ditserve_valid_context", False):
        return
    from ..parallel.hunyuanvideo15 import HunyuanVideo15ValidContextAttnProcessor

    trim = ContextTrim()
    sharded = getattr(transformer, "_ditserve_parallel", None) is not None
    processor = HunyuanVideo15ValidContextAttnProcessor()  # one for all blocks: one length read per forward
    for block in transformer.transformer_blocks:
        block.register_forward_pre_hook(trim, with_kwargs=True)
        if not sharded:
            block.attn.set_processor(processor)
    transformer._ditserve_valid_context = True


def _drop_padding(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``inputs`` with the text and glyph columns after the last one any row uses cut off."""
    out = dict(inputs)
    for embeds, mask in (
        ("encoder_hidden_states", "encoder_attention_mask"),
        ("encoder_hidden_states_2", "encoder_attention_mask_2"),
    ):
        used = inputs[mask].bool().any(dim=0)
        keep = max(1, int(used.nonzero().max()) + 1) if bool(used.any()) else 1
        out[embeds], out[mask] = inputs[embeds][:, :keep], inputs[mask][:, :keep]
    return out


class HunyuanVideo15Runner(PipelineRunner):
    cache_blocks = ("transformer_blocks",)
    cache_outputs = ("hidden_states", "encoder_hidden_states")

    def __init__(self, pipe, **kwargs) -> None:
        super().__init__(pipe, **kwargs)
        # No CUDA graphs: the model's own forward reads its inputs on the host (whether the image tokens
        # are all zero, boolean-mask reordering of the context), so no capture could succeed; and without
        # graphs the padding is dropped and only valid context attends (below), which reads lengths too.
        self.graphs = None

    def text_token_limit(self) -> int:
        """The pipeline's own prompt length (it takes no max_sequence_length; usage counts up to it)."""
        return int(self.pipe.tokenizer_max_length)

    @property
    def image_to_video(self) -> bool:
        return type(self.pipe).__name__ == I2V_PIPELINE

    def _guidance(self, params: GenerationParams) -> float:
        if params.guidance_scale is not None:
            return params.guidance_scale
        return float(self.pipe.guider.guidance_scale)

    def _do_cfg(self, params: GenerationParams) -> bool:
        """The guider's rule: a second branch unless it is disabled or its scale is 1."""
        return bool(self.pipe.guider._enabled) and not math.isclose(self._guidance(params), 1.0)

    def _encode_text(self, prompt: str | None, n: int) -> dict[str, torch.Tensor]:
        embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(
            prompt=prompt,  # None: the pipeline encodes "" (its negative prompt)
            device=self.device,
            dtype=self.dtype,
            batch_size=1,
            num_videos_per_prompt=n,
        )
        return {
            "encoder_hidden_states": embeds,
            "encoder_attention_mask": mask,
            "encoder_hidden_states_2": embeds_2,
            "encoder_attention_mask_2": mask_2,
        }

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        pipe, n = self.pipe, params.n
        if self.image_to_video and not params.images:
            raise ValueError("input_reference: this is an image-to-video model; give the first frame")
        if not self.image_to_video and params.images:
            raise ValueError("input_reference: this is a text-to-video model and takes no reference image")
        out = {"cond": self._encode_text(params.prompt, n)}
        if self._do_cfg(params):
            out["uncond"] = self._encode_text(params.negative_prompt, n)
        if self.image_to_video:
            image = pipe.video_processor.resize(
                open_image(params.images[0]), height=params.height, width=params.width, resize_mode="crop"
            )
            out["image_embeds"] = pipe.encode_image(
                image=image, batch_size=n, device=self.device, dtype=self.dtype
            )
            # (1, C, 1, h, w), already × scaling_factor
            out["image_latents"] = pipe._get_image_latents(
                vae=pipe.vae,
                image_processor=pipe.video_processor,
                image=image,
                height=params.height,
                width=params.width,
                device=self.device,
            )
        return out

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        pipe, n = self.pipe, params.n
        generator = torch.Generator("cpu").manual_seed(params.seed)
        # The noise is drawn in the model's dtype, as the pipelines draw it (and they step in it): some torch
        # versions' CPU bf16 normal sampler is not the fp32 one rounded (torch 2.11: other values altogether).
        latents = pipe.prepare_latents(
            n,
            pipe.num_channels_latents,
            params.height,
            params.width,
            params.num_frames,
            self.dtype,
            self.device,
            generator,
        )
        # [conditioning latents; mask] beside the noisy latents, as prepare_cond_latents_and_mask builds them
        _, channels, frames, height, width = latents.shape
        cond_latents = torch.zeros(
            n, channels + 1, frames, height, width, device=self.device, dtype=self.dtype
        )
        if "image_latents" in encoded:
            cond_latents[:, :channels, :1] = encoded["image_latents"].to(self.device, self.dtype)
            cond_latents[:, channels, 0] = 1.0
        extra_rows = {"cond_latents": cond_latents}
        if "image_embeds" in encoded:
            extra_rows["image_embeds"] = encoded["image_embeds"].to(self.device, self.dtype)
        cond = {**encoded["cond"], **extra_rows}
        uncond = {**encoded["uncond"], **extra_rows} if encoded.get("uncond") is not None else None

        scheduler = request_scheduler(pipe)
        steps = params.num_inference_steps
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas)
        return RequestState(
            req_id=req_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            cond=cond,
            uncond=uncond,
            cfg_scale=self._guidance(params),
            bucket=("hunyuanvideo15", params.height, params.width, params.num_frames),
            extra={"shared": {}},
        )

    def model_forward(self, latents, timesteps, inputs, shared):
        pipe = self.pipe
        rows = latents.shape[0]
        # Padding is masked wherever the model reads it (the refiner's attention and pooled mean, the
        # blocks' joint attention), so it is dropped: the trailing columns no row uses and the unused image
        # slots here, the rest inside (`ContextTrim`).
        apply_valid_context(pipe.transformer)
        inputs = _drop_padding(inputs)
        image_embeds = inputs.get("image_embeds")
        if image_embeds is None:  # text-to-video: one all-zero image slot, masked out as padding
            image_embeds = torch.zeros(
                rows, 1, pipe.vision_states_dim, device=latents.device, dtype=self.dtype
            )
        hidden = torch.cat([latents.to(self.dtype), inputs["cond_latents"]], dim=1)
        return pipe.transformer(
            hidden_states=hidden,
            image_embeds=image_embeds,
            timestep=timesteps.to(self.dtype),  # the pipeline casts t to the latents' (model) dtype
            encoder_hidden_states=inputs["encoder_hidden_states"],
            encoder_attention_mask=inputs["encoder_attention_mask"],
            encoder_hidden_states_2=inputs["encoder_hidden_states_2"],
            encoder_attention_mask_2=inputs["encoder_attention_mask_2"],
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        vae = self.pipe.vae
        latents = state.latents.to(vae.dtype) / vae.config.scaling_factor
        if math.prod(latents.shape[2:]) > TILED_DECODE_POSITIONS:
            vae.enable_tiling()
        else:
            vae.disable_tiling()
        # One video at a time: the VAE's causal attention mask (diffusers' AutoencoderKLHunyuanVideo15) is
        # shaped for a batch of one and fails to broadcast against two or more videos.
        return np.concatenate([decode_video(self.pipe, video[None]) for video in latents])
