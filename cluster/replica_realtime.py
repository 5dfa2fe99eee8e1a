"""Realtime video sessions on an engine replica (a mixin of ``EngineReplica``).

A session (``ws /v1/realtime_video/generate``, ``api_realtime``) is opened on a replica chosen round-robin;
its id ``<replica_id>.<token>`` pins every later call to that replica (``router.SessionRouter``), because
the ranks there hold its rollout: the K/V cache of the finished chunks, their latents and the VAE decoder's
causal cache. Each ``realtime_chunk`` call queues one chunk as a job of the engine's step loop (the
realtime bucket takes turns, step by step, with the image/video batches of the other buckets) and answers
when the chunk is denoised; its VAE decode then runs on rank 0 beside the steps that follow, and
``realtime_frames`` waits for its frames and encodes them for the wire (raw RGB, JPEG or WebP). So the
frontend queues chunk k + 1 while chunk k decodes: a steady chunk costs about its steps, not its steps plus
its decode. ``realtime_close`` frees the ranks' state; sessions the frontend forgot (it crashed) expire
after ``session_idle_timeout_s``.

Memory: a session holds its K/V cache on the ranks, ``2 × rows × heads × head_dim × layers × tokens``
values with ``tokens = full_chunk_limit × L × t_full + (chunks - full_chunk_limit + 1) × L × t_compressed``
(L latent frames per chunk, t_full / t_compressed tokens per latent frame at full and FAR-compressed
resolution), per rank ``heads / ulysses`` of them and about ``tokens / ring``: the open answer states one
rank's for the session's cap (``max_chunks`` or ``realtime_max_chunks``), and at most ``max_realtime_sessions`` sessions are open per replica (``QueueFull`` past it).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import secrets
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
from ray.serve.metrics import Gauge, Histogram

from ditserve.replica.launcher import RankDied, RankError
from ditserve.replica.request import GenerationParams
from ditserve.replica.scheduler import QueueFullError

from .errors import BadRequest, NotFound, QueueFull, ServeError, engine_error, param_of

logger = logging.getLogger("ditserve")

CONTENT_TYPES = {"raw": "application/x-raw-rgb", "jpeg": "image/jpeg", "webp": "image/webp"}
CHUNK_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60]


def _bad_request(message: str, replica: str) -> BadRequest:
    return BadRequest(message, param=param_of(message), replica=replica)


def _no_session(session_id: str, replica: str) -> NotFound:
    return NotFound(
        f"session_id: {session_id} does not exist (closed or expired)", param="session_id", replica=replica
    )


JPEG_QUALITY, WEBP_QUALITY = 95, 90  # SGLang's defaults when the init sets no output_compression


def preview_size(width: int, height: int, max_width: int | None) -> tuple[int, int]:
    """The size JPEG / WebP frames are sent at: narrowed to ``max_width`` (aspect kept), never widened."""
    if not max_width or max_width <= 0 or width <= max_width:
        return width, height
    return max_width, max(1, round(height * max_width / width))


def encode_frames(
    frames: np.ndarray, output_format: str, quality: int | None = None, preview_max_width: int | None = None
) -> list[bytes]:
    """uint8 [F, H, W, 3] → one payload per frame: raw RGB rows (row-major, R G B per pixel), or a JPEG /
    WebP file at ``quality`` (1-100), narrowed to ``preview_max_width``."""
    if output_format == "raw":
        return [np.ascontiguousarray(f).tobytes() for f in frames]
    from PIL import Image

    size = preview_size(int(frames.shape[2]), int(frames.shape[1]), preview_max_width)
    out = []
    for frame in frames:
        image = Image.fromarray(frame)
        if image.size != size:
            image = image.resize(size, Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        if output_format == "jpeg":
            image.save(buffer, format="JPEG", quality=quality or JPEG_QUALITY, subsampling=0)
        else:
            image.save(buffer, format="WEBP", quality=quality or WEBP_QUALITY, method=0)
        out.append(buffer.getvalue())
    return out


def session_kv_bytes(
    spec: Any, params: GenerationParams, chunks: int, dtype_bytes: int, *, ring: int = 1, ulysses: int = 1
) -> int:
    """The K/V cache a session of ``chunks`` chunks holds at its longest on each rank of a replica sharded
    over ring degree ``ring`` and Ulysses degree ``ulysses`` (see the module docstring)."""
    from ditserve.replica.families import vae_spatial_factor
    from ditserve.replica.pipelines.anyflow import kv_cache_bytes, session_partition

    config = SimpleNamespace(**spec.transformer_config())
    rows = params.n * (2 if (params.guidance_scale or 1.0) > 1.0 else 1)
    spatial = vae_spatial_factor(spec.folder)
    return kv_cache_bytes(
        config,
        rows=rows,
        partition=session_partition(params.num_frames, max(chunks, 2), spec.frame_multiple),
        height=params.height // spatial,
        width=params.width // spatial,
        dtype_bytes=dtype_bytes,
        ring=ring,
        ulysses=ulysses,
    )


@dataclass(eq=False)
class RealtimeSession:
    session_id: str
    params: GenerationParams  # the init's settings; each chunk replaces the prompt
    max_chunks: int | None
    output_format: str
    quality: int | None = None  # JPEG / WebP quality (the init's output_compression)
    preview_max_width: int | None = None
    next_chunk: int = 0
    # Denoised chunks whose frames are being decoded: chunk index → (frames future, when it was queued).
    decoding: dict[int, tuple[Any, float]] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RealtimeMetrics:
    def __init__(self, model: str):
        self.sessions = Gauge(
            "ditserve_realtime_sessions",
            description="Open realtime video sessions held by this replica.",
            tag_keys=("model",),
        )
        self.sessions.set_default_tags({"model": model})
        self.chunk_latency = Histogram(
            "ditserve_realtime_chunk_latency_seconds",
            description="From queueing a realtime video chunk to its frames, encoded (tag status).",
            boundaries=CHUNK_BUCKETS,
            tag_keys=("model", "status"),
        )
        self.chunk_latency.set_default_tags({"model": model})


class ReplicaRealtime:
    """Realtime video sessions of one replica (``self.engine``, ``self.args``, ``self.replica_id`` are
    ``EngineReplica``'s)."""

    @property
    def realtime(self) -> dict[str, RealtimeSession]:
        if "_realtime" not in self.__dict__:
            self._realtime: dict[str, RealtimeSession] = {}
            self._realtime_metrics = RealtimeMetrics(self.engine.spec.name)
        return self._realtime

    def _realtime_count(self) -> None:
        self._realtime_metrics.sessions.set(len(self.realtime))
        # Wake the opens waiting for a slot (``realtime_open``'s ``wait_s``); they count again.
        changed = self.__dict__.get("_realtime_changed")
        if changed is not None:
            changed.set()
        self._realtime_changed = asyncio.Event()

    async def _wait_for_slot(self, cap: int, wait_s: float) -> bool:
        """Whether a session slot is free, waiting up to ``wait_s`` for one to be released (a session
        closing, or expiring)."""
        deadline = time.monotonic() + wait_s
        while True:
            self._expire_realtime()
            if len(self.realtime) < cap:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if "_realtime_changed" not in self.__dict__:
                self._realtime_changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                # Bounded by the idle expiry's granularity too: expiring is checked here, not signalled.
                await asyncio.wait_for(self._realtime_changed.wait(), min(left, 1.0))

    def _expire_realtime(self) -> None:
        now = time.monotonic()
        idle, lifetime = self.args.session_idle_timeout_s, self.args.session_max_lifetime_s
        for session in list(self.realtime.values()):
            if session.lock.locked():
                continue
            if now - session.last_used > idle or now - session.created > lifetime:
                self._forget_realtime(session.session_id)

    def _forget_realtime(self, session_id: str) -> None:
        if self.realtime.pop(session_id, None) is not None:
            self.engine.close_session(session_id)  # frees the ranks' state between two steps
            self._realtime_count()

    async def realtime_open(
        self,
        params: GenerationParams,
        max_chunks: int | None,
        output_format: str,
        quality: int | None = None,
        preview_max_width: int | None = None,
        wait_s: float = 0.0,
    ) -> dict[str, Any] | ServeError:
        """Open a session. At ``--max-realtime-sessions`` it waits up to ``wait_s`` for a slot (a client
        that closed one session and opens the next at once: its close may still be on its way, or waiting
        for its running chunk to stop), then answers ``QueueFull``."""
        unavailable = self._unavailable()
        if unavailable is not None:
            return unavailable
        try:
            self.engine.check_chunk(params)
        except ValueError as exc:
            return _bad_request(str(exc), self.replica_id)
        # Chunks a session may run: --realtime-max-chunks, and the model's temporal positions (rope).
        config = self.engine.spec.transformer_config()
        per_chunk = params.num_frames // self.engine.spec.frame_multiple
        limit = min(
            self.args.realtime_max_chunks, (int(config.get("rope_max_seq_len", 1024)) - 1) // per_chunk + 1
        )
        if max_chunks is not None and max_chunks > limit:
            return _bad_request(
                f"max_chunks: {max_chunks} is above the maximum {limit} (--realtime-max-chunks "
                f"{self.args.realtime_max_chunks}, and the model's positions at {params.num_frames} frames per chunk)",
                self.replica_id,
            )
        # The init is checked first: a bad one is told its field whichever replica it lands on.
        cap = self.args.max_realtime_sessions
        if not await self._wait_for_slot(cap, wait_s):
            return QueueFull(
                f"max_realtime_sessions: this replica holds {len(self.realtime)} realtime sessions, its maximum "
                f"({cap}); retry later",
                param="max_realtime_sessions",
                retry_after=5,
                replica=self.replica_id,
            )
        session = RealtimeSession(
            f"{self.replica_id}.{secrets.token_hex(16)}",
            params,
            max_chunks,
            output_format,
            quality=quality,
            preview_max_width=preview_max_width,
        )
        self.realtime[session.session_id] = session
        self._realtime_count()
        chunks = max_chunks or limit
        dtype_bytes = 4 if self.config.dtype == "float32" else 2
        dims = self.config.parallel.dims(num_heads=self.engine.spec.num_attention_heads)
        kv = session_kv_bytes(
            self.engine.spec, params, chunks, dtype_bytes, ring=dims.ring, ulysses=dims.ulysses
        )
        logger.info(
            "realtime session %s opened: up to %d chunks, K/V cache %.1f MiB",
            session.session_id,
            chunks,
            kv / 2**20,
        )
        return {
            "replica": self.replica_id,
            "session_id": session.session_id,
            "kv_cache_bytes": kv,
            "chunk_limit": chunks,
        }

    async def realtime_chunk(
        self, session_id: str, chunk_index: int, prompt: str, event_id: int | None
    ) -> dict[str, Any] | ServeError:
        """Denoise chunk ``chunk_index`` of the session with ``prompt``; answers when it is denoised (the next
        chunk may be queued then), while its frames decode: ``realtime_frames`` gives them."""
        session = self.realtime.get(session_id)
        if session is None:
            return _no_session(session_id, self.replica_id)
        async with session.lock:
            session.last_used = time.monotonic()
            if chunk_index != session.next_chunk:
                return _bad_request(
                    f"chunk_index: expected chunk {session.next_chunk}, got {chunk_index}", self.replica_id
                )
            update: dict[str, Any] = {"prompt": prompt}
            if chunk_index > 0:
                update["images"] = ()  # the first frame is chunk 0's
            params = session.params.model_copy(update=update)
            t0 = time.perf_counter()
            unavailable = self._unavailable()
            if unavailable is not None:
                return unavailable
            try:
                chunk = self.engine.submit_chunk(session_id, chunk_index, params, session.max_chunks)
            except (ValueError, QueueFullError) as exc:
                return engine_error(exc, self.replica_id)
            failed = await self._realtime_wait(chunk.denoised, chunk.frames)
            if failed is not None:
                self._realtime_metrics.chunk_latency.observe(
                    time.perf_counter() - t0, tags={"status": type(failed).__name__}
                )
                return failed
            session.decoding[chunk_index] = (chunk.frames, t0)
            session.next_chunk += 1
            session.last_used = time.monotonic()
            return {
                "replica": self.replica_id,
                "session_id": session_id,
                "chunk_index": chunk_index,
                "event_id": event_id,
                "denoise_ms": (time.perf_counter() - t0) * 1000.0,
            }

    async def realtime_frames(self, session_id: str, chunk_index: int) -> dict[str, Any] | ServeError:
        """The frames of a denoised chunk (``realtime_chunk`` answered), encoded, once decoded. Not under the
        session's lock: the session's next chunk holds it while it is denoised."""
        session = self.realtime.get(session_id)
        if session is None:
            return _no_session(session_id, self.replica_id)
        if chunk_index not in session.decoding:
            return _bad_request(
                f"chunk_index: chunk {chunk_index} is not being decoded in {session_id}", self.replica_id
            )
        future, t0 = session.decoding[chunk_index]
        failed = await self._realtime_wait(future, future)
        session.decoding.pop(chunk_index, None)
        if failed is not None:
            self._realtime_metrics.chunk_latency.observe(
                time.perf_counter() - t0, tags={"status": type(failed).__name__}
            )
            return failed
        frames = future.result()
        generate_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        payloads = await asyncio.to_thread(
            encode_frames, frames, session.output_format, session.quality, session.preview_max_width
        )
        encode_s = time.perf_counter() - t1
        session.last_used = time.monotonic()
        self._realtime_metrics.chunk_latency.observe(time.perf_counter() - t0, tags={"status": "ok"})
        return {
            "replica": self.replica_id,
            "session_id": session_id,
            "chunk_index": chunk_index,
            "payloads": payloads,
            "num_frames": int(frames.shape[0]),
            "height": int(frames.shape[1]),
            "width": int(frames.shape[2]),
            "generate_ms": generate_s * 1000.0,
            "encode_ms": encode_s * 1000.0,
        }

    async def _realtime_wait(self, future, frames) -> ServeError | None:
        """Await one of a chunk's futures; None, or the error answer. Cancelled (the client left), the
        chunk is dropped: ``frames`` cancelled, its slot is freed at the next step."""
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            frames.cancel()
            raise
        except (ValueError, ServeError) as exc:  # bad input the engine found, or released memory
            return engine_error(exc, self.replica_id)
        except RankDied as exc:
            return self._rank_failed(exc)
        except RankError as exc:
            if self.launcher.dead:
                return self._rank_failed(exc)
            raise
        return None

    async def realtime_close(self, session_id: str) -> dict[str, Any] | ServeError:
        session = self.realtime.get(session_id)
        if session is None:
            return _no_session(session_id, self.replica_id)
        async with session.lock:
            self.realtime.pop(session_id, None)
            self._realtime_count()
            await asyncio.wrap_future(self.engine.close_session(session_id))
        return {"replica": self.replica_id, "session_id": session_id, "closed": True}
