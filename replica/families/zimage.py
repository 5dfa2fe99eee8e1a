"""Z-Image (base, Turbo): a single-stream DiT over [image; caption] tokens (each padded to a multiple of
32, 3-axis rotary positions, refiner blocks per stream first), a Qwen3 text encoder whose masked hidden
states give each prompt its own length, classifier-free guidance whenever guidance_scale > 0 with
ZImagePipeline's arithmetic (cond + scale·(cond − uncond), optional norm cap and truncation); image-to-image
from an uploaded image (``ZImageImg2ImgPipeline``'s arithmetic)."""

from . import Family, Folder, vae_spatial_factor


def _refuse(folder: Folder) -> str | None:
    config = folder.config("transformer")
    if config.get("siglip_feat_dim") is not None:
        return (
            "a ZImagePipeline folder whose transformer has SigLIP inputs (siglip_feat_dim: Z-Image Omni) is not "
            "supported; supported: Z-Image and Z-Image-Turbo text-to-image folders."
        )
    patches = list(zip(config.get("all_patch_size", [2]), config.get("all_f_patch_size", [1]), strict=False))
    if (2, 1) not in [tuple(p) for p in patches]:
        return (
            f"a ZImagePipeline folder whose transformer has no 2×2 patch embedding (all_patch_size "
            f"{config.get('all_patch_size')}, all_f_patch_size {config.get('all_f_patch_size')}) cannot run "
            "the pipeline's default patch size; supported: Z-Image / Z-Image-Turbo folders."
        )
    return None


def _refuse_size(folder: Folder, width: int, height: int, chunks: int | None) -> str | None:
    """The rotary table has ``axes_lens`` rows per axis: a larger latent grid has no positions (it failed the
    batch's forward with an IndexError)."""
    config = folder.config("transformer")
    side = list(config.get("all_patch_size", [2]))[0] * vae_spatial_factor(folder)
    largest_h, largest_w = (rows * side for rows in list(config.get("axes_lens", [64, 128, 128]))[1:3])
    if height > largest_h or width > largest_w:
        return f"size: {width}x{height} is above this model's largest {largest_w}x{largest_h}"
    return None


FAMILY = Family(
    name="zimage",
    pipelines={"ZImagePipeline": "image"},
    runner="pipelines.zimage:ZImageRunner",
    plan="parallel.zimage:ZIMAGE_PLAN",
    guidance="cfg",
    img2img=True,
    inpainting=True,  # with image-to-image's start image, as the family's inpaint pipeline
    inpainting_strength=1.0,  # ZImageInpaintPipeline's default (its img2img pipeline's is 0.6)
    # without a size, ZImageImg2ImgPipeline and ZImageInpaintPipeline draw at the start image's own size
    # (floored to the size multiple)
    img2img_size=lambda folder, image: image,
    size_multiple=lambda folder: vae_spatial_factor(folder) * 2,  # 2×2 patches of the 8× VAE's latents
    heads=lambda config: int(config["n_heads"]),
    refuse=_refuse,
    refuse_size=_refuse_size,
    checkpoints=((r"(?<![a-z])z-?image", 30),),
    typical_heads=30,
)
