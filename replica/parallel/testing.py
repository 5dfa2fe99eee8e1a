"""Helpers to run code on N local ranks (gloo on CPU) and to enumerate legal layouts.

Used by tests/distributed and reusable by the engine's local launcher checks: each rank process
initialises a process group with a timeout, runs `fn(rank, world_size, *args)` and sends back what it
returns (or its traceback). The ranks are forked from one spawned process that imported what they share.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .dims import ParallelDims


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _to_bytes(value: Any) -> bytes:
    """``value`` serialised with its tensors' data inline. Put on the queue as they are, tensors travel as
    shared-memory file descriptors that the parent fetches from this process after it got the message, and a
    rank that has exited by then resets the connection (ConnectionResetError in the parent)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _entry(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    try:
        torch.set_num_threads(1)  # N ranks on a few cores: avoid oversubscription
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            results.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


def _fork_ranks(
    world_size: int, port: int, timeout_s: float, fn: Callable[..., Any], args: tuple, results
) -> None:
    """The spawned parent of the ranks: it has imported torch and ``fn``'s module (unpickling ``fn``), and
    forks every rank from there, so each starts without importing them again (seconds per rank on a few
    cores). Nothing here has run torch yet, so no thread pool is forked. The ranks share its process group,
    which the caller kills if they do not end."""
    os.setpgid(0, 0)
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            try:
                _entry(rank, world_size, port, timeout_s, fn, args, results)  # reports every failure
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    join_timeout_s: float = 600.0,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results.

    `fn` must be importable (module level) because the ranks' parent is started with the spawn method.
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    parent = ctx.Process(
        target=_fork_ranks, args=(world_size, port, timeout_s, fn, args, results), daemon=True
    )
    parent.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(world_size):
        rank, ok, value = results.get()
        if ok:
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
            break  # the others will time out or fail too; do not wait for them
    parent.join(timeout=5 if errors else join_timeout_s)
    if parent.is_alive():
        try:
            os.killpg(parent.pid, signal.SIGKILL)  # the ranks too: one process group
        except ProcessLookupError:
            parent.kill()
        parent.join()
    if errors:
        raise RuntimeError("distributed run failed\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]


def legal_layouts(
    max_world_size: int, *, num_heads: int, cfg_sizes: tuple[int, ...] = (1, 2)
) -> Iterator[ParallelDims]:
    """Every ParallelDims with world size ≤ max_world_size that passes `validate(num_heads=...)`."""
    for cfg in cfg_sizes:
        for tp in range(1, max_world_size + 1):
            for ulysses in range(1, max_world_size + 1):
                for slot in range(1, max_world_size + 1):
                    for kind in ("ring", "kv_gather"):
                        if slot == 1 and kind == "kv_gather":
                            continue  # slot 1 is listed once, as ring 1
                        dims = ParallelDims(cfg=cfg, tp=tp, ulysses=ulysses, **{kind: slot})
                        if dims.world_size > max_world_size:
                            continue
                        try:
                            dims.validate(num_heads=num_heads)
                        except ValueError:
                            continue
                        yield dims
