"""Stable Diffusion 3 / 3.5 (medium, large, large turbo): MM-DiT joint attention over [image; text] with
separate projections per stream (3.5 medium adds an image-only ``attn2`` to its first blocks), three text
encoders (two CLIPs give the pooled vector, T5 the sequence), classifier-free guidance whenever
guidance_scale > 1, FlowMatchEuler with the scheduler's own shift; image-to-image from an uploaded image
(``StableDiffusion3Img2ImgPipeline``'s arithmetic)."""

from . import Family, Folder, vae_spatial_factor


def _refuse(folder: Folder) -> str | None:
    transformer = folder.config("transformer").get("_class_name", "SD3Transformer2DModel")
    if transformer != "SD3Transformer2DModel":
        return (
            f"a StableDiffusion3Pipeline folder with a {transformer} transformer is not supported; "
            "supported: SD3Transformer2DModel (SD3 medium, SD3.5 medium / large / large turbo)."
        )
    return None


def _default_size(folder: Folder) -> tuple[int, int]:
    """The pipeline's default: the transformer's sample_size in latents (128 for SD3/3.5: 1024²)."""
    side = int(folder.config("transformer").get("sample_size", 128)) * vae_spatial_factor(folder)
    return side, side


FAMILY = Family(
    name="sd3",
    pipelines={"StableDiffusion3Pipeline": "image"},
    runner="pipelines.sd3:SD3Runner",
    plan="parallel.sd3:SD3_PLAN",
    guidance="cfg",
    img2img=True,
    inpainting=True,  # with image-to-image's start image, as the family's inpaint pipeline
    # without T5 the pipeline conditions on zeros in its place (a common low-memory setup)
    optional_components=frozenset({"text_encoder_3", "tokenizer_3"}),
    refuse=_refuse,
    default_size=_default_size,
    # size multiple: the VAE's 8× times the transformer's patch_size 2 (the default rule reads both)
    checkpoints=(
        (r"(?<![a-z])(stable-diffusion-|sd)3\.5[-_]large", 38),
        (r"(?<![a-z])(stable-diffusion-|sd)3(\.5)?[-_]medium", 24),
    ),
    typical_heads=38,
)
