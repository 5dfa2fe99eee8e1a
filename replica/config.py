"""Engine configuration: one pydantic tree, validated once at the edge (CLI, Serve builder, YAML)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    import torch

    from .parallel.dims import ParallelDims

# Fields whose input may be "auto" (or left out): resolved from the device and the layout before the
# config is validated, so a built EngineConfig holds only final values.
AUTO = "auto"
AUTO_FIELDS = ("device", "dtype", "fused_epilogues", "cuda_graphs")


def host_device() -> Literal["cpu", "cuda"]:
    """What ``device: auto`` means on this machine. A torch build without a GPU backend answers cpu without
    being imported (1.5-2 s of ``ditserve serve``'s start on a small CPU machine, before Ray starts)."""
    if "torch" not in sys.modules and not torch_has_gpu_backend():
        return "cpu"
    import torch  # here: the API front end reads this module and needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_has_gpu_backend() -> bool:
    """Whether the installed torch build ships CUDA or ROCm libraries (read from its files, not imported);
    True where that cannot be told, so that torch itself is asked."""
    found = importlib.util.find_spec("torch")
    places = list(found.submodule_search_locations or []) if found is not None else []
    lib = Path(places[0]) / "lib" if places else None
    if lib is None or not lib.is_dir():
        return True
    return any(any(lib.glob(pattern)) for pattern in ("*torch_cuda*", "*torch_hip*"))


class ParallelFlags(BaseModel):
    """Layout flags of one engine replica, with SGLang Diffusion's meaning of ``--num-gpus``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_gpus: int | None = Field(
        default=None,
        ge=1,
        description="GPUs (CPU: rank processes) of the whole deployment; each replica gets num_gpus / dp_size. "
        "Unset: dp_size × the product of the degrees.",
    )
    dp_size: int = Field(default=1, ge=1, description="Number of engine replicas.")
    cfg_parallel_size: int = Field(
        default=1, ge=1, le=2, description="CFG branches on separate ranks (1 or 2)."
    )
    tp_size: int = Field(default=1, ge=1, description="Tensor-parallel degree.")
    # flag_aliases: the spellings of other serving stacks (--ulysses-size), one flag with ours
    ulysses_degree: int = Field(
        default=1,
        ge=1,
        description="Ulysses (all-to-all) sequence-parallel degree.",
        json_schema_extra={"flag_aliases": ["--ulysses-size"]},
    )
    ring_degree: int = Field(
        default=1,
        ge=1,
        description="Ring-attention sequence-parallel degree.",
        json_schema_extra={"flag_aliases": ["--ring-size"]},
    )
    kv_gather_degree: int = Field(
        default=1,
        ge=1,
        description="K/V all-gather sequence-parallel degree.",
        json_schema_extra={"flag_aliases": ["--kv-gather-size"]},
    )
    sp_degree: int | None = Field(
        default=None,
        ge=1,
        description="Sequence-parallel degree when no other sp flag is given: 2 → K/V-gather 2, larger → Ulysses.",
    )

    def dims(self, num_heads: int | None = None, tp_features: dict[str, int] | None = None) -> ParallelDims:
        """The validated per-replica :class:`ParallelDims` (raises ValueError naming the flags); with
        ``num_heads`` (and the feature dims TP cuts) checked against the model too, so suggested layouts fit it."""
        # Imported here: the parallel package loads diffusers' models, which config readers do not need.
        from .parallel.dims import ParallelDims

        return ParallelDims.from_flags(
            num_gpus=self.num_gpus,
            dp_size=self.dp_size,
            cfg=self.cfg_parallel_size,
            tp=self.tp_size,
            ulysses=self.ulysses_degree,
            ring=self.ring_degree,
            kv_gather=self.kv_gather_degree,
            sp_degree=self.sp_degree,
            num_heads=num_heads,
            tp_features=tp_features,
        )

    @property
    def world_size(self) -> int:
        return self.dims().world_size


class Limits(BaseModel):
    """Request limits a deployment enforces (over them → 400/413 naming the limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_width: int = Field(default=2048, ge=16, description="Largest image/video width in pixels.")
    max_height: int = Field(default=2048, ge=16, description="Largest image/video height in pixels.")
    max_frames: int = Field(default=129, ge=1, description="Most video frames per request.")
    max_steps: int = Field(default=100, ge=1, description="Most denoising steps per request.")
    max_n: int = Field(default=4, ge=1, description="Most images per request (n).")
    max_prompt_chars: int = Field(default=4000, ge=1, description="Longest prompt, in characters.")
    max_image_bytes: int = Field(
        default=16 << 20, ge=1024, description="Largest uploaded image (POST /v1/images/edits), in bytes."
    )
    max_image_pixels: int = Field(
        default=4096 * 4096, ge=256, description="Largest uploaded image, in pixels (width × height)."
    )


class EngineConfig(BaseModel):
    """Everything one engine replica needs; the same object drives ``generate`` and ``serve``.

    The fields of :data:`AUTO_FIELDS` may be given as ``"auto"`` or left out; they are resolved first
    (device: this host's, see :func:`resolve_auto`), then every final value is validated once.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default="demo-scenes", description="Embedded model name or a local diffusers folder.")
    device: Literal["cpu", "cuda"] = Field(
        description="Device of the ranks (auto: cuda when a GPU is visible, else cpu)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        description="Weights and activations dtype (auto: bfloat16 on cuda, float32 on cpu)."
    )
    parallel: ParallelFlags = Field(default_factory=ParallelFlags, description="Per-replica layout.")
    limits: Limits = Field(default_factory=Limits, description="Request limits.")
    max_sequence_length: int | None = Field(
        default=None,
        ge=1,
        description="Text tokens per prompt (default 512, capped by the pipeline's and tokenizer's own "
        "maximum; HunyuanVideo 1.5 encodes its pipeline's fixed length and refuses it).",
    )
    max_batch_size: int = Field(default=8, ge=1, description="Most requests in one running batch.")
    max_queue: int = Field(default=64, ge=1, description="Most queued requests per replica before 429.")
    compile: bool = Field(default=False, description="torch.compile the transformer blocks.")
    quantization: Literal["none", "fp8"] = Field(
        default="none",
        description="fp8: the transformer blocks' linears as FP8 GEMMs with row-wise scales (GPUs of compute "
        "capability 8.9+, bfloat16; images change a little).",
    )
    fused_epilogues: bool = Field(
        description="tanh GELU in the MLP up-projection's GEMM (cuBLASLt epilogue); FLUX: the single blocks' "
        "proj_out without the concat; FLUX.2, Wan, Qwen-Image, Z-Image on one GPU: q/k norm and rotary in "
        "one Triton pass (auto: on with --device cuda).",
    )
    cuda_graphs: bool = Field(
        description="Replay each transformer forward as a CUDA graph, one per input shape and adapter layout "
        "(saves the host's launch time where kernels are short; auto: on with --device cuda and one "
        "GPU per replica, no tensor, sequence or CFG parallelism).",
    )
    fused_lora: bool = Field(
        default=True,
        description="LoRA expand inside the base GEMM (Triton, GPU); off: base GEMM, then an in-place expand.",
    )
    max_loras: int = Field(default=8, ge=1, description="Adapter slots per replica.")
    max_lora_rank: int = Field(default=128, ge=1, le=128, description="Largest adapter rank.")
    cache_policy: Literal["recommended", "none", "fbcache", "taylorseer"] = Field(
        default="recommended",
        description="Step cache of requests that do not ask for one: none, fbcache, taylorseer, or recommended (what "
        'the model folder\'s ditserve.json recommends under "cache", else none). A request\'s own "cache" '
        'wins, {"policy": "none"} included.',
    )
    cache_threshold: float | None = Field(
        default=None, ge=0.0, le=10.0, description="fbcache threshold of the server's default (default 0.1)."
    )
    cache_interval: int | None = Field(
        default=None, ge=1, le=100, description="taylorseer interval of the server's default (default 3)."
    )
    encoder_placement: Literal["first", "all"] = Field(
        default="first",
        description="Where the text/image encoders run in a replica of several ranks: first (one copy, on the "
        "replica's first rank, which sends each request's embeddings to the others; the other ranks never "
        "load the encoders) or all (every rank loads them and encodes every prompt itself).",
    )
    encoder_tp_size: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel degree of the text encoders (LLaMA-like decoders such as FLUX.2's Mistral "
        "and Qwen-Image's Qwen2.5-VL, and T5): N > 1 shards them over the replica's first N ranks, which "
        "encode each request together; the first sends the embeddings on. Default 1: whole encoders where "
        "--encoder-placement puts them.",
    )
    lora_roots: tuple[str, ...] = Field(
        default=(), description="Folders adapters may be loaded from (empty: any local path)."
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        return resolve_auto(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError(
                "--dtype float16 is not supported on --device cpu; use --dtype float32 or bfloat16"
            )
        if self.quantization == "fp8" and self.device == "cuda" and self.dtype != "bfloat16":
            raise ValueError(
                f"--quantization fp8 writes bfloat16 GEMM outputs on GPUs; --dtype {self.dtype} cannot hold "
                "them: use --dtype bfloat16 (the default on cuda)"
            )
        if self.cache_threshold is not None and self.cache_policy != "fbcache":
            raise ValueError(
                f"--cache-threshold is an fbcache setting; --cache-policy is {self.cache_policy}"
            )
        if self.cache_interval is not None and self.cache_policy != "taylorseer":
            raise ValueError(
                f"--cache-interval is a taylorseer setting; --cache-policy is {self.cache_policy}"
            )
        if self.encoder_tp_size > 1 and self.encoder_placement == "all":
            raise ValueError(
                f"--encoder-tp-size {self.encoder_tp_size} shards one copy of the encoders over the replica's "
                "first ranks; --encoder-placement all keeps a whole copy on every rank: drop one of them"
            )
        ranks = _world_size(self.parallel)
        if ranks is not None and self.encoder_tp_size > ranks:
            raise ValueError(
                f"--encoder-tp-size {self.encoder_tp_size} is larger than the replica's {ranks} rank(s); "
                f"choose at most {ranks}"
            )
        if self.cuda_graphs and self.device != "cuda":  # auto never turns them on off cuda
            raise ValueError("--cuda-graphs needs --device cuda; drop it or pass --no-cuda-graphs")
        if self.cuda_graphs and (_world_size(self.parallel) or 1) != 1:  # an illegal layout: its own error
            raise ValueError(
                "--cuda-graphs runs replicas of one GPU (no --tp-size / sequence / CFG parallelism); "
                "drop it or pass --no-cuda-graphs"
            )
        return self

    @property
    def use_cuda_graphs(self) -> bool:
        return self.cuda_graphs

    @property
    def use_fused_epilogues(self) -> bool:
        return self.fused_epilogues

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)


def _world_size(parallel: ParallelFlags) -> int | None:
    """Ranks per replica, or None for a layout that is not legal (its own check names the flags)."""
    try:
        return parallel.dims().world_size
    except ValueError:
        return None


def resolve_auto(values: dict[str, Any], device: Literal["cpu", "cuda"] | None = None) -> dict[str, Any]:
    """``values`` with every auto field (``"auto"`` or absent) replaced by its final value.

    ``device`` is what ``device: auto`` means (default: this host's, :func:`host_device`); a manifest for
    GPU nodes resolves with ``"cuda"`` on a machine without one."""
    out = dict(values)
    if out.get("device", AUTO) == AUTO:
        out["device"] = device or host_device()
    on_cuda = out["device"] == "cuda"
    if out.get("dtype", AUTO) == AUTO:
        out["dtype"] = "bfloat16" if on_cuda else "float32"
    if out.get("fused_epilogues", AUTO) == AUTO:
        out["fused_epilogues"] = on_cuda
    if out.get("cuda_graphs", AUTO) == AUTO:
        parallel = out.get("parallel", {})
        try:
            parallel = (
                parallel if isinstance(parallel, ParallelFlags) else ParallelFlags.model_validate(parallel)
            )
        except ValidationError:  # reported by the field's own validation
            parallel = None
        out["cuda_graphs"] = on_cuda and parallel is not None and _world_size(parallel) == 1
    return out
