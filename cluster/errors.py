"""Exceptions that cross from Serve's routing layer to the ingress.

Kept out of ``router.py`` on purpose: Serve pickles the request-router module *by value*
(``RequestRouterConfig`` uses ``cloudpickle.register_pickle_by_value``), so a class defined there would be
a different class in the frontend and ``except`` would not match it. Classes here are pickled by reference.
"""

from __future__ import annotations


class SessionGoneError(RuntimeError):
    """The replica that held a session is gone, and the session's state with it (HTTP 410)."""

    def __init__(self, session_id: str):
        super().__init__(
            f"session {session_id!r} was lost: the replica that held its state is gone; open a new session"
        )
        self.session_id = session_id


def param_of(message: str) -> str | None:
    """The request field a ``ValueError`` message names (``"path: ... does not exist"`` → ``"path"``)."""
    head = message.split(":", 1)[0].strip()
    return head if head.isidentifier() else None
