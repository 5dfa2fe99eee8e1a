"""FLUX.2 dev (``Flux2Pipeline``): Mistral3 text encoder, double- then single-stream blocks with shared
modulation, packed latents with batch-norm statistics in the VAE, distilled guidance (one branch), and
reference images for editing (their tokens join the image tokens with their own rotary ids)."""

import math

from . import Family, Folder, vae_spatial_factor

# Flux2Pipeline / Flux2KleinPipeline bring a reference above this many pixels down to it
MAX_REFERENCE_AREA = 1024 * 1024


def reference_size(folder: Folder, references: list[tuple[int, int]]) -> tuple[int, int]:
    """The output (width, height) of an edit that names no size: the first reference's size as the pipelines
    take it without height and width — scaled down to 1024² pixels where it has more (its aspect kept, the
    sides truncated as ``Flux2ImageProcessor._resize_to_target_area``), floored to the size multiple."""
    width, height = references[0]
    if width * height > MAX_REFERENCE_AREA:
        scale = math.sqrt(MAX_REFERENCE_AREA / (width * height))
        width, height = int(width * scale), int(height * scale)
    multiple = vae_spatial_factor(folder) * 2
    return width // multiple * multiple, height // multiple * multiple


FAMILY = Family(
    name="flux2",
    pipelines={"Flux2Pipeline": "image"},
    runner="pipelines.flux2:Flux2Runner",
    plan="parallel.flux2:FLUX2_PLAN",
    guidance="distilled",
    single_branch=lambda folder: "its guidance is distilled, an embedding",
    negative_prompt=False,
    edit_pipelines=frozenset({"Flux2Pipeline"}),
    # diffusers takes any number; BFL documents up to 10 references for FLUX.2 dev (each adds its tokens
    # to every step's sequence)
    max_references=10,
    edit_size=reference_size,
    # the pipeline's default_sample_size (128 latents) × the VAE's factor: 1024²
    default_size=lambda folder: (128 * vae_spatial_factor(folder),) * 2,
    size_multiple=lambda folder: vae_spatial_factor(folder) * 2,  # latents packed in 2×2 patches
    checkpoints=((r"(?<![a-z])flux\.?2(?![0-9]).*dev", 48),),
    typical_heads=48,
)
