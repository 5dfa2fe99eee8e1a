"""Cluster and admin routes (an ``APIRouter`` included by ``frontend``): replicas, weights, memory,
shutdown, LoRA adapters.

Every control op follows one pattern: (1) where the op can fail on a replica (loading weights or an
adapter), a *prepare* broadcast does the failing part everywhere and is undone everywhere if any replica
fails; (2) the desired state in the state actor is updated (new version); (3) a *converge* broadcast
moves every running replica to it. Replicas that were not running at the time converge from the state
actor before they take traffic. Responses list each replica's answer and how many expected replicas did
not answer (``missing``).

An empty name in a path (``DELETE /v1/loras/``, ``POST /v1/admin/memory/``) is a 404 naming the field
(``name``, ``action``), as an unknown one; ``GET`` and ``POST`` on ``/v1/loras/`` are the list and the load.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ditserve.replica.lora.loader import inspect_adapter, second_expert_refusal
from ditserve.replica.models.registry import transformer_folder

from .control_state import lora_spec
from .errors import BadRequest, NotFound, ReplicaUnavailable, param_of
from .http_base import REPLICA_HEADER, frontend, registered_frontend


async def _admin_key(request: Request) -> None:
    """The admin key, checked before the body is read and validated: a caller without it learns nothing
    of what the routes take (a body it got wrong answers 401, not 400 naming the field)."""
    registered_frontend().check_auth(request, admin=True)


# Every route here but GET /v1/replicas (anyone may list replicas; the key shows more).
ADMIN = [Depends(_admin_key)]

router = APIRouter(tags=["admin"])


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        min_length=1, description="Local diffusers folder (pipeline or transformer) on every host."
    )


class LoRALoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=128, description="Name requests use to pick the adapter.")
    path: str = Field(min_length=1, description="Adapter file or folder (under --lora-root).")
    scale: float = Field(strict=True, default=1.0, ge=-10.0, le=10.0, description="Default strength.")
    target: Literal["transformer", "transformer_2"] | None = Field(
        default=None,
        description="The expert the file loads into (Wan 2.2 A14B: transformer_2 is the low-noise expert, as "
        "diffusers' load_into_transformer_2=True); left out, a file's transformer. weights go to the first "
        "expert and its transformer_2. weights to the second. Refused on models without a second expert.",
    )


def _respond(report: dict[str, Any], **extra: Any) -> JSONResponse:
    ids = ",".join(str(a["replica"]) for a in report["replicas"])
    return JSONResponse({**extra, **report}, headers={REPLICA_HEADER: ids})


async def _check_not_shut_down(fe: Any, what: str) -> None:
    """After POST /v1/admin/shutdown no replica serves again in this deploy: an op that changes the state is
    refused before it is recorded (the desired state stays what the replicas last applied)."""
    if (await fe.state_actor().get.remote())["shutdown"]:
        raise ReplicaUnavailable(
            f"{what}: the cluster was shut down by POST /v1/admin/shutdown and nothing was changed; "
            "restart the service (ditserve serve) to serve again"
        )


async def _converge(fe: Any, desired: dict[str, Any]) -> JSONResponse:
    report = await fe.broadcast({"op": "converge", "state": desired})
    if not report["ok"]:
        fe.raise_broadcast_error(report)
    return _respond(report, version=desired["version"], state=desired)


# What anyone may read of a replica; node addresses, GPUs, ranks, file paths and queue stats need the key.
PUBLIC_REPLICA_FIELDS = ("replica_id", "health", "layout", "device", "control_version")


async def replica_list(fe: Any, request: Any) -> dict[str, Any]:
    """The body of GET /v1/replicas (and gRPC's ListReplicas): the replicas, each with what ``request`` may
    see of it."""
    try:
        described = await fe.engine.broadcast("describe").results_async(timeout_s=30, return_exceptions=True)
    except Exception:
        described = []
    data = sorted((d for d in described if isinstance(d, dict)), key=lambda d: d["replica_id"])
    if not fe.is_admin(request):
        data = [{k: d[k] for k in PUBLIC_REPLICA_FIELDS if k in d} for d in data]
    desired = await fe.state_actor().get.remote()
    return {
        "object": "list",
        "data": data,
        "expected": fe.args.dp_size,
        "desired_version": desired["version"],
    }


@router.get("/v1/replicas/", include_in_schema=False)  # as /v1/replicas, not a 307 redirect
@router.get("/v1/replicas")
async def replicas(request: Request, fe: Any = Depends(frontend)) -> JSONResponse:
    """Each running replica: id, health, layout, control-state version; with the admin key (or when none is
    configured) also its node, GPUs, ranks, applied control state (weights and adapter paths) and stats."""
    listed = await replica_list(fe, request)
    return JSONResponse(listed, headers={REPLICA_HEADER: ",".join(d["replica_id"] for d in listed["data"])})


@router.post("/v1/admin/weights", dependencies=ADMIN)
async def update_weights(body: WeightsRequest, request: Request, fe: Any = Depends(frontend)):
    """Load new transformer weights on every replica: all replicas (and all their ranks) or none."""
    fe.check_auth(request, admin=True)
    _check_path(body.path)
    try:
        transformer_folder(body.path)  # a folder that holds no model is refused before any replica loads it
    except ValueError as exc:
        raise _bad_request(exc) from None
    except OSError as exc:  # a name longer than the file system takes, a folder it may not read
        raise _unreadable(body.path, exc) from None
    await _check_not_shut_down(fe, "weights")
    # here: that module loads the engine, which the front end runs without
    from .engine_deployment import new_tag

    tag = new_tag()
    staged = await fe.broadcast({"op": "stage_weights", "path": body.path, "tag": tag})
    if not staged["ok"]:
        await fe.broadcast({"op": "discard_weights"})
        fe.raise_broadcast_error(staged)
    desired = await fe.state_actor().set_weights.remote(body.path, tag)
    return await _converge(fe, desired)


# An empty action (".../memory/") was a bare 404 naming no field.
@router.post("/v1/admin/memory/", dependencies=ADMIN, include_in_schema=False)
async def empty_memory_action(request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=True)
    raise NotFound("action: the memory action is empty; use release or resume", param="action")


@router.post("/v1/admin/memory/{action}", dependencies=ADMIN)
async def memory(action: str, request: Request, fe: Any = Depends(frontend)):
    """``release``: weights to host memory, generation answers 503; ``resume``: back to serving."""
    fe.check_auth(request, admin=True)
    if action not in ("release", "resume"):
        raise NotFound(f"action: unknown memory action {action!r}; use release or resume", param="action")
    await _check_not_shut_down(fe, f"memory {action}")
    desired = await fe.state_actor().set_memory.remote("released" if action == "release" else "resident")
    return await _converge(fe, desired)


@router.post("/v1/admin/shutdown", dependencies=ADMIN)
async def shutdown(request: Request, fe: Any = Depends(frontend)):
    """Free every replica's engine; they stop accepting work (removing replicas is Serve's job)."""
    fe.check_auth(request, admin=True)
    await fe.state_actor().set_shutdown.remote()  # replacements started later stay shut down
    report = await fe.broadcast({"op": "shutdown"})
    if not report["ok"]:
        fe.raise_broadcast_error(report)
    return _respond(report)


def _bad_request(exc: ValueError) -> BadRequest:
    return BadRequest(str(exc), param=param_of(str(exc)))


def _unreadable(path: str, exc: OSError) -> BadRequest:
    shown = path if len(path) <= 200 else f"{path[:200]}... ({len(path)} characters)"
    return BadRequest(f"path: {shown} cannot be read: {exc.strerror or exc}", param="path")


def _check_path(path: str) -> None:
    if "\x00" in path:  # the OS takes no such name; Python refuses it with an error naming no field
        raise BadRequest("path: contains a NUL character", param="path")


# "/v1/loras/" loads and lists as "/v1/loras" does, instead of a 307 redirect (which a DELETE followed to
# the list).
@router.post("/v1/loras/", dependencies=ADMIN, include_in_schema=False)
@router.post("/v1/loras", dependencies=ADMIN)
async def load_lora(body: LoRALoadRequest, request: Request, fe: Any = Depends(frontend)):
    """Load an adapter on every replica; it enters the desired state only when every replica that answered
    loaded it (at least one must): a bad file never becomes state that replicas restart into."""
    fe.check_auth(request, admin=True)
    if not body.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise BadRequest(f"name: {body.name!r} must be letters, digits, '-', '_' or '.'", param="name")
    _check_path(body.path)
    if body.target == "transformer_2" and not fe.spec.two_experts:
        raise BadRequest(second_expert_refusal(fe.spec.name), param="target")
    try:  # what can be checked without the model, before any replica is asked
        source = str(inspect_adapter(body.path, fe.args.lora_root, fe.args.max_lora_rank))
    except ValueError as exc:
        raise _bad_request(exc) from None
    except OSError as exc:
        raise _unreadable(body.path, exc) from None
    await _check_not_shut_down(fe, "lora_load")
    spec = lora_spec(source, body.scale, body.target)
    prepared = await fe.broadcast({"op": "lora_load", "name": body.name, **spec})
    if not prepared["ok"]:
        if any(a["ok"] for a in prepared["replicas"]):  # undo where it was applied: back to the desired state
            previous = (await fe.state_actor().get.remote())["loras"].get(body.name)
            if previous is None:
                await fe.broadcast({"op": "lora_unload", "name": body.name})
            else:  # it replaced an adapter of the same name: put that one back
                await fe.broadcast({"op": "lora_load", "name": body.name, **previous})
        fe.raise_broadcast_error(prepared)
    desired = await fe.state_actor().set_lora.remote(body.name, source, body.scale, body.target)
    return await _converge(fe, desired)


@router.get("/v1/loras/", dependencies=ADMIN, include_in_schema=False)
@router.get("/v1/loras", dependencies=ADMIN)
async def list_loras(request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=True)
    desired = await fe.state_actor().get.remote()
    data = [
        {"name": n, "path": s["source"], "scale": s["scale"], "target": s.get("target")}
        for n, s in desired["loras"].items()
    ]
    return {"object": "list", "data": data, "version": desired["version"]}


# An empty name names no adapter: a 404 naming name, as an unknown one, rather than a redirect.
@router.delete("/v1/loras/", dependencies=ADMIN, include_in_schema=False)
async def empty_lora_name(request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=True)
    raise NotFound("name: the adapter name is empty; GET /v1/loras lists the loaded ones", param="name")


@router.delete("/v1/loras/{name}", dependencies=ADMIN)
async def unload_lora(name: str, request: Request, fe: Any = Depends(frontend)):
    fe.check_auth(request, admin=True)
    desired = await fe.state_actor().get.remote()
    if name not in desired["loras"]:
        raise NotFound(f"no LoRA adapter named {name!r} is loaded", param="name")
    await _check_not_shut_down(fe, "lora_unload")
    desired = await fe.state_actor().remove_lora.remote(name)
    return await _converge(fe, desired)
