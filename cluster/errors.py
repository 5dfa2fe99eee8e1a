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


class Contended(Conflict):
    """Another operation on the same resource is under way (loading an adapter name whose adapter is still
    being unloaded); the same request succeeds once it is done, with nothing for the client to change."""


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


_LOCATIONS = ("body", "query", "path", "header")  # where FastAPI found a field: not a field name


# pydantic's names of plain-type union members (``str | ImageReference`` fails as ``("input_reference",
# "str")``): lower-case identifiers, as field names are, but no request model has a field of these names.
_PLAIN_MEMBERS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none"})


def _union_tag(part: Any) -> bool:
    """A step of a validation error's location that names a union member (``LoRARef``,
    ``list[LoRARef]``, ``str``), not a field or an index: field names are snake_case identifiers."""
    return isinstance(part, str) and (not part.isidentifier() or part[:1].isupper() or part in _PLAIN_MEMBERS)


def error_param(loc: Any) -> str | None:
    """The request field of a validation error's location: ``("body", "lora", "LoRARef", "scale")`` →
    ``"lora.scale"``, ``("lora", "list[LoRARef]", 0, "scale")`` → ``"lora.0.scale"``. A model validated
    outside FastAPI (gRPC) gives the field alone: ``("path",)`` is the field ``path``, not a location."""
    parts = [str(p) for p in loc if not _union_tag(p)]
    if parts and parts[0] in _LOCATIONS and (len(parts) > 1 or parts[0] == "body"):
        parts = parts[1:]
    return ".".join(parts) or None


def first_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The validation error to report: the first one, except that for a field of several shapes (a
    union: one error per member) the member the input got furthest into, i.e. the one it was meant as
    (a list of adapters is told about its items, not that it is not one adapter)."""
    first = errors[0]
    if not any(_union_tag(p) for p in first.get("loc", ())):
        return first
    field = (error_param(first.get("loc", ())) or "").split(".")[0]
    same = [e for e in errors if (error_param(e.get("loc", ())) or "").split(".")[0] == field]
    return max(same, key=lambda e: len(e.get("loc", ())))


def validation_error(errors: list[dict[str, Any]], whole: str = "body") -> BadRequest:
    """A pydantic validation failure as the 400 a client reads: ``<field>: <what is wrong>`` naming the field
    (``whole`` when it is about the request as a whole)."""
    if not errors:
        return BadRequest(f"{whole}: invalid request")
    error = first_error(errors)
    param = error_param(error.get("loc", ()))
    message = str(error.get("msg")).removeprefix("Value error, ")
    return BadRequest(f"{param or whole}: {message}", param=param)


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


def typed_cause(exc: BaseException) -> ServeError | None:
    """The typed error inside ``exc``: ``exc`` itself, or one it wraps (Ray hands a replica's or the router's
    exception to the caller inside a ``RayTaskError``, whose ``cause`` is the original); None if none is."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ServeError):
        cause = getattr(cause, "cause", None) or cause.__cause__
    return cause
