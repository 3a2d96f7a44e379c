"""Discovery in a short-lived child process, for the long-lived agent and for input from elsewhere.

What a live discovery loads stays loaded for the life of the process that loaded it: libhwloc and
its plugins, NVML (which maps libcuda itself), each with its threads and caches — on a GPU host a
quarter of the agent's memory, kept for a rescan every few minutes. A child that discovers and exits
takes all of it with it. A child can also be killed: a thread stuck in a driver call, or on a FIFO a
capture put where a file should be, cannot, and would keep the agent from exiting.

And a child can die: a C library (hwloc, NVML) that crashes on what it reads takes the process
with it. The child says on stderr which probe starts and ends on which thread, and faulthandler
names the thread a fatal signal hit; when the child dies of a signal, discovery runs again without
the probe it died in (without every probe then running, where no thread is named), and its source
says what happened. A probe the retry also dies in is left out too: a crash costs its sources,
never the topology.

    python -m memtopo.discovery.isolated [--root DIR | --hwloc-xml FILE] [--leave-out SOURCE=REASON ...]
    # the serialized MemoryTopology on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from memtopo.text import excerpt
from memtopo.v1 import topology_pb2 as pb

if TYPE_CHECKING:
    from memtopo.discovery.source import ProbeContext

# A 64-node host's topology is a few hundred KiB; past this the child is not giving us a topology.
MAX_OUTPUT_BYTES = 64 << 20
# What a command waits for its child at most (each probe inside has its own deadline).
COMMAND_TIMEOUT_SECONDS = 3600.0
# The child's stderr lines telling which probe starts and ends, and on which thread.
PROBE_MARK = "memtopo-probe"
# How faulthandler names the thread a fatal signal was delivered to.
_FAULTED = "Current thread "


class IsolatedDiscoveryError(Exception):
    """The child did not give a topology: it failed, was killed, overran its deadline or printed garbage."""


def child_argv(root: str | None) -> list[str]:
    return [sys.executable, "-m", "memtopo.discovery.isolated", *(["--root", root] if root else [])]


def _running_at_death(err: bytes) -> list[str]:
    """The probes the child died in, in starting order: the one on the thread that took the signal
    (faulthandler names it as the "Current thread"), else every one started and not ended."""
    running: dict[str, int] = {}
    faulted: int | None = None
    for line in err.decode("utf-8", "replace").splitlines():
        if line.startswith(_FAULTED):
            with contextlib.suppress(ValueError):
                faulted = int(line[len(_FAULTED):].split()[0], 16)
            continue
        mark, _, rest = line.partition(" ")
        if mark != PROBE_MARK:
            continue
        what, _, rest = rest.partition(" ")
        source, _, thread = rest.partition(" ")
        if what == "start":
            with contextlib.suppress(ValueError):
                running[source] = int(thread, 16)
        elif what == "end":
            running.pop(source, None)
    on_that_thread = [source for source, thread in running.items() if thread == faulted]
    return on_that_thread or list(running)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
        name = _signal_name(-rc)
        suspects = [s for s in _running_at_death(err) if s not in left_out]
        if not suspects:
            raise IsolatedDiscoveryError(f"discovery process died of {name} outside any probe")
        for source in suspects:
            others = [s for s in suspects if s != source]
            beside = f" (beside {', '.join(others)})" if others else ""
            left_out[source] = (f"left out: the discovery process died of {name} while this probe ran{beside}; "
                                "discovery ran again without it")
    if rc != 0:
        last = [ln for ln in err.decode("utf-8", "replace").strip().splitlines()
                if not ln.startswith(PROBE_MARK)][-1:] or [""]
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
    # One write(2) of a short line: whole in the pipe even with probes on several threads.
    os.write(2, f"{PROBE_MARK} {'start' if starting else 'end'} {source} {threading.get_ident():#x}\n".encode())


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
