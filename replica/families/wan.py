"""Wan 2.1 text-to-video: one transformer, self-attention over the video tokens, cross-attention to the
text, classifier-free guidance whenever guidance_scale > 1."""

from . import Family, Folder


def _frame_multiple(folder: Folder) -> int:
    return 2 ** sum(bool(x) for x in folder.config("vae").get("temperal_downsample", []))


def _refuse(folder: Folder) -> str | None:
    if folder.has("transformer_2") or folder.index.get("boundary_ratio") is not None:
        return (
            f"a Wan 2.2 folder with two experts (transformer_2, boundary_ratio="
            f"{folder.index.get('boundary_ratio')}) is not supported yet; serving the first expert alone would "
            "draw wrong videos. Supported: Wan 2.1 text-to-video folders (one transformer)."
        )
    if folder.index.get("expand_timesteps"):
        return (
            "a Wan 2.2 TI2V folder (expand_timesteps: per-frame timesteps) is not supported yet. "
            "Supported: Wan 2.1 text-to-video folders."
        )
    return None


FAMILY = Family(
    name="wan",
    pipelines={"WanPipeline": "video"},
    runner="pipelines.wan:WanRunner",
    plan="parallel.wan:WAN_PLAN",
    guidance="cfg",
    frame_multiple=_frame_multiple,
    refuse=_refuse,
    checkpoints=(
        (r"(?<![a-z])wan-?2\.1.*(?<![0-9.])1\.3b", 12),
        (r"(?<![a-z])wan-?2\.1(?![0-9])", 40),
    ),
    typical_heads=40,
)
