"""The CPU enforcement on a real containerd inside the numa-vm lab (``dual-socket-cxl``: CPUs 0-1 on
node 0, 2-3 on node 1, node 2 memory without CPUs), with cgroup v1 and with cgroup v2: memory nodes
(``Mems_allowed_list``) really change on several NUMA nodes, and a container's pages already on node 0
really move to node 1 when it is pinned there, which this one-node host cannot show.
The guest runs tests/lab_enforce_script.py; the assertions are made here. Two guests boot in parallel.
Runs when MEMTOPO_LAB=1 (tools/test.sh sets it after ``numa-vm setup`` succeeded)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.fixtures import REPO, SHARED
from tests.lab import lab_marks

NUMA_VM = SHARED / "lab" / "numa-vm"
MARK = "LAB-ENFORCE-REPORT:"
PROFILE = "dual-socket-cxl"

# The lab's marks, its xdist group included: the module's guests boot once, on one worker (without the
# group, xdist spread the parametrized tests over two workers and each booted both guests again).
pytestmark = lab_marks


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    procs = {
        version: subprocess.Popen(
            [str(NUMA_VM), "run", "--profile", PROFILE, "--cgroup", version, "--timeout", "900", "--",
             str(REPO / ".venv/bin/python"), "tests/lab_enforce_script.py"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        for version in ("v1", "v2")
    }
    out: dict[str, dict[str, Any]] = {}
    for version, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1200)
        line = next((ln for ln in stdout.splitlines() if ln.startswith(MARK)), None)
        assert proc.returncode == 0 and line is not None, f"{version}: exit {proc.returncode}\n{stderr[-3000:]}"
        out[version] = json.loads(line[len(MARK):])
        print(f"{version}: {line}")  # the whole report, for a failure's captured output
    return out


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_pods_are_pinned_with_their_memory_nodes(reports: dict[str, dict[str, Any]], version: str) -> None:
    r = reports[version]
    assert r["cgroup"] == version and "unavailable" not in r and "error" not in r, r
    assert r["node"]["numa"] == {"0": [0, 1], "1": [2, 3]} and r["node"]["memory_nodes"] == [0, 1, 2]
    assert r["node"]["reserved"] == [0]  # no reservedSystemCPUs: the first CPU stays shared
    placed = r["scenarios"]["placed"]
    assert placed["state"] == "active"
    numa1, far = placed["numa1"], placed["far"]
    assert numa1["status"]["state"] == "applied" and numa1["status"]["source"] == "placement"
    assert (numa1["cgroup_cpus"], numa1["cgroup_mems"]) == ("2-3", "1")
    assert (numa1["cpus_allowed"], numa1["mems_allowed"]) == ("2-3", "1")
    # Memory on the node of the CPUs and on the CPU-less far-memory node.
    assert (far["cgroup_cpus"], far["cgroup_mems"], far["mems_allowed"]) == ("1", "0,2", "0,2")
    assert placed["shared"]["cgroup_cpus"] == "0" and placed["shared"]["cpus_allowed"] == "0"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_release_and_a_pod_without_placement(reports: dict[str, dict[str, Any]], version: str) -> None:
    r = reports[version]
    assert r["scenarios"]["released"]["shared"]["cgroup_cpus"] == "0,2-3"
    chosen = r["scenarios"]["chosen"]
    # Node 1 is the emptiest node with free CPUs (node 0's are reserved or held): its first core,
    # memory on node 1; the shared pool keeps the rest.
    assert chosen["status"]["state"] == "applied" and chosen["status"]["source"] == "chosen"
    assert (chosen["cgroup_cpus"], chosen["mems_allowed"]) == ("2", "1")
    assert chosen["shared"]["cgroup_cpus"] == "0,3"


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_pinned_containers_pages_move_to_its_memory_node(reports: dict[str, dict[str, Any]], version: str) -> None:
    moved = reports[version]["scenarios"]["moved"]
    assert (moved["cgroup_cpus"], moved["cgroup_mems"], moved["mems_allowed"]) == ("3", "1", "1")
    before, after = moved["pages_before"], moved["pages_after"]
    # It touched its memory on node 0 (the busybox file pages it maps may lie anywhere: other
    # containers read them first); pinned to node 1, its pages are there. A few shared ones may stay:
    # migrate_pages moves the pages a process maps alone.
    assert before.get("0", 0) >= 2000, moved
    assert after.get("1", 0) >= before["0"] * 9 // 10 and after.get("0", 0) < before["0"] // 10, moved
    assert len(moved["plans"]) == 1, moved  # the report says why when there is none
    [plan] = moved["plans"]
    assert plan["state"] in ("STATE_APPLIED", "STATE_UNCHANGED") and len(plan["actions"]) == len(moved["procs"]) >= 1
    if version == "v1":
        # cpuset.mems left the pages behind (memory_migrate is off): the engine moved them, journaled.
        assert moved["status"]["memory"] == "moved" and plan["journal"], moved
        assert max(int(a.get("pages_to_move", 0)) for a in plan["actions"]) >= 2000
    else:
        # cgroup v2's cpuset migrates on a cpuset.mems write itself (kernels since 5.x): nothing may be left.
        assert moved["status"]["memory"] in ("moved", "in place"), moved
