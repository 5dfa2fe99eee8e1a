"""One rank of an engine replica: loads the pipeline, shards it, and executes step commands (SPMD).

Every rank receives the same commands in the same order and holds the same request states; ranks differ
only in which shard of the model and of the sequence they compute. Rank 0's answers go back to the driver.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from .config import EngineConfig
from .models.registry import ModelSpec, resolve_model
from .pipelines.base import PipelineRunner, RequestState
from .request import GenerationParams

logger = logging.getLogger(__name__)

# A backstop for a peer that is alive but stuck: a dead peer is seen by the launcher within seconds and
# fails the step there. It must still cover the longest skew between ranks inside one step (the first
# compiled forward, rank 0's VAE decode), so it is not a step's length.
# Test mode, never a user default: the ranks of a replica share one GPU over gloo (NCCL refuses two ranks
# on one device), so every sharded GPU code path runs on a machine with a single GPU. Gloo takes CUDA
# tensors for the collectives; the ring's P2P is staged through host memory (``parallel/ring.py``).
SHARED_GPU_GLOO = os.environ.get("DITSERVE_TEST_SHARED_GPU_GLOO") == "1"


def process_group_backend(device: str) -> str:
    return "nccl" if device == "cuda" and not SHARED_GPU_GLOO else "gloo"


COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("DITSERVE_COLLECTIVE_TIMEOUT_S", "120")))


def encoder_components(spec: ModelSpec) -> list[str]:
    """The pipeline's encoder models: its ``transformers`` components that are models (text encoders, image
    encoders), not tokenizers or processors."""
    from .parallel.encoder_tp import encoder_components as components

    return components(spec.folder.index)


def refuse_missing_components(spec: ModelSpec, given: Any = ()) -> None:
    """ValueError naming the components the folder was saved without (``save_pretrained`` writes [null,
    null] for a component that was None) that its pipeline needs: not optional to the pipeline class or to
    the family, nor ``given`` in their place. ``from_pretrained`` would fail on them with a traceback of its
    own; ``serve`` says it before starting anything, a replica before loading."""
    import diffusers

    cls = getattr(diffusers, spec.pipeline_class)
    optional = set(spec.family_spec.optional_components) | set(getattr(cls, "_optional_components", ()))
    missing = [
        name
        for name, entry in spec.folder.index.items()
        if isinstance(entry, list) and entry[:1] == [None] and name not in given and name not in optional
    ]
    if missing:
        raise ValueError(
            f"--model {spec.name}: the folder was saved without {', '.join(missing)} ([null, null] in "
            f"model_index.json); {spec.pipeline_class} needs them: save it with every component"
        )


def load_pipeline(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    *,
    encoders: bool = True,
    encoder_group: Any = None,
):
    """``from_pretrained`` on the local folder: the same path for demo and real weights. Without
    ``encoders`` the encoder models are not loaded at all (ranks that receive embeddings); with an
    ``encoder_group`` (``--encoder-tp-size``) they are sharded over it on the host, before the move to
    ``device``, so the device only ever holds this rank's shard."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    cls = getattr(diffusers, spec.pipeline_class)
    skipped = {} if encoders else dict.fromkeys(encoder_components(spec))
    components = spec.family_spec.load("runner").pipeline_components(spec.path)
    absent = {name: None for name in spec.family_spec.optional_components if not spec.folder.has(name)}
    given = {**skipped, **absent, **components}
    refuse_missing_components(spec, given)
    pipe = cls.from_pretrained(spec.path, dtype=dtype, variant=spec.variant, **given)
    pipe.set_progress_bar_config(disable=True)
    if encoders and encoder_group is not None:
        from .parallel.encoder_tp import apply_encoder_tp

        for name in encoder_components(spec):
            model = getattr(pipe, name, None)
            if model is not None:
                apply_encoder_tp(model, group=encoder_group, component=name)
    return pipe.to(device)


def build_runner(spec: ModelSpec, pipe, config: EngineConfig, device: torch.device, mesh) -> PipelineRunner:
    runner_cls = spec.family_spec.load("runner")
    return runner_cls(
        pipe,
        device=device,
        dtype=config.torch_dtype,
        max_sequence_length=config.max_sequence_length,
        mesh=mesh,
        cuda_graphs=config.use_cuda_graphs,
    )


def apply_speed_switches(
    model: torch.nn.Module,
    *,
    family: str,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str = "none",
    fused_epilogues: bool = False,
) -> dict[str, int]:
    """``--quantization fp8`` and ``--fused-epilogues`` on a loaded (and sharded) transformer, before it is
    compiled (the compiled blocks trace what this leaves). The benchmarks call it too, so that they time
    what the engine runs. Returns how many modules each switch changed; applying it again is harmless."""
    changed = {"fp8_linears": 0, "fused_epilogues": 0, "fused_attention": 0}
    if quantization == "fp8":
        from .models.fp8 import Float8Linear, check_fp8_device, quantize_fp8

        check_fp8_device(device, dtype)
        changed["fp8_linears"] = quantize_fp8(model)
        already = any(isinstance(m, Float8Linear) for m in model.modules())  # applied before
        if not changed["fp8_linears"] and not already:
            raise ValueError(
                f"--quantization fp8: {type(model).__name__} has no block linears FP8 GEMMs can take"
            )
    if fused_epilogues:
        from .families import get_family
        from .models.flux_fused import fuse_flux_epilogues, fuse_gelu_epilogues
        from .parallel.plan import fuse_one_rank_processors

        fuse = fuse_flux_epilogues if family == "flux" else fuse_gelu_epilogues
        changed["fused_epilogues"] = fuse(model)
        changed["fused_attention"] = fuse_one_rank_processors(model, get_family(family).load("plan"))
    return changed


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` (tensors in nested dicts / lists / tuples) with every tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, device) for v in value)
    return value


def compile_blocks(model: torch.nn.Module) -> int:
    """``--compile``: regional compilation, one compiled graph reused by every transformer block (compiles in
    seconds): diffusers' ``compile_repeated_blocks`` where the class names its blocks, else each block of
    ``repeated_blocks`` compiled alike. Not fullgraph: a step with LoRA calls the (untraced) LoRA path at
    each adapted linear. Returns the blocks compiled here (0 when diffusers did it).

    Compiled code runs in two threads of a replica (a realtime chunk's VAE decode, with its compiled norms,
    beside the step loop). Tracing sets FX's process-wide "tracing" flag, and a compiled function called in
    another thread meanwhile raised ("... symbolically trace a dynamo-optimized function"; torch 2.11 leaves
    the flag visible to other threads while a graph compiles). With ``error_on_nested_fx_trace`` off, such a
    call runs its function eagerly instead: the same arithmetic, during a compile only."""
    from .models.blocks import repeated_blocks

    torch._dynamo.config.error_on_nested_fx_trace = False
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(fullgraph=False)
        return 0
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"--compile: {type(model).__name__} has no repeated blocks to compile")
    for block in blocks:
        block.compile(fullgraph=False)
    return len(blocks)


class ChunkDecodes:
    """Rank 0's VAE decodes of realtime chunks: one thread takes them in order, on a CUDA stream of its own,
    so a chunk's decode overlaps the steps that follow it on the GPU (the step loop's stream never waits for
    it). Results wait in ``done`` until the engine collects them (``RankWorker.decoded``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.cond = threading.Condition()
        self.queue: deque[tuple[str, Callable[[Any], Any], Any]] = deque()
        self.done: dict[str, tuple[str, Any]] = {}
        self.unfinished = 0  # submitted, not yet in ``done``
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="ditserve-chunk-decode", daemon=True)
        self.thread.start()

    def submit(self, req_id: str, decode: Callable[[Any], Any]) -> None:
        ready = None
        if self.stream is not None:  # the latents are written by work queued on the step loop's stream
            ready = torch.cuda.Event()
            ready.record()
        with self.cond:
            self.queue.append((req_id, decode, ready))
            self.unfinished += 1
            self.cond.notify_all()

    def _run(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                req_id, decode, ready = self.queue.popleft()
            try:
                if self.stream is None:
                    out = ("ok", decode(None))
                else:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(ready)
                        out = ("ok", decode(self.stream))
            except Exception as exc:  # noqa: BLE001 - handed to the engine, which fails that chunk
                logger.exception("chunk decode %s failed", req_id)
                out = ("error", exc)
            with self.cond:
                self.done[req_id] = out
                self.unfinished -= 1
                self.cond.notify_all()

    def collect(self, wait_s: float) -> dict[str, tuple[str, Any]]:
        with self.cond:
            if not self.done and self.unfinished and wait_s > 0:
                self.cond.wait(wait_s)
            done, self.done = self.done, {}
        return done

    def drain(self) -> None:
        """Wait until every submitted decode is done (their frames stay for ``collect``)."""
        with self.cond:
            while self.unfinished:
                self.cond.wait()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.queue.clear()
            self.cond.notify_all()
        self.thread.join(timeout=30)


class RankWorker:
    """The per-rank engine. ``rank``/``world_size``/``init_method`` describe the replica's process group."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
        device_index: int | None = None,
        pipe=None,
    ):
        self.config = config
        self.rank = rank
        self.spec = resolve_model(config.model, files=pipe is None)
        if config.device == "cuda":
            index = device_index if device_index is not None else rank % max(torch.cuda.device_count(), 1)
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.mesh = None
        dims = config.parallel.dims()
        if world_size > 1:
            import torch.distributed as dist

            from .parallel.mesh import build_mesh

            assert dims.world_size == world_size, (dims, world_size)
            dist.init_process_group(
                process_group_backend(config.device),
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=COLLECTIVE_TIMEOUT,
            )
            self.mesh = build_mesh(dims, device_type=self.device.type)
            # ``pipe`` is injected by benchmarks that build weights in memory; serving always loads the folder.
        # --encoder-placement first: one copy of the encoders, on rank 0 (or sharded over ranks 0..N-1 with
        # --encoder-tp-size N, which encode together), and rank 0 sends the embeddings.
        self.world_size = world_size
        encoder_ranks = config.encoder_tp_size
        self.encodes = world_size == 1 or config.encoder_placement == "all" or rank < encoder_ranks
        self.sends_embeddings = world_size > 1 and config.encoder_placement == "first"
        self.encoder_group = None
        if world_size > 1 and encoder_ranks > 1:
            import torch.distributed as dist

            # every rank takes part in making a group, members or not
            self.encoder_group = dist.new_group(list(range(encoder_ranks)), timeout=COLLECTIVE_TIMEOUT)
        if pipe is None:
            pipe = load_pipeline(
                self.spec,
                config.torch_dtype,
                self.device,
                encoders=self.encodes,
                encoder_group=self.encoder_group if self.encodes else None,
            )
        self.pipe = pipe
        self.prepare_transformer(self.pipe.transformer)
        if getattr(self.pipe, "transformer_2", None) is not None:  # a second expert (Wan 2.2 A14B): the same
            self.prepare_transformer(self.pipe.transformer_2)
        self.runner = build_runner(self.spec, self.pipe, config, self.device, self.mesh)
        self.lora = self._build_lora()
        self.runner.before_forward = lambda groups: self.lora.set_batch(
            [(rows, s.params.lora) for s, rows in groups]
        )
        self.runner.graph_key = lambda: self.lora.graph_key()
        self.runner.relayout = lambda rows, offsets: self.lora.relayout(rows, offsets)
        self.states: dict[str, RequestState] = {}
        self._decodes: ChunkDecodes | None = None  # realtime chunks' VAE decodes (rank 0, started lazily)

    def prepare_transformer(self, model: torch.nn.Module) -> None:
        """Everything the config does to a freshly loaded transformer, in order (at start and for every
        weights update): shard it, FP8 GEMMs, fused FLUX epilogues, compile."""
        config = self.config
        if self.mesh is not None:
            from .parallel.plan import parallelize

            parallelize(model, self.spec.family_spec.load("plan"), mesh=self.mesh)
        apply_speed_switches(
            model,
            family=self.spec.family,
            device=self.device,
            dtype=config.torch_dtype,
            quantization=config.quantization,
            fused_epilogues=config.use_fused_epilogues,
        )
        if config.compile:
            # Regional compilation: one compiled block graph reused by every block (compiles in seconds).
            # Not fullgraph: a step with LoRA calls the (untraced) LoRA path at each adapted linear.
            compile_blocks(model)

    # -- commands (same on every rank) --------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": str(self.device), "model": self.spec.name}

    def memory(self) -> list[dict[str, Any]] | None:
        """Per rank (rank 0 answers for all): bytes of parameters held by the transformer, the encoders and
        the VAE, and the device's peak allocation (cuda). Shows where ``--encoder-placement`` put the
        encoders."""

        def param_bytes(module: Any) -> int:
            if module is None or not hasattr(module, "parameters"):
                return 0
            return sum(p.numel() * p.element_size() for p in module.parameters())

        mine = {
            "rank": self.rank,
            "transformer_bytes": sum(
                param_bytes(getattr(self.pipe, n, None)) for n in ("transformer", "transformer_2")
            ),
            "encoder_bytes": sum(
                param_bytes(getattr(self.pipe, n, None)) for n in encoder_components(self.spec)
            ),
            "vae_bytes": param_bytes(getattr(self.pipe, "vae", None)),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device)
            if self.device.type == "cuda"
            else None,
        }
        if self.world_size == 1:
            return [mine]
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        return everyone if self.rank == 0 else None

    def add(self, req_id: str, params: GenerationParams) -> int:
        """Start a request; returns its number of steps."""
        encoded = self._encode(params)
        state = self.states[req_id] = self.runner.prepare(req_id, params, encoded)
        return state.num_steps

    def add_chunk(
        self, req_id: str, session_id: str, chunk_index: int, params: GenerationParams, max_chunks: int | None
    ) -> int:
        """Start chunk ``chunk_index`` of realtime video session ``session_id`` (its state stays on the ranks
        between chunks, until ``close_session``); returns the chunk's number of steps."""
        prepare_chunk = getattr(self.runner, "prepare_chunk", None)
        if prepare_chunk is None:
            raise ValueError(f"model: {self.spec.name} does not generate realtime video")
        encoded = self._encode(params)
        state = prepare_chunk(req_id, session_id, chunk_index, params, encoded, max_chunks)
        self.states[req_id] = state
        return state.num_steps

    def close_session(self, session_id: str) -> None:
        """Free a realtime session's state (its K/V cache)."""
        close = getattr(self.runner, "close_session", None)
        if close is not None:
            close(session_id)

    def _encode(self, params: GenerationParams) -> dict[str, Any]:
        """The request's embeddings: computed here, or (``--encoder-placement first``) on rank 0 (with
        ``--encoder-tp-size N``: on ranks 0..N-1 together) and received from rank 0. An encoder error on
        rank 0 travels too, so every rank raises it and none waits."""
        if not self.sends_embeddings:
            return self.runner.encode(params)
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.encodes:  # rank 0, or each rank of the encoders' TP group (they run the encoders together)
            try:
                box[0] = ("ok", _to_device(self.runner.encode(params), torch.device("cpu")))
            except Exception as exc:  # noqa: BLE001 - sent to the other ranks, raised everywhere below
                box[0] = ("error", exc)
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        status, value = box[0]
        if status == "error":
            raise value
        return _to_device(value, self.device)

    def step(self, req_ids: list[str]) -> dict[str, int]:
        """One denoising step for ``req_ids`` (one bucket); returns each request's completed step count."""
        states = [self.states[r] for r in req_ids]
        self.runner.step(states)
        return {s.req_id: s.step_index for s in states}

    def finish(self, req_id: str) -> dict[str, Any] | None:
        """Forget a finished request; rank 0 decodes it (once per replica) and returns its pixels and
        usage (its prompt's text tokens included, and its negative prompt's where the uncond branch read it:
        both are text the text encoder encoded and the transformer attended)."""
        state = self.states.pop(req_id)
        cost = self.runner.usage(state)  # on every rank: a collective under CFG parallelism
        if self.rank != 0:
            return None
        text_tokens = self.runner.prompt_tokens(state.params.prompt)
        if state.params.negative_prompt and state.uncond is not None:
            text_tokens += self.runner.prompt_tokens(state.params.negative_prompt)
        return {"pixels": self.runner.decode(state), "usage": cost | {"text_tokens": text_tokens}}

    def finish_chunk(self, req_id: str) -> None:
        """Forget a denoised realtime chunk and start its VAE decode, without waiting for it: rank 0 decodes
        in a thread of its own, on a CUDA stream of its own, while the step loop goes on (the session's
        next chunk, other requests); ``decoded`` hands the frames over. A session's chunks decode in order
        (one thread): each continues the decoder's causal cache of the one before."""
        state = self.states.pop(req_id)
        if self.rank != 0:
            return
        # Bound to this chunk's latents now: the next chunk appends its own to the rollout.
        decode = self.runner.chunk_decoder(state)
        if self._decodes is None:
            self._decodes = ChunkDecodes(self.device)
        self._decodes.submit(req_id, decode)

    def wait_decodes(self) -> None:
        """Let the chunk decodes in flight finish (before the VAE moves: memory release)."""
        if self._decodes is not None:
            self._decodes.drain()

    def decoded(self, wait_s: float = 0.0) -> dict[str, tuple[str, Any]] | None:
        """The chunk decodes finished since the last call, ``{req_id: ("ok", frames) | ("error", exc)}``;
        waits up to ``wait_s`` for the first one while some are running. Rank 0 only (others: None)."""
        if self.rank != 0 or self._decodes is None:
            return None if self.rank != 0 else {}
        return self._decodes.collect(wait_s)

    def latents(self, req_id: str) -> np.ndarray | None:
        """The request's current (packed) latents, float32 on host; rank 0 only (others return None)."""
        if self.rank != 0:
            return None
        return self.states[req_id].latents.detach().float().cpu().numpy()

    def preview(self, req_id: str) -> np.ndarray | None:
        """The request's first output's current latents as a (height, width, channels) grid on the latent
        grid (its family unpacks them), float32 on host: a progress preview's picture; rank 0 only."""
        if self.rank != 0:
            return None
        grid = self.runner.preview_latents(self.states[req_id])
        return grid.detach().float().permute(1, 2, 0).cpu().numpy()

    def drop(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def _build_lora(self):
        from .lora.manager import LoRAManager

        config = self.config
        return LoRAManager(
            self.pipe.transformer,
            self.spec.pipeline_class,
            max_loras=config.max_loras,
            max_rank=config.max_lora_rank,
            fused=config.fused_lora,
            transformer_2=getattr(self.pipe, "transformer_2", None),  # Wan 2.2 A14B's second expert
        )

    def reattach_lora(self) -> None:
        """After the transformer was replaced (weights update): the same adapters on the new modules."""
        previous = self.lora
        self.runner.model_changed()
        self.lora = self._build_lora()
        for name, info in previous.info.items():
            self.lora.load(name, info["path"], info["scale"], info.get("target"))

    def lora_load(
        self, name: str, path: str, scale: float = 1.0, target: str | None = None
    ) -> dict[str, Any]:
        self.runner.model_changed()
        return self.lora.load(name, path, scale, target)

    def lora_unload(self, name: str) -> None:
        self.runner.model_changed()
        self.lora.unload(name)

    def shutdown(self) -> None:
        self.states.clear()
        if self._decodes is not None:
            self._decodes.close()
        if self.mesh is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
