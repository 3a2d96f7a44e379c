"""Discovery outside the long-lived agent and outside the commands that read input from elsewhere.

What a live discovery loads stays loaded for the life of the process that loaded it: libhwloc's
topology and its plugins, NVML (which maps libcuda itself), each with its threads and caches — on
a GPU host a quarter of the agent's memory, kept for a rescan every few minutes. A child that
discovers and exits takes all of it with it. A child can also be killed: a thread stuck in a
driver call, or on a FIFO a capture put where a file should be, cannot, and would keep the agent
from exiting. And a child can die: a C library (hwloc, NVML) that crashes on what it reads takes the
process with it, and only it.

The agent's discoveries (``DiscoveryHelper``): each in a child of the discovery helper
(discovery/helper.py), one at a time; the helper forks those children warm, so a rescan pays no
process start. The helper leads a process group of its own: the agent kills the group (helper and
child) when a discovery overruns its limit or is cancelled (a stop), and the next discovery starts a
new helper; one that died between discoveries is started again the same way. A child that dies of a
signal costs the sources it died in (the helper runs the discovery again without them), never the
topology.

A command's discovery of a captured root or an hwloc export (``discover_apart``): one child of its
own, which says on stderr which probe starts and ends on which thread, while faulthandler names the
thread a fatal signal hit; when the child dies of a signal, discovery runs again without the probe it
died in (without every probe then running, where no thread is named), and its source says what
happened.

    python -m memtopo.discovery.isolated [--root DIR | --hwloc-xml FILE] [--leave-out SOURCE=REASON ...]
    # the serialized MemoryTopology on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import json
import os
import signal
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memtopo.discovery import crash
from memtopo.discovery.changes import EVERYTHING, Change
from memtopo.discovery.helper import FRAME_LENGTH, MAX_FRAME_BYTES, FrameError, request
from memtopo.text import excerpt
from memtopo.v1 import topology_pb2 as pb

if TYPE_CHECKING:
    from memtopo.discovery.source import ProbeContext

# The last bytes the helper and its children wrote to stderr, quoted when a discovery fails.
_STDERR_TAIL_BYTES = 2048
# A 64-node host's topology is a few hundred KiB; past this a command's child is not giving one.
MAX_OUTPUT_BYTES = 64 << 20
# What a command waits for its child at most (each probe inside has its own deadline).
COMMAND_TIMEOUT_SECONDS = 3600.0


class IsolatedDiscoveryError(Exception):
    """No topology came back: the child or the helper failed, was killed, overran its deadline or
    wrote garbage."""


@dataclass(frozen=True)
class Discovered:
    """One discovery's answer: the topology, its wire bytes as the child serialized them (the
    agent publishes those bytes as they are) and the sources the child ran (the rest were kept)."""

    topology: pb.MemoryTopology
    payload: bytes
    ran: tuple[str, ...]


def helper_argv() -> list[str]:
    return [sys.executable, "-m", "memtopo.discovery.helper"]


class DiscoveryHelper:
    """The helper process as the agent drives it: one discovery at a time."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr_tail: deque[bytes] = deque()
        self._stderr_task: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        """The helper's pid while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def discover(self, root: str | None, *, change: Change = EVERYTHING, node_name: str = "",
                       generation: int = 1, timeout: float) -> Discovered:
        """The topology of ``root`` (None: this host) after ``change``. The helper and its child are
        killed when ``timeout`` passes or the caller is cancelled; the next call starts a new helper."""
        asked = request(root, change, node_name, generation)
        try:
            proc = await self._running()
            head, payload = await asyncio.wait_for(self._exchange(proc, asked), timeout)
        except TimeoutError:
            await self.close()
            raise IsolatedDiscoveryError(f"discovery did not finish within {timeout:g} s; its processes were "
                                         "killed") from None
        except BaseException:  # cancelled (a stop), or the helper went away mid-answer
            await self.close()
            raise
        if not head.get("ok"):
            raise IsolatedDiscoveryError(str(head.get("error") or "discovery failed"))
        topo = pb.MemoryTopology()
        try:
            topo.ParseFromString(payload)
        except Exception as exc:  # protobuf's DecodeError, and whatever its C parser raises on garbage
            raise IsolatedDiscoveryError(f"the discovery process wrote no topology: {excerpt(str(exc))}") from None
        ran = head.get("ran")
        return Discovered(topo, payload, tuple(str(s) for s in ran) if isinstance(ran, list) else ())

    async def close(self) -> None:
        """Kill the helper and any child of it, and reap the helper."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        task, self._stderr_task = self._stderr_task, None
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 5)

    async def _running(self) -> asyncio.subprocess.Process:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            return proc
        if proc is not None:
            await self.close()  # it died between requests: start another
        proc = await asyncio.create_subprocess_exec(
            *helper_argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=MAX_FRAME_BYTES)
        self._proc = proc
        self._stderr_tail.clear()
        assert proc.stderr is not None
        self._stderr_task = asyncio.create_task(self._drain_stderr(proc.stderr))
        return proc

    async def _drain_stderr(self, stream: asyncio.StreamReader) -> None:
        """What the helper and its children write to stderr (hwloc's warnings, a traceback): read as it
        comes, so it never fills the pipe, and the last of it kept for an error message."""
        kept = 0
        while chunk := await stream.read(4096):
            self._stderr_tail.append(chunk)
            kept += len(chunk)
            while kept - len(self._stderr_tail[0]) >= _STDERR_TAIL_BYTES:
                kept -= len(self._stderr_tail.popleft())

    def _last_words(self) -> str:
        lines = b"".join(self._stderr_tail).decode("utf-8", "replace").strip().splitlines()
        return excerpt(lines[-1], 200) if lines else "''"

    async def _exchange(self, proc: asyncio.subprocess.Process, asked: bytes) -> tuple[dict[str, Any], bytes]:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(asked)
            await proc.stdin.drain()
            head = await _read_frame(proc.stdout)
            payload = await _read_frame(proc.stdout)
        except (ConnectionError, asyncio.IncompleteReadError, FrameError) as exc:
            if not isinstance(exc, FrameError):  # the pipe ended: the helper is exiting, say how
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 5)
            if self._stderr_task is not None:  # what it said last (a child it left may hold the pipe)
                await asyncio.wait({self._stderr_task}, timeout=1)
            status = f"exited with status {proc.returncode}" if proc.returncode is not None else "garbled its answer"
            raise IsolatedDiscoveryError(f"the discovery helper {status} ({_describe(exc)}): "
                                         f"{self._last_words()}") from None
        try:
            decoded = json.loads(head)
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict):
            text = head.decode("utf-8", "replace")
            raise IsolatedDiscoveryError(f"the discovery helper wrote no answer: {excerpt(text)}")
        return decoded, payload


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "its answer ended early"
    return excerpt(str(exc) or type(exc).__name__, 120)


async def _read_frame(stream: asyncio.StreamReader) -> bytes:
    (n,) = FRAME_LENGTH.unpack(await stream.readexactly(FRAME_LENGTH.size))
    if n > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {n} bytes, more than a topology")
    return await stream.readexactly(n)


# ---- a command's discovery in a child of its own ----------------------------------------
def child_argv(root: str | None) -> list[str]:
    return [sys.executable, "-m", "memtopo.discovery.isolated", *(["--root", root] if root else [])]


async def _run_child(argv: Sequence[str], timeout: float) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, limit=MAX_OUTPUT_BYTES)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        message = f"discovery did not finish within {timeout:g} s; its process was killed"
        raise IsolatedDiscoveryError(message) from None
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out, err


async def discover_in_child(root: str | None, timeout: float, *, hwloc_xml: str | None = None) -> pb.MemoryTopology:
    """The topology of ``root`` (None: this host; or of the export ``hwloc_xml``) as a child process
    finds it; the child is killed when ``timeout`` passes or the caller is cancelled, so nothing of
    it outlives this call. A child that dies of a signal is run again without the probes it died in."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    left_out: dict[str, str] = {}
    while True:
        argv = [*child_argv(root), *(["--hwloc-xml", hwloc_xml] if hwloc_xml else []),
                *(arg for source, reason in left_out.items() for arg in ("--leave-out", f"{source}={reason}"))]
        rc, out, err = await _run_child(argv, max(0.0, deadline - loop.time()))
        if rc >= 0:
            break
        name = crash.signal_name(-rc)
        suspects = [s for s in crash.running_at_death(err) if s not in left_out]
        if not suspects:
            raise IsolatedDiscoveryError(f"discovery process died of {name} outside any probe")
        crash.left_out(name, suspects, left_out)
    if rc != 0:
        last = [ln for ln in err.decode("utf-8", "replace").strip().splitlines()
                if not ln.startswith(crash.PROBE_MARK)][-1:] or [""]
        raise IsolatedDiscoveryError(f"discovery process exited with status {rc}: {excerpt(last[0], 200)}")
    if len(out) > MAX_OUTPUT_BYTES:
        raise IsolatedDiscoveryError(f"discovery process wrote {len(out)} bytes, more than a topology")
    topo = pb.MemoryTopology()
    try:
        topo.ParseFromString(out)
    except Exception as exc:  # protobuf's DecodeError, and whatever its C parser raises on garbage
        raise IsolatedDiscoveryError(f"discovery process wrote no topology: {excerpt(str(exc))}") from None
    return topo


def discover_apart(ctx: ProbeContext, timeout: float = COMMAND_TIMEOUT_SECONDS) -> pb.MemoryTopology:
    """What ``discover(ctx)`` finds, for a command: input from elsewhere (a captured root, an hwloc
    export) in a child process, so that a C library crashing on it costs its source and not the
    command (nor a temporary extraction the command holds); this host in this process."""
    if ctx.libraries_live:
        from memtopo.discovery.discover import discover

        return discover(ctx)
    xml = str(ctx.hwloc_xml) if ctx.hwloc_xml is not None else None
    root = None if xml is not None else str(ctx.fs.root)
    return asyncio.run(discover_in_child(root, timeout, hwloc_xml=xml))


def _leave_out(values: Sequence[str]) -> Mapping[str, str]:
    return dict(v.partition("=")[::2] for v in values)


def _tell(source: str, starting: bool) -> None:
    crash.mark(2, source, starting)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memtopo.discovery.isolated")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--root", help="a captured root (a directory); default: this host")
    src.add_argument("--hwloc-xml", help="an hwloc XML export")
    ap.add_argument("--leave-out", action="append", default=[], metavar="SOURCE=REASON",
                    help="a source not to run, and the reason its status gives")
    args = ap.parse_args(argv)
    # On a fatal signal (SIGSEGV, SIGABRT, SIGBUS …) the thread it hit is named on stderr, and so the
    # probe the parent leaves out the next time (a SIGKILL names none: then every probe running).
    faulthandler.enable()
    from memtopo.discovery.discover import discover
    from memtopo.discovery.source import ProbeContext

    if args.hwloc_xml:
        ctx = ProbeContext.at_root("/", hwloc_xml=Path(args.hwloc_xml))
    else:
        ctx = ProbeContext.at_root(args.root) if args.root else ProbeContext.live()
    ctx = dataclasses.replace(ctx, leave_out=_leave_out(args.leave_out), on_probe=_tell)
    sys.stdout.buffer.write(discover(ctx).SerializeToString())
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
