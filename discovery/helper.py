"""The agent's discovery helper: a warm process that forks a child for each discovery.

    python -m memtopo.discovery.helper     # started by the agent (discovery/isolated.py); requests on stdin

A fresh Python for every rescan costs its start and the imports again (about 0.3 s on a small host,
where the discovery itself takes a few milliseconds). The helper imports the discovery code once
(the probes every discovery runs; pyhwloc's bindings, with the library's version read from a
plugin-free synthetic topology that is freed at once), then waits for requests. Each one is
answered by a child it forked, which discovers with all of that imported, writes the topology and
exits: libhwloc's topology and plugins, NVML and the libcuda it maps leave with the child, and a
child stuck in a driver dies with its process group. The next child is forked as soon as an answer
is out and waits for its request, so the fork is in no one's wait. The helper itself never loads a
topology or a vendor library, reads nothing of a root but its tree's names (``check_tree``, once
per root) and starts no thread (a fork copies only the calling thread). It keeps each source's last
result, which the child sends back, so the next child reruns only the probes the request's change
reaches (discovery/probes.py ``reached``; discovery/discover.py ``Rescanner``).

Frames are a 4-byte big-endian length and that many bytes. A request is one frame of JSON
(``request``); an answer is a JSON header frame (``{"ok": true, "ran": [sources]}`` or ``{"ok":
false, "error": text}``) and the serialized MemoryTopology's frame. The child sends the helper the
same two frames and a third, its probes' results, pickled: it is the helper's own fork, running the
same code, on a pipe only the two of them hold. Nothing here imports asyncio or grpc: the helper's
memory is the agent's too (bench/footprint.py counts the process tree).
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import faulthandler
import gc
import importlib
import json
import os
import pickle
import struct
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from memtopo.discovery import crash
from memtopo.discovery.changes import EVERYTHING, Change
from memtopo.discovery.source import ProbeContext
from memtopo.text import excerpt

# A 64-node host's topology is a few hundred KiB; past this a frame is not a topology.
MAX_FRAME_BYTES = 64 << 20
FRAME_LENGTH = struct.Struct(">I")


class FrameError(Exception):
    """A frame that cannot be one: cut short, or longer than MAX_FRAME_BYTES."""


def frame(data: bytes) -> bytes:
    return FRAME_LENGTH.pack(len(data)) + data


def request(root: str | None, change: Change, node_name: str, generation: int) -> bytes:
    """A request frame: discover ``root`` (None: this host) after ``change``, name the node
    ``node_name`` (empty: its host name) and stamp ``generation``."""
    return frame(json.dumps({
        "root": root, "node_name": node_name, "generation": generation,
        "change": {"subsystems": sorted(change.subsystems), "pci_vendors": sorted(change.pci_vendors),
                   "pci_vendor_unknown": change.pci_vendor_unknown, "everything": change.everything},
    }).encode())


def change_of(raw: object) -> Change:
    """A request's change; anything unreadable is EVERYTHING (a full rescan is never wrong)."""
    if not isinstance(raw, dict) or raw.get("everything", True):
        return EVERYTHING
    subsystems, vendors = raw.get("subsystems"), raw.get("pci_vendors")
    if not isinstance(subsystems, list) or not isinstance(vendors, list):
        return EVERYTHING
    return Change(frozenset(str(s) for s in subsystems), frozenset(v for v in vendors if isinstance(v, int)),
                  bool(raw.get("pci_vendor_unknown")))


def _pickle_mapping_proxy(m: types.MappingProxyType[Any, Any]) -> tuple[Any, tuple[dict[Any, Any]]]:
    return types.MappingProxyType, (dict(m),)


class Helper:
    """The helper's state: the last results of each source, for the root they were read from, and the
    children: the one waiting for the next request, the one whose answer is going out."""

    def __init__(self, private: Sequence[int] = ()) -> None:
        from memtopo.discovery import hwloc
        from memtopo.discovery.probes import PROBES

        # The helper's ends of its pipes to the agent, which a child closes first thing.
        self.private = tuple(private)

        # Parts hold read-only mappings (MappingProxyType), which pickle does not know.
        copyreg.pickle(types.MappingProxyType, _pickle_mapping_proxy)
        # What a child runs: the collector and assembly, and the probes every discovery runs (a vendor's
        # is imported where its vendor is present, as in any discovery).
        importlib.import_module("memtopo.discovery.discover")
        for spec in PROBES:
            if spec.absent is None:
                importlib.import_module(spec.module)
        # What the hwloc probe does first in every process (pyhwloc's bindings, which map libhwloc,
        # and the library's version), done once here; no topology is kept.
        hwloc.prepare()
        self.root: str | None = None
        self.ctx: ProbeContext | None = None
        self.results: dict[str, Any] = {}
        self.ran: frozenset[str] = frozenset()
        # The child forked after the last answer, waiting for the next request (its fork and first
        # steps are then off the agent's wait), and the one whose answer is going out.
        self.standby: _Child | None = None
        self.answering: _Child | None = None
        # What is imported now stays shared with every child instead of being copied on first write.
        gc.collect()
        gc.freeze()

    def answer(self, asked: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        """The answer to one request, from a child: the one waiting (forked after the last answer,
        with everything the next discovery keeps), else a new one. ``settle`` follows."""
        root = asked.get("root")
        if root is not None and not isinstance(root, str):
            return {"ok": False, "error": "request: root is not a path"}, b""
        if self.ctx is None or root != self.root:
            self._drop_standby()
            self.root, self.results, self.ran = root, {}, frozenset()
            self.ctx = None
            try:
                self.ctx = _context(root)
            except Exception as exc:  # a root that cannot be opened: said, and tried again next time
                return {"ok": False, "error": f"root: {type(exc).__name__}: {excerpt(str(exc), 200)}"}, b""
        child, self.standby = self.standby or self._fork(), None
        left_out: dict[str, str] = {}
        while True:
            self.answering = child
            try:
                os.write(child.asks, frame(json.dumps(asked).encode()))
            except OSError:  # it died waiting: the frames below say so
                pass
            finally:
                os.close(child.asks)
            try:
                head, payload = read_frame(child.answers), read_frame(child.answers)
                break
            except FrameError as exc:
                signalled = child.died_of()
                if signalled is None:
                    return {"ok": False, "error": str(exc)}, b""
            # Killed by a signal (a C library crashing on what it read): again without the probes it
            # died in, whose sources say so; a crash outside every probe has nothing to leave out.
            word = crash.signal_name(signalled)
            suspects = [s for s in crash.running_at_death(child.account) if s not in left_out]
            if not suspects:
                return {"ok": False, "error": f"the discovery process died of {word} outside any probe"}, b""
            crash.left_out(word, suspects, left_out)
            assert self.ctx is not None
            child = self._fork(dataclasses.replace(self.ctx, leave_out={**self.ctx.leave_out, **left_out}))
        try:
            decoded = json.loads(head)
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict):
            return {"ok": False, "error": "the discovery process wrote garbage"}, b""
        if left_out:
            child.retried = True
        return decoded, payload if decoded.get("ok") else b""

    def settle(self) -> None:
        """After the answer went out: the child's results (kept for the next discovery; none kept if it
        failed), its exit, and the next child forked to wait for a request."""
        child, self.answering = self.answering, None
        if child is not None:
            try:
                kept = read_frame(child.answers)
            except FrameError:
                kept = b""
            child.answers.close()
            code = child.wait()
            # A discovery run again without a crashed probe keeps nothing: the next is a full one.
            if kept and code == 0 and not child.retried:
                got = pickle.loads(kept)  # noqa: S301 - this helper's own fork, on a private pipe
                self.results, self.ran = got["results"], frozenset(got["ran"])
            else:
                self.results, self.ran = {}, frozenset()  # the next discovery is a full one
        if self.ctx is not None and self.standby is None:
            self.standby = self._fork()

    def _fork(self, ctx: ProbeContext | None = None) -> _Child:
        """A child that waits for one request, discovers and exits; nothing of the helper's runs in it.
        It tells on a pipe of its own which probe starts and ends on which thread, and faulthandler
        names there the thread a fatal signal hit."""
        asks_r, asks_w = os.pipe()
        answers_r, answers_w = os.pipe()
        said_r, said_w = os.pipe()
        # A child's account of its probes is short; the helper reads it only after the child is gone.
        os.set_blocking(said_r, False)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd in (*self.private, asks_w, answers_r, said_r):
                    os.close(fd)
                faulthandler.enable(file=os.fdopen(said_w, "w", closefd=False))
                with os.fdopen(asks_r, "rb") as asks:
                    try:
                        asked = json.loads(read_frame(asks))
                    except FrameError:  # the helper went away or dropped it: nothing asked
                        os._exit(0)
                base = ctx or self.ctx
                assert base is not None
                told = dataclasses.replace(base, on_probe=lambda source, starting: crash.mark(said_w, source, starting))
                code = _child(answers_w, asked, told, self.results)
            finally:
                os._exit(code)
        os.close(asks_r)
        os.close(answers_w)
        os.close(said_w)
        return _Child(pid, asks_w, os.fdopen(answers_r, "rb"), said_r)

    def _drop_standby(self) -> None:
        child, self.standby = self.standby, None
        if child is not None:
            os.close(child.asks)  # it reads the end of its requests and exits
            child.answers.close()
            child.wait()


@dataclass
class _Child:
    """A forked child as the helper holds it: where its request goes, where its frames come from, and
    where it tells which probe it runs."""

    pid: int
    asks: int
    answers: BinaryIO
    said: int
    status: int | None = None  # its wait status, once reaped
    retried: bool = False  # it ran a discovery again without probes an earlier child died in

    account: bytes = b""  # what it said of its probes, read once it is gone

    def wait(self) -> int:
        """Reap it (once) and read what it said of its probes; its exit code (-N: killed by signal N)."""
        if self.status is None:
            _, self.status = os.waitpid(self.pid, 0)
            try:
                self.account = _read_all(self.said)
            finally:
                os.close(self.said)
        return os.waitstatus_to_exitcode(self.status)

    def died_of(self) -> int | None:
        """The signal that killed it, reaping it; None when it exited."""
        code = self.wait()
        return -code if code < 0 else None


def _read_all(fd: int) -> bytes:
    chunks = []
    with contextlib.suppress(OSError):  # BlockingIOError: nothing more (a child still holding it)
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks)


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


def _child(w: int, asked: dict[str, Any], ctx: ProbeContext, results: dict[str, Any]) -> int:
    """In the forked child: discover after the request's change and write the three frames."""
    from memtopo.discovery.discover import Rescanner
    from memtopo.discovery.source import DiscoveryScope

    with os.fdopen(w, "wb") as out:
        try:
            change = change_of(asked.get("change"))
            rescanner = Rescanner(ctx)
            rescanner.keep(results, frozenset())
            generation = asked.get("generation")
            node_name = asked.get("node_name")
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
        out.write(b"".join(frame(f) for f in (json.dumps(head).encode(), payload, kept)))
        out.flush()
    return 0


def read_frame(stream: BinaryIO) -> bytes:
    """One frame from a blocking stream."""
    head = stream.read(FRAME_LENGTH.size)
    if len(head) != FRAME_LENGTH.size:
        raise FrameError("the discovery process ended without an answer")
    (n,) = FRAME_LENGTH.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise FrameError(f"the discovery process wrote a frame of {n} bytes, more than a topology")
    data = stream.read(n)
    if len(data) != n:
        raise FrameError("the discovery process ended in the middle of its answer")
    return data


def serve(stdin: BinaryIO, stdout: BinaryIO) -> int:
    """The helper's loop: one request, one answer, until the agent closes stdin."""
    helper = Helper((stdin.fileno(), stdout.fileno()))
    while True:
        try:
            raw = read_frame(stdin)
        except FrameError:
            return 0  # the agent is gone
        try:
            asked = json.loads(raw)
        except ValueError:
            asked = None
        if isinstance(asked, dict):
            head, payload = helper.answer(asked)
        else:
            head, payload = {"ok": False, "error": "request: not a JSON object"}, b""
        stdout.write(frame(json.dumps(head).encode()) + frame(payload))
        stdout.flush()
        helper.settle()


def main(argv: Sequence[str] | None = None) -> int:
    if argv if argv is not None else sys.argv[1:]:
        print("python -m memtopo.discovery.helper: the agent's discovery helper takes no arguments "
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
