"""FLUX.1 (dev / schnell): double- then single-stream joint attention over [text; image], packed 2×2
latents, distilled guidance, optional true CFG with a negative prompt; image-to-image from an uploaded image
(``FluxImg2ImgPipeline``'s arithmetic), inpainting with a mask (``FluxInpaintPipeline``'s). FLUX.1 Kontext
(``FluxKontextPipeline``) is the same transformer with one reference image's latent tokens after the
generated ones (POST /v1/images/edits); with a mask, that image is also the start image
(``FluxKontextInpaintPipeline``'s)."""

from . import Family, Folder, vae_spatial_factor


def kontext_inpaint_size(folder: Folder, image: tuple[int, int]) -> tuple[int, int]:
    """The output (width, height) of a masked Kontext edit that names no size: the preferred Kontext
    resolution nearest the image's aspect (its sides first floored to the size multiple), floored to the
    multiple, as ``FluxKontextInpaintPipeline`` sizes it."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    multiple = vae_spatial_factor(folder) * 2
    width, height = (max(multiple, side // multiple * multiple) for side in image)
    _, width, height = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return width // multiple * multiple, height // multiple * multiple


def kontext_edit_size(folder: Folder, references: list[tuple[int, int]]) -> tuple[int, int]:
    """The output (width, height) of a Kontext edit that names no size: ``FluxKontextPipeline`` draws its
    default square brought to its ``max_area`` of 1024² pixels (1024×1024, floored to the size multiple)
    whatever the reference's size; the reference itself goes in at the preferred Kontext resolution of its
    aspect."""
    multiple = vae_spatial_factor(folder) * 2
    side = 1024 // multiple * multiple
    return side, side


def default_size(folder: Folder) -> tuple[int, int]:
    """Without a size: FluxPipeline's default_sample_size (128 latents) × the VAE's factor (1024² for FLUX.1's
    8×); FluxKontextPipeline brings that square to its max_area of 1024² pixels whatever the VAE, as an edit
    without a size."""
    if folder.index.get("_class_name") == "FluxKontextPipeline":
        return kontext_edit_size(folder, [])
    return (128 * vae_spatial_factor(folder),) * 2


FAMILY = Family(
    name="flux",
    pipelines={"FluxPipeline": "image", "FluxKontextPipeline": "image"},
    runner="pipelines.flux:FluxRunner",
    plan="parallel.flux:FLUX_PLAN",
    guidance="true_cfg",
    edit_pipelines=frozenset({"FluxKontextPipeline"}),
    max_references=1,
    img2img=True,
    inpainting=True,  # FluxPipeline folders (image-to-image, FluxInpaintPipeline)
    inpainting_edits={"FluxKontextPipeline": 1.0},  # FluxKontextInpaintPipeline and its default strength
    # without a size: Kontext edits 1024² (kontext_edit_size), masked ones the preferred resolution of the
    # image's aspect; FluxPipeline folders' image-to-image and inpainting the default 1024² (FluxImg2Img-
    # and FluxInpaintPipeline's default_sample_size × the VAE's factor), the start image resized to it
    edit_size=kontext_edit_size,
    inpainting_edit_size=kontext_inpaint_size,
    size_multiple=lambda folder: vae_spatial_factor(folder) * 2,  # latents packed in 2×2 patches
    default_size=default_size,
    lora_alphas=True,
    checkpoints=((r"(?<![a-z])flux\.?1(?![0-9])", 24),),
    typical_heads=24,
)
