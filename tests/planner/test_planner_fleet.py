"""Fleet placement (planner/fleet.py) over topologies discovered from fixture hosts: an Ascend 910
x8 node (the synthesized A2 host's tree with the real 910A x8 ``npu-smi info`` capture replayed),
the synthesized Kunlunxin P800 host, and variants of them (health, running processes, links down)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.planner import fleet, hccs, xpu
from memtopo.planner.errors import PlanError
from memtopo.v1 import topology_pb2 as pb
from tests.fleet_nodes import node, npu


def test_fixture_nodes_are_what_the_policies_expect() -> None:
    t910 = node("910", "a").topology
    assert t910 is not None
    assert sorted(a.index for a in t910.accelerators if a.kind == pb.ACCELERATOR_KIND_NPU) == list(range(8))
    assert {tuple(g.members) for g in t910.accelerator_groups if g.kind == "hccs-ring"} == {
        ("NPU0", "NPU1", "NPU2", "NPU3"), ("NPU4", "NPU5", "NPU6", "NPU7")}
    tp = node("p800", "b").topology
    assert tp is not None
    assert {tuple(g.members) for g in tp.accelerator_groups if g.kind == "numa-half"} == {
        ("XPU0", "XPU1", "XPU2", "XPU3"), ("XPU4", "XPU5", "XPU6", "XPU7")}


def test_hccs_derives_available_and_capacity_from_health_processes_and_allocations() -> None:
    def busy(topo: pb.MemoryTopology) -> None:
        npu(5, running="true", processes="4242")(topo)
        npu(6, health="Warning")(topo)  # a minor alarm: still schedulable

    nodes = [
        node("910", "free"),
        node("910", "busy", busy),
        node("910", "bad-chip", npu(7, health="Alarm")),
        node("p800", "xpu-host"),
        node("910", "gone", connected=False),
    ]
    doc = fleet.decide("hccs", {"request": 4, "allocated": {"busy": [0, 1, 2]}}, nodes)
    by_name = {n["name"]: n for n in doc["nodes"]}
    assert (by_name["free"]["available"], by_name["free"]["capacity"]) == (list(range(8)), 8)
    assert (by_name["busy"]["available"], by_name["busy"]["capacity"]) == ([3, 4, 6, 7], 8)
    assert (by_name["bad-chip"]["available"], by_name["bad-chip"]["capacity"]) == (list(range(7)), 7)
    assert set(by_name) == {"free", "busy", "bad-chip"}
    assert doc["skipped"] == [
        {"name": "gone", "reason": "not connected: its topology may be stale"},
        {"name": "xpu-host", "reason": "not an 8-NPU node (NPU ids none)"},
    ]
    # The same nodes written out by hand rank the same: the fleet adds derivation, not policy.
    by_hand = hccs.decide(hccs.parse_request({"request": 4, "nodes": [
        {"name": "free", "available": list(range(8))},
        {"name": "busy", "available": [3, 4, 6, 7], "capacity": 8},
        {"name": "bad-chip", "available": list(range(7)), "capacity": 7},
    ]})).to_json()
    assert {k: v for k, v in doc.items() if k != "skipped"} == by_hand
    # "busy" has 1 + 3 free NPUs in its rings: a 4-NPU pod needs one whole ring.
    assert by_name["busy"]["fits"] is False
    assert doc["chosen"] == ["free"]


def test_hccs_skips_reasons_name_what_is_missing() -> None:
    def no_rings(topo: pb.MemoryTopology) -> None:
        del topo.accelerator_groups[:]

    def seven(topo: pb.MemoryTopology) -> None:
        keep = [a for a in topo.accelerators if a.index != 7]
        del topo.accelerators[:]
        topo.accelerators.extend(keep)

    nodes = [node("910", "ok"), node("910", "ringless", no_rings), node("910", "seven", seven),
             node("910", "unknown-health", npu(2, health=""))]
    doc = fleet.decide("hccs", {"request": 1}, nodes)
    reasons = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert reasons == {
        "ringless": "no hccs-ring group NPU0–NPU3 in its topology",
        "seven": "not an 8-NPU node (NPU ids 0,1,2,3,4,5,6)",
        "unknown-health": "npu-smi gave no health for NPU2",
    }
    assert doc["chosen"] == ["ok"]


def test_xpu_uses_allocations_and_skips_non_p800_nodes() -> None:
    nodes = [node("p800", "x1"), node("p800", "x2"), node("910", "npu-host")]
    doc = fleet.decide("xpu", {"request": 2, "allocated": {"x2": [0, 1, 4]}}, nodes)
    by_hand = xpu.decide(xpu.parse_request({"request": 2, "nodes": [
        {"name": "x1", "used": []}, {"name": "x2", "used": [0, 1, 4]}]})).to_json()
    assert {k: v for k, v in doc.items() if k != "skipped"} == by_hand
    assert doc["chosen"] == "x2"  # MTF: filling the half-used half wins over breaking a free node
    assert doc["skipped"] == [{"name": "npu-host", "reason": "not an 8-XPU node (XPU ids none)"}]


def test_node_names_restricts_the_fleet() -> None:
    nodes = [node("p800", "x1"), node("p800", "x2")]
    doc = fleet.decide("xpu", {"request": 8, "node_names": ["x2"]}, nodes)
    assert [n["name"] for n in doc["nodes"]] == ["x2"] and doc["chosen"] == "x2"


def test_place_ranks_connected_nodes_and_reports_the_rest() -> None:
    nodes = [node("p800", "x1"), node("910", "n1"), node("910", "old", connected=False)]
    doc = fleet.decide("place", {"cpus": 4, "memory_gb": 1}, nodes)
    assert doc["policy"] == "place" and doc["chosen"] in ("x1", "n1")
    assert {n["node"] for n in doc["nodes"]} == {"x1", "n1"}
    assert doc["skipped"] == [{"name": "old", "reason": "not connected: its topology may be stale"}]
    with pytest.raises(PlanError) as too_big:
        fleet.decide("place", {"cpus": 100_000}, nodes)
    assert too_big.value.code == "unsatisfiable" and "x1: " in too_big.value.message


@pytest.mark.parametrize(("policy", "request_obj", "fragment"), [
    ("hccs", {"request": 3}, "request: 3"),
    ("xpu", {"request": 3}, "request: 3 XPUs is not allowed"),
    ("hccs", {"request": 1, "nodes": []}, "nodes: the fleet is the controller's nodes"),
    ("hccs", {"request": 1, "reqest": 2}, "reqest"),
    ("xpu", {"request": 1, "allocated": {"nobody": [1]}}, "allocated: 'nobody'"),
    ("xpu", {"request": 1, "allocated": {"x1": [8]}}, "allocated.x1: id 8 is outside 0–7"),
    ("xpu", {"request": 1, "node_names": ["x9"]}, "node_names: 'x9'"),
    ("xpu", {"request": 1, "node_names": ["x1", "x1"]}, "node_names: 'x1' appears twice"),
    ("place", {"cpus": 1, "allocated": {}}, "allocated: place takes no device allocations"),
    ("sort", {"request": 1}, "policy: 'sort' is not a fleet policy"),
    ("xpu", [1, 2], "request"),
])
def test_invalid_requests_are_refused_before_any_ranking(policy: str, request_obj: Any, fragment: str) -> None:
    with pytest.raises(PlanError) as err:
        fleet.decide(policy, request_obj, [node("p800", "x1")])
    assert err.value.code == "invalid_request" and fragment in err.value.message


def test_nodes_without_a_topology_are_skipped_and_json_errors_are_documents() -> None:
    nodes = [fleet.FleetNode("new", None), node("p800", "x1")]
    doc = fleet.decide_json("xpu", '{"request": 1}', nodes)
    assert doc["chosen"] == "x1" and doc["skipped"] == [{"name": "new", "reason": "no topology yet"}]
    assert fleet.decide_json("xpu", "{not json", nodes)["error"]["code"] == "invalid_request"
    assert fleet.decide_json("xpu", '{"request": 5}', nodes)["error"]["message"].startswith("request: 5 XPUs")


def test_an_empty_fleet_is_unsatisfiable_but_a_bad_size_still_invalid() -> None:
    with pytest.raises(PlanError) as err:
        fleet.decide("hccs", {"request": 2}, [node("p800", "x1")])
    assert err.value.code == "unsatisfiable" and "x1: not an 8-NPU node" in err.value.message
    with pytest.raises(PlanError) as none:
        fleet.decide("xpu", {"request": 2}, [])
    assert none.value.code == "unsatisfiable" and "the controller holds none" in none.value.message
    with pytest.raises(PlanError) as bad:
        fleet.decide("hccs", {"request": 12}, [])
    assert bad.value.code == "invalid_request"


_HEALTH = st.sampled_from(["OK", "Warning", "Alarm", "Critical"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_HEALTH, st.booleans(), st.booleans()), min_size=8, max_size=8),
       st.sampled_from([1, 2, 4, 8]))
def test_hccs_never_offers_an_unhealthy_busy_or_allocated_npu(states: list[tuple[str, bool, bool]],
                                                              size: int) -> None:
    def edit(topo: pb.MemoryTopology) -> None:
        for i, (health, running, _) in enumerate(states):
            npu(i, health=health, running="true" if running else "false")(topo)

    allocated = [i for i, (_, _, taken) in enumerate(states) if taken]
    free = {i for i, (health, running, taken) in enumerate(states)
            if health in ("OK", "Warning") and not running and not taken}
    try:
        doc = fleet.decide("hccs", {"request": size, "allocated": {"n": allocated}}, [node("910", "n", edit)])
    except PlanError as exc:
        assert exc.code == "unsatisfiable"
        return
    (entry,) = doc["nodes"]
    assert set(entry["available"]) == free
    assert entry["capacity"] == sum(h in ("OK", "Warning") for h, _, _ in states)
    assert set(entry["npus"]) <= free and len(entry["npus"]) == size
