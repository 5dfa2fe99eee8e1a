"""Realtime image sessions: ``/v1/sessions`` (an ``APIRouter`` included by ``frontend``).

A session lives on one replica, which keeps its last latents: each ``generate`` refines the previous
image with a new prompt (``strength`` says how far it may move). The session id names its owner replica
and travels as Serve's ``session_id``; the router sends it there and nowhere else (410 when it is gone).
"""

from __future__ import annotations

import base64
import functools
import time
from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ditserve.replica.caching import CacheSettings
from ditserve.replica.jsonfields import JsonInt, json_int
from ditserve.replica.request import GenerationParams, LoRARef

from .errors import BadRequest, NotFound, QueueFull
from .http_base import REPLICA_HEADER, check_size, frontend, requested_size
from .router import session_owner
from .schemas import Prompt, usage_of

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


class SessionOpenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    size: str | None = Field(default=None, description="WIDTHxHEIGHT of every image of the session.")
    model: str | None = Field(default=None, description="Model name (default: the served one).")


class SessionGenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: Prompt = Field(description="What to draw (this step).")
    negative_prompt: str | None = Field(
        default=None,
        description="What not to draw (as on /v1/images/generations: true CFG with FLUX.1 and Qwen-Image, "
        "the uncond branch of guidance_scale with SD3 and Z-Image; absent: the model's recommended one).",
    )
    strength: float = Field(
        strict=True,
        default=0.6,
        gt=0.0,
        le=1.0,
        description="How far this step may move from the previous image.",
    )
    num_inference_steps: JsonInt = Field(
        strict=True, default=4, ge=1, description="Steps of a full (strength 1) schedule."
    )
    guidance_scale: float | None = Field(
        strict=True, default=None, ge=0, le=100, description="Guidance (model default)."
    )
    true_cfg_scale: float | None = Field(
        strict=True,
        default=None,
        ge=0,
        le=100,
        description="True-CFG scale (FLUX.1, Qwen-Image; the others refuse it above 1).",
    )
    seed: json_int(ge=0, lt=2**63) | None = Field(default=None)
    lora: LoRARef | list[LoRARef] | None = Field(
        default=None,
        description="Adapter(s) for this step, each {name, scale}, as on /v1/images/generations.",
    )
    cache: CacheSettings | None = Field(
        default=None, description="Step cache of this step (as on /v1/images/generations)."
    )


def _pinned(fe: Any, session_id: str):
    try:
        session_owner(session_id)
    except ValueError as exc:
        raise NotFound(str(exc), param="session_id") from None
    return _pinned_handle(fe.engine, session_id)


# Each .options() of a handle makes a new handle: a session's steps reuse the one made for it.
@functools.lru_cache(maxsize=1024)
def _pinned_handle(engine: Any, session_id: str) -> Any:
    return engine.options(session_id=session_id)


def _no_session_id() -> NotFound:
    return NotFound(
        "session_id: the session id is empty; use the id POST /v1/sessions answered", param="session_id"
    )


# "/v1/sessions/" opens a session as "/v1/sessions" does, instead of a redirect (DELETE there would
# otherwise be redirected to "/v1/sessions", which answers 405).
@router.post("/", include_in_schema=False)
@router.post("", name="open_session")
async def open_session_route(
    request: Request,
    body: SessionOpenRequest | None = Body(default=None),  # every field is optional: so is the body
    fe: Any = Depends(frontend),
):
    return await open_session(body or SessionOpenRequest(), request, fe)


def session_refusal(spec: Any, name: str) -> str | None:
    """Why an image model cannot hold a session (its message, naming ``model``), else None. Each step after
    the first starts from the last one's latents (image-to-image), and a step sends a prompt only."""
    if not spec.family_spec.img2img:
        return (
            f"model: {name} has no image-to-image (it takes images as references), and a session refines "
            "each image from the last; use POST /v1/images/edits"
        )
    if spec.needs_references:
        return (
            f"model: {name} edits reference images and draws nothing from a prompt alone, and a session's "
            "steps send prompts only; use POST /v1/images/edits"
        )
    return None


async def open_session(body: SessionOpenRequest, request: Any, fe: Any) -> JSONResponse:
    """Open a session on a replica chosen round-robin with room for it (HTTP, and gRPC's OpenSession)."""
    fe.check_auth(request, admin=False)
    fe.check_model(body.model)
    if fe.model_kind != "image":
        raise BadRequest(f"model {fe.model_name!r} makes videos; sessions are for images", param="model")
    refused = session_refusal(fe.spec, fe.model_name)
    if refused is not None:
        raise BadRequest(refused, param="model")
    width, height = check_size(
        requested_size(body.size, fe.default_size),
        fe.args.max_width,
        fe.args.max_height,
        fe.spec.size_multiple,
    )
    # A replica at --max-sessions-per-replica refuses; round-robin then asks the next one, so the open is
    # refused only when every replica is full.
    tries = max(1, int(fe.args.dp_size))
    for attempt in range(tries):
        try:
            answer = await fe.call_engine(fe.engine.open_session.remote(width, height))
            break
        except QueueFull:
            if attempt == tries - 1:
                raise
    return JSONResponse(
        {"id": answer["session_id"], "object": "session", "size": f"{width}x{height}"},
        headers={REPLICA_HEADER: answer["replica"]},
    )


@router.post("/{session_id}/generate")
async def session_generate(
    session_id: str, body: SessionGenerateRequest, request: Request, fe: Any = Depends(frontend)
):
    fe.check_auth(request, admin=False)
    params = step_params(fe, body)
    call = _pinned(fe, session_id).session_generate.remote(session_id, params, body.strength)
    answer = await fe.call_engine(call)
    result = answer["result"]
    return JSONResponse(
        {
            "id": session_id,
            "created": int(time.time()),
            "step": answer["step"],
            "seed": result.seed,
            "size": f"{result.width}x{result.height}",
            "data": [{"b64_json": base64.b64encode(png).decode()} for png in result.outputs],
            "usage": usage_of(result),
        },
        headers={REPLICA_HEADER: answer["replica"]},
    )


def step_params(fe: Any, step: SessionGenerateRequest) -> GenerationParams:
    """A session step's engine parameters, as the HTTP route, the WebSocket and gRPC take it: the limits
    and guidance defaults of /v1/images/generations (prompt and negative prompt length, steps capped by
    ``--max-steps`` when left out, the model's recommended negative prompt and true-CFG scale), so a step
    draws what an image request with the same settings draws (adapters too). The replica adds size, start
    latents and strength."""
    step = fe.check_prompt_and_steps(step)
    negative, true_cfg = fe.spec.guidance_defaults(step.negative_prompt, step.true_cfg_scale)
    kwargs: dict[str, Any] = {} if step.seed is None else {"seed": step.seed}
    if step.lora is not None:
        kwargs["lora"] = tuple(step.lora if isinstance(step.lora, list) else [step.lora])
    return GenerationParams(
        prompt=step.prompt,
        negative_prompt=negative,
        num_inference_steps=step.num_inference_steps,
        guidance_scale=step.guidance_scale,
        true_cfg_scale=true_cfg,
        cache=step.cache,
        **kwargs,
    )


# An empty session id (".../sessions/" or ".../sessions//generate") names no session: a 404 naming
# session_id, as an unknown one, rather than a redirect or a bare 404.
@router.delete("/", include_in_schema=False)
@router.post("//generate", include_in_schema=False)
async def empty_session_id(request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=False)
    raise _no_session_id()


@router.delete("/{session_id}")
async def close_session(session_id: str, request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=False)
    answer = await fe.call_engine(_pinned(fe, session_id).close_session.remote(session_id))
    return JSONResponse(
        {"id": session_id, "object": "session", "deleted": True}, headers={REPLICA_HEADER: answer["replica"]}
    )
