"""AnyFlow-FAR: a causal Wan 2.1 that generates video chunk by chunk (flow-map steps per chunk,
block-causal attention to the past chunks through a K/V cache). Text-to-video, image-to-video from a first
frame, and realtime video sessions (``ws /v1/realtime_video/generate``: one chunk at a time, the prompt may
change between chunks).

Sharding: Ulysses (``--ulysses-degree``) and ring (``--ring-degree``) over each forward's tokens, the K/V
cache sharded the same way (by heads, and by tokens over the ring: ``parallel/anyflow.py``). TP,
K/V-gather and CFG-parallel are refused naming the flags (the runner's own chunk loop does not shard for
them); scale sessions with --dp-size."""

from . import Family, Folder, vae_spatial_factor
from .wan import refuse_rope_size


def _frame_multiple(folder: Folder) -> int:
    return int(folder.config("vae").get("scale_factor_temporal", 4))


def chunk_partition(latent_frames: int, default: tuple[int, ...]) -> list[int]:
    """Latent frames per chunk of a whole video: the model's own partition when it fits, else a first chunk
    of one frame then chunks of the model's usual length (the last one shorter)."""
    if sum(default) == latent_frames:
        return list(default)
    size = max(default)
    out, left = [1], latent_frames - 1
    while left > 0:
        out.append(min(size, left))
        left -= out[-1]
    return out


def _video_chunks(folder: Folder, num_frames: int) -> int:
    latent_frames = (num_frames - 1) // _frame_multiple(folder) + 1
    default = tuple(folder.config("transformer").get("chunk_partition") or (1, 3, 3, 3, 3, 3, 3, 2))
    return len(chunk_partition(latent_frames, default))


def _refuse_size(folder: Folder, width: int, height: int, chunks: int | None) -> str | None:
    """Sizes past the rotary table (as Wan's); and, as the chunks older than the last ``full_chunk_limit -
    1`` are kept as compressed latent patches, a rollout past ``full_chunk_limit`` chunks needs latents at
    least one such patch wide and high (a smaller one does not fit the patch, and the chunk after them
    fails)."""
    refused = refuse_rope_size(folder, width, height)
    if refused is not None:
        return refused
    config = folder.config("transformer")
    patch, full = config.get("compressed_patch_size"), config.get("full_chunk_limit")
    if not patch or not full or (chunks is not None and chunks <= full):
        return None
    least = vae_spatial_factor(folder) * max(patch[1:])
    if min(width, height) >= least:
        return None
    return (
        f"size: {width}x{height} is too small past {full} chunks: width and height must be at least {least} "
        f"(older chunks are kept as {patch[1]}x{patch[2]} latent patches), or the video at most {full} chunks"
    )


_FIRST_FRAME = (
    {"first_frame": lambda folder: "optional"} if "first_frame" in Family.__dataclass_fields__ else {}
)

FAMILY = Family(
    name="anyflow",
    default_size=lambda folder: (832, 480),  # the pipeline's 480p default
    step_cache=False,  # its flow-map chunk loop has no cache hooks yet
    pipelines={"AnyFlowFARPipeline": "video"},
    runner="pipelines.anyflow:AnyFlowRunner",
    plan="parallel.anyflow:ANYFLOW_PLAN",
    guidance="cfg",
    frame_multiple=_frame_multiple,
    refuse_size=_refuse_size,
    video_chunks=_video_chunks,
    checkpoints=((r"anyflow.*far.*1\.3b", 12), (r"anyflow.*far", 40)),
    typical_heads=12,
    extra={
        "realtime": True,
        # The K/V cache is sharded by heads (Ulysses) and by tokens (ring): parallel/anyflow.py.
        "parallel_axes": ("ulysses", "ring"),
    },
    **_FIRST_FRAME,
)
