"""The one error type every policy raises; the CLI prints it as {"error": {"code", "message"}}."""

from __future__ import annotations

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
