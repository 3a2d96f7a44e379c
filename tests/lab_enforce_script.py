"""The CPU enforcement's lab scenarios, run *inside* one numa-vm guest (tests/agent/test_lab_enforce.py boots
it, once with cgroup v1 and once with v2): a real containerd in the guest, on a kernel with several
NUMA nodes (``dual-socket-cxl``: CPUs 0-1 on node 0, 2-3 on node 1, node 2 memory without CPUs).

It only *observes*: it runs the pods, one enforcement pass per scenario, and reports what each
container's cgroup and ``/proc/PID/status`` say, as one JSON line after :data:`MARK`; the test makes
the assertions on the host. Progress goes to stderr.

    numa-vm run --profile dual-socket-cxl [--cgroup v1] -- .venv/bin/python tests/lab_enforce_script.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
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
    resources,
    run_pod,
)
from memtopo.agent.enforce import CgroupCpusets, Enforcer  # noqa: E402
from memtopo.hostfs import HostFS  # noqa: E402
from memtopo.k8s import cri  # noqa: E402
from memtopo.k8s import enforcement as ef  # noqa: E402

MARK = "LAB-ENFORCE-REPORT:"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def placement(cpus: str, mems: str) -> dict[str, str]:
    return {ef.PLACEMENT_ANNOTATION: json.dumps({"node": NODE, "cpus": cpus, "memory": {"nodes": mems}})}


def observe(ctrd: Containerd, cid: str) -> dict[str, Any]:
    with cri.CriClient(ctrd.endpoint) as c:
        pid = c.container_status(cid).pid
    assert pid is not None
    cpus, mems = cgroup_cpuset(pid)
    allowed_cpus, allowed_mems = proc_allowed(pid)
    return {"cgroup_cpus": cpus, "cgroup_mems": mems, "cpus_allowed": allowed_cpus, "mems_allowed": allowed_mems}


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
        enforcer = Enforcer(node=lambda: node, kubelet=lambda: kubelet_facts(), pods=pods, reporter=reporter,
                            connect=lambda: cri.CriClient(ctrd.endpoint, timeout=60.0),
                            cpusets=CgroupCpusets(HostFS.at("/")).read, interval=1.0)
        scenarios: dict[str, Any] = {}
        # A placement on node 1 with memory on node 1.
        a, a_obj = run_pod(k, "numa1", {"app": resources("2")}, placement("2-3", "1"), created="2026-01-01T00:00:01Z")
        # A placement on node 0 whose memory is node 0 and the CPU-less far-memory node 2.
        b, b_obj = run_pod(k, "far", {"app": resources("1")}, placement("1", "0,2"), created="2026-01-01T00:00:02Z")
        shared, s_obj = run_pod(k, "shared", {"web": resources(None, None)}, created="2026-01-01T00:00:03Z")
        for obj in (a_obj, b_obj, s_obj):
            pods.put(obj)
        result = asyncio.run(enforcer.reconcile())
        say(f"pass: {result.state} {result.message}")
        scenarios["placed"] = {
            "state": result.state,
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
