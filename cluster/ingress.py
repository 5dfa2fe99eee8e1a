"""The engine deployment as its own HTTP/gRPC ingress: one process per replica holds the routes and the engine.

Serve's proxy sends each request straight to an engine replica, chosen by ``router.SessionRouter``
(round-robin for work, the owner for a request that carries ``x-session-id`` / gRPC ``session_id``
metadata). The routes (``frontend.Frontend``) call the engine through ``engine_client.EngineClient``:
in this process when the work belongs here, forwarded to the owner replica when a session or job id in
the path names another one. A request therefore crosses proxy → replica, as a direct handle call crosses
router → replica; only a pinned request that lands on a replica other than its owner pays one more hop.

Serve calls the engine's methods by name on this object (broadcasts, forwards from other replicas, health
checks, replica metadata): they are the ``EngineReplica``'s, reached through ``__getattr__``.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from .engine_client import EngineClient
from .engine_deployment import EngineReplica
from .frontend import Frontend, fastapi_app


@serve.ingress(fastapi_app)
class EngineIngress(Frontend):
    """Routes (``Frontend``) and the engine (``EngineReplica``) of one replica, in one process.

    ``engine_cls`` is injectable as on ``EngineReplica`` (benchmarks of the serving path use a trivial one).
    """

    def __init__(self, args: dict[str, Any], deploy_id: str = "local", engine_cls: type | None = None):
        extra = {} if engine_cls is None else {"engine_cls": engine_cls}
        # The engine first: it converges to the desired control state before Serve routes anything here.
        self.replica = EngineReplica(args, deploy_id=deploy_id, **extra)
        self._deployment_handle: Any = None
        super().__init__(EngineClient(self.replica, self.replica.replica_id, self._handle), args, deploy_id)

    def _handle(self) -> Any:
        """This deployment's handle (forwards to owner replicas, broadcasts), made on first use."""
        if self._deployment_handle is None:
            ctx = serve.get_replica_context()
            self._deployment_handle = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        return self._deployment_handle

    # Serve's replica hooks, named here so Serve finds them on the class it wraps.
    def record_replica_metadata(self) -> dict[str, Any]:
        return self.replica.record_replica_metadata()

    async def check_health(self) -> None:
        await self.replica.check_health()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class and Frontend do not define: the engine's methods.
        replica = self.__dict__.get("replica")
        if replica is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(replica, name)

    def __del__(self):
        replica = self.__dict__.get("replica")
        if replica is not None:
            replica.__del__()
