"""The engine for real on this machine (root, cgroup v1 cpuset, real IRQs, one NUMA node).

Every test restores what it changed, through the engine and again in a ``finally``. Targets are
child processes started here; the IRQ is one whose affinity the kernel lets us write, put back
afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from memtopo.apply.config import ApplyConfig
from memtopo.apply.engine import Engine, Hook
from memtopo.apply.host import Host
from memtopo.cpulist import format_cpulist, parse_cpulist
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests.apply_fakes import cpuset, irq, migrate, plan, threads

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: changes real affinities, cpusets and IRQs"),
    # Several tests write the same real IRQ's affinity (the first writable one): one at a time, on
    # one xdist worker.
    pytest.mark.xdist_group("host-irq"),
]

REPO = Path(__file__).resolve().parents[2]
P = planpb.PlanResult
S = planpb.ActionResult
V1_CPUSET = Path("/sys/fs/cgroup/cpuset")

# A child with named threads (the CPU-binding roles: ACL and release threads, workers), printing its pid and
# thread ids.
CHILD = r"""
import ctypes, sys, threading, os
libc = ctypes.CDLL(None)
stop = threading.Event()
tids = {}
def run(name):
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
    tids[name] = threading.get_native_id()
    stop.wait()
names = ["acl_thread", "release_thread", "worker_a", "worker_b"]
ts = [threading.Thread(target=run, args=(n,), daemon=True) for n in names]
for t in ts: t.start()
while len(tids) < len(names): pass
buf = bytearray(8 << 20)  # some anonymous memory for numa_maps
for i in range(0, len(buf), 4096): buf[i] = 1
print(os.getpid(), " ".join(f"{k}={v}" for k, v in tids.items()), flush=True)
sys.stdin.readline()
"""


@dataclass
class Child:
    proc: subprocess.Popen[str]
    tids: dict[str, int]

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextlib.contextmanager
def child() -> Iterator[Child]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        tids = {k: int(v) for k, v in (kv.split("=") for kv in line[1:])}
        yield Child(proc, tids)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def topo() -> pb.MemoryTopology:
    return discover(ProbeContext.live())


@pytest.fixture
def prefix() -> str:
    return f"memtopo-test-{uuid.uuid4().hex[:8]}"


def engine(state: Path, topo: pb.MemoryTopology, prefix: str = "memtopo", hook: Hook | None = None) -> Engine:
    return Engine(Host.live(), lambda: topo, state, ApplyConfig(cgroup_prefixes=(prefix,), irqbalance="leave"),
                  hook=hook)


def status_list(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def cpu_pair() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two allowed CPUs")
    return cpus[0], cpus[-1]


@contextlib.contextmanager
def cleanup_cgroup(name: str, pids: list[int]) -> Iterator[Path]:
    path = V1_CPUSET / name
    try:
        yield path
    finally:
        if path.exists():
            for sub in sorted(path.rglob("cgroup.procs"), key=lambda p: -len(p.parts)):
                for member in sub.read_text().split():
                    with contextlib.suppress(OSError):
                        (V1_CPUSET / "cgroup.procs").write_text(member)
            for d in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                d.rmdir()
            path.rmdir()
        for pid in pids:
            with contextlib.suppress(OSError):
                (V1_CPUSET / "cgroup.procs").write_text(str(pid))


def writable_irq() -> tuple[int, str]:
    """An IRQ whose affinity the kernel lets us write (writing its own value back changes nothing);
    configuration vectors and ACPI events first: they hardly ever fire."""
    names: dict[int, str] = {}
    for line in Path("/proc/interrupts").read_text().splitlines()[1:]:
        head, _, rest = line.partition(":")
        if head.strip().isdigit():
            names[int(head)] = rest.split()[-1] if rest.split() else ""
    ranked = sorted(names, key=lambda n: (not names[n].endswith(("-config", "Ged")), n))
    for n in ranked:
        f = Path(f"/proc/irq/{n}/smp_affinity_list")
        try:
            f.write_text(f.read_text().strip())
        except OSError:
            continue
        return n, f.read_text().strip()
    pytest.skip("no IRQ with a writable smp_affinity_list here")


# ---- tests -----------------------------------------------------------------------------------------
def test_named_threads_get_per_role_affinity(tmp_path: Path, topo: pb.MemoryTopology) -> None:
    a, b = cpu_pair()
    with child() as c:
        original = {t: os.sched_getaffinity(t) for t in (c.pid, *c.tids.values())}
        eng = engine(tmp_path, topo)
        p = plan("roles", threads("main", c.pid, [a], all=True), threads("acl", c.pid, [b], name="acl_thread"),
                 threads("rel", c.pid, [a, b], name="release_.*"))
        try:
            r = eng.apply(p)
            assert r.state == P.STATE_APPLIED, r
            assert os.sched_getaffinity(c.tids["acl_thread"]) == {b}
            assert os.sched_getaffinity(c.tids["release_thread"]) == {a, b}
            assert os.sched_getaffinity(c.tids["worker_a"]) == {a}
            assert os.sched_getaffinity(c.pid) == {a}
            assert f"acl_thread: cpus {b}" in r.actions[1].after[0]
            rb = eng.rollback("roles")
            assert rb.state == P.STATE_ROLLED_BACK, rb
            assert {t: os.sched_getaffinity(t) for t in original} == original
        finally:
            for t, mask in original.items():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(t, mask)


@pytest.mark.skipif(not (V1_CPUSET / "cpuset.cpus").exists(), reason="no cgroup v1 cpuset mount here")
def test_cpuset_created_child_moved_in_verified_and_removed(tmp_path: Path, topo: pb.MemoryTopology,
                                                            prefix: str) -> None:
    _, b = cpu_pair()
    mem = sorted(topo.allowed_memory_nodes)[0]
    with child() as c, cleanup_cgroup(prefix, [c.pid]) as path:
        before_cg = Path(f"/proc/{c.pid}/cgroup").read_text()
        eng = engine(tmp_path, topo, prefix)
        r = eng.apply(plan("cs", cpuset("c", f"{prefix}/job", cpus=[b], mems=[mem], create=True, attach=[c.pid])))
        assert r.state == P.STATE_APPLIED, r
        assert status_list(c.pid, "Cpus_allowed_list") == str(b)
        assert status_list(c.pid, "Mems_allowed_list") == str(mem)
        assert f"cpuset:/{prefix}/job" in Path(f"/proc/{c.pid}/cgroup").read_text()
        assert (path / "job" / "cpuset.cpus").read_text().strip() == str(b)
        rb = eng.rollback("cs")
        assert rb.state == P.STATE_ROLLED_BACK, rb
        assert not path.exists()
        assert Path(f"/proc/{c.pid}/cgroup").read_text() == before_cg
        assert parse_cpulist(status_list(c.pid, "Cpus_allowed_list")) == tuple(sorted(os.sched_getaffinity(0)))


def test_irq_affinity_changed_verified_and_restored(tmp_path: Path, topo: pb.MemoryTopology) -> None:
    a, b = cpu_pair()
    n, original = writable_irq()
    target = [b] if parse_cpulist(original) != (b,) else [a]
    f = Path(f"/proc/irq/{n}/smp_affinity_list")
    try:
        eng = engine(tmp_path, topo)
        r = eng.apply(plan("irq", irq("i", target, number=n)))
        assert r.state == P.STATE_APPLIED, r
        assert f.read_text().strip() == format_cpulist(target)
        assert "effective_affinity" in r.actions[0].details
        rb = eng.rollback("irq")
        assert rb.state == P.STATE_ROLLED_BACK, rb
        assert f.read_text().strip() == original
    finally:
        with contextlib.suppress(OSError):
            f.write_text(original)


def test_managed_irq_is_skipped_with_the_kernel_errno(tmp_path: Path, topo: pb.MemoryTopology) -> None:
    managed = [int(p.parent.name) for p in Path("/proc/irq").glob("*/smp_affinity_list")
               if not os.stat(p).st_mode & 0o200]
    if not managed:
        pytest.skip("no managed (read-only) IRQ here")
    n = managed[0]
    original = Path(f"/proc/irq/{n}/smp_affinity_list").read_text().strip()
    cur = parse_cpulist(original)
    target = [c for c in sorted(os.sched_getaffinity(0)) if (c,) != cur][:1]
    r = engine(tmp_path, topo).apply(plan("m", irq("i", target, number=n, required=False)))
    assert r.actions[0].status == S.STATUS_SKIPPED
    assert "managed by the kernel" in r.actions[0].reason
    assert Path(f"/proc/irq/{n}/smp_affinity_list").read_text().strip() == original


def test_migrate_pages_runs_and_reports_counts(tmp_path: Path, topo: pb.MemoryTopology) -> None:
    node = sorted(topo.allowed_memory_nodes)[0]
    with child() as c:
        r = engine(tmp_path, topo).apply(plan("mig", migrate("m", c.pid, [node], [node])))
        assert r.state in (P.STATE_APPLIED, P.STATE_UNCHANGED), r
        d = r.actions[0].details
        # the child touched 8 MiB: at least 2048 pages on the node, before and after
        before = dict(kv.split("=") for kv in d["pages_before"].split())
        assert int(before[f"N{node}"]) >= 2048
        assert d["not_moved_reported"] == "0"
        assert d["pages_after"].startswith(f"N{node}=")


def test_third_action_failing_leaves_the_first_two_restored(tmp_path: Path, topo: pb.MemoryTopology) -> None:
    a, b = cpu_pair()
    n, original = writable_irq()
    target = [b] if parse_cpulist(original) != (b,) else [a]
    f = Path(f"/proc/irq/{n}/smp_affinity_list")
    with child() as c, child() as victim:
        masks = {t: os.sched_getaffinity(t) for t in (c.pid, *c.tids.values())}

        def kill_victim(event: str, action: planpb.PlanAction) -> None:
            if event == "after_action" and action.id == "irq":
                victim.proc.kill()
                victim.proc.wait()

        try:
            eng = engine(tmp_path, topo, hook=kill_victim)
            r = eng.apply(plan("fail3", threads("pin", c.pid, [a], all=True), irq("irq", target, number=n),
                               threads("victim", victim.pid, [a], all=True)))
            assert r.state == P.STATE_ROLLED_BACK, r
            assert [S.Status.Name(x.status) for x in r.actions] == [
                "STATUS_ROLLED_BACK", "STATUS_ROLLED_BACK", "STATUS_FAILED"]
            assert "exited" in r.actions[2].reason
            assert {t: os.sched_getaffinity(t) for t in masks} == masks
            assert f.read_text().strip() == original
        finally:
            with contextlib.suppress(OSError):
                f.write_text(original)
            for t, mask in masks.items():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(t, mask)


def test_plan_killed_midway_is_rolled_back_on_restart(tmp_path: Path, topo: pb.MemoryTopology, prefix: str) -> None:
    a, b = cpu_pair()
    n, original = writable_irq()
    target = [b] if parse_cpulist(original) != (b,) else [a]
    f = Path(f"/proc/irq/{n}/smp_affinity_list")
    state = tmp_path / "state"
    marker = tmp_path / "paused"
    with child() as c:
        masks = {t: os.sched_getaffinity(t) for t in (c.pid, *c.tids.values())}
        p = plan("killed", threads("pin", c.pid, [a], all=True), irq("irq", target, number=n),
                 threads("acl", c.pid, [b], name="acl_thread"))
        plan_file = tmp_path / "plan.json"
        from memtopo.protojson import to_json
        plan_file.write_text(to_json(p))
        # `memtopo apply` paused after the IRQ action (tests/apply_pausing.py: the CLI with a hook).
        agent = subprocess.Popen([sys.executable, "-m", "tests.apply_pausing", "irq", "60", str(marker), "apply",
                                  str(plan_file), "--state-dir", str(state)], cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not marker.exists():
                assert agent.poll() is None, agent.communicate()
                assert time.monotonic() < deadline, "the apply never reached its pause"
                time.sleep(0.05)
            # Paused after the second action, grouped with the third: the first two are applied.
            assert os.sched_getaffinity(c.pid) == {a}
            assert f.read_text().strip() == format_cpulist(target)
            agent.send_signal(signal.SIGKILL)
            agent.wait()
            results = engine(state, topo).recover()
            assert [r.plan_id for r in results] == ["killed"]
            assert results[0].state == P.STATE_ROLLED_BACK, results[0]
            assert {t: os.sched_getaffinity(t) for t in masks} == masks
            assert f.read_text().strip() == original
            assert engine(state, topo).recover() == []
        finally:
            agent.kill()
            agent.wait()
            with contextlib.suppress(OSError):
                f.write_text(original)
            for t, mask in masks.items():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(t, mask)


def test_cli_apply_dry_run_and_json(tmp_path: Path) -> None:
    with child() as c:
        a, _ = cpu_pair()
        plan_file = tmp_path / "p.json"
        from memtopo.protojson import to_json
        plan_file.write_text(to_json(plan("cli", threads("t", c.pid, [a], all=True))))
        before = {t: os.sched_getaffinity(t) for t in c.tids.values()}
        res = subprocess.run([sys.executable, "-m", "memtopo.cli", "apply", str(plan_file), "--dry-run",
                              "--state-dir", str(tmp_path / "s"), "--format", "json"], cwd=REPO, capture_output=True,
                             text=True, timeout=60, check=False)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["state"] == "STATE_DRY_RUN"
        assert out["actions"][0]["status"] in ("STATUS_WOULD_CHANGE", "STATUS_UNCHANGED")
        assert {t: os.sched_getaffinity(t) for t in c.tids.values()} == before
        assert not (tmp_path / "s").exists() or not any((tmp_path / "s").glob("*.json*"))
