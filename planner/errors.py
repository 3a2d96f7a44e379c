"""The one error type every policy raises; the CLI prints it as {"error": {"code", "message"}}."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Literal

ErrorCode = Literal["invalid_request", "unsatisfiable", "invalid_topology"]


class PlanError(Exception):
    """A request the policy refuses, with a machine-readable code and a message naming the cause."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message

    def to_json(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


def unsatisfiable(head: str, reasons: Iterable[str], count: int, shown: int = 5) -> PlanError:
    """PlanError("unsatisfiable"): ``head``, then the first ``shown`` of ``count`` per-node reasons
    and how many more. ``reasons`` may be lazy: a 10,000-node fleet formats five of them."""
    listed = "; ".join(itertools.islice(reasons, shown))
    more = f" (and {count - shown} more)" if count > shown else ""
    return PlanError("unsatisfiable", f"{head}: {listed}{more}" if listed else head)
