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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from ditserve.replica.config import EngineConfig, Limits, ParallelFlags

# Flags that mean exactly what the EngineConfig field of the same name means: declared once, there.
SHARED_ENGINE_FIELDS = (
    "max_batch_size", "compile", "quantization", "fused_epilogues", "cuda_graphs", "fused_lora", "max_loras",
    "max_lora_rank",
)  # fmt: skip


def _engine_field(name: str) -> FieldInfo:
    """EngineConfig's field ``name`` (default, bounds, help), for the flat argument models."""
    assert name in SHARED_ENGINE_FIELDS, name
    return copy.copy(EngineConfig.model_fields[name])


class EngineArgs(BaseModel):
    """Engine flags (``generate`` and ``serve``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default="demo-scenes", description="Embedded model name or a local diffusers folder.")
    device: Literal["cpu", "cuda"] | None = Field(
        default=None, description="Device of the ranks (default: cuda when a GPU is visible, else cpu)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="Weights/activations dtype (default: bfloat16 on cuda, float32 on cpu)."
    )
    num_gpus: int | None = Field(default=None, ge=1, description="GPUs (CPU: ranks) of the whole deployment.")
    dp_size: int = Field(default=1, ge=1, description="Number of engine replicas.")
    cfg_parallel_size: int = Field(default=1, ge=1, le=2, description="CFG-parallel degree (1 or 2).")
    tp_size: int = Field(default=1, ge=1, description="Tensor-parallel degree.")
    ulysses_degree: int = Field(default=1, ge=1, description="Ulysses sequence-parallel degree.")
    ring_degree: int = Field(default=1, ge=1, description="Ring-attention sequence-parallel degree.")
    kv_gather_degree: int = Field(default=1, ge=1, description="K/V all-gather sequence-parallel degree.")
    sp_degree: int | None = Field(
        default=None, ge=1, description="Sequence-parallel degree alone: 2 → K/V-gather, larger → Ulysses."
    )
    max_sequence_length: int = Field(default=512, ge=1, description="Text tokens per prompt.")
    max_batch_size: int = _engine_field("max_batch_size")
    max_queue: int = Field(default=64, ge=1, description="Most queued requests per replica before 429.")
    max_width: int = Field(default=2048, ge=16, description="Largest width in pixels.")
    max_height: int = Field(default=2048, ge=16, description="Largest height in pixels.")
    max_frames: int = Field(default=129, ge=1, description="Most video frames per request.")
    max_steps: int = Field(default=100, ge=1, description="Most denoising steps per request.")
    max_n: int = Field(default=4, ge=1, description="Most images per request.")
    max_prompt_chars: int = Field(default=4000, ge=1, description="Longest prompt in characters.")
    compile: bool = _engine_field("compile")
    quantization: Literal["none", "fp8"] = _engine_field("quantization")
    fused_epilogues: bool | None = _engine_field("fused_epilogues")
    cuda_graphs: bool | None = _engine_field("cuda_graphs")
    fused_lora: bool = _engine_field("fused_lora")
    lora_root: tuple[str, ...] = Field(default=(), description="Folders LoRA files may be loaded from.")
    max_loras: int = _engine_field("max_loras")
    max_lora_rank: int = _engine_field("max_lora_rank")

    def parallel_flags(self) -> ParallelFlags:
        return ParallelFlags(
            num_gpus=self.num_gpus,
            dp_size=self.dp_size,
            cfg_parallel_size=self.cfg_parallel_size,
            tp_size=self.tp_size,
            ulysses_degree=self.ulysses_degree,
            ring_degree=self.ring_degree,
            kv_gather_degree=self.kv_gather_degree,
            sp_degree=self.sp_degree,
        )

    def engine_config(self) -> EngineConfig:
        kwargs = {}
        if self.device is not None:
            kwargs["device"] = self.device
        config = EngineConfig(
            model=self.model,
            parallel=self.parallel_flags(),
            limits=Limits(
                max_width=self.max_width,
                max_height=self.max_height,
                max_frames=self.max_frames,
                max_steps=self.max_steps,
                max_n=self.max_n,
                max_prompt_chars=self.max_prompt_chars,
            ),
            max_sequence_length=self.max_sequence_length,
            max_queue=self.max_queue,
            **{name: getattr(self, name) for name in SHARED_ENGINE_FIELDS},
            lora_roots=self.lora_root,
            **kwargs,
        )
        dtype = self.dtype or ("bfloat16" if config.device == "cuda" else "float32")
        return config.model_copy(update={"dtype": dtype})


class AppArgs(EngineArgs):
    """``ditserve serve`` / ``build_app`` arguments: the engine flags plus the serving ones."""

    host: str = Field(default="127.0.0.1", description="HTTP bind address.")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port.")
    grpc_port: int = Field(default=9000, ge=0, le=65535, description="gRPC port (0 disables gRPC).")
    address: str | None = Field(default=None, description="Join this Ray cluster instead of starting one.")
    api_key: str | None = Field(
        default_factory=lambda: os.environ.get("DITSERVE_API_KEY") or None,
        description="Bearer key for admin endpoints (also DITSERVE_API_KEY).",
    )
    api_key_for_generation: bool = Field(default=False, description="Require the API key for generation too.")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="Largest request body in bytes.")
    replica_num_cpus: float = Field(default=0.1, gt=0, description="CPUs reserved per rank bundle on CPU.")
    max_sessions_per_replica: int = Field(
        default=16, ge=1, description="Open realtime sessions per replica before 429."
    )
    session_idle_timeout_s: float = Field(
        default=300.0, gt=0, description="A session unused this long is closed and its state freed."
    )
    lora_path: tuple[str, ...] = Field(default=(), description="Adapters to load at start, NAME=PATH.")
    session_max_lifetime_s: float = Field(
        default=3600.0, gt=0, description="A realtime session (and its WebSocket) is closed after this long."
    )
    video_ttl_s: float = Field(
        default=3600.0, gt=0, description="A finished video job and its MP4 are kept this long, then expire."
    )
    max_video_jobs_per_replica: int = Field(
        default=64, ge=1, description="Video jobs (running or kept) per replica before 429."
    )

    @model_validator(mode="after")
    def _check_layout(self) -> AppArgs:
        self.parallel_flags().dims()  # raises ValueError naming the flags
        return self


# -- argparse from the pydantic fields ------------------------------------------------------------------
def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _base_type(args[0])
    return annotation


def add_model_arguments(
    parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple[str, ...] = ()
) -> None:
    """One ``--flag`` per field; defaults stay with pydantic (argparse default is SUPPRESS)."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _base_type(field.annotation)
        kwargs: dict = {"default": argparse.SUPPRESS, "help": field.description, "dest": name}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            kwargs["choices"] = list(typing.get_args(kind))
        elif typing.get_origin(kind) is tuple:
            kwargs["action"] = "append"
        elif kind in (int, float, str):
            kwargs["type"] = kind
        parser.add_argument(flag, **kwargs)


def model_kwargs(ns: argparse.Namespace, model: type[BaseModel]) -> dict:
    return {k: v for k, v in vars(ns).items() if k in model.model_fields}
