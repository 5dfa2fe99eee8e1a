"""Realtime video over WebSocket, compatible with SGLang Diffusion's ``/v1/realtime_video``:
``ws://HOST/v1/realtime_video/generate``. Every message, both ways, is a msgpack map in a binary frame.

Client → server (optional fields may be nil: their default)::

    {"type": "init", "prompt", "model"?, "size"? ("WxH"; absent or "auto": the model's default, 832x480,
     within --max-width / --max-height), "num_frames"? (frames per chunk), "fps"?
     (16), "seed"? (42), "num_inference_steps"? (4), "guidance_scale"?, "negative_prompt"?, "max_chunks"?
     (absent: until the socket closes, at most --realtime-max-chunks), "first_frame"? (PNG / JPEG / WebP bytes
     within --max-image-bytes and --max-image-pixels, or their base64 / data URL),
     "realtime_output_format"? ("raw" (default) | "jpeg" | "webp"), "output_compression"?
     (JPEG / WebP quality, 95 / 90), "realtime_preview_max_width"? (JPEG / WebP narrowed to it),
     "realtime_output_pacing"? (true: each chunk is sent once the previous one's frames have played at fps; a
     chunk of a new prompt event at once), "trace_id"?}
    {"type": "event", "kind": "prompt", "payload": "<new prompt>", "event_id": n}   (also kind "heartbeat",
     which only counts as activity: no reply)

Server → client, per chunk (``chunk_index`` from 0, in order)::

    {"type": "frame_batch", "session_id", "replica", "request_id", "chunk_index", "frame_batch_index",
     "num_frame_batches", "is_final_frame_batch", "num_frames", "content_type", "format", "encoding", "width",
     "height", "channels", "bytes_per_frame", "total_size", "payload", "event_id"?, "raw_size"? (raw),
     "payload_lengths", "source_width", "source_height", "preview_width", "preview_height"? (jpeg/webp)}
    (at most 16 raw or 6 JPEG / WebP frames per message; a payload of 64 KiB or more: the same map as
     "frame_batch_header" without "payload", then the payload as its own binary frame)
    {"type": "chunk_stats", "trace_id", "session_id", "replica", "request_id", "chunk_index", "event_id",
     "request_prepare_ms", "scheduler_forward_ms", "frame_encode_ms", "header_write_ms", "raw_write_ms",
     "ws_write_ms", "chunk_total_ms", "num_batches", "num_frames", "raw_bytes", "ws_payload_bytes", ...}
    {"type": "error", "content": <message naming the field>, "code"?}

Raw frames are rows of RGB bytes (row-major, ``bytes_per_frame`` = width × height × 3 each). The first chunk is
the first latent frame (one video frame); every later chunk carries ``num_frames`` frames. A prompt event
applies from the next chunk not yet queued on the replica; as in SGLang, that chunk and every later one
generated with that prompt echo its ``event_id``. The session lives on one replica (``session_id`` =
``<replica_id>.<token>``, named in every message as ``replica``); the next chunk is queued there as soon as the
previous one is denoised, so the replica denoises it while the previous one's frames decode and this frontend
sends them. Closes: 1000 "generation complete" after ``max_chunks``; 1000 "session idle timeout"
(``session_idle_timeout_s``) or "maximum session lifetime reached" (``session_max_lifetime_s``), also while
no init has opened a session; an error
with ``code`` ``session_gone`` then 4410 when the owner replica is gone (or its memory is released, which
ends its sessions); 1008 past ``max_realtime_sessions``
(after an error; the init is tried on each replica, the last one asked waiting ``REALTIME_SLOT_WAIT_S`` for
a slot). A bad message before the session opens (a bad init, an event, a text or non-msgpack frame)
answers an error and the server waits for an init; a bad one during the session answers an error and the
session goes on. The client ends a session by closing the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any, Literal

import msgpack
from fastapi import APIRouter, Depends, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ditserve.replica.media import check_image
from ditserve.replica.request import GenerationParams

from .errors import (
    BadRequest,
    InternalError,
    QueueFull,
    ReplicaUnavailable,
    ServeError,
    SessionGone,
    validation_error,
)
from .http_base import base64_bytes, error_type, frontend, requested_size
from .replica_realtime import CONTENT_TYPES, preview_size
from .schemas import Prompt, parse_size

router = APIRouter(tags=["realtime"])
logger = logging.getLogger("ditserve")

PAYLOAD_INLINE_BYTES = 64 * 1024  # larger payloads travel as a header map then a binary frame
FRAMES_PER_MESSAGE = {"raw": 16, "jpeg": 6, "webp": 6}
DEFAULT_SEED = 42  # the same init gives the same video; a client wanting variety sends a seed
DEFAULT_FPS, DEFAULT_STEPS = 16, 4
GONE_CLOSE = 4410
# How long an open waits for a slot on the last replica it asks before "max_realtime_sessions" is final.
REALTIME_SLOT_WAIT_S = 5.0


class RealtimeInit(BaseModel):
    """The first message of a session (fields SGLang clients send that do not apply here are ignored). As in
    SGLang, every optional field may be sent as nil, meaning its default."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    type: Literal["init"]
    prompt: Prompt
    model: str | None = None
    size: str | None = None
    num_frames: int | None = Field(default=None, strict=True, ge=1)
    fps: int | None = Field(default=None, strict=True, ge=1, le=120)
    seed: int | None = Field(default=None, strict=True, ge=0, lt=2**63)
    num_inference_steps: int | None = Field(default=None, strict=True, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0, le=100)
    negative_prompt: str | None = None
    max_chunks: int | None = Field(default=None, strict=True, ge=1)
    first_frame: bytes | str | None = None  # image bytes, or a base64 string / data URL
    realtime_output_format: Literal["raw", "jpeg", "webp"] | None = None
    output_compression: int | None = Field(default=None, strict=True, ge=1, le=100)  # JPEG / WebP quality
    realtime_preview_max_width: int | None = Field(default=None, strict=True)  # JPEG / WebP; <= 0: none
    realtime_output_pacing: bool | None = Field(default=None, strict=True)
    trace_id: str | None = Field(default=None, max_length=256)

    @field_validator("first_frame", mode="before")
    @classmethod
    def _image_or_text(cls, value: Any) -> Any:
        """Named as the field, not as a member of its union (``first_frame.bytes``)."""
        if value is not None and not isinstance(value, (bytes, str)):
            raise ValueError("give image bytes, or a base64 string / data URL of them")
        return value

    @property
    def output_format(self) -> str:
        return self.realtime_output_format or "raw"


class RealtimeEvent(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    type: Literal["event"]
    kind: str
    payload: Any = None
    event_id: int | None = None


def _validation_message(exc: ValidationError) -> str:
    return validation_error(exc.errors(), whole="message").message


def _first_frame(value: bytes | str) -> bytes:
    """The init's ``first_frame``: image bytes, or a string holding them in base64 (plain or a data URL).
    The server fetches nothing, so URLs and paths are refused."""
    if isinstance(value, bytes):
        return value
    data = value
    if value.startswith("data:"):
        head, sep, data = value.partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadRequest("first_frame: a data URL must be base64 (data:image/png;base64,...)")
    decoded = base64_bytes(data)
    if decoded is None:
        raise BadRequest(
            "first_frame: give image bytes, or a base64 string / data URL of them; the server fetches no "
            "URLs or paths"
        )
    return decoded


def _default_frames(fe: Any) -> int:
    """Frames per chunk when the init gives none: the model's usual chunk (released: 3 latent frames)."""
    config = fe.spec.transformer_config()
    return fe.spec.frame_multiple * max(config.get("chunk_partition") or [3])


def init_params(fe: Any, init: RealtimeInit) -> GenerationParams:
    """Frontend checks of an init (model, size, prompt, limits) → the session's engine parameters."""
    fe.check_model(init.model)
    if not fe.spec.family_spec.extra.get("realtime"):
        raise BadRequest(
            f"model: {fe.model_name!r} does not generate realtime video (serve an AnyFlow-FAR model)"
        )
    for name in ("prompt", "negative_prompt"):  # the HTTP APIs' limit on both (a negative prompt had none)
        if len(getattr(init, name) or "") > fe.args.max_prompt_chars:
            raise BadRequest(f"{name}: longer than {fe.args.max_prompt_chars} characters", param=name)
    steps = init.num_inference_steps or DEFAULT_STEPS
    if steps > fe.args.max_steps:
        raise BadRequest(f"num_inference_steps: {steps} is above the maximum {fe.args.max_steps}")
    images: tuple[bytes, ...] = ()
    first_size = None
    if init.first_frame is not None:
        first = _first_frame(init.first_frame)
        try:  # the limits and formats of every uploaded image, checked before anything decodes it
            first_size = check_image(
                first, "first_frame", max_bytes=fe.args.max_image_bytes, max_pixels=fe.args.max_image_pixels
            )
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        images = (first,)
    # No size (or "auto"): the model's default fitted to the server's limits, as the videos API sizes it.
    default = fe.spec.fitted_size(fe.args.max_width, fe.args.max_height, first_size)
    try:
        width, height = parse_size(requested_size(init.size, f"{default[0]}x{default[1]}"))
    except BadRequest as exc:
        raise BadRequest(f"size: {exc.message.removeprefix('size ')}") from None
    if min(width, height) < 16:
        raise BadRequest(f"size: width and height must be at least 16, got {init.size!r}")
    refused = fe.spec.family_spec.refuse_size(fe.spec.folder, width, height, init.max_chunks)
    if refused is not None:
        raise BadRequest(refused)
    return GenerationParams(
        prompt=init.prompt,
        negative_prompt=init.negative_prompt,
        width=width,
        height=height,
        num_frames=init.num_frames or _default_frames(fe),
        num_inference_steps=steps,
        guidance_scale=init.guidance_scale,
        seed=DEFAULT_SEED if init.seed is None else init.seed,
        fps=init.fps or DEFAULT_FPS,
        images=images,
    )


class _Socket:
    """Sends msgpack maps (and raw payload frames) one message group at a time."""

    def __init__(self, websocket: WebSocket):
        self.ws = websocket
        self.lock = asyncio.Lock()
        self.closed = False

    async def send(self, *messages: dict[str, Any] | bytes, write_ms: list[float] | None = None) -> int:
        """Send the messages back to back; returns the bytes sent (``write_ms`` gets each write's time)."""
        sent = 0
        async with self.lock:
            for message in messages:
                data = message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)
                t0 = time.perf_counter()
                await self.ws.send_bytes(data)
                if write_ms is not None:
                    write_ms.append((time.perf_counter() - t0) * 1000.0)
                sent += len(data)
        return sent

    async def error(self, content: str, **extra: Any) -> None:
        await self.send({"type": "error", "content": content, **extra})

    async def close(self, code: int, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        async with self.lock:
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await self.ws.close(code=code, reason=reason.encode()[:120].decode(errors="ignore"))


async def _receive_map(ws: WebSocket) -> dict[str, Any] | str:
    """The next client message as a map, or an error message saying why it is not one."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    data = message.get("bytes")
    if data is None:
        return "message: send msgpack maps in binary frames"
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:
        return "message: not valid msgpack"
    if not isinstance(value, dict):
        return "message: must be a msgpack map"
    if not all(isinstance(key, str) for key in value):  # valid msgpack, but no field has such a name
        return "message: the map's keys must be strings (the field names)"
    return value


class _Session:
    """One open session: the current prompt and the chunk loop."""

    def __init__(
        self, fe: Any, sock: _Socket, init: RealtimeInit, opened: dict[str, Any], trace_id: str | None
    ):
        self.fe = fe
        self.sock = sock
        self.init = init
        self.session_id: str = opened["session_id"]
        self.trace_id = trace_id or self.session_id
        self.replica: str = opened["replica"]
        self.limit: int = init.max_chunks or opened["chunk_limit"]
        self.pinned = fe.engine.options(session_id=self.session_id)
        # As in SGLang, a chunk echoes the ``event_id`` of the latest prompt event it was generated with
        # (every chunk from the one that applied it until the next prompt event), none before any event.
        self.prompt = init.prompt
        self.event_id: int | None = None  # the event of ``self.prompt`` (None: the init's, or no event_id)
        self.applied_event: int | None = None  # the event of the prompt of the last queued chunk
        self.prompt_changed = False  # a prompt event arrived since the last chunk was queued
        self.created = self.last_activity = time.monotonic()
        self.paced_until: float | None = None  # realtime_output_pacing: when the sent frames have played
        self.paced_event: int | None = None
        self.gone = False
        self.released: asyncio.Task | None = None  # the replica's close, once asked
        self.calls: set[asyncio.Task] = set()  # replica calls in flight (cancelled when the session ends)

    def _call(self, response) -> asyncio.Task:
        task = asyncio.create_task(self.fe.call_engine(response))
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)
        return task

    def _chunk_call(self, index: int) -> tuple[asyncio.Task, float]:
        if self.prompt_changed:
            self.applied_event, self.prompt_changed = self.event_id, False
        call = self.pinned.realtime_chunk.remote(self.session_id, index, self.prompt, self.applied_event)
        return self._call(call), time.perf_counter()

    async def generate(self) -> str:
        """The chunk loop; returns why it ended."""
        try:
            return await self._chunks()
        finally:
            for task in list(
                self.calls
            ):  # the client left (or a limit closed the socket): stop the replica's chunk
                task.cancel()

    async def _failed(self, exc: ServeError, index: int) -> str:
        if isinstance(exc, (SessionGone, ReplicaUnavailable)):
            self.gone = True
            # The replica is gone, or lives on without the session's state (its memory was released).
            message = (
                f"session {self.session_id} was lost on replica {self.replica} ({exc.message}); "
                "open a new session"
            )
            await self.sock.error(message, code="session_gone", replica=self.replica)
            await self.sock.close(GONE_CLOSE, f"session gone: its state on replica {self.replica} is lost")
            return "gone"
        await self.sock.error(exc.message, code=error_type(exc))
        await self.sock.close(1011, f"chunk {index} failed")
        return "failed"

    async def _chunks(self) -> str:
        (task, started), index = self._chunk_call(0), 0
        while True:
            try:
                denoised = await task  # chunk ``index`` is denoised; its frames are being decoded
                frames = self._call(self.pinned.realtime_frames.remote(self.session_id, index))
                last = index + 1 >= self.limit
                if not last:  # the replica denoises the next chunk while this one decodes and is sent
                    task, next_started = self._chunk_call(index + 1)
                answer = {**await frames, "event_id": denoised.get("event_id")}
            except ServeError as exc:
                return await self._failed(exc, index)
            except Exception as exc:
                # The replica raised (a rank failed on the chunk): the client is told, not just closed.
                logger.exception("realtime session %s: chunk %d failed", self.session_id, index)
                failed = InternalError(f"internal error ({type(exc).__name__}); see the server log")
                return await self._failed(failed, index)
            forward_ms = (time.perf_counter() - started) * 1000.0
            await self._send_chunk(answer, forward_ms, started)
            if not last:
                started, index = next_started, index + 1
                continue
            reason = "generation complete"
            if self.init.max_chunks is None:
                reason = f"generation complete: chunk limit {self.limit} reached (--realtime-max-chunks)"
            await self.release()  # the replica's slot is free before the client hears the close
            await self.sock.close(1000, reason)
            return "complete"

    async def _pace(self, answer: dict[str, Any]) -> float:
        """With ``realtime_output_pacing``, as SGLang paces: wait until the frames sent so far have played at
        ``fps`` (a chunk of a new prompt event goes at once); returns the wait in ms."""
        if not self.init.realtime_output_pacing or not answer["num_frames"]:
            return 0.0
        now = time.perf_counter()
        until = now if self.paced_until is None else self.paced_until
        event = answer.get("event_id")
        if event is not None and event != self.paced_event:
            until, self.paced_event = min(until, now), event
        wait = max(0.0, until - now)
        if wait > 0:
            await asyncio.sleep(wait)
        fps = self.init.fps or DEFAULT_FPS
        self.paced_until = max(until, time.perf_counter()) + answer["num_frames"] / fps
        return wait * 1000.0

    async def _send_chunk(self, answer: dict[str, Any], forward_ms: float, started: float) -> None:
        """One chunk as SGLang sends it: ``frame_batch`` messages of at most 16 raw or 6 JPEG / WebP
        frames (the last one ``is_final_frame_batch``; a chunk with no frames still sends one, empty), each
        inline or, from 64 KiB of payload, a ``frame_batch_header`` then the payload as a binary frame; then
        ``chunk_stats``."""
        pace_ms = await self._pace(answer)
        fmt = self.init.output_format
        payloads: list[bytes] = answer["payloads"]
        width, height = answer["width"], answer["height"]
        per = FRAMES_PER_MESSAGE[fmt]
        batches = [payloads[i : i + per] for i in range(0, len(payloads), per)] or [[]]
        request_id = f"{self.session_id}_{answer['chunk_index']}"
        common: dict[str, Any] = {
            "session_id": self.session_id,
            "replica": answer["replica"],
            "request_id": request_id,
            "chunk_index": answer["chunk_index"],
            "content_type": CONTENT_TYPES[fmt],
            "format": "rgb24",
            "width": width,
            "height": height,
            "channels": 3,
            "bytes_per_frame": width * height * 3,
            "num_frame_batches": len(batches),
        }
        if fmt != "raw":  # SGLang's encoded frames: width / height are the sent (preview) size
            shown = preview_size(width, height, self.init.realtime_preview_max_width)
            common.update(
                format=fmt,
                encoding=fmt,
                source_width=width,
                source_height=height,
                preview_width=shown[0],
                preview_height=shown[1],
                width=shown[0],
                height=shown[1],
            )
        if answer.get("event_id") is not None:
            common["event_id"] = answer["event_id"]
        header_ms: list[float] = []
        payload_ms: list[float] = []
        sent = 0
        for i, frames in enumerate(batches):
            payload = b"".join(frames)
            header = {
                **common,
                "frame_batch_index": i,
                "is_final_frame_batch": i == len(batches) - 1,
                "num_frames": len(frames),
                "total_size": len(payload),
            }
            if fmt == "raw":
                header.update(raw_size=len(payload), encoding="raw")
            else:
                header["payload_lengths"] = [len(f) for f in frames]
            if len(payload) >= PAYLOAD_INLINE_BYTES:
                sent += await self.sock.send({"type": "frame_batch_header", **header}, write_ms=header_ms)
                sent += await self.sock.send(payload, write_ms=payload_ms)
            else:
                sent += await self.sock.send(
                    {"type": "frame_batch", **header, "payload": payload}, write_ms=payload_ms
                )
        stats = {
            "type": "chunk_stats",
            "trace_id": self.trace_id,
            "session_id": self.session_id,
            "replica": answer["replica"],
            "request_id": request_id,
            "chunk_index": answer["chunk_index"],
            "event_id": answer.get("event_id"),
            "request_prepare_ms": 0,
            "scheduler_forward_ms": round(answer["generate_ms"]),
            "frame_encode_ms": round(answer["encode_ms"]),
            "queue_and_transfer_ms": round(
                max(0.0, forward_ms - answer["generate_ms"] - answer["encode_ms"])
            ),
            "pace_wait_ms": round(pace_ms),
            "header_write_ms": round(sum(header_ms)),
            "raw_payload_build_ms": round(answer["encode_ms"]),
            "raw_write_ms": round(sum(payload_ms)),
            "ws_write_ms": round(sum(header_ms) + sum(payload_ms)),
            "chunk_total_ms": round((time.perf_counter() - started) * 1000.0),
            "num_batches": len(batches),
            "num_frames": answer["num_frames"],
            "raw_bytes": answer["num_frames"] * width * height * 3,
            "ws_payload_bytes": sent,
            "content_type": CONTENT_TYPES[fmt],
        }
        await self.sock.send(stats)

    async def listen(self) -> str:
        """Client events until the socket closes; returns why it ended."""
        while True:
            try:
                data = await _receive_map(self.sock.ws)
            except (WebSocketDisconnect, RuntimeError):
                return "client closed"
            self.last_activity = time.monotonic()
            if isinstance(data, str):
                await self.sock.error(data)
                continue
            if data.get("type") == "init":
                await self.sock.error(
                    "type: this session is already running; close the socket to start another"
                )
                continue
            try:
                event = RealtimeEvent.model_validate(data)
            except ValidationError as exc:
                await self.sock.error(_validation_message(exc))
                continue
            if event.kind in ("heartbeat", "client_trace"):
                continue
            if event.kind != "prompt":
                await self.sock.error(
                    f"kind: unknown event kind {event.kind!r}; expected prompt or heartbeat"
                )
                continue
            if not isinstance(event.payload, str) or not event.payload.strip():
                await self.sock.error("payload: a prompt event carries the new prompt as a non-empty string")
                continue
            if len(event.payload) > self.fe.args.max_prompt_chars:
                await self.sock.error(f"payload: longer than {self.fe.args.max_prompt_chars} characters")
                continue
            self.prompt, self.event_id, self.prompt_changed = event.payload, event.event_id, True

    async def watchdog(self) -> str:
        idle, lifetime = self.fe.args.session_idle_timeout_s, self.fe.args.session_max_lifetime_s
        while True:
            now = time.monotonic()
            if now - self.created >= lifetime:
                await self.sock.close(1000, "maximum session lifetime reached")  # SGLang's reasons, verbatim
                return "lifetime"
            if now - self.last_activity >= idle:
                await self.sock.close(1000, "session idle timeout")
                return "idle"
            await asyncio.sleep(min(1.0, idle / 4, lifetime / 4))

    async def release(self) -> None:
        """Close the session on its replica, once; the close runs to its end even when this wait is
        cancelled (the client left while it was on its way)."""
        if self.gone:
            return
        if self.released is None:
            self.released = _detached(_close_on_replica(self.fe, self.session_id))
        await asyncio.shield(self.released)


_detached_tasks: set[asyncio.Task] = set()


def _detached(coro) -> asyncio.Task:
    """``coro`` as a task that runs to its end even when whoever awaits it is cancelled (Serve cancels the
    handler when the client disconnects): a session's open and close must reach the replica, or its slot
    stays held there until the session expires."""
    task = asyncio.create_task(coro)
    _detached_tasks.add(task)
    task.add_done_callback(_detached_tasks.discard)
    return task


async def _close_on_replica(fe: Any, session_id: str) -> None:
    with contextlib.suppress(Exception):
        call = fe.engine.options(session_id=session_id).realtime_close.remote(session_id)
        await asyncio.wait_for(call, timeout=30)


def _close_if_opened(fe: Any, opening: asyncio.Task) -> None:
    """Done callback of an open whose client left meanwhile: the session it opened is closed again."""
    if not opening.cancelled() and opening.exception() is None:
        _detached(_close_on_replica(fe, opening.result()["session_id"]))


@router.websocket("/v1/realtime_video/generate")
async def realtime_video(websocket: WebSocket, fe: Any = Depends(frontend)):
    await websocket.accept()
    sock = _Socket(websocket)
    try:
        fe.check_auth(websocket, admin=False)
    except ServeError as exc:
        await sock.error(exc.message, code=error_type(exc))
        return await sock.close(4401, exc.message)
    try:
        init, opened = await _open(fe, sock)
    except (WebSocketDisconnect, RuntimeError):
        return
    if opened is None:
        return
    session = _Session(fe, sock, init, opened, init.trace_id or websocket.query_params.get("trace_id"))
    tasks = [asyncio.create_task(c) for c in (session.generate(), session.listen(), session.watchdog())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.release()
        await sock.close(1000, "session closed")


async def _open_on_a_replica(fe: Any, init: RealtimeInit, params: GenerationParams) -> dict[str, Any]:
    """Open the session on the next replica (round-robin) with a free slot: a replica at its
    ``--max-realtime-sessions`` refuses at once and the next one is asked, ``--dp-size`` of them; when all
    are full, each is asked once more and waits up to its share of ``REALTIME_SLOT_WAIT_S`` for a slot (a
    client that closed a session and opens the next at once: its close may still be on its way, or wait for
    the running chunk to stop) before the refusal is final."""
    replicas = max(1, int(fe.args.dp_size))
    tries = 2 * replicas
    for attempt in range(tries):
        opening = _detached(
            fe.call_engine(
                fe.engine.realtime_open.remote(
                    params,
                    init.max_chunks,
                    init.output_format,
                    init.output_compression,
                    init.realtime_preview_max_width,
                    wait_s=REALTIME_SLOT_WAIT_S / replicas if attempt >= replicas else 0.0,
                )
            )
        )
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:  # the client left while the session opened
            opening.add_done_callback(functools.partial(_close_if_opened, fe))
            raise
        except QueueFull:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


async def _open(fe: Any, sock: _Socket) -> tuple[RealtimeInit | None, dict[str, Any] | None]:
    """Wait for a valid init and open the session on a replica (round-robin). A bad init answers an error
    and waits for the next; the replicas' session cap answers an error and closes (1008). The session's
    limits hold from the socket's start: no message for ``session_idle_timeout_s``, or no session opened
    within ``session_max_lifetime_s``, closes it (1000) with the reason."""
    idle, deadline = fe.args.session_idle_timeout_s, time.monotonic() + fe.args.session_max_lifetime_s
    while True:
        left = deadline - time.monotonic()
        try:
            data = await asyncio.wait_for(_receive_map(sock.ws), min(idle, max(left, 0.0)))
        except TimeoutError:
            await sock.close(
                1000, "session idle timeout" if idle < left else "maximum session lifetime reached"
            )
            return None, None
        if isinstance(data, str):
            await sock.error(data)
            continue
        if data.get("type") == "event":
            await sock.error("type: no session is open yet; send an init message first")
            continue
        try:
            init = RealtimeInit.model_validate(data)
            params = init_params(fe, init)
        except ValidationError as exc:
            await sock.error(_validation_message(exc))
            continue
        except ServeError as exc:
            await sock.error(exc.message)
            continue
        try:
            opened = await _open_on_a_replica(fe, init, params)
        except ServeError as exc:
            if isinstance(exc, QueueFull):
                await sock.error(exc.message, code=error_type(exc))
                await sock.close(1008, "max_realtime_sessions reached; retry later")
                return init, None
            if isinstance(exc, BadRequest):
                await sock.error(exc.message)
                continue
            await sock.error(exc.message, code=error_type(exc))
            await sock.close(1011, "could not open a session")
            return init, None
        return init, opened
