"""Rank launchers: how an engine replica's ranks are started and commanded.

A launcher starts ``world_size`` :class:`RankWorker` s and sends each command to all of them (SPMD),
returning rank 0's answer. Implementations: in-process (one rank), local processes (``ditserve generate``
and tests), and Ray actors in the replica's placement group (``ditserve.cluster.ranks``, which is the only
place that knows Ray).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import socket
import threading
import time
import traceback
from abc import ABC, abstractmethod
from typing import Any

from .config import EngineConfig


class RankError(RuntimeError):
    """A rank failed a command; carries the remote traceback text."""


class RankDied(RankError):
    """A rank process is gone: the replica cannot run another step (its peers may be stuck in a collective).

    Raised as soon as the death is seen, without waiting for the surviving ranks' answers."""


class RankLauncher(ABC):
    world_size: int
    # Ranks seen dead (by a command or a liveness probe); once non-empty the launcher is unusable.
    dead: list[int]

    def dead_ranks(self, timeout_s: float = 5.0) -> list[int]:
        """Probe every rank without waiting for a running command; the ranks whose process is gone."""
        return list(getattr(self, "dead", []))

    @abstractmethod
    def start(self, config: EngineConfig) -> None: ...

    @abstractmethod
    def call(self, method: str, *args: Any) -> Any:
        """Run ``worker.method(*args)`` on every rank; return rank 0's result (raise if any rank failed)."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InProcessLauncher(RankLauncher):
    """One rank, in the caller's process: no process group, no pickling."""

    world_size = 1
    dead: list[int] = []  # the rank is this process: while it answers, it is alive

    def __init__(self, pipe=None):
        self.pipe = pipe  # an in-memory pipeline (benchmarks); None loads the model folder

    def start(self, config: EngineConfig) -> None:
        from .worker import RankWorker

        self.worker = RankWorker(config, pipe=self.pipe)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def shutdown(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.shutdown()
            self.worker = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _rank_main(conn, config: EngineConfig, rank: int, world_size: int, init_method: str) -> None:
    """Entry of a local rank process: build the worker, then serve commands until told to stop."""
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    try:
        from .worker import RankWorker

        worker = RankWorker(config, rank=rank, world_size=world_size, init_method=init_method)
        conn.send(("ok", None))
    except BaseException as exc:  # report start failures instead of hanging the driver
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        if method == "__exit__":
            worker.shutdown()
            conn.send(("ok", None))
            break
        try:
            result = getattr(worker, method)(*args)
            conn.send(("ok", result if rank == 0 else None))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# Rank processes fork from one fork server per process that imported torch, diffusers and the first model's
# pipeline once: each rank then starts without paying those imports again (seconds per rank, more when the
# ranks of a replica import at once on few cores). The server's environment and imports are fixed when it
# starts, so a launch from a different environment (a changed variable) spawns fresh interpreters instead.
_FORK_SERVER: dict[str, Any] = {}
_IGNORED_ENV = ("PYTEST_CURRENT_TEST",)


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _IGNORED_ENV}


def _preload(config: EngineConfig) -> list[str]:
    """Modules a rank of ``config`` imports: the worker, the family's runner and plan, the pipeline's module."""
    modules = [f"{__package__}.worker"]
    try:
        from .models.registry import resolve_model

        spec = resolve_model(config.model)
        family = spec.family_spec
        for attr in ("runner", "plan"):
            target = getattr(family, attr, None)
            if target:
                modules.append(f"{__package__}.{target.split(':')[0]}")
        import diffusers

        modules.append(getattr(diffusers, spec.pipeline_class).__module__)
    except Exception:  # noqa: BLE001 - a preload is an optimisation; the rank reports real errors itself
        pass
    return modules


def rank_context(config: EngineConfig):
    """The multiprocessing context to start ``config``'s ranks with: the fork server when this process's
    environment is the one it started with, else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    if not _FORK_SERVER:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_preload(config))
        _FORK_SERVER["env"] = _environment()
        return ctx
    if _FORK_SERVER["env"] == _environment():
        return mp.get_context("forkserver")
    return mp.get_context("spawn")


class LocalProcessLauncher(RankLauncher):
    """``world_size`` local processes, gloo on CPU, NCCL on GPUs, rendezvous on localhost."""

    def __init__(self, world_size: int, start_timeout_s: float = 300.0):
        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._procs: list[mp.Process] = []
        self._conns = []
        self.dead: list[int] = []

    def start(self, config: EngineConfig) -> None:
        ctx = rank_context(config)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(child, config, rank, self.world_size, init_method), daemon=True
            )
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self._gather("start", timeout=self.start_timeout_s)

    def _gather(self, what: str, timeout: float | None = None) -> Any:
        """Every rank's answer to ``what``; a rank whose process exits fails the call at once (its peers
        may wait in a collective for it until their timeout, so they are not waited for)."""
        answers: dict[int, tuple[str, Any]] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        deadline = None if timeout is None else time.monotonic() + timeout
        while waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp_connection.wait([*waiting, *sentinels], timeout=left)
            if not ready:
                late = sorted(waiting.values())
                raise RankError(f"ranks {late}: no answer to {what} within {timeout:.0f}s")
            for conn in [obj for obj in ready if obj in waiting]:
                self._receive(conn, waiting, answers)
            for sentinel in [obj for obj in ready if obj in sentinels]:
                rank = sentinels.pop(sentinel)
                conn = self._conns[rank]
                if conn in waiting and conn.poll():  # it answered, then exited (a start failure)
                    self._receive(conn, waiting, answers)
                if rank not in answers:
                    self.dead.append(rank)
                    code = self._procs[rank].exitcode
                    raise RankDied(f"rank {rank}: process exited (code {code}) during {what}")
        silent = [rank for rank in range(len(self._conns)) if rank not in answers]
        if silent:
            self.dead += silent
            raise RankDied(f"ranks {silent}: process exited during {what}")
        errors = [
            f"rank {rank}: {value}" for rank, (status, value) in sorted(answers.items()) if status != "ok"
        ]
        if errors:
            raise RankError("\n".join(errors))
        return answers[0][1]

    @staticmethod
    def _receive(conn, waiting: dict, answers: dict[int, tuple[str, Any]]) -> None:
        rank = waiting.pop(conn)
        try:
            answers[rank] = conn.recv()
        except EOFError:
            pass  # the process exited without answering: counted dead below

    def dead_ranks(self, timeout_s: float = 5.0) -> list[int]:
        self.dead += [r for r, p in enumerate(self._procs) if p.exitcode is not None and r not in self.dead]
        return list(self.dead)

    def call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self.dead:
                raise RankDied(f"ranks {self.dead} are gone; this replica cannot run {method}")
            for conn in self._conns:
                try:
                    conn.send((method, args))
                except (BrokenPipeError, OSError):
                    pass  # a dead rank: _gather sees its process exit
            return self._gather(method)

    def shutdown(self) -> None:
        with self._lock:
            for conn in self._conns:
                try:
                    conn.send(("__exit__", ()))
                except (BrokenPipeError, OSError):
                    pass
            for proc in self._procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
            self._procs, self._conns = [], []


def default_launcher(world_size: int) -> RankLauncher:
    return InProcessLauncher() if world_size == 1 else LocalProcessLauncher(world_size)
