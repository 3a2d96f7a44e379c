"""Retry delays every reconnecting loop shares (the controller link, the NodeResourceTopology
publisher, informers, the agent's task supervisor): exponential, capped, jittered."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial: float = 0.5
    maximum: float = 30.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Exponential, capped, with jitter over the upper half so a restarted server is not met by
        every client of the fleet in the same instant."""
        cap = min(self.maximum, self.initial * (2 ** min(attempt, 30)))
        return rng.uniform(cap / 2, cap)
