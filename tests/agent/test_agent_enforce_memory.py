"""Moving a pinned container's memory (agent/enforce.py's migration seam): when it runs, with which
processes and nodes, that it runs once per pinning, off the event loop, and that its failure is
reported without undoing the pinning. The runtime here is a stand-in (:class:`StandinRuntime`, an
in-memory CRI client whose cpusets are what the enforcement reads back) on a two-socket model: the
real containerd host has one NUMA node, where nothing is ever on the wrong one (its test is in
test_agent_enforce.py; several nodes in the lab, tests/lab_enforce_script.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.enforce_standins import StandinPods, StandinReporter, kubelet_facts
from memtopo.agent.enforce import (
    IN_PLACE,
    MOVED,
    CgroupCpusets,
    Enforcer,
    MemoryMove,
    MemoryMoveError,
    migration_outcome,
    migration_plan,
)
from memtopo.agent.metrics import EnforceMetrics
from memtopo.hostfs import HostFS
from memtopo.k8s import cri
from memtopo.k8s import enforcement as ef
from memtopo.k8s.cputopo import CpuPlace, CpuTopology
from memtopo.v1 import plan_pb2 as planpb

# Node 0 = CPUs 0-3, node 1 = CPUs 4-7, one core per CPU; memory on both.
TOPO = CpuTopology.of({c: CpuPlace(c, c // 4, c // 4) for c in range(8)})
NODE = ef.NodeFacts("n1", TOPO, frozenset({0}), frozenset({0, 1}))
ALL = frozenset(range(8))


class StandinRuntime:
    """A stand-in for the CRI client: running containers of the kubelet's labels, each with a pid and
    the cpuset its cgroup holds (``update_cpuset`` writes it, ``fail_updates`` refuses)."""

    def __init__(self) -> None:
        self.containers: dict[str, tuple[str, str, int]] = {}  # id → (pod uid, name, pid)
        self.cpusets: dict[int, ef.Observed] = {}
        self.updates: list[tuple[str, frozenset[int], tuple[int, ...]]] = []

    def run(self, cid: str, uid: str, name: str, pid: int) -> None:
        self.containers[cid] = (uid, name, pid)
        self.cpusets[pid] = ef.Observed(ALL, frozenset({0, 1}))

    def list_containers(self, labels: Any = None, state: str | None = cri.RUNNING) -> list[cri.RuntimeContainer]:
        return [cri.RuntimeContainer(cid, "sb", name, "running", 0, uid, uid, "ns")
                for cid, (uid, name, _pid) in self.containers.items()]

    def container_status(self, container_id: str) -> cri.ContainerDetail:
        return cri.ContainerDetail(container_id, "running", self.containers[container_id][2], None, None)

    def update_cpuset(self, container_id: str, cpus: Iterable[int], mems: Iterable[int] = ()) -> None:
        pid = self.containers[container_id][2]
        cpus, mems = frozenset(cpus), tuple(sorted(set(mems)))
        self.updates.append((container_id, cpus, mems))
        self.cpusets[pid] = ef.Observed(cpus, frozenset(mems) or self.cpusets[pid].mems)

    def events(self) -> Iterable[cri.ContainerEvent]:
        raise cri.CriError("UNIMPLEMENTED", "no events")

    def close(self) -> None:
        pass


def guaranteed(uid: str, cpus: int, placement: str | None = None) -> dict[str, Any]:
    res = {"limits": {"cpu": str(cpus), "memory": "1Gi"}, "requests": {"cpu": str(cpus), "memory": "1Gi"}}
    annotations = {ef.PLACEMENT_ANNOTATION: placement} if placement else {}
    return {"metadata": {"uid": uid, "name": uid, "namespace": "ns", "generation": 1,
                         "creationTimestamp": "2026-01-01T00:00:00Z", "annotations": annotations},
            "spec": {"containers": [{"name": "app", "resources": res}]}, "status": {"phase": "Running"}}


class Setup:
    def __init__(self, migrate: Any = None, procs: dict[int, Sequence[int] | None] | None = None) -> None:
        self.runtime, self.pods, self.reporter = StandinRuntime(), StandinPods(), StandinReporter()
        self.metrics = EnforceMetrics()
        self.calls: list[MemoryMove] = []
        self.threads: list[threading.Thread] = []
        self.procs = procs if procs is not None else {}

        def record(move: MemoryMove) -> str:
            self.calls.append(move)
            self.threads.append(threading.current_thread())
            return MOVED

        self.enforcer = Enforcer(
            node=lambda: NODE, kubelet=lambda: kubelet_facts(), connect=lambda: self.runtime,  # type: ignore[arg-type, return-value]
            pods=self.pods, reporter=self.reporter, cpusets=lambda pid: self.runtime.cpusets[pid],
            metrics=self.metrics, migrate=migrate or record, procs=lambda pid: self.procs.get(pid, (pid, pid + 1)))

    async def passes(self, n: int = 2) -> list[str]:
        """``n`` passes, each after the memory moves the one before started have ended."""
        states: list[str] = []
        for _ in range(n):
            states.append((await self.enforcer.reconcile()).state)
            await self.enforcer.moves_done()
        return states

    def migrations(self, result: str) -> float:
        value: float = self.metrics.migrations.labels(result)._value.get()
        return value


def test_a_container_pinned_to_one_of_two_nodes_has_its_pages_moved_once() -> None:
    s = Setup()
    s.runtime.run("c" * 64, "p1", "app", 100)
    s.pods.put(guaranteed("p1", 2, json.dumps({"node": "n1", "cpus": "4-5", "memory": {"nodes": "1"}})))
    assert asyncio.run(s.passes(3)) == ["active"] * 3
    # Pinned first (the CRI update), then the container's processes, all of them, off node 0 onto node 1.
    assert s.runtime.updates == [("c" * 64, frozenset({4, 5}), (1,))]
    assert s.calls == [MemoryMove("p1", "c" * 64, (100, 101), (0,), (1,))]
    assert all(t is not threading.main_thread() for t in s.threads)  # never on the event loop
    status = s.reporter.status("p1")
    assert status["state"] == "applied" and status["memory"] == "moved" and status["mems"] == "1"
    assert s.migrations("moved") == 1 and s.migrations("failed") == 0
    assert [e[2] for e in s.reporter.events] == ["CPUsPinned", "MemoryMoved"]


def test_drift_put_back_moves_nothing_again_but_a_new_pinning_does() -> None:
    s = Setup()
    s.runtime.run("c1", "p1", "app", 100)
    s.pods.put(guaranteed("p1", 1, json.dumps({"node": "n1", "cpus": "4", "memory": {"nodes": "1"}})))

    async def scenario() -> None:
        await s.passes()
        s.runtime.cpusets[100] = ef.Observed(ALL, frozenset({1}))  # someone widened its CPUs
        await s.passes()
        assert len(s.runtime.updates) == 2 and len(s.calls) == 1
        # The container restarts (a new id): pinned again, moved again.
        del s.runtime.containers["c1"]
        s.runtime.run("c2", "p1", "app", 200)
        await s.passes()

    asyncio.run(scenario())
    assert [(m.container, m.pids) for m in s.calls] == [("c1", (100, 101)), ("c2", (200, 201))]


def test_a_container_on_every_memory_node_or_pinned_by_the_kubelets_rule_on_all_is_not_moved() -> None:
    s = Setup()
    s.runtime.run("c1", "p1", "app", 100)
    s.pods.put(guaranteed("p1", 2, json.dumps({"node": "n1", "cpus": "4-5", "memory": {"nodes": "0,1"}})))
    asyncio.run(s.passes())
    assert s.runtime.updates and s.reporter.status("p1")["state"] == "applied"
    assert s.calls == [] and "memory" not in s.reporter.status("p1")
    assert s.migrations("moved") + s.migrations("in_place") + s.migrations("failed") == 0


@pytest.mark.parametrize(("failure", "procs", "reason"), [
    (MemoryMoveError("the plan was refused: x"), None, "failed: the plan was refused: x"),
    (RuntimeError("engine \x1b[2J" + "z" * 500), None, "failed: engine \\x1b[2J"),
    (None, {100: None}, "failed: the container's cgroup.procs cannot be read"),
    (None, {100: ()}, "failed: the container has no processes left"),
])
def test_a_failed_move_is_reported_and_the_pinning_kept(failure: Exception | None,
                                                        procs: dict[int, Sequence[int] | None] | None,
                                                        reason: str) -> None:
    def fail(move: MemoryMove) -> str:
        assert failure is not None
        raise failure

    s = Setup(migrate=fail if failure else None, procs=procs)
    s.runtime.run("c1", "p1", "app", 100)
    s.pods.put(guaranteed("p1", 1, json.dumps({"node": "n1", "cpus": "4", "memory": {"nodes": "1"}})))
    assert asyncio.run(s.passes(3)) == ["active"] * 3
    status = s.reporter.status("p1")
    assert status["state"] == "applied" and status["cpus"] == "4"
    assert status["memory"].startswith(reason) and len(status["memory"]) < 200 and "\x1b" not in status["memory"]
    # Nothing undone: the one update is the pinning, and it stays; not retried every pass.
    assert s.runtime.updates == [("c1", frozenset({4}), (1,))] and s.runtime.cpusets[100].cpus == frozenset({4})
    assert s.migrations("failed") == 1
    assert [e[1:3] for e in s.reporter.events] == [("Normal", "CPUsPinned"), ("Warning", "MemoryMoveFailed")]


def test_without_a_migrator_pages_stay_and_nothing_is_said() -> None:
    s = Setup()
    s.enforcer.migrate = None
    s.runtime.run("c1", "p1", "app", 100)
    s.pods.put(guaranteed("p1", 1, json.dumps({"node": "n1", "cpus": "4", "memory": {"nodes": "1"}})))
    asyncio.run(s.passes())
    assert s.calls == [] and "memory" not in s.reporter.status("p1")


def test_the_loop_waits_for_a_move_in_flight_when_it_stops() -> None:
    started, release = threading.Event(), threading.Event()

    def slow(move: MemoryMove) -> str:
        started.set()
        release.wait(30)
        return IN_PLACE

    s = Setup(migrate=slow)
    s.runtime.run("c1", "p1", "app", 100)
    s.pods.put(guaranteed("p1", 1, json.dumps({"node": "n1", "cpus": "4", "memory": {"nodes": "1"}})))

    async def scenario() -> None:
        loop = asyncio.create_task(s.enforcer.run())
        await asyncio.to_thread(started.wait, 30)
        loop.cancel()
        await asyncio.sleep(0.05)
        assert not loop.done()  # still waiting for the migration, which the engine finishes
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await loop

    asyncio.run(scenario())
    assert s.migrations("in_place") == 1


def test_cgroup_procs_are_read_from_the_containers_cpuset_cgroup_bounded(tmp_path: Path) -> None:
    """cgroup.procs beside the cpuset files the drift check reads (fake roots in the kernel's formats,
    v1 and v2)."""
    for v2 in (False, True):
        root = tmp_path / ("v2" if v2 else "v1")
        (root / "proc/self").mkdir(parents=True)
        mount = ("45 40 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n" if v2 else
                 "45 40 0:27 / /sys/fs/cgroup/cpuset rw,nosuid - cgroup cgroup rw,cpuset\n")
        (root / "proc/self/mountinfo").write_text(mount)
        base = root / ("sys/fs/cgroup" if v2 else "sys/fs/cgroup/cpuset")
        for pid, path, procs in ((123, "kubepods/podB/c1", "123\n130\n123\n"), (7, "kubepods/podB/c2", "7\nx\n"),
                                 (8, "kubepods/podB/c3", "8\n" * 40_000)):
            (root / f"proc/{pid}").mkdir(parents=True)
            (root / f"proc/{pid}/cgroup").write_text(f"0::/{path}\n" if v2 else f"5:cpuset:/{path}\n")
            (base / path).mkdir(parents=True)
            (base / path / "cgroup.procs").write_text(procs)
        read = CgroupCpusets(HostFS.at(root)).procs
        assert read(123) == (123, 130)
        assert read(7) is None  # not a pid list
        assert read(8) is None  # larger than any container's list is read
        assert read(999) is None  # gone


def test_the_plan_is_one_optional_action_per_process_and_its_result_is_read() -> None:
    move = MemoryMove("p1", "c" * 64, (100, 101), (0, 2), (1,))
    plan = migration_plan(move, "enforce-memory-x")
    assert [(a.id, a.required, a.page_migration.pid, list(a.page_migration.from_nodes),
             list(a.page_migration.to_nodes)) for a in plan.actions] == [
        ("pid-100", False, 100, [0, 2], [1]), ("pid-101", False, 101, [0, 2], [1])]
    S, P = planpb.ActionResult, planpb.PlanResult  # noqa: N806 - the proto's enums, as the engine names them

    def result(state: int, *statuses: int, rejections: Sequence[str] = ()) -> planpb.PlanResult:
        r = P(plan_id="x", state=state, message="m", rejections=rejections)  # type: ignore[arg-type]
        for i, st in enumerate(statuses):
            why = "process 5 does not exist" if st == S.STATUS_SKIPPED else ""
            r.actions.add(action_id=f"pid-{i}", status=st, reason=why)
        return r

    assert migration_outcome(result(P.STATE_APPLIED, S.STATUS_APPLIED, S.STATUS_SKIPPED)) == MOVED
    assert migration_outcome(result(P.STATE_UNCHANGED, S.STATUS_UNCHANGED)) == IN_PLACE
    with pytest.raises(MemoryMoveError, match="refused: pid-1: NUMA node 7"):
        migration_outcome(result(P.STATE_REJECTED, rejections=["pid-1: NUMA node 7 does not exist"]))
    with pytest.raises(MemoryMoveError, match="process 5 does not exist"):
        migration_outcome(result(P.STATE_APPLIED, S.STATUS_SKIPPED))
    with pytest.raises(MemoryMoveError, match="x: m"):
        migration_outcome(result(P.STATE_FAILED, S.STATUS_FAILED))
