"""The engine replica as a Ray Serve deployment: one :class:`Engine` per Serve replica.

Besides generation, a replica holds its realtime sessions (their last latents) and applies control
operations. Control state converges to the desired state kept by the app's state actor
(``control_state``): at start, in the constructor, before Serve routes anything here; after every
control op; and in the health check, which catches up a replica that missed a broadcast.

Errors cross the handle as values (typed, ``errors.py``): a refused request is an answer, not a Ray task
failure; the frontend and the gRPC service own the mapping to HTTP/gRPC codes.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray import serve

from ditserve.replica.engine import AdapterDraining, Engine
from ditserve.replica.launcher import RankDied, RankError
from ditserve.replica.request import GenerationParams

from .config import APP_NAME, AppArgs
from .control_state import get_or_create_state_actor, initial_state, lora_spec, parse_lora_paths
from .errors import (
    BadRequest,
    Contended,
    InternalError,
    NotFound,
    QueueFull,
    ReplicaUnavailable,
    ServeError,
    Unsupported,
    engine_error,
    param_of,
)
from .metrics import ReplicaMetrics
from .ranks import build_launcher, node_info
from .replica_realtime import ReplicaRealtime
from .replica_streams import ReplicaStreams

logger = logging.getLogger("ditserve")


def _rank_value_error(exc: BaseException) -> str | None:
    """The ``ValueError`` message a rank raised (bad input every rank saw: an adapter of the wrong shapes),
    out of the ranks' joined tracebacks; None for other failures."""
    if not isinstance(exc, RankError) or isinstance(exc, RankDied):
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip().startswith("ValueError: ")]
    return lines[-1].removeprefix("ValueError: ") if lines else None


def _control_error(exc: BaseException) -> ServeError:
    """A failed control op as the typed error the frontend passes on (the message names the exception,
    except for bad input, whose message names the field)."""
    if isinstance(exc, AdapterDraining):  # not bad input: the same request succeeds in a moment
        return Contended(str(exc), param=param_of(str(exc)))
    message = _rank_value_error(exc) or (str(exc) if isinstance(exc, ValueError) else None)
    if message is not None:
        return BadRequest(message, param=param_of(message))
    described = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, NotImplementedError):
        return Unsupported(described)
    if isinstance(exc, ReplicaUnavailable):
        return ReplicaUnavailable(described)
    return InternalError(described)


@dataclass(eq=False)
class Session:
    session_id: str
    width: int
    height: int
    latents: np.ndarray | None = None
    steps: int = 0
    last_used: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set once the session is dropped (closed, expired, its replica shut down); ``ended`` says why.
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    ended: str = ""
    # The watch (``session_ended``) of the WebSocket streaming this session, set when a newer socket takes
    # the session over: one socket per session, so open sockets hold at most one call per session here.
    watch: asyncio.Event | None = None


class EngineReplica(ReplicaStreams, ReplicaRealtime):
    """Serve replica wrapping one engine; its ranks start in the constructor (inside the placement group).

    ``engine_cls`` is injectable (Ray LLM's ``engine_cls`` pattern) so benchmarks can drive the real
    router and frontend with a small engine; it is built as ``engine_cls(config, launcher=...)``.
    """

    def __init__(self, args: dict[str, Any], engine_cls: type = Engine, deploy_id: str = "local"):
        self.args = AppArgs(**args)
        self.config = self.args.engine_config()
        try:
            ctx = serve.get_replica_context()
            self.replica_id, self.app_name = ctx.replica_id.unique_id, ctx.app_name
        except Exception:  # constructed outside Serve (tools)
            self.replica_id, self.app_name = "local", APP_NAME
        self.launcher = build_launcher(self.config, self.args.replica_num_cpus)
        self.engine = engine_cls(self.config, launcher=self.launcher)
        self.node = node_info()
        self.sessions: dict[str, Session] = {}
        self.shut_down = False
        self.released = False
        self.applied = initial_state()
        self.refused: dict[str, str] = {}  # desired-state items this replica could not apply, and why
        self._staged_tag: str | None = None
        # Catch up with the desired control state before Serve marks this replica ready.
        self.state_actor = get_or_create_state_actor(
            self.app_name, deploy_id, initial_state(parse_lora_paths(self.args.lora_path))
        )
        desired = ray.get(self.state_actor.get.remote())
        if desired.get("shutdown"):
            # The app was shut down before this replica started (Serve replaced one): stay so, without
            # starting the ranks and loading the model, which would hold the devices only to be stopped.
            self._shut_down()
        else:
            self.engine.start()
            if desired["version"] > self.applied["version"]:
                self.engine.run_control(lambda: self._apply(desired)).result()
                self._check_start_adapters(desired)
        self.metrics = ReplicaMetrics(self.replica_id, self.engine.spec.name, self.args.max_loras)
        getattr(self.engine, "step_listeners", []).append(self.metrics.observe_step)
        self.metrics.start(self.engine, self)
        logger.info("replica %s ready at control version %d", self.replica_id, self.applied["version"])

    # -- identity -----------------------------------------------------------------------------------------
    def record_replica_metadata(self) -> dict[str, Any]:
        """Published once through Serve (routers see it as ``RunningReplica.replica_metadata``)."""
        dims = self.config.parallel.dims()
        return {
            "replica_id": self.replica_id,
            **self.node,
            "ranks": getattr(self.launcher, "ranks", []),
            "layout": {
                "world_size": dims.world_size,
                "cfg": self.config.parallel.cfg_parallel_size,
                "tp": self.config.parallel.tp_size,
                "ulysses": self.config.parallel.ulysses_degree,
                "ring": self.config.parallel.ring_degree,
                "kv_gather": self.config.parallel.kv_gather_degree,
            },
            "device": self.config.device,
        }

    def health(self) -> str:
        if self.shut_down:
            return "shutdown"
        if self.launcher.dead:
            return "rank_failed"
        if not self.engine.running:
            return "engine_stopped"
        return "released" if self.released else "ok"

    async def describe(self) -> dict[str, Any]:
        self._expire_sessions()
        return {
            **self.record_replica_metadata(),
            "health": self.health(),
            "control_version": self.applied["version"],
            "control_state": self.applied,
            "refused": self.refused,
            "sessions": len(self.sessions),
            "realtime_sessions": len(self.realtime),
            "stats": self.engine.stats(),
        }

    async def info(self) -> dict[str, Any]:
        spec = self.engine.spec
        return {
            "replica_id": self.replica_id,
            "model": spec.name,
            "kind": spec.kind,
            "family": spec.family,
            "world_size": self.engine.world_size,
            "stats": self.engine.stats(),
        }

    async def check_health(self) -> None:
        if self.shut_down:
            return  # stopped on purpose: Serve must not restart it
        if not self.engine.running:
            raise RuntimeError("engine loop is not running")
        # A dead rank leaves the replica unable to step (its peers may sit in a collective): unhealthy, so
        # Serve replaces it (its rank actors end with it) and the replacement converges to the desired state.
        dead = await asyncio.to_thread(self.launcher.dead_ranks)
        if dead:
            raise RuntimeError(f"ranks {dead} of this replica are gone")
        self._expire_sessions()
        try:
            desired = await self.state_actor.get.remote()
        except Exception:  # the app is being deleted: nothing to converge to
            return
        if desired.get("shutdown"):
            await asyncio.to_thread(self._shut_down)  # missed the broadcast (e.g. starting at the time)
        elif desired["version"] > self.applied["version"]:
            await self._converge(desired)

    # -- generation ---------------------------------------------------------------------------------------
    def _rank_failed(self, exc: BaseException | None = None) -> ReplicaUnavailable:
        detail = f" ({str(exc).splitlines()[0]})" if exc is not None else ""
        return ReplicaUnavailable(
            f"replica {self.replica_id} lost a rank{detail} and is being replaced; retry the request",
            retry_after=1,
            replica=self.replica_id,
        )

    def _unavailable(self) -> ReplicaUnavailable | None:
        if self.shut_down:
            return ReplicaUnavailable("replica is shut down", replica=self.replica_id)
        if self.launcher.dead:
            return self._rank_failed()
        if self.released:
            return ReplicaUnavailable(
                "replica memory is released; POST /v1/admin/memory/resume first", replica=self.replica_id
            )
        return None

    async def _run(self, params: GenerationParams) -> dict[str, Any] | ServeError:
        unavailable = self._unavailable()
        if unavailable is not None:
            return unavailable
        try:
            future = self.engine.submit(params)
        except Exception as exc:
            refused = engine_error(exc, self.replica_id)
            if refused is None:
                raise
            return refused
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # the client went away: free the slot at the next step
            raise
        except (ValueError, ServeError) as exc:  # bad input the engine found, or released memory
            return engine_error(exc, self.replica_id)
        except RankDied as exc:
            return self._rank_failed(exc)
        except RankError as exc:
            if self.launcher.dead:
                return self._rank_failed(exc)
            raise
        self.metrics.observe_usage(result.usage)
        return {"replica": self.replica_id, "result": result}

    async def generate(self, params: GenerationParams) -> dict[str, Any] | ServeError:
        t0 = time.perf_counter()
        answer = await self._run(params)
        status = type(answer).__name__ if isinstance(answer, ServeError) else "ok"
        self.metrics.observe_request(time.perf_counter() - t0, status)
        return answer

    # -- realtime sessions --------------------------------------------------------------------------------
    def _expire_sessions(self) -> None:
        now = time.monotonic()
        deadline, born = now - self.args.session_idle_timeout_s, now - self.args.session_max_lifetime_s
        for sid in [
            s.session_id for s in self.sessions.values() if s.last_used < deadline or s.created < born
        ]:
            session = self.sessions[sid]
            if not session.lock.locked():
                self._drop_session(sid, "lifetime" if session.created < born else "idle")
        self._expire_realtime()

    def _drop_session(self, session_id: str, why: str) -> Session | None:
        """Remove a session and wake whoever waits for its end (``session_ended``: a WebSocket)."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.ended = why
            session.gone.set()
        return session

    def _session_missing(self, session_id: str) -> NotFound:
        return NotFound(
            f"session_id: session {session_id!r} does not exist (closed or expired)",
            param="session_id",
            replica=self.replica_id,
        )

    async def open_session(self, width: int, height: int) -> dict[str, Any] | ServeError:
        unavailable = self._unavailable()
        if unavailable is not None:
            return unavailable
        self._expire_sessions()
        if len(self.sessions) >= self.args.max_sessions_per_replica:
            return QueueFull(
                f"max_sessions_per_replica: this replica holds {len(self.sessions)} sessions, its maximum; "
                "close one or retry later",
                param="max_sessions_per_replica",
                retry_after=5,
                replica=self.replica_id,
            )
        session = Session(f"{self.replica_id}.{secrets.token_hex(16)}", width=width, height=height)
        self.sessions[session.session_id] = session
        return {"replica": self.replica_id, "session_id": session.session_id}

    async def session_generate(
        self, session_id: str, params: GenerationParams, strength: float
    ) -> dict[str, Any] | ServeError:
        """One step of a session: refine its last image with ``params.prompt`` (the first step: txt2img)."""
        self._expire_sessions()
        session = self.sessions.get(session_id)
        if session is None:
            return self._session_missing(session_id)
        async with session.lock:  # steps of one session run in order, each from the previous latents
            if self.sessions.get(session_id) is not session:  # closed while this step waited for the last
                return self._session_missing(session_id)
            session.last_used = time.monotonic()
            update = {"width": session.width, "height": session.height, "return_latents": True, "n": 1}
            if session.latents is not None:
                update |= {"init_latents": session.latents, "strength": strength}
            answer = await self._run(params.model_copy(update=update))
            session.last_used = time.monotonic()
            if isinstance(answer, ServeError):
                return answer
            result = answer["result"]
            session.latents, result.latents = result.latents, None
            session.steps += 1
            return answer | {"step": session.steps, "session_id": session_id}

    async def close_session(self, session_id: str) -> dict[str, Any] | ServeError:
        if self._drop_session(session_id, "closed") is None:
            return self._session_missing(session_id)
        return {"replica": self.replica_id, "session_id": session_id, "closed": True}

    # -- control ------------------------------------------------------------------------------------------
    async def control(self, op: dict[str, Any]) -> dict[str, Any]:
        """Broadcast target: run one control op; always answers with this replica's id."""
        answer = {"replica": self.replica_id, "op": op["op"]}
        try:
            result = await self._dispatch(op)
        except Exception as exc:
            logger.exception("control op %s failed", op["op"])
            return answer | {
                "ok": False,
                "error": _control_error(exc),
                "version": self.applied["version"],
            }
        return answer | {"ok": True, "result": result, "version": self.applied["version"]}

    async def _dispatch(self, op: dict[str, Any]) -> Any:
        kind = op["op"]
        if kind == "shutdown":
            for session_id in list(self.sessions):  # on this loop: their waiters hear of it
                self._drop_session(session_id, "closed")
            await asyncio.to_thread(self._shut_down)
            return "shut down"
        if self.shut_down:  # its engine loop is gone: an op waiting for it would never be answered
            raise ReplicaUnavailable("replica is shut down")
        if kind == "converge":
            return await self._converge(op["state"])
        if kind == "stage_weights":
            return await self._on_loop(lambda: self._stage_weights(op["path"], op["tag"]))
        if kind == "discard_weights":
            return await self._on_loop(self._discard_weights)
        if kind == "lora_load":  # prepare phase of a LoRA load: load it here now, record it after
            return await self._on_loop(
                lambda: self._lora_load(op["name"], op["source"], op["scale"], op.get("target"))
            )
        if kind == "lora_unload":
            return await self._on_loop(lambda: self._lora_unload(op["name"]))
        if kind == "lora_list":
            return await self._on_loop(lambda: self._lora_engine("lora_list")())
        raise ValueError(f"op: unknown control op {kind!r}")

    def _shut_down(self) -> None:
        self.shut_down = True
        self.applied["shutdown"] = True
        self.sessions.clear()
        if getattr(self.engine, "running", True):
            # The requests in flight end as the ones that come later are answered (503, shut down), not with
            # the engine's RuntimeError (a 500 "see the server log", a realtime session's internal error).
            stopped = ReplicaUnavailable("replica is shut down", replica=self.replica_id)
            try:
                self.engine.run_control(lambda: self.engine.abort_all(stopped)).result(timeout=60)
            except TimeoutError:  # a step that does not end: shutdown() below stops the loop anyway
                logger.warning("replica %s: in-flight requests not failed before shutdown", self.replica_id)
        self.engine.shutdown()

    async def _on_loop(self, fn) -> Any:
        """Run ``fn`` in the engine loop between two steps (waits for the current step, not the queue)."""
        return await asyncio.wrap_future(self.engine.run_control(fn))

    async def _converge(self, desired: dict[str, Any]) -> dict[str, Any]:
        await self._on_loop(lambda: self._apply(desired))
        if self.released and self.realtime:  # their ranks' state was freed: a resume starts with free slots
            self.realtime.clear()
            self._realtime_count()
        return {"version": self.applied["version"], "refused": dict(self.refused)}

    def _apply(self, desired: dict[str, Any]) -> None:
        """Move this replica to ``desired`` (loop thread). Older or equal versions are no-ops."""
        if desired["version"] <= self.applied["version"]:
            return
        applied = self.applied
        weights = desired["weights"]
        self.refused = {}
        if weights["version"] != applied["weights"]["version"] and weights["path"] is not None:
            try:
                if self._staged_tag != weights["tag"]:
                    self._stage_weights(weights["path"], weights["tag"])
                self.engine.call_ranks("commit_weights", weights["tag"])
                applied["weights"] = copy.deepcopy(weights)
                # A request part-way through its steps would finish on the new weights: an image drawn
                # partly with each. It ends with a retryable 503 instead; queued ones run on the new ones.
                self.engine.abort_running(
                    ReplicaUnavailable(
                        f"the served weights were replaced (POST /v1/admin/weights, {weights['path']}) "
                        "while this request was running; retry it",
                        retry_after=1,
                        replica=self.replica_id,
                    )
                )
            except RankDied:
                raise  # a lost rank is the replica's failure, not the item's
            except Exception as exc:  # keep serving the current weights
                self._refuse("weights", exc)
            self._staged_tag = None
        for name in [n for n in applied["loras"] if n not in desired["loras"]]:
            self._lora_unload(name)
        for name, spec in desired["loras"].items():
            if applied["loras"].get(name) != spec:
                try:
                    self._lora_load(name, spec["source"], spec["scale"], spec.get("target"))
                except RankDied:
                    raise
                except Exception as exc:  # e.g. the file is gone from a shared volume: serve the rest
                    self._refuse(f"lora:{name}", exc)
        if desired["memory"] != applied["memory"]:
            if desired["memory"] == "released":
                self.released = True
                self.engine.abort_all(ReplicaUnavailable("replica memory was released"), drop=True)
                # Realtime sessions end here (their chunks were just failed): their state on the ranks (K/V
                # caches on the device) is freed with the weights, their slots in ``_converge``.
                for session_id in list(self.realtime):
                    self.engine.call_ranks("close_session", session_id)
                self.engine.call_ranks("release_memory")
            else:
                self.engine.call_ranks("resume_memory")
                self.released = False
            applied["memory"] = desired["memory"]
        applied["version"] = desired["version"]

    def _check_start_adapters(self, desired: dict[str, Any]) -> None:
        """The deploy's own adapters (``--lora-path``) are its configuration: while no replica of this deploy
        has loaded them all yet, one this replica refuses fails its start with a ValueError naming the entry
        (``ditserve serve`` exits 2 with it, from Serve's status), instead of serving without the adapter.
        Once a replica has, a refusal is this replica's (a file gone from a shared volume, say): reported
        like any other item of the desired state, never a crash loop of the replicas Serve restarts."""
        start = parse_lora_paths(self.args.lora_path)
        refused = [
            (name, spec["source"], self.refused[f"lora:{name}"])
            for name, spec in start.items()
            if f"lora:{name}" in self.refused and desired["loras"].get(name) == spec
        ]
        if not refused:
            if start:
                ray.get(self.state_actor.confirm_start.remote())
            return
        if ray.get(self.state_actor.start_confirmed.remote()):
            return
        self.engine.shutdown()
        name, source, reason = refused[0]
        reason = reason.removeprefix("ValueError: ").removeprefix("path: ")
        raise ValueError(f"--lora-path {name}={source}: {reason}")

    def _refuse(self, item: str, exc: Exception) -> None:
        """An item of the desired state this replica cannot apply: reported (``/v1/replicas`` with the admin
        key, the converge answer), never a reason to fail the constructor and crash-loop (but for the deploy's
        own adapters before any replica loaded them: ``_check_start_adapters``)."""
        self.refused[item] = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        logger.error(
            "replica %s refuses %s of the desired state: %s", self.replica_id, item, self.refused[item]
        )

    def _stage_weights(self, path: str, tag: str) -> dict[str, Any]:
        """Load new weights on every rank next to the current ones; any rank failing discards all."""
        try:
            self.engine.call_ranks("stage_weights", path, tag)
        except Exception as exc:
            self._discard_weights()
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            message = message.removeprefix("ValueError: ")
            if message.startswith(f"path: {path}"):  # the ranks' own words on the folder (NaN weights, say)
                raise ValueError(message) from exc
            raise ValueError(f"path: could not load weights from {path}: {message}") from exc
        self._staged_tag = tag
        return {"staged": tag}

    def _discard_weights(self) -> None:
        self._staged_tag = None
        self.engine.call_ranks("discard_weights")

    # LoRA: the adapter engine attaches ``lora_load(name, source, scale)``, ``lora_unload(name)`` and
    # ``lora_list()`` to Engine; until then these ops answer 501.
    def _lora_engine(self, method: str):
        fn = getattr(self.engine, method, None)
        if fn is None:
            raise NotImplementedError(f"LoRA adapters are not available in this build (Engine.{method})")
        return fn

    def _lora_load(self, name: str, source: str, scale: float, target: str | None = None) -> Any:
        result = self._lora_engine("lora_load")(name, source, scale, target)
        self.applied["loras"][name] = lora_spec(source, scale, target)
        return result

    def _lora_unload(self, name: str) -> Any:
        result = self._lora_engine("lora_unload")(name)
        self.applied["loras"].pop(name, None)
        return result

    def __del__(self):
        if getattr(self, "metrics", None) is not None:
            self.metrics.stop()
        engine = getattr(self, "engine", None)
        if engine is not None and not getattr(self, "shut_down", False):
            engine.shutdown()


def new_tag() -> str:
    return uuid.uuid4().hex[:12]
