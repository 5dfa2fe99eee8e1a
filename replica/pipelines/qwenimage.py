"""Qwen-Image: text-to-image (QwenImagePipeline), image-to-image from one start image and ``strength`` on
the same folder (QwenImageImg2ImgPipeline's arithmetic), inpainting with a mask (QwenImageInpaintPipeline's),
and editing with one (QwenImageEditPipeline) or several (QwenImageEditPlusPipeline) reference images; an edit
with a mask inpaints its image as QwenImageEditInpaintPipeline (the image's VAE sample is both the reference
and the start latents the mask keeps).

The arithmetic follows diffusers' pipelines: Qwen2.5-VL prompt embeddings with their padding mask, packed
2×2 latents, FlowMatchEuler with the dynamic shift, true CFG with the pipelines' norm rescaling
(``comb * ‖cond‖ / ‖comb‖`` per token), and for edits the references' packed VAE latents appended to the
image tokens (their predictions are dropped).

Batching: rows of one forward share the rotary positions (``img_shapes``: the output size and every
reference's size), so a step runs one forward per distinct ``img_shapes``; prompts of different lengths
share a forward with their embeddings padded to the longest and ``encoder_hidden_states_mask`` marking
the padding (diffusers' own batched arithmetic). A forward whose rows are all unpadded passes no mask, as
the pipelines do.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps
from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import retrieve_latents

from ..media import to_rgb
from ..request import GenerationParams
from .base import PipelineRunner, RequestState, request_scheduler, to_uint8, true_cfg_branch
from .img2img import encode_start, inpainting, latent_mask, noised_start, request_generator, start_pixels
from .schedule import flow_sigmas, image_seq_shift
from .vae import channel_normalization

# QwenImageEditPlusPipeline's reference areas: the VL encoder's view and the VAE latents'.
CONDITION_AREA = 384 * 384
REFERENCE_AREA = 1024 * 1024


def area_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of about ``area`` pixels with the aspect of ``width × height``, multiples of 32 (the
    edit pipelines' ``calculate_dimensions``)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


def pil_processor(image_processor, tokenizer):
    """A Qwen2VLProcessor of ``image_processor`` and ``tokenizer`` with no video processor.

    transformers 5.25 builds Qwen2VLProcessor's video processor (and its default image processor) on
    torchvision, which PyPI's builds cannot load against the CPU torch build, and without torchvision it
    cannot even check a missing video processor's class; the pipelines never pass videos."""
    from transformers import Qwen2VLProcessor

    class PilQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return PilQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def load_processor(folder: str | Path):
    """The folder's Qwen2-VL processor with transformers' PIL image processor (``Qwen2VLImageProcessorPil``,
    which reads the same ``preprocessor_config.json``) and no video processor."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    return pil_processor(
        Qwen2VLImageProcessorPil.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    )


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a build that does not match torch fails with several types
        return False
    return True


def _decode_image(data: bytes, index: int):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"image: reference {index + 1} is not a readable image ({exc})") from None
    return to_rgb(image)  # upright, 8-bit RGB: the size the ingress read


class QwenImageRunner(PipelineRunner):
    cache_blocks = ("transformer_blocks",)
    cache_outputs = ("encoder_hidden_states", "hidden_states")

    def __init__(self, pipe, **kwargs):
        super().__init__(pipe, **kwargs)
        name = type(pipe).__name__
        self.edit = name in ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
        self.plus = name == "QwenImageEditPlusPipeline"
        if pipe.transformer.config.get("zero_cond_t", False):
            # Per-token modulation (reference tokens at t = 0) doubles the timestep rows inside the model:
            # the step cache's row bookkeeping does not follow it, so those requests run uncached.
            self.cache_blocks = ()
            # Adapters do follow it: the timestep embedding and every block's image modulation run on the
            # batch's rows twice over, [rows at t; the same rows at 0].
            transformer = pipe.transformer
            doubled = [
                "time_text_embed.timestep_embedder.linear_1",
                "time_text_embed.timestep_embedder.linear_2",
            ]
            doubled += [
                f"transformer_blocks.{i}.img_mod.1" for i in range(len(transformer.transformer_blocks))
            ]
            transformer.lora_row_copies = dict.fromkeys(doubled, 2)

    def text_token_limit(self) -> int:
        return min(self.max_sequence_length, 1024)  # QwenImagePipeline refuses more

    @classmethod
    def pipeline_components(cls, folder: Path) -> dict:
        """Components passed to ``from_pretrained`` instead of the folder's own (see ``load_processor``)."""
        if (folder / "processor").is_dir() and not _torchvision_loads():
            return {"processor": load_processor(folder / "processor")}
        return {}

    # -- encoders ---------------------------------------------------------------------------------------
    def _references(self, params: GenerationParams) -> list:
        cls = type(self.pipe).__name__
        if not self.edit:
            if len(params.images) > 1:
                raise ValueError(f"image: image-to-image starts from one image, got {len(params.images)}")
            return []  # a start image is not a reference: ``_start_latents``
        limit = 3 if self.plus else 1
        if not params.images:
            raise ValueError(
                f"image: {cls} edits a reference image; give 1 to {limit} (POST /v1/images/edits, not "
                "/v1/images/generations)"
            )
        if len(params.images) > limit:
            raise ValueError(
                f"image: {cls} takes at most {limit} reference image(s), got {len(params.images)}"
            )
        return [_decode_image(data, i) for i, data in enumerate(params.images)]

    def _prompt(self, prompt: str, n: int, image) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs = {"image": image} if self.edit else {}
        embeds, mask = self.pipe.encode_prompt(
            prompt=prompt,
            device=self.device,
            num_images_per_prompt=n,
            max_sequence_length=self.text_token_limit(),
            **kwargs,
        )
        return embeds.to(self.dtype), None if mask is None else mask.bool()

    def _reference_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Packed, normalised VAE latents (1, tokens, channels) of one preprocessed reference (1, 3, 1, H, W)."""
        pipe = self.pipe
        latents = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None)
        channels = pipe.transformer.config.in_channels // 4
        h, w = latents.shape[3:]
        return pipe._pack_latents(latents, 1, channels, h, w).to(self.dtype)

    def _start_latents(self, params: GenerationParams, generator: torch.Generator) -> torch.Tensor:
        """QwenImageImg2ImgPipeline's start latents: the image at the requested size, a VAE sample drawn
        with ``generator``, normalised, packed (1, tokens, channels)."""
        vae = self.pipe.vae
        pixels = start_pixels(self.pipe, params).unsqueeze(2)  # (1, 3, 1, H, W): the VAE's frame axis
        latents = retrieve_latents(vae.encode(pixels.to(self.device, vae.dtype)), generator=generator)
        mean, inv_std = channel_normalization(vae, latents)
        latents = (latents - mean) * inv_std
        channels, h, w = latents.shape[1], *latents.shape[3:]
        return self.pipe._pack_latents(latents, 1, channels, h, w).to(self.dtype)

    @torch.no_grad()
    def encode(self, params: GenerationParams) -> dict:
        pipe, n = self.pipe, params.n
        images = self._references(params)
        vl_image, refs, shapes = None, [], []
        factor = pipe.vae_scale_factor * 2
        start: dict = {}  # image-to-image's or a masked edit's start latents (and the generator after them)
        if images and params.mask is not None and not self.plus:
            # QwenImageEditInpaintPipeline: the image at the output size (its ~1024² when none is asked) for
            # the VL encoder, and its VAE sample from the request's generator both the reference and the
            # start latents the mask keeps (the noise is drawn after it from the same generator).
            w, h = params.width, params.height
            vl_image = pipe.image_processor.resize(images[0], h, w)
            start = encode_start(params, lambda generator: self._start_latents(params, generator))
            refs.append(start["init_latents"])
            shapes.append((1, h // factor, w // factor))
        elif images and not self.plus:
            # QwenImageEditPipeline: the reference at about 1024² for both the VL encoder and the VAE.
            w, h = area_size(REFERENCE_AREA, *images[0].size)
            vl_image = pipe.image_processor.resize(images[0], h, w)
            refs.append(self._reference_latents(pipe.image_processor.preprocess(vl_image, h, w).unsqueeze(2)))
            shapes.append((1, h // factor, w // factor))
        elif images:
            # QwenImageEditPlusPipeline: each reference at about 384² for the VL encoder, 1024² for the VAE.
            vl_image = []
            for image in images:
                cw, ch = area_size(CONDITION_AREA, *image.size)
                vw, vh = area_size(REFERENCE_AREA, *image.size)
                vl_image.append(pipe.image_processor.resize(image, ch, cw))
                refs.append(
                    self._reference_latents(pipe.image_processor.preprocess(image, vh, vw).unsqueeze(2))
                )
                shapes.append((1, vh // factor, vw // factor))
        embeds, mask = self._prompt(params.prompt, n, vl_image)
        out: dict = {"cond": {"encoder_hidden_states": embeds, "mask": mask}, "ref_shapes": shapes}
        if refs:
            out["image_latents"] = torch.cat(refs, dim=1)
        if true_cfg_branch(params):
            neg, neg_mask = self._prompt(params.negative_prompt, n, vl_image)
            out["uncond"] = {"encoder_hidden_states": neg, "mask": neg_mask}
        if params.images and not self.edit:  # image-to-image, sampled with the request's generator
            start = encode_start(params, lambda generator: self._start_latents(params, generator))
        out |= start
        if start and params.mask is not None:  # the inpaint pipelines' mask, at the latents' size, packed
            channels = pipe.transformer.config.in_channels // 4
            lat_h, lat_w = 2 * (params.height // factor), 2 * (params.width // factor)
            mask = latent_mask(params, lat_h, lat_w).repeat(1, channels, 1, 1)
            out["mask"] = pipe._pack_latents(mask, 1, channels, lat_h, lat_w)
        return out

    # -- request state ----------------------------------------------------------------------------------
    def _rows(self, branch: dict, image_latents: torch.Tensor | None, n: int) -> dict:
        rows = {"encoder_hidden_states": branch["encoder_hidden_states"]}
        if branch.get("mask") is not None:
            rows["encoder_hidden_states_mask"] = branch["mask"]
        if image_latents is not None:
            rows["image_latents"] = image_latents.expand(n, -1, -1)
        return rows

    @torch.no_grad()
    def prepare(self, req_id: str, params: GenerationParams, encoded: dict) -> RequestState:
        pipe, n = self.pipe, params.n
        channels = pipe.transformer.config.in_channels // 4
        generator = request_generator(params, encoded)
        args = (n, channels, params.height, params.width, self.dtype, self.device, generator)
        if self.edit:
            latents, _ = pipe.prepare_latents(None, *args)
        else:
            latents = pipe.prepare_latents(*args)
        factor = pipe.vae_scale_factor * 2
        img_shapes = [
            (1, params.height // factor, params.width // factor),
            *map(tuple, encoded["ref_shapes"]),
        ]
        image_latents = encoded.get("image_latents")
        cond = self._rows(encoded["cond"], image_latents, n)
        uncond = encoded.get("uncond")
        if uncond is not None:
            uncond = self._rows(uncond, image_latents, n)

        scheduler = request_scheduler(pipe)  # timesteps as the pipelines set them
        steps = params.num_inference_steps
        mu = image_seq_shift(scheduler, latents.shape[1])
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=flow_sigmas(steps), mu=mu)
        # Image-to-image (QwenImageImg2ImgPipeline): the start latents noised to strength's timestep (the
        # noise is elementwise, so packed latents give the pipeline's packed result).
        inpaint = inpainting(params, encoded, latents)
        latents, start = noised_start(scheduler, timesteps, latents, params, encoded)
        return RequestState(
            req_id=req_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            cond=cond,
            uncond=uncond,
            cfg_scale=params.true_cfg_scale,
            bucket=("qwenimage", params.height, params.width, 1),
            step_index=start,
            extra={"shared": {"img_shapes": img_shapes}, "group": tuple(img_shapes), **inpaint},
        )

    # -- steps ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, states: list[RequestState]) -> None:
        # One forward per rotary layout: the model builds one set of positions for all its rows.
        groups: dict[tuple, list[RequestState]] = {}
        for s in states:
            groups.setdefault(s.extra["group"], []).append(s)
        for group in groups.values():
            super().step(group)

    def concat_inputs(self, inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Rows of several requests: prompt embeddings padded to the longest, with the padding mask that the
        pipelines build for a batch of prompts (none when no row is padded)."""
        lengths = [x["encoder_hidden_states"].shape[1] for x in inputs]
        longest = max(lengths)
        padded = any(n != longest for n in lengths) or any("encoder_hidden_states_mask" in x for x in inputs)
        embeds, masks = [], []
        for x, length in zip(inputs, lengths, strict=True):
            e = x["encoder_hidden_states"]
            embeds.append(torch.nn.functional.pad(e, (0, 0, 0, longest - length)))
            if padded:
                m = x.get("encoder_hidden_states_mask")
                if m is None:
                    m = torch.ones(e.shape[:2], dtype=torch.bool, device=e.device)
                masks.append(torch.nn.functional.pad(m, (0, longest - length), value=False))
        out = {"encoder_hidden_states": torch.cat(embeds)}
        if padded:
            out["encoder_hidden_states_mask"] = torch.cat(masks)
        if "image_latents" in inputs[0]:
            out["image_latents"] = torch.cat([x["image_latents"] for x in inputs])
        return out

    def guide(self, state: RequestState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """The pipelines' true CFG: the guided prediction rescaled per token to the cond prediction's norm."""
        combined = uncond + state.cfg_scale * (cond - uncond)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        return combined * (cond_norm / torch.norm(combined, dim=-1, keepdim=True))

    def model_forward(self, latents, timesteps, inputs, shared):
        hidden = latents
        if "image_latents" in inputs:
            hidden = torch.cat([latents, inputs["image_latents"]], dim=1)
        out = self.pipe.transformer(
            hidden_states=hidden,
            timestep=timesteps / 1000,
            guidance=None,
            encoder_hidden_states_mask=inputs.get("encoder_hidden_states_mask"),
            encoder_hidden_states=inputs["encoder_hidden_states"],
            img_shapes=[shared["img_shapes"]] * latents.shape[0],
            return_dict=False,
        )[0]
        return out[:, : latents.shape[1]]

    def preview_latents(self, state: RequestState) -> torch.Tensor:
        pipe, p = self.pipe, state.params
        return pipe._unpack_latents(state.latents[:1], p.height, p.width, pipe.vae_scale_factor)[0, :, 0]

    @torch.no_grad()
    def decode(self, state: RequestState) -> np.ndarray:
        pipe, p = self.pipe, state.params
        vae = pipe.vae
        latents = pipe._unpack_latents(state.latents, p.height, p.width, pipe.vae_scale_factor).to(vae.dtype)
        mean, inv_std = channel_normalization(vae, latents)
        image = vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return to_uint8(pipe.image_processor.postprocess(image, output_type="np"))
