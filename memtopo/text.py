"""Text every view shares: sizes in the units people read, and what an error message may quote of what
it read — a short excerpt with control characters escaped, so a hostile file or request can neither flood
a log nor forge lines in it."""

from __future__ import annotations

EXCERPT_CHARS = 60


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``value`` as at most ``limit`` printable characters (a non-string as its repr); longer text ends in …"""
    text = value if isinstance(value, str) else repr(value)
    head = text[: limit + 1]
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in head)
    return shown if len(shown) <= limit and len(text) <= limit else shown[: limit - 1] + "…"


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
