"""Step-level continuous batching: which requests run the next denoising step.

Requests are grouped into shape buckets (model, height, width, frames): only requests of one bucket can
share a transformer forward. Each step, one bucket's running batch advances by one step; new requests of
that bucket join at the boundary (up to ``max_batch_size``), finished ones leave. Buckets take turns
round-robin, so a bucket never starves behind a busy one. Pure Python: no torch, unit-testable.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class QueueFullError(RuntimeError):
    """The bounded queue is full; the ingress answers 429 with Retry-After."""

    def __init__(self, max_queue: int, retry_after_s: float = 1.0):
        super().__init__(f"queue full ({max_queue} requests waiting); retry later")
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Job:
    req_id: str
    params: Any
    bucket: tuple
    future: Future = field(default_factory=Future)
    on_progress: Callable[[int, int], None] | None = None
    on_start: Callable[[], None] | None = None  # when the loop admits it, before its inputs are encoded
    steps_done: int = 0
    admitted: bool = False
    total_steps: int | None = None  # what the ranks said at admission (a chunked video: chunks × steps)
    # A realtime video chunk: (session id, chunk index, the session's chunk count or None when endless).
    chunk: tuple[str, int, int | None] | None = None
    # A realtime chunk's second future: resolved when its steps are done (its frames decode after that,
    # while the session's next chunk may already run).
    denoised: Future | None = None

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()


class StepScheduler:
    def __init__(self, max_batch_size: int, max_queue: int):
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.pending: deque[Job] = deque()
        self.running: dict[tuple, list[Job]] = {}
        self._turn: deque[tuple] = deque()  # bucket order for round-robin
        self.cond = threading.Condition()

    # -- producer side ----------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.pending) >= self.max_queue:
                raise QueueFullError(self.max_queue)
            self.pending.append(job)
            if job.bucket not in self._turn:
                self._turn.append(job.bucket)
            self.cond.notify_all()

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    @property
    def num_running(self) -> int:
        return sum(len(v) for v in self.running.values())

    # -- consumer side (the engine loop) ----------------------------------------------------------------
    def reap_cancelled(self) -> list[Job]:
        """Remove cancelled jobs; returns the admitted ones (their rank state must be dropped)."""
        with self.cond:
            dropped = [j for j in self.pending if j.cancelled]
            self.pending = deque(j for j in self.pending if not j.cancelled)
            for bucket, jobs in list(self.running.items()):
                dropped += [j for j in jobs if j.cancelled]
                self.running[bucket] = [j for j in jobs if not j.cancelled]
            self._forget_idle()
            return [j for j in dropped if j.admitted]

    def next_batch(self) -> tuple[list[Job], list[Job]] | None:
        """Pick the next bucket in turn; returns (jobs to admit now, jobs already running) or None."""
        with self.cond:
            self._forget_idle()
            if not self._turn:
                return None
            bucket = self._turn[0]
            self._turn.rotate(-1)
            running = self.running.setdefault(bucket, [])
            room = self.max_batch_size - len(running)
            admit = []
            for job in list(self.pending):
                if room <= 0:
                    break
                if job.bucket == bucket:
                    self.pending.remove(job)
                    admit.append(job)
                    room -= 1
            return admit, list(running)

    def start_running(self, job: Job) -> None:
        with self.cond:
            job.admitted = True
            self.running.setdefault(job.bucket, []).append(job)

    def finish(self, job: Job) -> None:
        with self.cond:
            jobs = self.running.get(job.bucket, [])
            if job in jobs:
                jobs.remove(job)
            self._forget_idle()

    def wait_for_work(self, timeout: float) -> None:
        with self.cond:
            if not self.pending and not self.num_running:
                self.cond.wait(timeout)

    def _forget_idle(self) -> None:
        busy = {j.bucket for j in self.pending} | {b for b, jobs in self.running.items() if jobs}
        for bucket in list(self._turn):
            if bucket not in busy:
                self._turn.remove(bucket)
                self.running.pop(bucket, None)
