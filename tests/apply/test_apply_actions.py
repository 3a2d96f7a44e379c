"""Each action kind on the fake machine: apply, verify, and restore (rollback), plus the cases where
the kernel says no."""

from __future__ import annotations

import errno
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memtopo.apply import irqbalance
from memtopo.apply.actions import ACTIONS
from memtopo.v1 import plan_pb2 as planpb
from tests.apply_fakes import (
    ONLINE_CPUS,
    FakeMachine,
    cpuset,
    irq,
    machine,
    mempolicy,
    migrate,
    plan,
    threads,
)

S = planpb.ActionResult
P = planpb.PlanResult
ALL = set(ONLINE_CPUS)
WORKER_TIDS = range(100, 111)


@pytest.fixture
def m(tmp_path: Path) -> FakeMachine:
    return machine(tmp_path)


def test_every_plan_action_kind_in_the_schema_has_a_kind_module() -> None:
    """A kind added to the PlanAction oneof without a registry entry would be refused by every plan
    (validation finds no check for it); one listed under another name would never be reached."""
    oneof = planpb.PlanAction.DESCRIPTOR.oneofs_by_name["action"]
    assert [f.name for f in oneof.fields] == list(ACTIONS)
    for name, kind in ACTIONS.items():
        assert kind.name == name
        # The step's kind names its overlay entries and fsync groups (Step.kind): the same name.
        assert getattr(kind.step, "kind", None) == name, kind.step


@pytest.fixture
def m2(tmp_path: Path) -> FakeMachine:
    return machine(tmp_path, cgroup_version=2)


def _status(result: planpb.PlanResult) -> dict[str, str]:
    return {a.action_id: S.Status.Name(a.status).removeprefix("STATUS_") for a in result.actions}


# ---- thread affinity -------------------------------------------------------------------------------
def test_all_threads_pinned_verified_and_restored(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", threads("t", 100, [0, 1], all=True)))
    assert r.state == P.STATE_APPLIED, r
    assert all(m.kernel.masks[t] == {0, 1} for t in WORKER_TIDS)
    a = r.actions[0]
    assert a.details["threads"] == "11" and a.details["changed"] == "11"
    assert a.before == ["pid 100 (worker) 11 threads [tid 100-110]: cpus 0-7"]
    assert a.after == ["pid 100 (worker) 11 threads [tid 100-110]: cpus 0-1"]
    # one batched set call for all threads, not one per thread
    assert [c for c in m.kernel.calls if c[0] == "set_affinities"] == [
        ("set_affinities", (tuple(WORKER_TIDS), frozenset({0, 1})))]
    rb = m.engine().rollback("p")
    assert rb.state == P.STATE_ROLLED_BACK
    assert _status(rb) == {"t": "ROLLED_BACK"}
    assert all(m.kernel.masks[t] == ALL for t in WORKER_TIDS)


def test_reference_design_roles_main_acl_release(m: FakeMachine) -> None:
    """vLLM-Ascend: all threads → main CPUs, then acl_thread and release_thread to their own."""
    p = plan("roles", threads("main", 100, [2, 3], all=True), threads("acl", 100, [4], name="acl_thread"),
             threads("rel", 100, [5], name="release_.*"))
    r = m.engine().apply(p)
    assert r.state == P.STATE_APPLIED
    assert m.kernel.masks[101] == {4} and m.kernel.masks[102] == {5}
    assert all(m.kernel.masks[t] == {2, 3} for t in (100, *range(103, 111)))
    # the later actions record the earlier one's CPUs as what they replace
    assert r.actions[1].before == ["pid 100 (worker) tid 101 acl_thread: cpus 2-3"]
    m.engine().rollback("roles")
    assert all(m.kernel.masks[t] == ALL for t in WORKER_TIDS)


def test_tids_and_main_thread_selectors(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", threads("a", 100, [6], tids=[104, 105]), threads("b", 200, [7], main=True)))
    assert r.state == P.STATE_APPLIED
    assert m.kernel.masks[104] == m.kernel.masks[105] == {6}
    assert m.kernel.masks[103] == ALL
    assert m.kernel.masks[200] == {7} and m.kernel.masks[201] == ALL


def test_thread_narrowed_by_its_cpuset_fails_verification_and_rolls_back(m: FakeMachine) -> None:
    # tid 103's cpuset only allows CPUs 0-3: widening it to 4-5 cannot hold.
    m.kernel.masks[103] = {0, 1}
    m.kernel.allowed[103] = {0, 1, 2, 3, 4}
    r = m.engine().apply(plan("p", irq("i", [1], number=24), threads("t", 100, [4, 5], all=True)))
    assert r.state == P.STATE_ROLLED_BACK
    assert _status(r) == {"i": "ROLLED_BACK", "t": "FAILED"}
    assert "tid 103 holds cpus 4" in r.actions[1].reason and "cpuset" in r.actions[1].reason
    assert m.kernel.masks[103] == {0, 1}
    assert all(m.kernel.masks[t] == ALL for t in WORKER_TIDS if t != 103)
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "0-7"


def test_thread_that_exits_meanwhile_is_counted_not_failed(m: FakeMachine) -> None:
    eng = m.engine()
    m.kernel.fail_on("set_affinities", 1, errno.ESRCH, tid=107)
    r = eng.apply(plan("p", threads("t", 100, [1], all=True)))
    assert r.state == P.STATE_APPLIED
    assert r.actions[0].details["threads_exited"] == "1"


def test_kernel_refusal_names_the_thread(m: FakeMachine) -> None:
    m.kernel.fail_on("set_affinities", 1, errno.EPERM, tid=105)
    r = m.engine().apply(plan("p", threads("t", 100, [1], all=True)))
    assert r.state == P.STATE_ROLLED_BACK
    assert "tid 105" in r.actions[0].reason and "EPERM" in r.actions[0].reason
    assert all(m.kernel.masks[t] == ALL for t in WORKER_TIDS)


# ---- cpuset ----------------------------------------------------------------------------------------
def test_cpuset_v1_nested_create_attach_and_restore(m: FakeMachine) -> None:
    base = "sys/fs/cgroup/cpuset/memtopo"
    r = m.engine().apply(plan("p", cpuset("c", "memtopo/a/b", cpus=[4, 5], mems=[1], create=True, attach=[200])))
    assert r.state == P.STATE_APPLIED, r
    # the intermediate level got its parent's sets (a v1 cpuset starts empty), the leaf the plan's
    assert m.read(f"{base}/a/cpuset.cpus").strip() == "0-7"
    assert m.read(f"{base}/a/cpuset.mems").strip() == "0-1,4"
    assert m.read(f"{base}/a/b/cpuset.cpus").strip() == "4-5"
    assert m.read(f"{base}/a/b/cpuset.mems").strip() == "1"
    assert "3:cpuset:/memtopo/a/b" in m.read("proc/200/cgroup")
    assert r.actions[0].details["effective_cpus"] == "4-5"
    assert "memory_migrate" in r.actions[0].details  # v1: placed pages stay, and the result says so
    rb = m.engine().rollback("p")
    assert rb.state == P.STATE_ROLLED_BACK, rb
    assert not (m.root / f"{base}/a").exists()
    assert "3:cpuset:/\n" in m.read("proc/200/cgroup")
    assert "200" in m.read("sys/fs/cgroup/cpuset/cgroup.procs").split()


def test_cpuset_existing_values_restored(m: FakeMachine) -> None:
    job = "sys/fs/cgroup/cpuset/memtopo/job"
    r = m.engine().apply(plan("p", cpuset("c", "memtopo/job", cpus=[4, 5, 6], mems=[0, 1])))
    assert r.state == P.STATE_APPLIED
    assert r.actions[0].before == ["cgroup /sys/fs/cgroup/cpuset/memtopo/job: cpus 0-3 mems 0"]
    assert m.read(f"{job}/cpuset.cpus").strip() == "4-6"
    m.engine().rollback("p")
    assert m.read(f"{job}/cpuset.cpus").strip() == "0-3"
    assert m.read(f"{job}/cpuset.mems").strip() == "0"


def test_cpuset_by_pid_changes_the_process_cgroup(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", cpuset("c", pid=100, cpus=[1, 2])))
    assert r.state == P.STATE_APPLIED
    assert m.read("sys/fs/cgroup/cpuset/memtopo/job/cpuset.cpus").strip() == "1-2"


def test_cpuset_write_refused_midway_restores_the_created_cgroup(m: FakeMachine) -> None:
    m.files.fail_write("sys/fs/cgroup/cpuset/memtopo/new/cpuset.mems", errno.EINVAL)
    r = m.engine().apply(plan("p", cpuset("c", "memtopo/new", cpus=[1], mems=[0], create=True, attach=[200])))
    assert r.state == P.STATE_ROLLED_BACK
    assert "cpuset.mems" in r.actions[0].reason and "EINVAL" in r.actions[0].reason
    assert "partial changes were restored" in r.actions[0].reason
    assert not (m.root / "sys/fs/cgroup/cpuset/memtopo/new").exists()
    assert "3:cpuset:/\n" in m.read("proc/200/cgroup")


def test_cpuset_v2_create_attach_partition_and_restore(m2: FakeMachine) -> None:
    mount = "sys/fs/cgroup"
    r = m2.engine().apply(plan("p", cpuset("c", "memtopo/rt", cpus=[6, 7], mems=[1], create=True,
                                           attach=[200], partition="isolated")))
    assert r.state == P.STATE_APPLIED, r
    assert m2.read(f"{mount}/memtopo/rt/cpuset.cpus.partition").strip() == "isolated"
    assert m2.read(f"{mount}/memtopo/rt/cpuset.cpus").strip() == "6-7"
    assert m2.read("proc/200/cgroup").strip().endswith("0::/memtopo/rt")
    assert r.actions[0].details["hierarchy"] == "cgroup v2 cpuset at /sys/fs/cgroup"
    m2.engine().rollback("p")
    assert not (m2.root / f"{mount}/memtopo/rt").exists()
    assert m2.read("proc/200/cgroup").strip().endswith("0::/")


def test_cpuset_v2_delegation_enabled_down_the_chain_and_disabled_again(m2: FakeMachine) -> None:
    (m2.root / "sys/fs/cgroup/cgroup.subtree_control").write_text("cpu memory\n")
    eng = m2.engine(cgroup_prefixes=("fresh",))
    r = eng.apply(plan("p", cpuset("c", "fresh/a", cpus=[1], create=True)))
    assert r.state == P.STATE_APPLIED, r
    assert "cpuset" in m2.read("sys/fs/cgroup/cgroup.subtree_control").split()
    assert "cpuset" in m2.read("sys/fs/cgroup/fresh/cgroup.subtree_control").split()
    assert m2.read("sys/fs/cgroup/fresh/a/cpuset.cpus").strip() == "1"
    eng.rollback("p")
    assert not (m2.root / "sys/fs/cgroup/fresh").exists()
    assert m2.read("sys/fs/cgroup/cgroup.subtree_control").split() == ["cpu", "memory"]


def test_cpuset_v2_invalid_partition_fails_with_the_kernel_reason(m2: FakeMachine) -> None:
    m2.files.invalid_partition = "Cpu list in cpuset.cpus not exclusive"
    r = m2.engine().apply(plan("p", cpuset("c", "memtopo/job", partition="root")))
    assert r.state == P.STATE_ROLLED_BACK
    assert "not exclusive" in r.actions[0].reason
    assert m2.read("sys/fs/cgroup/memtopo/job/cpuset.cpus.partition").strip() == "member"


# ---- IRQ affinity ----------------------------------------------------------------------------------
def test_irq_by_number_bdf_and_name(m: FakeMachine) -> None:
    p = plan("p", irq("n", [1], number=24), irq("b", [2, 3], bdf="0000:3B:00.0"), irq("s", [4], name="sq_send|cq_up"))
    r = m.engine().apply(p)
    assert r.state == P.STATE_APPLIED, r
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "1"
    assert all(m.read(f"proc/irq/{n}/smp_affinity_list").strip() == "2-3" for n in (40, 41, 42))
    assert all(m.read(f"proc/irq/{n}/smp_affinity_list").strip() == "4" for n in (50, 51))
    s = r.actions[2]
    assert s.details["irqs"] == "50-51" and "sq_send_trigger_irq" in s.after[0]
    assert s.details["effective_affinity"] == "50→4, 51→4"
    m.engine().rollback("p")
    assert all(m.read(f"proc/irq/{n}/smp_affinity_list").strip() == "0-7" for n in (24, 40, 41, 42, 50, 51))


@pytest.mark.parametrize("required", [True, False])
def test_managed_irq_is_skipped_with_its_reason(m: FakeMachine, required: bool) -> None:
    r = m.engine().apply(plan("p", irq("m", [1], number=36, required=required)))
    assert _status(r) == {"m": "SKIPPED"}
    assert "managed by the kernel (EPERM)" in r.actions[0].reason
    assert r.state == P.STATE_UNCHANGED


def test_managed_irq_among_movable_ones_is_reported(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", irq("m", [1], name="nvme0q1|ACPI")))
    assert r.state == P.STATE_APPLIED
    assert r.actions[0].details["unmovable"] == "36 (EPERM)"
    assert "IRQ 36 (nvme0q1): unchanged (managed, EPERM)" in r.actions[0].after
    assert m.read("proc/irq/24/smp_affinity_list").strip() == "1"


def test_unwritable_irq_fails_a_required_action_and_skips_an_optional_one(m: FakeMachine) -> None:
    m.files.fail_write("proc/irq/24/smp_affinity_list", errno.EACCES)
    r = m.engine().apply(plan("p1", irq("a", [2], number=40), irq("b", [1], number=24, required=False)))
    assert r.state == P.STATE_APPLIED
    assert _status(r) == {"a": "APPLIED", "b": "SKIPPED"}
    assert "EACCES" in r.actions[1].reason
    m.files.fail_write("proc/irq/42/smp_affinity_list", errno.EACCES)
    r = m.engine().apply(plan("p2", irq("a", [3], number=41), irq("b", [1], number=42)))
    assert r.state == P.STATE_ROLLED_BACK
    assert m.read("proc/irq/41/smp_affinity_list").strip() == "0-7"


def test_irqbalance_leave_reports_it(tmp_path: Path) -> None:
    m = machine(tmp_path, irqbalance_pid=300)
    r = m.engine(irqbalance="leave").apply(plan("p", irq("i", [1], number=24)))
    assert r.state == P.STATE_APPLIED
    assert "irqbalance running (pid 300, unit irqbalance.service)" in r.actions[0].details["irqbalance"]
    assert "may move these IRQs again" in r.actions[0].details["irqbalance"]
    assert m.runner.calls == []


def test_irqbalance_stop_is_restarted_on_rollback(tmp_path: Path) -> None:
    m = machine(tmp_path, irqbalance_pid=300)
    r = m.engine(irqbalance="stop").apply(plan("p", irq("a", [1], number=24), irq("b", [2], number=40)))
    assert r.state == P.STATE_APPLIED
    assert m.runner.calls == [("systemctl", "stop", "irqbalance.service")]  # once per plan
    m.engine(irqbalance="stop").rollback("p")
    assert ("systemctl", "start", "irqbalance.service") in m.runner.calls


@pytest.fixture(autouse=True)
def patient_irqbalance_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake socket below answers from a thread of this process, which a busy machine may not run
    for seconds: the client's 2 s timeout is for a real irqbalance, not for this stand-in."""
    monkeypatch.setattr(irqbalance, "TIMEOUT_S", 120.0)


SYNC = "memtopo-test-sync"


class FakeIrqbalanceSocket:
    """irqbalance's control socket: ``setup`` answers the banned IRQs, ``settings ban irqs``
    replaces them (as irqbalance.c sock_handle does)."""

    def __init__(self, path: Path, banned: tuple[int, ...]) -> None:
        self.banned = list(banned)
        self.commands: list[str] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                cmd = conn.recv(500).decode()
                self.commands.append(cmd)
                if cmd.startswith("setup"):
                    irqs = "".join(f"IRQ {i} LOAD 0 DIFF 0 CLASS 0 " for i in self.banned)
                    conn.sendall(f"SLEEP 10 {irqs}BANNED 00000000".encode())
                elif cmd.startswith("settings ban irqs "):
                    arg = cmd.removeprefix("settings ban irqs ")
                    self.banned = [] if arg.startswith("NONE") else [int(x) for x in arg.split()]
                elif cmd == SYNC:
                    conn.sendall(b"ok")

    def settled(self) -> FakeIrqbalanceSocket:
        """Wait until every command sent so far has been handled. A ban is sent without waiting for
        an answer (irqbalance gives none), so the client may return before this thread has read it;
        connections are accepted in order, so once ours is answered, every earlier one was handled."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(120)
            s.connect(self.sock.getsockname())
            s.sendall(SYNC.encode())
            s.shutdown(socket.SHUT_WR)
            assert s.recv(2) == b"ok"
        self.commands.remove(SYNC)
        return self

    def holds(self, banned: list[int], timeout: float = 30.0) -> bool:
        """Whether the banned list becomes ``banned``: irqbalance answers no ``settings`` command, so
        the client's send returns before this server's thread has handled it."""
        deadline = time.monotonic() + timeout
        while self.banned != banned and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.banned == banned

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="mt", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_irqbalance_ban_merges_with_its_list_and_restores_it(short_tmp: Path) -> None:
    m = machine(short_tmp, irqbalance_pid=300)
    server = FakeIrqbalanceSocket(m.root / "run/irqbalance/irqbalance300.sock", banned=(7,))
    try:
        r = m.engine(irqbalance="ban").apply(plan("p", irq("a", [1], number=24), irq("b", [2], bdf="0000:3b:00.0")))
        assert r.state == P.STATE_APPLIED, r
        assert server.holds([7, 24, 40, 41, 42]), server.banned
        assert "policy ban" in r.actions[1].details["irqbalance"]
        assert server.commands.count("setup") == 1  # read once per plan, then tracked
        rb = m.engine(irqbalance="ban").rollback("p")
        assert rb.state == P.STATE_ROLLED_BACK, rb
        assert server.holds([7]), server.banned
    finally:
        server.close()


def test_irqbalance_ban_without_socket_is_reported_not_fatal(tmp_path: Path) -> None:
    m = machine(tmp_path, irqbalance_pid=300)
    r = m.engine(irqbalance="ban").apply(plan("p", irq("a", [1], number=24)))
    assert r.state == P.STATE_APPLIED
    assert "could not ban" in r.actions[0].details["irqbalance"]


# ---- page migration --------------------------------------------------------------------------------
def test_migration_reports_numa_maps_before_and_after(m: FakeMachine) -> None:
    m.kernel.not_moved = 3
    r = m.engine().apply(plan("p", migrate("m", 100, [0], [1])))
    assert r.state == P.STATE_APPLIED
    d = r.actions[0].details
    # numa_maps: heap N0=8213 N1=837 plus a file mapping N0=32 (all mappings count)
    assert d["pages_before"] == "N0=8245 N1=837"
    assert d["pages_after"] == "N1=9082"
    assert d["not_moved_reported"] == "3"
    assert d["pages_left_on_source"] == "0"
    assert ("migrate_pages", (100, (0,), (1,))) in m.kernel.calls


def test_migration_with_nothing_to_move_is_unchanged_but_still_asks_the_kernel(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", migrate("m", 100, [4], [0])))
    assert r.state == P.STATE_UNCHANGED
    assert _status(r) == {"m": "UNCHANGED"}
    assert ("migrate_pages", (100, (4,), (0,))) in m.kernel.calls


def test_reversible_migration_is_migrated_back(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", migrate("m", 200, [0], [1])))  # pid 200 has pages only on node 0
    assert r.state == P.STATE_APPLIED
    m.engine().rollback("p")
    assert ("migrate_pages", (200, (1,), (0,))) in m.kernel.calls
    assert "N0=100" in m.read("proc/200/numa_maps")


def test_migration_error_is_a_failure(m: FakeMachine) -> None:
    m.kernel.fail_on("migrate_pages", 1, errno.EPERM)
    r = m.engine().apply(plan("p", migrate("m", 100, [0], [1])))
    assert r.state == P.STATE_ROLLED_BACK
    assert "EPERM" in r.actions[0].reason and "CAP_SYS_NICE" in r.actions[0].reason


# ---- memory policy (running process) ---------------------------------------------------------------
def test_memory_policy_through_the_process_cpuset(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", mempolicy("m", 100, [1], migrate_existing=True)))
    assert r.state == P.STATE_APPLIED, r
    assert m.read("sys/fs/cgroup/cpuset/memtopo/job/cpuset.mems").strip() == "1"
    d = r.actions[0].details
    assert "cpuset mems of cgroup /sys/fs/cgroup/cpuset/memtopo/job" in d["method"]
    assert "migrate_pages" in d["method"]
    assert ("migrate_pages", (100, (0, 4), (1,))) in m.kernel.calls
    m.engine().rollback("p")
    assert m.read("sys/fs/cgroup/cpuset/memtopo/job/cpuset.mems").strip() == "0"


def test_memory_policy_for_a_process_in_the_root_cpuset_gets_its_own_v1_cpuset(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", mempolicy("m", 200, [1])))
    assert r.state == P.STATE_APPLIED, r
    assert "3:cpuset:/memtopo/pid-200" in m.read("proc/200/cgroup")
    assert m.read("sys/fs/cgroup/cpuset/memtopo/pid-200/cpuset.cpus").strip() == "0-7"
    assert "created for it" in r.actions[0].details["method"]
    m.engine().rollback("p")
    assert not (m.root / "sys/fs/cgroup/cpuset/memtopo/pid-200").exists()


def test_memory_policy_on_v2_root_cgroup_is_refused(m2: FakeMachine) -> None:
    r = m2.engine().apply(plan("p", mempolicy("m", 200, [1])))
    assert r.state == P.STATE_REJECTED
    assert "would move every controller" in r.rejections[0]


def test_unified_domain_is_skipped_unless_asked(m: FakeMachine) -> None:
    r = m.engine().apply(plan("p", mempolicy("m", 100, [4])))
    assert _status(r) == {"m": "SKIPPED"}
    assert "Unified memory domain" in r.actions[0].reason
    assert m.read("sys/fs/cgroup/cpuset/memtopo/job/cpuset.mems").strip() == "0"
    r = m.engine().apply(plan("p2", mempolicy("m", 100, [4], unified=True)))
    assert _status(r) == {"m": "APPLIED"}
    assert m.read("sys/fs/cgroup/cpuset/memtopo/job/cpuset.mems").strip() == "4"
