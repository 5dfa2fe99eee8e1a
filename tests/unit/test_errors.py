"""The typed errors as users see them: every kind has an HTTP status, body type and gRPC code (one table at
each edge), replica answers survive the trip through Ray (pickling, RayTaskError wrapping), and the HTTP
answer carries Retry-After and the replica header."""

from __future__ import annotations

import pickle

import grpc
import pytest
from fastapi.testclient import TestClient
from ray.exceptions import RayTaskError

from ditserve.cluster import errors
from ditserve.cluster.errors import (
    BadRequest,
    Conflict,
    Contended,
    InternalError,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    ReplicaUnavailable,
    ServeError,
    SessionGone,
    Unauthorized,
    Unsupported,
    engine_error,
    typed_cause,
)
from ditserve.cluster.grpc_service import GRPC_CODES, grpc_code
from ditserve.cluster.http_base import HTTP_ERRORS, build_fastapi, error_body, http_status
from ditserve.replica.scheduler import QueueFullError

# What a client sees for each kind: HTTP status, the body's "type", the gRPC code.
SEEN = {
    BadRequest: (400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    Unauthorized: (401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED),
    NotFound: (404, "not_found_error", grpc.StatusCode.NOT_FOUND),
    Conflict: (409, "invalid_request_error", grpc.StatusCode.FAILED_PRECONDITION),
    # a retry of the same call succeeds once the other operation is done: ABORTED, not FAILED_PRECONDITION
    Contended: (409, "invalid_request_error", grpc.StatusCode.ABORTED),
    SessionGone: (410, "session_gone_error", grpc.StatusCode.NOT_FOUND),
    PayloadTooLarge: (413, "invalid_request_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
    QueueFull: (429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
    InternalError: (500, "server_error", grpc.StatusCode.INTERNAL),
    Unsupported: (501, "not_implemented_error", grpc.StatusCode.UNIMPLEMENTED),
    ReplicaUnavailable: (503, "service_unavailable_error", grpc.StatusCode.UNAVAILABLE),
}


def test_every_kind_is_in_both_tables():
    kinds = {
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, ServeError) and cls is not ServeError
    }
    assert kinds == set(SEEN), "a typed error without its row here"
    assert set(HTTP_ERRORS) == kinds, "a typed error the HTTP edge cannot answer"
    assert set(GRPC_CODES) == kinds, "a typed error the gRPC edge cannot answer"


@pytest.mark.parametrize("kind", list(SEEN), ids=lambda k: k.__name__)
def test_each_kind_maps_to_what_users_see(kind):
    status, body_type, code = SEEN[kind]
    exc = kind("size: 7x7 must be a multiple of 16", param="size")
    assert http_status(exc) == status
    assert error_body(exc) == {
        "error": {
            "message": "size: 7x7 must be a multiple of 16",
            "type": body_type,
            "param": "size",
            "code": status,
        }
    }
    assert grpc_code(exc) == code


@pytest.mark.parametrize("kind", list(SEEN), ids=lambda k: k.__name__)
def test_a_replica_answer_crosses_pickling_and_ray_wrapping(kind):
    sent = kind("replica is shut down", param="p", retry_after=5, replica="r1")
    got = pickle.loads(pickle.dumps(sent))
    assert type(got) is kind
    assert (got.message, got.param, got.retry_after, got.replica) == ("replica is shut down", "p", 5, "r1")
    # Ray may hand an error back as a class that is both a RayTaskError and the error's own.
    wrapped = RayTaskError("method", "Traceback ...", sent).as_instanceof_cause()
    assert isinstance(wrapped, kind) and type(wrapped) is not kind
    assert (http_status(wrapped), grpc_code(wrapped)) == (SEEN[kind][0], SEEN[kind][2])


def test_the_typed_error_inside_a_wrapped_failure_is_found():
    """What the frontend's unary calls and streams answer for a replica's (or the router's) typed error that
    Ray hands back wrapped: the error itself, found through ``cause`` and ``__cause__``; None for a failure
    with no typed error in it (answered as an internal error)."""
    gone = SessionGone("session s1 is gone")
    wrapped = RayTaskError("method", "Traceback ...", gone)
    assert typed_cause(wrapped) is gone
    bad = BadRequest("lora: no adapter named 'x' is loaded", param="lora")
    try:
        try:
            raise bad
        except BadRequest as inner:
            raise RuntimeError("stream failed") from inner
    except RuntimeError as outer:
        assert typed_cause(RayTaskError("method", "Traceback ...", outer)) is bad
    assert typed_cause(RayTaskError("method", "Traceback ...", RuntimeError("rank 1 died"))) is None


def test_engine_errors_become_typed():
    bad = engine_error(ValueError("lora: no adapter named 'x' is loaded"), "r1")
    assert type(bad) is BadRequest and (bad.param, bad.replica) == ("lora", "r1")
    full = engine_error(QueueFullError(4, retry_after_s=2.0), "r1")
    assert type(full) is QueueFull and full.retry_after == 2.0
    assert engine_error(RuntimeError("rank 1 died")) is None


def test_http_answer_headers():
    app = build_fastapi()

    @app.get("/full")
    async def full():
        raise QueueFull("queue full (4 requests waiting); retry later", retry_after=2.5, replica="r1")

    @app.get("/bad")
    async def bad():
        raise BadRequest("n: 9 is above the maximum 4", param="n")

    client = TestClient(app)
    answer = client.get("/full")
    assert answer.status_code == 429
    assert answer.headers["retry-after"] == "2" and answer.headers["x-ditserve-replica"] == "r1"
    assert answer.json()["error"]["type"] == "rate_limit_error"
    answer = client.get("/bad")
    assert answer.status_code == 400 and "retry-after" not in answer.headers
    assert answer.json() == {
        "error": {
            "message": "n: 9 is above the maximum 4",
            "type": "invalid_request_error",
            "param": "n",
            "code": 400,
        }
    }


def test_a_failed_video_job_says_what_happened_and_keeps_internal_errors_in_the_log(caplog):
    """``error.message`` of a failed video job: a retryable end (memory released, a rank lost) says to create
    the video again; bad input found while running keeps its words; any other failure is an internal error
    whose text (paths, a traceback's words) goes to the server log, as on every other route, not to the user."""
    from ditserve.cluster.errors import ReplicaUnavailable
    from ditserve.cluster.replica_streams import job_failure
    from ditserve.replica.launcher import RankDied

    released = ReplicaUnavailable("replica memory was released")
    assert job_failure(released) == "replica memory was released; create the video again"
    swapped = ReplicaUnavailable(
        "the served weights were replaced (...) while this request was running; retry it"
    )
    assert job_failure(swapped) == swapped.message
    died = RankDied("rank 1: process exited (code -9) during step")
    assert job_failure(died) == "rank 1: process exited (code -9) during step; create the video again"
    assert job_failure(ValueError("input_reference: too long")) == "input_reference: too long"
    with caplog.at_level("ERROR", logger="ditserve"):
        message = job_failure(RuntimeError("/srv/models/private/vae: CUDA error"))
    assert message == "internal error (RuntimeError); see the server log"
    assert "/srv/models/private/vae" in caplog.text
