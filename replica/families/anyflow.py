"""AnyFlow-FAR: a causal Wan 2.1 that generates video chunk by chunk (flow-map steps per chunk,
block-causal attention to the past chunks through a K/V cache). Text-to-video, image-to-video from a first
frame, and realtime video sessions (``ws /v1/realtime_video/generate``: one chunk at a time, the prompt may
change between chunks).

Sharding: Ulysses (``--ulysses-degree``) and ring (``--ring-degree``) over each forward's tokens, the K/V
cache sharded the same way (by heads, and by tokens over the ring: ``parallel/anyflow.py``). TP,
K/V-gather and CFG-parallel are refused naming the flags (the runner's own chunk loop does not shard for
them); scale sessions with --dp-size."""

from . import Family, Folder


def _frame_multiple(folder: Folder) -> int:
    return int(folder.config("vae").get("scale_factor_temporal", 4))


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
    checkpoints=((r"anyflow.*far.*1\.3b", 12), (r"anyflow.*far", 40)),
    typical_heads=12,
    extra={
        "realtime": True,
        # The K/V cache is sharded by heads (Ulysses) and by tokens (ring): parallel/anyflow.py.
        "parallel_axes": ("ulysses", "ring"),
    },
    **_FIRST_FRAME,
)
