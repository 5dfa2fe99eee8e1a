"""How the ``ditserve`` commands report bad input: one ``ditserve: error:`` line naming the flag, exit 2.

A leaf module: the CLI and the deploy generator both print through it.
"""

from __future__ import annotations

import sys

from pydantic import ValidationError


def fail(message: str) -> int:
    """Print ``message`` as the command's error and return the exit status for bad usage."""
    print(f"ditserve: error: {message}", file=sys.stderr)
    return 2


def validation_message(exc: ValidationError) -> str:
    """Pydantic's errors as flags: ``--dp-size: Input should be greater than or equal to 1``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        flag = f"--{loc.replace('_', '-')}: " if loc else ""
        lines.append(f"{flag}{err['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)
