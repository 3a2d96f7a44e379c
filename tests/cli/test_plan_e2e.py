"""End to end on the synthesized Ascend A3 host: discovery → ``memtopo plan cpu-binding
--pid`` → ``memtopo apply --dry-run`` shows the diff the decision implies.

The A3 host (``tests/fixtures/ascend-a3-16npu``: 640 CPUs on 8 nodes, 16 running NPUs) has no IRQ
files, so a copy of it gets NPU 0's two MSI-X vectors in the kernel's formats
(``sys/bus/pci/devices/<bdf>/msi_irqs/<n>`` and ``sys/kernel/irq/<n>/actions``) named as the Ascend
driver names them (``sq_send_trigger_irq``, ``cq_update_irq``). Two runs:

* a real child process with role-named threads, planned from that root and dry-run through
  ``memtopo apply`` on this host. Its CPUs 2-39 do not exist here, so apply is given the A3 topology
  (what it validates CPUs and the plan's fingerprint against) in place of this host's discovery;
  the threads, their masks and the IRQ files are this host's;
* the fake host of ``tests/apply_fakes.py`` (whose worker has acl/release threads, pages on nodes 0
  and 1, and the two IRQs) through ``apply.engine.Engine`` with the A3 topology as its provider,
  where every action, the optional IRQ and migration ones included, would change something.

Expected CPUs are the A3 table of vLLM-Ascend's CPU-binding design document: NPU 0 → pool 0-39, IRQ 0 and 1,
main 2-37, ACL 38, release 39; the pool is node 0's, so pages move from nodes 1-7 to node 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import memtopo.cli.apply
from memtopo.apply.config import ApplyConfig
from memtopo.apply.engine import Engine
from memtopo.apply.planio import load_plan
from memtopo.cpulist import format_cpulist
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests import apply_fakes
from tests.cli.main_call import memtopo_main
from tests.fixtures import extracted

A3_TARBALL = Path(__file__).parents[1] / "fixtures" / "ascend-a3-16npu" / "root.tar.gz"
NPU0_BDF = "0000:9d:00.0"  # Phy-ID 0 (README of the fixture), logical 0
S = planpb.ActionResult

# vLLM-Ascend's design-document A3 table, NPU 0.
POOL, IRQ_CPUS, MAIN, ACL, RELEASE = "0-39", "0-1", "2-37", 38, 39


def _free_irq_pair() -> tuple[int, int]:
    """Two adjacent IRQ numbers this host does not have, so the live dry run cannot touch real ones."""
    for sq in range(9000, 9100, 2):
        if not any(Path(f"/proc/irq/{n}").exists() for n in (sq, sq + 1)):
            return sq, sq + 1
    raise AssertionError("no free IRQ numbers in 9000-9099")


SQ_IRQ, CQ_IRQ = _free_irq_pair()


@dataclass(frozen=True)
class A3:
    root: Path
    topology: pb.MemoryTopology


# The A3 host copied and discovered once for the module, on one xdist worker.
pytestmark = pytest.mark.xdist_group("plan-e2e-a3")


@pytest.fixture(scope="module")
def a3(tmp_path_factory: pytest.TempPathFactory) -> A3:
    root = tmp_path_factory.mktemp("a3") / "root"
    shutil.copytree(extracted(A3_TARBALL), root, symlinks=True)
    device = (root / "sys/bus/pci/devices" / NPU0_BDF).resolve()
    assert device.is_relative_to(root.resolve())
    (device / "msi_irqs").mkdir()
    for irq, action in ((SQ_IRQ, "sq_send_trigger_irq"), (CQ_IRQ, "cq_update_irq")):
        (device / "msi_irqs" / str(irq)).write_text("msix\n")
        (root / f"sys/kernel/irq/{irq}").mkdir(parents=True)
        (root / f"sys/kernel/irq/{irq}/actions").write_text(action + "\n")
    topo = discover(ProbeContext.at_root(root))
    npu0 = next(a for a in topo.accelerators if a.kind == pb.ACCELERATOR_KIND_NPU and a.index == 0)
    assert npu0.bdf == NPU0_BDF
    return A3(root, topo)


# ---- the child process -------------------------------------------------------------------------------
CHILD = r"""
import json, os, sys, threading

def name(comm):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(comm)

tids = {"main": threading.get_native_id()}
ready = threading.Barrier(4)
stop = threading.Event()

def worker(comm):
    name(comm)
    tids[comm] = threading.get_native_id()
    ready.wait()
    stop.wait()

for comm in ("acl_thread", "release_thread", "worker"):
    threading.Thread(target=worker, args=(comm,), daemon=True).start()
ready.wait()
print(json.dumps(tids), flush=True)
sys.stdin.read()
"""


@dataclass(frozen=True)
class Child:
    pid: int
    comm: str  # the main thread's name (the interpreter's file name)
    tids: dict[str, int]  # role → tid: main, acl_thread, release_thread, worker


@pytest.fixture
def child() -> Iterator[Child]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        tids = json.loads(proc.stdout.readline())
        yield Child(proc.pid, Path(f"/proc/{proc.pid}/comm").read_text().strip(), tids)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- memtopo ------------------------------------------------------------------------------------------
def plan_for(monkeypatch: pytest.MonkeyPatch, a3: A3, pid: int) -> dict[str, Any]:
    rc, text = memtopo_main(monkeypatch, ["plan", "cpu-binding", "--request", "-", "--root", str(a3.root),
                                     "--pid", str(pid), "--npu", "0", "--emit", "both"], "{}")
    assert rc == 0, text
    doc: dict[str, Any] = json.loads(text)
    return doc


def results(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {a["action_id"]: a for a in result["actions"]}


def test_plan_follows_the_decision(monkeypatch: pytest.MonkeyPatch, a3: A3, child: Child) -> None:
    doc = plan_for(monkeypatch, a3, child.pid)
    decision, plan = doc["decision"], load_plan(json.dumps(doc["plan"]))
    assert decision["npus"]["0"] == {"cpus": POOL, "irq": IRQ_CPUS, "main": MAIN, "acl": ACL, "release": RELEASE}
    assert decision["facts"]["fingerprint"] == plan.topology_fingerprint == a3.topology.fingerprint
    kinds = [(a.id, a.WhichOneof("action"), a.required) for a in plan.actions]
    assert kinds == [("npu0-main", "thread_affinity", True), ("npu0-acl", "thread_affinity", True),
                     ("npu0-release", "thread_affinity", True), ("npu0-migrate", "page_migration", False),
                     (f"npu0-irq-sq-{SQ_IRQ}", "irq_affinity", False), (f"npu0-irq-cq-{CQ_IRQ}", "irq_affinity", False)]
    migrate = plan.actions[3].page_migration
    assert (migrate.pid, list(migrate.from_nodes), list(migrate.to_nodes)) == (child.pid, list(range(1, 8)), [0])
    assert [list(a.irq_affinity.cpus) for a in plan.actions[4:]] == [[0], [1]]


def test_dry_run_of_a_real_process(monkeypatch: pytest.MonkeyPatch, a3: A3, child: Child,
                                   tmp_path: Path) -> None:
    doc = plan_for(monkeypatch, a3, child.pid)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(doc["plan"]))
    # apply validates against the topology it discovers; here that is the A3 host the plan was made for.
    monkeypatch.setattr(memtopo.cli.apply, "live_topology", lambda: a3.topology)
    before = {tid: os.sched_getaffinity(tid) for tid in child.tids.values()}
    rc, text = memtopo_main(monkeypatch, ["apply", str(plan_file), "--dry-run", "--state-dir", str(tmp_path / "state"),
                                     "--format", "json"])
    result = json.loads(text)
    assert rc == 0 and result["state"] == "STATE_DRY_RUN", text
    by_id = results(result)
    # The diff names each role's threads, from the CPUs they have now to the CPUs the decision gave
    # the role: main is every thread but the ACL and release ones.
    comm, tids = child.comm, child.tids
    now = format_cpulist(os.sched_getaffinity(child.pid))
    main_threads = f"pid {child.pid} ({comm}) tid {tids['main']} {comm}, tid {tids['worker']} worker"
    expected = {
        "npu0-main": ([f"{main_threads}: cpus {now}"], [f"{main_threads}: cpus {MAIN}"]),
        "npu0-acl": ([f"pid {child.pid} ({comm}) tid {tids['acl_thread']} acl_thread: cpus {now}"],
                     [f"pid {child.pid} ({comm}) tid {tids['acl_thread']} acl_thread: cpus {ACL}"]),
        "npu0-release": ([f"pid {child.pid} ({comm}) tid {tids['release_thread']} release_thread: cpus {now}"],
                         [f"pid {child.pid} ({comm}) tid {tids['release_thread']} release_thread: cpus {RELEASE}"]),
    }
    for aid, (was, will) in expected.items():
        assert (by_id[aid]["status"], by_id[aid]["before"], by_id[aid]["after"]) == ("STATUS_WOULD_CHANGE", was, will)
    # Optional actions are listed: the migration reads this host's numa_maps (nothing lives on nodes
    # 1-7 here); the IRQs do not exist on this host, so they are skipped with the reason.
    migrate = by_id["npu0-migrate"]
    assert migrate["status"] in ("STATUS_UNCHANGED", "STATUS_WOULD_CHANGE"), migrate
    assert migrate["after"][0].startswith(f"pid {child.pid} ({comm}): pages on node(s) 1-7 moved to 0")
    for irq in (SQ_IRQ, CQ_IRQ):
        skipped = next(a for a in result["actions"] if a["action_id"].endswith(f"-{irq}"))
        assert skipped["status"] == "STATUS_SKIPPED" and f"IRQ {irq} does not exist" in skipped["reason"]
    # A dry run changes nothing.
    assert {tid: os.sched_getaffinity(tid) for tid in child.tids.values()} == before
    # The human view shows the same diff.
    rc, text = memtopo_main(monkeypatch, ["apply", str(plan_file), "--dry-run", "--state-dir", str(tmp_path / "state")])
    assert rc == 0
    assert f"      + {main_threads}: cpus {MAIN}" in text and f"[SKIPPED] npu0-irq-sq-{SQ_IRQ}" in text
    assert "npu0-main thread_affinity (required)" in text


def test_dry_run_on_the_fake_host_shows_every_action(monkeypatch: pytest.MonkeyPatch, a3: A3,
                                                     tmp_path: Path) -> None:
    irqs = [*apply_fakes.standard_irqs(),
            apply_fakes.FakeIrq(SQ_IRQ, "sq_send_trigger_irq", f"PCI-MSIX-{NPU0_BDF}   0-edge"),
            apply_fakes.FakeIrq(CQ_IRQ, "cq_update_irq", f"PCI-MSIX-{NPU0_BDF}   1-edge")]
    m = apply_fakes.machine(tmp_path, irqs=irqs)
    worker = 100  # threads 100-110: worker, acl_thread (101), release_thread (102), worker …
    doc = plan_for(monkeypatch, a3, worker)
    plan = load_plan(json.dumps(doc["plan"]))
    engine = Engine(m.host, lambda: a3.topology, m.state_dir, ApplyConfig(self_pid=apply_fakes.SELF_PID))
    snapshot = m.snapshot()
    result = engine.apply(plan, dry_run=True)
    assert result.state == planpb.PlanResult.STATE_DRY_RUN, result
    by_id = {a.action_id: a for a in result.actions}
    assert {aid: a.status for aid, a in by_id.items()} == {a.id: S.STATUS_WOULD_CHANGE for a in plan.actions}
    main_tids = ", ".join(f"tid {t} worker" for t in (100, *range(103, 111)))
    assert list(by_id["npu0-main"].before) == [f"pid 100 (worker) {main_tids}: cpus 0-7"]
    assert list(by_id["npu0-main"].after) == [f"pid 100 (worker) {main_tids}: cpus {MAIN}"]
    assert list(by_id["npu0-acl"].after) == [f"pid 100 (worker) tid 101 acl_thread: cpus {ACL}"]
    assert list(by_id["npu0-release"].after) == [f"pid 100 (worker) tid 102 release_thread: cpus {RELEASE}"]
    # Pages: the worker has N0=8213 N1=837; the 837 on node 1 move to the pool's node 0.
    assert list(by_id["npu0-migrate"].after) == ["pid 100 (worker): pages on node(s) 1-7 moved to 0 (837 to move)"]
    # The SQ IRQ to the pool's first CPU, the CQ IRQ to its second (as vLLM-Ascend pins them), from every CPU.
    sq, cq = by_id[f"npu0-irq-sq-{SQ_IRQ}"], by_id[f"npu0-irq-cq-{CQ_IRQ}"]
    assert (list(sq.before), list(sq.after)) == ([f"IRQ {SQ_IRQ}: affinity 0-7"], [f"IRQ {SQ_IRQ}: affinity 0"])
    assert (list(cq.before), list(cq.after)) == ([f"IRQ {CQ_IRQ}: affinity 0-7"], [f"IRQ {CQ_IRQ}: affinity 1"])
    assert m.kernel.mutations() == [] and m.snapshot() == snapshot


def test_apply_on_another_host_refuses_the_plan(monkeypatch: pytest.MonkeyPatch, a3: A3, child: Child,
                                               tmp_path: Path) -> None:
    # Without standing in the A3 topology, apply discovers this host: the plan carries the A3
    # fingerprint, so it is refused before anything is looked at, with the reason.
    rc, text = memtopo_main(monkeypatch, ["plan", "cpu-binding", "--request", "-", "--root", str(a3.root),
                                     "--pid", str(child.pid), "--npu", "0", "--emit", "plan"], "{}")
    assert rc == 0
    rc, out = memtopo_main(monkeypatch, ["apply", "-", "--dry-run", "--state-dir", str(tmp_path / "state"),
                                    "--format", "json"], text)
    result = json.loads(out)
    assert rc == 1 and result["state"] == "STATE_REJECTED"
    assert any("re-plan" in r and a3.topology.fingerprint[:16] in r for r in result["rejections"])


# ---- place --pid on this host -------------------------------------------------------------------------
def test_place_plan_of_a_real_process_dry_runs_on_this_host(monkeypatch: pytest.MonkeyPatch, child: Child,
                                                            tmp_path: Path) -> None:
    """Discovery of the live host → ``plan place --pid`` → ``apply --dry-run``: no topology is swapped
    in, so the plan's fingerprint must match what apply discovers, and the diff is every thread of the
    child moving to the CPU the decision chose."""
    rc, text = memtopo_main(monkeypatch, ["plan", "place", "--request", "-", "--pid", str(child.pid),
                                          "--emit", "both"], '{"cpus": 1}')
    assert rc == 0, text
    doc = json.loads(text)
    decision, plan = doc["decision"], load_plan(json.dumps(doc["plan"]))
    assert plan.plan_id.startswith(f"place-pid{child.pid}-") and plan.policy == "place"
    assert plan.topology_fingerprint == decision["facts"]["fingerprint"] and decision["facts"]["source"] == "live host"
    assert plan.actions[0].id == "place-cpus" and format_cpulist(plan.actions[0].thread_affinity.cpus) == \
        decision["cpus"]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(doc["plan"]))
    before = {tid: os.sched_getaffinity(tid) for tid in child.tids.values()}
    rc, text = memtopo_main(monkeypatch, ["apply", str(plan_file), "--dry-run", "--state-dir",
                                          str(tmp_path / "state"), "--format", "json"])
    result = json.loads(text)
    assert rc == 0 and result["state"] == "STATE_DRY_RUN", text
    cpus = results(result)["place-cpus"]
    now = format_cpulist(os.sched_getaffinity(child.pid))
    comm = child.comm
    # Every thread at once: apply summarises them rather than naming each.
    threads = f"{len(child.tids)} threads [tid {format_cpulist(child.tids.values())}]"
    assert cpus["before"] == [f"pid {child.pid} ({comm}) {threads}: cpus {now}"]
    assert cpus["after"] == [f"pid {child.pid} ({comm}) {threads}: cpus {decision['cpus']}"]
    assert cpus["status"] == ("STATUS_UNCHANGED" if now == decision["cpus"] else "STATUS_WOULD_CHANGE")
    assert {tid: os.sched_getaffinity(tid) for tid in child.tids.values()} == before  # a dry run changes nothing
