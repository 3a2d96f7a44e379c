"""The state directory: one journal and one result per plan id, and a lock.

Layout (``<key>`` = the first 32 hex digits of SHA-256 of the plan id, so any id is a safe name)::

    <state>/.lock                 flock'ed by whoever applies, rolls back or recovers
    <state>/<key>.journal.jsonl   append-only records, below
    <state>/pending/<key>         exists while that journal is unfinished: recovery reads only these
    <state>/<key>.result.json     {"plan_id", "plan_sha256", "state", "message", "result": base64 PlanResult}
    <state>/<key>.result.tmp      the next result, written there and renamed into place

Journal records (one JSON object per line, ``t`` = type)::

    begin   plan_id, plan_sha256, plan (base64 of the serialized BindingPlan), pid, time
                                                              ← written with the first undo record
    undo    i (action index), action, ops: [undo op, …]     ← fsynced before the change it guards
    done    action, status                                    ← after an action applied
    restored action                                           ← an optional action undone in place
    end     state                                             ← the result file is written
    rollback                                                  ← a rollback (or recovery) started
    rolled_back state                                         ← and finished

A journal with ``begin`` and no ``end``, or a ``rollback`` with no ``rolled_back`` after it, is
unfinished: the next :meth:`Engine.recover` restores it. A torn last line (a crash inside a write)
is ignored: the change it was about to guard never started, because undo records are fsynced first.
One fsync per record batch (one per action or group of actions), never one per thread.

The pending marker is made after the first write (``begin`` and the first undo records) and before
the first change, so a marker always names a journal that holds a ``begin``: one that is missing,
empty, not a regular file or without a readable ``begin`` was damaged after the fact, and is
reported and kept (:class:`JournalState` ``unreadable``), never dropped.

A full disk: ``<state>/.reserve`` is a file of :data:`RESERVE_BYTES` real blocks, checked (and
allocated again if it was spent) once per apply before its first change; a run that cannot have it
changes nothing. Every write is checked for a short count and a failed one is cut back off its
file, so a record is whole or absent; a write that meets ENOSPC gives the reserve up to the
filesystem and is tried once more, so the records and the result after a change find room. The
reserve is one file kept across runs rather than blocks preallocated in each journal: on ext4
giving back unused preallocated blocks costs a truncate (milliseconds, every run), and keeping
them would grow the directory by the reservation with every plan.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from memtopo.apply.errors import StateError
from memtopo.apply.host import StateFiles, write_all
from memtopo.apply.undo import FileUndo, UndoFormatError, UndoOp, from_json, to_json
from memtopo.hostfs import read_regular
from memtopo.text import excerpt
from memtopo.v1 import plan_pb2 as planpb

JOURNAL_SUFFIX = ".journal.jsonl"
RESULT_SUFFIX = ".result.json"
RESULT_TMP_SUFFIX = ".result.tmp"
RESERVE_NAME = ".reserve"
# Room for what a run writes after its first change (later undo records, done and end records,
# the result): a few KiB for most plans.
RESERVE_BYTES = 32 << 10
MAX_JOURNAL_BYTES = 256 << 20
MAX_RESULT_BYTES = 64 << 20
# What an error message may quote of a damaged file.
EXCERPT_CHARS = 80

# The record type and action id of a damaged line, where they survived.
_TYPE_RE = re.compile(r'"t"\s*:\s*"(\w{1,16})"')
_ACTION_RE = re.compile(r'"action"\s*:\s*"((?:[^"\\]|\\.){1,256})"')


def plan_key(plan_id: str) -> str:
    return hashlib.sha256(plan_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def plan_hash(plan: planpb.BindingPlan) -> str:
    return hashlib.sha256(plan.SerializeToString(deterministic=True)).hexdigest()


@dataclass(frozen=True)
class StoredResult:
    plan_id: str
    plan_sha256: str
    result: planpb.PlanResult


@dataclass
class JournalState:
    key: str
    plan_id: str = ""
    plan_sha256: str = ""
    plan: planpb.BindingPlan | None = None
    # Last undo record per action index (a re-prepared action supersedes its earlier record).
    undo: dict[int, tuple[str, list[UndoOp]]] = field(default_factory=dict)
    done: dict[str, str] = field(default_factory=dict)
    restored: set[str] = field(default_factory=set)
    ended: bool = False
    rollback_open: bool = False
    rolled_back: bool = False
    # /proc/sys/kernel/random/boot_id of the boot that wrote it ("" in journals from before).
    boot_id: str = ""
    problems: list[str] = field(default_factory=list)
    path: str = ""
    # Why the journal as a whole cannot be used (unreadable, not a regular file, no ``begin``).
    unreadable: str = ""
    # Damaged undo records: (line number, the action id where it survived, else "").
    damaged: list[tuple[int, str]] = field(default_factory=list)

    @property
    def unfinished(self) -> bool:
        return bool(self.plan_id) and (not self.ended or self.rollback_open)

    def unrestorable(self, plan_actions: Sequence[str]) -> dict[str, str]:
        """Actions whose previous state may be lost in a damaged line: {action id: why}. A damaged
        undo record that still names its action names that one; one that does not names every
        action of the plan with no readable undo record (any of them may have been changed)."""
        out: dict[str, str] = {}
        read = {aid for aid, _ in self.undo.values()}
        for line, aid in self.damaged:
            if aid:
                out.setdefault(aid, f"its undo record (journal line {line}) is unreadable")
            else:
                for a in plan_actions:
                    if a not in read:
                        out.setdefault(a, f"journal line {line} is unreadable and may have held its undo record")
        return out

    def ops_in_order(self) -> list[tuple[int, str, list[UndoOp]]]:
        """Undo ops by action index, leaving out actions already undone in place."""
        return [(i, aid, ops) for i, (aid, ops) in sorted(self.undo.items()) if aid not in self.restored]


# Called when a write meets a full disk: frees the state directory's reserve; True if it freed any.
OnFull = Callable[[], bool]


class JournalWriter:
    """Appends to one plan's journal. Records are written at once (a crash of this process keeps
    them: they are in the page cache); ``sync`` makes them durable. A write that fails or comes up
    short is cut back off the file; on a full disk the state directory's reserve is given up and
    the write tried once more; then it raises StateError. The journal holds whole records only."""

    def __init__(self, path: Path, io: StateFiles | None = None, on_full: OnFull | None = None) -> None:
        self.path = path
        self.io = io or StateFiles()
        self.on_full = on_full
        # Records held back until the next write (``begin``): one write(2) instead of two, and
        # nothing a crash could lose that recovery needs (no change happens before that write).
        self._held = b""
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StateError(f"{path}: {exc.strerror}") from exc
        try:
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            os.close(self._fd)
            raise StateError(f"{path}: {exc.strerror}") from exc

    def hold(self, records: Sequence[dict[str, Any]]) -> None:
        """Write these with the next :meth:`write` (or :meth:`close`)."""
        self._held += _encode(records)

    def write(self, records: Sequence[dict[str, Any]], sync: bool = False) -> None:
        self.write_encoded(_encode(records), sync)

    def write_encoded(self, lines: bytes, sync: bool = False) -> None:
        """Records already encoded as JSON lines (the one-per-action kinds skip the dict)."""
        data = self._held + lines
        self._held = b""
        try:
            self._write(data, sync)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or self.on_full is None or not self.on_full():
                raise StateError(f"{self.path}: {exc.strerror or exc}") from exc
            try:
                self._write(data, sync)
            except OSError as again:
                raise StateError(f"{self.path}: {again.strerror or again} (after giving up the "
                                 "state directory's reserve)") from again
        self._size += len(data)

    def _write(self, data: bytes, sync: bool) -> None:
        try:
            write_all(self.io, self._fd, data)
            if sync:
                self.io.fdatasync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                self.io.truncate(self._fd, self._size)
            raise

    def undo(self, entries: Sequence[tuple[int, str, Sequence[UndoOp]]]) -> None:
        """The previous values of the next changes: one fsync for all of them."""
        self.write_encoded(b"".join(_undo_line(i, aid, ops) for i, aid, ops in entries), sync=True)

    def done(self, applied: Sequence[tuple[str, str]]) -> None:
        """"done" records of (action id, status name): informational, not synced."""
        text = _ENCODER.encode
        self.write_encoded("".join([f'{{"t":"done","action":{text(aid)},"status":{text(status)}}}\n'
                                    for aid, status in applied]).encode())

    def close(self) -> None:
        """Idempotent: the engine closes on every way out of a run."""
        if self._fd < 0:
            return
        with contextlib.suppress(StateError):
            if self._held:
                self.write([])
        fd, self._fd = self._fd, -1
        with contextlib.suppress(OSError):
            os.close(fd)


def _commit(tmp: Path, final: Path, body: bytes, io: StateFiles) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o600)
    try:
        write_all(io, fd, body)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, final)


# One encoder for every record: json.dumps with non-default separators builds a new one per call,
# which cost as much as the encoding of a plan's two dozen small records.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _encode(records: Sequence[dict[str, Any]]) -> bytes:
    encode = _ENCODER.encode
    return "".join([encode(r) + "\n" for r in records]).encode()


def _undo_line(i: int, aid: str, ops: Sequence[UndoOp]) -> bytes:
    """The undo record of one action, as _encode writes it: a file op (one per IRQ action, and most
    of any plan's) is written field by field, the rest through the encoder."""
    text = _ENCODER.encode
    parts = [f'{{"op":"file","path":{text(op.path)},"value":{text(op.value)},"kind":{text(op.kind)}}}'
             if type(op) is FileUndo else text(to_json(op)) for op in ops]
    return f'{{"t":"undo","i":{i:d},"action":{text(aid)},"ops":[{",".join(parts)}]}}\n'.encode()


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symlink (refused)"
    if exc.errno == errno.ENOENT:
        return "missing"
    return str(exc.strerror or exc)


class StateStore:
    def __init__(self, state_dir: str | os.PathLike[str], io: StateFiles | None = None) -> None:
        self.dir = Path(state_dir)
        self.io = io or StateFiles()

    def ensure(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise StateError(f"state directory {self.dir}: {exc.strerror}") from exc

    @contextlib.contextmanager
    def lock(self, timeout_s: float) -> Iterator[None]:
        """Exclusive across processes: recovery must never roll back a plan another live process is
        still applying. The kernel drops the lock when its holder dies."""
        self.ensure()
        try:
            fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StateError(f"{self.dir}/.lock: {exc.strerror}") from exc
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StateError(f"{self.dir} is locked by another memtopo apply/rollback") from None
                    time.sleep(0.02)
            yield
        finally:
            os.close(fd)

    def journal_path(self, plan_id: str) -> Path:
        return self.dir / f"{plan_key(plan_id)}{JOURNAL_SUFFIX}"

    def result_path(self, plan_id: str) -> Path:
        return self.dir / f"{plan_key(plan_id)}{RESULT_SUFFIX}"

    def _marker(self, plan_id: str) -> Path:
        return self.dir / "pending" / plan_key(plan_id)

    def mark_open(self, plan_id: str) -> None:
        """Before a journal gets records that leave it unfinished (begin, rollback)."""
        marker = self._marker(plan_id)
        try:
            try:
                fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:  # the first plan of this state directory
                self.ensure()
                marker.parent.mkdir(exist_ok=True, mode=0o700)
                fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.close(fd)
        except OSError as exc:
            raise StateError(f"{marker}: {exc.strerror}") from exc

    def mark_closed(self, plan_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._marker(plan_id).unlink()

    def pending(self) -> list[JournalState]:
        """Unfinished journals, found through their markers: every apply looks for them, and
        reading every journal of a long-lived state directory each time would grow without end.
        A marker whose journal cannot be used is returned with ``unreadable`` set, and kept."""
        out: list[JournalState] = []
        pending_dir = self.dir / "pending"
        if not pending_dir.is_dir():
            return out
        for key in sorted(os.listdir(pending_dir)):
            path = self.dir / f"{key}{JOURNAL_SUFFIX}"
            st = self._read(path)
            if not st.plan_id and not st.unreadable:
                st.unreadable = "no readable begin record (truncated or overwritten)"
            if st.unreadable or st.unfinished:
                out.append(st)
            else:
                with contextlib.suppress(FileNotFoundError):
                    (pending_dir / key).unlink()
        return out

    def marker_path(self, key: str) -> Path:
        return self.dir / "pending" / key

    # ---- the reserve -----------------------------------------------------------------------------
    def reserve(self) -> None:
        """Before a run's first change: the reserve file holds its blocks (allocated again if a
        full disk took them). StateError when the filesystem cannot give them: nothing changed."""
        path = self.dir / RESERVE_NAME
        try:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:
                self.ensure()  # the state directory is made on first use
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                st = os.fstat(fd)
                if st.st_size < RESERVE_BYTES or st.st_blocks * 512 < RESERVE_BYTES:
                    self.io.allocate(fd, RESERVE_BYTES)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StateError(f"{path}: cannot reserve {RESERVE_BYTES} bytes in the state directory before "
                             f"changing anything: {exc.strerror or exc}") from exc

    def spend_reserve(self) -> bool:
        """A write met a full disk: give the reserve's blocks back. True if it held any."""
        path = self.dir / RESERVE_NAME
        try:
            if os.lstat(path).st_blocks == 0:
                return False
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                self.io.truncate(fd, 0)
            finally:
                os.close(fd)
        except OSError:
            return False
        return True

    def begin(self, plan: planpb.BindingPlan, sha: str, boot_id: str = "") -> JournalWriter:
        """The writer of a new run; ``begin`` goes out with its first write. The caller marks the
        journal open after that write, and only then lets the writer spend the reserve (``on_full``):
        it is for the writes after a change, and before the first one a full disk only refuses."""
        try:
            w = JournalWriter(self.journal_path(plan.plan_id), self.io)
        except StateError:
            if self.dir.is_dir():
                raise
            self.ensure()  # the state directory is made on first use
            w = JournalWriter(self.journal_path(plan.plan_id), self.io)
        # Not written on its own: it goes out with the first undo record, whose fsync covers it.
        w.hold([{"t": "begin", "plan_id": plan.plan_id, "plan_sha256": sha, "pid": os.getpid(),
                  "boot_id": boot_id, "time": time.time(),
                  "plan": base64.b64encode(plan.SerializeToString()).decode()}])
        return w

    def append(self, plan_id: str, records: Sequence[dict[str, Any]], sync: bool = False) -> None:
        w = JournalWriter(self.journal_path(plan_id), self.io, self.spend_reserve)
        try:
            w.write(records, sync)
        finally:
            w.close()

    # ---- results -----------------------------------------------------------------------------------
    def save_result(self, plan_id: str, sha: str, result: planpb.PlanResult) -> None:
        """Atomically (write beside, rename): a reader sees the old result or the new one.

        Not fsynced, unlike undo records: what a result describes (affinities, cpusets, IRQ masks)
        does not survive the reboot that would lose it, and a lost result only means the plan id
        can be applied again. The proto is stored serialized (proto3 JSON costs more than the
        rest of a plan); ``state`` and ``message`` beside it are for people reading the directory.
        """
        body = json.dumps({"plan_id": plan_id, "plan_sha256": sha, "state": planpb.PlanResult.State.Name(result.state),
                           "message": result.message,
                           "result": base64.b64encode(result.SerializeToString()).decode()})
        final = self.result_path(plan_id)
        tmp = self.dir / f"{plan_key(plan_id)}{RESULT_TMP_SUFFIX}"
        try:
            try:
                _commit(tmp, final, body.encode(), self.io)
            except FileNotFoundError:
                self.ensure()  # the state directory is made on first use
                _commit(tmp, final, body.encode(), self.io)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not self.spend_reserve():
                raise StateError(f"{final}: {exc.strerror or exc}") from exc
            try:
                _commit(tmp, final, body.encode(), self.io)
            except OSError as again:
                raise StateError(f"{final}: {again.strerror or again} (after giving up the state directory's "
                                 "reserve)") from again

    def load_result(self, plan_id: str) -> StoredResult | None:
        return self._load(self.result_path(plan_id))

    def _load(self, path: Path) -> StoredResult | None:
        try:
            data = read_regular(path, MAX_RESULT_BYTES, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateError(f"{path}: unreadable result: {_reason(exc)}") from exc
        if len(data) > MAX_RESULT_BYTES:
            raise StateError(f"{path}: unreadable result: larger than {MAX_RESULT_BYTES} bytes")
        try:
            obj = json.loads(data)
            result = planpb.PlanResult()
            result.ParseFromString(base64.b64decode(obj["result"], validate=True))
            return StoredResult(str(obj["plan_id"]), str(obj["plan_sha256"]), result)
        except (ValueError, KeyError, TypeError, DecodeError) as exc:
            raise StateError(f"{path}: unreadable result ({type(exc).__name__}): "
                             f"{excerpt(data.decode('utf-8', 'replace'), EXCERPT_CHARS)}") from exc

    def results(self) -> list[StoredResult]:
        """Every stored result; one that cannot be read is listed as such (state unspecified, the
        reason in its message, the plan id from its journal where that says), not an error for all."""
        if not self.dir.is_dir():
            return []
        out = []
        for path in sorted(self.dir.glob(f"*{RESULT_SUFFIX}")):
            try:
                stored = self._load(path)
            except StateError as exc:
                key = path.name.removesuffix(RESULT_SUFFIX)
                js = self._read(self.dir / f"{key}{JOURNAL_SUFFIX}")
                bad = planpb.PlanResult(plan_id=js.plan_id, state=planpb.PlanResult.STATE_UNSPECIFIED,
                                        message=f"{exc}; the plan's journal is {self.dir / (key + JOURNAL_SUFFIX)}")
                out.append(StoredResult(js.plan_id, js.plan_sha256, bad))
                continue
            if stored is not None:
                out.append(stored)
        return out

    # ---- journals ----------------------------------------------------------------------------------
    def read_journal(self, plan_id: str) -> JournalState | None:
        """None when this plan id has no journal; one that exists but cannot be used comes back
        with ``unreadable`` set."""
        path = self.journal_path(plan_id)
        if not os.path.lexists(path) and not os.path.lexists(self.marker_path(plan_key(plan_id))):
            return None
        st = self._read(path)
        if not st.plan_id and not st.unreadable:
            st.unreadable = "no readable begin record (truncated or overwritten)"
        return st

    def journals(self) -> list[JournalState]:
        if not self.dir.is_dir():
            return []
        return [self._read(p) for p in sorted(self.dir.glob(f"*{JOURNAL_SUFFIX}"))]

    def _read(self, path: Path) -> JournalState:
        st = JournalState(path.name.removesuffix(JOURNAL_SUFFIX), path=str(path))
        try:
            data = read_regular(path, MAX_JOURNAL_BYTES, follow_symlinks=False)
        except OSError as exc:
            st.unreadable = _reason(exc)
            st.problems.append(f"{path}: {st.unreadable}")
            return st
        if len(data) > MAX_JOURNAL_BYTES:
            st.unreadable = f"larger than {MAX_JOURNAL_BYTES} bytes"
            st.problems.append(f"{path}: {st.unreadable}")
            return st
        lines = data.decode("utf-8", "replace").split("\n")
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                self._apply_record(st, rec)
            except (ValueError, KeyError, TypeError, AttributeError, UndoFormatError, DecodeError) as exc:
                if n == len(lines) - 1:
                    continue  # torn last record (no newline after it): its change never started
                st.problems.append(f"{path} line {n + 1}: {type(exc).__name__}: {excerpt(str(exc), EXCERPT_CHARS)}")
                kind = _TYPE_RE.search(line[:200])
                if kind is None or kind.group(1) == "undo":
                    aid = _ACTION_RE.search(line[:600])
                    st.damaged.append((n + 1, _unescape(aid.group(1)) if aid else ""))
        return st

    @staticmethod
    def _apply_record(st: JournalState, rec: dict[str, Any]) -> None:
        kind = rec["t"]
        if kind == "begin":
            st.plan_id = str(rec["plan_id"])
            st.plan_sha256 = str(rec["plan_sha256"])
            st.boot_id = str(rec.get("boot_id", ""))
            plan = planpb.BindingPlan()
            plan.ParseFromString(base64.b64decode(rec["plan"]))
            st.plan = plan
        elif kind == "undo":
            st.undo[int(rec["i"])] = (str(rec["action"]), [from_json(o) for o in rec["ops"]])
            st.restored.discard(str(rec["action"]))
        elif kind == "done":
            st.done[str(rec["action"])] = str(rec["status"])
        elif kind == "restored":
            st.restored.add(str(rec["action"]))
        elif kind == "end":
            st.ended = True
        elif kind == "rollback":
            st.rollback_open = True
        elif kind == "rolled_back":
            st.rollback_open = False
            st.rolled_back = True


def _unescape(text: str) -> str:
    try:
        return str(json.loads(f'"{text}"'))
    except ValueError:
        return text
