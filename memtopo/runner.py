"""The one way memtopo runs an external tool, so tests can replace every call with recorded output.

Tools run with a list argv (never a shell), ``LC_ALL=C`` so their output parses the same everywhere,
no stdin, and a timeout. Failures come back as a :class:`ToolResult` with a reason; nothing raises.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import ClassVar, Protocol

from memtopo.hostfs import HostFS, HostReadError
from memtopo.model import frozen

DEFAULT_TIMEOUT_S = 10.0


@frozen
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


@frozen
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
        # Here, not at the top: most discoveries find no vendor tool to run.
        import subprocess

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


# Inside a captured root: tool outputs recorded with it (by `memtopo gather`, or a synthesized
# fixture), so `topo --root` replays that host's tools instead of running this host's.
RECORDED_TOOLS_DIR = ".memtopo/tools"
# A tool's recorded output: the largest real one (npu-smi info -t topo on 16 NPUs) is a few KB.
MAX_RECORDING_BYTES = 16 << 20


@frozen
class RecordedRunner:
    """Replays recorded outputs keyed by argv; an unknown argv behaves like a missing tool."""

    recordings: Mapping[tuple[str, ...], ToolResult]
    # A replay answers at once: run_all needs no threads to keep its calls from waiting on each other.
    blocks: ClassVar[bool] = False

    @classmethod
    def from_dir(cls, tools: Path) -> RecordedRunner:
        """``argv.json`` ({"file.txt": ["npu-smi", "info", "-m"], …}) and each file's text.

        A file named ``*.exit<N>.txt`` replays a tool that printed it and exited with status N.
        A directory without ``argv.json`` replays no tool at all.
        """
        return cls.from_fs(HostFS.at(tools), "")

    @classmethod
    def from_fs(cls, fs: HostFS, rel: str) -> RecordedRunner:
        """As from_dir, for the directory ``rel`` of a root, every file read inside the root."""
        import json

        base = f"{rel}/" if rel else ""
        try:
            index = json.loads(fs.read_bytes(f"{base}argv.json", MAX_RECORDING_BYTES)) \
                if fs.exists(f"{base}argv.json") else {}
        except (HostReadError, ValueError):
            index = {}
        recordings: dict[tuple[str, ...], ToolResult] = {}
        if not isinstance(index, dict):
            return cls(recordings)
        for fname, argv in index.items():
            if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
                continue
            if "/" in fname or fname.startswith("."):
                continue  # never read outside the tools directory
            try:
                text = fs.read_bytes(f"{base}{fname}", MAX_RECORDING_BYTES).decode("utf-8", "replace")
            except HostReadError:
                continue
            stem = fname.rsplit(".", 1)[0]
            _, sep, code_s = stem.rpartition(".exit")
            code = int(code_s) if sep and code_s.isdigit() else 0
            failure = None if code == 0 else f"{argv[0]}: exit status {code}"
            recordings[tuple(argv)] = ToolResult(tuple(argv), code, text, "", failure)
        return cls(recordings)

    def run(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> ToolResult:
        args = tuple(argv)
        rec = self.recordings.get(args)
        if rec is None:
            return ToolResult(args, None, "", failure=f"{args[0] if args else '?'}: not found")
        return rec


# Enough for one probe's independent calls (npu-smi's three views, xpu-smi per device) without
# letting a 16-device host start 16 tool processes at once.
MAX_CONCURRENT_TOOLS = 4


def run_all(runner: Runner, argvs: Sequence[Sequence[str]], timeout: float = DEFAULT_TIMEOUT_S) -> list[ToolResult]:
    """Run independent tool calls concurrently, results in argv order: one slow tool costs its
    own timeout, not the sum of all of them. A runner whose ``blocks`` is False (a replay) is
    called in turn: starting a thread pool costs more than all of its answers."""
    if len(argvs) <= 1 or not getattr(runner, "blocks", True):
        return [runner.run(a, timeout) for a in argvs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT_TOOLS, len(argvs))) as pool:
        return list(pool.map(lambda a: runner.run(a, timeout), argvs))
