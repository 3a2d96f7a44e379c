"""Discovery outside the long-lived agent: a warm helper process forks a child for each discovery.

What a live discovery loads stays loaded for the life of the process that loaded it: libhwloc's
topology and its plugins, NVML (which maps libcuda itself), each with its threads and caches — on
a GPU host a quarter of the agent's memory, kept for a rescan every few minutes. A child that
discovers and exits takes all of it with it. A child can also be killed: a thread stuck in a
driver call, or on a FIFO a capture put where a file should be, cannot, and would keep the agent
from exiting.

A fresh Python for every rescan costs its start and the imports again (about 0.3 s on a small host,
where the discovery itself takes a few milliseconds). So the agent starts one helper,
``python -m memtopo.discovery.isolated``, which imports the discovery code once (the probes every
discovery runs, and pyhwloc's bindings) and then waits for requests on its stdin. For each request
it forks a child that discovers with all of that imported, writes the topology and exits. The
helper itself never loads a topology or a vendor library, reads nothing of the root and starts no
thread (a fork copies only the calling thread). It keeps each source's last result, which the child
sends back, so the next child reruns only the probes the request's change reaches
(discovery/probes.py ``reached``; discovery/discover.py ``Rescanner``).

The helper leads a process group of its own: the agent kills the group (helper and child) when a
discovery overruns its limit or is cancelled (a stop), and the next request starts a new helper.

Frames on the pipes are a 4-byte big-endian length and that many bytes. A request is one frame of
JSON; an answer is a JSON header frame and the serialized MemoryTopology's frame. The child sends the
helper the same two frames and a third, its probes' results (pickled: it is the helper's own fork,
running the same code, over a pipe only the two of them hold).
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import gc
import importlib
import json
import os
import pickle
import signal
import struct
import sys
import types
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from memtopo.discovery.changes import EVERYTHING, Change
from memtopo.discovery.source import ProbeContext
from memtopo.text import excerpt
from memtopo.v1 import topology_pb2 as pb

# A 64-node host's topology is a few hundred KiB; past this the child is not giving us a topology.
MAX_OUTPUT_BYTES = 64 << 20
_LENGTH = struct.Struct(">I")
# The last bytes the helper and its children wrote to stderr, quoted when a discovery fails.
_STDERR_TAIL_BYTES = 2048
# Imported by the helper before its first fork, beyond the probe modules: what the hwloc probe
# imports when it runs (pyhwloc's ctypes layer, which maps libhwloc without loading a topology).
_PRELOAD = ("pyhwloc.hwloc.core", "pyhwloc.hwloc.lib")


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
    return [sys.executable, "-m", "memtopo.discovery.isolated"]


# ---- the agent's side ----------------------------------------------------------------------------------
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
        request = json.dumps({
            "root": root, "node_name": node_name, "generation": generation,
            "change": {"subsystems": sorted(change.subsystems), "pci_vendors": sorted(change.pci_vendors),
                       "pci_vendor_unknown": change.pci_vendor_unknown, "everything": change.everything},
        }).encode()
        try:
            proc = await self._running()
            head, payload = await asyncio.wait_for(self._exchange(proc, request), timeout)
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
            stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=MAX_OUTPUT_BYTES)
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

    async def _exchange(self, proc: asyncio.subprocess.Process, request: bytes) -> tuple[dict[str, Any], bytes]:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(_LENGTH.pack(len(request)) + request)
            await proc.stdin.drain()
            head = await _read_frame(proc.stdout)
            payload = await _read_frame(proc.stdout)
        except (ConnectionError, asyncio.IncompleteReadError, _FrameError) as exc:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5)
            if self._stderr_task is not None:  # what it said last (a child it left may hold the pipe)
                await asyncio.wait({self._stderr_task}, timeout=1)
            status = f"exited with status {proc.returncode}" if proc.returncode is not None else "broke off"
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


class _FrameError(Exception):
    pass


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "its answer ended early"
    return excerpt(str(exc) or type(exc).__name__, 120)


async def _read_frame(stream: asyncio.StreamReader) -> bytes:
    (n,) = _LENGTH.unpack(await stream.readexactly(_LENGTH.size))
    if n > MAX_OUTPUT_BYTES:
        raise _FrameError(f"a frame of {n} bytes, more than a topology")
    return await stream.readexactly(n)


# ---- the helper --------------------------------------------------------------------------------------
def _pickle_mapping_proxy(m: types.MappingProxyType[Any, Any]) -> tuple[Any, tuple[dict[Any, Any]]]:
    return types.MappingProxyType, (dict(m),)


class _Helper:
    """The helper's state: the last results of each source, for the root they were read from."""

    def __init__(self, private: Sequence[int] = ()) -> None:
        from memtopo.discovery.probes import PROBES

        # The helper's ends of its pipes to the agent, which a child closes first thing.
        self.private = tuple(private)

        # Parts hold read-only mappings (MappingProxyType), which pickle does not know.
        copyreg.pickle(types.MappingProxyType, _pickle_mapping_proxy)
        for spec in PROBES:
            if spec.absent is None:  # vendor probes are imported only where their vendor is present
                importlib.import_module(spec.module)
        for module in _PRELOAD:
            with contextlib.suppress(Exception):  # the hwloc probe reports a broken library itself
                importlib.import_module(module)
        self.root: str | None = None
        self.ctx: ProbeContext | None = None
        self.results: dict[str, Any] = {}
        self.ran: frozenset[str] = frozenset()
        # What is imported now stays shared with every child instead of being copied on first write.
        gc.collect()
        gc.freeze()

    def answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        root = request.get("root")
        if root is not None and not isinstance(root, str):
            return {"ok": False, "error": "request: root is not a path"}, b""
        if self.ctx is None or root != self.root:
            self.root, self.results, self.ran = root, {}, frozenset()
            self.ctx = None
            try:
                self.ctx = _context(root)
            except Exception as exc:  # a root that cannot be opened: said, and tried again next time
                return {"ok": False, "error": f"root: {type(exc).__name__}: {excerpt(str(exc), 200)}"}, b""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: discover, send, exit without running anything of the helper's
            code = 1
            try:
                os.close(r)
                for fd in self.private:
                    os.close(fd)
                code = _child(w, request, self.ctx, self.results)
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            try:
                head, payload, results = _read_sync(pipe), _read_sync(pipe), _read_sync(pipe)
            except _FrameError as exc:
                head, payload, results = json.dumps({"ok": False, "error": str(exc)}).encode(), b"", b""
        _, status = os.waitpid(pid, 0)
        try:
            decoded = json.loads(head)
        except ValueError:
            decoded = {"ok": False, "error": "the discovery process wrote garbage"}
        if not isinstance(decoded, dict):
            decoded = {"ok": False, "error": "the discovery process wrote garbage"}
        if decoded.get("ok") and os.waitstatus_to_exitcode(status) == 0 and results:
            kept = pickle.loads(results)  # noqa: S301 - this helper's own fork, on a private pipe
            self.results, self.ran = kept["results"], frozenset(kept["ran"])
            return decoded, payload
        if decoded.get("ok"):
            decoded = {"ok": False, "error": f"the discovery process exited with status "
                                             f"{os.waitstatus_to_exitcode(status)}"}
        self.results = {}  # the next discovery is a full one
        return decoded, b""


def _context(root: str | None) -> ProbeContext:
    """The context of a root, made once while the helper discovers it: a captured root's tree is
    checked (memtopo.hostfs.check_tree: links, FIFOs, sizes; names and modes only, no file is
    opened) and its recordings found when it is opened, as by a discovery on the agent's thread,
    and every child inherits that."""
    if not root:
        return ProbeContext.live()
    ctx = ProbeContext.at_root(root)
    ctx.fs.tree_problems  # noqa: B018 - checked here, once, rather than in every child
    return ctx


def _child(w: int, request: dict[str, Any], ctx: ProbeContext, results: dict[str, Any]) -> int:
    """In the forked child: discover after the request's change and write the three frames."""
    from memtopo.discovery.discover import Rescanner
    from memtopo.discovery.source import DiscoveryScope

    with os.fdopen(w, "wb") as out:
        try:
            change = _change(request.get("change"))
            rescanner = Rescanner(ctx)
            rescanner.keep(results, frozenset())
            generation = request.get("generation")
            node_name = request.get("node_name")
            # The scope is never closed: freeing hwloc's topology (and unloading its plugins) is
            # work the exit does better.
            topo = rescanner.discover(change, generation=generation if isinstance(generation, int) else 1,
                                      node_name=node_name if isinstance(node_name, str) else "",
                                      scope=DiscoveryScope())
            payload = topo.SerializeToString()
            kept = pickle.dumps({"results": rescanner.results, "ran": sorted(rescanner.ran)},
                                protocol=pickle.HIGHEST_PROTOCOL)
            head = {"ok": True, "ran": sorted(rescanner.ran)}
        except Exception as exc:  # anything the backstop in collect does not catch: assembly, encoding
            head, payload, kept = ({"ok": False, "error": f"discovery failed: {type(exc).__name__}: "
                                                          f"{excerpt(str(exc), 200)}"}, b"", b"")
        for frame in (json.dumps(head).encode(), payload, kept):
            out.write(_LENGTH.pack(len(frame)) + frame)
        out.flush()
    return 0


def _change(raw: object) -> Change:
    if not isinstance(raw, dict) or raw.get("everything", True):
        return EVERYTHING
    subsystems, vendors = raw.get("subsystems"), raw.get("pci_vendors")
    if not isinstance(subsystems, list) or not isinstance(vendors, list):
        return EVERYTHING
    return Change(frozenset(str(s) for s in subsystems), frozenset(v for v in vendors if isinstance(v, int)),
                  bool(raw.get("pci_vendor_unknown")))


def _read_sync(stream: BinaryIO) -> bytes:
    head = stream.read(_LENGTH.size)
    if len(head) != _LENGTH.size:
        raise _FrameError("the discovery process ended without an answer")
    (n,) = _LENGTH.unpack(head)
    if n > MAX_OUTPUT_BYTES:
        raise _FrameError(f"the discovery process wrote a frame of {n} bytes, more than a topology")
    data = stream.read(n)
    if len(data) != n:
        raise _FrameError("the discovery process ended in the middle of its answer")
    return data


def serve(stdin: BinaryIO, stdout: BinaryIO) -> int:
    """The helper's loop: one request, one answer, until the agent closes stdin."""
    helper = _Helper((stdin.fileno(), stdout.fileno()))
    while True:
        try:
            frame = _read_sync(stdin)
        except _FrameError:
            return 0  # the agent is gone
        try:
            request = json.loads(frame)
        except ValueError:
            request = None
        if isinstance(request, dict):
            head, payload = helper.answer(request)
        else:
            head, payload = {"ok": False, "error": "request: not a JSON object"}, b""
        for out in (json.dumps(head).encode(), payload):
            stdout.write(_LENGTH.pack(len(out)) + out)
        stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    if argv if argv is not None else sys.argv[1:]:
        print("python -m memtopo.discovery.isolated: the agent's discovery helper takes no arguments "
              "(requests come on stdin)", file=sys.stderr)
        return 2
    # The protocol gets descriptors of its own; fd 1 becomes stderr and fd 0 /dev/null, so that
    # nothing a library prints (in the helper or a child) can land in an answer.
    requests, answers = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    with os.fdopen(requests, "rb") as stdin, os.fdopen(answers, "wb") as stdout:
        return serve(stdin, stdout)


if __name__ == "__main__":
    sys.exit(main())
