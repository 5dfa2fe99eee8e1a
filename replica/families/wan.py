"""Wan text-to-video (``WanPipeline``): Wan 2.1 (one transformer), Wan 2.2 A14B (two experts switching at
``boundary_ratio``, each with its own CFG scale) and Wan 2.2 TI2V-5B (per-token timesteps, its own VAE,
text or text + first frame). Self-attention over the video tokens, cross-attention to the text,
classifier-free guidance whenever guidance_scale > 1."""

from . import Family, FirstFrame, Folder, vae_spatial_factor


def frame_multiple(folder: Folder) -> int:
    return 2 ** sum(bool(x) for x in folder.config("vae").get("temperal_downsample", []))


def refuse_experts(folder: Folder) -> str | None:
    """A two-expert folder needs both experts and the boundary between them."""
    if not folder.has("transformer"):
        return (
            "a Wan folder without `transformer` (only transformer_2) is not supported; give a folder with "
            "both experts (Wan 2.2 A14B) or one transformer (Wan 2.1, TI2V-5B)."
        )
    two, ratio = folder.has("transformer_2"), folder.index.get("boundary_ratio")
    if two != (ratio is not None):
        return (
            f"transformer_2 and boundary_ratio come together (found transformer_2: {two}, boundary_ratio: "
            f"{ratio}); a Wan 2.2 A14B folder has both, a Wan 2.1 folder neither."
        )
    if two and not folder.config("transformer_2"):
        return "model_index.json lists transformer_2 but the folder has no transformer_2/config.json"
    if two and folder.config("transformer_2").get("num_attention_heads") != folder.config("transformer").get(
        "num_attention_heads"
    ):
        return "the two experts have different attention heads; both are sharded by one layout"
    return None


def refuse_rope_size(folder: Folder, width: int, height: int, chunks: int | None = None) -> str | None:
    """The transformer's rotary table has ``rope_max_seq_len`` positions per axis (rows and columns of
    patches): a larger frame has no positions (it failed the whole batch's forward in the rotary
    embedding)."""
    config = folder.config("transformer")
    limit, patch = config.get("rope_max_seq_len"), config.get("patch_size")
    if not limit or not patch:
        return None
    factor = vae_spatial_factor(folder)
    most_w, most_h = limit * patch[2] * factor, limit * patch[1] * factor
    if width > most_w or height > most_h:
        return f"size: {width}x{height} is above this model's largest {most_w}x{most_h}"
    return None


def _first_frame(folder: Folder) -> FirstFrame:
    # TI2V-5B takes a first frame as WanImageToVideoPipeline does for it; Wan 2.1 / 2.2 A14B T2V do not.
    return "optional" if folder.index.get("expand_timesteps") else "none"


FAMILY = Family(
    name="wan",
    default_size=lambda folder: (832, 480),  # the pipeline's 480p default
    pipelines={"WanPipeline": "video"},
    runner="pipelines.wan:WanRunner",
    plan="parallel.wan:WAN_PLAN",
    guidance="cfg",
    frame_multiple=frame_multiple,
    first_frame=_first_frame,
    fps=lambda folder: 24 if folder.index.get("expand_timesteps") else 16,  # TI2V-5B: 24; 2.1, A14B: 16
    refuse=refuse_experts,
    refuse_size=refuse_rope_size,
    checkpoints=(
        # image-to-video folders (i2v, not ti2v) are wan_i2v's
        (r"(?<![a-z])wan-?2\.1(?!.*(?<!t)i2v).*(?<![0-9.])1\.3b", 12),
        (r"(?<![a-z])wan-?2\.1(?![0-9])(?!.*(?<!t)i2v)", 40),
        (r"(?<![a-z])wan-?2\.2(?!.*(?<!t)i2v).*(?<![0-9.])5b", 24),
        (r"(?<![a-z])wan-?2\.2(?![0-9])(?!.*(?<!t)i2v)", 40),
    ),
    typical_heads=40,
)
