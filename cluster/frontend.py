"""HTTP ingress (FastAPI inside a Serve deployment): validation, auth, error mapping, OpenAI shapes.

Stateless: it holds a handle to the engine deployment and nothing else, so it can be scaled or restarted.
Status codes are chosen here and only here.
"""

import base64
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from ditserve.replica.models.registry import resolve_model

from .config import AppArgs
from .schemas import APIError, ImageData, ImageGenerationRequest, ImagesResponse, ModelCard, parse_size

REPLICA_HEADER = "x-ditserve-replica"


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
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
            message = "request body is missing"
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


fastapi_app = build_fastapi()


def _check_size(size: str, max_width: int, max_height: int, multiple: int = 16) -> tuple[int, int]:
    width, height = parse_size(size)
    if width % multiple or height % multiple or width == 0 or height == 0:
        raise APIError(
            400, f"size: {size} must have a width and height that are multiples of {multiple}", param="size"
        )
    if width > max_width or height > max_height:
        raise APIError(400, f"size: {size} is above the maximum {max_width}x{max_height}", param="size")
    return width, height


@serve.deployment(name="Frontend", ray_actor_options={"num_cpus": 0.1})
@serve.ingress(fastapi_app)
class Frontend:
    def __init__(self, engine, args: dict[str, Any]):
        self.engine = engine
        self.args = AppArgs(**args)
        spec = resolve_model(self.args.model)
        self.model_name = spec.name
        self.model_kind = spec.kind
        self.created = int(time.time())
        # Demo models are trained and tested at 64×64; real checkpoints at 1024².
        self.default_size = "64x64" if spec.name.startswith("demo-") else "1024x1024"

    # -- helpers ----------------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                400, f"model {model!r} is not served here; available: [{self.model_name!r}]", param="model"
            )

    def _check_auth(self, request: Request, admin: bool) -> None:
        key = self.args.api_key
        if key is None or not (admin or self.args.api_key_for_generation):
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {key}":
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer <key>)", type="authentication_error"
            )

    async def _check_body_size(self, request: Request) -> None:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.args.max_body_bytes:
            raise APIError(413, f"request body is {length} bytes; the limit is {self.args.max_body_bytes}")

    @staticmethod
    def _raise_engine_error(answer: dict[str, Any]) -> None:
        err = answer["error"]
        headers = {REPLICA_HEADER: str(err.get("replica", ""))}
        if err["status"] == 429:
            headers["Retry-After"] = str(max(1, int(err.get("retry_after", 1))))
        kind = "rate_limit_error" if err["status"] == 429 else "invalid_request_error"
        raise APIError(err["status"], err["message"], type=kind, param=err.get("param"), headers=headers)

    # -- routes -----------------------------------------------------------------------------------------
    @fastapi_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = ModelCard(id=self.model_name, created=self.created, kind=self.model_kind)
        return {"object": "list", "data": [card.model_dump()]}

    @fastapi_app.post("/v1/images/generations", response_model=ImagesResponse)
    async def images_generations(self, body: ImageGenerationRequest, request: Request) -> JSONResponse:
        self._check_auth(request, admin=False)
        await self._check_body_size(request)
        self._check_model(body.model)
        if self.model_kind != "image":
            raise APIError(400, f"model {self.model_name!r} makes videos; use POST /v1/videos", param="model")
        if body.response_format != "b64_json":
            raise APIError(400, "response_format: only 'b64_json' is supported", param="response_format")
        if body.stream:
            raise APIError(400, "stream: streaming is not supported by this endpoint yet", param="stream")
        limits = self.args
        if body.n > limits.max_n:
            raise APIError(400, f"n: {body.n} is above the maximum {limits.max_n}", param="n")
        if len(body.prompt) > limits.max_prompt_chars:
            raise APIError(
                400,
                f"prompt: {len(body.prompt)} characters is above the maximum {limits.max_prompt_chars}",
                param="prompt",
            )
        if body.num_inference_steps > limits.max_steps:
            raise APIError(
                400,
                f"num_inference_steps: {body.num_inference_steps} is above the maximum {limits.max_steps}",
                param="num_inference_steps",
            )
        width, height = _check_size(body.size or self.default_size, limits.max_width, limits.max_height)
        params = body.to_params(width, height, default_true_cfg=4.0)
        answer = await self.engine.generate.remote(params)
        if "error" in answer:
            self._raise_engine_error(answer)
        result = answer["result"]
        response = ImagesResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=base64.b64encode(png).decode()) for png in result.outputs],
            seed=result.seed,
            size=f"{width}x{height}",
        )
        return JSONResponse(
            response.model_dump(exclude_none=True), headers={REPLICA_HEADER: answer["replica"]}
        )
