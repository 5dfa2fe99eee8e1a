"""Qwen-Image: a dual-stream MM-DiT (separate text and image projections, one joint attention) with its own
3-D rotary positions, Qwen2.5-VL prompt embeddings with a padding mask, packed 2×2 latents and true CFG
(the pipelines rescale the guided prediction to the cond prediction's norm); image-to-image from an
uploaded image on a text-to-image folder (``QwenImageImg2ImgPipeline``'s arithmetic). Qwen-Image-Edit
(``QwenImageEditPipeline``, one reference) and Qwen-Image-Edit-2509/2511 (``QwenImageEditPlusPipeline``,
several) append the references' latent tokens after the generated ones and show the references to the VL
encoder; Qwen-Image-Edit with a mask inpaints its image as ``QwenImageEditInpaintPipeline``."""

from __future__ import annotations

import math

from . import Family, Folder, vae_spatial_factor

# QwenImageEditPlusPipeline takes any number of references in diffusers' code; the Qwen-Image-Edit-2509
# model card supports 1 to 3, and every reference adds ~4096 tokens at 1024².
MAX_PLUS_REFERENCES = 3


def edit_size(folder: Folder, reference: tuple[int, int]) -> tuple[int, int]:
    """The output (width, height) of an edit that names no size: the (last) reference's aspect at about
    1024² pixels, as the edit pipelines choose it (multiples of 32, then of the size multiple)."""
    width, height = reference
    ratio = width / height
    w = math.sqrt(1024 * 1024 * ratio)
    multiple = vae_spatial_factor(folder) * 2
    out_w, out_h = round(w / 32) * 32, round(w / ratio / 32) * 32
    return out_w // multiple * multiple, out_h // multiple * multiple


def _refuse(folder: Folder) -> str | None:
    config = folder.config("transformer")
    if config.get("guidance_embeds"):
        return "a guidance-distilled Qwen-Image transformer (guidance_embeds: true) is not supported"
    if config.get("use_layer3d_rope") or config.get("use_additional_t_cond"):
        return (
            "a Qwen-Image-Layered transformer (use_layer3d_rope / use_additional_t_cond) is not supported. "
            "Supported: QwenImagePipeline, QwenImageEditPipeline, QwenImageEditPlusPipeline folders."
        )
    return None


FAMILY = Family(
    name="qwenimage",
    pipelines={
        "QwenImagePipeline": "image",
        "QwenImageEditPipeline": "image",
        "QwenImageEditPlusPipeline": "image",
    },
    runner="pipelines.qwenimage:QwenImageRunner",
    plan="parallel.qwenimage:QWENIMAGE_PLAN",
    guidance="true_cfg",
    default_true_cfg=4.0,  # the pipelines' default true_cfg_scale
    edit_pipelines=frozenset({"QwenImageEditPipeline", "QwenImageEditPlusPipeline"}),
    img2img=True,  # QwenImagePipeline folders; the edit folders take their images as references
    inpainting=True,  # QwenImagePipeline folders, as QwenImageInpaintPipeline
    # QwenImageEditInpaintPipeline (its default strength); it sizes its output as the edit pipelines do.
    # diffusers has no inpaint pipeline for Edit Plus (2509/2511): a mask there is refused.
    inpainting_edits={"QwenImageEditPipeline": 0.6},
    max_references=MAX_PLUS_REFERENCES,
    pipeline_references={"QwenImageEditPipeline": 1},
    references_required=frozenset({"QwenImageEditPipeline", "QwenImageEditPlusPipeline"}),
    size_multiple=lambda folder: vae_spatial_factor(folder) * 2,  # latents packed in 2×2 patches
    refuse=_refuse,
    checkpoints=((r"(?<![a-z])qwen-?image", 24),),
    typical_heads=24,
    edit_size=lambda folder, sizes: edit_size(folder, sizes[-1]),  # Edit: one reference; Plus: the last
    # the pipelines' default_sample_size (128 latents) × the VAE's factor: 1024² (also the size
    # QwenImageImg2ImgPipeline / QwenImageInpaintPipeline draw an image-to-image request without a size at)
    default_size=lambda folder: (128 * vae_spatial_factor(folder),) * 2,
)
