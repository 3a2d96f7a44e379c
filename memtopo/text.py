"""Text every view shares: sizes in the units people read, and what an error message may quote of what
it read — a short excerpt with control characters escaped, so a hostile file or request can neither flood
a log nor forge lines in it."""

from __future__ import annotations

import re

# A config value or an address shown back in an error message.
SHORTEN_CHARS = 60
# What a file, tool or request said, quoted in a reason or log line.
EXCERPT_CHARS = 40


def escaped(text: str, keep: str = "") -> str:
    """``text`` with each character that is not printable (controls, U+202E and the other bidi
    overrides, U+0085 …) written as its escape (``\\u202e``), except those in ``keep`` (a text view
    keeps its newlines). What a terminal shows of a name from the network or a host is then what it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def shorten(value: object, limit: int = SHORTEN_CHARS) -> str:
    """``value`` as at most ``limit`` printable characters (a non-string as its repr); longer text ends in …"""
    text = value if isinstance(value, str) else repr(value)
    shown = escaped(text[: limit + 1])
    return shown if len(shown) <= limit and len(text) <= limit else shown[: limit - 1] + "…"


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def excerpt(text: str | bytes, limit: int = EXCERPT_CHARS) -> str:
    """``text`` as a quoted, escaped literal of at most ``limit`` characters of it, saying how long
    the whole was when it was cut: ``'0-3,zz'`` or ``'abcd…' (5000 chars)``."""
    cut = text[:limit]
    shown = repr(cut)
    if len(text) <= limit:
        return shown
    unit = "bytes" if isinstance(text, bytes) else "chars"
    return f"{shown[:-1]}…{shown[-1]} ({len(text)} {unit})"


_DIGITS = re.compile(r"([0-9]+)")  # ASCII only: int() of a superscript "¹" fails


def natural_key(name: str) -> tuple[tuple[int, str, int], ...]:
    """Sort key for names as people count them: GPU2 before GPU10 (a run of digits by its value,
    before any text at the same place)."""
    # split with a group alternates text and digit runs: odd positions are the numbers.
    return tuple((0, "", int(part)) if n % 2 else (1, part, 0)
                 for n, part in enumerate(_DIGITS.split(name)) if part)


def reason(exc: BaseException) -> str:
    """What went wrong, in the words of the exception: an OSError's strerror ("No such file or
    directory"), else its message, else its type."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
