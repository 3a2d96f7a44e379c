"""The one way memtopo runs an external tool, so tests can replace every call with recorded output.

Tools run with a list argv (never a shell), ``LC_ALL=C`` so their output parses the same everywhere,
no stdin, and a timeout. Failures come back as a :class:`ToolResult` with a reason; nothing raises.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ToolResult:
    argv: tuple[str, ...]
    returncode: int | None
    stdout: str
    stderr: str = ""
    # Set when the tool did not produce usable output: missing, timed out, exit status, ...
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


class Runner(Protocol):
    def run(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> ToolResult: ...


@dataclass(frozen=True)
class SubprocessRunner:
    """Runs the real tool."""

    extra_env: Mapping[str, str] = field(default_factory=dict)

    def run(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> ToolResult:
        args = tuple(argv)
        if not args:
            return ToolResult(args, None, "", failure="empty argv")
        exe = shutil.which(args[0])
        if exe is None:
            return ToolResult(args, None, "", failure=f"{args[0]}: not found")
        env = {**os.environ, **self.extra_env, "LC_ALL": "C", "LANG": "C"}
        try:
            proc = subprocess.run(
                [exe, *args[1:]],
                capture_output=True,
                stdin=subprocess.DEVNULL,
                timeout=timeout,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return ToolResult(args, None, "", failure=f"{args[0]}: timed out after {timeout:g}s")
        except OSError as exc:
            return ToolResult(args, None, "", failure=f"{args[0]}: {exc.strerror or exc}")
        out = proc.stdout.decode("utf-8", "replace")
        err = proc.stderr.decode("utf-8", "replace")
        failure = None if proc.returncode == 0 else f"{args[0]}: exit status {proc.returncode}"
        return ToolResult(args, proc.returncode, out, err, failure)


@dataclass(frozen=True)
class RecordedRunner:
    """Replays recorded outputs keyed by argv; an unknown argv behaves like a missing tool."""

    recordings: Mapping[tuple[str, ...], ToolResult]

    def run(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> ToolResult:
        args = tuple(argv)
        rec = self.recordings.get(args)
        if rec is None:
            return ToolResult(args, None, "", failure=f"{args[0] if args else '?'}: not found")
        return rec
