"""Per-replica metrics through Ray Serve's metrics API: the Ray dashboard and Prometheus show them.

Ray exports them from every node's metrics agent (``--metrics-export-port``) with a ``ray_`` prefix, and
Serve adds the ``deployment``, ``replica`` and ``application`` tags. Gauges are sampled by a background
thread (``start``); request and step latencies are observed where they happen. deploy/grafana/ditserve.json
has one panel per metric.

| metric (Prometheus name)                  | kind      | from                                        |
|-------------------------------------------|-----------|---------------------------------------------|
| ray_ditserve_queue_depth                  | gauge     | Engine.stats()["queue_depth"]               |
| ray_ditserve_running_batch_size           | gauge     | Engine.stats()["running"]                   |
| ray_ditserve_step_latency_seconds         | histogram | every denoising step (Engine.step_listeners)|
| ray_ditserve_steps_total                  | counter   | the same                                    |
| ray_ditserve_request_latency_seconds      | histogram | EngineReplica, per request, tag ``status``  |
| ray_ditserve_requests_total               | counter   | the same                                    |
| ray_ditserve_active_sessions              | gauge     | EngineReplica.sessions                      |
| ray_ditserve_lora_slots_in_use            | gauge     | Engine stats, else the applied LoRAs        |
| ray_ditserve_lora_slots                   | gauge     | --max-loras                                 |
| ray_ditserve_control_state_version        | gauge     | the control state this replica has applied  |
| ray_ditserve_device_memory_bytes          | gauge     | NVML per GPU of the ranks (tag ``device``), |
|                                           |           | on CPU the replica's resident memory        |

Realtime video sessions (``replica_realtime``, created with a replica's first session):
``ray_ditserve_realtime_sessions`` (gauge: open sessions) and ``ray_ditserve_realtime_chunk_latency_seconds``
(histogram, tag ``status``: from queueing a chunk to its encoded frames).

Tag ``status``: ``ok``, or the kind of the typed error the replica answered (``QueueFull``, ``BadRequest``,
``ReplicaUnavailable``, ... of ``errors.py``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from typing import Any

from ray.serve.metrics import Counter, Gauge, Histogram

logger = logging.getLogger("ditserve")

# The Prometheus names (Ray prefixes "ray_"; histograms export _bucket/_count/_sum series).
EXPORTED = (
    "ray_ditserve_queue_depth",
    "ray_ditserve_running_batch_size",
    "ray_ditserve_step_latency_seconds",
    "ray_ditserve_steps_total",
    "ray_ditserve_request_latency_seconds",
    "ray_ditserve_requests_total",
    "ray_ditserve_active_sessions",
    "ray_ditserve_lora_slots_in_use",
    "ray_ditserve_lora_slots",
    "ray_ditserve_control_state_version",
    "ray_ditserve_device_memory_bytes",
    "ray_ditserve_cache_forwards_total",
)
HISTOGRAMS = ("ray_ditserve_step_latency_seconds", "ray_ditserve_request_latency_seconds")
# Seconds; a step of a small image is milliseconds, a video step on 8 GPUs can take many seconds.
STEP_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
REQUEST_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]


def _stat(stats: dict[str, Any], obj: Any, key: str, default: float = 0) -> float:
    """A number from ``stats`` if the engine reports it, else an attribute (called if callable)."""
    if key in stats:
        return float(stats[key])
    value = getattr(obj, key, default)
    return float(value() if callable(value) else value)


class ReplicaMetrics:
    """The metrics of one engine replica; thread-safe to observe from the engine loop and the replica."""

    def __init__(self, replica_id: str, model: str, max_loras: int = 0, interval_s: float = 2.0):
        self.replica_id = replica_id
        self.interval_s = interval_s
        tags = {"model": model}

        def gauge(name: str, description: str, tag_keys: tuple[str, ...] = ()) -> Gauge:
            g = Gauge(f"ditserve_{name}", description=description, tag_keys=("model", *tag_keys))
            g.set_default_tags(dict(tags))  # Serve adds its tags into the dict it gets
            return g

        self.queue_depth = gauge("queue_depth", "Requests waiting for a slot in the running batch.")
        self.running = gauge("running_batch_size", "Requests in the running batch (denoised together).")
        self.sessions = gauge("active_sessions", "Open sessions (POST /v1/sessions) held by this replica.")
        self.lora_in_use = gauge("lora_slots_in_use", "LoRA adapter slots holding an adapter.")
        self.lora_slots = gauge("lora_slots", "LoRA adapter slots of this replica (--max-loras).")
        self.control_version = gauge("control_state_version", "Version of the control state applied here.")
        self.device_memory = gauge(
            "device_memory_bytes", "Memory used per device of this replica's ranks.", ("device",)
        )
        self.step_latency = Histogram(
            "ditserve_step_latency_seconds",
            description="Time of one denoising step of the running batch, over all ranks.",
            boundaries=STEP_BUCKETS,
            tag_keys=("model",),
        )
        self.step_latency.set_default_tags(dict(tags))  # Serve adds its tags into the dict it gets
        self.steps = Counter("ditserve_steps_total", description="Denoising steps run.", tag_keys=("model",))
        self.steps.set_default_tags(dict(tags))  # Serve adds its tags into the dict it gets
        self.request_latency = Histogram(
            "ditserve_request_latency_seconds",
            description="Time from a request reaching the replica to its result (queue + steps + encode).",
            boundaries=REQUEST_BUCKETS,
            tag_keys=("model", "status"),
        )
        self.request_latency.set_default_tags(dict(tags))  # Serve adds its tags into the dict it gets
        self.requests = Counter(
            "ditserve_requests_total",
            description="Requests answered, by status.",
            tag_keys=("model", "status"),
        )
        self.requests.set_default_tags(dict(tags))  # Serve adds its tags into the dict it gets
        self.cache_forwards = Counter(
            "ditserve_cache_forwards_total",
            description="Transformer forwards of finished requests by step-cache policy; cached=true: the "
            "step cache answered them (blocks after the first skipped).",
            tag_keys=("model", "policy", "cached"),
        )
        self.cache_forwards.set_default_tags(dict(tags))
        self.lora_slots.set(max_loras)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- events ---------------------------------------------------------------------------------------
    def observe_request(self, latency_s: float, status: str = "ok") -> None:
        self.request_latency.observe(latency_s, tags={"status": status})
        self.requests.inc(tags={"status": status})

    def observe_usage(self, usage: dict[str, Any]) -> None:
        """A finished request's usage: its forwards, computed and cached, under its cache policy."""
        if not usage:
            return
        policy = str(usage.get("cache_policy", "none"))
        cached = int(usage.get("cached_forwards", 0))
        computed = int(usage.get("transformer_forwards", 0)) - cached
        if computed > 0:
            self.cache_forwards.inc(computed, tags={"policy": policy, "cached": "false"})
        if cached > 0:
            self.cache_forwards.inc(cached, tags={"policy": policy, "cached": "true"})

    def observe_step(self, batch_size: int, latency_s: float) -> None:
        """Engine step listener (called in the engine loop thread after every step)."""
        self.step_latency.observe(latency_s)
        self.steps.inc()

    # -- sampled gauges -------------------------------------------------------------------------------
    def refresh(self, engine: Any, replica: Any = None) -> None:
        """Sample the gauges from ``engine.stats()`` and, where the engine has no number, the replica."""
        stats = engine.stats()
        self.queue_depth.set(_stat(stats, engine, "queue_depth"))
        self.running.set(_stat(stats, engine, "running"))
        sessions = getattr(replica, "sessions", None)
        self.sessions.set(_stat(stats, engine, "active_sessions", len(sessions) if sessions else 0))
        applied = getattr(replica, "applied", None) or {}
        self.lora_in_use.set(_stat(stats, engine, "lora_slots_in_use", len(applied.get("loras", {}))))
        self.control_version.set(_stat(stats, engine, "control_version", applied.get("version", 0)))
        for device, used in device_memory(engine).items():
            self.device_memory.set(used, tags={"device": device})

    def start(self, engine: Any, replica: Any = None) -> ReplicaMetrics:
        """Refresh every ``interval_s`` in a daemon thread until :meth:`stop`."""

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.refresh(engine, replica)
                except Exception:  # metrics must never take the replica down
                    logger.exception("metrics refresh failed")
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=loop, name="ditserve-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def device_memory(engine: Any) -> dict[str, float]:
    """Bytes used per device of this replica: ``cuda:<id>`` from NVML (no CUDA context is created here,
    the ranks own the devices), or ``cpu``: this process's resident memory (ranks in Ray actors on other
    processes are not counted)."""
    if getattr(engine.config, "device", "cpu") == "cuda":
        import ray

        here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        ranks = getattr(getattr(engine, "launcher", None), "ranks", [])
        gpu_ids = sorted({g for r in ranks if r.get("node_id") in (None, here) for g in r.get("gpu_ids", [])})
        return _nvidia_smi_used(gpu_ids)
    import psutil

    return {"cpu": float(psutil.Process(os.getpid()).memory_info().rss)}


def _nvidia_smi_used(gpu_ids: list[str]) -> dict[str, float]:
    if not gpu_ids:
        return {}
    cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    cmd.append(f"--id={','.join(gpu_ids)}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.strip().splitlines():
        index, mib = (part.strip() for part in line.split(","))
        used[f"cuda:{index}"] = float(mib) * 2**20
    return used
