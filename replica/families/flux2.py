"""FLUX.2 dev (``Flux2Pipeline``): Mistral3 text encoder, double- then single-stream blocks with shared
modulation, packed latents with batch-norm statistics in the VAE, distilled guidance (one branch), and
reference images for editing (their tokens join the image tokens with their own rotary ids)."""

from . import Family, vae_spatial_factor

FAMILY = Family(
    name="flux2",
    pipelines={"Flux2Pipeline": "image"},
    runner="pipelines.flux2:Flux2Runner",
    plan="parallel.flux2:FLUX2_PLAN",
    guidance="distilled",
    negative_prompt=False,
    edit_pipelines=frozenset({"Flux2Pipeline"}),
    # diffusers takes any number; BFL documents up to 10 references for FLUX.2 dev (each adds its tokens
    # to every step's sequence)
    max_references=10,
    size_multiple=lambda folder: vae_spatial_factor(folder) * 2,  # latents packed in 2×2 patches
    checkpoints=((r"(?<![a-z])flux\.?2(?![0-9]).*dev", 48),),
    typical_heads=48,
)
