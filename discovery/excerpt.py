"""The one way an error message quotes what it read: short and escaped.

A hostile file (a capture's ``cpulist`` made a link to ``/etc/shadow``, a tool printing megabytes)
must not travel whole into a source's degraded reason, a log line or an agent's answer.
"""

from __future__ import annotations

EXCERPT_CHARS = 40


def excerpt(text: str | bytes, limit: int = EXCERPT_CHARS) -> str:
    """``text`` as a quoted, escaped literal of at most ``limit`` characters of it, saying how long
    the whole was when it was cut: ``'0-3,zz'`` or ``'abcd…' (5000 chars)``."""
    cut = text[:limit]
    shown = repr(cut)
    if len(text) <= limit:
        return shown
    unit = "bytes" if isinstance(text, bytes) else "chars"
    return f"{shown[:-1]}…{shown[-1]} ({len(text)} {unit})"
