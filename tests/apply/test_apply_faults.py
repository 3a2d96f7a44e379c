"""The apply engine when the state directory fails: a full disk at every write, unreadable and
damaged journals, a corrupt result, and `memtopo apply` beside a running agent.

The write-point matrix runs through the engine's host layer (apply.host.StateFiles) on the fake
machine of tests/apply_fakes.py, so it needs no mount. The disk-full matrix mounts a small tmpfs
as the state directory and runs the real `memtopo apply` CLI against a real child process with 200
threads (root only; skipped where mount is not permitted).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from memtopo.apply.errors import StateError, UnreadableJournalError
from memtopo.apply.host import StateFiles, parse_proc_locks
from memtopo.protojson import to_json
from memtopo.v1 import plan_pb2 as planpb
from tests.apply_fakes import FakeMachine, cpuset, irq, machine, plan, threads

S = planpb.ActionResult
P = planpb.PlanResult
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def m(tmp_path: Path) -> FakeMachine:
    return machine(tmp_path)


def _three() -> planpb.BindingPlan:
    return plan("three", irq("i", [2], number=24),
                cpuset("c", "memtopo/x", cpus=[0, 1], mems=[0], create=True, attach=[200]),
                threads("t", 100, [1], all=True))


def _host(m: FakeMachine) -> tuple[dict[int, set[int]], dict[str, str]]:
    return (dict(m.kernel.masks), {k: v for k, v in m.snapshot().items() if not k.startswith("state")})


# ---- a failure at every write point ----------------------------------------------------------------
@dataclass
class Call:
    op: str      # write | fdatasync | allocate
    what: str    # the journal records written ("begin+undo"), "result", or "reserve"


def _what(fd: int, data: bytes | memoryview | None) -> str:
    name = os.readlink(f"/proc/self/fd/{fd}")
    if ".result" in name:
        return "result"
    if name.endswith(".reserve"):
        return "reserve"
    if data is None:
        return "journal"
    kinds = []
    for line in bytes(data).decode(errors="replace").splitlines():
        try:
            kinds.append(str(json.loads(line)["t"]))
        except (ValueError, KeyError, TypeError):
            kinds.append("?")
    return "+".join(dict.fromkeys(kinds)) or "journal"


class FaultyState(StateFiles):
    """Counts every state-directory system call and fails the ``fail_at``-th. Modes: "enospc"
    (that call answers ENOSPC once: a disk that was full for a moment, or that the state
    directory's reserve relieves), "full" (that call and every later write answer ENOSPC: full
    beyond the reserve), "short" (that write writes half its bytes, then full as above)."""

    def __init__(self, fail_at: int = -1, mode: str = "enospc") -> None:
        self.calls: list[Call] = []
        self.fail_at = fail_at
        self.mode = mode
        self.full = False

    def _hit(self, op: str, fd: int, data: bytes | memoryview | None = None) -> bool:
        self.calls.append(Call(op, _what(fd, data)))
        return len(self.calls) - 1 == self.fail_at

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self._hit("write", fd, data):
            self.full = self.mode in ("full", "short")
            if self.mode == "short" and len(data) > 1:
                return super().write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(fd, data)

    def fdatasync(self, fd: int) -> None:
        if self._hit("fdatasync", fd):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().fdatasync(fd)

    def allocate(self, fd: int, length: int) -> bool:
        if self._hit("allocate", fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().allocate(fd, length)


def _machine_with(tmp: Path, io: StateFiles) -> FakeMachine:
    tmp.mkdir(parents=True, exist_ok=True)
    m = machine(tmp)
    object.__setattr__(m.host, "state", io)
    return m


def write_point_matrix(tmp: Path) -> list[tuple[int, str, str, str, str, bool]]:
    """(point, call, mode, apply state, host after, rollback/recovery clean) for every state
    directory call of one apply of `_three`, failing each in turn."""
    tmp.mkdir(parents=True, exist_ok=True)
    probe = FaultyState()
    clean = _machine_with(tmp / "clean", probe)
    start = _host(clean)
    assert clean.engine().apply(_three()).state == P.STATE_APPLIED
    applied = _host(clean)
    rows = []
    for n, call in enumerate(probe.calls):
        for mode in (("enospc", "full", "short") if call.op == "write" else ("enospc",)):
            io = FaultyState(n, mode)
            m = _machine_with(tmp / f"p{n}{mode}", io)
            r = m.engine().apply(_three())
            after = _host(m)
            host = "changed (as applied)" if after == applied else "unchanged" if after == start else "HALF"
            # A later process: recovery must not change what this left, and an applied plan must
            # roll back from what is on disk.
            object.__setattr__(m.host, "state", StateFiles())
            m.engine().recover()
            if r.state == P.STATE_APPLIED:
                rb = m.engine().rollback("three")
                clean_after = rb.state == P.STATE_ROLLED_BACK and _host(m) == start
            else:
                clean_after = _host(m) == start
            rows.append((n, f"{call.op} {call.what}", mode, P.State.Name(r.state), host, clean_after))
    return rows


def test_a_write_failure_at_any_point_leaves_the_host_whole(tmp_path: Path) -> None:
    rows = write_point_matrix(tmp_path)
    points = {what for _, what, *_ in rows}
    # every kind of write point was hit: the reserve, begin with the first undo records, each later
    # undo record and its fsync, the done records, the result, the end record
    assert {"allocate reserve", "write begin+undo", "fdatasync journal", "write undo",
            "write done", "write result", "write end"} <= points, points
    for n, what, mode, state, host, clean_after in rows:
        assert host != "HALF", (n, what, mode, state)
        assert (state == "STATE_APPLIED") == (host == "changed (as applied)"), (n, what, mode, state, host)
        assert clean_after, (n, what, mode, state)
    by_point = {(what, mode): state for _, what, mode, state, _, _ in rows}
    # nothing changes without the reserve; a write after the first change that fails beyond it
    # restores everything; one the reserve relieves goes through; only the end record, written
    # after the result is stored, leaves the plan applied when it fails (recovery closes the journal)
    assert by_point[("allocate reserve", "enospc")] == "STATE_ROLLED_BACK"
    # before the first change a full disk refuses: the reserve is kept for the writes after one
    assert by_point[("write begin+undo", "enospc")] == "STATE_ROLLED_BACK"
    assert by_point[("write result", "full")] == "STATE_ROLLED_BACK"
    assert by_point[("write result", "short")] == "STATE_ROLLED_BACK"
    assert by_point[("write result", "enospc")] == "STATE_APPLIED"
    assert by_point[("write done", "full")] == "STATE_ROLLED_BACK"
    assert by_point[("write undo", "full")] == "STATE_ROLLED_BACK"
    assert by_point[("write end", "full")] == "STATE_APPLIED"


def test_a_short_result_write_is_rolled_back_and_reported(tmp_path: Path) -> None:
    probe = FaultyState()
    assert _machine_with(tmp_path / "probe", probe).engine().apply(_three()).state == P.STATE_APPLIED
    at = next(i for i, c in enumerate(probe.calls) if c.op == "write" and c.what == "result")
    m = _machine_with(tmp_path / "m", FaultyState(at, "short"))
    start = _host(m)
    r = m.engine().apply(_three())
    assert r.state == P.STATE_ROLLED_BACK, r
    assert "result could not be stored" in r.message and "No space left" in r.message
    assert "reserve" in r.message  # the reserve was given up first, and did not suffice
    assert {a.action_id: S.Status.Name(a.status) for a in r.actions} == {
        "i": "STATUS_ROLLED_BACK", "c": "STATUS_ROLLED_BACK", "t": "STATUS_ROLLED_BACK"}
    assert _host(m) == start
    # nothing half-written is left for a reader: no result, or a whole one
    for res in (m.state_dir).glob("*.result.json"):
        json.loads(res.read_text())


def test_the_reserve_is_allocated_once_not_per_apply_or_record(tmp_path: Path) -> None:
    io = FaultyState()
    m = _machine_with(tmp_path, io)
    for n in range(3):
        p = plan(f"many{n}", *[irq(f"i{k}", [(k + n) % 8], number=q) for k, q in enumerate((24, 40, 41, 42, 50, 51))],
                 cpuset("c", "memtopo/x", cpus=[n % 2], mems=[0], create=True, attach=[200]),
                 threads("t", 100, [1 + n % 2], all=True))
        assert m.engine().apply(p).state == P.STATE_APPLIED
    assert [c.what for c in io.calls if c.op == "allocate"] == ["reserve"]
    # given up to a full disk, it is allocated again by the next apply, before its first change
    assert m.engine().store.spend_reserve()
    assert m.engine().apply(plan("again", irq("i", [5], number=24))).state == P.STATE_APPLIED
    assert [c.what for c in io.calls if c.op == "allocate"] == ["reserve", "reserve"]
    assert (m.state_dir / ".reserve").stat().st_blocks * 512 >= 32 << 10


# ---- disk-full matrix on a real tmpfs --------------------------------------------------------------
CHILD = r"""
import threading, os, sys
stop = threading.Event()
ts = [threading.Thread(target=stop.wait, daemon=True) for _ in range(199)]
for t in ts: t.start()
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


@contextlib.contextmanager
def _tmpfs(path: Path, size: int) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()[:200]}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def _fill_to(path: Path, free: int) -> int:
    """Leave ``free`` bytes free on the filesystem at ``path``; what is free after."""
    st = os.statvfs(path)
    avail = st.f_bavail * st.f_frsize
    with open(path / "filler", "wb") as f:
        f.write(b"\0" * max(0, avail - free))
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def _threads_child() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _masks(pid: int) -> dict[int, frozenset[int]]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            out[int(t)] = frozenset(os.sched_getaffinity(int(t)))
    return out


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memtopo.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)


def disk_full_matrix(tmp: Path, levels: Sequence[int], reserved: bool = False) -> list[dict[str, object]]:
    """``reserved``: the state directory was used before the disk filled up (its reserve exists)."""
    cpus = sorted(os.sched_getaffinity(0))
    rows: list[dict[str, object]] = []
    for free in levels:
        state = tmp / f"state{free}{'r' if reserved else ''}"
        with _tmpfs(state, 1 << 20), _threads_child() as child:
            if reserved:
                from memtopo.apply.journal import StateStore
                StateStore(state).reserve()
            got = _fill_to(state, free)
            before = _masks(child.pid)
            p = plan(f"full{free}", threads("pin", child.pid, [cpus[-1]], all=True))
            plan_file = tmp / f"plan{free}.json"
            plan_file.write_text(to_json(p))
            try:
                res = _cli("apply", str(plan_file), "--state-dir", str(state), "--irqbalance", "leave")
                changed = _masks(child.pid) != before
                row: dict[str, object] = {"free": got, "exit": res.returncode, "host_changed": changed,
                                          "said": (res.stdout.splitlines() or [""])[0] or res.stderr}
                with contextlib.suppress(OSError):
                    row["reserve_left"] = (state / ".reserve").stat().st_blocks * 512
                if changed:
                    (state / "filler").unlink()  # the operator makes room; rollback must work
                    rb = _cli("rollback", p.plan_id, "--state-dir", str(state))
                    row["rollback_exit"] = rb.returncode
                    row["rollback_said"] = ((rb.stdout.splitlines() or [""])[0] or rb.stderr)[:200]
                    row["restored"] = _masks(child.pid) == before
                rows.append(row)
            finally:
                for tid, mask in before.items():
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(tid, mask)
    return rows


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts a tmpfs and changes real affinities")
def test_disk_full_matrix_on_a_small_tmpfs(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two allowed CPUs")
    rows = disk_full_matrix(tmp_path, (4096, 8192, 12288, 65536, 262144))
    for row in rows:
        if row["exit"] == 0:
            assert row["host_changed"] and row["rollback_exit"] == 0 and row["restored"], row
        else:
            assert not row["host_changed"], row
            assert row["exit"] == 1 and "cannot reserve" in str(row["said"]), row
    assert rows[0]["exit"] == 1 and rows[-1]["exit"] == 0, rows


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts a tmpfs and changes real affinities")
def test_disk_full_after_the_reserve_was_made_spends_it_and_stays_whole(tmp_path: Path) -> None:
    """The disk filled up after the state directory was in use: the writes after the change use
    the reserve; with no room even for the first record nothing changes."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two allowed CPUs")
    rows = disk_full_matrix(tmp_path, (0, 4096, 8192), reserved=True)
    for row in rows:
        if row["exit"] == 0:
            assert row["host_changed"] and row["rollback_exit"] == 0 and row["restored"], row
        else:
            assert not row["host_changed"] and row["exit"] == 1, row
    assert rows[0]["exit"] == 1 and "No space left" in str(rows[0]["said"]), rows
    assert rows[1]["exit"] == 0 and rows[1]["reserve_left"] == 0, rows  # the result found room in the reserve


# ---- unreadable and damaged journals ---------------------------------------------------------------
def _interrupted(m: FakeMachine) -> Path:
    """Apply `_three` and die after its second action: an unfinished journal, the host changed."""
    class Crash(BaseException):
        pass

    def hook(event: str, action: planpb.PlanAction) -> None:
        if event == "after_action" and action.id == "c":
            raise Crash

    with pytest.raises(Crash):
        m.engine(hook=hook).apply(_three())
    return m.engine().store.journal_path("three")


@pytest.mark.parametrize("damage", ["empty", "garbage", "symlink", "fifo", "missing"])
def test_an_unreadable_pending_journal_is_kept_reported_and_blocks_applies(m: FakeMachine, damage: str) -> None:
    journal = _interrupted(m)
    changed = _host(m)
    if damage == "empty":
        journal.write_bytes(b"")
    elif damage == "garbage":
        journal.write_bytes(os.urandom(3000).replace(b"\n", b"x"))
    elif damage == "symlink":
        journal.unlink()
        journal.symlink_to("/etc/passwd")
    elif damage == "fifo":
        journal.unlink()
        os.mkfifo(journal)
    else:
        journal.unlink()
    content = journal.read_bytes() if damage in ("empty", "garbage") else None
    eng = m.engine()
    assert eng.recover() == []
    [bad] = eng.unreadable
    assert bad.path == str(journal) and bad.unreadable
    # kept as it was, marker included; nothing restored behind the operator's back
    assert os.path.lexists(journal) or damage == "missing"
    if content is not None:
        assert journal.read_bytes() == content
    marker = m.state_dir / "pending" / bad.key
    assert marker.exists()
    assert _host(m) == changed
    with pytest.raises(UnreadableJournalError, match="cannot be read") as exc:
        eng.apply(plan("next", irq("i", [3], number=40)))
    assert "remove the marker" in str(exc.value) and str(m.state_dir / "pending") in str(exc.value)
    assert _host(m) == changed
    with pytest.raises(StateError):
        eng.rollback("three")
    # the operator has dealt with the host and removes the marker: applies go on, the journal stays
    marker.unlink()
    assert eng.unreadable == []
    assert eng.apply(plan("next", irq("i", [3], number=40))).state == P.STATE_APPLIED
    assert os.path.lexists(journal) or damage == "missing"


def test_a_damaged_undo_record_names_the_action_it_could_not_restore(m: FakeMachine) -> None:
    journal = _interrupted(m)
    lines = journal.read_text().splitlines()
    cs = next(i for i, line in enumerate(lines) if '"action":"c"' in line and '"t":"undo"' in line)
    lines[cs] = lines[cs][:60] + "\x00garbage" + lines[cs][80:]  # damaged in place, not the last line
    journal.write_text("\n".join(lines) + "\n")
    [r] = m.engine().recover()
    assert r.state == P.STATE_FAILED, r
    by_id = {a.action_id: a for a in r.actions}
    assert by_id["c"].status == S.STATUS_ROLLBACK_FAILED
    assert "not restored" in by_id["c"].reason and "unreadable" in by_id["c"].reason
    assert by_id["i"].status == S.STATUS_ROLLED_BACK
    assert "c could not be restored" in r.message
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"


def test_one_corrupt_result_does_not_hide_the_other_plans(m: FakeMachine) -> None:
    eng = m.engine()
    assert eng.apply(plan("a", irq("i", [1], number=24))).state == P.STATE_APPLIED
    assert eng.apply(plan("b", irq("i", [2], number=40))).state == P.STATE_APPLIED
    eng.store.result_path("a").write_text('{"plan_id": "a", "result": "%%%' + "A" * 5000)
    listed = {r.plan_id: r for r in eng.list_plans()}
    assert listed["b"].state == P.STATE_APPLIED
    assert listed["a"].state == P.STATE_UNSPECIFIED
    assert "unreadable result" in listed["a"].message
    assert len(listed["a"].message) < 600  # a short excerpt, not the file
    # the journal still says what was changed: rollback works without the result
    rb = eng.rollback("a")
    assert rb.state == P.STATE_ROLLED_BACK, rb
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"


# ---- the running agent is not a target of `memtopo apply` -----------------------------------------
HOLDER = r"""
import sys, time
from memtopo.agent.sockets import take_lock
fd = take_lock(sys.argv[1] + ".lock")   # what the agent's socket front does to claim its path
print("locked", flush=True)
sys.stdin.readline()
"""


def test_proc_locks_parser_takes_holders_not_waiters() -> None:
    text = ("1: FLOCK  ADVISORY  WRITE 4242 fe:01:123 0 EOF\n"
            "1: -> FLOCK  ADVISORY  WRITE 999 fe:01:123 0 EOF\n"
            "2: POSIX  ADVISORY  READ 17 08:02:77 0 EOF\n"
            "garbage line\n")
    assert parse_proc_locks(text) == {(0xfe, 1, 123): {4242}, (8, 2, 77): {17}}


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs /proc/locks")
def test_cli_apply_refuses_the_process_holding_the_agent_socket_lock(tmp_path: Path) -> None:
    """A stand-in agent: a process that claims a socket path with agent.sockets' own lock (the
    same file, the same flock), so the CLI must find it the way it finds the real agent."""
    sock = tmp_path / "run" / "agent.sock"
    sock.parent.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(sock)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        cpus = sorted(os.sched_getaffinity(0))
        before = _masks(holder.pid)
        target = [cpus[-1]] if len(cpus) > 1 else cpus
        plan_file = tmp_path / "p.json"
        plan_file.write_text(to_json(plan("pin-agent", threads("t", holder.pid, target, all=True))))
        res = _cli("apply", str(plan_file), "--state-dir", str(tmp_path / "s"), "--agent-socket", str(sock),
                   "--irqbalance", "leave")
        assert res.returncode == 1, res
        assert "running memtopo agent" in res.stdout, res.stdout
        assert _masks(holder.pid) == before
        # the same plan against a process that holds no agent lock is applied (the check is the lock)
        with _threads_child() as other:
            plan_file.write_text(to_json(plan("pin-other", threads("t", other.pid, target, all=True))))
            res2 = _cli("apply", str(plan_file), "--state-dir", str(tmp_path / "s"), "--agent-socket", str(sock),
                        "--irqbalance", "leave")
            assert res2.returncode == 0, res2
    finally:
        holder.kill()
        holder.wait()


def test_cli_apply_exits_2_naming_an_unreadable_journal(tmp_path: Path) -> None:
    state = tmp_path / "s"
    (state / "pending").mkdir(parents=True)
    (state / "pending" / ("ab" * 16)).write_text("")
    (state / ("ab" * 16 + ".journal.jsonl")).write_bytes(b"\x00\x01garbage\n" * 10)
    plan_file = tmp_path / "p.json"
    plan_file.write_text(to_json(plan("x", threads("t", os.getpid(), sorted(os.sched_getaffinity(0)), all=True))))
    res = _cli("apply", str(plan_file), "--state-dir", str(state))
    assert res.returncode == 2, res
    assert "cannot be read" in res.stderr and "ab" * 16 in res.stderr
    assert (state / ("ab" * 16 + ".journal.jsonl")).exists()
    assert (state / "pending" / ("ab" * 16)).exists()



# ---- the agent reports an unreadable journal -------------------------------------------------------
def test_the_agent_reports_an_unreadable_journal_in_readyz_metrics_and_logs(tmp_path: Path) -> None:

    import structlog

    from tests.agents import inproc_agent, run_agent

    state = tmp_path / "state" / "apply"
    key = "cd" * 16
    (state / "pending").mkdir(parents=True)
    (state / "pending" / key).write_text("")
    (state / f"{key}.journal.jsonl").write_bytes(b"")  # truncated to 0 after its plan changed the host
    agent = inproc_agent(tmp_path)  # its state directory is tmp_path/state, the journal's
    seen: dict[str, Any] = {}

    def probe() -> None:
        seen["ready"] = agent.ready()
        seen["metrics"] = agent.metrics.render()[0].decode()
        (state / "pending" / key).unlink()  # the operator's fix
        seen["ready_after"] = agent.ready()
        seen["metrics_after"] = agent.metrics.render()[0].decode()
        agent.request_stop()

    with structlog.testing.capture_logs() as logs:
        assert run_agent(agent, probe) == 0
    ok, checks = seen["ready"]
    assert not ok and "cannot be read" in checks["apply_journals"] and key in checks["apply_journals"]
    assert "memtopo_apply_unreadable_journals 1.0" in seen["metrics"]
    [event] = [e for e in logs if e["event"] == "plan_journal_unreadable"]
    assert event["key"] == key and event["log_level"] == "error"
    ok, checks = seen["ready_after"]
    assert ok and checks["apply_journals"] == "ok"
    assert "memtopo_apply_unreadable_journals 0.0" in seen["metrics_after"]
    assert (state / f"{key}.journal.jsonl").exists()
