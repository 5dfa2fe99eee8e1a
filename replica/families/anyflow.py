"""AnyFlow-FAR: a causal Wan 2.1 that generates video chunk by chunk (flow-map steps per chunk,
block-causal attention to the past chunks through a K/V cache). Text-to-video, image-to-video from a first
frame, and realtime video sessions (``ws /v1/realtime_video/generate``: one chunk at a time, the prompt may
change between chunks).

One rank per replica: the K/V cache of a session would have to be sharded like the chunk's tokens (Ulysses
by heads, ring by tokens) and the diffusers processor attends through flex attention with a block mask;
neither is sharded here yet, so a sharded layout is refused (naming the flags) rather than served wrong.
Scale sessions with --dp-size."""

from . import Family, Folder


def _frame_multiple(folder: Folder) -> int:
    return int(folder.config("vae").get("scale_factor_temporal", 4))


_FIRST_FRAME = (
    {"first_frame": lambda folder: "optional"} if "first_frame" in Family.__dataclass_fields__ else {}
)

FAMILY = Family(
    name="anyflow",
    pipelines={"AnyFlowFARPipeline": "video"},
    runner="pipelines.anyflow:AnyFlowRunner",
    plan="parallel.anyflow:ANYFLOW_PLAN",
    guidance="cfg",
    frame_multiple=_frame_multiple,
    checkpoints=((r"anyflow.*far.*1\.3b", 12), (r"anyflow.*far", 40)),
    typical_heads=12,
    extra={
        "realtime": True,
        "single_rank": "its K/V cache across chunks is not sharded yet",
    },
    **_FIRST_FRAME,
)
