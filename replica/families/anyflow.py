"""AnyFlow-FAR: a causal Wan 2.1 that generates video chunk by chunk (flow-map steps per chunk,
block-causal attention to the past chunks through a K/V cache). Text-to-video, image-to-video from a first
frame, and realtime video sessions (``ws /v1/realtime_video/generate``: one chunk at a time, the prompt may
change between chunks).

Sharding: Ulysses (``--ulysses-degree``) over each forward's tokens, the K/V cache sharded by heads the
same way (``parallel/anyflow.py``). TP, ring, K/V-gather and CFG-parallel are refused naming the flags
(the cache and the flex block mask are not sharded for them); scale sessions with --dp-size."""

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
        "parallel_axes": ("ulysses",),  # the K/V cache is sharded by heads (parallel/anyflow.py)
    },
    **_FIRST_FRAME,
)
