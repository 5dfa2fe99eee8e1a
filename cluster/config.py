"""The application's arguments: one flat pydantic model shared by the CLI, ``serve run`` YAML and KubeRay.

``build_app(args)`` takes the same dict whatever the entry point; CLI flags are generated from these fields
(``--dp-size`` ↔ ``dp_size``), so the three can never drift apart.
"""

from __future__ import annotations

import argparse
import copy
import os
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from ditserve.replica.config import AUTO, AUTO_FIELDS, EngineConfig, Limits, ParallelFlags, resolve_auto

# The Serve application's name: ``serve.run``, the KubeRay serveConfigV2 and the control-state actors' names.
APP_NAME = "ditserve"
# Serve's graceful_shutdown_wait_loop_s for both deployments: how often a stopping replica looks for
# requests still running (Serve's default, 2 s, is also the least a stop takes; see app.py).
SHUTDOWN_WAIT_LOOP_S = 0.2

# Flat names of nested or plural EngineConfig fields: one flag per value, ``--lora-root`` repeated.
FLAT_NAMES = {"lora_roots": "lora_root"}
NESTED = {"parallel": ParallelFlags, "limits": Limits}


def _auto(field: FieldInfo) -> tuple[Any, FieldInfo]:
    """An auto field's flat form: its final type or ``"auto"``, ``"auto"`` by default."""
    flat = copy.copy(field)
    flat.default, flat.default_factory = AUTO, None
    return Literal["auto"] | field.annotation, flat  # type: ignore[return-value]


def _flat_fields() -> dict[str, tuple[Any, FieldInfo]]:
    """Every EngineConfig field, nested ones flattened, in declaration order: each declared once, there."""
    fields: dict[str, tuple[Any, FieldInfo]] = {}
    for name, field in EngineConfig.model_fields.items():
        if name in NESTED:
            for inner, inner_field in NESTED[name].model_fields.items():
                fields[inner] = (inner_field.annotation, copy.copy(inner_field))
        elif name in AUTO_FIELDS:
            fields[name] = _auto(field)
        else:
            fields[FLAT_NAMES.get(name, name)] = (field.annotation, copy.copy(field))
    return fields


class _EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def parallel_flags(self) -> ParallelFlags:
        return ParallelFlags(**{name: getattr(self, name) for name in ParallelFlags.model_fields})

    def engine_config(self, device: Literal["cpu", "cuda"] | None = None) -> EngineConfig:
        """The final engine configuration: auto values resolved (``device: auto`` → ``device``, default
        this host's), then validated once. Raises ValidationError whose message names the flags."""
        values: dict[str, Any] = {
            name: getattr(self, FLAT_NAMES.get(name, name))
            for name in EngineConfig.model_fields
            if name not in NESTED
        }
        values["parallel"] = self.parallel_flags()
        values["limits"] = Limits(**{name: getattr(self, name) for name in Limits.model_fields})
        return EngineConfig(**resolve_auto(values, device))


EngineArgs = create_model(
    "EngineArgs",
    __base__=_EngineArgs,
    __module__=__name__,
    __doc__="Engine flags (``generate`` and ``serve``): EngineConfig's fields, flat, auto values unresolved.",
    **_flat_fields(),  # type: ignore[call-overload]
)


class AppArgs(EngineArgs):
    """``ditserve serve`` / ``build_app`` arguments: the engine flags plus the serving ones."""

    host: str = Field(default="127.0.0.1", description="HTTP bind address.")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port.")
    grpc_port: int = Field(default=9000, ge=0, le=65535, description="gRPC port (0 disables gRPC).")
    address: str | None = Field(default=None, description="Join this Ray cluster instead of starting one.")
    direct_ingress: bool = Field(
        default=False,
        description="The frontend replica takes HTTP/gRPC on --port/--grpc-port itself (Serve's direct "
        "ingress; no proxy actor hop). A joined cluster's nodes need the RAY_SERVE_* variables it names.",
    )
    api_key: str | None = Field(
        default_factory=lambda: os.environ.get("DITSERVE_API_KEY") or None,
        description="Bearer key for admin endpoints (also DITSERVE_API_KEY).",
    )
    api_key_for_generation: bool = Field(default=False, description="Require the API key for generation too.")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="Largest request body in bytes.")
    replica_num_cpus: float = Field(default=0.1, gt=0, description="CPUs reserved per rank bundle on CPU.")
    max_sessions_per_replica: int = Field(
        default=16,
        ge=1,
        description="Open sessions (POST /v1/sessions) per replica before 429; realtime video sessions have "
        "--max-realtime-sessions.",
    )
    session_idle_timeout_s: float = Field(
        default=300.0, gt=0, description="A session unused this long is closed and its state freed."
    )
    lora_path: tuple[str, ...] = Field(
        default=(),
        description="Adapter to load at start, NAME=PATH[:SCALE] (scale default 1.0; repeat the flag for more); "
        "NAME@transformer_2=PATH[:SCALE] loads the file into Wan 2.2 A14B's second (low-noise) expert.",
    )
    session_max_lifetime_s: float = Field(
        default=3600.0,
        gt=0,
        description="A session (/v1/sessions, or a realtime video session) and its WebSocket are closed after this long.",
    )
    video_ttl_s: float = Field(
        default=3600.0, gt=0, description="A finished video job and its MP4 are kept this long, then expire."
    )
    max_video_jobs_per_replica: int = Field(
        default=64, ge=1, description="Video jobs (running or kept) per replica before 429."
    )
    max_realtime_sessions: int = Field(
        default=4,
        ge=1,
        description="Realtime video sessions per replica (ws /v1/realtime_video/generate); an init past them waits up to "
        "5 s for a free slot, then gets an error and close code 1008. Each "
        "holds its K/V cache on the ranks (its size is logged and answered at open).",
    )
    realtime_max_chunks: int = Field(
        default=64,
        ge=2,
        description="Most chunks of one realtime video session (an init without max_chunks runs until then, "
        "then closes 1000); bounds the session's K/V cache.",
    )

    @field_validator("api_key")
    @classmethod
    def _non_empty_key(cls, key: str | None) -> str | None:
        # An empty key is no key the clients could send ("Bearer " is all a request would need to match):
        # `--api-key "$KEY"` with KEY unset is a mistake, not a wish for an open admin API.
        if key is not None and not key.strip():
            raise ValueError(
                "is empty; pass a key, or leave --api-key out (and DITSERVE_API_KEY unset) to serve without one"
            )
        return key

    @model_validator(mode="after")
    def _distinct_ports(self) -> AppArgs:
        # Serve's HTTP proxy binds --host, its gRPC proxy every interface: on one port both bind, and the
        # more specific address takes the connections (gRPC clients then reach the HTTP server).
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(
                f"--port {self.port} and --grpc-port {self.grpc_port} are the same port; HTTP and gRPC need "
                "one each: choose another --grpc-port (0 turns gRPC off)"
            )
        return self


# -- argparse from the pydantic fields ------------------------------------------------------------------
def _members(annotation) -> list:
    """The types a field accepts, unions and ``None`` unpacked."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) if a is not type(None) for m in _members(a)]
    return [annotation]


def add_model_arguments(
    parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = ()
) -> None:
    """One ``--flag`` per field; defaults stay with pydantic (argparse default is SUPPRESS). An auto field
    left out stays ``auto``; a boolean one takes ``--x`` / ``--no-x``."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        members = _members(field.annotation)
        literals = [v for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)]
        kwargs: dict = {"default": argparse.SUPPRESS, "help": field.description, "dest": name}
        if bool in members:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif literals and len(literals) == sum(len(typing.get_args(m)) for m in members):
            kwargs["choices"] = literals
        elif typing.get_origin(members[0]) is tuple:
            kwargs["action"] = "append"
        elif members[0] in (int, float, str):
            kwargs["type"] = members[0]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        parser.add_argument(flag, *extra.get("flag_aliases", ()), **kwargs)  # type: ignore[arg-type]


def model_kwargs(ns: argparse.Namespace, model: type[BaseModel]) -> dict:
    return {k: v for k, v in vars(ns).items() if k in model.model_fields}
