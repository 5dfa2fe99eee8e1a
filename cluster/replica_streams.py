"""Streaming and job methods of the engine replica (mixed into ``EngineReplica``).

- ``generate_stream``: an async generator Serve streams back (``handle.options(stream=True)``): one event
  per denoising step from the engine's progress callback, then the result. The frontend turns the events
  into server-sent events (HTTP), WebSocket messages (sessions) or a gRPC server stream.
- Video jobs: a job lives on the replica that runs it; its id is ``<replica_id>.<random>`` and travels
  as Serve's ``session_id``, so the session router sends every later call here (any frontend can serve
  it, so jobs survive a frontend restart). Finished jobs are kept ``video_ttl_s``, then forgotten.
- ``session_stream``: one realtime-session step as a stream, optionally with low-res latent previews.

Events cross the handle as plain dicts, errors as typed values (``errors.py``), like the rest of the
replica's answers.
"""

from __future__ import annotations

import asyncio
import io
import logging
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from ditserve.replica.launcher import RankDied
from ditserve.replica.request import GenerationParams, GenerationResult
from ditserve.replica.scheduler import QueueFullError

from .errors import (
    Conflict,
    InternalError,
    NotFound,
    QueueFull,
    ReplicaUnavailable,
    ServeError,
    engine_error,
    typed_cause,
)

logger = logging.getLogger("ditserve")


def job_failure(exc: BaseException) -> str:
    """A failed video job's ``error.message``: the typed error's own words (bad input found while running, a
    replica that lost a rank, released its memory or took new weights: those end with what to do), else an
    internal error, logged here, whose text stays in the server log as for every other route."""
    typed = typed_cause(exc) or engine_error(exc)
    if isinstance(typed, ReplicaUnavailable) or isinstance(exc, RankDied):
        message = typed.message if typed is not None else str(exc)
        return message if "retry" in message else f"{message}; create the video again"
    if typed is not None:
        return typed.message
    logger.error("video job failed", exc_info=exc)
    return f"internal error ({type(exc).__name__}); see the server log"


def latent_preview(grid: np.ndarray) -> bytes:
    """A cheap preview of latents on their grid, (height, width, channels) as the family unpacks them
    (``Worker.preview``): three latent channels, min-max scaled, one pixel per latent (1/8 of the image size
    with an 8x VAE; no VAE decode)."""
    grid = np.asarray(grid, dtype=np.float32)
    rgb = grid[..., :3] if grid.shape[-1] >= 3 else np.repeat(grid[..., :1], 3, axis=-1)
    lo, hi = float(rgb.min()), float(rgb.max())
    pixels = ((rgb - lo) / (hi - lo + 1e-6) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def video_token(created: float) -> str:
    """The part of a video id after ``<replica>.``: 32 hex digits, the job's creation time in milliseconds (12)
    then 20 random ones, so that an id keeps its place in a listing once its job is gone (a page cursor)."""
    return f"{int(created * 1000):012x}{secrets.token_hex(10)}"


def token_ms(token: str) -> int:
    """The creation time in milliseconds a :func:`video_token` carries."""
    return int(token[:12], 16)


@dataclass(eq=False)
class VideoJob:
    id: str
    prompt: str
    model: str
    size: str
    num_frames: int
    fps: int
    created: float = field(default_factory=time.time)  # orders a listing (created_at is whole seconds)
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    finished: float | None = None  # monotonic time of completion or failure
    error: dict[str, Any] | None = None
    mp4: bytes | None = None
    future: Future | None = None
    usage: dict[str, Any] | None = None  # transformer_forwards, cached_forwards, cache_policy once completed
    params: GenerationParams | None = None  # what ran (seed included): a remix reruns it with another prompt
    remixed_from: str | None = None

    def public(self, ttl_s: float) -> dict[str, Any]:
        """The job in OpenAI's ``video`` shape (plus ``num_frames`` and ``fps``)."""
        return {
            "id": self.id,
            "object": "video",
            "status": self.status,
            "progress": self.progress,
            "created_at": int(self.created),
            "completed_at": self.completed_at,
            "expires_at": None if self.completed_at is None else self.completed_at + int(ttl_s),
            "model": self.model,
            "size": self.size,
            "seconds": f"{self.num_frames / self.fps:g}",
            "num_frames": self.num_frames,
            "fps": self.fps,
            "prompt": self.prompt,
            "error": self.error,
            "usage": self.usage,
            "remixed_from_video_id": self.remixed_from,
        }


class ReplicaStreams:
    """Mixin of ``EngineReplica``: uses its ``engine``, ``args``, ``replica_id``, ``sessions``, ``launcher`` and
    ``_unavailable``/``_expire_sessions``/``_session_missing``/``_rank_failed``."""

    # -- streamed generation -----------------------------------------------------------------------------
    async def generate_stream(
        self, params: GenerationParams, preview: bool = False
    ) -> AsyncIterator[dict[str, Any] | ServeError]:
        """Events: ``{"type": "progress", "step", "total"[, "preview"]}`` per step, then ``{"type":
        "result", "result", "replica"}``, or a single typed error."""
        unavailable = self._unavailable()
        if unavailable is not None:
            yield unavailable
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def post(event: dict[str, Any]) -> None:  # engine loop thread → this event loop
            loop.call_soon_threadsafe(events.put_nowait, event | {"replica": self.replica_id})

        def on_progress(done: int, total: int) -> None:
            if not preview or done >= total:
                post({"type": "progress", "step": done, "total": total})

        def on_preview(done: int, total: int, grid: Any) -> None:
            png = latent_preview(grid) if grid is not None else b""
            post({"type": "progress", "step": done, "total": total, "preview": png})

        try:
            future = self.engine.submit(
                params, on_progress=on_progress, on_preview=on_preview if preview else None
            )
        except (ValueError, QueueFullError) as exc:
            yield engine_error(exc, self.replica_id)
            return
        finished = asyncio.ensure_future(asyncio.wrap_future(future))
        try:
            while not finished.done():
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            # Progress callbacks were posted before the future resolved: deliver them first.
            while not events.empty():
                yield events.get_nowait()
            try:
                result: GenerationResult = finished.result()
            except (ValueError, ServeError) as exc:  # bad input the engine found, or released memory
                yield engine_error(exc, self.replica_id)
                return
            except Exception as exc:
                if isinstance(exc, RankDied) or self.launcher.dead:  # retried elsewhere, as unary answers it
                    yield self._rank_failed(exc)
                else:  # the model failed this request: ours, not a replica to retry (as unary answers it)
                    logger.error("streamed generation failed", exc_info=exc)
                    yield InternalError(
                        f"internal error ({type(exc).__name__}); see the server log", replica=self.replica_id
                    )
                return
            self.metrics.observe_usage(result.usage)
            yield {"type": "result", "result": result, "replica": self.replica_id}
        finally:
            if not future.done():
                future.cancel()  # the client went away: the engine frees the slot at the next step

    async def session_stream(
        self, session_id: str, params: GenerationParams, strength: float, preview: bool = False
    ) -> AsyncIterator[dict[str, Any] | ServeError]:
        """One realtime-session step as a stream (see ``session_generate``); the result's latents become
        the session's next starting point."""
        self._expire_sessions()
        session = self.sessions.get(session_id)
        if session is None:
            yield self._session_missing(session_id)
            return
        async with session.lock:
            if self.sessions.get(session_id) is not session:  # closed while this step waited for the last
                yield self._session_missing(session_id)
                return
            session.last_used = time.monotonic()
            update = {"width": session.width, "height": session.height, "return_latents": True, "n": 1}
            if session.latents is not None:
                update |= {"init_latents": session.latents, "strength": strength}
            async for event in self.generate_stream(params.model_copy(update=update), preview=preview):
                if not isinstance(event, ServeError) and event["type"] == "result":
                    result = event["result"]
                    session.latents, result.latents = result.latents, None
                    session.steps += 1
                    event = event | {"step": session.steps, "session_id": session_id}
                session.last_used = time.monotonic()
                yield event

    async def session_ended(self, session_id: str) -> dict[str, Any] | ServeError:
        """Answers once the session is gone: ``{"ended": "closed" | "idle" | "lifetime"}`` (closed, or expired
        for being idle or old), the NotFound of a session that is not here. A WebSocket waiting for its
        client's next step holds this call, so it hears of a DELETE at once. Expiry happens at the session's
        deadline, which each step moves on: the wait ends there to check it.

        One WebSocket streams a session at a time: a newer socket's call ends the older one's with
        ``{"ended": "replaced"}`` (a client reconnecting takes its session over from a socket the network
        left half-open), so sockets opened on one session cannot pile up calls on this replica."""
        self._expire_sessions()
        session = self.sessions.get(session_id)
        if session is None:
            return self._session_missing(session_id)
        if session.watch is not None:
            session.watch.set()
        mine = session.watch = asyncio.Event()
        try:
            # Held by reference: when the wait below expires the session itself, ``ended`` says so ("idle"),
            # where looking the id up again would find nothing and answer as for a session never opened.
            while not session.gone.is_set() and not mine.is_set():
                deadline = min(
                    session.last_used + self.args.session_idle_timeout_s,
                    session.created + self.args.session_max_lifetime_s,
                )
                left = deadline - time.monotonic()
                # a step running past the deadline keeps its session: check again an idle timeout later
                wait = left if left > 0 else self.args.session_idle_timeout_s
                waits = [asyncio.ensure_future(session.gone.wait()), asyncio.ensure_future(mine.wait())]
                try:
                    done, _ = await asyncio.wait(waits, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
                if not done:
                    self._expire_sessions()
        finally:
            if session.watch is mine:
                session.watch = None
        ended = session.ended if session.gone.is_set() else "replaced"
        return {"replica": self.replica_id, "session_id": session_id, "ended": ended}

    async def session_touch(self, session_id: str) -> dict[str, Any] | ServeError:
        """Does the session exist here, and how old is it (a WebSocket's lifetime deadline)."""
        self._expire_sessions()
        session = self.sessions.get(session_id)
        if session is None:
            return self._session_missing(session_id)
        session.last_used = time.monotonic()
        return {"replica": self.replica_id, "age_s": time.monotonic() - session.created}

    # -- video jobs -----------------------------------------------------------------------------------------
    @property
    def _videos(self) -> dict[str, VideoJob]:
        if not hasattr(self, "_video_jobs"):
            self._video_jobs: dict[str, VideoJob] = {}
        return self._video_jobs

    def _expire_videos(self) -> None:
        deadline = time.monotonic() - self.args.video_ttl_s
        for job in [j for j in self._videos.values() if j.finished is not None and j.finished < deadline]:
            del self._videos[job.id]

    def _video(self, video_id: str) -> VideoJob | NotFound:
        self._expire_videos()
        job = self._videos.get(video_id)
        if job is None:
            return NotFound(
                f"video {video_id!r} does not exist (deleted, expired or never created)",
                param="video_id",
                replica=self.replica_id,
            )
        return job

    async def create_video(
        self, params: GenerationParams, model: str, prompt: str
    ) -> dict[str, Any] | ServeError:
        unavailable = self._unavailable()
        if unavailable is not None:
            return unavailable
        self._expire_videos()
        if len(self._videos) >= self.args.max_video_jobs_per_replica:
            return QueueFull(
                f"this replica holds {len(self._videos)} video jobs, its maximum; "
                "delete finished ones or retry later",
                retry_after=5,
                replica=self.replica_id,
            )
        created = time.time()
        job = VideoJob(
            id=f"{self.replica_id}.{video_token(created)}",
            created=created,
            prompt=prompt,
            model=model,
            size=f"{params.width}x{params.height}",
            num_frames=params.num_frames,
            fps=params.fps,
            params=params,
        )

        def on_start() -> None:  # engine loop thread: taken from the queue, its inputs encoded next
            job.status = "in_progress"

        def on_progress(done: int, total: int) -> None:  # engine loop thread: plain attribute writes
            job.status = "in_progress"
            job.progress = min(99, int(100 * done / total))

        def on_done(future: Future) -> None:
            job.finished = time.monotonic()
            job.completed_at = int(time.time())
            if future.cancelled():
                job.status, job.error = "failed", {"code": "cancelled", "message": "the job was deleted"}
                return
            exc = future.exception()
            if exc is not None:
                job.status, job.error = "failed", {"code": "generation_failed", "message": job_failure(exc)}
                return
            result = future.result()
            job.mp4, job.usage = result.outputs[0], result.usage or None
            self.metrics.observe_usage(result.usage)
            job.status, job.progress = "completed", 100

        try:
            job.future = self.engine.submit(params, on_progress=on_progress, on_start=on_start)
        except (ValueError, QueueFullError) as exc:
            return engine_error(exc, self.replica_id)
        job.future.add_done_callback(on_done)
        self._videos[job.id] = job
        return {"replica": self.replica_id, "video": job.public(self.args.video_ttl_s)}

    async def get_video(self, video_id: str) -> dict[str, Any] | ServeError:
        job = self._video(video_id)
        if isinstance(job, ServeError):
            return job
        return {"replica": self.replica_id, "video": job.public(self.args.video_ttl_s)}

    async def remix_video(self, video_id: str, prompt: str) -> dict[str, Any] | ServeError:
        """A new job on this replica: the completed job's parameters and seed with another prompt."""
        job = self._video(video_id)
        if isinstance(job, ServeError):
            return job
        if job.status != "completed" or job.params is None:
            return Conflict(
                f"video {video_id!r} is {job.status}; only a completed video can be remixed",
                param="video_id",
                replica=self.replica_id,
            )
        params = job.params.model_copy(update={"prompt": prompt})
        answer = await self.create_video(params, job.model, prompt)
        if isinstance(answer, ServeError):
            return answer
        self._videos[answer["video"]["id"]].remixed_from = video_id
        answer["video"]["remixed_from_video_id"] = video_id
        return answer

    async def list_videos(self) -> dict[str, Any]:
        """Broadcast target of ``GET /v1/videos``: every job this replica holds, each with its creation
        time (``created``, to order jobs made within one second)."""
        self._expire_videos()
        ttl_s = self.args.video_ttl_s
        videos = [(j.created, j.public(ttl_s)) for j in self._videos.values()]
        return {"replica": self.replica_id, "videos": videos}

    async def video_content(self, video_id: str) -> dict[str, Any] | ServeError:
        job = self._video(video_id)
        if isinstance(job, ServeError):
            return job
        if job.status != "completed":
            return Conflict(
                f"video {video_id!r} is {job.status}; its content exists once it is completed",
                param="video_id",
                replica=self.replica_id,
            )
        return {"replica": self.replica_id, "mp4": job.mp4}

    async def delete_video(self, video_id: str) -> dict[str, Any] | ServeError:
        job = self._video(video_id)
        if isinstance(job, ServeError):
            return job
        if job.future is not None and not job.future.done():
            job.future.cancel()  # a running job stops at the next step
        del self._videos[video_id]
        return {
            "replica": self.replica_id,
            "video": {"id": video_id, "object": "video.deleted", "deleted": True},
        }
