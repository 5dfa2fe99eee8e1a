"""The errors a client must know about, typed: what went wrong, never how a protocol says it.

Replicas return them as values (a refused request is an answer, not a Ray task failure with a traceback in
the log); the frontend and its route modules raise them. Only the edges turn a kind into a code: the HTTP
ingress through ``http_base.HTTP_ERRORS`` (status, the body's ``type``, Retry-After), the gRPC service
through ``grpc_service.GRPC_CODES``.

Kept out of ``router.py`` on purpose: Serve pickles the request-router module *by value*
(``RequestRouterConfig`` uses ``cloudpickle.register_pickle_by_value``), so a class defined there would be
a different class in the frontend and ``except`` would not match it. Classes here are pickled by reference.
"""

from __future__ import annotations

from typing import Any

from ditserve.replica.scheduler import QueueFullError


class ServeError(Exception):
    """A failure the client must know about: the subclass says which, ``message`` names the field or the fix.

    ``param``: the request field it is about; ``retry_after``: seconds after which a retry may succeed;
    ``replica``: the replica that answered (the HTTP answer names it in a header)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after: float | None = None,
        replica: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.replica = replica

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles its positional args only; the keyword fields travel as the state.
        return (type(self), (self.message,), dict(self.__dict__))


class BadRequest(ServeError):
    """The request is invalid; ``param`` names the field."""


class Unauthorized(ServeError):
    """Missing or wrong API key."""


class NotFound(ServeError):
    """No such resource (session, video, adapter, route argument)."""


class Conflict(ServeError):
    """The resource is in a state that cannot answer this (a video that is not completed)."""


class SessionGone(ServeError):
    """The replica that held a session is gone, and the session's state with it."""

    @classmethod
    def lost(cls, session_id: str) -> SessionGone:
        return cls(
            f"session_id: session {session_id!r} was lost: the replica that held its state is gone; open a "
            "new session",
            param="session_id",
        )


class PayloadTooLarge(ServeError):
    """The request body or message is over ``max_body_bytes``."""


class QueueFull(ServeError):
    """The replica takes no more work now; retry after ``retry_after`` seconds."""


class ReplicaUnavailable(ServeError):
    """No replica can take the request now: released, shut down, lost a rank, or none running."""


class Unsupported(ServeError):
    """This build or model cannot do what was asked (e.g. LoRA without the adapter engine)."""


class InternalError(ServeError):
    """A failure of ours, not the request's; the message says where to look."""


def param_of(message: str) -> str | None:
    """The request field a ``ValueError`` message names (``"path: ... does not exist"`` → ``"path"``)."""
    head = message.split(":", 1)[0].strip()
    return head if head.isidentifier() else None


def engine_error(exc: BaseException, replica: str | None = None) -> ServeError | None:
    """The typed error for what the engine raised at a request: bad input (``ValueError``), a full queue, or a
    typed error already; None for any other failure (the caller decides)."""
    if isinstance(exc, ServeError):
        err = exc
    elif isinstance(exc, ValueError):
        err = BadRequest(str(exc), param=param_of(str(exc)))
    elif isinstance(exc, QueueFullError):
        err = QueueFull(str(exc), retry_after=exc.retry_after_s)
    else:
        return None
    if replica is not None:
        err.replica = replica
    return err
