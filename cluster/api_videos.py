"""Videos as asynchronous jobs, in the shape of OpenAI's videos API (an ``APIRouter`` included by
``frontend``): ``POST /v1/videos`` → a job, ``GET /v1/videos`` (the jobs of every replica, cursor pages),
``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content`` (H.264 MP4; ``variant=thumbnail``: the first
frame as WebP, ``variant=spritesheet``: a JPEG grid of frames), ``POST /v1/videos/{id}/remix`` (the same
job with another prompt), ``DELETE /v1/videos/{id}``. OpenAI's video edits, extensions and characters
answer 501.

The job lives on the replica that runs it (``replica_streams``); its id ``<replica_id>.<random>`` is
routed like a session id, so any frontend, including a restarted one, reaches it. ``POST`` takes JSON or
``multipart/form-data`` (what OpenAI's client sends); form values are validated by the same model.

A job's ``usage`` (once completed) is in the shape of image responses' and gRPC's ``VideoJob.usage``:
OpenAI's token fields (``input_tokens``, ``input_tokens_details`` {``text_tokens``, ``image_tokens``},
``output_tokens``, ``total_tokens``) and ``transformer_forwards``, ``cached_forwards``, ``cache_policy``.

An empty id (``DELETE /v1/videos/``, ``/v1/videos//content``, ``/v1/videos//remix``) is a 404 naming
``video_id``, as an unknown one; ``GET`` and ``POST`` on ``/v1/videos/`` are the list and the create.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from ray.serve.exceptions import DeploymentUnavailableError

from ditserve.replica.caching import CacheSettings
from ditserve.replica.media import check_image, first_frame_refusal, image_size
from ditserve.replica.models.registry import video_model_hint
from ditserve.replica.request import GenerationParams, LoRARef

from .errors import BadRequest, Conflict, NotFound, SessionGone, Unsupported, validation_error
from .http_base import (
    ERROR_DESCRIPTIONS,
    REPLICA_HEADER,
    base64_bytes,
    check_size,
    form_hint,
    form_list,
    frontend,
    list_in_form,
    multipart_message,
    nest_form_fields,
    requested_size,
)
from .replica_streams import token_ms
from .router import session_owner
from .schemas import ErrorResponse, Prompt, api_usage, json_field

router = APIRouter(prefix="/v1/videos", tags=["videos"])
VIDEOS_PATH = "/v1/videos"
REF = "#/components/schemas/{model}"  # nested models (cache) point into the OpenAPI components
VIDEO_TOKEN = re.compile(r"[0-9a-f]{32}")  # a video id's part after the replica (replica_streams.video_token)


class ImageReference(BaseModel):
    """OpenAI's reference object: ``{"image_url": "data:image/png;base64,..."}`` (``file_id`` is refused:
    there is no files API here)."""

    model_config = ConfigDict(extra="forbid")

    image_url: str | None = Field(default=None, description="A base64 data URL of a PNG / JPEG / WebP image.")
    file_id: str | None = Field(default=None, description="Not supported (no files API): a 400.")


NUMBER_FIELDS = (
    "seconds",
    "num_frames",
    "fps",
    "num_inference_steps",
    "guidance_scale",
    "guidance_scale_2",
    "seed",
)


class VideoCreateRequest(BaseModel):
    """``POST /v1/videos``: OpenAI's fields (prompt, model, size, seconds) plus frames, fps, steps, seed,
    adapters and the step cache."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: Prompt = Field(description="What to film.")
    model: str | None = Field(default=None, description="Model name (default: the served one).")
    size: str | None = Field(default=None, description="WIDTHxHEIGHT (default: the model's native size).")
    seconds: float | None = Field(
        default=None,
        allow_inf_nan=False,
        gt=0,
        le=600,
        description="Duration (default 1, capped by max_frames); frames = seconds·fps, rounded to what the model takes.",
    )
    num_frames: int | None = Field(
        default=None, ge=1, description="Frames (instead of seconds; given both, they must agree)."
    )
    fps: int | None = Field(
        default=None,
        ge=1,
        le=120,
        description="Frame rate of the MP4 (default: the model's, 16 for Wan 2.1 / 2.2 A14B, 24 for Wan 2.2 "
        "TI2V-5B and HunyuanVideo 1.5).",
    )
    num_inference_steps: int = Field(default=20, ge=1, description="Denoising steps.")
    guidance_scale: float | None = Field(
        default=None, allow_inf_nan=False, ge=0, le=100, description="CFG scale (model default)."
    )
    negative_prompt: str | None = Field(default=None, description="What not to film.")
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="Random seed (random when absent).")
    guidance_scale_2: float | None = Field(
        default=None,
        allow_inf_nan=False,
        ge=0,
        le=100,
        description="Two-expert models (Wan 2.2 A14B): the low-noise expert's CFG scale (default: guidance_scale).",
    )
    input_reference: str | ImageReference | None = Field(
        default=None,
        description="The first frame of an image-to-video model, resized to size: a file part (multipart, as "
        'OpenAI\'s client sends it), or a base64 data URL (a string or {"image_url": ...}).',
    )
    lora: LoRARef | list[LoRARef] | None = Field(
        default=None,
        description="Adapter(s) for this video, each {name, scale} (as on /v1/images/generations); in a "
        "multipart form: JSON text, or lora[name] and lora[scale] fields for one adapter.",
    )
    cache: CacheSettings | None = Field(
        default=None,
        description="Step cache of this video (as on /v1/images/generations); in a multipart form: JSON text, "
        "or cache[policy], cache[threshold], ... fields (as OpenAI's client sends extra_body).",
    )

    _json = field_validator("lora", "cache", mode="before")(json_field)

    @field_validator(*NUMBER_FIELDS, mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any, info: ValidationInfo) -> Any:
        """Numbers come as JSON numbers or as text (form fields, OpenAI's ``seconds``), never as true/false
        (which lax parsing would read as 1 and 0)."""
        if isinstance(value, bool):
            raise ValueError(f"a number, not {str(value).lower()}")
        return value


def _data_url(value: str) -> bytes:
    """``data:<type>;base64,<data>`` → the bytes (the server fetches nothing, so other URLs are refused)."""
    head, sep, data = value.partition(",")
    head = head.strip().lower()  # a URL's scheme and a data URL's ";base64" are case-insensitive
    if not head.startswith("data:") or not sep or not head.endswith(";base64"):
        raise BadRequest(
            "input_reference: give an image file, or a base64 data URL (data:image/png;base64,...); "
            "the server fetches no URLs",
            param="input_reference",
        )
    decoded = base64_bytes(data)
    if decoded is None:
        raise BadRequest("input_reference: the data URL is not valid base64", param="input_reference")
    return decoded


def reference_bytes(body: VideoCreateRequest, upload: bytes | None) -> bytes | None:
    """The first frame as encoded bytes: an uploaded file, or the body's data URL (not both)."""
    given = body.input_reference
    if upload is not None and given is not None:
        raise BadRequest("input_reference: given twice (a file and a URL)", param="input_reference")
    if upload is not None:
        return upload
    if isinstance(given, ImageReference):
        if given.file_id is not None or given.image_url is None:
            given_id = (
                "file_id is not supported (no files API)" if given.file_id is not None else "no image_url"
            )
            raise BadRequest(
                f"input_reference: {given_id}; give image_url as a data URL", param="input_reference"
            )
        given = given.image_url
    return None if given is None else _data_url(given)


def reference_allowance(fe: Any) -> int:
    """Bytes a video request may carry beyond ``max_body_bytes``: the first frame, where the model takes one,
    at its size as a JSON data URL (base64: 4 bytes for every 3, and a line break, up to 2 bytes, every 76
    characters where it is wrapped as MIME wraps it; a file part is checked when decoded)."""
    if fe.spec.first_frame == "none":
        return 0
    encoded = 4 * -(-fe.args.max_image_bytes // 3)
    return encoded + 2 * -(-encoded // 76)


def video_params(fe: Any, body: VideoCreateRequest, upload: bytes | None = None) -> GenerationParams:
    """Checks shared by HTTP and gRPC → engine parameters (``upload``: the input_reference file)."""
    fe.check_model(body.model)
    if fe.model_kind != "video":
        raise BadRequest(
            f"model: {fe.model_name!r} makes images; videos need a video model "
            f"(e.g. --model {video_model_hint()})",
            param="model",
        )
    limits = fe.args
    body = fe.check_prompt_and_steps(body)
    multiple = fe.spec.frame_multiple
    fps = fe.spec.fps if body.fps is None else body.fps
    frames = body.num_frames
    wanted = round((body.seconds if body.seconds is not None else 1.0) * fps)
    timed = multiple * max(1, round((wanted - 1) / multiple)) + 1  # the frames the duration asks
    if frames is None:
        frames = timed
        if body.seconds is None:  # the default (1 s) shrinks to what the server allows
            frames = min(frames, multiple * ((limits.max_frames - 1) // multiple) + 1)
    elif (frames - 1) % multiple:
        raise BadRequest(
            f"num_frames: must be {multiple}·k + 1 for {fe.model_name}, got {frames}", param="num_frames"
        )
    elif body.seconds is not None and frames != timed:  # one of them would be served wrong
        raise BadRequest(
            f"seconds: {body.seconds:g} s at {fps} fps is {timed} frames, but num_frames is {frames} "
            f"({frames / fps:g} s); give seconds or num_frames, not both",
            param="seconds",
        )
    if frames > limits.max_frames:
        most = multiple * ((limits.max_frames - 1) // multiple) + 1  # the longest video this model makes here
        if body.num_frames is not None:
            raise BadRequest(
                f"num_frames: {frames} frames is above the maximum {limits.max_frames}", param="num_frames"
            )
        raise BadRequest(  # OpenAI's clients know durations alone: say which one fits
            f"seconds: {body.seconds:g} s at {fps} fps is {frames} frames, above the maximum "
            f"{limits.max_frames}; ask at most {most / fps:g} s (or a lower fps)",
            param="seconds",
        )
    refused = fe.spec.refusal(body.cache, body.guidance_scale_2, guidance_scale=body.guidance_scale)
    if refused is not None:
        raise BadRequest(refused[1], param=refused[0])
    kwargs: dict[str, Any] = {} if body.seed is None else {"seed": body.seed}
    reference = reference_bytes(body, upload)
    first_frame = fe.spec.first_frame
    if reference is not None:
        if first_frame == "none":
            raise BadRequest(
                f"input_reference: {fe.model_name} is a text-to-video model and takes no reference image",
                param="input_reference",
            )
        try:
            width, height = check_image(
                reference,
                "input_reference",
                max_bytes=limits.max_image_bytes,
                max_pixels=limits.max_image_pixels,
            )
        except ValueError as exc:
            raise BadRequest(str(exc), param="input_reference") from None
        if (refused := first_frame_refusal(width, height)) is not None:
            raise BadRequest(refused, param="input_reference")
        kwargs["images"] = (reference,)  # resized to width x height by the model's own video processor
    elif first_frame == "required":
        raise BadRequest(
            f"input_reference: {fe.model_name} is an image-to-video model; give the first frame",
            param="input_reference",
        )
    default = fe.default_size
    if reference is not None:  # where the pipeline sizes image-to-video by the first frame (HunyuanVideo 1.5)
        sized = fe.spec.fitted_size(limits.max_width, limits.max_height, image_size(reference))
        default = f"{sized[0]}x{sized[1]}"
    width, height = check_size(
        requested_size(body.size, default), limits.max_width, limits.max_height, fe.spec.size_multiple
    )
    return GenerationParams(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        width=width,
        height=height,
        num_frames=frames,
        fps=fps,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        guidance_scale_2=body.guidance_scale_2,
        cache=body.cache,
        lora=() if body.lora is None else tuple(body.lora if isinstance(body.lora, list) else [body.lora]),
        **kwargs,
    )


def _binary(part: Any, data: bytes) -> bool:
    """A form part that carries a file without naming one (curl's ``-F 'input_reference=<first.png'``, a
    part typed ``image/png``): a declared type other than text, or bytes that are not UTF-8 text."""
    if part.get_content_maintype() != "text":
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _form_fields(content_type: str, raw: bytes) -> tuple[dict[str, Any], bytes | None]:
    """multipart/form-data → ({name: value}, the input_reference file) with the standard library's MIME
    parser (binary parts come back byte for byte); a text ``input_reference`` is a data URL."""
    message = multipart_message(content_type, raw)
    fields: dict[str, Any] = {}
    upload = None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        data = part.get_payload(decode=True) or b""
        if name == "input_reference" and part.get_filename() == "" and not data:
            continue  # an HTML form's file input left empty (filename "", no bytes): no file given
        if name == "input_reference" and (part.get_filename() is not None or _binary(part, data)):
            if upload is not None:
                raise BadRequest("input_reference: one first frame per video", param="input_reference")
            upload = data
            continue
        if part.get_filename():
            raise BadRequest(f"{name}: files are taken only as input_reference", param=name)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"{name}: not UTF-8 text", param=name) from None
        if name in fields:
            if (listed := form_list(name)) is not None:  # a second item's lora[][name]: a list
                raise list_in_form(listed)
            raise BadRequest(f"{name}: given more than once", param=name)
        fields[name] = text
    return nest_form_fields(fields), upload


async def _read_create(request: Request) -> tuple[VideoCreateRequest, bytes | None]:
    content_type = request.headers.get("content-type", "")
    raw = await request.body()
    upload = None
    try:
        if content_type.lower().startswith("multipart/form-data"):  # media types are case-insensitive
            # CPU work in proportion to the upload: off the event loop that serves every other request
            data, upload = await asyncio.to_thread(_form_fields, content_type, raw)
        else:
            try:
                data = json.loads(raw)
            except ValueError:
                raise BadRequest(
                    "request body is not valid JSON" + form_hint(request, multipart=True)
                ) from None
            if not isinstance(data, dict):
                raise BadRequest("request body must be a JSON object")
        return VideoCreateRequest.model_validate(data), upload
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def video_token_of(video_id: str) -> str | None:
    """The part of ``video_id`` after its replica where it is one this server could have issued, else None."""
    token = video_id.rpartition(".")[2]
    return token if "." in video_id and VIDEO_TOKEN.fullmatch(token) else None


def pinned(fe: Any, video_id: str):
    """The engine handle that reaches the replica of ``video_id``. An id this server cannot have issued (a
    replica makes ``<replica>.<32 hex digits>``) is a 404 here: sent on, an unknown replica reads as one
    that died, and the job as failed (or deleted)."""
    try:
        session_owner(video_id)
    except ValueError:
        pass
    else:
        if VIDEO_TOKEN.fullmatch(video_id.rpartition(".")[2]):
            return fe.engine.options(session_id=video_id)
    raise NotFound(
        f"video {video_id!r} does not exist (ids look like <replica>.<32 hex digits>)", param="video_id"
    )


def no_video_id() -> NotFound:
    return NotFound("video_id: the video id is empty; use the id POST /v1/videos answered", param="video_id")


def http_video(video: dict[str, Any]) -> dict[str, Any]:
    """A job as HTTP answers it: its usage (the engine's forwards and text tokens) in the API's shape, OpenAI's
    token fields as image responses carry them, as gRPC's ``VideoJob.usage`` does."""
    usage = video.get("usage")
    return {**video, "usage": api_usage(usage)} if usage else video


class VideoLost(Exception):
    """The replica that ran a video job is gone, and the job with it."""


def lost_video(video_id: str, model: str = "") -> dict[str, Any]:
    """A job whose replica died: failed, with the reason (an id this server issued is never a 404). What
    the job was went with the replica: the fields a client requires are there, zero."""
    return {
        "id": video_id,
        "object": "video",
        "status": "failed",
        "progress": 0,
        "created_at": 0,
        "model": model,
        "size": "0x0",
        "seconds": "0",
        "error": {
            "code": "replica_gone",
            "message": f"the replica that ran video {video_id!r} is gone, and the job with it; create it again",
        },
    }


async def call_job(fe: Any, video_id: str, call) -> dict[str, Any]:
    try:
        return await fe.call_engine(call)
    except SessionGone:  # the owner replica is gone, and the job with it
        raise VideoLost(video_id) from None


# "/v1/videos/" creates as "/v1/videos" does, instead of a 307 redirect.
@router.post("/", include_in_schema=False)
@router.post(
    "",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": VideoCreateRequest.model_json_schema(ref_template=REF)},
                "multipart/form-data": {"schema": VideoCreateRequest.model_json_schema(ref_template=REF)},
            },
        }
    },
)
async def create_video(request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=False)
    body, upload = await _read_create(request)
    params = await asyncio.to_thread(video_params, fe, body, upload)  # decodes the reference: off the loop
    answer = await fe.call_engine(fe.engine.create_video.remote(params, fe.model_name, body.prompt))
    return JSONResponse(http_video(answer["video"]), headers={REPLICA_HEADER: answer["replica"]})


def _documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Error answers a route gives beyond those ``http_base.error_statuses`` derives from its shape."""
    return {s: {"description": ERROR_DESCRIPTIONS[s], "model": ErrorResponse} for s in statuses}


async def list_page(fe: Any, after: str | None, limit: int, order: str) -> dict[str, Any]:
    """One page of the video jobs of every running replica (a replica that is restarting has none to show),
    by created_at; ``after``: the last id of the previous page. Shared by HTTP and gRPC."""
    if not 1 <= limit <= 100:
        raise BadRequest(f"limit: {limit} is not within 1..100", param="limit")
    if order not in ("asc", "desc"):
        raise BadRequest(f"order: 'asc' or 'desc', got {order!r}", param="order")
    try:
        answers = await fe.engine.broadcast("list_videos").results_async(timeout_s=30, return_exceptions=True)
    except DeploymentUnavailableError:
        answers = []
    # by creation time in milliseconds, as an id carries it: a cursor whose job was deleted or expired since
    # still says where the next page starts
    listed = [
        (token_ms(video_token_of(v["id"])), v["id"], v)
        for a in answers
        if isinstance(a, dict)
        for _, v in a["videos"]
    ]
    listed.sort(key=lambda item: item[:2], reverse=order == "desc")
    videos = [video for *_, video in listed]
    start = 0
    if after:
        token = video_token_of(after)
        if token is None:
            raise NotFound(
                f"after: {after!r} is not a video id of this server (ids look like <replica>.<32 hex digits>); "
                "list again without after",
                param="after",
            )
        cursor = (token_ms(token), after)
        start = sum(1 for item in listed if (item[:2] <= cursor if order == "asc" else item[:2] >= cursor))
    page = videos[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(videos),
    }


# "/v1/videos/" lists as "/v1/videos" does: a 307 redirect was answered there for every method, and a DELETE
# followed it to the list, which has no DELETE.
@router.get("/", include_in_schema=False)
@router.get("", responses=_documented(404))
async def list_videos(
    request: Request,
    after: str | None = Query(None, description="The id of the last video of the previous page."),
    limit: int = Query(20, ge=1, le=100, description="Videos per page."),
    order: Literal["asc", "desc"] = Query(
        "desc", description="By created_at: newest first (desc) or oldest."
    ),
    fe: Any = Depends(frontend),
):
    fe.check_auth(request, admin=False)
    page = await list_page(fe, after, limit, order)
    return JSONResponse({**page, "data": [http_video(video) for video in page["data"]]})


@router.get("/{video_id}")
async def get_video(video_id: str, request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=False)
    try:
        answer = await call_job(fe, video_id, pinned(fe, video_id).get_video.remote(video_id))
    except VideoLost:
        return JSONResponse(lost_video(video_id, fe.model_name))
    return JSONResponse(http_video(answer["video"]), headers={REPLICA_HEADER: answer["replica"]})


MEDIA_TYPES = {"video": "video/mp4", "thumbnail": "image/webp", "spritesheet": "image/jpeg"}
SPRITES = 16  # at most this many frames in a spritesheet, 4 a row
SPRITE_SIDE = 256  # each scaled down to at most this on its longer side


def _frames(mp4: bytes, count: int | None) -> list[np.ndarray]:
    """The first ``count`` frames (all when None) of an MP4, RGB."""
    import av

    frames = []
    with av.open(io.BytesIO(mp4)) as container:
        for frame in container.decode(video=0):
            frames.append(frame.to_ndarray(format="rgb24"))
            if count is not None and len(frames) >= count:
                break
    return frames


def thumbnail(mp4: bytes) -> bytes:
    """The first frame as WebP."""
    buf = io.BytesIO()
    Image.fromarray(_frames(mp4, 1)[0]).save(buf, format="WEBP", quality=90)
    return buf.getvalue()


def spritesheet(mp4: bytes) -> bytes:
    """Up to ``SPRITES`` frames spread evenly over the video, each at most ``SPRITE_SIDE`` pixels on its
    longer side, in a JPEG grid of 4 a row (left to right, then down)."""
    frames = _frames(mp4, None)
    picks = np.unique(np.linspace(0, len(frames) - 1, min(SPRITES, len(frames))).round().astype(int))
    height, width = frames[0].shape[:2]
    scale = min(1.0, SPRITE_SIDE / max(width, height))
    tile = (max(1, round(width * scale)), max(1, round(height * scale)))
    columns = min(4, len(picks))
    rows = -(-len(picks) // columns)
    sheet = Image.new("RGB", (tile[0] * columns, tile[1] * rows))
    for n, index in enumerate(picks):
        sprite = Image.fromarray(frames[index]).resize(tile, Image.Resampling.BILINEAR)
        sheet.paste(sprite, ((n % columns) * tile[0], (n // columns) * tile[1]))
    buf = io.BytesIO()
    sheet.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def video_variant(mp4: bytes, variant: str) -> bytes:
    """A completed video's downloadable asset: the MP4 itself, its thumbnail or its spritesheet."""
    if variant == "thumbnail":
        return thumbnail(mp4)
    if variant == "spritesheet":
        return spritesheet(mp4)
    return mp4


BYTE_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The bytes [start, end) one ``Range: bytes=...`` header asks of ``size`` bytes (``a-b``, ``a-``, or the
    last ``-n``); None for no header, several ranges or one past the end: those get the whole asset (RFC
    9110 lets a server ignore Range)."""
    match = BYTE_RANGE.fullmatch((header or "").strip())
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if not first:  # a suffix: the last n bytes
        start, end = max(0, size - int(last)), size
    else:
        start, end = int(first), size if not last else min(size, int(last) + 1)
    return (start, end) if start < end else None


@router.get(
    "/{video_id}/content",
    response_class=Response,
    responses={
        200: {"content": {media: {} for media in MEDIA_TYPES.values()}},
        206: {
            "description": "The bytes a Range header asked for (players seek, and Safari plays, this way).",
            "content": {media: {} for media in MEDIA_TYPES.values()},
        },
    },
)
@router.head("/{video_id}/content", include_in_schema=False)  # the headers alone (size, type, ranges)
async def video_content(
    video_id: str,
    request: Request,
    variant: Literal["video", "thumbnail", "spritesheet"] = Query(
        "video", description="video: the MP4; thumbnail: the first frame (WebP); spritesheet: frames (JPEG)."
    ),
    fe: Any = Depends(frontend),
):
    fe.check_auth(request, admin=False)
    try:
        answer = await call_job(fe, video_id, pinned(fe, video_id).video_content.remote(video_id))
    except VideoLost:
        message = lost_video(video_id)["error"]["message"]
        raise Conflict(f"video {video_id!r} failed: {message}", param="video_id") from None
    data = (
        answer["mp4"]
        if variant == "video"
        else await asyncio.to_thread(video_variant, answer["mp4"], variant)
    )
    headers = {REPLICA_HEADER: answer["replica"], "accept-ranges": "bytes"}
    asked = byte_range(request.headers.get("range"), len(data))
    if asked is None:
        return Response(data, media_type=MEDIA_TYPES[variant], headers=headers)
    start, end = asked
    headers["content-range"] = f"bytes {start}-{end - 1}/{len(data)}"
    return Response(data[start:end], status_code=206, media_type=MEDIA_TYPES[variant], headers=headers)


class VideoRemixRequest(BaseModel):
    """``POST /v1/videos/{id}/remix``: the new prompt; everything else (size, frames, steps, seed, first
    frame) is the completed video's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: Prompt = Field(description="What the remix films.")


async def remix(fe: Any, video_id: str, prompt: str) -> dict[str, Any]:
    """A completed video's job again with another prompt, on its replica (HTTP and gRPC)."""
    body = VideoRemixRequest.model_validate({"prompt": prompt})
    if len(body.prompt) > fe.args.max_prompt_chars:
        raise BadRequest(
            f"prompt: {len(body.prompt)} characters is above the maximum {fe.args.max_prompt_chars}",
            param="prompt",
        )
    try:
        call = pinned(fe, video_id).remix_video.remote(video_id, body.prompt)
        return await call_job(fe, video_id, call)
    except VideoLost:
        message = lost_video(video_id)["error"]["message"]
        raise Conflict(f"video {video_id!r} failed: {message}", param="video_id") from None


@router.post("/{video_id}/remix", responses=_documented(409, 429))
async def remix_video(video_id: str, body: VideoRemixRequest, request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=False)
    await fe.check_body_size(request)
    answer = await remix(fe, video_id, body.prompt)
    return JSONResponse(http_video(answer["video"]), headers={REPLICA_HEADER: answer["replica"]})


# An empty id (".../videos/", ".../videos//content", ".../videos//remix") names no video: a 404 naming
# video_id, as an unknown one, rather than a redirect or a bare 404.
@router.delete("/", include_in_schema=False)
@router.get("//content", include_in_schema=False)
@router.head("//content", include_in_schema=False)
@router.post("//remix", include_in_schema=False)
async def empty_video_id(request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=False)
    raise no_video_id()


@router.post("/edits", include_in_schema=False)
@router.post("/extensions", include_in_schema=False)
@router.post("/characters", include_in_schema=False)
@router.get("/characters/{character_id}", include_in_schema=False)
@router.get("/characters/", include_in_schema=False)
async def not_served(request: Request, fe: Any = Depends(frontend)):
    """OpenAI's video edits, extensions and characters: said plainly, not a 404 or 405 of a path (after the
    key, as every videos route: a caller without it learns nothing of the server)."""
    fe.check_auth(request, admin=False)
    raise Unsupported(
        f"{request.method} {request.url.path} is not served by ditserve; videos are made with POST /v1/videos "
        "and remixed with POST /v1/videos/{id}/remix"
    )


@router.delete("/{video_id}")
async def delete_video(video_id: str, request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=False)
    try:
        answer = await call_job(fe, video_id, pinned(fe, video_id).delete_video.remote(video_id))
    except VideoLost:  # nothing is left of it anywhere: deleted
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})
    return JSONResponse(http_video(answer["video"]), headers={REPLICA_HEADER: answer["replica"]})
