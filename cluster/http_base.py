"""Shared parts of the HTTP ingress: the typed errors as HTTP answers (``HTTP_ERRORS``, the one error
shape), the FastAPI app factory, the replica header, size checks, the JSON-body middleware, and the ``frontend`` dependency that route modules use
to reach the Frontend."""

from __future__ import annotations

import base64
import binascii
import email.errors
import email.message
import email.parser
import email.policy
import functools
import json
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ditserve.replica.request import GenerationParams

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
    error_param,
    first_error,
)
from .schemas import ErrorResponse, parse_size

REPLICA_HEADER = "x-ditserve-replica"

# Each typed error as HTTP answers it: the status, and the body's ``type``.
HTTP_ERRORS: dict[type[ServeError], tuple[int, str]] = {
    BadRequest: (400, "invalid_request_error"),
    Unauthorized: (401, "authentication_error"),
    NotFound: (404, "not_found_error"),
    Conflict: (409, "invalid_request_error"),
    Contended: (409, "invalid_request_error"),
    SessionGone: (410, "session_gone_error"),
    PayloadTooLarge: (413, "invalid_request_error"),
    QueueFull: (429, "rate_limit_error"),
    InternalError: (500, "server_error"),
    Unsupported: (501, "not_implemented_error"),
    ReplicaUnavailable: (503, "service_unavailable_error"),
}


def form_hint(request: Request, multipart: bool = False) -> str:
    """What to send instead, for a body that is not JSON and came as a URL-encoded form (``curl -d
    'prompt=...'``, curl's default): its key=value pairs are not read."""
    sent = request.headers.get(SENT_TYPE.decode()) or request.headers.get("content-type", "")
    if "x-www-form-urlencoded" not in sent.lower():
        return ""
    also = " or a multipart/form-data form" if multipart else ""
    return f": send a JSON object{also}; URL-encoded form fields (key=value&...) are not read"


def _http_error(exc: ServeError) -> tuple[int, str]:
    # By the class hierarchy: an error re-raised by Ray may be a subclass that is also a RayTaskError.
    return next(HTTP_ERRORS[cls] for cls in type(exc).__mro__ if cls in HTTP_ERRORS)


def http_status(exc: ServeError) -> int:
    return _http_error(exc)[0]


def error_type(exc: ServeError) -> str:
    """The body's ``type`` (also a WebSocket error's ``code``)."""
    return _http_error(exc)[1]


def _body(status: int, kind: str, message: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_body(exc: ServeError) -> dict[str, Any]:
    """The one error shape (``schemas.ErrorResponse``): also the data of SSE and WebSocket error events."""
    status, kind = _http_error(exc)
    return _body(status, kind, exc.message, exc.param)


def error_headers(exc: ServeError) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) when a retry may succeed; the replica that answered."""
    headers = {}
    if exc.replica is not None:
        headers[REPLICA_HEADER] = exc.replica
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(exc.retry_after)))
    return headers


def error_response(exc: ServeError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=http_status(exc), headers=error_headers(exc))


_instance: list[Any] = []


def register_frontend(instance: Any) -> None:
    """Called by the Frontend constructor (one Frontend per replica process)."""
    _instance[:] = [instance]


def registered_frontend() -> Any:
    """This process's Frontend instance (IndexError when none was constructed here).

    (Serve freezes a copy of the FastAPI app at decoration time, so ``app.state`` set later would not be
    seen by the served copy; a module-level holder is.)"""
    return _instance[0]


async def frontend() -> Any:
    """FastAPI dependency for route modules: this process's Frontend instance. A coroutine because FastAPI
    runs a plain function dependency in its thread pool: a thread hand-off on every request."""
    return _instance[0]


def build_fastapi() -> FastAPI:
    app = FastAPI(
        title="ditserve",
        description="Diffusion transformer serving: OpenAI-compatible images and videos.",
        version="0.1.0",
    )

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, exc: ServeError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = first_error(errors) if errors else {"loc": (), "msg": "invalid request"}
        param = error_param(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON" + form_hint(request), None
        elif first.get("type") == "missing" and param is None:
            message = "request body is missing: send a JSON object"
        elif param is None and first.get("type") in ("model_attributes_type", "dict_type"):
            message = "request body must be a JSON object (content-type: application/json)"
        else:
            message = f"{param or 'body'}: {str(first.get('msg')).removeprefix('Value error, ')}"
        return error_response(BadRequest(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 405:  # every method of every route on this path, not only the first route's
            allowed = _allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}"
        return JSONResponse(
            _body(exc.status_code, kind, message, None), status_code=exc.status_code, headers=headers
        )

    # The served schema says what this server answers: its errors, its limits (see openapi_schema).
    # A module-level function (partial), so the copy Serve freezes still finds this process's Frontend.
    app.openapi = functools.partial(served_openapi, app)  # type: ignore[method-assign]
    return app


def served_openapi(app: FastAPI) -> dict[str, Any]:
    """``GET /openapi.json``: the schema for this process's server (built once it has started)."""
    if not _instance:
        return openapi_schema(app, None)
    if app.openapi_schema is None:
        fe = _instance[0]
        app.openapi_schema = openapi_schema(
            app, fe.args, fe.model_name, fe.model_kind, fe.default_size, fe.spec.size_multiple
        )
    return app.openapi_schema


def _allowed_methods(request: Request) -> list[str]:
    methods: set[str] = set()

    def visit(routes: list[Any], scope: dict[str, Any]) -> None:
        for route in routes:
            included = getattr(route, "original_router", None)  # an include_router()'s routes, wrapped
            if included is not None:
                prefix = getattr(getattr(route, "include_context", None), "prefix", "") or ""
                if scope["path"].startswith(prefix):
                    visit(included.routes, {**scope, "path": scope["path"][len(prefix) :]})
                continue
            match, _ = route.matches({**scope, "method": "GET"})
            if match != Match.NONE and getattr(route, "methods", None):
                methods.update(route.methods)

    # Without the routing state FastAPI left in the scope (the included router last matched).
    visit(request.app.routes, {k: v for k, v in request.scope.items() if k != "fastapi"})
    return sorted(methods)


def _takes_as_is(content_type: bytes) -> bool:
    """JSON (``application/json``, ``application/*+json``) and ``multipart/form-data`` bodies are read as
    their type says; any other (or none) is read as JSON."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json") or media == b"multipart/form-data"


# The content type a client sent, where JSONBodyMiddleware replaced it (for the error of a body that is no JSON).
SENT_TYPE = b"x-ditserve-sent-content-type"


class JSONBodyMiddleware:
    """ASGI middleware: a request body sent without a JSON content type is read as JSON.

    ``curl -d '{...}'`` labels its body ``application/x-www-form-urlencoded``; FastAPI would then refuse
    the JSON object in it. Every route here takes JSON (``POST /v1/videos`` multipart too, which keeps its
    type), so the body's type is set to JSON and a body that is not JSON gets "not valid JSON"."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") in ("POST", "PUT", "PATCH"):
            headers = list(scope.get("headers") or [])
            content_type = next((v for k, v in headers if k == b"content-type"), b"")
            if not _takes_as_is(content_type):
                headers = [(k, v) for k, v in headers if k not in (b"content-type", SENT_TYPE)]
                sent = [(SENT_TYPE, content_type)] if content_type else []
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json"), *sent]}
        return await self.app(scope, receive, send)


def requested_size(size: str | None, default: str) -> str:
    """The size a request asks for: absent, empty or OpenAI's ``"auto"`` mean the model's default."""
    return default if size in (None, "", "auto") else size


# The least side a request may ask (GenerationParams' width / height bound), whatever the model's multiple.
MIN_SIDE = next(m.ge for m in GenerationParams.model_fields["width"].metadata if hasattr(m, "ge"))


def check_size(size: str, max_width: int, max_height: int, multiple: int = 16) -> tuple[int, int]:
    width, height = parse_size(size)
    if width % multiple or height % multiple:  # a side of 0 is a multiple, refused below as under MIN_SIDE
        raise BadRequest(
            f"size: {size} must have a width and height that are multiples of {multiple}", param="size"
        )
    if min(width, height) < MIN_SIDE:  # a model whose multiple is under it (a small VAE)
        raise BadRequest(f"size: {size} is below the minimum of {MIN_SIDE} pixels a side", param="size")
    if width > max_width or height > max_height:
        raise BadRequest(f"size: {size} is above the maximum {max_width}x{max_height}", param="size")
    return width, height


# -- the served OpenAPI schema ------------------------------------------------------------------------

ERROR_DESCRIPTIONS = {
    400: "Invalid request: the message names the field (param) and the limit or the fix.",
    401: "Missing or wrong API key (Authorization: Bearer <key>).",
    404: "No such resource (the id or name in the path is unknown here).",
    409: "The resource is in a state that cannot answer this (e.g. a failed video's content).",
    410: "The session is gone (its replica restarted or it expired); open a new one.",
    413: "The request body is over --max-body-bytes.",
    429: "The replica's queue is full; retry after Retry-After seconds.",
    503: "No engine replica can take the request now (starting, released or shut down); retry later.",
}

# Routes anyone may call, with or without the key.
PUBLIC_PATHS = ("/health", "/v1/models", "/v1/replicas")
# Routes that generate (they queue on a replica, so a full queue answers 429).
GENERATION_ROUTES = {
    ("post", "/v1/images/generations"),
    ("post", "/v1/images/edits"),
    ("post", "/v1/videos"),
    ("post", "/v1/sessions"),
    ("post", "/v1/sessions/{session_id}/generate"),
}
# Routes that change the cluster's control state: a replica's refusal (e.g. a bad adapter file) is passed on.
CONTROL_PREFIXES = ("/v1/loras", "/v1/admin/")
# Routes only one model kind serves; a server of the other kind answers them with 400 naming model.
KIND_PATHS = {"image": ("/v1/videos",), "video": ("/v1/images/", "/v1/sessions")}


def error_statuses(method: str, path: str, operation: dict[str, Any], args: Any | None) -> list[int]:
    """The error statuses one operation can answer with, on a server started with ``args``."""
    if path == "/v1/models":
        return []
    if path == "/v1/models/{model}":  # anyone may ask; a name not served is a 404
        return [404]
    if path == "/health":
        return [503]
    statuses = {503}
    if method in ("post", "put", "patch"):
        statuses |= {400, 413}  # a body that is not JSON, or too large
    if operation.get("parameters") or "requestBody" in operation:
        statuses.add(400)
    if path not in PUBLIC_PATHS and _needs_key(path, args):
        statuses.add(401)
    if "{" in path:
        statuses.add(404)
    if (method, path) in GENERATION_ROUTES:
        statuses.add(429)
    if path.startswith("/v1/sessions/{"):
        statuses |= {410, 429}
    if path == "/v1/videos/{video_id}/content":
        statuses.add(409)
    if path.startswith(CONTROL_PREFIXES) and method != "get":
        statuses |= {400, 404, 409}
    return sorted(statuses)


def _needs_key(path: str, args: Any | None) -> bool:
    if args is None:
        return True
    if args.api_key is None:
        return False
    return path.startswith(CONTROL_PREFIXES) or args.api_key_for_generation


def _steps(limit: int, multiple: int) -> list[int]:
    return list(range(multiple, limit + 1, multiple))


def size_pattern(max_width: int, max_height: int, multiple: int = 16) -> str:
    """A regex of the sizes ``check_size`` takes: WIDTHxHEIGHT, multiples of the model's size multiple up to
    the limits."""
    widths = "|".join(map(str, _steps(max_width, multiple)))
    heights = "|".join(map(str, _steps(max_height, multiple)))
    return f"^(({widths})x({heights})|auto)?$"  # empty or auto: the model's default size, as when left out


def _nullable(schema: dict[str, Any], description: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"anyOf": [schema, {"type": "null"}]}
    if description:
        out["description"] = description
    return out


def _apply_limits(
    components: dict[str, Any], args: Any, model_name: str, kind: str, default_size: str, multiple: int
) -> None:
    """The server's limits (--max-steps, --max-width, ...) as constraints of the request bodies, so a
    request the schema allows is one this server takes."""
    size = {"type": "string", "pattern": size_pattern(args.max_width, args.max_height, multiple)}
    prompt = {"type": "string", "minLength": 1, "maxLength": args.max_prompt_chars, "pattern": "\\S"}
    model = {"type": "string", "enum": [model_name]}
    for name in (
        "ImageGenerationRequest",
        "ImageEditRequest",
        "SessionGenerateRequest",
        "SessionOpenRequest",
        "VideoCreateRequest",
        "VideoRemixRequest",
    ):
        props = components.get(name, {}).get("properties", {})
        if "prompt" in props:
            props["prompt"] = {**prompt, "description": props["prompt"].get("description", "")}
        if "negative_prompt" in props:  # --max-prompt-chars bounds it too (a longer one is a 400)
            negative = {"type": "string", "maxLength": args.max_prompt_chars}
            props["negative_prompt"] = _nullable(negative, props["negative_prompt"].get("description"))
        if "num_inference_steps" in props:
            props["num_inference_steps"]["maximum"] = args.max_steps
            props["num_inference_steps"]["default"] = min(
                props["num_inference_steps"].get("default", 1), args.max_steps
            )
        if "size" in props:
            props["size"] = _nullable(size, props["size"].get("description"))
        if "model" in props:
            props["model"] = _nullable(model, props["model"].get("description"))
        if "seed" in props:  # a bound the generators read exactly (2**63 as exclusiveMaximum is a float)
            props["seed"] = _nullable(
                {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}, props["seed"].get("description")
            )
    for name in ("ImageGenerationRequest", "ImageEditRequest"):
        image = components.get(name, {}).get("properties", {})
        if image:
            image["n"]["maximum"] = args.max_n
            image["response_format"]["enum"] = ["b64_json"]
    edit = components.get("ImageEditRequest", {}).get("properties", {})
    if edit:  # "auto": the model's size from the images (ModelSpec.edit_request_size)
        edit["size"]["anyOf"][0]["pattern"] = edit["size"]["anyOf"][0]["pattern"].replace(")?$", "|auto)?$")
    video = components.get("VideoCreateRequest", {}).get("properties", {})
    if video and "num_frames" in video:
        video["num_frames"] = _nullable(
            {"type": "integer", "minimum": 1, "maximum": args.max_frames},
            video["num_frames"].get("description"),
        )


def openapi_schema(
    app: FastAPI,
    args: Any | None,
    model_name: str = "",
    kind: str = "",
    default_size: str = "",
    size_multiple: int = 16,
) -> dict[str, Any]:
    """The app's OpenAPI schema as this server answers: each operation's error statuses with the one
    error model (validation errors are 400, so no 422), the limits of ``args`` as constraints, and on the
    routes the served model's kind does not take, that they answer 400. ``args`` None (no server): errors
    only."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(components["ErrorResponse"].pop("$defs", {}))
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, item in list(schema["paths"].items()):
        other_kind = bool(kind) and path.startswith(KIND_PATHS.get(kind, ()))
        for method, operation in item.items():
            if other_kind and method == "post":  # documented for clients of every server, refused here
                operation["description"] = (
                    f"{operation.get('description', '')}\n\nThis server's model ({model_name}) makes "
                    f"{kind}s: it answers 400 naming model."
                ).strip()
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in error_statuses(method, path, operation, args):
                responses[str(status)] = {
                    "description": ERROR_DESCRIPTIONS[status],
                    "content": {"application/json": {"schema": ref}},
                }
            if (method, path) == ("post", "/v1/images/generations"):  # "stream": true answers events
                responses["200"].setdefault("content", {})["text/event-stream"] = {
                    "schema": {"type": "object", "description": "Each event's data (see api_stream)."}
                }
            body = operation.get("requestBody", {}).get("content", {})
            for media in body.values():  # one named model for a body documented inline (POST /v1/videos)
                inline = media.get("schema", {})
                title = inline.get("title")
                if "$ref" not in inline and title and "properties" in inline:
                    components.update(inline.pop("$defs", {}))
                    components[title] = inline
                    media["schema"] = {"$ref": f"#/components/schemas/{title}"}
    if args is not None:
        _apply_limits(components, args, model_name, kind, default_size, size_multiple)
    return schema


FORM_KEY = re.compile(r"(\w+)\[(\w*)\].*")  # cache[policy]; lora[][name]


def list_in_form(field: str) -> BadRequest:
    """The refusal of a list sent as form fields (``field[]`` / ``field[][key]``, one set per item)."""
    return BadRequest(
        f"{field}: a list cannot be sent as form fields; send it as JSON text in {field}", param=field
    )


def form_list(name: str) -> str | None:
    """The field a form name sends a list item of (``lora`` for ``lora[][name]``), else None."""
    match = FORM_KEY.fullmatch(name)
    return match.group(1) if match is not None and not match.group(2) else None


def nest_form_fields(fields: dict[str, str]) -> dict[str, Any]:
    """Form names ``field[key]`` (how OpenAI's client sends a mapping given in ``extra_body``, e.g.
    ``cache[policy]``) → ``{field: {key: value}}``, each value read as JSON where it is JSON (``0.1`` is a
    number, ``fbcache`` stays text). A list (``field[]``) has no unambiguous form shape: JSON text is asked."""
    data: dict[str, Any] = {}
    for name, text in fields.items():
        match = FORM_KEY.fullmatch(name)
        if match is None:
            if name in data:
                raise BadRequest(f"{name}: given more than once", param=name)
            data[name] = text
            continue
        field, key = match.groups()
        if not key:
            raise list_in_form(field)
        group = data.setdefault(field, {})
        if not isinstance(group, dict) or key in group:
            raise BadRequest(f"{field}: given more than once", param=field)
        try:
            group[key] = json.loads(text)
        except ValueError:
            group[key] = text
    return data


def base64_bytes(text: str) -> bytes | None:
    """Base64 text → bytes, None where it is not base64. Line breaks and spaces are allowed, as MIME's
    base64 (Python's ``base64.encodebytes``, ``openssl base64``) wraps its lines; anything else outside
    the alphabet is refused rather than skipped."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def multipart_message(content_type: str, raw: bytes) -> email.message.EmailMessage:
    """A multipart/form-data body as the standard library's MIME parser reads it (binary parts come back byte
    for byte), refused unless it is whole: a body cut off before its closing boundary is kept as far as it
    was read, so an upload cut off in the prompt would draw a shorter prompt. CPU work in proportion to the
    body (seconds for tens of MB): the routes run it off the event loop."""
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + raw)
    if not message.is_multipart():
        raise BadRequest("request body is not valid multipart/form-data")
    if any(isinstance(d, email.errors.CloseBoundaryNotFoundDefect) for d in message.defects):
        raise BadRequest(
            "request body is not complete multipart/form-data: its closing boundary is missing (the upload "
            "was cut off); send it again"
        )
    return message
