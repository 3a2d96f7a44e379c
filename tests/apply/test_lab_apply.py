"""The apply engine on a real multi-NUMA kernel: the numa-vm lab (6.1, nodes 0 and 1 with CPUs 0-1
and 2-3, node 2 CPU-less, virtio and NVMe devices with MSI-X vectors).

One guest boot (about 4 minutes under TCG) runs tests/apply/lab_apply_script.py, which performs every
scenario and reports what it saw as JSON: numa_maps texts, cgroup files, /proc/PID/status,
/proc/irq files and interrupt counts, plan results. The assertions are all here. The guest starts
on cgroup v2 (the lab default) and the script later rebinds the cpuset controller to a v1 hierarchy
it mounts itself, so both versions are covered by the same boot.

Runs when MEMTOPO_LAB=1 (tools/test.sh sets it after `numa-vm setup` succeeded), like tests/discovery/test_lab.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest

from memtopo.v1 import plan_pb2 as planpb
from tests.apply.lab_apply_script import CHILD_MIB, MARK
from tests.fixtures import REPO
from tests.lab import NUMA_VM, lab_marks

Json = dict[str, Any]
# The guest's machine (README of the lab, profile dual-socket-cxl).
NODE0_CPUS = "0-1"
NODE1_CPUS = "2-3"
ALL_MEMS = "0-2"
CHILD_PAGES = CHILD_MIB << 8  # 4 KiB pages

# The same gate and marker as the other lab tests: MEMTOPO_LAB=1.
pytestmark = lab_marks


@pytest.fixture(scope="module")
def report() -> Json:
    proc = subprocess.run([str(NUMA_VM), "run", "--profile", "dual-socket-cxl", "--timeout", "1500", "--",
                           str(REPO / ".venv/bin/python"), "tests/apply/lab_apply_script.py"],
                          capture_output=True, text=True, cwd=REPO, timeout=1800, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    line = next((x for x in proc.stdout.splitlines() if x.startswith(MARK)), None)
    assert line is not None, f"no report on stdout\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    data: Json = json.loads(line[len(MARK):])
    return data


def scenario(report: Json, name: str) -> Json:
    data: Json = report[name]
    assert "error" not in data, f"{name} raised in the guest:\n{data['error']}"
    return data


# ---- oracles: read the raw /proc texts independently of the engine's parsers ------------------------
def node_pages(numa_maps: str) -> dict[int, int]:
    """Pages per node over every mapping: the N<node>=<pages> tokens of numa_maps (numa(7))."""
    out: dict[int, int] = {}
    for line in numa_maps.splitlines():
        for tok in line.split():
            m = re.fullmatch(r"N(\d+)=(\d+)", tok)
            if m:
                out[int(m[1])] = out.get(int(m[1]), 0) + int(m[2])
    return out


def mapping_at(numa_maps: str, addr: int) -> str:
    """The numa_maps line of the mapping holding ``addr`` (lines start with the VMA's start address)."""
    starts = [(int(line.split()[0], 16), line) for line in numa_maps.splitlines() if line.strip()]
    return max((s for s in starts if s[0] <= addr), key=lambda s: s[0])[1]


def reported_pages(text: str) -> dict[int, int]:
    """The engine's "N0=17812 N1=1777" detail."""
    return {int(n): int(c) for n, c in re.findall(r"N(\d+)=(\d+)", text)}


def statuses(result: Json) -> list[str]:
    return [a["status"] for a in result["actions"]]


def smp(files: Json) -> dict[str, str]:
    return {irq: f["smp_affinity_list"] for irq, f in files.items()}


# ---- memtopo apply: page migration -----------------------------------------------------------------
def test_apply_migrates_a_process_from_node0_to_node1_and_reports_numa_maps(report: Json) -> None:
    s = scenario(report, "cli_migration")
    before, after = node_pages(s["numa_maps_before"]), node_pages(s["numa_maps_after"])
    assert before.get(0, 0) >= CHILD_PAGES, before  # the child touched 64 MiB on node 0
    assert s["apply"]["rc"] == 0, s["apply"]["stderr"]
    res = s["apply"]["json"]
    assert res["state"] == "STATE_APPLIED", res
    (action,) = res["actions"]
    assert action["status"] == "STATUS_APPLIED"
    d = action["details"]
    # The counts in the result are what /proc said, before and after (the child is idle meanwhile).
    assert reported_pages(d["pages_before"]) == before
    assert reported_pages(d["pages_after"]) == after
    assert int(d["pages_to_move"]) == before[0]
    assert d["pages_left_on_source"] == str(after.get(0, 0)) == "0"
    assert d["not_moved_reported"] == "0"
    assert after.get(1, 0) == before.get(1, 0) + before[0]
    rb = s["rollback"]
    assert rb["rc"] == 0, rb["stderr"]
    assert rb["json"]["state"] == "STATE_ROLLED_BACK"
    reason = rb["json"]["actions"][0]["reason"]
    # Whether the child had pages on node 1 before depends on where the scheduler ran its
    # interpreter before it pinned itself to node 0: each case has its own exact outcome.
    if before.get(1, 0):
        # Moving "back" would move those too: the rollback leaves the pages and says so.
        assert "pages left where they are" in reason
        assert node_pages(s["numa_maps_after_rollback"]) == after
    else:
        # Nothing lived on node 1: the rollback moves every page back to node 0.
        assert reason == "restored"
        assert node_pages(s["numa_maps_after_rollback"]) == before


@pytest.mark.parametrize("name", ["mempolicy_v1_cli", "mempolicy_v2"])
def test_memory_policy_bind_with_migrate_existing_moves_a_running_process(report: Json, name: str) -> None:
    s = scenario(report, name)
    res = s["apply"]["json"] if "apply" in s else s["result"]
    if "apply" in s:
        assert s["apply"]["rc"] == 0, s["apply"]["stderr"]
    else:
        assert s["place"]["state"] == "STATE_APPLIED", s["place"]
        assert s["placed"]["status"]["Mems_allowed_list"] == "0-1"
    assert res["state"] == "STATE_APPLIED", res
    d = res["actions"][0]["details"]
    assert d["mode"] == "MODE_BIND"
    assert "cpuset mems" in d["method"] and "migrate_pages" in d["method"]
    before, during = node_pages(s["before"]["numa_maps"]), node_pages(s["during"]["numa_maps"])
    assert before.get(0, 0) >= CHILD_PAGES
    assert during.get(0, 0) == 0 and during.get(1, 0) >= CHILD_PAGES, during
    assert reported_pages(d["pages_after"]) == during
    assert s["during"]["status"]["Mems_allowed_list"] == "1"
    if name == "mempolicy_v1_cli":
        # In the root cpuset: v1 gives it a cpuset of its own under the prefix, removed on rollback.
        assert f"cpuset:/memtopo/pid-{s['pid']}" in s["during"]["cgroup"]
        assert s["files"]["cpuset.mems"] == "1"
        assert s["rollback"]["rc"] == 0 and s["rollback"]["json"]["state"] == "STATE_ROLLED_BACK"
        assert not s["managed_exists_after"]
    else:
        assert s["cpuset_mems"] == "1"
        assert s["rollback"]["state"] == "STATE_ROLLED_BACK"
        assert s["cpuset_mems_after_rollback"] == "0-1"  # what the first plan had set
        assert s["rollback_place"]["state"] == "STATE_ROLLED_BACK"
        assert not s["dir_exists_after"]
    assert s["after"]["status"] == s["before"]["status"]
    assert s["after"]["cgroup"] == s["before"]["cgroup"]


# ---- memtopo exec ------------------------------------------------------------------------------------
def _exec(report: Json, name: str) -> tuple[Json, str]:
    run = scenario(report, "exec")[name]
    assert run["rc"] == 0, run["stderr"]
    out: Json = json.loads(run["stdout"])
    return out, mapping_at(out["numa_maps"], out["addr"])


def test_exec_membind_places_the_child_on_node1(report: Json) -> None:
    out, line = _exec(report, "membind")
    assert " bind:1 " in line, line
    # The mapping may have merged with a neighbour of the same policy: at least the child's pages.
    pages = node_pages(line)
    assert set(pages) == {1} and pages[1] >= CHILD_PAGES, line
    assert out["affinity"] == [2, 3]  # --cpus 2-3 held across exec


def test_exec_interleave_spreads_over_both_nodes(report: Json) -> None:
    _, line = _exec(report, "interleave")
    assert " interleave:0-1 " in line, line
    pages = node_pages(line)
    total = sum(pages.values())
    assert set(pages) == {0, 1} and total >= CHILD_PAGES, line
    # Round-robin per page: each node holds about half (the kernel's interleave index drifts a little).
    assert all(pages[n] >= 0.4 * total for n in (0, 1)), pages


# ---- cpuset ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [2, 1])
def test_cpuset_with_mems_1_applied_verified_and_rolled_back(report: Json, version: int) -> None:
    if version == 1:
        scenario(report, "switch_to_v1")
    s = scenario(report, f"cpuset_v{version}")
    res = s["result"]
    assert res["state"] == "STATE_APPLIED", res
    assert res["actions"][0]["details"]["hierarchy"].startswith(f"cgroup v{version} cpuset")
    f = s["files"]
    assert (f["cpuset.cpus"], f["cpuset.mems"]) == (NODE1_CPUS, "1")
    eff = ("cpuset.cpus.effective", "cpuset.mems.effective") if version == 2 else ("cpuset.effective_cpus",
                                                                                  "cpuset.effective_mems")
    assert (f[eff[0]], f[eff[1]]) == (NODE1_CPUS, "1")
    assert f["cgroup.procs"] == [str(s["pid"])]
    during = s["during"]
    assert during["status"] == {"Cpus_allowed_list": NODE1_CPUS, "Mems_allowed_list": "1"}
    assert ("0::/memtopo/lab-v2" if version == 2 else "cpuset:/memtopo/lab-v1") in during["cgroup"]
    assert all(mask == [2, 3] for mask in during["masks"].values())
    before_pages, during_pages = node_pages(s["before"]["numa_maps"]), node_pages(during["numa_maps"])
    assert before_pages.get(0, 0) >= CHILD_PAGES
    if version == 2:
        # v2 migrates a task's pages when it joins a cgroup with other mems (admin-guide/cgroup-v2.rst, cpuset.mems).
        assert during_pages.get(0, 0) == 0, during_pages
    else:
        # v1 only with memory_migrate=1 (default 0): the pages stay, and the result says so.
        assert during_pages == before_pages
        assert "memory_migrate" in res["actions"][0]["details"]
    assert s["rollback"]["state"] == "STATE_ROLLED_BACK", s["rollback"]
    assert s["after"]["status"] == s["before"]["status"] == {"Cpus_allowed_list": "0-3", "Mems_allowed_list": ALL_MEMS}
    assert s["after"]["cgroup"] == s["before"]["cgroup"]
    assert s["after"]["masks"] == s["before"]["masks"]
    assert not s["dir_exists_after"] and not s["prefix_exists_after"]
    assert s["root_subtree_control_after"] == s["root_subtree_control_before"]


# ---- IRQs ------------------------------------------------------------------------------------------
def test_irq_affinity_moves_and_interrupts_arrive_on_the_new_cpu(report: Json) -> None:
    s = scenario(report, "irq")
    target = str(s["target"])
    res = s["result"]
    assert res["state"] == "STATE_APPLIED", res
    assert res["actions"][0]["details"]["irqs"] == ",".join(map(str, s["vectors"]))
    assert set(smp(s["after"]).values()) == {target}
    # The io share's vector fired while the guest wrote to it: every interrupt since on the new CPU.
    grown = {irq: s["counts_after"][irq][target] - s["counts_before"][irq][target] for irq in s["after"]}
    busy = max(grown, key=lambda irq: grown[irq])
    assert grown[busy] >= 100, (grown, s["counts_before"], s["counts_after"])
    assert s["after"][busy]["effective_affinity_list"] == target
    counts_before, counts_after = s["counts_before"][busy], s["counts_after"][busy]
    others = {c: counts_after[c] - counts_before[c] for c in counts_after if c != target}
    assert sum(others.values()) <= 2, others  # at most the interrupt that was in flight
    assert s["rollback"]["state"] == "STATE_ROLLED_BACK"
    assert smp(s["restored"]) == smp(s["before"])


def test_managed_nvme_vector_is_refused_with_its_reason(report: Json) -> None:
    s = scenario(report, "irq_managed")
    assert re.fullmatch(r"nvme\d+q[1-9]\d*", s["name"])
    (action,) = s["result"]["actions"]
    assert action["status"] == "STATUS_SKIPPED"
    assert f"IRQ {s['irq']} managed by the kernel (EIO)" in action["reason"]
    assert s["result"]["state"] == "STATE_UNCHANGED"
    assert s["after"]["smp_affinity_list"] == s["before"]["smp_affinity_list"]


def test_nvme_controller_by_pci_address_moves_its_admin_vector_only(report: Json) -> None:
    s = scenario(report, "irq_managed")
    admin, target = str(s["admin"]), str(s["target"])
    res = s["device_result"]
    assert res["state"] == "STATE_APPLIED", res
    d = res["actions"][0]["details"]
    assert d["selector"] == f"PCI {s['bdf']} msi_irqs"
    queues = [str(v) for v in s["msi_irqs"] if str(v) != admin]
    before, after = smp(s["device_before"]), smp(s["device_after"])
    assert after[admin] == target
    assert all(after[q] == before[q] for q in queues)  # managed: the kernel kept them
    moved_queues = {q for q in queues if before[q] != target}
    assert moved_queues, before
    assert {m.split(" ")[0] for m in d["unmovable"].split(", ")} == moved_queues
    assert all("(EIO)" in m for m in d["unmovable"].split(", "))
    assert s["device_rollback"]["state"] == "STATE_ROLLED_BACK"
    assert smp(s["device_restored"]) == before


# ---- a required action failing mid-plan ----------------------------------------------------------
@pytest.mark.parametrize("version", [2, 1])
def test_required_action_failing_mid_plan_restores_everything(report: Json, version: int) -> None:
    s = scenario(report, f"failure_v{version}")
    mid = s["mid"]
    # The first three really changed the guest before the fourth failed.
    assert mid["irq"]["smp_affinity_list"] == str(s["irq_target"]) != s["irq_before"]["smp_affinity_list"]
    assert mid["dir_exists"]
    assert mid["status"] == {"Cpus_allowed_list": NODE1_CPUS, "Mems_allowed_list": "1"}
    assert mid["cgroup"] != s["before"]["cgroup"]
    assert mid["masks"] != s["before"]["masks"]
    res = s["result"]
    assert res["state"] == "STATE_ROLLED_BACK", res
    assert statuses(res) == ["STATUS_ROLLED_BACK"] * 3 + ["STATUS_FAILED"]
    assert "has exited" in res["actions"][3]["reason"]
    assert all("restored because victim failed" in a["reason"] for a in res["actions"][:3])
    # And the guest's own files say so.
    assert s["irq_after"]["smp_affinity_list"] == s["irq_before"]["smp_affinity_list"]
    assert s["after"]["masks"] == s["before"]["masks"]
    assert s["after"]["status"] == s["before"]["status"]
    assert s["after"]["cgroup"] == s["before"]["cgroup"]
    assert not s["dir_exists_after"] and not s["prefix_exists_after"]


def test_every_scenario_ran(report: Json) -> None:
    from tests.apply.lab_apply_script import SCENARIOS

    assert [name for name, _ in SCENARIOS] == [k for k in report if k in dict(SCENARIOS)]
    failed = {k: v["error"].splitlines()[-1] for k, v in report.items() if "error" in v}
    assert not failed, failed
    env = report["environment"]
    assert (env["node0_cpus"], env["node1_cpus"]) == ([0, 1], [2, 3])
    # The status names the guest reports are the schema's.
    names = {a["status"] for v in report.values() if isinstance(v, dict) and isinstance(v.get("result"), dict)
             for a in v["result"].get("actions", [])}
    assert names <= set(planpb.ActionResult.Status.keys())
