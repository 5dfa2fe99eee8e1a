"""Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.1 I2V (CLIP image tokens beside the text) and
Wan 2.2 I2V A14B (two experts). The first frame is required (POST /v1/videos ``input_reference``); it is
VAE-encoded into conditioning channels, and Wan 2.1's also into CLIP image tokens."""

from . import Family, Folder
from .wan import frame_multiple, refuse_experts, refuse_rope_size


def _refuse(folder: Folder) -> str | None:
    refused = refuse_experts(folder)
    if refused:
        return refused
    if folder.config("transformer").get("pos_embed_seq_len"):
        # its image tokens come in first + last frame pairs: one first frame fails the forward (a reshape)
        return (
            "a first-last-frame folder (Wan 2.1 FLF2V: the transformer's pos_embed_seq_len pairs the two "
            "frames' image tokens) is not supported: a request gives the first frame only. Supported: Wan 2.1 "
            "I2V and Wan 2.2 I2V A14B folders."
        )
    if folder.config("transformer").get("image_dim") is not None and not folder.has("image_encoder"):
        return (
            "the transformer takes CLIP image tokens (image_dim) but the folder has no image_encoder; "
            "a Wan 2.1 I2V folder has image_encoder and image_processor."
        )
    return None


FAMILY = Family(
    name="wan_i2v",
    default_size=lambda folder: (832, 480),  # the pipeline's 480p default
    pipelines={"WanImageToVideoPipeline": "video"},
    runner="pipelines.wan_i2v:WanI2VRunner",
    plan="parallel.wan:WAN_PLAN",
    guidance="cfg",
    frame_multiple=frame_multiple,
    first_frame=lambda folder: "required",
    refuse=_refuse,
    refuse_size=refuse_rope_size,
    checkpoints=(
        (r"(?<![a-z])wan-?2\.1.*i2v", 40),
        (r"(?<![a-z])wan-?2\.2.*i2v", 40),
    ),
    typical_heads=40,
)
