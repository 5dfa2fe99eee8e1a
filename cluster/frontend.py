"""HTTP ingress (FastAPI inside a Serve deployment): validation, auth, error mapping, OpenAI shapes.

Stateless: it holds a handle to the engine deployment and nothing else, so it can be scaled or restarted.
Typed errors (``errors.py``) become status codes here and only here (``http_base.HTTP_ERRORS``).

How the routes are organised (add new groups the same way):

- This module builds the one FastAPI app, its exception handlers, and the :class:`Frontend` deployment
  with the helpers every route shares: auth (``check_auth``), engine calls that raise the replica's typed
  errors (``call_engine``), control broadcasts (``broadcast``), and the core routes (health, models, images).
- Each further route group is a module with an ``APIRouter`` named ``router`` (``api_sessions``,
  ``api_admin``), included below. Its handlers are plain functions that reach the Frontend instance
  through ``Depends(http_base.frontend)`` (the instance registers itself at start), so they use
  the same handle, settings and helpers as the class-based routes.
"""

import asyncio
import base64
import functools
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, RequestCancelledError

from ditserve.replica.models.registry import resolve_model
from ditserve.replica.request import GenerationParams

from . import api_admin, api_edits, api_realtime, api_sessions, api_stream, api_videos
from .config import APP_NAME, SHUTDOWN_WAIT_LOOP_S, AppArgs
from .control_state import (
    delete_state_actors,
    get_or_create_state_actor,
    initial_state,
    parse_lora_paths,
    state_actor_name,
)
from .errors import (
    BadRequest,
    InternalError,
    NotFound,
    PayloadTooLarge,
    ReplicaUnavailable,
    ServeError,
    Unauthorized,
    typed_cause,
)
from .grpc_service import GrpcMethods
from .http_base import (
    REPLICA_HEADER,
    JSONBodyMiddleware,
    build_fastapi,
    check_size,
    frontend,
    register_frontend,
    requested_size,
)
from .schemas import ImageData, ImageGenerationRequest, ImagesResponse, ModelCard, usage_of

logger = logging.getLogger("ditserve")

fastapi_app = build_fastapi()


# The busiest routes are registered first, as plain routes of the app. FastAPI tries routes in order, and an
# included route group costs a match of each of its routes (twice for the group that holds the route);
# the class's own routes would be included last by @serve.ingress. Their work lives in Frontend's methods.
@fastapi_app.post("/v1/images/generations", response_model=ImagesResponse)
async def images_generations(
    body: ImageGenerationRequest, request: Request, fe: Any = Depends(frontend)
) -> Response:
    """With ``stream: true``: server-sent events, one per denoising step, then the images (api_stream)."""
    return await fe.images_generations(body, request)


@fastapi_app.get("/v1/models/", include_in_schema=False)  # as /v1/models, not a redirect
@fastapi_app.get("/v1/models")
async def models(fe: Any = Depends(frontend)) -> dict[str, Any]:
    return Response(fe.models_body, media_type="application/json")


# A path: a Hub model's name is org/name (OpenAI's client sends org%2Fname, which arrives decoded).
@fastapi_app.get("/v1/models/{model:path}", response_model=ModelCard)
async def model_card(model: str, fe: Any = Depends(frontend)) -> dict[str, Any]:
    """The served model's card (OpenAI's ``models.retrieve``); another name is a 404 naming model (it was a
    bare 404 of an unknown path)."""
    card = json.loads(fe.models_body)["data"][0]
    if model != card["id"]:
        raise NotFound(
            f"model: {model!r} is not served here; this server serves {card['id']!r}", param="model"
        )
    return card


@fastapi_app.get("/health")
async def health(fe: Any = Depends(frontend)) -> dict[str, str]:
    """200 ``{"status": "ok"}`` while the service takes work; 503 in the error shape once
    ``POST /v1/admin/shutdown`` has shut it down (for good: the desired state says so)."""
    return await fe.health()


# Route groups live in their own modules; include them before @serve.ingress freezes the app.
fastapi_app.include_router(api_sessions.router)
fastapi_app.include_router(api_admin.router)
fastapi_app.include_router(api_videos.router)
fastapi_app.include_router(api_edits.router)
fastapi_app.include_router(api_stream.router)
fastapi_app.include_router(api_realtime.router)
# Over --max-body-bytes → 413 before the body is read or parsed.
fastapi_app.add_middleware(api_stream.BodyLimitMiddleware)
# `curl -d '{...}'` without a content-type header still sends JSON (read as such).
fastapi_app.add_middleware(JSONBodyMiddleware)

# The playground: static files shipped in the package (no build step, nothing fetched from elsewhere).
STATIC_DIR = Path(__file__).resolve().parent / "static"
fastapi_app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


@fastapi_app.get("/", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html")


@serve.deployment(
    name="Frontend",
    ray_actor_options={"num_cpus": 0.1},
    graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,  # see app.engine_deployment_options
)
@serve.ingress(fastapi_app)
class Frontend(GrpcMethods):  # gRPC methods: see grpc_service
    def __init__(self, engine, args: dict[str, Any], deploy_id: str = "local"):
        self.engine = engine
        self.args = AppArgs(**args)
        self.deploy_id = deploy_id
        spec = resolve_model(self.args.model)
        self.spec = spec
        self.model_name = spec.name
        self.model_kind = spec.kind
        self.created = int(time.time())
        card = ModelCard(id=self.model_name, created=self.created, kind=self.model_kind)
        # GET /v1/models answers the same bytes until this replica stops: encoded once.
        self.models_body = json.dumps(
            {"object": "list", "data": [card.model_dump()]}, separators=(",", ":")
        ).encode()
        # A request without a size gets the model's own default (the pipeline's), scaled down to the limits.
        width, height = spec.fitted_size(self.args.max_width, self.args.max_height)
        self.default_size = f"{width}x{height}"
        try:
            self.app_name = serve.get_replica_context().app_name
        except Exception:
            self.app_name = APP_NAME
        self._state_actor = None
        register_frontend(self)  # route modules reach this instance through http_base.frontend()
        try:  # this deploy's state exists from now on; earlier deploys' states are forgotten
            delete_state_actors(self.app_name, keep=state_actor_name(self.app_name, deploy_id))
            self.state_actor()
        except Exception:  # constructed outside a Ray cluster (tools)
            pass

    # -- helpers ----------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(
                f"model: {model!r} is not served here; available: [{self.model_name!r}]", param="model"
            )

    def is_admin(self, request: Request) -> bool:
        """Whether the request may see and change the cluster: no key configured, or the right one (compared
        in constant time, so response timing does not reveal how much of a guess was right)."""
        key = self.args.api_key
        if key is None:
            return True
        header = request.headers.get("authorization", "")
        return hmac.compare_digest(header.encode(), f"Bearer {key}".encode())

    def check_auth(self, request: Request, admin: bool) -> None:
        if self.args.api_key is None or not (admin or self.args.api_key_for_generation):
            return
        if not self.is_admin(request):
            raise Unauthorized("missing or wrong API key (Authorization: Bearer <key>)")

    async def check_body_size(self, request: Request) -> None:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.args.max_body_bytes:
            raise PayloadTooLarge(
                f"request body is {length} bytes; the server's limit is {self.args.max_body_bytes} bytes "
                "(--max-body-bytes)",
                param="max_body_bytes",
            )

    async def call_engine(self, response) -> dict[str, Any]:
        """Await one engine call (a DeploymentResponse): its answer, or the typed error the replica answered
        (or the router raised: ``SessionGone``), or ``ReplicaUnavailable`` when the call found no replica."""
        try:
            answer = await response
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            raise ReplicaUnavailable(
                f"the replica serving this request failed ({type(exc).__name__}); retry the request",
                retry_after=1,
            ) from None
        except DeploymentUnavailableError:
            raise ReplicaUnavailable("no engine replica is available") from None
        except (ServeError, RequestCancelledError):
            raise
        except Exception as exc:
            # A typed error may arrive wrapped (RayTaskError); any other failure of the replica (its model
            # raised) is ours: answered in the error shape, as gRPC and streams answer it, not a bare text 500.
            if (typed := typed_cause(exc)) is not None:
                raise typed from None
            logger.error("engine call failed", exc_info=exc)
            raise InternalError(f"internal error ({type(exc).__name__}); see the server log") from None
        if isinstance(answer, ServeError):
            raise answer
        return answer

    async def broadcast(self, op: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        """Send ``op`` to every running replica; every replica answers with its id.

        Serve's broadcast skips replicas that are not running (e.g. restarting): they are counted in
        ``missing`` and catch up from the state actor before they take traffic."""
        try:
            results = await self.engine.broadcast("control", op).results_async(
                timeout_s=timeout_s, return_exceptions=True
            )
        except DeploymentUnavailableError:
            results = []
        # A replica the call could not reach (it died, or is restarting) did not answer: it is "missing",
        # and converges from the state actor when it runs again.
        answers = sorted(
            (r for r in results if not isinstance(r, Exception)), key=lambda a: str(a["replica"])
        )
        return {
            "op": op["op"],
            "replicas": answers,
            "answered": len(answers),
            "missing": max(0, self.args.dp_size - len(answers)),
            # An op no replica answered is not done: nothing checked it, nothing applied it.
            "ok": bool(answers) and all(a["ok"] for a in answers),
        }

    @staticmethod
    def raise_broadcast_error(report: dict[str, Any]) -> None:
        if not report["replicas"]:  # nothing was checked or applied anywhere: retry once replicas run
            raise ReplicaUnavailable(
                f"{report['op']}: no engine replica answered ({report['missing']} starting or restarting); "
                "nothing was changed, retry in a moment",
                retry_after=5,
            )
        failed = [a for a in report["replicas"] if not a["ok"]]
        first = failed[0]
        err: ServeError = first["error"]  # the replica's typed error (EngineReplica.control)
        raise type(err)(
            f"{report['op']} failed on {len(failed)} of {report['answered']} replicas; "
            f"replica {first['replica']}: {err.message}",
            param=err.param,
        )

    def state_actor(self):
        """This deploy's control-state actor. The handle is kept: finding it by name is a blocking call to
        Ray's GCS, which would stall this replica's event loop (and its HTTP server under direct ingress)
        on every health probe and admin call. A health probe that finds it dead looks it up again."""
        if self._state_actor is None:
            self._state_actor = get_or_create_state_actor(
                self.app_name, self.deploy_id, initial_state(parse_lora_paths(self.args.lora_path))
            )
        return self._state_actor

    # -- routes -----------------------------------------------------------------------------------------
    async def health(self) -> dict[str, str]:
        try:  # a health probe must answer, even when the state actor does not
            desired = await asyncio.wait_for(self.state_actor().get.remote(), timeout=10)
        except (asyncio.TimeoutError, RayActorError) as exc:
            if isinstance(exc, RayActorError):
                self._state_actor = None
            raise ReplicaUnavailable(
                f"the control state did not answer ({type(exc).__name__}); see the Ray dashboard",
            ) from None
        if desired.get("shutdown"):
            raise ReplicaUnavailable(
                "shut down by POST /v1/admin/shutdown; restart the service (ditserve serve) to serve again",
            )
        return {"status": "ok"}

    def check_prompt_and_steps(self, body: Any) -> Any:
        """Limits every generation body shares (images, videos): prompt and negative prompt length, steps. A
        body that leaves the steps out gets the default capped by ``--max-steps``."""
        limits = self.args
        for name in ("prompt", "negative_prompt"):
            text = getattr(body, name, None) or ""
            if len(text) > limits.max_prompt_chars:
                raise BadRequest(
                    f"{name}: {len(text)} characters is above the maximum {limits.max_prompt_chars}",
                    param=name,
                )
        if "num_inference_steps" not in body.model_fields_set:
            body = body.model_copy(
                update={"num_inference_steps": min(body.num_inference_steps, limits.max_steps)}
            )
        if body.num_inference_steps > limits.max_steps:
            raise BadRequest(
                f"num_inference_steps: {body.num_inference_steps} is above the maximum {limits.max_steps}",
                param="num_inference_steps",
            )
        return body

    def image_params(self, body: ImageGenerationRequest) -> tuple[GenerationParams, int, int]:
        """Checks shared by HTTP and gRPC (limits, model kind) → engine parameters, width, height."""
        self.check_model(body.model)
        if self.model_kind != "image":
            raise BadRequest(f"model {self.model_name!r} makes videos; use POST /v1/videos", param="model")
        if body.response_format != "b64_json":
            raise BadRequest("response_format: only 'b64_json' is supported", param="response_format")
        limits = self.args
        if body.n > limits.max_n:
            raise BadRequest(f"n: {body.n} is above the maximum {limits.max_n}", param="n")
        body = self.check_prompt_and_steps(body)
        width, height = check_size(
            requested_size(body.size, self.default_size),
            limits.max_width,
            limits.max_height,
            self.spec.size_multiple,
        )
        return body.to_params(width, height, self.spec), width, height

    async def images_generations(self, body: ImageGenerationRequest, request: Request) -> Response:
        self.check_auth(request, admin=False)
        await self.check_body_size(request)
        params, width, height = self.image_params(body)
        if body.stream:
            if body.output_format != "png":
                raise BadRequest(
                    "output_format: streamed images are png; leave it out", param="output_format"
                )
            return await self.stream_images(params, preview=body.preview, partial_images=body.partial_images)
        if body.preview:
            raise BadRequest("preview: previews come with stream: true", param="preview")
        answer = await self.call_engine(self.generate.remote(params))
        result = answer["result"]
        if body.output_format != "png":  # re-encoded off the event loop
            response = await asyncio.to_thread(
                api_edits.images_response, result, body.output_format, body.output_compression
            )
            headers = {REPLICA_HEADER: answer["replica"]}
            return Response(json.dumps(response), media_type="application/json", headers=headers)
        response = ImagesResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=base64.b64encode(png).decode()) for png in result.outputs],
            seed=result.seed,
            size=f"{width}x{height}",
            usage=usage_of(result),
        )
        return Response(
            response.model_dump_json(exclude_none=True),
            media_type="application/json",
            headers={REPLICA_HEADER: answer["replica"]},
        )

    async def stream_images(
        self,
        params: GenerationParams,
        preview: bool = False,
        partial_images: int | None = None,
        kind: str = "image_generation",
    ) -> Response:
        """Server-sent events of an image request (``api_stream.image_events``), for the routes here and
        in route modules that ``api_stream`` itself imports (edits)."""
        return await api_stream.image_events(
            self, params, preview=preview, partial_images=partial_images, kind=kind
        )

    @functools.cached_property
    def generate(self):
        """The engine's ``generate`` method handle, made once: each attribute of a handle is a new handle."""
        return self.engine.generate
