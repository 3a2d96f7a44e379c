"""``memtopo plan``: every policy through the command line, the error contract and exit codes.

Expected values come from the upstream projects' unit tests (vllm-ascend CPU binding, the Volcano
Ascend plugin, HAMi's kunlun device, KubeVirt's pci-placement) and the reference designs' own
examples, not from this code's output. Topologies: the synthesized A3 and GH200 hosts (``tests/fixtures``),
discovered once per module, and hand-built messages where a vector names a fake sysfs.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtopo.cli.main
from memtopo.apply.planio import load_plan
from memtopo.cli import plan_run
from memtopo.cpulist import parse_cpulist
from memtopo.discovery.capture import open_root
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests.cli.main_call import memtopo_main
from tests.fixtures import extracted
from tests.strategies import json_like

FIXTURES = Path(__file__).parents[1] / "fixtures"
A3_TARBALL = FIXTURES / "ascend-a3-16npu" / "root.tar.gz"
GH200_TARBALL = FIXTURES / "gh200" / "root.tar.gz"

ERROR_EXIT = {"unsatisfiable": 1, "invalid_request": 2, "invalid_topology": 2, "invalid_root": 2, "usage": 2}


# ---- helpers -----------------------------------------------------------------------------------------
def run(argv: Sequence[str], stdin: str | bytes | None = None) -> tuple[int, dict[str, Any]]:
    """``memtopo`` with ``argv`` through the plan command's own entry; (exit status, stdout as JSON)."""
    return _call(lambda: memtopo.cli.main.main(list(argv)), stdin)


def _call(entry: Any, stdin: str | bytes | None) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        if stdin is not None:
            stream: Any = (io.TextIOWrapper(io.BytesIO(stdin)) if isinstance(stdin, bytes) else io.StringIO(stdin))
            mp.setattr("sys.stdin", stream)
        mp.setattr("sys.stdout", out)
        try:
            rc = entry()
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code
    text = out.getvalue()
    assert "Traceback" not in text
    return rc, json.loads(text)


def plan(policy: str, request: Any, *extra: str) -> tuple[int, dict[str, Any]]:
    return run(["plan", policy, "--request", "-", *extra], json.dumps(request))


def error_of(doc: Mapping[str, Any]) -> tuple[str, str]:
    assert set(doc) == {"error"}, doc
    return doc["error"]["code"], doc["error"]["message"]


def topology_json(topo: pb.MemoryTopology) -> dict[str, Any]:
    return json_format.MessageToDict(topo, preserving_proto_field_name=True)


@pytest.fixture(scope="module")
def a3_root() -> Path:
    return extracted(A3_TARBALL)  # extracted once per machine: 8,700 files is slow on a busy host


@pytest.fixture(scope="module")
def a3_topology(a3_root: Path) -> pb.MemoryTopology:
    return discover(ProbeContext.at_root(a3_root))


@pytest.fixture(scope="module")
def gh200_topology() -> pb.MemoryTopology:
    with open_root(GH200_TARBALL) as root:
        return discover(ProbeContext.at_root(root))


@pytest.fixture
def no_discovery(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the command tries to discover a host: the request is complete."""
    def refuse(root: str | None, with_irqs: bool = False, pid: int | None = None) -> plan_run.Facts:
        raise AssertionError(f"discovery of {root or 'this host'} was not expected")
    monkeypatch.setattr(plan_run, "discover_facts", refuse)


def fake_discovery(monkeypatch: pytest.MonkeyPatch, topo: pb.MemoryTopology,
                   npu_irqs: Mapping[int, Any] | None = None) -> list[str | None]:
    """Discovery answers ``topo``; returns the list of roots it was asked for."""
    asked: list[str | None] = []

    def fake(root: str | None, with_irqs: bool = False, pid: int | None = None) -> plan_run.Facts:
        asked.append(root)
        return plan_run.Facts(topo, root or plan_run.LIVE, dict(npu_irqs or {}) if with_irqs else {})
    monkeypatch.setattr(plan_run, "discover_facts", fake)
    return asked


# ---- cpu-binding (vllm-ascend's vectors and design examples) -----------------------------------------
A2_AFFINITY = {"0": "144-167", "1": "0-23", "2": "144-167", "3": "0-23",
               "4": "96-119", "5": "48-71", "6": "96-119", "7": "48-71"}
A2_NUMA = {str(n): f"{24 * n}-{24 * n + 23}" for n in range(8)}


@pytest.mark.usefixtures("no_discovery")
def test_cpu_binding_rfc_example_2() -> None:
    # C.4, RFC #6966 example 2 (A3): allowed 0-23, total 4, running 0-3 → 0:[0-5] … 3:[18-23];
    # NPU1 IRQ 6,7, main [8,9], acl 10, rel 11.
    rc, doc = plan("cpu-binding", {"device_type": "A3", "allowed_cpus": "0-23", "total_logic_npus": 4,
                                   "running_npus": [0, 1, 2, 3]})
    assert rc == 0
    assert doc["policy"] == "cpu-binding" and doc["mode"] == "global_slice"
    assert [doc["npus"][k]["cpus"] for k in "0123"] == ["0-5", "6-11", "12-17", "18-23"]
    assert doc["npus"]["1"] == {"cpus": "6-11", "irq": "6-7", "main": "8-9", "acl": 10, "release": 11}
    assert "facts" not in doc


@pytest.mark.usefixtures("no_discovery")
def test_cpu_binding_a2_without_affinity_falls_back_to_global_slice() -> None:
    # U12: A2, running [0,1,2], allowed 0-16, total_logic 3 → 0:[0-5], 1:[6-11], 2:[12-16].
    rc, doc = plan("cpu-binding", {"device_type": "A2", "allowed_cpus": "0-16", "total_logic_npus": 3,
                                   "running_npus": [0, 1, 2]})
    assert rc == 0 and doc["mode"] == "global_slice"
    assert {k: v["cpus"] for k, v in doc["npus"].items()} == {"0": "0-5", "1": "6-11", "2": "12-16"}


@pytest.mark.usefixtures("no_discovery")
def test_cpu_binding_hidden_same_affinity_workers_do_not_overlap() -> None:
    # C.4 / U26: NPU0 and NPU2 share affinity 144-167, both processes have 144-191; A sees NPU0, B NPU2
    # → A 144-167, B 168-191.
    base = {"device_type": "A2", "allowed_cpus": "144-191", "total_logic_npus": 8,
            "topo_affinity": A2_AFFINITY, "numa_cpus": A2_NUMA}
    rc_a, a = plan("cpu-binding", {**base, "running_npus": [0]})
    rc_b, b = plan("cpu-binding", {**base, "running_npus": [2]})
    assert (rc_a, rc_b) == (0, 0) and a["mode"] == b["mode"] == "topo_affinity"
    assert a["npus"]["0"]["cpus"] == "144-167"
    assert b["npus"]["2"] == {"cpus": "168-191", "irq": "168-169", "main": "170-189", "acl": 190, "release": 191}


@pytest.mark.usefixtures("no_discovery")
def test_cpu_binding_too_few_cpus_is_unsatisfiable_exit_1() -> None:
    # U15: running [0,1], allowed 0-7, total_logic 2 → refused (base 4 < 5).
    rc, doc = plan("cpu-binding", {"device_type": "A2", "allowed_cpus": "0-7", "total_logic_npus": 2,
                                   "running_npus": [0, 1]})
    code, message = error_of(doc)
    assert (rc, code) == (1, "unsatisfiable")
    assert "min_per_npu=4" in message and "Need at least 10 CPUs" in message


@pytest.mark.usefixtures("no_discovery")
def test_cpu_binding_npu_outside_the_logical_range_is_invalid_exit_2() -> None:
    # U17: running [2], allowed 0-11, total 2 → invalid NPU id.
    rc, doc = plan("cpu-binding", {"device_type": "A2", "allowed_cpus": "0-11", "total_logic_npus": 2,
                                   "running_npus": [2]})
    code, message = error_of(doc)
    assert (rc, code) == (2, "invalid_request") and "NPU 2" in message


@pytest.mark.usefixtures("no_discovery")
@pytest.mark.parametrize(("request_", "field"), [
    ({"device_type": "A3", "allowed_cpus": "0-23", "running_npus": [0], "allowed_cpu": "0-3"}, "allowed_cpu"),
    ({"device_type": "A3", "allowed_cpus": 23, "running_npus": [0]}, "allowed_cpus"),
    ({"device_type": "A3", "allowed_cpus": "0-23", "running_npus": "0"}, "running_npus"),
    ({"device_type": "A3", "allowed_cpus": "0-23", "running_npus": [0], "numa_cpus": {"x": "0-3"}}, "numa_cpus"),
    ({"device_type": ["A3"], "allowed_cpus": "0-23", "running_npus": [0]}, "device_type"),
])
def test_cpu_binding_bad_requests_name_the_key(request_: dict[str, Any], field: str) -> None:
    rc, doc = plan("cpu-binding", request_)
    code, message = error_of(doc)
    assert (rc, code) == (2, "invalid_request") and field in message


def test_cpu_binding_a3_root_fills_every_fact(a3_root: Path, a3_topology: pb.MemoryTopology) -> None:
    # Real discovery of the synthesized A3 host: 640 CPUs, 8 nodes, 16 running NPUs, no affinity column
    # → the design doc's A3 table: NPU i → 40i…40i+39.
    rc, doc = run(["plan", "cpu-binding", "--request", "-", "--root", str(a3_root)], "{}")
    assert rc == 0 and doc["mode"] == "global_slice" and len(doc["npus"]) == 16
    assert doc["npus"]["0"] == {"cpus": "0-39", "irq": "0-1", "main": "2-37", "acl": 38, "release": 39}
    assert doc["npus"]["1"] == {"cpus": "40-79", "irq": "40-41", "main": "42-77", "acl": 78, "release": 79}
    assert doc["npus"]["15"] == {"cpus": "600-639", "irq": "600-601", "main": "602-637", "acl": 638,
                                 "release": 639}
    facts = doc["facts"]
    assert facts["source"] == str(a3_root) and facts["fingerprint"] == a3_topology.fingerprint
    assert set(facts["filled"]) == set(plan_run.CPU_BINDING_KEYS)


def test_cpu_binding_request_values_win_over_discovery(monkeypatch: pytest.MonkeyPatch,
                                                       a3_topology: pb.MemoryTopology) -> None:
    # Only NPU 3 runs here, and this process may use 0-191: global_slice over the host's 16 NPUs
    # gives each NPU len(allowed) // NPUs = 192 // 16 = 12 CPUs, NPU 3 → 36-47.
    asked = fake_discovery(monkeypatch, a3_topology)
    rc, doc = plan("cpu-binding", {"running_npus": [3], "allowed_cpus": "0-191"})
    assert rc == 0 and asked == [None]
    assert list(doc["npus"]) == ["3"] and doc["npus"]["3"]["cpus"] == "36-47"
    assert doc["facts"]["source"] == plan_run.LIVE
    assert "running_npus" not in doc["facts"]["filled"] and "allowed_cpus" not in doc["facts"]["filled"]
    assert {"device_type", "numa_cpus", "total_logic_npus"} <= set(doc["facts"]["filled"])


def test_cpu_binding_host_without_npus_says_which_fact_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    topo = pb.MemoryTopology(node_name="plain")
    topo.allowed_cpus.extend(range(8))
    asked = fake_discovery(monkeypatch, topo)
    rc, doc = plan("cpu-binding", {})
    code, message = error_of(doc)
    assert (rc, code) == (2, "invalid_request") and asked == [None]
    assert message.startswith("device_type:") and "live host" in message


# ---- cpu-binding --pid: the BindingPlan ----------------------------------------------------------------
ONE_NPU = {"device_type": "A3", "allowed_cpus": "0-23", "total_logic_npus": 4, "running_npus": [1]}


@pytest.mark.usefixtures("no_discovery")
def test_pid_emits_decision_and_plan_and_plan_alone_feeds_apply() -> None:
    rc, both = plan("cpu-binding", ONE_NPU, "--pid", "4321")
    assert rc == 0 and set(both) == {"decision", "plan"}
    assert both["decision"]["npus"]["1"]["main"] == "8-9"
    rc, bare = plan("cpu-binding", ONE_NPU, "--pid", "4321", "--emit", "plan")
    assert rc == 0 and bare == both["plan"]
    p = load_plan(json.dumps(bare))  # exactly what `memtopo apply -` reads
    roles = {a.thread_affinity.role: (list(a.thread_affinity.cpus), a.required)
             for a in p.actions if a.WhichOneof("action") == "thread_affinity"}
    # RFC example 2: NPU1 main [8,9], acl 10, rel 11; thread bindings are required.
    assert roles == {"main": ([8, 9], True), "acl": ([10], True), "release": ([11], True)}
    assert all(a.thread_affinity.pid == 4321 for a in p.actions if a.HasField("thread_affinity"))
    assert p.policy == "cpu-binding" and p.topology_fingerprint == ""
    rc, only = plan("cpu-binding", ONE_NPU, "--pid", "4321", "--emit", "decision")
    assert rc == 0 and only == both["decision"]


@pytest.mark.usefixtures("no_discovery")
def test_default_plan_id_follows_the_content_and_plan_id_overrides_it() -> None:
    _, first = plan("cpu-binding", ONE_NPU, "--pid", "4321", "--emit", "plan")
    _, again = plan("cpu-binding", ONE_NPU, "--pid", "4321", "--emit", "plan")
    _, other = plan("cpu-binding", ONE_NPU, "--pid", "4322", "--emit", "plan")
    assert first["plan_id"] == again["plan_id"] and first["plan_id"].startswith("cpu-binding-pid4321-npu1-")
    assert other["plan_id"] != first["plan_id"]
    _, named = plan("cpu-binding", ONE_NPU, "--pid", "4321", "--emit", "plan", "--plan-id", "job-7")
    assert named["plan_id"] == "job-7"
    rc, doc = plan("cpu-binding", ONE_NPU, "--pid", "4321", "--plan-id", "")
    assert rc == 2 and error_of(doc) == ("invalid_request", "plan_id: must not be empty")


@pytest.mark.usefixtures("no_discovery")
def test_several_running_npus_need_npu() -> None:
    four = {**ONE_NPU, "running_npus": [0, 1, 2, 3]}
    rc, doc = plan("cpu-binding", four, "--pid", "4321")
    code, message = error_of(doc)
    assert (rc, code) == (2, "invalid_request") and message.startswith("--npu:") and "0, 1, 2, 3" in message
    rc, doc = plan("cpu-binding", four, "--pid", "4321", "--npu", "2", "--emit", "plan")
    assert rc == 0
    main = next(a for a in doc["actions"] if a["id"] == "npu2-main")
    assert main["thread_affinity"]["cpus"] == [14, 15]  # NPU2 12-17: main 14-15
    rc, doc = plan("cpu-binding", four, "--pid", "4321", "--npu", "7")
    assert rc == 2 and error_of(doc)[0] == "invalid_request" and "NPU 7" in error_of(doc)[1]


def test_pid_finds_its_npu_and_its_irqs_from_discovery(monkeypatch: pytest.MonkeyPatch,
                                                      a3_topology: pb.MemoryTopology) -> None:
    # npu-smi lists pid 100005 on NPU 5 (README of the A3 fixture: pids 100000 + logical id).
    from memtopo.planner.cpu_binding import NpuIrqs
    fake_discovery(monkeypatch, a3_topology, {5: NpuIrqs(sq=(700,), cq=(701,))})
    rc, doc = run(["plan", "cpu-binding", "--request", "-", "--pid", "100005", "--emit", "plan"], "{}")
    assert rc == 0
    actions = {a["id"]: a for a in doc["actions"]}
    # NPU 5 → 200-239: IRQ CPUs 200 (SQ) and 201 (CQ), main 202-237, acl 238, release 239.
    assert actions["npu5-main"]["thread_affinity"]["cpus"] == list(range(202, 238))
    assert actions["npu5-irq-sq-700"]["irq_affinity"] == {"irq": 700, "cpus": [200]}
    assert actions["npu5-irq-cq-701"]["irq_affinity"] == {"irq": 701, "cpus": [201]}
    assert doc["topology_fingerprint"] == a3_topology.fingerprint


@pytest.mark.usefixtures("no_discovery")
@pytest.mark.parametrize("extra", [("--npu", "1"), ("--plan-id", "x"), ("--emit", "plan"), ("--emit", "both")])
def test_plan_options_need_pid(extra: tuple[str, str]) -> None:
    rc, doc = plan("cpu-binding", ONE_NPU, *extra)
    code, message = error_of(doc)
    assert (rc, code) == (2, "usage") and "needs --pid" in message


def test_npu_irqs_read_msi_vectors_by_action_name(tmp_path: Path) -> None:
    from memtopo.apply.host import HostFiles
    from memtopo.hostfs import HostFS
    bdf = "0000:c1:00.0"
    for irq, action in ((96, "sq_send_trigger_irq"), (97, "cq_update_irq"), (98, "other_irq")):
        (tmp_path / f"sys/bus/pci/devices/{bdf}/msi_irqs").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"sys/bus/pci/devices/{bdf}/msi_irqs/{irq}").write_text("msix\n")
        (tmp_path / f"sys/kernel/irq/{irq}").mkdir(parents=True)
        (tmp_path / f"sys/kernel/irq/{irq}/actions").write_text(action + "\n")
    topo = pb.MemoryTopology()
    topo.accelerators.add(index=3, kind=pb.ACCELERATOR_KIND_NPU, bdf=bdf)
    topo.accelerators.add(index=4, kind=pb.ACCELERATOR_KIND_NPU, bdf="0000:c2:00.0")  # no vectors
    found = plan_run.npu_irqs(HostFiles(HostFS.at(tmp_path)), topo)
    assert set(found) == {3} and (found[3].sq, found[3].cq) == ((96,), (97,))


# ---- hccs (the Volcano Ascend plugin's test vectors) -------------------------------------------------
def test_hccs_master_score_vector() -> None:
    # master frame_test ScoreBestNPUNodes: r=1; node1 {0}, node3 {0,1,2}, node11 {4,5}, node12 {4,5,6,7};
    # allocatable 8 → 263, 253, 246, 236.
    nodes = [{"name": n, "available": ids, "capacity": 8}
             for n, ids in (("node1", [0]), ("node3", [0, 1, 2]), ("node11", [4, 5]), ("node12", [4, 5, 6, 7]))]
    rc, doc = plan("hccs", {"request": 1, "nodes": nodes})
    assert rc == 0 and doc["policy"] == "hccs" and doc["chosen"] == ["node1"]
    assert {n["name"]: n["score"] for n in doc["nodes"]} == {"node1": 263, "node3": 253, "node11": 246,
                                                              "node12": 236}


def test_hccs_four_npus_take_a_whole_ring_in_node_order() -> None:
    # v2.0.3 best nodes / select: r=4; centos1 {5,2,0,1,3} → group A, NPUs [2,0,1,3] (both nodes are in
    # group A; with 8 allocatable each the fuller centos1 ranks first: fewer available scores higher).
    rc, doc = plan("hccs", {"request": 4, "nodes": [
        {"name": "centos1", "available": [5, 2, 0, 1, 3], "capacity": 8},
        {"name": "centos2", "available": [5, 4, 6, 7, 0, 1], "capacity": 8}]})
    assert rc == 0 and doc["chosen"] == ["centos1"]
    first = doc["nodes"][0]
    assert first["name"] == "centos1" and first["group"] == "A" and first["npus"] == [2, 0, 1, 3]
    assert doc["nodes"][1]["group"] == "A"
    assert first["annotation"] == {"huawei.com/Ascend910": "Ascend910-2,Ascend910-0,Ascend910-1,Ascend910-3"}


def test_hccs_errors() -> None:
    rc, doc = plan("hccs", {"request": 7, "nodes": [{"name": "a", "available": list(range(8))}]})
    assert rc == 2 and error_of(doc)[0] == "invalid_request"
    assert "1, 2 or 4 NPUs (kept inside one ring), 8 (a whole node) or 8·N" in error_of(doc)[1]
    # v2.0.3 insertNodeInPriGroup: request 2 with one free NPU in each ring fits nowhere.
    rc, doc = plan("hccs", {"request": 2, "nodes": [{"name": "a", "available": [0, 4]}]})
    assert rc == 1 and error_of(doc)[0] == "unsatisfiable" and "a:" in error_of(doc)[1]
    rc, doc = plan("hccs", {"request": 2, "nodes": [{"name": "a", "available": [0, 4], "capcity": 8}]})
    assert rc == 2 and "capcity" in error_of(doc)[1]


# ---- xpu and mtf (the design's examples, bit i from the right = XPU i) -------------------------------
def test_xpu_design_score_examples() -> None:
    # The design: 00000111→00001111 −1 → 2000; 00001111→00011111 +1 → 0; 00000000→00000001 +2 → −1000
    # (one card each); 00000111→00110111 0 → 1000 (two cards).
    nodes = [{"name": "a", "occupancy": "00000111"}, {"name": "b", "occupancy": "00001111"},
             {"name": "c", "used": []}]
    rc, doc = plan("xpu", {"request": 1, "nodes": nodes})
    assert rc == 0 and doc["policy"] == "xpu" and doc["chosen"] == "a"
    got = {n["name"]: (n["devices"], n["delta"], n["score"]) for n in doc["nodes"]}
    assert got == {"a": ([3], -1, 2000), "b": ([4], 1, 0), "c": ([0], 2, -1000)}
    assert doc["nodes"][0]["annotation"] == "BAIDU_COM_DEVICE_IDX=3"
    rc, doc = plan("xpu", {"request": 2, "nodes": [{"name": "a", "occupancy": "00000111"}]})
    assert rc == 0 and (doc["nodes"][0]["devices"], doc["nodes"][0]["score"]) == ([4, 5], 1000)


def test_xpu_errors() -> None:
    rc, doc = plan("xpu", {"request": 3, "nodes": [{"name": "a", "used": []}]})
    assert rc == 2 and "only 1, 2, 4 or 8-card allocations are allowed" in error_of(doc)[1]
    rc, doc = plan("xpu", {"request": 1, "nodes": [{"name": "full", "occupancy": "11111111"}]})
    assert rc == 1 and error_of(doc)[0] == "unsatisfiable" and "NumaNotFit" in error_of(doc)[1]


@pytest.mark.parametrize(("occupancy", "mtf"), [("11111111", 0), ("00000000", 1), ("00000011", 2),
                                                 ("00000001", 3), ("00010001", 4)])
def test_mtf_design_table(occupancy: str, mtf: int) -> None:
    rc, doc = run(["plan", "mtf", occupancy])
    assert rc == 0 and doc["mtf"] == mtf and doc["occupancy"] == occupancy


def test_mtf_bad_occupancy() -> None:
    rc, doc = run(["plan", "mtf", "0000001"])
    assert rc == 2 and error_of(doc)[0] == "invalid_request"


# ---- guest-pci (KubeVirt pci-placement_test.go) -----------------------------------------------------
GUEST_NUMA = {"cells": {"0": "0-1", "1": "2-3"}, "vcpupins": {"0": "0", "2": "4"},
              "host_node_cpus": {"0": "0-3", "1": "4-7"}}
# The upstream test's fake sysfs: 01=0, 02=1, 03=0, 04=1, 05=0, 06 has no entry.
SYSFS_NODES = {"01": 0, "02": 1, "03": 0, "04": 1, "05": 0}


def _bdf(bus: str) -> str:
    return f"0000:{bus}:00.0"


@pytest.mark.usefixtures("no_discovery")
def test_guest_pci_d1_order() -> None:
    # D1: devices given as 04, 03, 01, 02 → pxb 1 node0 busNr 253; rp 2, 3 on bus 1; pxb 4 node1
    # busNr 250; rp 5, 6 on bus 4; devices 01→2, 03→3, 02→5, 04→6.
    devices = [{"bdf": _bdf(b), "numa_node": SYSFS_NODES[b]} for b in ("04", "03", "01", "02")]
    rc, doc = plan("guest-pci", {"devices": devices, "guest_numa": GUEST_NUMA})
    assert rc == 0 and doc["policy"] == "guest-pci"
    ctl = [(c["index"], c["model"], c.get("bus_nr"), c.get("node"), c.get("address", {}).get("bus"))
           for c in doc["controllers"]]
    assert ctl == [(1, "pcie-expander-bus", 253, 0, None), (2, "pcie-root-port", None, None, 1),
                   (3, "pcie-root-port", None, None, 1), (4, "pcie-expander-bus", 250, 1, None),
                   (5, "pcie-root-port", None, None, 4), (6, "pcie-root-port", None, None, 4)]
    assert {d["bdf"][5:7]: d["address"]["bus"] for d in doc["devices"]} == {"01": 2, "03": 3, "02": 5, "04": 6}
    assert "<controller" in doc["xml"]


@pytest.mark.usefixtures("no_discovery")
def test_guest_pci_strict_without_affinity_fails_exit_1() -> None:
    # S1: strict; 06 (no NUMA) → "strict PCI NUMA-aware placement failed" naming 0000:06:00.0.
    rc, doc = plan("guest-pci", {"devices": [{"bdf": _bdf("06"), "numa_node": -1}], "strict": True,
                                 "guest_numa": GUEST_NUMA})
    code, message = error_of(doc)
    assert (rc, code) == (1, "unsatisfiable")
    assert "strict PCI NUMA-aware placement failed" in message and "0000:06:00.0" in message


def _sysfs_topology() -> pb.MemoryTopology:
    topo = pb.MemoryTopology(node_name="kubevirt-fake")
    for bus, node in SYSFS_NODES.items():
        topo.pci_devices.add(bdf=_bdf(bus), numa_node=node)
    return topo


def test_guest_pci_numa_nodes_come_from_discovery(monkeypatch: pytest.MonkeyPatch) -> None:
    # B2: 01(n0), 02(n1) → busNr 254 and 252; B6: 06 (no sysfs entry), 01 → 06 unaddressed, 01 on bus 2.
    asked = fake_discovery(monkeypatch, _sysfs_topology())
    rc, doc = plan("guest-pci", {"devices": [{"bdf": _bdf("01")}, {"bdf": _bdf("02")}], "guest_numa": GUEST_NUMA})
    assert rc == 0 and asked == [None]
    assert [c["bus_nr"] for c in doc["controllers"] if c["model"] == "pcie-expander-bus"] == [254, 252]
    assert doc["facts"]["filled"] == ["devices[0].numa_node", "devices[1].numa_node"]
    rc, doc = plan("guest-pci", {"devices": [{"bdf": _bdf("06")}, {"bdf": _bdf("01")}], "guest_numa": GUEST_NUMA},
                   "--root", "/captured")
    assert rc == 0 and asked == [None, "/captured"]
    by_bdf = {d["bdf"]: d for d in doc["devices"]}
    assert by_bdf[_bdf("06")]["status"] == "default" and "address" not in by_bdf[_bdf("06")]
    assert by_bdf[_bdf("01")]["address"]["bus"] == 2
    assert [(c["model"], c.get("node")) for c in doc["controllers"]] == [("pcie-expander-bus", 0),
                                                                         ("pcie-root-port", None)]
    assert any("0000:06:00.0 is not a PCI device of /captured" in n for n in doc["facts"]["notes"])


@pytest.mark.usefixtures("no_discovery")
def test_guest_pci_complete_request_needs_no_host() -> None:
    rc, doc = plan("guest-pci", {"devices": [{"bdf": _bdf("01"), "numa_node": 0}], "numa_mapping": {"0": 0}})
    assert rc == 0 and "facts" not in doc and doc["controllers"][0]["bus_nr"] == 254


# ---- place (memory topology) ------------------------------------------------------------------------
def test_place_unified_memory_policy_is_skipped_unless_explicit(gh200_topology: pb.MemoryTopology) -> None:
    # On a Unified (GH200) domain the memory policy is skipped unless the request names one.
    topo = topology_json(gh200_topology)
    rc, doc = plan("place", {"cpus": 8, "gpus": 1, "memory_gb": 16, "topology": topo})
    assert rc == 0 and doc["policy"] == "place" and doc["co_located"] is True
    assert doc["memory_policy"]["mode"] == "skip" and doc["domains"][0]["type"] == "UNIFIED"
    assert "facts" not in doc
    rc, doc = plan("place", {"cpus": 8, "gpus": 1, "memory_gb": 16, "topology": topo,
                             "constraints": {"memory_policy": "interleave"}})
    assert rc == 0 and doc["memory_policy"]["mode"] == "interleave" and doc["memory_policy"]["explicit"] is True


def test_place_hard_constraints_name_the_constraint(a3_topology: pb.MemoryTopology) -> None:
    topo = topology_json(a3_topology)  # 8 DRAM nodes of 64 GiB, no Unified domain, no CXL
    rc, doc = plan("place", {"cpus": 8, "topology": topo, "constraints": {"require_unified_memory": True}})
    assert rc == 1 and doc["error"]["code"] == "unsatisfiable"
    assert doc["error"]["constraint"] == "require_unified_memory"
    # Memory above local DRAM (512 GiB here) needs allow_cxl_memory.
    rc, doc = plan("place", {"cpus": 8, "memory_gb": 600, "topology": topo})
    assert rc == 1 and doc["error"]["constraint"] == "allow_cxl_memory"


def test_place_reads_the_root() -> None:
    rc, doc = run(["plan", "place", "--request", "-", "--root", str(GH200_TARBALL)],
                  json.dumps({"cpus": 4, "gpus": 1}))
    assert rc == 0 and doc["node"] == "gh200" and doc["facts"]["filled"] == ["topology"]
    assert doc["memory_policy"]["mode"] == "skip"


@pytest.mark.usefixtures("no_discovery")
def test_place_pid_plan_from_an_inline_topology(a3_topology: pb.MemoryTopology) -> None:
    topo = topology_json(a3_topology)  # 8 DRAM nodes: local memory, pages move home from the other 7
    rc, doc = plan("place", {"cpus": 8, "memory_gb": 16, "topology": topo}, "--pid", "4242", "--emit", "both")
    assert rc == 0 and set(doc) == {"decision", "plan"}
    p = doc["plan"]
    assert p["plan_id"].startswith("place-pid4242-") and p["topology_fingerprint"] == a3_topology.fingerprint
    acts = {a["id"]: a for a in p["actions"]}
    assert acts["place-cpus"]["thread_affinity"]["cpus"] == list(parse_cpulist(doc["decision"]["cpus"]))
    home = parse_cpulist(doc["decision"]["memory"]["nodes"])
    assert acts["place-migrate"]["page_migration"]["to_nodes"] == list(home)
    assert sorted(acts["place-migrate"]["page_migration"]["from_nodes"] + list(home)) == list(range(8))
    rc, again = plan("place", {"cpus": 8, "memory_gb": 16, "topology": topo}, "--pid", "4242", "--emit", "plan")
    assert rc == 0 and again == p
    rc, named = plan("place", {"cpus": 8, "topology": topo}, "--pid", "4242", "--emit", "plan", "--plan-id", "j1")
    assert rc == 0 and named["plan_id"] == "j1"
    rc, doc = plan("place", {"cpus": 8, "topology": topo}, "--plan-id", "j1")
    assert rc == 2 and error_of(doc) == ("usage", "--plan-id needs --pid: there is no plan without a process to bind")


@pytest.mark.usefixtures("no_discovery")
def test_place_topology_errors() -> None:
    rc, doc = plan("place", {"cpus": 1, "topology": {"domains": "x"}})
    assert rc == 2 and error_of(doc)[0] == "invalid_request" and error_of(doc)[1].startswith("topology:")
    rc, doc = plan("place", {"cpus": 1, "topology": {}}, "--root", "/x")
    assert rc == 2 and error_of(doc)[0] == "usage"
    rc, doc = plan("place", {"cpus": 1, "topology": {}, "constraints": {"allow_cxl": True}})
    assert rc == 2 and "allow_cxl" in error_of(doc)[1]


# ---- request reading and the error contract ----------------------------------------------------------
@pytest.mark.usefixtures("no_discovery")
@pytest.mark.parametrize(("stdin", "words"), [
    ("{", "not JSON"), ("", "not JSON"), ('{"request": NaN}', "NaN"), ("[1, 2]", "expected a JSON object"),
    (b'{"request": "\xff"}', "not JSON"), ("[" * 100_000 + "]" * 100_000, "not JSON"),
])
def test_malformed_requests(stdin: str | bytes, words: str) -> None:
    rc, doc = run(["plan", "xpu", "--request", "-"], stdin)
    code, message = error_of(doc)
    assert (rc, code) == (2, "invalid_request") and words in message


def test_request_from_a_file_and_a_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "req.json"
    f.write_text(json.dumps({"request": 1, "nodes": [{"name": "a", "used": []}]}))
    rc, doc = run(["plan", "xpu", "--request", str(f)])
    assert rc == 0 and doc["chosen"] == "a"
    rc, doc = run(["plan", "xpu", "--request", str(tmp_path / "nope.json")])
    assert rc == 2 and error_of(doc)[0] == "invalid_request" and "cannot read" in error_of(doc)[1]


def test_bad_root_is_invalid_root(tmp_path: Path) -> None:
    rc, doc = run(["plan", "place", "--request", "-", "--root", str(tmp_path / "missing")], '{"cpus": 1}')
    assert rc == 2 and error_of(doc)[0] == "invalid_root"


@pytest.mark.parametrize("argv", [["plan", "cpu-binding", "--request", "-", "--pid", "abc"],
                                  ["plan", "hccs"], ["plan", "mtf"]])
def test_usage_errors_are_json_on_stdout(argv: list[str]) -> None:
    rc, doc = run(argv, "{}")
    assert rc == 2 and error_of(doc)[0] == "usage"


def test_internal_errors_are_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(obj: Any) -> Any:
        raise KeyError("oops")
    monkeypatch.setattr("memtopo.planner.xpu.parse_request", boom)
    rc, doc = plan("xpu", {})
    code, message = error_of(doc)
    assert (rc, code) == (3, "internal") and "KeyError" in message and "please report" in message




def test_through_memtopo_main(monkeypatch: pytest.MonkeyPatch) -> None:
    rc, text = memtopo_main(monkeypatch, ["plan", "mtf", "00000011"])
    assert rc == 0 and json.loads(text)["mtf"] == 2
    rc, text = memtopo_main(monkeypatch, ["plan", "hccs", "--request", "-"],
                            '{"request": 8, "nodes": [{"name": "n", "available": []}]}')
    assert rc == 1 and error_of(json.loads(text))[0] == "unsatisfiable"


# ---- property: any input gives a decision or an error object, with a consistent exit status ------------
_json = json_like(
    st.none() | st.booleans() | st.integers(-(10**4), 10**4)
    | st.floats(min_value=-1e9, max_value=1e9) | st.text(max_size=12),
    st.text(max_size=8), max_leaves=12,
)
_KEYS = sorted({*plan_run.CPU_BINDING_KEYS, "request", "nodes", "name", "available", "capacity", "used",
                "occupancy", "cross_half_fallback", "devices", "bdf", "numa_node", "strict", "numa_mapping",
                "guest_numa", "highest_controller_index", "cpus", "gpus", "memory_gb", "workload",
                "constraints", "topology"})
_value = st.one_of(
    _json, st.sampled_from(["A2", "A3", "0-7", "0-3,8", "00000011", "0000:01:00.0", "gpu-heavy"]),
    st.lists(st.integers(0, 9), max_size=8),
    st.lists(st.fixed_dictionaries({"name": st.text(min_size=1, max_size=3)},
                                   optional={"available": st.lists(st.integers(-1, 9), max_size=8),
                                             "used": st.lists(st.integers(-1, 9), max_size=8),
                                             "occupancy": st.sampled_from(["00000011", "1111111x", ""]),
                                             "bdf": st.sampled_from(["0000:01:00.0", "0000:02:00.0", "zz"]),
                                             "numa_node": st.integers(-2, 2)}), max_size=4),
)
_requests = st.one_of(_json, st.dictionaries(st.sampled_from(_KEYS), _value, max_size=6))
_POLICIES = ("cpu-binding", "hccs", "xpu", "guest-pci", "place")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(_POLICIES), request=_requests, pid=st.none() | st.integers(-5, 10**6))
def test_any_request_gets_a_decision_or_an_error(policy: str, request: Any, pid: int | None) -> None:
    topo = _sysfs_topology()
    topo.allowed_cpus.extend(range(8))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_run, "discover_facts",
                   lambda root, with_irqs=False, pid=None: plan_run.Facts(topo, root or plan_run.LIVE))
        extra = ["--pid", str(pid)] if pid is not None and policy == "cpu-binding" else []
        rc, doc = plan(policy, request, *extra)
    if "error" in doc:
        code = doc["error"]["code"]
        assert code in ERROR_EXIT, doc  # never "internal": that would be a bug
        assert rc == ERROR_EXIT[code] and doc["error"]["message"]
    else:
        assert rc == 0 and ("policy" in doc or "decision" in doc)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_on_stdin_get_an_answer(data: bytes) -> None:
    rc, doc = run(["plan", "hccs", "--request", "-"], data)
    assert rc in (0, 1, 2) and (("error" in doc) == (rc != 0))


@given(occupancy=st.text(max_size=10))
def test_any_occupancy_gets_an_answer(occupancy: str) -> None:
    rc, doc = run(["plan", "mtf", "--", occupancy])
    if rc == 0:
        assert 0 <= doc["mtf"] <= 8
    else:
        assert rc == 2 and error_of(doc)[0] in ("invalid_request", "usage")


@pytest.mark.usefixtures("no_discovery")
def test_place_huge_memory_is_an_invalid_request() -> None:
    rc, doc = plan("place", {"cpus": 1, "memory_gb": 1e300, "topology": {}})
    assert rc == 2 and error_of(doc)[0] == "invalid_request"


def test_plan_json_round_trips_through_apply_loader() -> None:
    p = planpb.BindingPlan(plan_id="x", policy="cpu-binding")
    p.actions.add(id="a", required=True).thread_affinity.cpus.extend([1, 2])
    assert load_plan(json.dumps(plan_run.plan_json(p))) == p
