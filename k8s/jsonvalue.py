"""A JSON object inside a string another party wrote (an annotation on a pod, a runtime's verbose
container info): bounded before it is parsed, and an object or an error saying why it is not one."""

from __future__ import annotations

import json
from typing import Any

from memtopo.text import excerpt


class JsonObjectError(ValueError):
    """Why a value is not the JSON object it should be (quoting at most a short excerpt of it)."""


def json_object(raw: object, limit: int, what: str) -> dict[str, Any]:
    """The object in ``raw``, a string of at most ``limit`` characters (``what`` names such a value
    in the error: "a placement")."""
    if not isinstance(raw, str):
        raise JsonObjectError("not a string")
    if len(raw) > limit:
        raise JsonObjectError(f"{len(raw)} bytes, more than {what} ({limit})")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested past the decoder's depth
        raise JsonObjectError(f"not JSON: {excerpt(raw)}") from None
    if not isinstance(doc, dict):
        raise JsonObjectError(f"not a JSON object: {excerpt(raw)}")
    return doc


def json_object_or_none(raw: object, limit: int) -> dict[str, Any] | None:
    """json_object's answer, or None where there is none (a caller that only skips a broken value)."""
    try:
        return json_object(raw, limit, "a value")
    except JsonObjectError:
        return None
