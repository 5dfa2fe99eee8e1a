"""Request router of the engine deployment: round-robin for generation, strict pinning for sessions.

Set through ``RequestRouterConfig(request_router_class="ditserve.cluster.router:SessionRouter")``, so
every handle to the engine deployment (each frontend replica has one) routes with it.

A realtime session lives on one replica (its latents are there). Its id is ``<replica_id>.<random>`` and
travels as Serve's ``session_id`` (``handle.options(session_id=...)``), so the owner is read off the id:
no session map in the router, nothing to keep in sync between frontends. When the owner is not among the
running replicas, the request fails with :class:`SessionGone` (410 at the HTTP ingress) instead of being
remapped to a replica that never saw the session.

Serve pickles this module by value into every handle's router: keep it small, import by absolute names,
and define no classes here that other modules catch (see ``errors``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ray.serve.experimental.round_robin_router import RoundRobinRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from ditserve.cluster.errors import SessionGone  # absolute: this module is pickled by value

ROUTER_PATH = "ditserve.cluster.router:SessionRouter"


def session_owner(session_id: str) -> str:
    """The owner replica id of a session id ``<replica_id>.<random>``."""
    owner, sep, _ = session_id.rpartition(".")
    if not sep or not owner:
        raise ValueError(f"session id {session_id!r} is not of the form <replica_id>.<token>")
    return owner


class SessionRouter(RoundRobinRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Sequence[list[RunningReplica]]:
        session_id = pending_request.metadata.session_id if pending_request is not None else ""
        if not session_id:
            return await super().choose_replicas(candidate_replicas, pending_request)
        owner = session_owner(session_id)
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == owner:
                pending_request.routing_context.should_backoff = True  # owner busy: wait, never remap
                return [[replica]]
        # Owner gone: fail this request now. Returning a non-empty rank makes Serve's routing loop look at
        # the (now done) future and stop instead of polling for a replica that will never come back.
        if not pending_request.future.done():
            pending_request.future.set_exception(SessionGone.lost(session_id))
        return [candidate_replicas[:1]] if candidate_replicas else []
