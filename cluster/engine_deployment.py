"""The engine replica as a Ray Serve deployment: one :class:`Engine` per Serve replica."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from ditserve.replica.engine import Engine
from ditserve.replica.request import GenerationParams
from ditserve.replica.scheduler import QueueFullError

from .config import AppArgs

logger = logging.getLogger("ditserve")


def error_dict(status: int, message: str, param: str | None = None, **extra: Any) -> dict[str, Any]:
    """Errors cross the handle as data: the frontend owns the mapping to HTTP/gRPC codes."""
    return {"error": {"status": status, "message": message, "param": param, **extra}}


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0].strip()
    return head if head.isidentifier() else None


class EngineReplica:
    """Serve replica wrapping one engine (its ranks are started in the constructor)."""

    def __init__(self, args: dict[str, Any]):
        self.args = AppArgs(**args)
        self.config = self.args.engine_config()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (tests, tools)
            self.replica_id = "local"
        self.engine = Engine(self.config).start()
        logger.info("replica %s ready: %s", self.replica_id, self.engine.spec)

    async def generate(self, params: GenerationParams) -> dict[str, Any]:
        try:
            future = self.engine.submit(params)
        except ValueError as exc:
            return error_dict(400, str(exc), _param_of(str(exc)), replica=self.replica_id)
        except QueueFullError as exc:
            return error_dict(429, str(exc), retry_after=exc.retry_after_s, replica=self.replica_id)
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # the client went away: free the slot at the next step
            raise
        except ValueError as exc:
            return error_dict(400, str(exc), _param_of(str(exc)), replica=self.replica_id)
        return {"replica": self.replica_id, "result": result}

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

    def check_health(self) -> None:
        if not self.engine.running:
            raise RuntimeError("engine loop is not running")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
