"""Streaming over HTTP: server-sent events for ``POST /v1/images/generations`` and ``/v1/images/edits``
with ``stream: true``,
the realtime-session WebSocket ``/v1/sessions/{id}/stream``, and the request-body limit (413).

Progress comes from the replica: the engine's per-step callback feeds ``EngineReplica.generate_stream``
(an async generator), which Serve streams to this frontend (``handle.options(stream=True)``).

SSE events (``text/event-stream``), then ``data: [DONE]``::

    event: image_generation.progress   data: {"type", "step", "total"}
    event: image_generation.partial_image  (request "preview": true; after each step but the last)
                                       data: {"type", "partial_image_b64", "partial_image_index", "step",
                                              "total", "created_at", "output_format", ...}
    event: image_generation.completed  data: {"type", "b64_json", "index", "created_at", "size", "seed", ...}
    event: error                       data: {"error": {"message", "type", "param", "code"}}

Edits send the same events named ``image_edit.*`` (OpenAI's), previews by ``partial_images`` only.

WebSocket protocol. The client sends JSON steps (in text or binary frames) ``{"prompt", "negative_prompt"?,
"strength"?, "num_inference_steps"?, "guidance_scale"?, "true_cfg_scale"?, "seed"?, "lora"?, "cache"?,
"preview"?}`` (the fields of ``POST /v1/sessions/{id}/generate``, and ``preview``); the server answers
``{"type": "progress", "step", "total", "preview_b64"?}`` per denoising step (``preview``: a 1/8-size picture of the latents), then ``{"type":
"image", "step", "b64_json", "seed"}``. A step sent while one runs supersedes it: the running one is
cancelled (``{"type": "superseded"}``) and the newest runs; steps queued behind it are answered
``superseded`` too. A bad step answers ``{"type": "error"}`` and the socket stays open. Each step gets
exactly one of ``image``, ``superseded`` or ``error``, in the order sent; ``image`` means the session holds
that step's latents (a running step that finished before its cancel reached the replica answers ``image``). The server closes with a reason: 4401 bad API key, 4404 unknown or expired
session (a socket waiting for its client's next step is closed as soon as its session is deleted or
expires: the replica answers a ``session_ended`` call then), 4410 its replica is gone, 4408 idle longer than ``session_idle_timeout_s``, 4409 session older
than ``session_max_lifetime_s``, 4429 another socket opened on the same session (one streams a session at a
time: the newer takes it over, so a client reconnecting gets its session back at once). Admission control is at ``POST /v1/sessions`` (429 past
``max_sessions_per_replica``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationError
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, TaskCancelledError
from ray.serve.exceptions import DeploymentUnavailableError, RequestCancelledError

from ditserve.replica.media import image_size
from ditserve.replica.request import GenerationParams

from .api_edits import EDITS_PATH, upload_allowance
from .api_sessions import SessionGenerateRequest, step_params
from .api_videos import VIDEOS_PATH, reference_allowance
from .errors import (
    BadRequest,
    InternalError,
    NotFound,
    PayloadTooLarge,
    ReplicaUnavailable,
    ServeError,
    SessionGone,
    typed_cause,
    validation_error,
)
from .http_base import REPLICA_HEADER, error_body, frontend, http_status, registered_frontend
from .router import session_owner
from .schemas import usage_of

router = APIRouter(tags=["streaming"])
logger = logging.getLogger("ditserve")


# -- request-body limit ----------------------------------------------------------------------------------
class BodyLimitMiddleware:
    """ASGI middleware: a body over ``max_body_bytes`` answers 413 naming the limit, before any handler
    reads or parses it (by Content-Length, or by counting a chunked body)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            fe = registered_frontend()
        except IndexError:  # no Frontend in this process (the app used alone)
            return await self.app(scope, receive, send)
        limit = fe.args.max_body_bytes
        if scope.get("path") == EDITS_PATH:  # image files on top (each checked against max_image_bytes)
            limit += upload_allowance(fe)
        elif scope.get("path") == VIDEOS_PATH:  # an image-to-video model's first frame (input_reference)
            limit += reference_allowance(fe)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                return await _too_large(send, f"request body is {int(length)} bytes", limit)
            return await self.app(scope, receive, send)
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self.app(scope, receive, send)
        # No length: read the (chunked) body up to the limit, then replay it to the app.
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                return await _too_large(send, f"request body is over {size} bytes", limit)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


async def _too_large(send, what: str, limit: int) -> None:
    err = PayloadTooLarge(
        f"{what}; the server's limit is {limit} bytes (--max-body-bytes)", param="max_body_bytes"
    )
    body = json.dumps(error_body(err)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


# -- engine streams ----------------------------------------------------------------------------------------
async def engine_events(fe: Any, stream) -> AsyncIterator[dict[str, Any]]:
    """Iterate a Serve streaming response; failures raise the same typed errors as ``call_engine``."""
    try:
        async for event in stream:
            if isinstance(event, ServeError):
                raise event
            yield event
    except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
        raise ReplicaUnavailable(
            f"the replica serving this request failed ({type(exc).__name__}); retry"
        ) from None
    except DeploymentUnavailableError:
        raise ReplicaUnavailable("no engine replica is available") from None
    except (RequestCancelledError, TaskCancelledError):
        return  # cancelled by the caller (stream.cancel()): the stream ends
    except ServeError:
        raise
    except Exception as exc:
        # A typed error (the router's SessionGone, a replica's refusal) may arrive wrapped (RayTaskError).
        if (typed := typed_cause(exc)) is not None:
            raise typed from None
        logger.exception("engine stream failed")
        raise InternalError(f"internal error ({type(exc).__name__}); see the server log") from None
    finally:
        try:
            stream.cancel()  # no-op when finished; stops the replica's generator when the client left
        except Exception:  # a stream that failed to route re-raises its error here: already mapped
            pass


def _partial(event: dict[str, Any], index: int, kind: str) -> dict[str, Any]:
    """OpenAI's ``image_generation.partial_image`` shape (the picture in ``b64_json``, and under its first
    name ``partial_image_b64``), plus the step it shows; the picture is the latents' own (1/8 of the image
    size, ``size`` says), not a decoded image."""
    picture = base64.b64encode(event["preview"]).decode()
    width, height = image_size(event["preview"])
    return {
        "type": f"{kind}.partial_image",
        "partial_image_index": index,
        "b64_json": picture,
        "partial_image_b64": picture,
        "size": f"{width}x{height}",
        "step": event["step"],
        "total": event["total"],
        "created_at": int(time.time()),
        "output_format": "png",
        "background": "opaque",
        "quality": "low",
    }


def _sse(event: str, data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"event: {event}\ndata: {payload}\n\n"


async def image_events(
    fe: Any,
    params: GenerationParams,
    preview: bool = False,
    partial_images: int | None = None,
    kind: str = "image_generation",
) -> StreamingResponse:
    """``stream: true`` images: the first event is awaited here, so errors known before the first step
    (bad adapter, full queue, no replica) get their status code instead of a 200 stream. With
    ``preview``, each step but the last is followed by an ``image_generation.partial_image`` event;
    ``partial_images`` (OpenAI's field) keeps only that many, the last steps' (0: none). ``kind`` names
    the events: ``image_generation`` (generations) or ``image_edit`` (edits), as OpenAI's."""
    if partial_images is not None and not preview:
        preview = partial_images > 0
    events = engine_events(fe, fe.engine.options(stream=True).generate_stream.remote(params, preview))
    first = await anext(events)

    async def body() -> AsyncIterator[str]:
        event: dict[str, Any] | None = first
        partial_index = 0
        try:
            while event is not None:
                if event["type"] == "progress":
                    data = {
                        "type": f"{kind}.progress",
                        "step": event["step"],
                        "total": event["total"],
                    }
                    yield _sse(f"{kind}.progress", data)
                    # steps 1 .. total-1 carry a preview; partial_images keeps the last ones
                    shown = partial_images is None or event["step"] >= event["total"] - partial_images
                    if event.get("preview") and shown:
                        yield _sse(f"{kind}.partial_image", _partial(event, partial_index, kind))
                        partial_index += 1
                else:
                    result = event["result"]
                    for index, png in enumerate(result.outputs):
                        data = {
                            "type": f"{kind}.completed",
                            "index": index,
                            "b64_json": base64.b64encode(png).decode(),
                            "created_at": int(time.time()),
                            "size": f"{result.width}x{result.height}",
                            "seed": result.seed,
                            "output_format": "png",
                            "background": "opaque",
                            "quality": "auto",
                            "usage": usage_of(result),
                        }
                        yield _sse(f"{kind}.completed", data)
                event = await anext(events, None)
        except ServeError as exc:
            yield _sse("error", error_body(exc))
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={REPLICA_HEADER: str(first.get("replica", "")), "Cache-Control": "no-cache"},
    )


# -- realtime sessions over WebSocket ------------------------------------------------------------------------
class StreamStep(SessionGenerateRequest):
    """One message of the session WebSocket: a session step plus whether to send previews."""

    # Strict, as on /v1/images/generations: "preview": "yes" or 1 is refused naming the field.
    preview: bool = Field(
        default=False, strict=True, description="Send a low-res latent preview with every step."
    )


def _validation_error(exc: ValidationError) -> BadRequest:
    return validation_error(exc.errors(), whole="message")


def _close_code(exc: ServeError) -> int:
    """The WebSocket close code: 4000 + the HTTP status (4404 unknown session, 4410 its replica is gone)."""
    status = http_status(exc)
    return 4000 + status if 400 <= status < 1000 else 4500


@router.websocket("/v1/sessions/{session_id}/stream")
async def session_socket(websocket: WebSocket, session_id: str, fe: Any = Depends(frontend)):
    await websocket.accept()

    async def close(code: int, reason: str) -> None:
        await websocket.close(code=code, reason=reason[:120])  # control frames carry ≤ 123 bytes

    try:
        fe.check_auth(websocket, admin=False)
        session_owner(session_id)
    except ServeError as exc:
        return await close(_close_code(exc), exc.message)
    except ValueError as exc:
        return await close(4404, str(exc))
    pinned = fe.engine.options(session_id=session_id)
    try:
        info = await fe.call_engine(pinned.session_touch.remote(session_id))
    except ServeError as exc:
        return await close(_close_code(exc), exc.message)
    expires = time.monotonic() + fe.args.session_max_lifetime_s - info["age_s"]

    inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()

    async def read() -> None:
        """Client messages into ``inbox`` (None: the client left); a binary frame is read as JSON too."""
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                await inbox.put(text if text is not None else message.get("bytes") or b"")
        except (WebSocketDisconnect, RuntimeError):
            pass
        await inbox.put(None)

    lifetime_over = f"session lifetime over (session_max_lifetime_s={fe.args.session_max_lifetime_s:g})"
    idle = fe.args.session_idle_timeout_s
    idle_over = f"idle for {idle:g}s (session_idle_timeout_s)"
    reader = asyncio.create_task(read())
    # The replica answers this call once the session is gone (a DELETE, expiry): the socket is closed then,
    # not at the client's next step.
    watch = pinned.session_ended.remote(session_id)
    ended = asyncio.ensure_future(fe.call_engine(watch))
    try:
        while True:
            left = expires - time.monotonic()
            get = asyncio.ensure_future(inbox.get())
            done, _ = await asyncio.wait(
                {get, ended}, timeout=max(0.0, min(idle, left)), return_when=asyncio.FIRST_COMPLETED
            )
            if ended in done:
                get.cancel()
                gone = _session_end(ended, session_id, idle_over, lifetime_over)
                if gone is not None:
                    return await close(*gone)
                ended = asyncio.get_running_loop().create_future()  # could not tell: the next step will
                if get not in done:
                    continue
            if get not in done:
                get.cancel()
                if left <= idle:
                    return await close(4409, lifetime_over)
                return await close(4408, idle_over)
            text = get.result()
            if text is None:
                return  # the client closed
            while not inbox.empty():  # only the newest prompt runs; the ones it skips are answered
                newer = inbox.get_nowait()
                if newer is None:
                    return
                await websocket.send_json({"type": "superseded"})
                text = newer
            try:
                step = StreamStep.model_validate_json(text)
                params = step_params(fe, step)
            except ValidationError as exc:
                err = (
                    BadRequest("message is not valid JSON")
                    if exc.errors()[0].get("type") == "json_invalid"
                    else _validation_error(exc)
                )
                await websocket.send_json({"type": "error", **error_body(err)})
                continue
            except ServeError as exc:
                await websocket.send_json({"type": "error", **error_body(exc)})
                continue
            stream = pinned.options(stream=True).session_stream.remote(
                session_id, params, step.strength, step.preview
            )
            cancelled = False
            try:
                async for event in engine_events(fe, stream):
                    if event["type"] == "result":
                        # The replica made it the session's state before sending it: it is answered even
                        # when a newer step came meanwhile, so what the client saw is what the session holds.
                        await websocket.send_json(_ws_event(event))
                        break
                    if cancelled:
                        continue
                    if inbox.empty():
                        await websocket.send_json(_ws_event(event))
                        continue
                    # A newer step (or the client left): cancel this one. The stream then ends, or brings
                    # the result that was made before the cancel reached the replica.
                    stream.cancel()
                    cancelled = True
                else:
                    if cancelled and inbox._queue[-1] is not None:  # type: ignore[attr-defined]
                        await websocket.send_json({"type": "superseded"})
            except ServeError as exc:
                if isinstance(exc, (NotFound, SessionGone)):
                    return await close(_close_code(exc), exc.message)
                await websocket.send_json({"type": "error", **error_body(exc)})
    except (WebSocketDisconnect, RuntimeError):
        return  # the client went away mid-send
    finally:
        reader.cancel()
        ended.cancel()
        watch.cancel()  # the replica stops waiting for this session's end


def _session_end(
    ended: asyncio.Future, session_id: str, idle_over: str, lifetime_over: str
) -> tuple[int, str] | None:
    """The close (code, reason) of a session the replica says is gone, as a step on it would be closed:
    4404 closed (or unknown), 4410 its replica is gone, 4408/4409 expired idle/old, 4429 taken over by a newer
    socket. None: not known."""
    try:
        answer = ended.result()
    except (NotFound, SessionGone) as exc:
        return _close_code(exc), exc.message
    except ReplicaUnavailable:
        return 4410, SessionGone.lost(session_id).message
    except Exception:  # the watch itself failed: the session may live on
        logger.exception("watching session %s failed", session_id)
        return None
    why = answer.get("ended")
    if why == "idle":
        return 4408, idle_over
    if why == "lifetime":
        return 4409, lifetime_over
    if why == "replaced":
        return 4429, "replaced: another WebSocket opened on this session (one streams it at a time)"
    return 4404, f"session_id: session {session_id!r} does not exist (closed or expired)"


def _ws_event(event: dict[str, Any]) -> dict[str, Any]:
    if event["type"] == "progress":
        out = {"type": "progress", "step": event["step"], "total": event["total"]}
        if event.get("preview"):
            out["preview_b64"] = base64.b64encode(event["preview"]).decode()
        return out
    result = event["result"]
    return {
        "type": "image",
        "step": event["step"],
        "seed": result.seed,
        "size": f"{result.width}x{result.height}",
        "b64_json": base64.b64encode(result.outputs[0]).decode(),
        "replica": event["replica"],
        "usage": usage_of(result),
    }


@router.websocket("/v1/sessions//stream")
async def empty_session_socket(websocket: WebSocket, fe: Any = Depends(frontend)):
    """An empty session id names no session: closed 4404 naming session_id, as an unknown one."""
    await websocket.accept()
    try:
        fe.check_auth(websocket, admin=False)
    except ServeError as exc:
        return await websocket.close(code=_close_code(exc), reason=exc.message[:120])
    await websocket.close(code=4404, reason="session_id: the session id is empty")
