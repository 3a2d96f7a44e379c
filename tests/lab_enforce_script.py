"""The CPU enforcement's lab scenarios, run *inside* one numa-vm guest (tests/agent/test_lab_enforce.py boots
it, once with cgroup v1 and once with v2): a real containerd in the guest, on a kernel with several
NUMA nodes (``dual-socket-cxl``: CPUs 0-1 on node 0, 2-3 on node 1, node 2 memory without CPUs).

It only *observes*: it runs the pods, one enforcement pass per scenario, and reports what each
container's cgroup and ``/proc/PID/status`` say (and, for the container whose memory is moved, its
pages per node from ``/proc/PID/numa_maps`` and the apply engine's result), as one JSON line after
:data:`MARK`; the test makes the assertions on the host. Progress goes to stderr.

    numa-vm run --profile dual-socket-cxl [--cgroup v1] -- .venv/bin/python tests/lab_enforce_script.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.containerd import Containerd, cgroup_cpuset, proc_allowed, unavailable_reason  # noqa: E402
from bench.enforce_standins import (  # noqa: E402
    NODE,
    StandinPods,
    StandinReporter,
    host_node,
    kubelet_facts,
    pod_object,
    resources,
    run_pod,
)
from memtopo.agent.enforce import CgroupCpusets, Enforcer, EngineMigrator  # noqa: E402
from memtopo.apply.engine import Engine  # noqa: E402
from memtopo.apply.host import Host, parse_numa_maps  # noqa: E402
from memtopo.apply.hostfacts import light_facts  # noqa: E402
from memtopo.hostfs import HostFS  # noqa: E402
from memtopo.k8s import cri  # noqa: E402
from memtopo.k8s import enforcement as ef  # noqa: E402
from memtopo.v1 import plan_pb2 as planpb  # noqa: E402
from memtopo.v1 import topology_pb2 as pb  # noqa: E402

MARK = "LAB-ENFORCE-REPORT:"
# What the container whose memory is moved runs: about 15 MB of shell variable, allocated at once
# on the memory nodes it starts with, then held.
TOUCH = ["/bin/sh", "-c", "a=$(busybox seq 1 2000000); while true; do sleep 1000; done"]
TOUCHED_PAGES = 2000  # 8 MB: the variable is there


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def placement(cpus: str, mems: str) -> dict[str, str]:
    return {ef.PLACEMENT_ANNOTATION: json.dumps({"node": NODE, "cpus": cpus, "memory": {"nodes": mems}})}


def container_pid(ctrd: Containerd, cid: str) -> int:
    with cri.CriClient(ctrd.endpoint, timeout=60.0) as c:  # a guest on a busy host answers slowly
        pid = c.container_status(cid).pid
    assert pid is not None
    return pid


def observe(ctrd: Containerd, cid: str) -> dict[str, Any]:
    pid = container_pid(ctrd, cid)
    cpus, mems = cgroup_cpuset(pid)
    allowed_cpus, allowed_mems = proc_allowed(pid)
    return {"cgroup_cpus": cpus, "cgroup_mems": mems, "cpus_allowed": allowed_cpus, "mems_allowed": allowed_mems}


def pages(pid: int) -> dict[str, int]:
    """Pages per NUMA node of the process, from ``/proc/PID/numa_maps``."""
    return {str(n): c for n, c in parse_numa_maps(Path(f"/proc/{pid}/numa_maps").read_text()).items()}


def wait_touched(pid: int, limit_s: float = 120.0) -> dict[str, int]:
    """The pages once the shell holds its variable: past :data:`TOUCHED_PAGES` and no longer growing."""
    deadline = time.monotonic() + limit_s
    last: dict[str, int] = {}
    while True:
        seen = pages(pid)
        if (sum(seen.values()) >= TOUCHED_PAGES and seen == last) or time.monotonic() > deadline:
            return seen
        last = seen
        time.sleep(1.0)


def no_topology() -> pb.MemoryTopology:
    raise RuntimeError("a page migration plan is validated from the host's files")


def main() -> int:
    report: dict[str, Any] = {"cgroup": "v2" if Path("/sys/fs/cgroup/cgroup.controllers").is_file() else "v1"}
    why = unavailable_reason()
    if why:
        report["unavailable"] = why
        print(MARK + json.dumps(report), flush=True)
        return 0
    # containerd's overlay snapshots need an upper directory that is not itself on overlayfs (the
    # guest's root is an overlay over the host's): a tmpfs of its own.
    work = Path(tempfile.mkdtemp(prefix="mt-ctrd-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(work)], check=True)
    node = host_node()
    report["node"] = {"cpus": sorted(node.allocatable), "memory_nodes": sorted(node.memory_nodes),
                      "reserved": sorted(node.reserved),
                      "numa": {n: sorted(node.topo.cpus_in("numa", n)) for n in node.topo.ids("numa")}}
    say(f"node: {report['node']}")
    ctrd = Containerd.start(work, ready_s=180)
    say("containerd ready")
    try:
        k = ctrd.kubelet()
        pods, reporter = StandinPods(), StandinReporter()
        # The agent's wiring: pinned containers' pages are moved through an apply engine.
        engine = Engine(Host.live(), no_topology, work / "apply-state",
                        facts_provider=lambda plan: light_facts(plan, HostFS.at("/")))
        cgroups = CgroupCpusets(HostFS.at("/"))
        enforcer = Enforcer(node=lambda: node, kubelet=lambda: kubelet_facts(), pods=pods, reporter=reporter,
                            connect=lambda: cri.CriClient(ctrd.endpoint, timeout=60.0),
                            cpusets=cgroups.read, interval=1.0, migrate=EngineMigrator(engine), procs=cgroups.procs)

        async def settle() -> str:
            """One pass, the memory moves it started, and the pass that reports them; should that pass
            start moves of its own (a container it saw late), those too and a pass after them, so that
            what is read next is every move's plan and report."""
            state = (await enforcer.reconcile()).state
            for _ in range(4):
                await enforcer.moves_done()
                if not (await enforcer.reconcile()).moves:
                    break
            return state

        scenarios: dict[str, Any] = {}
        # A placement on node 1 with memory on node 1.
        a, a_obj = run_pod(k, "numa1", {"app": resources("2")}, placement("2-3", "1"), created="2026-01-01T00:00:01Z")
        # A placement on node 0 whose memory is node 0 and the CPU-less far-memory node 2.
        b, b_obj = run_pod(k, "far", {"app": resources("1")}, placement("1", "0,2"), created="2026-01-01T00:00:02Z")
        shared, s_obj = run_pod(k, "shared", {"web": resources(None, None)}, created="2026-01-01T00:00:03Z")
        for obj in (a_obj, b_obj, s_obj):
            pods.put(obj)
        placed_state = asyncio.run(settle())
        say(f"pass: {placed_state} {enforcer.last.message}")
        scenarios["placed"] = {
            "state": placed_state,
            "numa1": {"status": reporter.status(a.uid), **observe(ctrd, a.containers["app"])},
            "far": {"status": reporter.status(b.uid), **observe(ctrd, b.containers["app"])},
            "shared": observe(ctrd, shared.containers["web"]),
        }
        # Released: the node-1 pod goes, its CPUs return to the shared pool.
        pods.delete(a.uid)
        k.remove_pod(a.uid)
        asyncio.run(enforcer.reconcile())
        scenarios["released"] = {"shared": observe(ctrd, shared.containers["web"])}
        # A pod that did not pass through the extender: the kubelet's rule, memory on its CPUs' node.
        c, c_obj = run_pod(k, "chosen", {"app": resources("1")}, created="2026-01-01T00:00:04Z")
        pods.put(c_obj)
        asyncio.run(enforcer.reconcile())
        scenarios["chosen"] = {"status": reporter.status(c.uid), **observe(ctrd, c.containers["app"]),
                               "shared": observe(ctrd, shared.containers["web"])}
        # Memory touched on node 0 (the container starts there), then pinned to node 1: its pages move.
        spec: dict[str, str | int] = {"cpuset_cpus": "0-1", "cpuset_mems": "0"}
        m = k.run_pod("moved", {"app": spec}, commands={"app": TOUCH})
        m_obj = pod_object(m, {"app": resources("1")}, placement("3", "1"), created="2026-01-01T00:00:05Z")
        pid = container_pid(ctrd, m.containers["app"])
        before = wait_touched(pid)
        say(f"touched: {before}")
        pods.put(m_obj)
        asyncio.run(settle())
        plans = [r for r in engine.list_plans() if r.plan_id.startswith(f"enforce-memory-{m.containers['app'][:12]}")]
        scenarios["moved"] = {
            "status": reporter.status(m.uid), **observe(ctrd, m.containers["app"]), "pages_before": before,
            "pages_after": pages(pid), "procs": list(cgroups.procs(pid) or ()),
            "plans": [{"state": planpb.PlanResult.State.Name(r.state), "message": r.message,
                       "journal": engine.store.journal_path(r.plan_id).is_file(),
                       "actions": [{"status": planpb.ActionResult.Status.Name(a.status), "reason": a.reason,
                                    **dict(a.details)} for a in r.actions]} for r in plans],
        }
        report["scenarios"] = scenarios
    except Exception:
        report["error"] = traceback.format_exc()[-3000:]
    finally:
        ctrd.stop()
        subprocess.run(["umount", "-l", str(work)], check=False)
    print(MARK + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
