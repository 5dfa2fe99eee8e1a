"""FLUX.1 (dev / schnell): double- then single-stream joint attention over [text; image], packed 2×2
latents, distilled guidance, optional true CFG with a negative prompt; image-to-image from an uploaded image
(``FluxImg2ImgPipeline``'s arithmetic), inpainting with a mask (``FluxInpaintPipeline``'s). FLUX.1 Kontext
(``FluxKontextPipeline``) is the same transformer with one reference image's latent tokens after the
generated ones (POST /v1/images/edits)."""

from . import Family, vae_spatial_factor

FAMILY = Family(
    name="flux",
    pipelines={"FluxPipeline": "image", "FluxKontextPipeline": "image"},
    runner="pipelines.flux:FluxRunner",
    plan="parallel.flux:FLUX_PLAN",
    guidance="true_cfg",
    edit_pipelines=frozenset({"FluxKontextPipeline"}),
    max_references=1,
    img2img=True,
    inpainting=True,  # FluxPipeline folders (image-to-image); Kontext folders take no mask
    size_multiple=lambda folder: vae_spatial_factor(folder) * 2,  # latents packed in 2×2 patches
    lora_alphas=True,
    checkpoints=((r"(?<![a-z])flux\.?1(?![0-9])", 24),),
    typical_heads=24,
)
