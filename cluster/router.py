"""Request router of the engine deployment: round-robin for generation, strict pinning for sessions.

Set through ``RequestRouterConfig(request_router_class="ditserve.cluster.router:SessionRouter")``, so
every handle to the engine deployment routes with it: Serve's proxies (the engine deployment is the HTTP
and gRPC ingress), each replica's own handle (forwards to an owner, broadcasts) and drivers' handles.

Work (generation, opening a session, a video job or a realtime stream) goes round-robin on its own cursor;
every other request (status polls, listings, health, the playground) on a second one, so a client that
polls between its jobs does not skew where the jobs land.

A realtime session lives on one replica (its latents are there). Its id is ``<replica_id>.<random>`` and
travels as Serve's ``session_id`` (``handle.options(session_id=...)``), so the owner is read off the id:
no session map in the router, nothing to keep in sync between proxies. When the owner is not among the
running replicas, the request fails with :class:`SessionGoneError` (410 at the ingress) instead of being
remapped to a replica that never saw the session.

Serve pickles this module by value into every handle's router: keep it small, import by absolute names,
and define no classes here that other modules catch (see ``errors``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ray.serve.experimental.round_robin_router import RoundRobinRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from ditserve.cluster.errors import SessionGoneError  # absolute: this module is pickled by value

ROUTER_PATH = "ditserve.cluster.router:SessionRouter"

# Requests that start work on the replica they reach: HTTP by route pattern (Serve's proxy matches the
# FastAPI routes), handle and gRPC calls by method name.
WORK_ROUTES = frozenset(
    {
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/videos",
        "/v1/sessions",
        "/v1/realtime_video/generate",
    }
)
WORK_METHODS = frozenset(
    {
        "generate", "generate_stream", "open_session", "create_video", "realtime_open",
        "Generate", "GenerateStream", "EditImage", "CreateVideo", "OpenSession",
    }
)  # fmt: skip


def is_work(metadata) -> bool:
    """Whether a request starts work (round-robin on the work cursor)."""
    if metadata.is_http_request:  # through the HTTP proxy: ``route`` is the matched route pattern
        return metadata.route in WORK_ROUTES
    return metadata.call_method in WORK_METHODS


def session_owner(session_id: str) -> str:
    """The owner replica id of a session id ``<replica_id>.<random>``."""
    owner, sep, _ = session_id.rpartition(".")
    if not sep or not owner:
        raise ValueError(f"session id {session_id!r} is not of the form <replica_id>.<token>")
    return owner


class SessionRouter(RoundRobinRouter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._other_cursor = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Sequence[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        meta = pending_request.metadata
        from_client = meta.is_http_request or meta.is_grpc_request  # through Serve's proxy
        session_id = meta.session_id
        if session_id:
            try:
                owner = session_owner(session_id)
            except ValueError:
                if not from_client:
                    raise
                owner = ""  # a client's header that is no id of ours: routed as if absent
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == owner:
                    pending_request.routing_context.should_backoff = True  # owner busy: wait, never remap
                    return [[replica]]
            if not from_client:
                # Owner gone: fail this request now. Returning a non-empty rank makes Serve's routing loop
                # look at the (now done) future and stop instead of polling for a replica that will never
                # come back.
                if not pending_request.future.done():
                    pending_request.future.set_exception(SessionGoneError(session_id))
                return [candidate_replicas[:1]]
            # A client's x-session-id / session_id metadata naming a replica that is gone: any replica takes
            # the request, and its forward to the owner answers 410 in the API's error shape.
        if is_work(meta):
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Everything else: its own cursor, so it does not move the work cursor. Each rank holds one replica;
        # Serve tries the next when one is full.
        pending_request.routing_context.should_backoff = True
        start, n = self._other_cursor, len(candidate_replicas)
        self._other_cursor = (start + 1) % (1 << 31)
        return [[candidate_replicas[(start + k) % n]] for k in range(n)]
