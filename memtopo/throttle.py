"""How often a repeated event is logged: once per key (a peer and what it did) a minute, with a count
of what was held back, so a client repeating itself cannot flood the journal. Every listener uses it:
the agent's gRPC front and services, and the HTTP server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Throttle:
    """At most one log event per key per ``interval`` seconds. ``allow(key)`` returns None while a
    key is quiet (the call is counted), else how many calls were held back since its last event
    (0 the first time), for the event to carry. Keys beyond ``max_keys`` evict the oldest, so a
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
