"""Structured logs: one JSON object per line on stdout, which journald stores as the unit's messages.

Events are names with fields (``log.info("generation_published", generation=3, fingerprint=fp)``),
never sentences, so they can be filtered and counted. Everything goes through stdlib logging with
structlog's ProcessorFormatter as the one renderer: the agent's own events and what libraries log
through `logging` (grpc's Python side, asyncio) come out in the same format, on one handler, so lines
written from several threads never interleave.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Final, TextIO, cast

import structlog
from structlog.typing import FilteringBoundLogger, Processor

LEVELS: Final[dict[str, int]] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMATS: Final = ("json", "console")

# The stdlib logger the agent's own events go through; foreign records keep their logger's name.
LOGGER_NAME: Final = "memtopo"


class _MemtopoHandler(logging.StreamHandler[TextIO]):
    """Marks the handler configure_logging installed, so a second call replaces it (and only it:
    handlers others put on the root logger, such as pytest's capture, stay)."""


# Attributes every LogRecord has, plus the two a formatter adds: whatever else a record carries came
# from `extra=` and becomes a field. (structlog's ExtraAdder would also pick up `message`/`asctime`
# whenever another handler formatted the record first.)
_RECORD_ATTRS: Final = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _foreign_fields(_: object, __: str, event_dict: structlog.typing.EventDict) -> structlog.typing.EventDict:
    record = event_dict.get("_record")
    if isinstance(record, logging.LogRecord):
        event_dict["logger"] = record.name
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS:
                event_dict.setdefault(key, value)
    return event_dict


def _leading_keys(_: object, __: str, event_dict: structlog.typing.EventDict) -> structlog.typing.EventDict:
    # Time, level and event first: the order a person scanning `journalctl -o cat` reads in.
    head = {k: event_dict.pop(k) for k in ("timestamp", "level", "event") if k in event_dict}
    return {**head, **event_dict}


def configure_logging(level: str, fmt: str = "json", stream: TextIO | None = None) -> None:
    """Route the agent's events and stdlib logging to `stream` (stdout by default) in `fmt`.

    Raises ValueError naming the bad value when `level` or `fmt` is not one of the known words.
    """
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    # Resolved at call time, not as a default argument: tests and pytest swap sys.stdout.
    out = sys.stdout if stream is None else stream
    numeric = LEVELS[level]

    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        timestamper,
    ]
    renderers: list[Processor] = ([_leading_keys, structlog.processors.JSONRenderer(default=str)] if fmt == "json"
                                  else [structlog.dev.ConsoleRenderer(colors=False)])
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _foreign_fields],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.StackInfoRenderer(),
            # A traceback as one string field: the line stays one JSON object.
            structlog.processors.format_exc_info,
            *renderers,
        ],
    )
    handler = _MemtopoHandler(out)
    handler.setFormatter(formatter)

    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _MemtopoHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        # Filtering in structlog's wrapper makes a disabled debug call a no-op method.
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # Not cached: a later configure_logging (tests, a SIGHUP reload) must reach loggers already made.
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: object) -> FilteringBoundLogger:
    """A logger whose events carry `bound` (e.g. ``get_logger(component="link", node=name)``)."""
    return cast(FilteringBoundLogger, structlog.get_logger(LOGGER_NAME, **bound))


class Throttle:
    """At most one log event per key (a peer and what it did) per ``interval`` seconds, so a client
    repeating itself cannot flood the journal: every listener uses it (the agent's gRPC front and
    services, the HTTP server). ``allow(key)`` returns None while a key is quiet (the call is
    counted), else how many calls were held back since its last event (0 the first time), for the
    event to carry. Keys beyond ``max_keys`` evict the oldest, so a
    peer inventing new keys cannot grow it. Thread-safe."""

    def __init__(self, interval: float = 60.0, max_keys: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # key → (time of its last event, calls held back)
        self._lock = threading.Lock()

    def allow(self, key: str) -> int | None:
        now = self._clock()
        with self._lock:
            last = self._seen.get(key)
            if last is not None and now - last[0] < self.interval:
                self._seen[key] = (last[0], last[1] + 1)
                return None
            self._seen.pop(key, None)
            if len(self._seen) >= self.max_keys:
                del self._seen[next(iter(self._seen))]
            self._seen[key] = (now, 0)
            return last[1] if last is not None else 0
