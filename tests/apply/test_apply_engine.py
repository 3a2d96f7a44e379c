"""The engine around the actions: dry run, idempotency, journal and crash recovery, rollback on
failure, fsync batching, locking."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.apply.errors import PlanNotFoundError, StateError
from memtopo.apply.host import Affinities
from memtopo.apply.journal import StateStore
from memtopo.v1 import plan_pb2 as planpb
from tests.apply_fakes import (
    ONLINE_CPUS,
    FakeKernel,
    FakeMachine,
    cpuset,
    irq,
    machine,
    migrate,
    plan,
    threads,
)

S = planpb.ActionResult
P = planpb.PlanResult
ALL = set(ONLINE_CPUS)


@pytest.fixture
def m(tmp_path: Path) -> FakeMachine:
    return machine(tmp_path)


def _three(pid_cpus: Sequence[int] = (1,)) -> planpb.BindingPlan:
    return plan("three", irq("i", [2], number=24),
                cpuset("c", "memtopo/x", cpus=[0, 1], mems=[0], create=True, attach=[200]),
                threads("t", 100, pid_cpus, all=True))


def _host_state(m: FakeMachine) -> tuple[dict[int, set[int]], dict[str, str]]:
    return (dict(m.kernel.masks), {k: v for k, v in m.snapshot().items() if not k.startswith("state")})


class Crash(BaseException):
    """Stands for the process dying: nothing in the engine catches a BaseException."""


# ---- dry run ---------------------------------------------------------------------------------------
def test_dry_run_shows_the_diff_and_touches_nothing(m: FakeMachine) -> None:
    before = m.snapshot()
    r = m.engine().apply(_three(), dry_run=True)
    assert r.state == P.STATE_DRY_RUN
    assert [a.status for a in r.actions] == [S.STATUS_WOULD_CHANGE] * 3
    assert r.actions[0].before == ["IRQ 24: affinity 0-7"]
    assert r.actions[0].after == ["IRQ 24: affinity 2"]
    assert r.actions[1].before[0].endswith("memtopo/x: absent")
    assert "pid 100 (worker) 11 threads [tid 100-110]: cpus 1" in r.actions[2].after
    assert m.snapshot() == before
    assert m.kernel.mutations() == []
    assert m.files.writes == []
    assert not m.state_dir.exists() or not any(m.state_dir.iterdir())


def test_dry_run_of_a_rejected_plan_is_rejected(m: FakeMachine) -> None:
    assert m.engine().apply(plan("p", threads("t", 1, [0], all=True)), dry_run=True).state == P.STATE_REJECTED


# ---- unchanged and idempotent ----------------------------------------------------------------------
def test_plan_whose_state_already_holds_is_unchanged(m: FakeMachine) -> None:
    p = plan("p", threads("t", 100, ONLINE_CPUS, all=True), irq("i", ONLINE_CPUS, number=24),
             cpuset("c", "memtopo/job", cpus=[0, 1, 2, 3], mems=[0]))
    r = m.engine().apply(p)
    assert r.state == P.STATE_UNCHANGED, r
    assert {a.status for a in r.actions} == {S.STATUS_UNCHANGED}
    assert m.kernel.mutations() == []
    assert m.files.writes == []
    assert not list(m.state_dir.glob("*.journal.jsonl"))  # nothing changed, nothing to journal


def test_same_plan_id_twice_returns_the_stored_result_without_touching_the_host(m: FakeMachine) -> None:
    first = m.engine().apply(_three())
    assert first.state == P.STATE_APPLIED
    calls, writes = len(m.kernel.calls), len(m.files.writes)
    m.kernel.masks[103] = {7}  # drift: a second apply must still not touch anything
    again = m.engine().apply(_three())
    assert again.state == P.STATE_APPLIED
    assert [a.status for a in again.actions] == [a.status for a in first.actions]
    assert "stored result" in again.message
    assert (len(m.kernel.calls), len(m.files.writes)) == (calls, writes)
    assert m.kernel.masks[103] == {7}


def test_a_used_plan_id_with_other_content_is_rejected(m: FakeMachine) -> None:
    m.engine().apply(plan("p", irq("i", [1], number=24)))
    r = m.engine().apply(plan("p", irq("i", [2], number=24)))
    assert r.state == P.STATE_REJECTED
    assert "already used for a different plan" in r.rejections[0]
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "1"


def test_result_and_list_plans(m: FakeMachine) -> None:
    eng = m.engine()
    assert eng.result("p") is None
    eng.apply(plan("p", irq("i", [1], number=24)))
    eng.apply(plan("q", irq("i", [1], number=24)))
    res = eng.result("p")
    assert res is not None and res.state == P.STATE_APPLIED
    assert sorted(r.plan_id for r in eng.list_plans()) == ["p", "q"]
    assert eng.result("q").state == P.STATE_UNCHANGED  # type: ignore[union-attr]


# ---- failures --------------------------------------------------------------------------------------
def test_a_failed_run_and_a_crashed_one_report_a_restore_alike(m: FakeMachine, tmp_path: Path) -> None:
    """One restore path: what restoring an action says (here: its pages stay where they are, the
    process had pages on the destination before) reaches its result whether a later required action
    failed or the run died and recovery restored its journal."""
    note = "pages left where they are"

    def two() -> planpb.BindingPlan:
        return plan("two", migrate("m", 100, [0], [1]), threads("t", 200, [1], all=True))

    m.kernel.fail_on("set_affinities", 1, errno.EINVAL)
    failed = m.engine().apply(two())
    assert failed.state == P.STATE_ROLLED_BACK, failed
    assert failed.actions[0].status == S.STATUS_ROLLED_BACK
    assert failed.actions[0].reason.startswith("restored because t failed: ")

    def hook(event: str, action: planpb.PlanAction) -> None:
        if event == "after_action" and action.id == "m":
            raise Crash

    (tmp_path / "other").mkdir()
    other = machine(tmp_path / "other")  # the same host as m before its failed run
    with pytest.raises(Crash):
        other.engine(hook=hook).apply(two())
    [crashed] = other.engine().recover()
    assert crashed.state == P.STATE_ROLLED_BACK, crashed
    assert crashed.actions[0].status == S.STATUS_ROLLED_BACK
    assert crashed.actions[0].reason.startswith("restored: ")
    said = failed.actions[0].reason.removeprefix("restored because t failed: ")
    assert note in said and crashed.actions[0].reason.removeprefix("restored: ") == said


def test_third_action_failing_restores_the_first_two(m: FakeMachine) -> None:
    start = _host_state(m)
    m.kernel.fail_on("set_affinities", 1, errno.EINVAL)
    r = m.engine().apply(_three())
    assert r.state == P.STATE_ROLLED_BACK, r
    assert [S.Status.Name(a.status) for a in r.actions] == ["STATUS_ROLLED_BACK"] * 2 + ["STATUS_FAILED"]
    assert "restored because t failed" in r.actions[0].reason
    assert _host_state(m) == start
    # stored: the same id again answers the same without a second try
    assert m.engine().apply(_three()).state == P.STATE_ROLLED_BACK


def test_optional_failure_is_skipped_and_the_rest_applies(m: FakeMachine) -> None:
    m.files.fail_write("sys/fs/cgroup/cpuset/memtopo/x/cgroup.procs", errno.ENOSPC)
    p = plan("p", irq("i", [2], number=24),
             cpuset("c", "memtopo/x", cpus=[0], mems=[0], create=True, attach=[200], required=False),
             threads("t", 100, [1], all=True))
    r = m.engine().apply(p)
    assert r.state == P.STATE_APPLIED
    assert [S.Status.Name(a.status) for a in r.actions] == ["STATUS_APPLIED", "STATUS_SKIPPED", "STATUS_APPLIED"]
    assert "ENOSPC" in r.actions[1].reason and "its changes were restored" in r.actions[1].reason
    assert not (m.root / "sys/fs/cgroup/cpuset/memtopo/x").exists()
    # a later rollback does not replay the skipped action's undo
    rb = m.engine().rollback("p")
    assert rb.state == P.STATE_ROLLED_BACK
    assert [S.Status.Name(a.status) for a in rb.actions] == ["STATUS_ROLLED_BACK", "STATUS_SKIPPED",
                                                             "STATUS_ROLLED_BACK"]


def test_a_restore_that_fails_is_reported(m: FakeMachine) -> None:
    # The IRQ write succeeds, then its restore is refused: the plan ends FAILED, and says which.
    m.files.fail_write("proc/irq/24/smp_affinity_list", errno.EBUSY, nth=2)
    m.files.fail_write("proc/irq/24/smp_affinity_list", errno.EBUSY, nth=3)
    m.kernel.fail_on("set_affinities", 1, errno.EINVAL)
    r = m.engine().apply(plan("p", irq("i", [2], number=24), threads("t", 100, [1], all=True)))
    assert r.state == P.STATE_FAILED
    assert r.actions[0].status == S.STATUS_ROLLBACK_FAILED
    assert "EBUSY" in r.actions[0].reason
    assert "restore did not complete" in r.message


def test_rollback_on_request_then_again(m: FakeMachine) -> None:
    start = _host_state(m)
    m.engine().apply(_three())
    assert _host_state(m) != start
    rb = m.engine().rollback("three")
    assert rb.state == P.STATE_ROLLED_BACK
    assert _host_state(m) == start
    calls = len(m.kernel.calls)
    again = m.engine().rollback("three")
    assert again.state == P.STATE_ROLLED_BACK and "already rolled back" in again.message
    assert len(m.kernel.calls) == calls
    with pytest.raises(PlanNotFoundError):
        m.engine().rollback("never-applied")


def test_rollback_leaves_a_recycled_pid_alone(m: FakeMachine) -> None:
    m.engine().apply(plan("p", threads("t", 200, [3], all=True)))
    # pid 200 exits and the pid is reused by another process: different start time.
    stat = m.root / "proc/200/stat"
    stat.write_text(stat.read_text().replace(" 6000 ", " 9999 "))
    calls = len(m.kernel.mutations())
    rb = m.engine().rollback("p")
    assert rb.state == P.STATE_ROLLED_BACK
    assert "pid 200 has exited" in rb.actions[0].reason
    assert len(m.kernel.mutations()) == calls
    assert m.kernel.masks[200] == {3}


# ---- journal and recovery --------------------------------------------------------------------------
def test_previous_state_is_journaled_and_synced_before_each_change(m: FakeMachine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    journal = m.engine().store.journal_path("three")
    seen_at_change: list[list[str]] = []

    class Watching(FakeKernel):
        def set_affinities(self, tids: Sequence[int], cpus: AbstractSet[int]) -> dict[int, int]:
            seen_at_change.append([json.loads(x)["t"] for x in journal.read_text().splitlines()])
            return super().set_affinities(tids, cpus)

    kernel = Watching(m.root)
    kernel.masks = m.kernel.masks
    object.__setattr__(m.host, "kernel", kernel)
    m.engine().apply(_three())
    # When the threads changed, their undo record was already in the (synced) journal.
    undo_records = [r for r in journal.read_text().splitlines() if json.loads(r)["t"] == "undo"]
    assert json.loads(undo_records[-1])["action"] == "t"
    assert seen_at_change[0].count("undo") == 3
    # one fsync per group of actions (irq + cpuset | threads: the cpuset changes what the threads'
    # prepare reads), never per thread; the result file is renamed into place unsynced (what it
    # describes does not survive a reboot either)
    journal_syncs = [s for s in synced if s.endswith(".journal.jsonl")]
    assert len(journal_syncs) == 2
    assert synced == journal_syncs


def test_consecutive_affinity_actions_share_one_fsync(m: FakeMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    count = [0]
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".journal.jsonl"):
            count[0] += 1
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    p = plan("p", *[irq(f"i{n}", [n % 8], number=q) for n, q in enumerate((24, 40, 41, 42, 50, 51))],
             threads("t", 100, [1], all=True), threads("a", 100, [2], name="acl_thread"))
    assert m.engine().apply(p).state == P.STATE_APPLIED
    assert count[0] == 1


def test_killed_mid_plan_is_rolled_back_by_recover(m: FakeMachine) -> None:
    start = _host_state(m)

    def hook(event: str, action: planpb.PlanAction) -> None:
        if event == "after_action" and action.id == "c":
            raise Crash

    with pytest.raises(Crash):
        m.engine(hook=hook).apply(_three())
    assert _host_state(m) != start
    fresh = m.engine()  # a new process: nothing in memory
    results = fresh.recover()
    assert [r.plan_id for r in results] == ["three"]
    r = results[0]
    assert r.state == P.STATE_ROLLED_BACK, r
    assert "recovery" in r.message
    assert [S.Status.Name(a.status) for a in r.actions] == ["STATUS_ROLLED_BACK", "STATUS_ROLLED_BACK",
                                                            "STATUS_SKIPPED"]
    assert _host_state(m) == start
    assert fresh.recover() == []
    assert not any((m.state_dir / "pending").iterdir())
    # the id is spent: applying it again returns the recovered result
    assert fresh.apply(_three()).state == P.STATE_ROLLED_BACK


def test_a_journal_from_before_a_reboot_is_closed_not_restored(m: FakeMachine) -> None:
    """After a reboot the recorded previous values describe objects that no longer exist (IRQ
    numbers and pids are reused): recovery must not write them."""
    boot = m.root / "proc/sys/kernel/random/boot_id"
    boot.parent.mkdir(parents=True, exist_ok=True)
    boot.write_text("boot-one\n")

    def hook(event: str, action: planpb.PlanAction) -> None:
        if event == "after_action" and action.id == "c":
            raise Crash

    with pytest.raises(Crash):
        m.engine(hook=hook).apply(_three())
    boot.write_text("boot-two\n")
    changed = _host_state(m)
    calls = len(m.kernel.calls)
    [r] = m.engine().recover()
    assert r.plan_id == "three" and r.state == P.STATE_FAILED and "reboot" in r.message
    assert not [c for c in m.kernel.calls[calls:] if c[0] in m.kernel.MUTATING]
    assert _host_state(m) == changed
    assert not any((m.state_dir / "pending").iterdir())
    assert m.engine().recover() == []


def test_killed_inside_an_action_restores_its_partial_changes(m: FakeMachine) -> None:
    start = _host_state(m)

    class Dying(FakeKernel):
        def set_affinities(self, tids: Sequence[int], cpus: AbstractSet[int]) -> dict[int, int]:
            half = list(tids)[: len(tids) // 2]
            super().set_affinities(half, cpus)
            raise Crash

    kernel = Dying(m.root)
    kernel.masks = m.kernel.masks
    object.__setattr__(m.host, "kernel", kernel)
    with pytest.raises(Crash):
        m.engine().apply(plan("p", threads("t", 100, [1], all=True)))
    object.__setattr__(m.host, "kernel", m.kernel)
    [r] = m.engine().recover()
    assert r.actions[0].status == S.STATUS_FAILED and "interrupted while being applied" in r.actions[0].reason
    assert r.state == P.STATE_ROLLED_BACK
    assert _host_state(m) == start


def test_apply_recovers_pending_journals_first(m: FakeMachine) -> None:
    def hook(event: str, action: planpb.PlanAction) -> None:
        if event == "after_action":
            raise Crash

    with pytest.raises(Crash):
        m.engine(hook=hook).apply(plan("a", irq("i", [1], number=24)))
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "1"
    r = m.engine().apply(plan("b", irq("i", [3], number=40)))
    assert r.state == P.STATE_APPLIED
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"
    assert m.engine().result("a").state == P.STATE_ROLLED_BACK  # type: ignore[union-attr]


def test_crash_after_the_result_was_written_keeps_the_plan(m: FakeMachine) -> None:
    eng = m.engine()
    eng.apply(plan("p", irq("i", [1], number=24)))
    journal = eng.store.journal_path("p")
    lines = journal.read_text().splitlines()
    assert json.loads(lines[-1])["t"] == "end"
    journal.write_text("\n".join(lines[:-1]) + "\n")  # the end record never made it
    eng.store.mark_open("p")  # nor the removal of the pending marker
    assert m.engine().recover() == []
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "1"
    assert json.loads(journal.read_text().splitlines()[-1])["t"] == "end"


def test_crash_during_a_rollback_is_finished_by_recover(m: FakeMachine) -> None:
    eng = m.engine()
    eng.apply(_three())
    eng.store.mark_open("three")  # a rollback that died before restoring anything
    eng.store.append("three", [{"t": "rollback"}])
    [r] = m.engine().recover()
    assert r.state == P.STATE_ROLLED_BACK
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"
    assert all(m.kernel.masks[t] == ALL for t in range(100, 111))


def test_torn_last_journal_line_is_ignored(m: FakeMachine) -> None:
    def hook(event: str, action: planpb.PlanAction) -> None:
        raise Crash

    with pytest.raises(Crash):
        m.engine(hook=hook).apply(plan("p", irq("i", [1], number=24)))
    journal = m.engine().store.journal_path("p")
    with open(journal, "a") as f:
        f.write('{"t":"undo","i":7,"action":"x","ops":[{"op":"fi')
    [r] = m.engine().recover()
    assert r.state == P.STATE_ROLLED_BACK
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"


def test_a_tampered_journal_cannot_write_outside_the_cgroup_and_irq_trees(m: FakeMachine) -> None:
    store = m.engine().store
    store.mark_open("evil")
    store.journal_path("evil").write_text(
        '{"t":"begin","plan_id":"evil","plan_sha256":"x","pid":1,"time":0,"plan":""}\n'
        '{"t":"undo","i":0,"action":"a","ops":[{"op":"file","path":"sys/devices/system/cpu/online",'
        '"value":"0","kind":"text"}]}\n')
    [r] = m.engine().recover()
    assert r.state == P.STATE_FAILED
    assert r.actions[0].status == S.STATUS_ROLLBACK_FAILED
    assert "not below a writable prefix" in r.actions[0].reason
    assert m.read("sys/devices/system/cpu/online").strip() == "0-7"


def test_journal_of_unknown_ops_is_reported_not_executed(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.ensure()
    path = store.journal_path("p")
    path.write_text('{"t":"undo","i":0,"action":"a","ops":[{"op":"rm -rf","path":"/"}]}\n{"t":"end","state":"x"}\n')
    st = store.read_journal("p")
    assert st is not None and st.undo == {}
    assert "unknown undo op" in st.problems[0]


# ---- concurrency -----------------------------------------------------------------------------------
def test_one_plan_at_a_time_in_a_process(m: FakeMachine) -> None:
    eng = m.engine()
    inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def hook(event: str, action: planpb.PlanAction) -> None:
        if action.id == "slow" and event == "before_action":
            order.append("slow-start")
            inside.set()
            release.wait(60)
            order.append("slow-end")

    eng.hook = hook
    t = threading.Thread(target=lambda: eng.apply(plan("a", irq("slow", [1], number=24))))
    t.start()
    assert inside.wait(60)
    def second() -> None:
        order.append("b-start")
        eng.apply(plan("b", irq("fast", [2], number=40)))
        order.append("b-end")

    t2 = threading.Thread(target=second)
    t2.start()
    for _ in range(3000):  # a busy machine may start the thread late; wait for it, not for a clock
        if "b-start" in order:
            break
        time.sleep(0.02)
    t2.join(0.3)
    assert t2.is_alive()  # waiting for the lock
    release.set()
    t.join(60)
    t2.join(60)
    assert order == ["slow-start", "b-start", "slow-end", "b-end"]


def test_state_dir_held_by_another_process_times_out(m: FakeMachine) -> None:
    m.state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(m.state_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StateError, match="locked by another"):
            m.engine(lock_timeout_s=0.1).apply(plan("p", irq("i", [1], number=24)))
    finally:
        os.close(fd)
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"


def test_hook_sees_every_action_in_order(m: FakeMachine) -> None:
    seen: list[tuple[str, str]] = []
    m.engine(hook=lambda e, a: seen.append((e, a.id))).apply(
        plan("p", irq("a", [1], number=24), migrate("b", 200, [0], [1])))
    assert seen == [("before_action", "a"), ("after_action", "a"), ("before_action", "b"), ("after_action", "b")]


def test_kernel_affinity_read_failure_fails_the_action(m: FakeMachine) -> None:
    class Blind(FakeKernel):
        def get_affinities(self, tids: Sequence[int]) -> Affinities:
            return Affinities([None for _ in tids], {t: errno.EPERM for t in tids})

    object.__setattr__(m.host, "kernel", Blind(m.root))
    r = m.engine().apply(plan("p", threads("t", 100, [1], all=True)))
    assert r.state == P.STATE_ROLLED_BACK
    assert "cannot read the affinity" in r.actions[0].reason


def _ids(values: Iterable[int]) -> list[int]:
    return sorted(values)


# ---- property: apply then rollback (or a failure) leaves the host as it was ------------------------
@dataclass(frozen=True)
class Spec:
    kind: str
    cpus: tuple[int, ...]
    name: str = ""
    tids: tuple[int, ...] = ()
    irq: int = 0
    frm: tuple[int, ...] = ()
    to: tuple[int, ...] = ()


_cpus = st.sets(st.integers(min_value=0, max_value=7), min_size=1, max_size=8).map(lambda c: tuple(sorted(c)))
_spec = st.one_of(
    st.builds(Spec, st.just("all"), _cpus),
    st.builds(Spec, st.just("name"), _cpus, name=st.sampled_from(["acl_thread", "release_.*", "worker"])),
    st.builds(Spec, st.just("tids"), _cpus, tids=st.sets(st.integers(min_value=100, max_value=110), min_size=1)
              .map(lambda t: tuple(sorted(t)))),
    st.builds(Spec, st.just("irq"), _cpus, irq=st.sampled_from([24, 40, 41, 42, 50, 51])),
    st.builds(Spec, st.just("mig"), st.just(()), frm=st.sampled_from([(0,), (1,), (0, 1)]),
              to=st.sampled_from([(0,), (1,), (4,)])),
)


def _build(specs: list[Spec]) -> planpb.BindingPlan:
    actions = []
    seen: set[tuple[object, ...]] = set()
    for n, sp in enumerate(specs):
        # One action per object: the same threads or IRQ twice is a contradiction (tested above).
        key = (sp.kind, sp.name, sp.tids, sp.irq) if sp.kind != "mig" else ("mig",)
        if key in seen:
            continue
        seen.add(key)
        aid = f"a{n}"
        if sp.kind == "all":
            actions.append(threads(aid, 100, sp.cpus, all=True))
        elif sp.kind == "name":
            actions.append(threads(aid, 100, sp.cpus, name=sp.name))
        elif sp.kind == "tids":
            actions.append(threads(aid, 100, sp.cpus, tids=sp.tids))
        elif sp.kind == "irq":
            actions.append(irq(aid, sp.cpus, number=sp.irq))
        else:
            actions.append(migrate(aid, 200, sp.frm, sp.to))
    return plan("prop", *actions)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(_spec, min_size=1, max_size=6), fail_at=st.integers(min_value=0, max_value=2))
def test_any_plan_applied_then_rolled_back_leaves_the_host_unchanged(tmp_path_factory: pytest.TempPathFactory,
                                                                      specs: list[Spec], fail_at: int) -> None:
    m = machine(tmp_path_factory.mktemp("prop"))
    start_masks, start_files = _host_state(m)
    if fail_at:
        m.kernel.fail_on("set_affinities", fail_at, errno.EPERM)
    r = m.engine().apply(_build(specs))
    if r.state == P.STATE_REJECTED:  # contradictions the generator made: nothing may have changed
        assert _host_state(m) == (start_masks, start_files)
        return
    if r.state != P.STATE_ROLLED_BACK:
        assert r.state in (P.STATE_APPLIED, P.STATE_UNCHANGED), r
        m.kernel.rules.clear()
        assert m.engine().rollback("prop").state == P.STATE_ROLLED_BACK
    masks, files = _host_state(m)
    assert masks == start_masks
    # pages migrated where the process already had pages are left in place (not reversible)
    assert {k: v for k, v in files.items() if "numa_maps" not in k} == \
        {k: v for k, v in start_files.items() if "numa_maps" not in k}
