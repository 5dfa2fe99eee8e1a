"""FLUX.2 Klein (``Flux2KleinPipeline``): FLUX.2's transformer without a guidance embedding, a Qwen3 text
encoder, true classifier-free guidance against the empty prompt (no user negative prompt) unless the
folder is step-distilled, and the same reference-image editing as FLUX.2 dev; with a mask, inpainting as
``Flux2KleinInpaintPipeline``."""

from . import Family, vae_spatial_factor
from .flux2 import reference_size

FAMILY = Family(
    name="flux2_klein",
    pipelines={"Flux2KleinPipeline": "image"},
    runner="pipelines.flux2:Flux2KleinRunner",
    plan="parallel.flux2:FLUX2_PLAN",
    guidance="cfg",
    # Flux2KleinPipeline skips guidance for a step-distilled folder whatever guidance_scale says
    single_branch=lambda folder: (
        "its folder is step-distilled: model_index.json's is_distilled"
        if folder.index.get("is_distilled")
        else None
    ),
    negative_prompt=False,
    edit_pipelines=frozenset({"Flux2KleinPipeline"}),
    max_references=10,
    # with a mask: Flux2KleinInpaintPipeline (the image is the start image and the first reference), its
    # default strength; its size without one is the edit's (the image at most 1024² pixels, floored)
    inpainting_edits={"Flux2KleinPipeline": 0.8},
    edit_size=reference_size,  # as Flux2Pipeline: the first reference's size, at most 1024² pixels
    # the pipeline's default_sample_size (128 latents) × the VAE's factor: 1024²
    default_size=lambda folder: (128 * vae_spatial_factor(folder),) * 2,
    size_multiple=lambda folder: vae_spatial_factor(folder) * 2,
    checkpoints=((r"(?<![a-z])flux\.?2.*klein.*9b", 32), (r"(?<![a-z])flux\.?2.*klein", 24)),
    typical_heads=24,
)
