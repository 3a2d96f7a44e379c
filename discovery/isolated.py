"""Discovery in a short-lived child process, for the long-lived agent.

What a live discovery loads stays loaded for the life of the process that loaded it: libhwloc and
its plugins, NVML (which maps libcuda itself), each with its threads and caches — on a GPU host a
quarter of the agent's memory, kept for a rescan every few minutes. A child that discovers and exits
takes all of it with it. A child can also be killed: a thread stuck in a driver call, or on a FIFO a
capture put where a file should be, cannot, and would keep the agent from exiting.

    python -m memtopo.discovery.isolated [--root DIR]   # the serialized MemoryTopology on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Sequence

from memtopo.text import excerpt
from memtopo.v1 import topology_pb2 as pb

# A 64-node host's topology is a few hundred KiB; past this the child is not giving us a topology.
MAX_OUTPUT_BYTES = 64 << 20


class IsolatedDiscoveryError(Exception):
    """The child did not give a topology: it failed, was killed, overran its deadline or printed garbage."""


def child_argv(root: str | None) -> list[str]:
    return [sys.executable, "-m", "memtopo.discovery.isolated", *(["--root", root] if root else [])]


async def discover_in_child(root: str | None, timeout: float) -> pb.MemoryTopology:
    """The topology of ``root`` (None: this host) as a child process finds it; the child is killed
    when ``timeout`` passes or the caller is cancelled, so nothing of it outlives this call."""
    proc = await asyncio.create_subprocess_exec(
        *child_argv(root), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
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
    if proc.returncode != 0:
        last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise IsolatedDiscoveryError(f"discovery process exited with status {proc.returncode}: {excerpt(last[0], 200)}")
    if len(out) > MAX_OUTPUT_BYTES:
        raise IsolatedDiscoveryError(f"discovery process wrote {len(out)} bytes, more than a topology")
    topo = pb.MemoryTopology()
    try:
        topo.ParseFromString(out)
    except Exception as exc:  # protobuf's DecodeError, and whatever its C parser raises on garbage
        raise IsolatedDiscoveryError(f"discovery process wrote no topology: {excerpt(str(exc))}") from None
    return topo


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memtopo.discovery.isolated")
    ap.add_argument("--root", help="a captured root (a directory); default: this host")
    args = ap.parse_args(argv)
    from memtopo.discovery.discover import discover
    from memtopo.discovery.source import ProbeContext

    ctx = ProbeContext.at_root(args.root) if args.root else ProbeContext.live()
    sys.stdout.buffer.write(discover(ctx).SerializeToString())
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
