"""Number types of request bodies that read JSON as its schema says.

A JSON Schema ``integer`` is any number with no fractional part (``1.0`` included), but never ``true`` or
the string ``"3"``. Pydantic's strict ``int`` refuses ``1.0`` and its lax ``int`` takes ``true`` and
``"3"``: :data:`JsonInt` takes exactly what the schema allows.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # anything else goes to the strict int check (bool and str are refused there)


JsonInt = Annotated[int, BeforeValidator(_integral)]


def json_int(**constraints: Any) -> Any:
    """:data:`JsonInt` with bounds, for optional fields (``json_int(ge=1) | None``): the bounds sit on the int
    itself, so the JSON schema states them (``minimum``/``maximum``) inside the union."""
    return Annotated[int, Field(strict=True, **constraints), BeforeValidator(_integral)]
