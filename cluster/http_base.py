"""Shared parts of the HTTP ingress: the FastAPI app factory with the one error shape, the replica
header, size checks, the JSON-body middleware, and the ``frontend`` dependency that route modules use
to reach the Frontend."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .schemas import APIError, parse_size

REPLICA_HEADER = "x-ditserve-replica"

ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    410: "session_gone_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}


_instance: list[Any] = []


def register_frontend(instance: Any) -> None:
    """Called by the Frontend constructor (one Frontend per replica process)."""
    _instance[:] = [instance]


def frontend() -> Any:
    """FastAPI dependency for route modules: this process's Frontend instance.

    (Serve freezes a copy of the FastAPI app at decoration time, so ``app.state`` set later would not be
    seen by the served copy; a module-level holder is.)"""
    return _instance[0]


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):  # the location, not a field named "path"
        parts = parts[1:]
    return ".".join(parts) or None


def build_fastapi() -> FastAPI:
    app = FastAPI(
        title="ditserve",
        description="Diffusion transformer serving: OpenAI-compatible images and videos.",
        version="0.1.0",
    )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _loc_to_param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        elif first.get("type") == "missing" and param is None:
            message = "request body is missing: send a JSON object"
        elif param is None and first.get("type") in ("model_attributes_type", "dict_type"):
            message = "request body must be a JSON object (content-type: application/json)"
        else:
            message = f"{param or 'body'}: {first.get('msg')}"
        err = APIError(400, message, param=param)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail), type=kind).body(), status_code=exc.status_code
        )

    return app


def _takes_as_is(content_type: bytes) -> bool:
    """JSON (``application/json``, ``application/*+json``) and ``multipart/form-data`` bodies are read as
    their type says; any other (or none) is read as JSON."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json") or media == b"multipart/form-data"


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
                headers = [(k, v) for k, v in headers if k != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        return await self.app(scope, receive, send)


def check_size(size: str, max_width: int, max_height: int, multiple: int = 16) -> tuple[int, int]:
    width, height = parse_size(size)
    if width % multiple or height % multiple or width == 0 or height == 0:
        raise APIError(
            400, f"size: {size} must have a width and height that are multiples of {multiple}", param="size"
        )
    if width > max_width or height > max_height:
        raise APIError(400, f"size: {size} is above the maximum {max_width}x{max_height}", param="size")
    return width, height
