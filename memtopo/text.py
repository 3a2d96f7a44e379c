"""What an error message may quote of what it read: a short excerpt with control characters escaped,
so a hostile file or request can neither flood a log nor forge lines in it."""

from __future__ import annotations

EXCERPT_CHARS = 60


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``value`` as at most ``limit`` printable characters (a non-string as its repr); longer text ends in …"""
    text = value if isinstance(value, str) else repr(value)
    head = text[: limit + 1]
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in head)
    return shown if len(shown) <= limit and len(text) <= limit else shown[: limit - 1] + "…"
