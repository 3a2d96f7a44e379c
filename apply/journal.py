"""The state directory: one journal and one result per plan id, and a lock.

Layout (``<key>`` = the first 32 hex digits of SHA-256 of the plan id, so any id is a safe name)::

    <state>/.lock                 flock'ed by whoever applies, rolls back or recovers
    <state>/<key>.journal.jsonl   append-only records, below
    <state>/pending/<key>         exists while that journal is unfinished: recovery reads only these
    <state>/<key>.result.json     {"plan_id", "plan_sha256", "state", "message", "result": base64 PlanResult}

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
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from memtopo.apply.errors import StateError
from memtopo.apply.undo import UndoFormatError, UndoOp, from_json, to_json
from memtopo.v1 import plan_pb2 as planpb

JOURNAL_SUFFIX = ".journal.jsonl"
RESULT_SUFFIX = ".result.json"
MAX_JOURNAL_BYTES = 256 << 20


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

    @property
    def unfinished(self) -> bool:
        return bool(self.plan_id) and (not self.ended or self.rollback_open)

    def ops_in_order(self) -> list[tuple[int, str, list[UndoOp]]]:
        """Undo ops by action index, leaving out actions already undone in place."""
        return [(i, aid, ops) for i, (aid, ops) in sorted(self.undo.items()) if aid not in self.restored]


class JournalWriter:
    """Appends to one plan's journal. Records are written at once (a crash of this process keeps
    them: they are in the page cache); ``sync`` makes them durable."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Records held back until the next write (``begin``): one write(2) instead of two, and
        # nothing a crash could lose that recovery needs (no change happens before that write).
        self._held = b""
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StateError(f"{path}: {exc.strerror}") from exc

    def hold(self, records: Sequence[dict[str, Any]]) -> None:
        """Write these with the next :meth:`write` (or :meth:`close`)."""
        self._held += _encode(records)

    def write(self, records: Sequence[dict[str, Any]], sync: bool = False) -> None:
        data = self._held + _encode(records)
        self._held = b""
        try:
            os.write(self._fd, data)
            if sync:
                os.fdatasync(self._fd)
        except OSError as exc:
            raise StateError(f"{self.path}: {exc.strerror}") from exc

    def undo(self, entries: Sequence[tuple[int, str, Sequence[UndoOp]]]) -> None:
        """The previous values of the next changes: one fsync for all of them."""
        self.write([{"t": "undo", "i": i, "action": aid, "ops": [to_json(op) for op in ops]}
                    for i, aid, ops in entries], sync=True)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self._held:
                os.write(self._fd, self._held)
            os.close(self._fd)


# One encoder for every record: json.dumps with non-default separators builds a new one per call,
# which cost as much as the encoding of a plan's two dozen small records.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _encode(records: Sequence[dict[str, Any]]) -> bytes:
    encode = _ENCODER.encode
    return "".join([encode(r) + "\n" for r in records]).encode()


class StateStore:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)

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
        reading every journal of a long-lived state directory each time would grow without end."""
        out: list[JournalState] = []
        pending_dir = self.dir / "pending"
        if not pending_dir.is_dir():
            return out
        for key in sorted(os.listdir(pending_dir)):
            path = self.dir / f"{key}{JOURNAL_SUFFIX}"
            if not path.exists():
                with contextlib.suppress(FileNotFoundError):
                    (pending_dir / key).unlink()
                continue
            st = self._read(path)
            if st.unfinished:
                out.append(st)
            else:
                with contextlib.suppress(FileNotFoundError):
                    (pending_dir / key).unlink()
        return out

    def begin(self, plan: planpb.BindingPlan, sha: str, boot_id: str = "") -> JournalWriter:
        self.mark_open(plan.plan_id)
        w = JournalWriter(self.journal_path(plan.plan_id))
        # Not written on its own: it goes out with the first undo record, whose fsync covers it.
        w.hold([{"t": "begin", "plan_id": plan.plan_id, "plan_sha256": sha, "pid": os.getpid(),
                  "boot_id": boot_id, "time": time.time(),
                  "plan": base64.b64encode(plan.SerializeToString()).decode()}])
        return w

    def append(self, plan_id: str, records: Sequence[dict[str, Any]], sync: bool = False) -> None:
        w = JournalWriter(self.journal_path(plan_id))
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
        path = self.result_path(plan_id)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        body = json.dumps({"plan_id": plan_id, "plan_sha256": sha, "state": planpb.PlanResult.State.Name(result.state),
                           "message": result.message,
                           "result": base64.b64encode(result.SerializeToString()).decode()})
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:  # the state directory is made on first use
                self.ensure()
                fd = os.open(tmp, flags, 0o600)
            try:
                os.write(fd, body.encode())
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            raise StateError(f"{path}: {exc.strerror}") from exc

    def load_result(self, plan_id: str) -> StoredResult | None:
        return self._load(self.result_path(plan_id))

    def _load(self, path: Path) -> StoredResult | None:
        try:
            obj = json.loads(path.read_text())
            result = planpb.PlanResult()
            result.ParseFromString(base64.b64decode(obj["result"]))
            return StoredResult(str(obj["plan_id"]), str(obj["plan_sha256"]), result)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, DecodeError) as exc:
            raise StateError(f"{path}: unreadable result: {exc}") from exc

    def results(self) -> list[StoredResult]:
        if not self.dir.is_dir():
            return []
        out = []
        for path in sorted(self.dir.glob(f"*{RESULT_SUFFIX}")):
            stored = self._load(path)
            if stored is not None:
                out.append(stored)
        return out

    # ---- journals ----------------------------------------------------------------------------------
    def read_journal(self, plan_id: str) -> JournalState | None:
        path = self.journal_path(plan_id)
        return self._read(path) if path.exists() else None

    def journals(self) -> list[JournalState]:
        if not self.dir.is_dir():
            return []
        return [self._read(p) for p in sorted(self.dir.glob(f"*{JOURNAL_SUFFIX}"))]

    def _read(self, path: Path) -> JournalState:
        st = JournalState(path.name.removesuffix(JOURNAL_SUFFIX))
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_JOURNAL_BYTES + 1)
        except OSError as exc:
            st.problems.append(f"{path}: {exc.strerror}")
            return st
        if len(data) > MAX_JOURNAL_BYTES:
            st.problems.append(f"{path}: larger than {MAX_JOURNAL_BYTES} bytes")
        lines = data.decode("utf-8", "replace").split("\n")
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                self._apply_record(st, rec)
            except (ValueError, KeyError, TypeError, UndoFormatError, DecodeError) as exc:
                if n >= len(lines) - 2:
                    continue  # torn last record: its change never started
                st.problems.append(f"{path} line {n + 1}: {exc}")
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
