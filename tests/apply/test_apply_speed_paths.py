"""The fast paths of the apply engine keep its contract: IRQ actions share the journal
fsync of a cpuset action before them and are still rolled back after a crash at any point; the
IRQ write reads back through its own descriptor (real files) or through a fake kernel's write;
kernel attributes are read in one read(2) without losing longer files; the journal's ``begin``
record goes out with the first undo record; validation's CPU-list cache still names every bad
action; the cpuset hierarchy is detected again whenever the mount table changes (always on a fake
or captured root; on the live one when procfs signals a mount, checked in a private mount
namespace); thread ids are journaled as runs that round-trip exactly (old journals still read);
a step predicts what it leaves only when a later step of its kind in the group reads it; the
one-per-action journal records written field by field are the JSON the general encoder writes. All on
the fake machine of tests/apply_fakes.py except the mount-namespace test (root and unshare(1))."""

from __future__ import annotations

import contextlib
import errno
import gc
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.apply.actions.threads import ThreadStep
from memtopo.apply.cgroups import Hierarchy, HierarchyCache, MountWatch
from memtopo.apply.errors import HostWriteError
from memtopo.apply.host import HostFiles
from memtopo.apply.journal import StateStore
from memtopo.apply.undo import (
    PID_MAX_LIMIT,
    AffinityUndo,
    UndoFormatError,
    from_json,
    parse_tid_runs,
    tid_runs,
    to_json,
)
from memtopo.hostfs import HostFS, HostReadError
from memtopo.v1 import plan_pb2 as planpb
from tests.apply_fakes import ONLINE_CPUS, FakeFiles, FakeMachine, cpuset, irq, machine, plan, threads

S = planpb.ActionResult
P = planpb.PlanResult
MOVABLE_IRQS = (24, 40, 41, 42)
REPO = Path(__file__).resolve().parents[2]


class Crash(BaseException):
    """The process dying: nothing in the engine catches a BaseException."""


@pytest.fixture
def m(tmp_path: Path) -> FakeMachine:
    return machine(tmp_path)


@pytest.fixture
def journal_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    synced: list[str] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(".journal.jsonl"):
            synced.append(path)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    yield synced


def _records(m: FakeMachine, plan_id: str) -> list[dict[str, object]]:
    path = m.engine().store.journal_path(plan_id)
    return [json.loads(line) for line in path.read_text().splitlines()]


def _irq_plan(plan_id: str = "p") -> planpb.BindingPlan:
    return plan(plan_id, threads("t", 100, [1], all=True),
                cpuset("c", "memtopo/x", cpus=[0, 1], mems=[0], create=True),
                *(irq(f"i{q}", [2, 3], number=q) for q in MOVABLE_IRQS))


# ---- fsync groups ----------------------------------------------------------------------------------
def test_a_pin_its_cpuset_and_irqs_share_one_fsync(m: FakeMachine, journal_syncs: list[str]) -> None:
    """A cpuset's prepare reads only cgroup files, which the thread pin before it does not change:
    it ends the pin's group, and the independent IRQs join it."""
    r = m.engine().apply(_irq_plan())
    assert r.state == P.STATE_APPLIED, r
    # threads + cpuset + 4 IRQs: one group, one fsync (it was two, and three before that)
    assert len(journal_syncs) == 1
    undo = [rec["action"] for rec in _records(m, "p") if rec["t"] == "undo"]
    assert undo == ["t", "c", *(f"i{q}" for q in MOVABLE_IRQS)]
    assert all(m.read(f"proc/irq/{q}/smp_affinity_list").strip() == "2-3" for q in MOVABLE_IRQS)


def test_threads_after_a_cpuset_still_get_their_own_fsync(m: FakeMachine, journal_syncs: list[str]) -> None:
    """A cpuset changes thread masks: a thread action after it is prepared once it has applied."""
    p = plan("p", cpuset("c", "memtopo/x", cpus=[0, 1], mems=[0], create=True), irq("i", [2], number=24),
             threads("t", 100, [1], all=True))
    assert m.engine().apply(p).state == P.STATE_APPLIED
    assert len(journal_syncs) == 2  # cpuset + IRQ | threads


def test_irq_undo_is_durable_before_the_cpuset_changes(m: FakeMachine, journal_syncs: list[str]) -> None:
    files = m.files
    real_mkdir = files._mkdir
    seen: list[list[str]] = []

    def watching_mkdir(path: str) -> None:
        seen.append([str(rec.get("action", "")) for rec in _records(m, "p") if rec["t"] == "undo"])
        seen.append(list(journal_syncs))
        real_mkdir(path)

    files._mkdir = watching_mkdir  # type: ignore[method-assign]
    assert m.engine().apply(_irq_plan()).state == P.STATE_APPLIED
    undo_at_mkdir, synced_at_mkdir = seen[0], seen[1]
    assert undo_at_mkdir == ["t", "c", *(f"i{q}" for q in MOVABLE_IRQS)]
    assert len(synced_at_mkdir) == 1  # the one fsync of the whole group, before its first change


@pytest.mark.parametrize(("event", "action_id"), [
    ("after_action", "t"),        # threads pinned; the cpuset's undo (a mkdir not made yet) journaled
    ("after_action", "c"),        # cpuset made, no IRQ moved yet (their undo is journaled)
    ("after_action", "i40"),      # half the IRQs moved
    ("before_action", "i24"),     # between the cpuset and the first IRQ
])
def test_a_crash_inside_the_cpuset_irq_group_is_rolled_back(m: FakeMachine, event: str, action_id: str) -> None:
    start = (dict(m.kernel.masks), m.snapshot())

    def hook(ev: str, action: planpb.PlanAction) -> None:
        if ev == event and action.id == action_id:
            raise Crash

    with pytest.raises(Crash):
        m.engine(hook=hook).apply(_irq_plan())
    assert (dict(m.kernel.masks), m.snapshot()) != start
    [r] = m.engine().recover()
    assert r.state == P.STATE_ROLLED_BACK, r
    snap = {k: v for k, v in m.snapshot().items() if not k.startswith("state")}
    assert dict(m.kernel.masks) == start[0]
    assert snap == {k: v for k, v in start[1].items() if not k.startswith("state")}


def test_optional_cpuset_failing_in_the_group_re_prepares_the_irqs(m: FakeMachine) -> None:
    m.files.fail_write("sys/fs/cgroup/cpuset/memtopo/x/cpuset.cpus", errno.EINVAL)
    p = plan("p", cpuset("c", "memtopo/x", cpus=[0, 1], mems=[0], create=True, required=False),
             irq("i", [2], number=24))
    r = m.engine().apply(p)
    assert r.state == P.STATE_APPLIED, r
    assert [S.Status.Name(a.status) for a in r.actions] == ["STATUS_SKIPPED", "STATUS_APPLIED"]
    assert not (m.root / "sys/fs/cgroup/cpuset/memtopo/x").exists()
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "2"
    assert m.engine().rollback("p").state == P.STATE_ROLLED_BACK
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"


# ---- IRQ write and read-back -------------------------------------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    d = tmp_path / "root/proc/irq/24"
    d.mkdir(parents=True)
    (d / "smp_affinity_list").write_text("0-7\n")
    return tmp_path / "root"


def test_write_read_returns_what_the_file_holds_after_the_write(tree: Path) -> None:
    files = HostFiles(HostFS.at(tree), ["proc/irq"])
    assert files.write_read("proc/irq/24/smp_affinity_list", "3") == "3"
    assert (tree / "proc/irq/24/smp_affinity_list").read_text() == "3"
    with pytest.raises(HostWriteError) as exc:
        files.write_read("proc/irq/99/smp_affinity_list", "1")  # no O_CREAT, as write
    assert exc.value.errno == errno.ENOENT


def test_write_read_goes_through_a_fake_kernels_write(m: FakeMachine) -> None:
    # FakeFiles normalizes what it stores and refuses managed IRQs: write_read must see both.
    m.files.allow_writes(["proc/irq"])
    assert m.files.write_read("proc/irq/24/smp_affinity_list", "3,1,2") == "1-3\n"
    with pytest.raises(HostWriteError) as exc:
        m.files.write_read("proc/irq/36/smp_affinity_list", "1")
    assert exc.value.errno == errno.EPERM


class _LyingKernel(FakeFiles):
    """smp_affinity_list reads back something else, and the effective affinity stays outside."""

    def _write_read(self, path: str, data: bytes) -> bytes:
        self._write(path, data)
        Path(path).with_name("effective_affinity_list").write_text("7\n")
        return b"0-7\n"


def test_an_irq_that_does_not_read_back_as_written_fails_and_is_restored(m: FakeMachine) -> None:
    lying = _LyingKernel(m.root)
    lying.allow_writes(m.files.writable)
    object.__setattr__(m.host, "files", lying)
    r = m.engine().apply(plan("p", irq("a", [1], number=24), irq("b", [2], number=40)))
    assert r.state == P.STATE_ROLLED_BACK, r
    assert "smp_affinity_list reads 0-7 after writing 1" in r.actions[0].reason
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"


def test_effective_affinity_inside_the_set_is_enough(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", irq("a", [2, 3], number=24)))
    assert r.state == P.STATE_APPLIED
    # FakeFiles moves the effective affinity to the lowest CPU of the set at once
    assert r.actions[0].details["effective_affinity"] == "24→2"
    assert r.actions[0].before == ["IRQ 24: affinity 0-7"]
    assert r.actions[0].after == ["IRQ 24: affinity 2-3"]


# ---- one-read attributes ---------------------------------------------------------------------------
def test_read_record_reads_short_files_in_one_go_and_long_ones_in_full(tree: Path) -> None:
    files = HostFiles(HostFS.at(tree))
    assert files.read_record("proc/irq/24/smp_affinity_list") == "0-7\n"
    long = ",".join(str(n) for n in range(0, 16000, 2)) + "\n"  # > one read's buffer
    (tree / "proc/irq/24/long").write_text(long)
    assert files.read_record("proc/irq/24/long") == long
    assert files.read_ids("proc/irq/24/long") == tuple(range(0, 16000, 2))
    with pytest.raises(HostReadError, match="missing"):
        files.read_record("proc/irq/25/smp_affinity_list")
    with pytest.raises(HostReadError):
        files.read_record("proc/../etc/passwd")


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_read_ids_on_garbage_is_a_typed_error(tree: Path, data: bytes) -> None:
    (tree / "proc/irq/24/smp_affinity_list").write_bytes(data)
    files = HostFiles(HostFS.at(tree))
    try:
        ids = files.read_ids("proc/irq/24/smp_affinity_list")
    except HostReadError:
        return
    assert ids == tuple(sorted(set(ids)))


# ---- journal ---------------------------------------------------------------------------------------
def test_begin_goes_out_with_the_first_undo_record(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    store.ensure()
    w = store.begin(planpb.BindingPlan(plan_id="p"), "sha")
    path = store.journal_path("p")
    assert path.read_text() == ""
    # a crash here: nothing changed, and recovery finds nothing to do
    assert store.pending() == []
    assert not (tmp_path / "state/pending").exists()
    w.undo([(0, "a", [])])
    # the marker comes after the first write: a marked journal always holds its begin record
    store.mark_open("p")
    assert [json.loads(x)["t"] for x in path.read_text().splitlines()] == ["begin", "undo"]
    assert [js.plan_id for js in store.pending()] == ["p"]
    w.close()


def test_a_held_begin_is_written_on_close(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    w = store.begin(planpb.BindingPlan(plan_id="p"), "sha")
    w.close()
    st_ = store.read_journal("p")
    assert st_ is not None and st_.plan_id == "p"


def test_mark_open_makes_the_state_directory_on_first_use(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "a/b/state")
    store.mark_open("p")
    assert (tmp_path / "a/b/state/pending").is_dir()
    assert len(list((tmp_path / "a/b/state/pending").iterdir())) == 1


# ---- validation --------------------------------------------------------------------------------------
def test_a_repeated_bad_cpu_list_rejects_every_action_that_has_it(m: FakeMachine) -> None:
    bad = max(ONLINE_CPUS) + 1
    r = m.engine().apply(plan("p", irq("a", [1], number=24), irq("b", [bad], number=40), irq("c", [bad], number=41)))
    assert r.state == P.STATE_REJECTED
    assert [x.split(":")[0] for x in r.rejections] == ["b", "c"]


def test_a_missing_irq_is_still_named_as_missing(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", irq("a", [1], number=24), irq("b", [1], number=77)))
    assert r.state == P.STATE_REJECTED
    assert r.rejections == ["b: IRQ 77 does not exist (no /proc/irq/77)"]


# ---- cgroup hierarchy, detected once per mount table -------------------------------------------------
def test_a_fake_root_detects_the_hierarchy_on_every_call(m: FakeMachine) -> None:
    """A captured or fake mountinfo is a plain file that never signals a change: no caching there,
    so a test (or a capture) that rewrites it is always seen."""
    cache = HierarchyCache(m.files)
    first, fresh1 = cache.get()
    again, fresh2 = cache.get()
    assert fresh1 and fresh2
    assert isinstance(first, Hierarchy) and first.version == 1 and again == first
    (m.root / "proc/self/mountinfo").write_text(
        "31 23 0:28 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    (m.root / "sys/fs/cgroup/cgroup.controllers").write_text("cpuset memory\n")
    now, _ = cache.get()
    assert isinstance(now, Hierarchy) and now.version == 2 and now.mount == "sys/fs/cgroup"


def test_the_engine_follows_a_changed_fake_mount_table(m: FakeMachine) -> None:
    engine = m.engine()
    assert engine.apply(plan("a", cpuset("c", "memtopo/x", cpus=[0, 1], mems=[0], create=True))).state == \
        P.STATE_APPLIED
    (m.root / "proc/self/mountinfo").write_text("")  # no cgroup mount any more
    r = engine.apply(plan("b", cpuset("c", "memtopo/y", cpus=[0, 1], mems=[0], create=True)))
    assert r.state == P.STATE_REJECTED
    assert "no cpuset hierarchy" in r.rejections[0]


_WATCH_SCRIPT = r"""
import os, subprocess, sys
from memtopo.apply.cgroups import HierarchyCache, MountWatch
from memtopo.apply.host import HostFiles
from memtopo.hostfs import HostFS
files = HostFiles(HostFS.at("/"))
watch = MountWatch(files)
cache = HierarchyCache(files)
out = [watch.armed, watch.changed(), cache.get()[1], cache.get()[1]]
subprocess.run(["mount", "-t", "tmpfs", "none", sys.argv[1]], check=True)
out += [watch.changed(), watch.changed(), cache.get()[1], cache.get()[1]]
subprocess.run(["umount", sys.argv[1]], check=True)
out += [watch.changed(), cache.get()[1]]
watch.close()
out.append(watch.changed())  # closed: never claims "unchanged"
print(" ".join(str(x) for x in out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1): mounts a tmpfs in a private mount namespace")
def test_the_live_mount_table_is_watched_and_a_mount_invalidates(tmp_path: Path) -> None:
    """procfs reports a mount or unmount to the open mountinfo once (POLLPRI): the cache detects
    again exactly then. In a private mount namespace, so the host's table never changes."""
    res = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", _WATCH_SCRIPT,
                          str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [
        "True", "False", "True", "False",   # armed; nothing changed; first detect; then cached
        "True", "False", "True", "False",   # the mount: seen once; the cache detects again once
        "True", "True",                     # the unmount likewise
        "True",
    ]


def mountinfo_fds() -> set[int]:
    """This process's descriptors open on its mount table."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").endswith("/mountinfo"):
                found.add(int(name))
    return found


def test_the_watch_closes_its_descriptor_with_the_engine(tmp_path: Path) -> None:
    # The watch's own descriptor, not a count of all: collecting garbage also closes what earlier
    # tests in this process left behind, and their threads may still open and close files.
    gc.collect()
    before = mountinfo_fds()
    watch = MountWatch(HostFiles(HostFS.at("/")))
    if not watch.armed:
        pytest.skip("no /proc/self/mountinfo")
    mine = mountinfo_fds() - before
    assert len(mine) == 1
    del watch
    gc.collect()
    assert not mountinfo_fds() & mine


# ---- tids in the journal as runs -------------------------------------------------------------------
@given(tids=st.lists(st.integers(min_value=1, max_value=PID_MAX_LIMIT - 1), max_size=200))
def test_tid_runs_round_trip_in_order(tids: list[int]) -> None:
    text = tid_runs(tids)
    assert parse_tid_runs(text) == tuple(tids)
    # one run per break in +1 steps: never longer than the numbers themselves
    assert text.count(",") == sum(1 for a, b in itertools.pairwise(tids) if b != a + 1)


def test_a_thousand_threads_are_one_short_record() -> None:
    op = AffinityUndo(100, 5000, (((0, 1), tuple(range(20000, 21000))), ((2,), (21005, 21007, 21008))))
    rec = to_json(op)
    assert rec["groups"] == [["0-1", "20000-20999"], ["2", "21005,21007-21008"]]
    assert from_json(json.loads(json.dumps(rec))) == op


def test_journals_written_before_with_tid_lists_still_restore() -> None:
    old = {"op": "affinity", "pid": 100, "starttime": 5000, "groups": [["0-1", [100, 101]], ["3", [102]]]}
    assert from_json(old) == AffinityUndo(100, 5000, (((0, 1), (100, 101)), ((3,), (102,))))


@given(text=st.text(alphabet="0123456789-, x", max_size=40))
def test_garbage_tid_runs_are_a_typed_error(text: str) -> None:
    try:
        tids = parse_tid_runs(text)
    except UndoFormatError:
        return
    assert all(0 <= t < PID_MAX_LIMIT for t in tids)
    assert tid_runs(tids) == tid_runs(parse_tid_runs(tid_runs(tids)))


@pytest.mark.parametrize("text", ["5-3", "1-99999999", "-4", "4-", ",", "1,,2", "0x10", "٣", "1" * 30,
                                  f"0-{PID_MAX_LIMIT - 1},1"])
def test_bad_tid_runs_are_refused(text: str) -> None:
    with pytest.raises(UndoFormatError):
        parse_tid_runs(text)
    with pytest.raises(UndoFormatError):
        from_json({"op": "affinity", "pid": 1, "starttime": 1, "groups": [["0", text]]})


# ---- predictions only where a later step reads them ------------------------------------------------
def test_a_second_thread_action_in_the_group_records_what_the_first_leaves(m: FakeMachine,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = ThreadStep.predict

    def spy(self: ThreadStep, overlay: dict[tuple[str, int], frozenset[int]]) -> None:
        calls.append(self.action.id)
        real(self, overlay)

    monkeypatch.setattr(ThreadStep, "predict", spy)
    start = {t: set(m.kernel.masks[t]) for t in (100, 101, 102)}
    r = m.engine().apply(plan("p", threads("all", 100, [1], all=True), threads("acl", 100, [2], name="acl_thread"),
                              irq("i", [3], number=24)))
    assert r.state == P.STATE_APPLIED, r
    assert calls == ["all"]  # the acl step reads it; nothing after the acl step does
    undo: dict[object, Any] = {rec["action"]: rec["ops"] for rec in _records(m, "p") if rec["t"] == "undo"}
    # the acl thread's previous mask is what the "all" step leaves, not what it had before the plan
    assert undo["acl"][0]["groups"] == [["1", "101"]]
    assert m.kernel.masks[101] == {2} and m.kernel.masks[100] == {1}
    assert m.engine().rollback("p").state == P.STATE_ROLLED_BACK
    assert {t: set(m.kernel.masks[t]) for t in (100, 101, 102)} == start


def test_a_single_thread_action_predicts_nothing(m: FakeMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(ThreadStep, "predict", lambda self, overlay: calls.append(self.action.id))
    r = m.engine().apply(plan("p", threads("all", 100, [1], all=True), irq("i", [3], number=24)))
    assert r.state == P.STATE_APPLIED, r
    assert calls == []


_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(i=st.integers(0, 10_000), aid=_TEXT, path=_TEXT, value=_TEXT, pid=st.integers(1, PID_MAX_LIMIT - 1))
def test_undo_and_done_records_written_field_by_field_read_as_the_dicts_do(i: int, aid: str, path: str, value: str,
                                                                          pid: int) -> None:
    """The one-per-action records (an IRQ action's file undo, every "done") skip building a dict:
    what they write is the very JSON the general encoder writes, whatever the strings hold."""
    from memtopo.apply import journal
    from memtopo.apply.undo import FileUndo, MkdirUndo, UndoOp, to_json

    ops: list[UndoOp] = [FileUndo(path, value, "list"), MkdirUndo(path, value),
                         AffinityUndo(pid, 7, (((0, 1), (pid,)),))]
    general = journal._encode([{"t": "undo", "i": i, "action": aid, "ops": [to_json(op) for op in ops]}])
    assert journal._undo_line(i, aid, ops) == general
    assert [from_json(o) for o in json.loads(general)["ops"]] == ops
    lines: list[bytes] = []

    class Capture(journal.JournalWriter):
        def write_encoded(self, data: bytes, sync: bool = False) -> None:
            lines.append(data)

    writer = Capture.__new__(Capture)
    writer.done([(aid, "STATUS_APPLIED"), (aid + "x", "STATUS_UNCHANGED")])
    assert lines == [journal._encode([{"t": "done", "action": aid, "status": "STATUS_APPLIED"},
                                      {"t": "done", "action": aid + "x", "status": "STATUS_UNCHANGED"}])]
