"""cpu-binding policy: the upstream vectors, the documented deviations, properties.

The upstream vectors are the cases of vLLM-Ascend's own unit tests
(``tests/ut/device_allocator/test_cpu_binding.py`` at ``182b75ea``) and the worked examples of its
CPU-binding design document and RFC #6966, restated as requests. Test names carry this project's
label for the case they restate (p = parser, u = allocator, s = binding side effect, c4 = design
example, a7 = a quirk of the reference, kept or corrected); each test says what it checks.

Real Ascend hardware is absent: end-to-end cases use the recorded/synthesized tool outputs under
../shared/fixtures/ascend (lscpu layouts read from the files; NPU affinities and running sets as that
README states for the npu-smi captures, since parsing npu-smi is discovery's job, not the planner's).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.cpulist import format_cpulist, parse_cpulist
from memtopo.planner.cpu_binding import (
    CpuBindingDecision,
    CpuBindingRequest,
    NpuIrqs,
    ThreadRoles,
    decide,
    device_type_of,
    example_a3_request,
    extend_to_next_node,
    fill_from_topology,
    parse_request,
    pool_nodes,
    split_evenly,
    to_binding_plan,
)
from memtopo.planner.cpu_binding import _topo_affinity_pools as pool_stage  # the stage upstream tests in isolation
from memtopo.planner.errors import PlanError
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import SHARED
from tests.strategies import json_like

ASCEND = SHARED / "fixtures" / "ascend"


def lscpu_numa(path: Path) -> dict[str, str]:
    """``lscpu -e=CPU,NODE`` → numa_cpus request field (rows whose first character is a digit)."""
    nodes: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line[:1].isdigit():
            cpu, node = line.split()
            nodes.setdefault(int(node), []).append(int(cpu))
    return {str(n): format_cpulist(c) for n, c in sorted(nodes.items())}


NUMA_192 = lscpu_numa(ASCEND / "synthesized" / "lscpu-e-cpu-node-192cpu-8node.txt")
NUMA_640 = lscpu_numa(ASCEND / "synthesized" / "lscpu-e-cpu-node-640cpu-8node.txt")
NUMA_0_2 = lscpu_numa(ASCEND / "synthesized" / "lscpu-e-cpu-node-8cpu-nodes-0-2.txt")
NUMA_192_INT = {int(k): parse_cpulist(v) for k, v in NUMA_192.items()}

# CPU Affinity columns of the real `npu-smi info -t topo` captures, as fixtures/ascend/README.md states.
INTERLEAVED = {
    "0": "144-167",
    "1": "0-23",
    "2": "144-167",
    "3": "0-23",
    "4": "96-119",
    "5": "48-71",
    "6": "96-119",
    "7": "48-71",
}
PAIRED = {
    "0": "144-167",
    "1": "144-167",
    "2": "96-119",
    "3": "96-119",
    "4": "0-23",
    "5": "0-23",
    "6": "48-71",
    "7": "48-71",
}
PCIE_4 = {"0": "144-167", "1": "96-119", "2": "48-71", "3": "0-23"}


def run(obj: dict[str, Any]) -> CpuBindingDecision:
    return decide(parse_request(obj))


def pools(obj: dict[str, Any]) -> dict[str, str]:
    return {npu: v["cpus"] for npu, v in run(obj).to_json()["npus"].items()}


def error(obj: Any) -> PlanError:
    with pytest.raises(PlanError) as exc:
        decide(parse_request(obj))
    return exc.value


def a2(allowed: str, running: list[int], affinity: dict[str, str] | None, **extra: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"device_type": "A2", "allowed_cpus": allowed, "running_npus": running, **extra}
    if affinity is not None:
        obj["topo_affinity"] = affinity
    return obj


def a3(allowed: str, running: list[int], total: int = 0, **extra: Any) -> dict[str, Any]:
    return {"device_type": "A3", "allowed_cpus": allowed, "running_npus": running, "total_logic_npus": total, **extra}


def test_fixture_numa_layouts() -> None:
    # The synthesized lscpu files follow node = cpu // 24 (192 CPUs) and cpu // 80 (640 CPUs).
    assert {str(n): f"{24 * n}-{24 * n + 23}" for n in range(8)} == NUMA_192
    assert example_a3_request()["numa_cpus"] == NUMA_640
    assert NUMA_0_2 == {"0": "0-3", "2": "4-7"}


# ---- parser vectors that concern the allocator's input ------------------------------------------------
def test_p19_cpulist_with_spaces() -> None:
    assert parse_request(a3("0-2, 4, 6-8", [0])).allowed_cpus == (0, 1, 2, 4, 6, 7, 8)


def test_p20_no_allowed_cpus_is_unsatisfiable() -> None:
    # Upstream: a missing /proc/self/status gives allowed = [] and a later failure.
    e = error(a3("", [0], 1))
    assert e.code == "unsatisfiable" and "allowed_cpus is empty" in e.message


def test_p22_numa_without_nodes_is_refused() -> None:
    e = error(a2("0-9", [0], {"0": "0-9"}, numa_cpus={}))
    assert e.code == "invalid_request" and "numa_cpus" in e.message


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("ut-lscpu-e-cpu-node-interleaved.txt", {0: (0, 2), 1: (1, 3)}),
        ("ut-lscpu-e-cpu-node-header-blank.txt", {0: (0,), 1: (1,)}),
    ],
)
def test_p23_p24_lscpu_becomes_numa_cpus(name: str, expected: dict[int, tuple[int, ...]]) -> None:
    numa = lscpu_numa(ASCEND / "upstream-ut" / name)
    assert parse_request(a2("0-3", [0], {"0": "0"}, numa_cpus=numa)).numa_cpus == expected


def test_p16_p18_topo_affinity_field() -> None:
    assert parse_request(a2("0-9", [0], {"0": "0-3"})).topo_affinity == {0: (0, 1, 2, 3)}
    # A topo table without an affinity column is an empty map: topo_affinity falls back to global_slice.
    assert run(a2("0-9", [0], {}, total_logic_npus=1)).mode == "global_slice"


BAD_REQUESTS: list[tuple[Any, str]] = [
    ([], "request"),
    ({"allowed_cpus": "0-9", "running_npus": [0]}, "device_type"),
    (a3("0-9", [0]) | {"device_type": ""}, "device_type"),
    ({"device_type": 3, "allowed_cpus": "0-9", "running_npus": [0]}, "device_type"),
    (a3("0-9", [0]) | {"device_type": "Ascend950DT"}, "device_type"),
    (a3("0-9", [0]) | {"device_type": "A5"}, "device_type"),
    ({"device_type": "A3", "running_npus": [0]}, "allowed_cpus"),
    (a3("0-9", [0]) | {"allowed_cpus": 5}, "allowed_cpus"),
    (a3("0-9", [0]) | {"allowed_cpus": "0-3-5"}, "allowed_cpus"),
    (a3("0-9", [0]) | {"allowed_cpus": "9-1"}, "allowed_cpus"),
    (a3("0-9", [0]) | {"allowed_cpus": "0,,1"}, "allowed_cpus"),
    ({"device_type": "A3", "allowed_cpus": "0-9"}, "running_npus"),
    (a3("0-9", []), "running_npus"),
    (a3("0-9", [-1]), "running_npus[0]"),
    (a3("0-9", ["0"]), "running_npus[0]"),  # type: ignore[list-item]
    (a3("0-9", [True]), "running_npus[0]"),
    (a3("0-9", [0]) | {"running_npus": "0"}, "running_npus"),
    (a3("0-9", [0], -1), "total_logic_npus"),
    (a3("0-9", [0]) | {"total_logic_npus": "16"}, "total_logic_npus"),
    (a3("0-9", [0]) | {"total_logic_npus": True}, "total_logic_npus"),
    (a3("0-9", [2], 2), "running_npus"),  # NPU 2 of 2 logical NPUs
    (a2("0-9", [0], None, topo_affinity=["0-3"]), "topo_affinity"),
    (a2("0-9", [0], {"x": "0-3"}), "topo_affinity"),
    (a2("0-9", [0], {"-1": "0-3"}), "topo_affinity"),
    (a2("0-9", [0], None, topo_affinity={"0": 3}), "topo_affinity[0]"),
    (a2("0-9", [0], {"0": "0-3"}, numa_cpus={"0": "0-5", "1": "5-9"}), "numa_cpus"),
    (a2("0-9", [0], {"0": "0-3"}, numa_cpus={"0": "a"}), "numa_cpus[0]"),
    (a2("0-9", [0], {"0": "0-3"}, numa_cpus="0-9"), "numa_cpus"),
]


@pytest.mark.parametrize(("obj", "field"), BAD_REQUESTS)
def test_bad_request_names_the_field(obj: Any, field: str) -> None:
    with pytest.raises(PlanError) as exc:
        parse_request(obj)
    assert exc.value.code == "invalid_request"
    assert exc.value.message.startswith(field)
    assert exc.value.to_json()["error"]["code"] == "invalid_request"


_json = json_like(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.text(alphabet="0123456789-,: x", max_size=12),
    st.text(alphabet="0123x", max_size=3), max_leaves=12,
)
_fields = st.fixed_dictionaries(
    {},
    optional={
        "device_type": st.sampled_from(["A2", "A3", "310P", "A5", "", "Ascend910"]) | _json,
        "allowed_cpus": st.sampled_from(["0-47", "", "0-3", "144-191"]) | _json,
        "running_npus": st.lists(st.integers(0, 9), max_size=4) | _json,
        "total_logic_npus": st.integers(-1, 10) | _json,
        "topo_affinity": st.dictionaries(st.sampled_from("0123"), st.sampled_from(["0-23", "24-47", "", "5"])) | _json,
        "numa_cpus": st.dictionaries(st.sampled_from("012"), st.sampled_from(["0-23", "24-47", "48-71", ""])) | _json,
    },
)


@given(_fields | _json)
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_garbage_gives_plan_error_or_a_decision(obj: Any) -> None:
    try:
        decision = decide(parse_request(obj))
    except PlanError as exc:
        assert exc.code in ("invalid_request", "unsatisfiable", "invalid_topology") and exc.message
    else:
        assert decision.npus


# ---- device type and mode (the reference's SoC and mode tables) ---------------------------------------
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("A2", "A2"),
        ("a3", "A3"),
        ("310p", "310P"),
        ("A5", "A5"),
        ("ascend910b1", "A2"),
        ("ascend910b4-1", "A2"),
        ("Ascend 910B3", "A2"),
        ("910B2C", "A2"),
        ("ascend910_9391", "A3"),
        ("ascend910_9362", "A3"),
        ("910c", "A3"),
        ("Ascend910", "A3"),
        ("ascend310p3vir02", "310P"),
        ("310P3", "310P"),
        ("Ascend950DT", "A5"),
        ("ascend950", "A5"),
        ("Ascend910ProB", None),
        ("Mcu", None),
        ("", None),
        ("Tesla V100", None),
    ],
)
def test_device_type_of(name: str, expected: str | None) -> None:
    assert device_type_of(name) == expected


@pytest.mark.parametrize(
    ("device_type", "mode"),
    [
        ("A2", "topo_affinity"),
        ("310P", "topo_affinity"),
        ("A3", "global_slice"),
        ("X9", "topo_affinity"),
        ("ascend910b3", "topo_affinity"),
        ("Ascend910", "global_slice"),
    ],
)
def test_u3_u5_mode_table(device_type: str, mode: str) -> None:
    obj = a2("0-19", [0, 1], {"0": "0-9", "1": "10-19"}, total_logic_npus=2) | {"device_type": device_type}
    assert run(obj).mode == mode


def test_u4_no_affinity_falls_back_to_global_slice() -> None:
    decision = run(a2("0-19", [1], None, total_logic_npus=2))
    assert decision.mode == "global_slice" and decision.to_json()["npus"]["1"]["cpus"] == "10-19"


# ---- allocator vectors --------------------------------------------------------------------------------
def test_u1_u2_split_evenly_remainder_to_last() -> None:
    assert split_evenly([10, 11, 12, 13], [0, 1]) == {0: (10, 11), 1: (12, 13)}
    assert split_evenly(list(range(14)), [0, 1, 2]) == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7), 2: tuple(range(8, 14))}
    # As upstream: fewer CPUs than members leaves all but the last empty.
    assert split_evenly([0, 1], [0, 1, 2]) == {0: (), 1: (), 2: (0, 1)}


def test_u6_to_u9_extension_to_next_node() -> None:
    numa = {0: [0, 1], 1: [2, 3]}
    assert extend_to_next_node([], numa, [0, 1, 2, 3]) == ()
    assert extend_to_next_node([0, 1], numa, [0, 1, 2, 3]) == (0, 1, 2, 3)
    assert extend_to_next_node([0, 1], numa, [0, 1, 3]) == (0, 1, 3)
    assert extend_to_next_node([0, 1], {0: [0], 1: [1]}, [0, 1]) == (0, 1)  # two nodes: unchanged
    # Wrap-around: the last node extends to node 0; a single node extends to itself (no change).
    assert extend_to_next_node([2, 3], numa, [0, 1, 2, 3]) == (2, 3, 0, 1)
    assert extend_to_next_node([0], {0: [0, 1]}, [0, 1]) == (0,)


def test_u10_global_slice_by_logical_id() -> None:
    obj = a3("0-19", [1], 2, topo_affinity={"0": "0-1", "1": "2-3"})
    assert pools(obj) == {"1": "10-19"}


def test_u11_two_processes_same_cpuset_disjoint() -> None:
    a = run(a2("0-19", [0], None, total_logic_npus=4)).pool(0)
    b = run(a2("0-19", [3], None, total_logic_npus=4)).pool(3)
    assert format_cpulist(a.cpus) == "0-4" and format_cpulist(b.cpus) == "15-19"
    assert not set(a.cpus) & set(b.cpus) and not set(a.main) & set(b.main)


def test_u12_remainder_to_lowest_ids() -> None:
    assert pools(a2("0-16", [0, 1, 2], None, total_logic_npus=3)) == {"0": "0-5", "1": "6-11", "2": "12-16"}


def test_u13_u14_total_from_affinity_then_running() -> None:
    assert pools(a3("0-11", [0, 1], 0, topo_affinity={"0": "0-5", "1": "6-11"})) == {"0": "0-5", "1": "6-11"}
    assert pools(a3("0-11", [0, 1], 0)) == {"0": "0-5", "1": "6-11"}
    # Three affinity rows count three NPUs although two run.
    assert pools(a3("0-14", [0, 1], 0, topo_affinity={"0": "0", "1": "1", "2": "2"})) == {"0": "0-4", "1": "5-9"}


def test_u15_global_minimum() -> None:
    e = error(a2("0-7", [0, 1], None, total_logic_npus=2))
    assert e.code == "unsatisfiable"
    assert "NPU 0: its global slice has 4 CPUs" in e.message
    assert "total_allowed=8, total_npus=2, min_per_npu=4 (<5). Need at least 10 CPUs in cpuset." in e.message


def test_a7_7_global_minimum_counts_every_logical_npu() -> None:
    e = error(a3("0-78", [0], 16))
    assert "total_allowed=79, total_npus=16" in e.message and "NPU 15: its global slice has 4 CPUs" in e.message
    assert pools(a3("0-79", [0], 16)) == {"0": "0-4"}
    assert pools(a3("0-82", [0, 2, 3, 15], 16)) == {"0": "0-5", "2": "12-17", "3": "18-22", "15": "78-82"}


def test_u17_invalid_npu_id() -> None:
    with pytest.raises(PlanError, match=r"running_npus: NPU 2 is not among the 2 logical NPUs"):
        parse_request(a2("0-11", [2], None, total_logic_npus=2))
    # Without total_logic_npus the running count is the total.
    e = error(a3("0-11", [2], 0))
    assert e.code == "invalid_request" and e.message == "Invalid NPU id 2, total_npus=1."


def test_u19_role_split_of_five() -> None:
    assert run(a3("0-4", [0], 1)).to_json() == {
        "mode": "global_slice",
        "npus": {"0": {"cpus": "0-4", "irq": "0-1", "main": "2", "acl": 3, "release": 4}},
    }


def test_u20_pool_below_five_names_npu_and_size() -> None:
    e = error(a2("0-1", [0], {"0": "0-1"}))
    assert e.code == "unsatisfiable"
    assert e.message.startswith("NPU 0: its pool has 2 CPUs (0-1); each NPU needs at least 5")


def test_u22_affinity_outside_cpuset() -> None:
    e = error(a2("8-9", [0], {"0": "0-1"}))
    assert e.code == "unsatisfiable" and e.message.startswith("NPU 0: none of its affinity CPUs (0-1)")
    assert "conflict with NUMA affinity" in e.message


def test_u23_shared_affinity_split_without_extension() -> None:
    req = parse_request(a2("0-3", [0, 1, 2], {"0": "0-1", "1": "2-3", "2": "2-3"}, total_logic_npus=3))
    assert pool_stage(req) == {0: (0, 1), 1: (2,), 2: (3,)}
    # The minimum is checked afterwards, on the first NPU short of it.
    assert error(a2("0-3", [0, 1, 2], {"0": "0-1", "1": "2-3", "2": "2-3"})).message.startswith(
        "NPU 0: its pool has 2 CPUs"
    )


def test_u24_hidden_npu_outside_cpuset_is_no_candidate() -> None:
    req = parse_request(a2("192-193", [0], {"0": "192-193", "1": "128-129"}, total_logic_npus=2))
    assert pool_stage(req) == {0: (192, 193)}


def test_u25_hidden_npu_with_same_affinity_takes_half() -> None:
    obj = a2("192-201", [0], {"0": "192-201", "1": "192-201"}, total_logic_npus=2)
    assert run(obj).to_json()["npus"] == {
        "0": {"cpus": "192-196", "irq": "192-193", "main": "194", "acl": 195, "release": 196}
    }


def test_u26_and_design_doc_hidden_same_affinity() -> None:
    # Both processes may use 144-191; NPU0's affinity 144-167 (node 6) extends to node 7.
    a = run(a2("144-191", [0], INTERLEAVED, total_logic_npus=8, numa_cpus=NUMA_192)).pool(0)
    b = run(a2("144-191", [2], INTERLEAVED, total_logic_npus=8, numa_cpus=NUMA_192)).pool(2)
    assert format_cpulist(a.cpus) == "144-167" and format_cpulist(b.cpus) == "168-191"  # v0.18.0 gave A 144-191
    roles_a = [set(a.cpus), set(a.main), {a.acl}, {a.release}]
    roles_b = [set(b.cpus), set(b.main), {b.acl}, {b.release}]
    assert all(not x & y for x, y in zip(roles_a, roles_b, strict=True))


def test_u26_allowed_cpus_from_status_fixture() -> None:
    status = (ASCEND / "synthesized" / "proc-self-status-cpus-allowed-144-191.txt").read_text()
    allowed = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    assert pools(a2(allowed, [2], INTERLEAVED, total_logic_npus=8, numa_cpus=NUMA_192)) == {"2": "168-191"}


# ---- the design document's and RFC #6966's examples ---------------------------------------------------
def test_c4_a3_640_cpus_16_npus() -> None:
    decision = run(example_a3_request())
    assert decision.mode == "global_slice" and [p.npu for p in decision.npus] == list(range(16))
    for i in range(16):
        c = 40 * i
        assert decision.to_json()["npus"][str(i)] == {
            "cpus": f"{c}-{c + 39}",
            "irq": f"{c}-{c + 1}",
            "main": f"{c + 2}-{c + 37}",
            "acl": c + 38,
            "release": c + 39,
        }


def test_c4_rfc_example_2() -> None:
    decision = run(a3("0-23", [0, 1, 2, 3], 4))
    assert {k: v["cpus"] for k, v in decision.to_json()["npus"].items()} == {
        "0": "0-5",
        "1": "6-11",
        "2": "12-17",
        "3": "18-23",
    }
    assert decision.to_json()["npus"]["1"] == {"cpus": "6-11", "irq": "6-7", "main": "8-9", "acl": 10, "release": 11}


# ---- A2 end to end on the real topo layouts ---------------------------------------------------------
@pytest.mark.parametrize(
    ("affinity", "expected"),
    [
        (
            INTERLEAVED,
            {
                "0": "144-167",
                "1": "0-23",
                "2": "168-191",
                "3": "24-47",
                "4": "96-119",
                "5": "48-71",
                "6": "120-143",
                "7": "72-95",
            },
        ),
        (
            PAIRED,
            {
                "0": "144-167",
                "1": "168-191",
                "2": "96-119",
                "3": "120-143",
                "4": "0-23",
                "5": "24-47",
                "6": "48-71",
                "7": "72-95",
            },
        ),
        (PCIE_4, {"0": "144-191", "1": "96-143", "2": "48-95", "3": "0-47"}),
    ],
)
def test_a2_whole_host_all_running(affinity: dict[str, str], expected: dict[str, str]) -> None:
    # Each pair sharing a node gets that node and the next one, split in id order.
    obj = a2("0-191", [int(k) for k in affinity], affinity, total_logic_npus=len(affinity), numa_cpus=NUMA_192)
    assert pools(obj) == expected


# ---- deviations from the reference (docs/planner-cpu-binding.md) --------------------------------------
def test_a7_3_wrap_around_keeps_irq_on_the_npus_node() -> None:
    obj = a2("0-191", [0], {"0": "168-191"}, total_logic_npus=1, numa_cpus=NUMA_192)
    assert run(obj).to_json()["npus"]["0"] == {
        "cpus": "0-23,168-191",  # as upstream
        "irq": "168-169",  # upstream: 0-1, on the node the extension wrapped to
        "main": "0-21,170-191",
        "acl": 22,
        "release": 23,
    }
    plan = to_binding_plan(run(obj), parse_request(obj), 42, plan_id="p")
    migration = next(a.page_migration for a in plan.actions if a.HasField("page_migration"))
    assert list(migration.to_nodes) == [0, 7]  # upstream: node 0 only (pool[0]'s)


def test_a7_3_wrap_around_shared_pool_gives_lowest_id_its_own_node() -> None:
    obj = a2("0-191", [0, 1], {"0": "168-191", "1": "168-191"}, total_logic_npus=2, numa_cpus=NUMA_192)
    assert pools(obj) == {"0": "168-191", "1": "0-23"}  # upstream: 0 → 0-23, 1 → 168-191


def test_a7_4_overlapping_pools_are_split() -> None:
    # NPU i on node i: upstream pools 0-47, 24-71, … overlap and NPU6/NPU7 share ACL 190, release 191.
    ring = {str(i): f"{24 * i}-{24 * i + 23}" for i in range(8)}
    decision = run(a2("0-191", list(range(8)), ring, total_logic_npus=8, numa_cpus=NUMA_192))
    assert {k: v["cpus"] for k, v in decision.to_json()["npus"].items()} == ring
    # Two chained pools (0-47, 24-71) share their union evenly.
    chained = a2("0-191", [0, 1], {"0": "0-23", "1": "24-47"}, total_logic_npus=2, numa_cpus=NUMA_192)
    assert pools(chained) == {"0": "0-35", "1": "36-71"}


def test_a7_4_single_process_of_a_ring_host_stays_off_the_others() -> None:
    ring = {str(i): f"{24 * i}-{24 * i + 23}" for i in range(8)}
    own = [run(a2("0-191", [i], ring, total_logic_npus=8, numa_cpus=NUMA_192)).pool(i) for i in range(8)]
    assert [format_cpulist(p.cpus) for p in own] == list(ring.values())


def test_a7_5_sparse_node_ids() -> None:
    # Nodes 0 and 2 (fixture): upstream extends node 0 to the absent node 1 (nothing) and fails (<5).
    assert pools(a2("0-7", [0], {"0": "0-3"}, total_logic_npus=1, numa_cpus=NUMA_0_2)) == {"0": "0-7"}
    high = run(a2("0-7", [0], {"0": "4-7"}, total_logic_npus=1, numa_cpus=NUMA_0_2)).to_json()["npus"]["0"]
    assert high == {"cpus": "0-7", "irq": "4-5", "main": "0-1,6-7", "acl": 2, "release": 3}


def test_a7_6_more_members_than_cpus() -> None:
    shared = {"0": "0-1", "1": "0-1", "2": "0-1"}
    assert error(a2("0-1", [2], shared)).message.startswith("NPU 2: its pool has 2 CPUs (0-1)")
    assert error(a2("0-1", [0], shared)).message.startswith("NPU 0: its pool has 0 CPUs (none)")


def test_a7_8_running_npu_without_topo_row() -> None:
    e = error(a2("0-191", [5], {str(i): "0-23" for i in range(4)}, total_logic_npus=8))
    assert e.code == "unsatisfiable" and e.message == "NPU 5: topo_affinity has no entry for it"


def test_affinity_cpu_on_no_node_is_a_topology_error() -> None:
    e = error(a2("0-199", [0], {"0": "192-199"}, numa_cpus=NUMA_192))
    assert e.code == "invalid_topology" and "CPU 192" in e.message


# ---- fill_from_topology --------------------------------------------------------------------------------
def a2_topology(processes: dict[int, str]) -> pb.MemoryTopology:
    topo = pb.MemoryTopology(allowed_cpus=range(192))
    for n in range(8):
        topo.numa_nodes.add(id=n, cpus=range(24 * n, 24 * n + 24), has_cpu=True, has_memory=True)
    topo.numa_nodes.add(id=8, has_memory=True)  # a CPU-less (CXL/HBM) node: no numa_cpus entry
    topo.accelerators.add(index=0, kind=pb.ACCELERATOR_KIND_GPU, model="A100", local_cpus=range(4))
    for i in (3, 0, 1, 2, 4, 5, 6, 7):  # out of order on purpose
        topo.accelerators.add(
            index=i,
            kind=pb.ACCELERATOR_KIND_NPU,
            model="Ascend 910B3",
            id=f"NPU{i}",
            local_cpus=parse_cpulist(INTERLEAVED[str(i)]),
            attributes={"processes": processes[i]} if i in processes else {},
        )
    return topo


def test_fill_from_topology_builds_the_request() -> None:
    filled = fill_from_topology({}, a2_topology({0: "124528", 5: "  "}))
    assert filled == {
        "allowed_cpus": "0-191",
        "numa_cpus": NUMA_192,
        "topo_affinity": INTERLEAVED,
        "running_npus": [0],
        "total_logic_npus": 8,
        "device_type": "A2",
    }
    # NPU0 shares 144-191 with the hidden NPU2, which is outside the cpuset's running set.
    assert pools(filled) == {"0": "144-167"}


def test_fill_from_topology_keeps_what_the_request_gives() -> None:
    obj = {"allowed_cpus": "144-191", "running_npus": [2], "device_type": "A3", "numa_cpus": None}
    filled = fill_from_topology(obj, a2_topology({0: "1"}))
    assert filled["allowed_cpus"] == "144-191" and filled["running_npus"] == [2] and filled["device_type"] == "A3"
    assert filled["numa_cpus"] == NUMA_192  # null counts as absent
    assert obj == {"allowed_cpus": "144-191", "running_npus": [2], "device_type": "A3", "numa_cpus": None}


def test_fill_from_topology_device_type() -> None:
    topo = pb.MemoryTopology(allowed_cpus=range(640))
    for i in range(16):
        topo.accelerators.add(index=i, kind=pb.ACCELERATOR_KIND_NPU, model="Ascend910", attributes={"processes": "7"})
    filled = fill_from_topology({}, topo)
    assert filled["device_type"] == "A3" and filled["running_npus"] == list(range(16))
    assert filled["total_logic_npus"] == 16 and "topo_affinity" not in filled and "numa_cpus" not in filled
    # Models that disagree decide nothing; the probe's series (A3 marker) wins over the model.
    topo.accelerators[1].model = "Ascend 910B3"
    assert "device_type" not in fill_from_topology({}, topo)
    topo.accelerators[1].attributes["series"] = "A3"
    assert fill_from_topology({}, topo)["device_type"] == "A3"
    # A series the reference has no type for is passed on as named (topo_affinity, like any unknown).
    for a in topo.accelerators:
        a.attributes["series"] = "910"
    assert fill_from_topology({}, topo)["device_type"] == "910"
    for a in topo.accelerators:
        a.attributes["series"] = "950"
    assert fill_from_topology({}, topo)["device_type"] == "A5"  # then refused by parse_request


def test_fill_from_topology_running_attribute() -> None:
    # The npu-smi probe marks every NPU running "true"/"false" and lists pids only for running ones.
    topo = pb.MemoryTopology(allowed_cpus=range(8))
    topo.accelerators.add(index=0, kind=pb.ACCELERATOR_KIND_NPU, attributes={"running": "false"})
    topo.accelerators.add(index=1, kind=pb.ACCELERATOR_KIND_NPU, attributes={"running": "true"})
    topo.accelerators.add(index=2, kind=pb.ACCELERATOR_KIND_NPU, attributes={"running": "true", "processes": "5,9"})
    assert fill_from_topology({}, topo)["running_npus"] == [1, 2]


def test_fill_from_topology_without_npus_or_object() -> None:
    topo = pb.MemoryTopology(allowed_cpus=[0, 1, 2])
    assert fill_from_topology({"device_type": "A2"}, topo) == {"device_type": "A2", "allowed_cpus": "0-2"}
    with pytest.raises(PlanError, match="request: expected a JSON object"):
        fill_from_topology(["x"], topo)


# ---- to_binding_plan (the upstream binding side-effect vectors as plan actions) -----------------------
def plan_of(obj: dict[str, Any], pid: int = 1000, **kw: Any) -> planpb.BindingPlan:
    req = parse_request(obj)
    return to_binding_plan(decide(req), req, pid, plan_id="plan-1", **kw)


def kinds(plan: planpb.BindingPlan) -> list[tuple[str, bool]]:
    return [(a.id, a.required) for a in plan.actions]


def test_s2_s4_threads_by_role_then_migration() -> None:
    # Upstream: main [2] for every other thread, acl [3], release [4]; migration once, for the main pid.
    numa = {"0": "0-4", "1": "5-9"}
    plan = plan_of(a3("0-4", [0], 1, numa_cpus=numa), irqs=NpuIrqs(sq=(123,), cq=(124,)))
    assert kinds(plan) == [
        ("npu0-main", True),
        ("npu0-acl", True),
        ("npu0-release", True),
        ("npu0-migrate", False),
        ("npu0-irq-sq-123", False),
        ("npu0-irq-cq-124", False),
    ]
    main, acl, rel = (a.thread_affinity for a in plan.actions[:3])
    assert (list(main.cpus), list(acl.cpus), list(rel.cpus)) == ([2], [3], [4])
    assert {main.pid, acl.pid, rel.pid, plan.actions[3].page_migration.pid} == {1000}
    assert (main.role, acl.role, rel.role) == ("main", "acl", "release")
    assert plan.policy == "cpu-binding" and plan.plan_id == "plan-1"


@pytest.mark.parametrize(
    ("comm", "role"),
    [
        ("python3", "main"),
        ("VLLMWorker_TP", "main"),
        ("acl_thread", "acl"),
        ("x_acl_thread_1", "acl"),
        ("release_thread", "release"),
        ("release_thre", "main"),
        ("", "main"),
    ],
)
def test_thread_patterns_partition_comm_names(comm: str, role: str) -> None:
    plan = plan_of(a3("0-4", [0], 1))
    matched = [
        a.thread_affinity.role for a in plan.actions[:3] if re.fullmatch(a.thread_affinity.threads.name_pattern, comm)
    ]
    assert matched == [role]


def test_custom_thread_roles() -> None:
    plan = plan_of(a3("0-4", [0], 1), thread_roles=ThreadRoles(acl="acl", release="rel"))
    patterns = [a.thread_affinity.threads.name_pattern for a in plan.actions[:3]]
    assert patterns[1:] == ["acl", "rel"]
    assert re.fullmatch(patterns[0], "acl_x") and not re.fullmatch(patterns[0], "acl")
    with pytest.raises(PlanError, match=r"thread_roles\.acl"):
        plan_of(a3("0-4", [0], 1), thread_roles=ThreadRoles(acl="("))


def test_s7_migration_to_the_pools_node() -> None:
    # Upstream: pool on node 1 of {0, 1} → `migratepages 1000 0,1 1` ≙ from [0] to [1].
    plan = plan_of(a3("8-12", [0], 1, numa_cpus={"0": "0-7", "1": "8-15"}))
    m = next(a for a in plan.actions if a.HasField("page_migration"))
    assert (list(m.page_migration.from_nodes), list(m.page_migration.to_nodes), m.required) == ([0], [1], False)


def test_a7_2_migration_follows_the_whole_pool() -> None:
    obj = a2("144-191", [2], INTERLEAVED, total_logic_npus=8, numa_cpus=NUMA_192)
    m = next(a.page_migration for a in plan_of(obj).actions if a.HasField("page_migration"))
    assert list(m.to_nodes) == [7] and list(m.from_nodes) == [0, 1, 2, 3, 4, 5, 6]
    # A global slice across node boundaries (NPU1 of 5 on 192 CPUs: 39-77) migrates to every node it is on.
    req = parse_request(a3("0-191", [1], 5, numa_cpus=NUMA_192))
    pool = decide(req).pool(1)
    assert format_cpulist(pool.cpus) == "39-77" and pool_nodes(pool, NUMA_192_INT) == (1, 2, 3)


def test_s6_no_node_for_the_pool_no_migration() -> None:
    # Upstream: the pool's CPUs are on no known node → nothing to migrate (the plan says why).
    plan = plan_of(a3("8-12", [0], 1, numa_cpus={"0": "0-3", "1": "4-7"}))
    assert not any(a.HasField("page_migration") for a in plan.actions) and "no page migration" in plan.description
    # No NUMA facts, or a single node: nothing to move either.
    assert not any(a.HasField("page_migration") for a in plan_of(a3("0-4", [0], 1)).actions)
    assert not any(a.HasField("page_migration") for a in plan_of(a3("0-4", [0], 1, numa_cpus={"0": "0-9"})).actions)


def test_s15_s18_irq_numbers_to_the_irq_cpus() -> None:
    # Upstream: msi 123/124, pool starting 8, 9 → 123 → CPU 8 (mask 00000100), 124 → CPU 9 (00000200).
    plan = plan_of(a3("8-12", [0], 1), irqs=NpuIrqs(sq=(123,), cq=(124,)))
    irqs = [
        (a.irq_affinity.irq, list(a.irq_affinity.cpus), a.required) for a in plan.actions if a.HasField("irq_affinity")
    ]
    assert irqs == [(123, [8], False), (124, [9], False)]


def test_s14_no_sq_irq_of_the_device_no_irq_action() -> None:
    plan = plan_of(a3("8-12", [0], 1), irqs=NpuIrqs())
    assert not any(a.HasField("irq_affinity") for a in plan.actions)


def test_irq_name_patterns_only_on_a_single_npu_host() -> None:
    plan = plan_of(a3("8-12", [0], 1))
    irqs = [
        (a.irq_affinity.name_pattern, list(a.irq_affinity.cpus), a.required)
        for a in plan.actions
        if a.HasField("irq_affinity")
    ]
    assert irqs == [("sq_send_trigger_irq", [8], False), ("cq_update_irq", [9], False)]
    assert re.search(irqs[0][0], "sq_send_trigger_irq") and not re.search(irqs[0][0], "cq_update_irq")
    # 16 NPUs share the names: a pattern would pin every chip's IRQs to this pool.
    plan = plan_of(example_a3_request(), npu=3)
    assert not any(a.HasField("irq_affinity") for a in plan.actions) and "no IRQ binding" in plan.description


def test_s11_which_npu_the_pid_gets() -> None:
    with pytest.raises(PlanError, match=r"NPU 4 is not a running NPU of this decision \(running: 0, 1\)"):
        plan_of(a3("0-19", [0, 1], 2), npu=4)
    with pytest.raises(PlanError, match=r"the decision covers NPUs 0, 1: say which NPU's pool pid 1000 gets"):
        plan_of(a3("0-19", [0, 1], 2))
    assert plan_of(a3("0-19", [0, 1], 2), npu=1).actions[0].thread_affinity.cpus == list(range(12, 18))


@pytest.mark.parametrize(("pid", "plan_id"), [(0, "p"), (-1, "p"), (True, "p"), ("12", "p"), (12, "")])
def test_bad_plan_arguments(pid: Any, plan_id: str) -> None:
    req = parse_request(a3("0-4", [0], 1))
    with pytest.raises(PlanError) as exc:
        to_binding_plan(decide(req), req, pid, plan_id=plan_id)
    assert exc.value.code == "invalid_request"


def test_a3_end_to_end_plan_round_trips() -> None:
    req = parse_request(example_a3_request())
    plan = to_binding_plan(decide(req), req, 4242, plan_id="a3-npu3", npu=3, topology_fingerprint="abc")
    again = json_format.Parse(json_format.MessageToJson(plan), planpb.BindingPlan())
    assert again == plan and plan.topology_fingerprint == "abc"
    assert list(plan.actions[0].thread_affinity.cpus) == list(range(122, 158))
    m = plan.actions[3].page_migration
    assert list(m.to_nodes) == [1] and list(m.from_nodes) == [0, 2, 3, 4, 5, 6, 7]
    assert plan.description.startswith("cpu-binding (global_slice): pid 4242 on NPU 3: main 122-157, acl 158")


# ---- properties ---------------------------------------------------------------------------------------
@st.composite
def global_requests(draw: st.DrawFn) -> dict[str, Any]:
    allowed = draw(st.sets(st.integers(0, 1023), max_size=300))
    total = draw(st.integers(1, 24))
    running = draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=total, unique=True))
    return a3(format_cpulist(allowed), running, total)


@given(global_requests())
def test_global_slice_pools_disjoint_inside_allowed(obj: dict[str, Any]) -> None:
    req = parse_request(obj)
    base, extra = divmod(len(req.allowed_cpus), req.total_npus)
    try:
        decision = decide(req)
    except PlanError as exc:
        assert req.allowed_cpus == () or base < 5, exc.message
        return
    assert base >= 5
    seen: set[int] = set()
    for p in decision.npus:
        assert set(p.cpus) <= set(req.allowed_cpus) and not seen & set(p.cpus)
        assert len(p.cpus) == base + (p.npu < extra)
        seen |= set(p.cpus)


@st.composite
def topo_requests(draw: st.DrawFn) -> dict[str, Any]:
    node_ids = draw(st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True))
    numa: dict[str, str] = {}
    cpu = 0
    for n in node_ids:
        size = draw(st.integers(2, 24))
        numa[str(n)] = format_cpulist(range(cpu, cpu + size))
        cpu += size

    def cpus() -> set[int]:
        # Mostly whole nodes and ranges, as real affinities and cpusets are; sometimes anything.
        whole = st.sampled_from(sorted(numa.values())).map(lambda s: set(parse_cpulist(s)))
        span = st.tuples(st.integers(0, cpu - 1), st.integers(1, cpu)).map(
            lambda t: set(range(t[0], min(cpu, t[0] + t[1])))
        )
        return draw(whole | span | st.sets(st.integers(0, cpu - 1), min_size=1))

    allowed = cpus() if draw(st.booleans()) else set(range(cpu))
    total = draw(st.integers(1, 8))
    affinity = {str(i): format_cpulist(cpus()) for i in draw(st.sets(st.integers(0, total - 1), min_size=1))}
    running = draw(st.lists(st.sampled_from(sorted(int(k) for k in affinity)), min_size=1, unique=True))
    obj = a2(format_cpulist(allowed), running, affinity, total_logic_npus=total)
    if draw(st.integers(0, 3)):
        obj["numa_cpus"] = numa
    return obj


def _roles_partition(decision: CpuBindingDecision, allowed: tuple[int, ...]) -> None:
    seen: set[int] = set()
    for npu, v in decision.to_json()["npus"].items():
        pool, irq, main = (parse_cpulist(v[k]) for k in ("cpus", "irq", "main"))
        parts = [set(irq), set(main), {v["acl"]}, {v["release"]}]
        assert len(irq) == 2 and main and set().union(*parts) == set(pool), npu
        assert sum(map(len, parts)) == len(pool), npu  # disjoint
        assert set(pool) <= set(allowed) and not seen & set(pool), npu
        seen |= set(pool)


@given(topo_requests() | global_requests())
@settings(max_examples=300)
def test_roles_partition_every_pool_and_pools_are_disjoint(obj: dict[str, Any]) -> None:
    req = parse_request(obj)
    try:
        decision = decide(req)
    except PlanError as exc:
        assert exc.code in ("unsatisfiable", "invalid_topology")
        return
    _roles_partition(decision, req.allowed_cpus)


@given(topo_requests())
def test_decision_is_deterministic_and_order_free(obj: dict[str, Any]) -> None:
    shuffled = dict(reversed(obj.items()))
    for field in ("topo_affinity", "numa_cpus"):
        if field in obj:
            shuffled[field] = dict(reversed(obj[field].items()))
    shuffled["running_npus"] = list(reversed(obj["running_npus"]))
    outcomes = []
    for o in (obj, obj, shuffled):
        try:
            outcomes.append(run(o).to_json())
        except PlanError as exc:
            outcomes.append(exc.to_json())
    assert outcomes[0] == outcomes[1] == outcomes[2]


@given(topo_requests(), st.data())
def test_independent_workers_sharing_a_cpuset_never_overlap(obj: dict[str, Any], data: st.DataObject) -> None:
    # Two single-NPU workers with the same cpuset and topology (upstream's two-process cases, generalised).
    ids = sorted(int(k) for k in obj["topo_affinity"])
    if len(ids) < 2:
        return
    a, b = data.draw(st.lists(st.sampled_from(ids), min_size=2, max_size=2, unique=True))
    try:
        pa = run(obj | {"running_npus": [a]}).pool(a)
        pb_ = run(obj | {"running_npus": [b]}).pool(b)
    except PlanError:
        return
    assert not set(pa.cpus) & set(pb_.cpus)


@given(topo_requests() | global_requests(), st.integers(1, 1 << 22), st.booleans())
@settings(max_examples=150)
def test_plans_are_valid(obj: dict[str, Any], pid: int, with_irqs: bool) -> None:
    req = parse_request(obj)
    try:
        decision = decide(req)
    except PlanError:
        return
    pool = decision.npus[-1]
    irqs = NpuIrqs(sq=(200,), cq=(201,)) if with_irqs else None
    plan = to_binding_plan(decision, req, pid, plan_id="p", npu=pool.npu, irqs=irqs)
    assert len({a.id for a in plan.actions}) == len(plan.actions)
    threads = [a for a in plan.actions if a.HasField("thread_affinity")]
    assert [a.thread_affinity.role for a in threads] == ["main", "acl", "release"] and all(a.required for a in threads)
    assert all(not a.required for a in plan.actions if not a.HasField("thread_affinity"))
    bound = [c for a in threads for c in a.thread_affinity.cpus]
    assert sorted(bound) == sorted(set(pool.cpus) - set(pool.irq)) and all(
        a.thread_affinity.pid == pid for a in threads
    )
    for a in plan.actions:
        if a.HasField("irq_affinity"):
            assert list(a.irq_affinity.cpus) in ([pool.irq[0]], [pool.irq[1]])
        if a.HasField("page_migration"):
            m = a.page_migration
            assert m.pid == pid and m.to_nodes and not set(m.to_nodes) & set(m.from_nodes)


def test_request_dataclass_is_frozen() -> None:
    req = parse_request(a3("0-4", [0], 1))
    assert isinstance(req, CpuBindingRequest)
    with pytest.raises(AttributeError):
        req.device_type = "A2"  # type: ignore[misc]
