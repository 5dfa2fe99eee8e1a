"""The engine of one replica: a scheduler loop driving SPMD rank workers one denoising step at a time.

``Engine`` runs in the driver process (the Serve replica, or ``ditserve generate``). It never imports Ray:
the rank launcher is injected (local processes, or Ray actors from ``ditserve.cluster``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any

from .caching.settings import CacheSettings
from .config import EngineConfig
from .launcher import RankLauncher, default_launcher
from .media import encode_mp4, encode_png, first_frame_refusal, image_size
from .models.registry import ModelSpec, resolve_model
from .request import GenerationParams, GenerationResult
from .scheduler import Job, StepScheduler

logger = logging.getLogger(__name__)


def validate_layout(config: EngineConfig, spec: ModelSpec) -> int:
    """Check the parallel layout against the model before any process starts; returns the world size."""
    try:
        dims = config.parallel.dims(num_heads=spec.num_attention_heads)
        tp = dims.tp > 1
    except ValueError:  # its suggestions may hold TP sizes: check them against the features too
        tp = True
    if tp:  # the feature dims the family's TP plan cuts (imports torch and diffusers: only here)
        from .parallel.tp import tp_features

        features = tp_features(spec.folder, spec.family_spec)
        dims = config.parallel.dims(num_heads=spec.num_attention_heads, tp_features=features)
    world_size = dims.world_size
    if dims.cfg > 1 and (one := spec.family_spec.single_branch(spec.folder)) is not None:
        raise ValueError(
            f"--cfg-parallel-size {dims.cfg}: {spec.name} runs one branch a step ({one}), so a second cfg "
            "rank would only repeat the first's work; give the GPUs to --tp-size, --ulysses-degree or "
            "--ring-degree (or --dp-size)"
        )
    # A family may shard over only some axes (its plan declares which; e.g. AnyFlow-FAR: Ulysses).
    axes = spec.family_spec.extra.get("parallel_axes")
    if axes is not None:
        dims = config.parallel.dims(num_heads=spec.num_attention_heads)
        flags = {"cfg": "--cfg-parallel-size", "tp": "--tp-size", "ulysses": "--ulysses-degree"}
        flags |= {"ring": "--ring-degree", "kv_gather": "--kv-gather-degree"}
        refused = [f"{flags[a]} {getattr(dims, a)}" for a in flags if a not in axes and getattr(dims, a) > 1]
        # --sp-degree (given alone) became one of the degrees: name the flag typed
        sp = config.parallel.sp_degree if (config.parallel.sp_degree or 1) > 1 else None
        refused = [
            f"--sp-degree {sp} (runs as {r})" if sp and r.endswith(f"degree {sp}") else r for r in refused
        ]
        if refused:
            allowed = ", ".join(flags[a] for a in axes) or "none"
            raise ValueError(
                f"{', '.join(refused)}: {spec.name} shards over {allowed} only; set the others to 1 "
                f"(and scale with --dp-size){f' and pass {allowed} explicitly' if sp else ''}"
            )
    if config.max_sequence_length is not None and not spec.family_spec.text_length:
        raise ValueError(
            f"--max-sequence-length {config.max_sequence_length}: {spec.name} encodes prompts at its "
            "pipeline's fixed length, which it does not take; leave the flag out"
        )
    if config.encoder_tp_size > 1:  # heads, KV heads and MLP features of each encoder divide the degree
        from .parallel.encoder_tp import check_encoder_tp, encoder_components

        names = encoder_components(spec.folder.index)
        kinds = [check_encoder_tp(spec.folder.config(name), config.encoder_tp_size, name) for name in names]
        if not any(kinds):  # CLIP / vision encoders only: the flag would only load whole copies on more ranks
            raise ValueError(
                f"--encoder-tp-size {config.encoder_tp_size}: none of {spec.name}'s encoders "
                f"({', '.join(names) or 'none'}) is one it shards (T5, Mistral3, Qwen2.5-VL, Qwen3 text "
                "models; CLIP stays whole); leave --encoder-tp-size at 1"
            )
    return world_size


def default_cache(config: EngineConfig, spec: ModelSpec) -> CacheSettings | None:
    """The step cache of requests that ask for none: ``--cache-policy`` (recommended: the model's). A cache
    the model's family does not take is refused here, naming where it came from (every request that gave
    none would be refused naming ``cache``)."""
    if config.cache_policy == "none":
        return None
    if config.cache_policy == "recommended":
        cache, source = spec.recommended_cache, f'--model {spec.name}: ditserve.json\'s "cache"'
    else:
        extra = {"threshold": config.cache_threshold, "interval": config.cache_interval}
        given = {k: v for k, v in extra.items() if v is not None}
        cache = CacheSettings(policy=config.cache_policy, **given)
        source = f"--cache-policy {config.cache_policy}"
    if cache is not None and cache.enabled and not spec.family_spec.step_cache:
        raise ValueError(f"{source}: {spec.name} does not take a step cache; use --cache-policy none")
    return cache


@dataclass(frozen=True)
class ChunkFutures:
    """A queued realtime chunk: ``denoised`` resolves (to None) when its steps are done, the moment the
    session's next chunk may be queued; ``frames`` to its frames, uint8 [frames, H, W, 3], once decoded.
    Cancel ``frames`` to drop the chunk."""

    denoised: Future
    frames: Future


# While chunk decodes run on rank 0 and nothing else is runnable, the loop checks for finished ones this
# often (a new request waits at most this long to be picked up).
DECODE_POLL_S = 0.005


class AdapterDraining(ValueError):
    """A load of a name whose adapter is still being unloaded, or that would replace an adapter, while queued
    or running requests use it: the same load succeeds once they are done."""


class Engine:
    """Owns a replica's ranks and its step loop.

    >>> engine = Engine(EngineConfig(model="demo-flux")); engine.start()
    >>> result = engine.generate(GenerationParams(prompt="a red fox", width=64, height=64))
    """

    def __init__(self, config: EngineConfig, launcher: RankLauncher | None = None):
        self.config = config
        # a launcher that brings its pipeline in memory (InProcessLauncher(pipe)) needs no weights on disk
        self.spec = resolve_model(config.model, files=getattr(launcher, "pipe", None) is None)
        self.world_size = validate_layout(config, self.spec)
        self.default_cache = default_cache(config, self.spec)
        self.launcher = launcher or default_launcher(self.world_size)
        self.scheduler = StepScheduler(config.max_batch_size, config.max_queue)
        self._controls: SimpleQueue[tuple[Callable[[], Any], Future]] = SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps_run = 0
        self._decoding: dict[str, Job] = {}  # realtime chunks whose frames rank 0 is decoding (loop thread)
        self.loras: dict[str, dict[str, Any]] = {}  # loaded adapters (the same on every rank)
        self.draining: set[str] = set()  # unloaded, waiting for the requests that use them to finish
        self.last_batch_size = 0
        self.last_step_s = 0.0
        self.step_seconds_total = 0.0
        # Called as fn(batch_size, step_s) in the loop thread after every step (metrics).
        self.step_listeners: list[Callable[[int, float], None]] = []

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> Engine:
        self.launcher.start(self.config)
        self._thread = threading.Thread(target=self._loop, name="ditserve-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        with self.scheduler.cond:
            self.scheduler.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.abort_all(RuntimeError("engine shut down"))
        self.launcher.shutdown()

    def abort_all(self, exc: BaseException, drop: bool = False) -> None:
        """Fail every queued and running request with ``exc``. Call from the loop thread (``run_control``)
        or after the loop stopped; ``drop`` also frees the running requests' rank state."""
        with self.scheduler.cond:
            pending = list(self.scheduler.pending)
            self.scheduler.pending.clear()
            running = [j for js in self.scheduler.running.values() for j in js]
        decoding, self._decoding = list(self._decoding.values()), {}
        for job in running + decoding:
            self._fail(job, exc)
            if drop:
                self._drop_quietly(job)
        for job in pending:
            self._fail_futures(job, exc)

    def abort_running(self, exc: BaseException) -> int:
        """Fail the requests whose denoising has begun with ``exc`` and free their rank state; queued ones
        and realtime chunks stay (a session's stream goes on: it holds state drawn by earlier chunks anyway;
        failing its chunk would end it). Loop thread. Returns how many were failed."""
        with self.scheduler.cond:
            running = [j for js in self.scheduler.running.values() for j in js if j.chunk is None]
        for job in running:
            self._fail(job, exc)
            self._drop_quietly(job)
        return len(running)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests ---------------------------------------------------------------------------------------
    def check(self, params: GenerationParams) -> None:
        """Model-dependent checks, done before queueing so bad input never reaches the ranks."""
        limits, spec = self.config.limits, self.spec
        multiple = spec.size_multiple
        if params.width % multiple or params.height % multiple:
            raise ValueError(
                f"size: width and height must be multiples of {multiple} for {spec.name}, "
                f"got {params.width}x{params.height}"
            )
        if spec.kind == "video" and (params.num_frames - 1) % spec.frame_multiple:
            raise ValueError(
                f"num_frames: must be {spec.frame_multiple}·k + 1 for {spec.name}, got {params.num_frames}"
            )
        family = spec.family_spec
        chunks = family.video_chunks(spec.folder, params.num_frames) if spec.kind == "video" else 1
        refused = family.refuse_size(spec.folder, params.width, params.height, chunks)
        if refused is not None:
            raise ValueError(refused)
        if params.width > limits.max_width or params.height > limits.max_height:
            raise ValueError(
                f"size: {params.width}x{params.height} is above the maximum "
                f"{limits.max_width}x{limits.max_height}"
            )
        if params.num_inference_steps > limits.max_steps:
            raise ValueError(
                f"num_inference_steps: {params.num_inference_steps} is above the maximum {limits.max_steps}"
            )
        if params.num_inference_steps < spec.min_steps:
            raise ValueError(
                f"num_inference_steps: {spec.name} needs at least {spec.min_steps} steps (its scheduler "
                f"stretches the schedule to shift_terminal; {params.num_inference_steps} step draws NaN, a black "
                "image, in diffusers' pipeline too)"
            )
        names = [ref.name for ref in params.lora]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(
                f"lora: adapter(s) {twice} given more than once; give each adapter once, with the scale wanted"
            )
        if params.lora and not spec.takes_adapters:
            raise ValueError(f"lora: {spec.name} ({spec.pipeline_class}) takes no adapters; leave lora out")
        for ref in params.lora:
            if ref.name not in self.loras or ref.name in self.draining:
                loaded = sorted(set(self.loras) - self.draining)
                raise ValueError(f"lora: adapter {ref.name!r} is not loaded; loaded: {loaded}")
        if params.n > limits.max_n:
            raise ValueError(f"n: {params.n} is above the maximum {limits.max_n}")
        refused = spec.refusal(
            params.cache, params.guidance_scale_2, params.true_cfg_scale, params.guidance_scale
        )
        if refused is not None:
            raise ValueError(refused[1])
        self.check_images(params)
        if params.init_latents is not None and not spec.family_spec.img2img:
            raise ValueError(f"init_latents: image-to-image is not supported for {spec.name}")
        if spec.kind == "video":
            first_frame = spec.first_frame
            if params.images and first_frame == "none":
                raise ValueError(
                    f"input_reference: {spec.name} is a text-to-video model and takes no reference image"
                )
            if not params.images and first_frame == "required":
                raise ValueError(
                    f"input_reference: {spec.name} is an image-to-video model; give the first frame"
                )
            if len(params.images) > 1:
                raise ValueError(f"input_reference: one first frame, got {len(params.images)} images")
            if params.images and (refused := first_frame_refusal(*image_size(params.images[0]))) is not None:
                raise ValueError(refused)  # ditserve generate's --image and gRPC as POST /v1/videos
            if params.mask is not None:
                raise ValueError(
                    f"mask: {spec.name} makes videos; a mask is image inpainting's (the first frame is kept "
                    "whole), send the video request without it"
                )
        if self.spec.kind == "video" and params.num_frames > limits.max_frames:
            raise ValueError(f"num_frames: {params.num_frames} is above the maximum {limits.max_frames}")

    def check_images(self, params: GenerationParams) -> None:
        """An image model's uploaded images (POST /v1/images/edits, ``generate --image``; decoded and sized
        at the ingress): references up to the edit model's count, one start image for image-to-image, a
        mask only where the family inpaints."""
        spec = self.spec
        family = spec.family_spec
        if spec.kind != "image":
            return
        if params.mask is not None and not spec.inpaints:
            raise ValueError(f"mask: {spec.mask_refusal()}")
        if not params.images:
            if params.mask is not None:
                raise ValueError("image: a mask needs the image it masks")
            return
        count = len(params.images)
        if spec.edits:
            if count > spec.max_references:
                raise ValueError(
                    f"image: {spec.name} takes at most {spec.max_references} reference image(s), got {count}"
                )
        elif family.img2img:
            if count > 1:
                raise ValueError(f"image: image-to-image with {spec.name} starts from one image, got {count}")
            if params.init_latents is not None:
                raise ValueError("image: give a start image or init_latents, not both")
        else:
            raise ValueError(f"image: {spec.name} takes no input images")

    def submit(
        self,
        params: GenerationParams,
        on_progress: Callable[[int, int], None] | None = None,
        on_preview: Callable[[int, int, Any], None] | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> Future:
        """Queue a request; the future resolves to a :class:`GenerationResult`. Cancel it to free the slot.

        ``on_progress(done, total)`` runs in the loop thread after every step; ``on_preview(done, total,
        grid)`` too, before the last step, with the current latents as a (height, width, channels) grid (a
        served rank's ``preview``);
        ``on_start()`` once, when the loop takes the request from the queue (its prompt and images are encoded
        after it, then its first step runs)."""
        if not self.running:
            raise RuntimeError("engine is not running")
        self.check(params)
        if params.cache is None:
            if self.default_cache is not None:
                params = params.model_copy(update={"cache": self.default_cache})
        elif (cache := params.cache.with_defaults(self.default_cache)) is not params.cache:
            params = params.model_copy(update={"cache": cache})
        bucket = (params.height, params.width, params.num_frames if self.spec.kind == "video" else 1)
        if params.images and self.spec.edits:
            # References of other sizes may give other sequence lengths: rows of one forward share one.
            bucket += tuple(image_size(data) for data in params.images)
            # A masked edit's image is its reference at the output size, not at the pipeline's own size.
            bucket += (params.mask is not None,)
        job = Job(
            req_id=uuid.uuid4().hex, params=params, bucket=bucket, on_progress=on_progress, on_start=on_start
        )
        if on_preview is not None:

            def progress_and_preview(done: int, total: int) -> None:
                if on_progress is not None:
                    on_progress(done, total)
                if done < total:  # between steps: the ranks are idle, reading latents is safe
                    on_preview(done, total, self.launcher.call("preview", job.req_id))

            job.on_progress = progress_and_preview
        self.scheduler.submit(job)
        return job.future

    # -- realtime video sessions (chunk-autoregressive families) -------------------------------------------
    def check_chunk(self, params: GenerationParams) -> None:
        """Model checks of a realtime session's chunk (``params.num_frames``: frames per chunk)."""
        spec, limits = self.spec, self.config.limits
        if not spec.family_spec.extra.get("realtime"):
            raise ValueError(f"model: {spec.name} does not generate realtime video (no chunked family)")
        multiple = spec.size_multiple
        if params.width % multiple or params.height % multiple:
            raise ValueError(
                f"size: width and height must be multiples of {multiple} for {spec.name}, "
                f"got {params.width}x{params.height}"
            )
        if params.width > limits.max_width or params.height > limits.max_height:
            raise ValueError(
                f"size: {params.width}x{params.height} is above the maximum {limits.max_width}x{limits.max_height}"
            )
        if params.num_frames % spec.frame_multiple or params.num_frames > limits.max_frames:
            raise ValueError(
                f"num_frames: frames per chunk must be a multiple of {spec.frame_multiple} up to "
                f"{limits.max_frames} for {spec.name}, got {params.num_frames}"
            )
        if params.num_inference_steps > limits.max_steps:
            raise ValueError(
                f"num_inference_steps: {params.num_inference_steps} is above the maximum {limits.max_steps}"
            )
        if params.lora:
            raise ValueError(f"lora: realtime sessions of {spec.name} take no adapters")

    def submit_chunk(
        self, session_id: str, chunk_index: int, params: GenerationParams, max_chunks: int | None
    ) -> ChunkFutures:
        """Queue chunk ``chunk_index`` of realtime session ``session_id``. The chunk joins the step loop like
        any request (its own shape bucket, so its steps take turns with image/video batches); chunks of one
        session must be submitted in order, each after the previous one is denoised (the ranks keep the
        session's state in between). Its VAE decode then runs on rank 0 beside the steps that follow (the
        next chunk's), and its frames come when decoded."""
        if not self.running:
            raise RuntimeError("engine is not running")
        self.check_chunk(params)
        bucket = ("realtime", params.height, params.width, params.num_frames)
        job = Job(
            req_id=uuid.uuid4().hex,
            params=params,
            bucket=bucket,
            chunk=(session_id, chunk_index, max_chunks),
            denoised=Future(),
        )
        self.scheduler.submit(job)
        return ChunkFutures(denoised=job.denoised, frames=job.future)

    def close_session(self, session_id: str) -> Future:
        """Free a realtime session's state on the ranks (between two steps)."""
        return self.run_control(lambda: self.launcher.call("close_session", session_id))

    def generate(self, params: GenerationParams, timeout: float | None = None) -> GenerationResult:
        return self.submit(params).result(timeout=timeout)

    def run_control(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` in the loop thread between two steps (control ops wait for the step, not the queue)."""
        fut: Future = Future()
        self._controls.put((fn, fut))
        with self.scheduler.cond:
            self.scheduler.cond.notify_all()
        return fut

    # -- adapters ------------------------------------------------------------------------------------------
    # lora_load / lora_unload / lora_list run in the loop thread (inside ``run_control``, between steps);
    # load_lora / unload_lora are the thread-safe wrappers for callers outside it (CLI, tests).
    def lora_load(
        self, name: str, source: str, scale: float = 1.0, target: str | None = None
    ) -> dict[str, Any]:
        """Load (or replace) adapter ``name`` from a local safetensors file on every rank; ``target``: the
        expert it loads into (Wan 2.2 A14B's ``transformer_2``; None: each expert's weights into that one)."""
        from .lora.loader import check_allowed

        if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"name: {name!r} must be letters, digits, '-', '_' or '.'")
        if name in self.draining:
            raise AdapterDraining(
                f"name: adapter {name!r} is still being unloaded (requests use it); retry shortly"
            )
        users = sum(any(ref.name == name for ref in j.params.lora) for j in self._jobs())
        if name in self.loras and users:
            # Its slot would change under them between two steps: an image drawn partly with each adapter.
            raise AdapterDraining(
                f"name: adapter {name!r} is used by {users} queued or running request(s); replacing it now "
                "would change their images part-way. Retry once they are done, or load it under another name"
            )
        resolved = str(check_allowed(Path(source), self.config.lora_roots))
        info = self.launcher.call("lora_load", name, resolved, float(scale), target)
        self.loras[name] = info
        return info

    def lora_unload(self, name: str) -> None:
        """Unload ``name`` now, or, while queued or running requests use it, once the last of them is done
        (it is refused to new requests from now on): an unload never fails a request that was accepted."""
        if name not in self.loras:
            raise ValueError(f"name: adapter {name!r} is not loaded; loaded: {sorted(self.loras)}")
        self.draining.add(name)
        self._unload_drained()

    def _unload_drained(self) -> None:
        """Unload the draining adapters no queued or running request uses any more (loop thread)."""
        for name in list(self.draining):
            if not any(ref.name == name for j in self._jobs() for ref in j.params.lora):
                self.launcher.call("lora_unload", name)
                self.loras.pop(name, None)
                self.draining.discard(name)

    def lora_list(self) -> list[dict[str, Any]]:
        return [dict(info) for info in self.loras.values()]

    def load_lora(
        self, name: str, source: str, scale: float = 1.0, target: str | None = None
    ) -> dict[str, Any]:
        return self.run_control(lambda: self.lora_load(name, source, scale, target)).result()

    def unload_lora(self, name: str) -> None:
        self.run_control(lambda: self.lora_unload(name)).result()

    def _jobs(self) -> list[Job]:
        return list(self.scheduler.pending) + [j for jobs in self.scheduler.running.values() for j in jobs]

    def call_ranks(self, method: str, *args: Any) -> Any:
        return self.launcher.call(method, *args)

    def stats(self) -> dict[str, Any]:
        return {
            "queue_depth": self.scheduler.queue_depth,
            "running": self.scheduler.num_running,
            "last_batch_size": self.last_batch_size,
            "steps_run": self.steps_run,
            "last_step_s": self.last_step_s,
            "step_seconds_total": self.step_seconds_total,
        }

    # -- the loop ---------------------------------------------------------------------------------------
    def _run_controls(self) -> None:
        while True:
            try:
                fn, fut = self._controls.get_nowait()
            except Empty:
                return
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._run_controls()
                for job in self.scheduler.reap_cancelled():
                    self.launcher.call("drop", job.req_id)
                if self.draining:
                    self._unload_drained()
                picked = self.scheduler.next_batch()
                if picked is None:
                    if self._decoding:
                        self._collect_decodes(DECODE_POLL_S)
                    else:
                        self.scheduler.wait_for_work(timeout=0.1)
                    continue
                self._step(*picked)
                if self._decoding:
                    self._collect_decodes(0.0)
            except Exception:
                logger.exception("engine loop error")
                time.sleep(0.05)

    def _fail(self, job: Job, exc: BaseException) -> None:
        self.scheduler.finish(job)
        self._fail_futures(job, exc)

    @staticmethod
    def _fail_futures(job: Job, exc: BaseException) -> None:
        for future in (job.denoised, job.future):
            if future is not None and not future.done():
                future.set_exception(exc)

    def _collect_decodes(self, wait_s: float) -> None:
        """Hand out the frames of the realtime chunks rank 0 finished decoding (waiting up to ``wait_s``)."""
        try:
            done = self.launcher.call("decoded", wait_s) or {}
        except Exception as exc:  # a rank died: the chunks being decoded are lost with it
            decoding, self._decoding = list(self._decoding.values()), {}
            for job in decoding:
                self._fail_futures(job, exc)
            return
        for req_id, (status, value) in done.items():
            job = self._decoding.pop(req_id, None)
            if job is None or job.future.done():
                continue
            if status == "ok":
                job.future.set_result(value[0])
            else:
                job.future.set_exception(value)

    def _step(self, admit: list[Job], running: list[Job]) -> None:
        for job in admit:
            if job.on_start is not None:
                try:
                    job.on_start()
                except Exception:
                    logger.exception("start callback failed")
            try:
                if job.chunk is not None:
                    total = self.launcher.call(
                        "add_chunk", job.req_id, *job.chunk[:2], job.params, job.chunk[2]
                    )
                else:
                    total = self.launcher.call("add", job.req_id, job.params)
                job.total_steps = total if isinstance(total, int) else None
            except Exception as exc:
                self._fail(job, exc)
                continue
            self.scheduler.start_running(job)
            running.append(job)
        if not running:
            return
        t0 = time.perf_counter()
        try:
            progress = self.launcher.call("step", [j.req_id for j in running])
        except Exception as exc:
            for job in running:
                self._fail(job, exc)
                self._drop_quietly(job)
            return
        self.steps_run += 1
        self.last_batch_size = len(running)
        step_s = time.perf_counter() - t0
        self.last_step_s = step_s
        self.step_seconds_total += step_s
        for listener in self.step_listeners:
            try:
                listener(len(running), step_s)
            except Exception:
                logger.exception("step listener failed")
        for job in running:
            job.steps_done = progress[job.req_id]
            total = job.total_steps or job.params.num_inference_steps
            if job.on_progress is not None:
                try:
                    job.on_progress(job.steps_done, total)
                except Exception:
                    logger.exception("progress callback failed")
            if job.steps_done >= total:
                self._complete(job, step_s)

    def _drop_quietly(self, job: Job) -> None:
        try:
            self.launcher.call("drop", job.req_id)
        except Exception:
            logger.exception("drop failed")

    def _complete(self, job: Job, step_s: float) -> None:
        self.scheduler.finish(job)
        if job.chunk is not None:  # a realtime chunk: decoded beside the next steps, its frames unencoded
            try:
                self.launcher.call("finish_chunk", job.req_id)
            except Exception as exc:
                self._fail_futures(job, exc)
                return
            self._decoding[job.req_id] = job
            if not job.denoised.done():
                job.denoised.set_result(None)
            return
        try:
            p = job.params
            # ``latents`` before ``finish``: finish forgets the request's state.
            latents = self.launcher.call("latents", job.req_id) if p.return_latents else None
            finished = self.launcher.call("finish", job.req_id)
            pixels = finished["pixels"]
            if self.spec.kind == "video":
                outputs, media = [encode_mp4(v, fps=p.fps) for v in pixels], "video/mp4"
            else:
                outputs, media = [encode_png(img) for img in pixels], "image/png"
            result = GenerationResult(
                outputs=outputs,
                media_type=media,
                seed=p.seed,
                width=p.width,
                height=p.height,
                num_frames=p.num_frames if self.spec.kind == "video" else 1,
                timings={"last_step_s": step_s},
                latents=latents,
                usage={**finished["usage"], "cache_policy": p.cache.policy if p.cache else "none"},
            )
        except Exception as exc:
            if not job.future.done():
                job.future.set_exception(exc)
            return
        if not job.future.done():
            job.future.set_result(result)
