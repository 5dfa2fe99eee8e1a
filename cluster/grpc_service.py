"""gRPC API (``proto/ditserve/v1/ditserve.proto``, service ``ditserve.v1.DitServe``) on the Frontend.

How Serve 2.60 dispatches gRPC: its gRPC proxy (``serve.start(grpc_options=gRPCOptions(port=...,
grpc_servicer_functions=["ditserve.cluster.grpc_gen.ditserve_pb2_grpc.add_DitServeServicer_to_server"]))``)
registers the service's method table, picks the application (metadata ``application``, or the only one),
and calls the method **named like the RPC** on that application's ingress deployment, with the decoded
request message and, when the method has a ``grpc_context`` parameter, a ``RayServegRPCContext``. The
replica looks the name up with ``getattr`` on the ingress object, so a FastAPI ingress can carry the RPC
methods next to its routes: ``Frontend`` mixes in :class:`GrpcMethods`. One deployment serves both
protocols with the same engine handle, limits and checks: requests are turned into the HTTP API's pydantic
models, so a bad field fails with the same message (INVALID_ARGUMENT naming it). Server reflection is on
(Serve's proxy enables it for the registered services), so ``grpcurl`` needs no ``-proto``. The standard
``grpc.health.v1.Health`` service is registered as well (``deploy.GRPC_SERVICER_FUNCTIONS``) and answered
here the same way (``Check``, ``List``, ``Watch``), as ``Health`` answers.

Status codes: each typed error (``errors.py``) has one (``GRPC_CODES``); the details are its message, led by
the field it is about (HTTP's ``param``) where the message does not start with it. The API key
travels as metadata ``authorization: Bearer <key>``. Messages larger than ``max_body_bytes`` are refused
(RESOURCE_EXHAUSTED). A message that is not valid protobuf is refused by Serve's proxy before it
reaches this code (UNKNOWN, "Error parsing message with type 'ditserve.v1.…': Wire format was corrupt").
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, ValidationError

from .errors import (
    BadRequest,
    Conflict,
    Contended,
    InternalError,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    ReplicaUnavailable,
    ServeError,
    SessionGone,
    Unauthorized,
    Unsupported,
    validation_error,
)
from .grpc_gen import ditserve_pb2 as pb
from .schemas import ImageGenerationRequest

logger = logging.getLogger("ditserve")

# Each typed error as gRPC answers it.
GRPC_CODES: dict[type[ServeError], grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    # gRPC's guide: FAILED_PRECONDITION when the client should not retry until the state is fixed (a video
    # that is not completed, or failed), ABORTED for a concurrency conflict that a retry of the same call
    # resolves (the adapter being unloaded is gone once its requests are done).
    Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    Contended: grpc.StatusCode.ABORTED,
    SessionGone: grpc.StatusCode.NOT_FOUND,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    InternalError: grpc.StatusCode.INTERNAL,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    ReplicaUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def grpc_code(exc: ServeError) -> grpc.StatusCode:
    # By the class hierarchy: an error re-raised by Ray may be a subclass that is also a RayTaskError.
    return next(GRPC_CODES[cls] for cls in type(exc).__mro__ if cls in GRPC_CODES)


class _Metadata:
    """The bit of a Starlette request the shared HTTP helpers read (``headers``), from gRPC metadata."""

    def __init__(self, context: Any):
        pairs = context.invocation_metadata() if context is not None else []
        self.headers = {k.lower(): v for k, v in pairs if isinstance(v, str)}


def _typed(exc: Exception) -> ServeError:
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors(), whole="request")
    logger.error("gRPC call failed", exc_info=exc)
    return InternalError(f"internal error ({type(exc).__name__}); see the server log")


# The HTTP routes a message tells the client to call instead, as the RPCs a gRPC client calls (and the
# form's file fields, as EditImageRequest's repeated image).
_RPC_OF_ROUTE = (
    ("(image, or image[] for several)", "(the image field, once per file)"),
    ("POST /v1/admin/memory/resume", "ResumeMemory"),
    ("POST /v1/admin/shutdown", "Shutdown"),
    ("POST /v1/admin/weights", "UpdateWeights"),
    ("POST /v1/images/edits", "EditImage"),
    ("/v1/images/generations", "Generate"),
    ("POST /v1/videos/{id}/remix", "RemixVideo"),
    ("POST /v1/videos", "CreateVideo"),
)


def _in_rpc_terms(message: str) -> str:
    for route, rpc in _RPC_OF_ROUTE:
        message = message.replace(route, rpc)
    return message


def _details(err: ServeError) -> str:
    """The error's message in RPC terms, naming its field: an HTTP answer carries the field beside the message
    (``param``), a gRPC status its details alone, so a message that does not start with the field ("video
    'x' does not exist", param video_id) gets it in front, as the messages that name it do."""
    message = _in_rpc_terms(err.message)
    if err.param and not re.match(rf"{re.escape(err.param)}\b", message):
        message = f"{err.param}: {message}"
    return message


def _fail(context: Any, exc: Exception) -> None:
    err = _typed(exc)
    context.set_code(grpc_code(err))
    details = _details(err)
    if err.retry_after is not None:
        # HTTP's Retry-After, in the message: Serve's gRPC proxy sends a failed call's code and details only
        # (trailing metadata set here never reaches the client).
        details += f" (retry after {max(1, int(err.retry_after))} s)"
    context.set_details(details)


def unary(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, grpc_context=None):
        try:
            self.check_message_size(request)
            return await fn(self, request, grpc_context)
        except Exception as exc:  # every failure gets a code and a message, never a stack trace
            _fail(grpc_context, exc)
            raise RuntimeError(grpc_context.details()) from None  # Serve keeps the code we set

    return wrapper


def streaming(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, grpc_context=None):
        try:
            self.check_message_size(request)
            async for message in fn(self, request, grpc_context):
                yield message
        except Exception as exc:  # every failure gets a code and a message, never a stack trace
            _fail(grpc_context, exc)
            raise RuntimeError(grpc_context.details()) from None

    return wrapper


_INT64_TYPES = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
_FLOAT_TYPES = (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT)


def _numbers(descriptor: Any, data: dict[str, Any]) -> None:
    """Numbers as the client sent them, in ``data`` (the JSON mapping of a message of ``descriptor``) and its
    nested messages: the mapping writes 64-bit integers as strings, and NaN and the infinities as "NaN",
    "Infinity", "-Infinity", which the HTTP models would refuse as not numbers rather than as not finite."""
    for field in descriptor.fields:
        if field.name not in data:
            continue
        values = data[field.name] if field.is_repeated else [data[field.name]]
        if field.message_type is not None:
            for value in values:
                if isinstance(value, dict):
                    _numbers(field.message_type, value)
            continue
        if field.cpp_type in _INT64_TYPES:
            convert: Any = int
        elif field.cpp_type in _FLOAT_TYPES:
            convert = float
        else:
            continue
        converted = [convert(v) if isinstance(v, str) else v for v in values]
        data[field.name] = converted if field.is_repeated else converted[0]


# Plain strings whose "" the proto documents as not given: a StepCache without a policy is the server's
# default ({}), or the policy its settings name ({"threshold": 0.3} is fbcache), as HTTP's cache object.
_EMPTY_IS_UNSET = frozenset({"ditserve.v1.StepCache.policy"})


def _plain_strings(descriptor: Any, data: dict[str, Any]) -> None:
    """A string without ``optional`` has no presence: "" is what the client sent (the JSON mapping leaves it
    out), so an empty prompt, or an adapter's empty name, is refused as HTTP refuses {"prompt": ""} or
    {"lora": [{"name": ""}]}, not as a missing field. In ``data`` and its nested messages."""
    for field in descriptor.fields:
        if field.message_type is not None:
            values = data.get(field.name, [])
            for value in values if field.is_repeated else [values]:
                if isinstance(value, dict) and not field.message_type.GetOptions().map_entry:
                    _plain_strings(field.message_type, value)
            continue
        plain = field.type == FieldDescriptor.TYPE_STRING and not field.has_presence and not field.is_repeated
        if plain and field.name not in data and field.full_name not in _EMPTY_IS_UNSET:
            data[field.name] = ""


def fields(message: Any, files: tuple[str, ...] = (), **rename: str) -> dict[str, Any]:
    """The fields a client set (proto3 ``optional`` presence) and its plain strings, named as in the HTTP API;
    ``files``: bytes fields left out (uploads are read as bytes, not as the JSON mapping's base64 of them)."""
    if files:
        rest = type(message)()
        rest.CopyFrom(message)
        for name in files:
            rest.ClearField(name)
        message = rest
    data = MessageToDict(message, preserving_proto_field_name=True)
    _numbers(message.DESCRIPTOR, data)
    _plain_strings(message.DESCRIPTOR, data)
    return {rename.get(k, k): v for k, v in data.items()}


def _json(response) -> dict[str, Any]:
    return json.loads(response.body)


def _admin_reply(data: dict[str, Any]) -> pb.AdminReply:
    return pb.AdminReply(
        version=int(data.get("version", 0)),
        replicas=[str(a["replica"]) for a in data.get("replicas", [])],
        missing=int(data.get("missing", 0)),
    )


def _result_message(
    result: Any,
    replica: str,
    images: list[bytes] | None = None,
    output_format: str = "png",
    session_step: int = 0,
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        session_step=session_step,
        created=int(time.time()),
        images=list(result.outputs) if images is None else images,
        seed=result.seed,
        size=f"{result.width}x{result.height}",
        replica=replica,
        usage=_usage(getattr(result, "usage", None)),
        output_format=output_format,
    )


async def _encoded_result(result: Any, replica: str, body: Any) -> pb.GenerateResponse:
    """The result with its images in the request's ``output_format`` (re-encoded off the event loop)."""
    from .api_edits import encode_output

    fmt, compression = body.output_format, body.output_compression
    images = list(result.outputs)
    if fmt != "png":
        images = await asyncio.to_thread(lambda: [encode_output(png, fmt, compression) for png in images])
    return _result_message(result, replica, images, fmt)


def _usage(usage: dict[str, Any] | None) -> pb.Usage | None:
    """A request's usage as HTTP reports it (token fields, transformer forwards, cached forwards, cache
    policy) as the proto's message."""
    if not usage:
        return None
    from .schemas import api_usage

    api = api_usage(usage)
    details = api["input_tokens_details"]
    return pb.Usage(
        transformer_forwards=int(api["transformer_forwards"]),
        cached_forwards=int(api["cached_forwards"]),
        cache_policy=str(api["cache_policy"]),
        input_tokens=int(api["input_tokens"]),
        input_tokens_details=pb.InputTokensDetails(
            text_tokens=int(details["text_tokens"]), image_tokens=int(details["image_tokens"])
        ),
        output_tokens=int(api["output_tokens"]),
        total_tokens=int(api["total_tokens"]),
    )


def _video_job(data: dict[str, Any]) -> pb.VideoJob:
    error = data.get("error") or {}
    return pb.VideoJob(
        id=data["id"],
        object=data.get("object", "video"),
        status=data.get("status", ""),
        progress=int(data.get("progress", 0)),
        created_at=int(data.get("created_at") or 0),
        completed_at=int(data.get("completed_at") or 0),
        expires_at=int(data.get("expires_at") or 0),
        model=data.get("model", ""),
        size=data.get("size", ""),
        seconds=str(data.get("seconds", "")),
        num_frames=int(data.get("num_frames", 0)),
        fps=int(data.get("fps", 0)),
        prompt=data.get("prompt") or "",
        error=error.get("message", "") if isinstance(error, dict) else str(error),
        error_code=error.get("code", "") if isinstance(error, dict) else "",
        deleted=bool(data.get("deleted", False)),
        usage=_usage(data.get("usage")),
        remixed_from_video_id=data.get("remixed_from_video_id") or "",
    )


def _validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    return model.model_validate(data)


def _session_id(data: dict[str, Any]) -> str:
    """A session step's session_id, taken out of its fields (the rest are the step's)."""
    session_id = data.pop("session_id", "")
    if not session_id:
        raise BadRequest("session_id: the session id is required", param="session_id")
    return session_id


def _unknown_field(message: Any, path: str = "") -> str | None:
    """Where ``message`` (or a message in it) holds a field its type does not have, e.g. ``lora.0: field 7``;
    None when it holds none."""
    from google.protobuf.unknown_fields import UnknownFieldSet

    unknown = UnknownFieldSet(message)
    if len(unknown):
        return f"{path}field {unknown[0].field_number}"
    for field, value in message.ListFields():
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        for index, item in enumerate(value) if field.is_repeated else [(None, value)]:
            where = f"{path}{field.name}{'' if index is None else f'.{index}'}: "
            found = _unknown_field(item, where)
            if found is not None:
                return found
    return None


# The services grpc.health.v1's Check answers for: the server as a whole ("") and the API.
HEALTH_SERVICES = ("", "ditserve.v1.DitServe")
HEALTH_WATCH_S = 5.0


class GrpcMethods:
    """The RPCs of ``ditserve.v1.DitServe``, mixed into the Frontend ingress (``self`` is the Frontend)."""

    def check_message_size(self, request: Any) -> None:
        """The message's size, and that it holds no field this server's proto lacks: a client built from
        another ditserve.proto would see such a setting ignored, where HTTP refuses a field it lacks."""
        unknown = _unknown_field(request)
        if unknown is not None:
            raise BadRequest(
                f"{unknown} of {request.DESCRIPTOR.full_name} is not in this server's ditserve.proto; "
                "it is refused rather than ignored (leave it out, or use a server that has it)"
            )
        size, limit = request.ByteSize(), self.args.max_body_bytes
        if isinstance(request, pb.EditImageRequest):  # image files on top, as POST /v1/images/edits
            from .api_edits import upload_allowance

            limit += upload_allowance(self)
        elif isinstance(request, pb.CreateVideoRequest):  # the first frame, as POST /v1/videos
            from .api_videos import reference_allowance

            limit += reference_allowance(self)
        if size > limit:
            raise PayloadTooLarge(
                f"message is {size} bytes; the server's limit is {limit} bytes (--max-body-bytes)",
                param="max_body_bytes",
            )

    # -- images ------------------------------------------------------------------------------------------
    @unary
    async def Generate(self, request, grpc_context=None):
        self.check_auth(_Metadata(grpc_context), admin=False)
        body = _validate(ImageGenerationRequest, fields(request))
        if body.preview:  # as HTTP refuses it without stream (partial_images is ignored, as OpenAI's)
            raise BadRequest("preview: previews come with GenerateStream", param="preview")
        params, _, _ = self.image_params(body)
        answer = await self.call_engine(self.generate.remote(params))
        return await _encoded_result(answer["result"], answer["replica"], body)

    async def _image_events(self, params: Any, preview: bool, partial_images: int | None):
        """A streamed image's events as HTTP's SSE stream sends them: a preview with each step but the last
        when asked (``partial_images``: with the last N steps only)."""
        from .api_stream import engine_events

        if partial_images is not None and not preview:
            preview = partial_images > 0
        stream = self.engine.options(stream=True).generate_stream.remote(params, preview)
        async for event in engine_events(self, stream):
            if event["type"] == "progress" and partial_images is not None:
                if event["step"] < event["total"] - partial_images:
                    event = {k: v for k, v in event.items() if k != "preview"}
            yield _event_message(event)

    @streaming
    async def GenerateStream(self, request, grpc_context=None):
        self.check_auth(_Metadata(grpc_context), admin=False)
        body = _validate(ImageGenerationRequest, fields(request))
        if body.output_format != "png":
            raise BadRequest("output_format: streamed images are png; leave it out", param="output_format")
        params, _, _ = self.image_params(body)
        async for message in self._image_events(params, body.preview, body.partial_images):
            yield message

    async def _edit(self, request, grpc_context) -> tuple[Any, Any]:
        """EditImage's request as POST /v1/images/edits checks it → (the validated fields, engine params).
        Decoding the images to check them is CPU work in proportion to the upload: in a worker thread, as
        HTTP's, not on the event loop that serves every other request of this frontend."""
        from .api_edits import edit_params, validate_edit

        self.check_auth(_Metadata(grpc_context), admin=False)

        def checked() -> tuple[Any, Any]:
            body = validate_edit(fields(request, files=("image", "mask")))
            mask = request.mask if request.HasField("mask") else None
            params, _, _ = edit_params(self, body, list(request.image), mask)
            return body, params

        return await asyncio.to_thread(checked)

    @unary
    async def EditImage(self, request, grpc_context=None):
        body, params = await self._edit(request, grpc_context)
        answer = await self.call_engine(self.generate.remote(params))
        return await _encoded_result(answer["result"], answer["replica"], body)

    @streaming
    async def EditImageStream(self, request, grpc_context=None):
        body, params = await self._edit(request, grpc_context)
        if body.output_format != "png":
            raise BadRequest("output_format: streamed images are png; leave it out", param="output_format")
        async for message in self._image_events(params, False, body.partial_images):
            yield message

    # -- videos ------------------------------------------------------------------------------------------
    @unary
    async def CreateVideo(self, request, grpc_context=None):
        from .api_videos import VideoCreateRequest, video_params

        self.check_auth(_Metadata(grpc_context), admin=False)
        body = _validate(VideoCreateRequest, fields(request, files=("input_reference",)))
        upload = request.input_reference if request.HasField("input_reference") else None
        params = await asyncio.to_thread(
            video_params, self, body, upload
        )  # decodes the reference: off the loop
        answer = await self.call_engine(self.engine.create_video.remote(params, self.model_name, body.prompt))
        return _video_job(answer["video"])

    async def _video_call(self, request, grpc_context, method: str) -> dict[str, Any]:
        from .api_videos import call_job, pinned

        self.check_auth(_Metadata(grpc_context), admin=False)
        if not request.id:
            raise BadRequest("id: the video id is required", param="id")
        handle = pinned(self, request.id)
        return await call_job(self, request.id, getattr(handle, method).remote(request.id))

    @unary
    async def GetVideo(self, request, grpc_context=None):
        from .api_videos import VideoLost, lost_video

        try:
            answer = await self._video_call(request, grpc_context, "get_video")
        except VideoLost:  # as GET /v1/videos/{id}: the job failed with the reason
            return _video_job(lost_video(request.id, self.model_name))
        return _video_job(answer["video"])

    @unary
    async def DeleteVideo(self, request, grpc_context=None):
        from .api_videos import VideoLost

        try:
            answer = await self._video_call(request, grpc_context, "delete_video")
        except VideoLost:  # nothing is left of it anywhere: deleted
            return pb.VideoJob(id=request.id, object="video.deleted", deleted=True)
        return _video_job(answer["video"])

    @unary
    async def GetVideoContent(self, request, grpc_context=None):
        from .api_videos import MEDIA_TYPES, VideoLost, lost_video, video_variant

        variant = request.variant if request.HasField("variant") else "video"
        if variant not in MEDIA_TYPES:  # said before the job is asked
            raise BadRequest(f"variant: one of {', '.join(MEDIA_TYPES)}, got {variant!r}", param="variant")
        try:
            answer = await self._video_call(request, grpc_context, "video_content")
        except VideoLost:
            message = lost_video(request.id)["error"]["message"]
            raise Conflict(f"video {request.id!r} failed: {message}", param="video_id") from None
        if variant == "video":
            return pb.VideoContent(id=request.id, mp4=answer["mp4"], media_type=MEDIA_TYPES[variant])
        image = await asyncio.to_thread(video_variant, answer["mp4"], variant)
        return pb.VideoContent(id=request.id, image=image, media_type=MEDIA_TYPES[variant])

    @unary
    async def ListVideos(self, request, grpc_context=None):
        from .api_videos import list_page

        self.check_auth(_Metadata(grpc_context), admin=False)
        page = await list_page(
            self,
            request.after if request.HasField("after") else None,
            request.limit if request.HasField("limit") else 20,
            request.order if request.HasField("order") else "desc",
        )
        return pb.VideoList(
            data=[_video_job(v) for v in page["data"]],
            first_id=page["first_id"] or "",
            last_id=page["last_id"] or "",
            has_more=page["has_more"],
        )

    @unary
    async def RemixVideo(self, request, grpc_context=None):
        from .api_videos import remix

        self.check_auth(_Metadata(grpc_context), admin=False)
        if not request.id:
            raise BadRequest("id: the video id is required", param="id")
        return _video_job((await remix(self, request.id, request.prompt))["video"])

    # -- sessions ----------------------------------------------------------------------------------------
    @unary
    async def OpenSession(self, request, grpc_context=None):
        from .api_sessions import SessionOpenRequest, open_session

        body = _validate(SessionOpenRequest, fields(request))
        data = _json(await open_session(body, _Metadata(grpc_context), self))
        return pb.Session(id=data["id"], size=data["size"])

    @streaming
    async def SessionGenerateStream(self, request, grpc_context=None):
        from .api_sessions import _pinned, step_params
        from .api_stream import StreamStep, engine_events

        self.check_auth(_Metadata(grpc_context), admin=False)
        data = fields(request)
        session_id = _session_id(data)
        step = _validate(StreamStep, data)
        params = step_params(self, step)
        handle = _pinned(self, session_id).options(stream=True)
        stream = handle.session_stream.remote(session_id, params, step.strength, step.preview)
        async for event in engine_events(self, stream):
            yield _event_message(event)

    @unary
    async def SessionGenerate(self, request, grpc_context=None):
        from .api_sessions import SessionGenerateRequest, _pinned, step_params

        self.check_auth(_Metadata(grpc_context), admin=False)
        data = fields(request)
        session_id = _session_id(data)
        if data.pop("preview", False):  # as HTTP's POST .../generate, which takes no preview
            raise BadRequest("preview: previews come with SessionGenerateStream", param="preview")
        step = _validate(SessionGenerateRequest, data)
        params = step_params(self, step)
        call = _pinned(self, session_id).session_generate.remote(session_id, params, step.strength)
        answer = await self.call_engine(call)
        return _result_message(answer["result"], answer["replica"], session_step=answer["step"])

    @unary
    async def CloseSession(self, request, grpc_context=None):
        from .api_sessions import close_session

        self.check_auth(_Metadata(grpc_context), admin=False)  # before the id is looked at, as every RPC
        if not request.id:
            raise BadRequest("id: the session id is required", param="id")
        await close_session(request.id, _Metadata(grpc_context), self)
        return pb.Session(id=request.id, closed=True)

    # -- models and admin --------------------------------------------------------------------------------
    @unary
    async def ListModels(self, request, grpc_context=None):
        return pb.ListModelsResponse(
            data=[pb.ModelCard(id=self.model_name, kind=self.model_kind, created=self.created)]
        )

    @unary
    async def ListReplicas(self, request, grpc_context=None):
        from google.protobuf.struct_pb2 import Struct

        from .api_admin import PUBLIC_REPLICA_FIELDS, replica_list

        listed = await replica_list(self, _Metadata(grpc_context))
        replicas = []
        for entry in listed["data"]:
            details = Struct()
            details.update({k: v for k, v in entry.items() if k not in PUBLIC_REPLICA_FIELDS})
            replicas.append(
                pb.Replica(
                    replica_id=entry["replica_id"],
                    health=str(entry.get("health", "")),
                    device=str(entry.get("device", "")),
                    control_version=int(entry.get("control_version", 0)),
                    layout={k: int(v) for k, v in (entry.get("layout") or {}).items()},
                    details=details,
                )
            )
        return pb.ListReplicasResponse(
            data=replicas, expected=int(listed["expected"]), desired_version=int(listed["desired_version"])
        )

    @unary
    async def Health(self, request, grpc_context=None):
        return pb.HealthReply(**await self.health())

    # -- grpc.health.v1.Health (grpc_health_probe, Kubernetes' gRPC probes, load balancers) ---------------
    async def _serving(self) -> int:
        """SERVING while Health answers "ok", NOT_SERVING while it answers UNAVAILABLE (shut down, or the
        control state does not answer)."""
        from grpc_health.v1 import health_pb2

        try:
            await self.health()
        except ReplicaUnavailable:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    @unary
    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        if request.service not in HEALTH_SERVICES:
            raise NotFound(
                f"service: {request.service!r} is not served here; ask for {' or '.join(map(repr, HEALTH_SERVICES))}",
                param="service",
            )
        return health_pb2.HealthCheckResponse(status=await self._serving())

    @unary
    async def List(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse(status=await self._serving())
        return health_pb2.HealthListResponse(statuses={name: status for name in HEALTH_SERVICES})

    @streaming
    async def Watch(self, request, grpc_context=None):
        """The status now, then each change (looked at every ``HEALTH_WATCH_S``), until the client leaves; a
        service not served here is SERVICE_UNKNOWN, as the health protocol answers it."""
        from grpc_health.v1 import health_pb2

        if request.service not in HEALTH_SERVICES:
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            return
        sent = None
        while True:
            status = await self._serving()
            if status != sent:
                yield health_pb2.HealthCheckResponse(status=status)
                sent = status
            await asyncio.sleep(HEALTH_WATCH_S)

    @unary
    async def LoadLoRA(self, request, grpc_context=None):
        from .api_admin import LoRALoadRequest, load_lora

        self.check_auth(_Metadata(grpc_context), admin=True)
        body = _validate(LoRALoadRequest, fields(request))
        return _admin_reply(_json(await load_lora(body, _Metadata(grpc_context), self)))

    @unary
    async def ListLoRAs(self, request, grpc_context=None):
        from .api_admin import list_loras

        data = await list_loras(_Metadata(grpc_context), self)
        return pb.ListLoRAsResponse(
            data=[
                pb.LoRAInfo(name=d["name"], path=d["path"], scale=d["scale"], target=d["target"])
                for d in data["data"]
            ],
            version=int(data["version"]),
        )

    @unary
    async def UnloadLoRA(self, request, grpc_context=None):
        from .api_admin import unload_lora

        self.check_auth(_Metadata(grpc_context), admin=True)
        if not request.name:
            raise BadRequest("name: the adapter name is required", param="name")
        return _admin_reply(_json(await unload_lora(request.name, _Metadata(grpc_context), self)))

    @unary
    async def UpdateWeights(self, request, grpc_context=None):
        from .api_admin import WeightsRequest, update_weights

        self.check_auth(_Metadata(grpc_context), admin=True)
        body = _validate(WeightsRequest, fields(request))
        return _admin_reply(_json(await update_weights(body, _Metadata(grpc_context), self)))

    @unary
    async def ReleaseMemory(self, request, grpc_context=None):
        from .api_admin import memory

        return _admin_reply(_json(await memory("release", _Metadata(grpc_context), self)))

    @unary
    async def ResumeMemory(self, request, grpc_context=None):
        from .api_admin import memory

        return _admin_reply(_json(await memory("resume", _Metadata(grpc_context), self)))

    @unary
    async def Shutdown(self, request, grpc_context=None):
        from .api_admin import shutdown

        return _admin_reply(_json(await shutdown(_Metadata(grpc_context), self)))


def _event_message(event: dict[str, Any]) -> pb.GenerateEvent:
    if event["type"] == "progress":
        return pb.GenerateEvent(
            progress=pb.Progress(step=event["step"], total=event["total"], preview=event.get("preview", b""))
        )
    return pb.GenerateEvent(
        result=_result_message(event["result"], event["replica"], session_step=event.get("step", 0))
    )
