"""Work measured by counting, not by a clock: a busy or slow machine runs the same lines."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def lines_run(fn: Callable[[], object]) -> int:
    """How many Python lines ``fn()`` executes, in every frame it enters."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count
