"""Undo operations: what the journal records before each change, and how each is restored.

Every op is self-contained (root-relative paths, pids with their start time) so that a later
process, after a crash, restores it without the plan or the handler that made it. Restores are
idempotent and tolerate the change never having happened (a crash between the journal fsync and
the first write): restoring an untouched object writes the value it already has.

A process is named by (pid, starttime): a pid recycled since the change is a different process
and is left alone.
"""

from __future__ import annotations

import errno
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from memtopo.apply import irqbalance
from memtopo.apply.errors import ApplyError, HostWriteError, KernelCallError
from memtopo.apply.host import Host, Ids
from memtopo.cpulist import CpuListError, format_cpulist, parse_cpulist
from memtopo.hostfs import HostReadError

FileKind = Literal["list", "text", "partition", "subtree"]

# include/linux/threads.h: no tid reaches this on any kernel (64-bit pid_max limit).
PID_MAX_LIMIT = 1 << 22

_BAN_SOCKET = re.compile(r"irqbalance\d{1,9}\.sock")
_IRQBALANCE_UNIT = re.compile(r"irqbalance[\w@.-]{0,64}\.service")


@dataclass(frozen=True)
class Outcome:
    ok: bool
    note: str = ""


@dataclass(frozen=True)
class AffinityUndo:
    pid: int
    starttime: int
    # (cpus, tids) groups: threads with the same previous mask share one entry.
    groups: tuple[tuple[Ids, Ids], ...]


@dataclass(frozen=True)
class FileUndo:
    path: str
    value: str
    kind: FileKind = "text"


@dataclass(frozen=True)
class MkdirUndo:
    # Root-relative cgroup directory created by the plan; leftover processes go to `parent_procs`.
    path: str
    parent_procs: str


@dataclass(frozen=True)
class AttachUndo:
    pid: int
    starttime: int
    # The cgroup.procs file of the cgroup the process was in.
    procs_file: str


@dataclass(frozen=True)
class MigrateUndo:
    pid: int
    starttime: int
    from_nodes: Ids
    to_nodes: Ids
    # False when the process already had pages on the destination: moving back would move those too.
    reversible: bool


@dataclass(frozen=True)
class BanUndo:
    pid: int
    starttime: int
    address: str
    banned: Ids


@dataclass(frozen=True)
class ServiceUndo:
    unit: str


UndoOp = AffinityUndo | FileUndo | MkdirUndo | AttachUndo | MigrateUndo | BanUndo | ServiceUndo

_KINDS: dict[type[Any], str] = {
    AffinityUndo: "affinity", FileUndo: "file", MkdirUndo: "mkdir", AttachUndo: "attach",
    MigrateUndo: "migrate", BanUndo: "irqbalance_ban", ServiceUndo: "service",
}


class UndoFormatError(ApplyError):
    """A journal entry that is not an undo op this version knows."""


def tid_runs(tids: Sequence[int]) -> str:
    """Tids as runs of consecutive ids, in their order: ``(7, 8, 9, 3)`` → ``"7-9,3"``. A journal
    names every thread it pins: a thousand tids as JSON numbers cost more to encode than the rest
    of the record, and a process's threads are mostly one or a few runs. Not
    :func:`format_cpulist`: that sorts (and tids exceed what a cpulist parser accepts)."""
    n = len(tids)
    if not n:
        return ""
    first = tids[0]
    # The common case (one unbroken run) checked in C.
    if tids[-1] - first == n - 1 and tuple(tids) == tuple(range(first, first + n)):
        return f"{first}-{tids[-1]}" if n > 1 else str(first)
    steps = list(map(operator.sub, tids[1:], tids[:-1]))
    parts: list[str] = []
    start = 0
    for i in [i for i, d in enumerate(steps, 1) if d != 1] + [n]:
        parts.append(str(tids[start]) if i - start == 1 else f"{tids[start]}-{tids[i - 1]}")
        start = i
    return ",".join(parts)


def parse_tid_runs(text: str) -> Ids:
    """The inverse of :func:`tid_runs`; UndoFormatError on anything else (a journal is data)."""
    out: list[int] = []
    if not text:
        return ()
    for part in text.split(","):
        lo_s, dash, hi_s = part.partition("-")
        digits = lo_s + hi_s if dash else lo_s
        if len(part) > 16 or not lo_s or (dash and not hi_s) or not digits.isdigit() or not digits.isascii():
            raise UndoFormatError(f"malformed tid run {part[:40]!r}")
        lo = int(lo_s)
        hi = int(hi_s) if dash else lo
        if hi >= PID_MAX_LIMIT or lo > hi or len(out) + hi - lo >= PID_MAX_LIMIT:
            raise UndoFormatError(f"bad tid run {part[:40]!r}")
        out.extend(range(lo, hi + 1))
    return tuple(out)


def to_json(op: UndoOp) -> dict[str, Any]:
    if type(op) is FileUndo:  # most of a plan's ops (one per IRQ action): its fields as they are
        return {"op": "file", "path": op.path, "value": op.value, "kind": op.kind}
    out: dict[str, Any] = {"op": _KINDS[type(op)]}
    for name, value in vars(op).items():
        if isinstance(value, tuple) and value and isinstance(value[0], tuple):
            out[name] = [[format_cpulist(c), tid_runs(t)] for c, t in value]
        elif isinstance(value, tuple):
            out[name] = list(value)
        else:
            out[name] = value
    return out


def from_json(obj: Mapping[str, Any]) -> UndoOp:
    try:
        kind = obj["op"]
        if kind == "affinity":
            # Tids as runs (tid_runs), or as a list of numbers in journals written before.
            groups = tuple((parse_cpulist(c), parse_tid_runs(tids) if isinstance(tids, str) else
                            tuple(int(t) for t in tids)) for c, tids in obj["groups"])
            return AffinityUndo(int(obj["pid"]), int(obj["starttime"]), groups)
        if kind == "file":
            k = obj.get("kind", "text")
            if k not in ("list", "text", "partition", "subtree"):
                raise UndoFormatError(f"unknown file kind {k!r}")
            return FileUndo(str(obj["path"]), str(obj["value"]), k)
        if kind == "mkdir":
            return MkdirUndo(str(obj["path"]), str(obj["parent_procs"]))
        if kind == "attach":
            return AttachUndo(int(obj["pid"]), int(obj["starttime"]), str(obj["procs_file"]))
        if kind == "migrate":
            return MigrateUndo(int(obj["pid"]), int(obj["starttime"]), _ids(obj["from_nodes"]),
                               _ids(obj["to_nodes"]), bool(obj["reversible"]))
        if kind == "irqbalance_ban":
            # A journal is data: it may only ever name irqbalance's own socket and unit.
            address = str(obj["address"])
            if not _BAN_SOCKET.fullmatch(address.rsplit("/", 1)[-1].lstrip("\0")):
                raise UndoFormatError(f"not an irqbalance socket: {address[:80]!r}")
            return BanUndo(int(obj["pid"]), int(obj["starttime"]), address, _ids(obj["banned"]))
        if kind == "service":
            unit = str(obj["unit"])
            if not _IRQBALANCE_UNIT.fullmatch(unit):
                raise UndoFormatError(f"not an irqbalance unit: {unit[:80]!r}")
            return ServiceUndo(unit)
    except (KeyError, TypeError, ValueError, CpuListError) as exc:
        raise UndoFormatError(f"malformed undo entry {dict(obj)!r:.200}: {exc}") from exc
    raise UndoFormatError(f"unknown undo op {obj.get('op')!r}")


def _ids(value: Any) -> Ids:
    return tuple(int(v) for v in value)


def describe(op: UndoOp) -> str:
    match op:
        case AffinityUndo():
            n = sum(len(t) for _, t in op.groups)
            return f"pid {op.pid}: affinity of {n} thread(s) → " + "; ".join(
                f"{format_cpulist(c)}" for c, _ in op.groups)
        case FileUndo():
            return f"/{op.path} ← {op.value!r}"
        case MkdirUndo():
            return f"remove /{op.path}"
        case AttachUndo():
            return f"pid {op.pid} → /{op.procs_file}"
        case MigrateUndo():
            return (f"pid {op.pid}: pages {format_cpulist(op.to_nodes)} → {format_cpulist(op.from_nodes)}"
                    if op.reversible else f"pid {op.pid}: pages stay (not reversible)")
        case BanUndo():
            return f"irqbalance banned IRQs ← {format_cpulist(op.banned) or 'none'}"
        case ServiceUndo():
            return f"systemctl start {op.unit}"


# ---- restore and verify ---------------------------------------------------------------------------
def _same_process(host: Host, pid: int, starttime: int) -> bool:
    return host.procs.starttime(pid) == starttime


def restore(host: Host, op: UndoOp) -> Outcome:
    """Put the previous state back. Verification is separate (:func:`verify`): restores of later
    actions may only hold once earlier ones are restored too (a cpuset narrows thread masks)."""
    try:
        return _restore(host, op)
    except (HostWriteError, KernelCallError, irqbalance.IrqbalanceError, HostReadError) as exc:
        return Outcome(False, str(exc))


def _restore(host: Host, op: UndoOp) -> Outcome:
    match op:
        case AffinityUndo():
            if not _same_process(host, op.pid, op.starttime):
                return Outcome(True, f"pid {op.pid} has exited")
            live = set(host.procs.tids(op.pid))
            failed: dict[int, int] = {}
            for cpus, tids in op.groups:
                alive = [t for t in tids if t in live]
                failed.update(host.kernel.set_affinities(alive, set(cpus)))
            hard = {t: e for t, e in failed.items() if e != errno.ESRCH}
            if hard:
                tid, code = next(iter(hard.items()))
                why = errno.errorcode.get(code, str(code))
                return Outcome(False, f"{len(hard)} thread(s) not restored (tid {tid}: {why})")
            return Outcome(True)
        case FileUndo():
            host.files.write(op.path, op.value)
            return Outcome(True)
        case MkdirUndo():
            if not host.files.is_dir(op.path):
                return Outcome(True, "already absent")
            for pid in _procs_in(host, f"{op.path}/cgroup.procs"):
                try:
                    host.files.write(op.parent_procs, str(pid))
                except HostWriteError as exc:
                    if exc.errno != errno.ESRCH:
                        raise
            host.files.rmdir(op.path)
            return Outcome(True)
        case AttachUndo():
            if not _same_process(host, op.pid, op.starttime):
                return Outcome(True, f"pid {op.pid} has exited")
            host.files.write(op.procs_file, str(op.pid))
            return Outcome(True)
        case MigrateUndo():
            if not op.reversible:
                return Outcome(True, "pages left where they are: the process had pages on the destination "
                                     "before, and migrating back would move those too")
            if not _same_process(host, op.pid, op.starttime):
                return Outcome(True, f"pid {op.pid} has exited")
            left = host.kernel.migrate_pages(op.pid, op.to_nodes, op.from_nodes)
            return Outcome(True, f"{left} page(s) could not be moved back" if left else "")
        case BanUndo():
            if not _same_process(host, op.pid, op.starttime):
                return Outcome(True, "irqbalance has restarted since (its runtime bans are gone)")
            irqbalance.Client(op.address).set_banned(op.banned)
            return Outcome(True)
        case ServiceUndo():
            res = host.runner.run(["systemctl", "start", op.unit])
            return Outcome(res.ok, res.failure or "")


def _procs_in(host: Host, rel: str) -> list[int]:
    try:
        text = host.files.read_text(rel)
    except HostReadError:
        return []
    return [int(x) for x in text.split() if x.isdigit()]


def verify(host: Host, op: UndoOp) -> Outcome:
    """Does the host hold the previous state again?"""
    try:
        return _verify(host, op)
    except (HostReadError, KernelCallError, irqbalance.IrqbalanceError) as exc:
        return Outcome(False, str(exc))


def _verify(host: Host, op: UndoOp) -> Outcome:
    match op:
        case AffinityUndo():
            if not _same_process(host, op.pid, op.starttime):
                return Outcome(True)
            live = set(host.procs.tids(op.pid))
            for cpus, tids in op.groups:
                alive = [t for t in tids if t in live]
                got = host.kernel.get_affinities(alive)
                want = set(cpus)
                for tid, mask in zip(alive, got.masks, strict=True):
                    if mask is not None and mask != want:
                        return Outcome(False, f"tid {tid} has cpus {format_cpulist(mask)}, "
                                              f"expected {format_cpulist(cpus)}")
            return Outcome(True)
        case FileUndo():
            return _verify_file(host, op)
        case MkdirUndo():
            gone = not host.files.is_dir(op.path)
            return Outcome(gone, "" if gone else f"/{op.path} still exists")
        case AttachUndo():
            if not _same_process(host, op.pid, op.starttime):
                return Outcome(True)
            back = op.pid in _procs_in(host, op.procs_file)
            return Outcome(back, "" if back else f"pid {op.pid} is not in /{op.procs_file}")
        case MigrateUndo():
            return Outcome(True)
        case BanUndo():
            if not _same_process(host, op.pid, op.starttime):
                return Outcome(True)
            now = irqbalance.Client(op.address).banned()
            ok = set(now) == set(op.banned)
            return Outcome(ok, "" if ok else f"irqbalance bans {format_cpulist(now) or 'none'}, "
                                             f"expected {format_cpulist(op.banned) or 'none'}")
        case ServiceUndo():
            res = host.runner.run(["systemctl", "is-active", op.unit])
            return Outcome(res.ok, "" if res.ok else f"{op.unit} is not active")


def _verify_file(host: Host, op: FileUndo) -> Outcome:
    now = host.files.read_text(op.path).strip()
    want = op.value.strip()
    if op.kind == "list":
        try:
            ok = parse_cpulist(now) == parse_cpulist(want)
        except CpuListError:
            ok = False
    elif op.kind == "partition":
        # An invalid partition reads back as "root invalid (<reason>)".
        ok = now.split(" ")[0] == want.split(" ")[0]
    elif op.kind == "subtree":
        # "-cpuset" undoes an enable: cpuset must no longer be listed.
        ok = ("cpuset" in now.split()) == (not want.startswith("-"))
    else:
        ok = now == want
    return Outcome(ok, "" if ok else f"/{op.path} reads {now!r}, expected {want!r}")


def keys(op: UndoOp) -> set[tuple[object, ...]]:
    """The host objects an op restores, to find ops of different actions that overlap."""
    match op:
        case AffinityUndo():
            return {("tid", op.pid, t) for _, tids in op.groups for t in tids}
        case FileUndo():
            return {("file", op.path)}
        case MkdirUndo():
            return {("dir", op.path)}
        case AttachUndo():
            return {("member", op.pid)}
        case MigrateUndo():
            return {("pages", op.pid, *op.from_nodes, -1, *op.to_nodes)}
        case BanUndo():
            return {("irqbalance", op.pid)}
        case ServiceUndo():
            return {("unit", op.unit)}


def _narrow(op: UndoOp, seen: set[tuple[object, ...]]) -> UndoOp | None:
    """``op`` without the objects an earlier op also restores (that one holds the final value)."""
    if isinstance(op, AffinityUndo):
        groups = tuple((cpus, kept) for cpus, tids in op.groups
                       if (kept := tuple(t for t in tids if ("tid", op.pid, t) not in seen)))
        return AffinityUndo(op.pid, op.starttime, groups) if groups else None
    return None if keys(op) <= seen else op


def restore_all(host: Host, ops: Sequence[UndoOp]) -> list[Outcome]:
    """Restore in reverse, then verify, then retry once what did not hold: a thread mask restored
    while the plan's cpuset still narrowed it only holds once the cpuset is restored too.

    When two ops restore the same object (an action binding all threads, a later one the ACL
    thread), the reverse order leaves the earlier op's value, the state before the plan: only that
    one is verified. Outcomes are in the order of ``ops``; notes keep what the restore said.
    """
    done = [Outcome(True)] * len(ops)
    for i in reversed(range(len(ops))):
        done[i] = restore(host, ops[i])
    seen: set[tuple[object, ...]] = set()
    final: list[UndoOp | None] = []
    for op in ops:
        final.append(_narrow(op, seen))
        seen |= keys(op)
    # A fully superseded op's own restore is only an intermediate step: the earlier one decides.
    results = [_merge(done[i], verify(host, f)) if f is not None else _merge(done[i], Outcome(True))
               for i, f in enumerate(final)]
    for i in reversed(range(len(ops))):
        f = final[i]
        if f is not None and not results[i].ok:
            results[i] = _merge(restore(host, f), verify(host, f))
    return results


def _merge(restored: Outcome, verified: Outcome) -> Outcome:
    if verified.ok:
        return Outcome(True, restored.note if restored.ok else "")
    note = verified.note if restored.ok else f"{restored.note}; {verified.note}"
    return Outcome(False, note)
