"""The engine as the HTTP/gRPC routes call it: the replica in this process first, the deployment otherwise.

The engine deployment is its own ingress (``ingress.EngineIngress``): Serve's proxy routes a request
straight to an engine replica (round-robin, ``router.SessionRouter``), and the routes run next to the
engine they call. :class:`EngineClient` has the shape of the ``DeploymentHandle`` the routes were written
against (``.method.remote(...)``, ``.options(session_id=..., stream=True)``, ``.broadcast(...)``) and
decides per call where it runs:

- work the router may place anywhere (generation, opening a session or a video job): on this replica,
  no further hop;
- work pinned to a session or job id (``<replica_id>.<token>``) owned here: on this replica;
- pinned work owned by another replica: forwarded through the deployment's handle with Serve's
  ``session_id``, so ``SessionRouter`` sends it to the owner (or answers 410 when the owner is gone);
- control broadcasts: through the handle to every replica, this one included.

A local call keeps the semantics of a handle call the routes rely on: it starts at once (a task), awaiting
it gives the answer, cancelling it cancels the replica's work, and a stream can be cancelled while it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from .router import session_owner

_DONE = object()


class LocalStream:
    """A replica's async generator run as a task, read like Serve's ``DeploymentResponseGenerator``."""

    def __init__(self, items: AsyncIterator[Any]):
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pump(items))

    async def _pump(self, items: AsyncIterator[Any]) -> None:
        try:
            async for item in items:
                self._queue.put_nowait(item)
        except asyncio.CancelledError:  # cancel(): the stream ends here for its reader
            raise
        except Exception as exc:  # handed to the reader, as Serve raises a replica's error there
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(_DONE)

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _DONE:
            self._queue.put_nowait(_DONE)  # later reads end too
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        """Stop the replica's generator (its ``finally`` frees the engine slot); no-op once finished."""
        self._task.cancel()


class _Method:
    def __init__(self, client: EngineClient, name: str):
        self._client = client
        self._name = name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._client._call(self._name, args, kwargs)


class EngineClient:
    """Handle-shaped access to the engine from the routes of one ingress replica (see the module doc).

    ``local``: this process's ``EngineReplica``; ``local_id``: its replica id; ``handle``: a callable
    returning the engine deployment's ``DeploymentHandle`` (made on first use: forwards and broadcasts)."""

    def __init__(
        self,
        local: Any,
        local_id: str,
        handle: Callable[[], Any],
        *,
        session_id: str = "",
        stream: bool = False,
    ):
        self._local = local
        self._local_id = local_id
        self._handle = handle
        self._session_id = session_id
        self._stream = stream

    def options(self, *, session_id: str | None = None, stream: bool | None = None) -> EngineClient:
        return EngineClient(
            self._local,
            self._local_id,
            self._handle,
            session_id=self._session_id if session_id is None else session_id,
            stream=self._stream if stream is None else stream,
        )

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def broadcast(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._handle().broadcast(method, *args, **kwargs)

    def runs_here(self) -> bool:
        """Whether a call with these options runs on this replica (else it is forwarded)."""
        if not self._session_id:
            return True
        try:
            return session_owner(self._session_id) == self._local_id
        except ValueError:  # not an id this server issued: the handle's router answers as before
            return False

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        if not self.runs_here():
            handle = self._handle().options(session_id=self._session_id, stream=self._stream)
            return getattr(handle, name).remote(*args, **kwargs)
        method = getattr(self._local, name)
        if self._stream:
            return LocalStream(method(*args, **kwargs))
        return asyncio.ensure_future(method(*args, **kwargs))
