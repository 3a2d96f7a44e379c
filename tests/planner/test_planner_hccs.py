"""Ascend 910 HCCS policy: the design's scenario table, the Volcano plugin's upstream test vectors and properties.

No Ascend hardware here: inputs are the node lists the device plugin publishes, in its real format
where a fixture exists (../shared/fixtures/ascend910).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.planner import hccs
from memtopo.planner.errors import PlanError
from memtopo.planner.examples_hccs_xpu import hccs_example_fleet
from tests.fixtures import SHARED
from tests.strategies import json_like
from tests.work import lines_run

ASCEND910 = SHARED / "fixtures" / "ascend910"


def node(name: str, available: list[int], capacity: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "available": available}
    if capacity is not None:
        out["capacity"] = capacity
    return out


def plan(request: int, *nodes: dict[str, Any]) -> hccs.Decision:
    return hccs.decide(hccs.parse_request({"request": request, "nodes": list(nodes)}))


def ids(left: int, right: int, *, last: bool = False) -> list[int]:
    """``left`` ids from ring 0–3 and ``right`` from ring 4–7 (the first ones, or the last ones)."""
    lo = [0, 1, 2, 3][4 - left :] if last else [0, 1, 2, 3][:left]
    hi = [4, 5, 6, 7][4 - right :] if last else [4, 5, 6, 7][:right]
    return lo + hi


# --- request validation ------------------------------------------------------------------------

INVALID_SIZES = [0, 3, 5, 6, 7, 9, 12, 20, -1, -8]


@pytest.mark.parametrize("n", INVALID_SIZES)
def test_illegal_request_sizes_name_the_allowed_sizes_and_why(n: int) -> None:
    with pytest.raises(PlanError) as err:
        hccs.parse_request({"request": n, "nodes": [node("a", list(range(8)))]})
    assert err.value.code == "invalid_request"
    assert err.value.message.startswith("request:")
    message = err.value.message
    assert "1, 2 or 4 NPUs (kept inside one ring)" in message and "8 (a whole node)" in message and "8·N" in message
    assert "HCCS rings (0–3, 4–7) cannot exchange gradients" in message


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 24, 64])
def test_legal_request_sizes(n: int) -> None:
    req = hccs.parse_request({"request": n, "nodes": [node("a", list(range(8)))]})
    assert req.request == n
    assert req.per_pod == min(n, 8)
    assert req.pods == max(1, n // 8)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (None, "request: expected a JSON object"),
        ({"nodes": []}, "request: required field is missing"),
        ({"request": True, "nodes": []}, "request: expected an integer"),
        ({"request": "4", "nodes": []}, "request: expected an integer"),
        ({"request": 4.0, "nodes": []}, "request: expected an integer"),
        ({"request": 4}, "nodes: required field is missing"),
        ({"request": 4, "nodes": {}}, "nodes: expected a list"),
        ({"request": 4, "nodes": []}, "nodes: at least one node"),
        ({"request": 4, "nodes": ["a"]}, "nodes[0].node: expected a JSON object"),
        ({"request": 4, "nodes": [{"available": [0]}]}, "nodes[0].name: required field is missing"),
        ({"request": 4, "nodes": [{"name": "", "available": [0]}]}, "nodes[0].name: must not be empty"),
        ({"request": 4, "nodes": [{"name": 7, "available": [0]}]}, "nodes[0].name: expected a string"),
        ({"request": 4, "nodes": [{"name": "a"}]}, "nodes[0].available: required field is missing"),
        ({"request": 4, "nodes": [node("a", [0]), node("b", [0, 8])]}, "nodes[1].available: NPU id 8 is outside 0–7"),
        ({"request": 4, "nodes": [node("a", [1, 0, 1])]}, "nodes[0].available: NPU 1 is listed twice"),
        ({"request": 4, "nodes": [node("a", [0, True])]}, "nodes[0].available[1]: expected a non-negative integer"),
        ({"request": 4, "nodes": [node("a", [-1])]}, "nodes[0].available[0]: expected a non-negative integer"),
        ({"request": 4, "nodes": [node("a", [0], 9)]}, "nodes[0].capacity: 9 is more than"),
        ({"request": 4, "nodes": [node("a", [0, 1, 2], 2)]}, "nodes[0].capacity: 2 healthy NPUs but 3"),
        ({"request": 4, "nodes": [node("a", [0], -1)]}, "nodes[0].capacity: must be ≥ 0"),
        ({"request": 4, "nodes": [node("a", [0]), node("a", [1])]}, "nodes[1].name: 'a' appears twice"),
        ({"request": 4, "nodes": [node("a", [0])], "pods": 1}, "request: unknown keys ['pods']"),
        (
            {"request": 4, "nodes": [{"name": "a", "available": [0], "capacty": 8}]},
            "nodes[0].node: unknown keys ['capacty']",
        ),
    ],
)
def test_invalid_requests(body: Any, fragment: str) -> None:
    with pytest.raises(PlanError) as err:
        hccs.parse_request(body)
    assert err.value.code == "invalid_request"
    assert fragment in err.value.message


def test_capacity_defaults_to_the_number_available() -> None:
    req = hccs.parse_request({"request": 1, "nodes": [node("a", [5, 1, 2])]})
    assert req.nodes == (hccs.Node("a", (5, 1, 2), 3),)


# --- the design's scenario table, with 3/3 schedulable for 2 NPUs ----------------------------

# "chosen ring − [counts the other ring may have]", transcribed from the design's table; the one
# change is 2-NPU group C = 3−[0, 1, 3]: the table prints 3−[0, 1], but every upstream version
# schedules 2 NPUs on a node with 3 free in each ring, and dropping it would strand that node.
DESIGN_TABLE: dict[int, dict[str, tuple[int, list[int]]]] = {
    1: {"A": (1, [0, 1, 2, 3, 4]), "B": (3, [0, 2, 3, 4]), "C": (2, [0, 2, 4]), "D": (4, [0, 4])},
    2: {"A": (2, [0, 1, 2, 3, 4]), "B": (4, [0, 1, 3, 4]), "C": (3, [0, 1, 3])},
    4: {"A": (4, [0, 1, 2, 3, 4])},
}


def table_group(request: int, left: int, right: int) -> str | None:
    if request == 8:
        return "A" if left == right == 4 else None
    found = {
        group
        for group, (ring, others) in DESIGN_TABLE[request].items()
        if (left == ring and right in others) or (right == ring and left in others)
    }
    assert len(found) <= 1, f"design table lists {left}/{right} twice"
    return found.pop() if found else None


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_groups_match_the_design_table_for_every_ring_count(size: int) -> None:
    for left in range(5):
        for right in range(5):
            assert hccs.group_of(size, left, right) == table_group(size, left, right), (left, right)


def test_two_npus_on_a_node_with_three_free_per_ring_is_group_c() -> None:
    decision = plan(2, node("n", [0, 1, 2, 4, 5, 6], 8))
    (result,) = decision.nodes
    assert result.fit.group == "C"
    assert result.npus == (0, 1)  # left ring first at the matching size


# --- upstream vectors: v2.0.3 model_test.go, insertNodeInPriGroup --------------------------------

GROUP_VECTORS = [
    (1, 1, 4, "A"),
    (1, 4, 3, "B"),
    (1, 2, 4, "C"),
    (1, 0, 4, "D"),
    (1, 0, 0, None),
    (2, 4, 2, "A"),
    (2, 4, 4, "B"),
    (2, 0, 3, "C"),
    (2, 1, 1, None),
    (4, 2, 4, "A"),
    (4, 2, 2, None),
    (8, 4, 4, "A"),
    (8, 1, 4, None),
]


@pytest.mark.parametrize(("size", "left", "right", "group"), GROUP_VECTORS)
def test_upstream_group_membership(size: int, left: int, right: int, group: str | None) -> None:
    assert hccs.group_of(size, left, right) == group
    # The same through a whole node: the group, and a reason instead when it does not fit.
    result = hccs.evaluate(size, hccs.Node("n", tuple(ids(left, right)), 8))
    assert result.fit.group == group
    assert (result.fit.reason is None) == (group is not None)


def test_upstream_group_membership_illegal_request_7() -> None:
    with pytest.raises(PlanError, match="a pod holds 1, 2, 4 or 8 NPUs, got 7"):
        hccs.group_of(7, 4, 4)


# --- upstream vectors: v2.0.3 frame_test / model_test -------------------------------------------


@pytest.mark.parametrize(
    ("size", "available", "fits"),
    [
        (1, [], False),
        (2, [0, 1], True),
        (4, [4, 5, 6], False),
        (8, list(range(8)), True),
        (4, [5, 2], False),  # CheckNodeNPUByTask, annotation Ascend910-5,Ascend910-2
        (4, [1, 0, 3, 2], True),  # CheckNodeNPUByTask, Ascend910-1,-0,-3,-2
    ],
)
def test_upstream_predicate(size: int, available: list[int], fits: bool) -> None:
    result = hccs.evaluate(size, hccs.Node("n", tuple(available), 8))
    assert result.fit.fits is fits


def test_upstream_predicate_requests_0_and_7_are_refused() -> None:
    # Upstream's predicate passes a 0-NPU (CPU) task and fails 7; both are rejected at validation here,
    # as upstream's job validation does ("job no use npu", "illegal req_npu num").
    for n in (0, 7):
        with pytest.raises(PlanError):
            hccs.parse_request({"request": n, "nodes": [node("n", list(range(8)))]})


def test_upstream_best_nodes_for_four() -> None:
    decision = plan(4, node("centos1", [5, 2, 0, 1, 3], 8), node("centos2", [5, 4, 6, 7, 0, 1], 8))
    by_name = {r.node.name: r for r in decision.nodes}
    assert by_name["centos1"].fit.group == "A"
    assert by_name["centos1"].npus == (2, 0, 1, 3)
    # Both are group A; centos1 has fewer NPUs left (binpack term), so it ranks first.
    assert decision.chosen == ("centos1",)


def test_upstream_v203_score_is_the_group_band() -> None:
    # v2.0.3 scores capacity·4 − g: {euler1: group 0, euler2: group 3}, allocatable 8 → {32, 29}.
    # The master formula refines it to 8·that + (8 − available), so the band is score // 8.
    decision = plan(1, node("euler1", [0], 8), node("euler2", list(range(8)), 8))
    scores = {r.node.name: r.fit.score for r in decision.nodes}
    assert scores == {"euler1": 8 * 32 + 7, "euler2": 8 * 29 + 0}
    assert {k: v // 8 for k, v in scores.items() if v is not None} == {"euler1": 32, "euler2": 29}


@pytest.mark.parametrize(
    ("size", "available", "expected"),
    [
        (8, [], ()),
        (4, [5, 2, 0, 1, 3], (2, 0, 1, 3)),
        (2, [5, 7], (5, 7)),
    ],
)
def test_upstream_select(size: int, available: list[int], expected: tuple[int, ...]) -> None:
    assert hccs.select_npus(size, available) == expected


def test_upstream_pod_annotation_keeps_the_selection_order() -> None:
    (result,) = plan(4, node("n", [5, 2, 0, 1, 3], 8)).nodes
    assert result.annotation == "Ascend910-2,Ascend910-0,Ascend910-1,Ascend910-3"
    assert result.to_json()["annotation"] == {"huawei.com/Ascend910": "Ascend910-2,Ascend910-0,Ascend910-1,Ascend910-3"}


# --- upstream vectors: master (2023) frame_test --------------------------------------------------


def test_upstream_master_score_best_npu_nodes() -> None:
    decision = plan(
        1,
        node("node1", [0], 8),
        node("node3", [0, 1, 2], 8),
        node("node11", [4, 5], 8),
        node("node12", [4, 5, 6, 7], 8),
    )
    assert {r.node.name: r.fit.score for r in decision.nodes} == {
        "node1": 263,
        "node3": 253,
        "node11": 246,
        "node12": 236,
    }
    assert [r.node.name for r in decision.nodes] == ["node1", "node3", "node11", "node12"]


@pytest.mark.parametrize(
    ("available", "pod", "remaining"),
    [
        ([0, 4, 5], (0,), (4, 5)),
        ([0, 1, 2, 4, 5], (0,), (1, 2, 4, 5)),
        ([0, 1, 4, 5, 6], (4,), (0, 1, 5, 6)),
        ([0, 1, 4, 5, 6, 7], (0,), (1, 4, 5, 6, 7)),
    ],
)
def test_upstream_master_use_annotation(available: list[int], pod: tuple[int, ...], remaining: tuple[int, ...]) -> None:
    (result,) = plan(1, node("n", available, 8)).nodes
    assert result.npus == pod
    assert result.annotation == ",".join(f"Ascend910-{i}" for i in pod)
    assert result.remaining == remaining


@pytest.mark.parametrize(("size", "ok"), [(1, True), (3, False), (2, True)])
def test_upstream_master_valid_npu_job(size: int, ok: bool) -> None:
    body = {"request": size, "nodes": [node("n", list(range(8)))]}
    if ok:
        assert hccs.parse_request(body).request == size
    else:
        with pytest.raises(PlanError, match="not allowed"):
            hccs.parse_request(body)


# --- r40 multi-node ranking vectors (the master score formula ranks all 54 like r40) -------------
# Transcribed from Ascend/ascend-for-volcano branch HuaWei-0.4.0, topology910_test.go,
# buildBatchNodeOrderFnTests: node "nK_L_R" = node nK with L free in ring 0–3 and R in ring 4–7;
# capacity n1–n3 8, n4 7, n5 6; the pod name's suffix is the node r40 gives weight 1 ("n0": none).
# Upstream draws the ids inside each ring at random; only the counts matter for the node choice.
R40_CAPACITY = {"n1": 8, "n2": 8, "n3": 8, "n4": 7, "n5": 6}
R40_VECTORS: list[tuple[int, str, list[str]]] = [
    (1, "n0", ["n1_0_0"]),
    (1, "n1", ["n1_0_1"]),
    (1, "n1", ["n1_4_4"]),
    (1, "n0", ["n1_0_0", "n2_0_0", "n3_0_0"]),
    (1, "n1", ["n1_1_0", "n2_1_1", "n3_1_2"]),
    (1, "n1", ["n1_1_1", "n2_0_0", "n3_1_2"]),
    (1, "n1", ["n1_1_2", "n2_1_3", "n3_1_4"]),
    (1, "n1", ["n1_1_2", "n2_0_2", "n3_1_4"]),
    (1, "n1", ["n1_1_4", "n2_0_2", "n3_0_3"]),
    (1, "n1", ["n1_3_0", "n2_3_2", "n3_3_3"]),
    (1, "n1", ["n1_3_2", "n2_2_0", "n3_3_3"]),
    (1, "n1", ["n1_3_3", "n2_2_0", "n3_2_2"]),
    (1, "n1", ["n1_3_3", "n2_3_4", "n4_1_3"]),
    (1, "n1", ["n1_3_2", "n2_3_4", "n4_3_3"]),
    (1, "n1", ["n1_2_0", "n2_2_2", "n3_0_0"]),
    (1, "n1", ["n1_2_2", "n2_2_4", "n3_0_0"]),
    (1, "n1", ["n1_4_0", "n2_4_4", "n4_1_0"]),
    (1, "n1", ["n1_4_4", "n4_1_2", "n5_1_0"]),
    (1, "n4", ["n1_0_0", "n4_1_2", "n5_1_0"]),
    (1, "n5", ["n1_0_0", "n4_0_0", "n5_4_0"]),
    (2, "n0", ["n1_0_0"]),
    (2, "n0", ["n1_0_1"]),
    (2, "n1", ["n1_0_2"]),
    (2, "n0", ["n1_0_0", "n2_0_1", "n3_1_1"]),
    (2, "n1", ["n1_2_0", "n2_2_1", "n3_2_2"]),
    (2, "n1", ["n1_2_1", "n2_0_0", "n3_2_2"]),
    (2, "n1", ["n1_4_0", "n2_4_1", "n3_4_3"]),
    (2, "n1", ["n1_2_0", "n2_4_1", "n3_4_3"]),
    (2, "n1", ["n1_4_1", "n2_0_0", "n3_4_3"]),
    (2, "n1", ["n1_2_1", "n2_0_0", "n3_4_3"]),
    (2, "n1", ["n1_4_3", "n2_0_0", "n3_3_3"]),
    (2, "n1", ["n1_2_1", "n2_4_0", "n3_2_2"]),
    (2, "n1", ["n1_2_0", "n2_4_0", "n3_4_0"]),
    (2, "n1", ["n1_2_3", "n2_4_0", "n3_1_3"]),
    (2, "n1", ["n1_3_0", "n2_3_1", "n4_2_0"]),
    (2, "n4", ["n1_1_0", "n4_3_1", "n5_2_0"]),
    (2, "n5", ["n1_0_0", "n4_1_1", "n5_3_3"]),
    (4, "n0", ["n1_0_0"]),
    (4, "n0", ["n1_0_2"]),
    (4, "n1", ["n1_0_4"]),
    (4, "n1", ["n1_2_4"]),
    (4, "n0", ["n1_2_0", "n2_2_2", "n3_3_2"]),
    (4, "n1", ["n1_4_0", "n2_4_1", "n3_4_2"]),
    (4, "n1", ["n1_4_1", "n2_3_1", "n3_4_2"]),
    (4, "n1", ["n1_4_2", "n2_4_4", "n3_4_3"]),
    (4, "n1", ["n1_4_1", "n2_4_2", "n4_4_0"]),
    (4, "n4", ["n1_3_1", "n2_3_2", "n4_4_2"]),
    (4, "n4", ["n1_0_0", "n4_4_1", "n5_4_0"]),
    (4, "n5", ["n1_0_0", "n4_3_2", "n5_4_2"]),
    (8, "n0", ["n1_0_0"]),
    (8, "n0", ["n1_4_3"]),
    (8, "n0", ["n1_4_3", "n2_4_2", "n3_4_1"]),
    (8, "n1", ["n1_4_4", "n2_4_3", "n3_4_2"]),
    (8, "n2", ["n2_4_4", "n4_4_3", "n5_4_1"]),
]


def test_r40_vector_count() -> None:
    assert len(R40_VECTORS) == 54


@pytest.mark.parametrize(("size", "winner", "pool"), R40_VECTORS)
@pytest.mark.parametrize("last", [False, True])
def test_r40_multi_node_ranking(size: int, winner: str, pool: list[str], last: bool) -> None:
    nodes = []
    for key in pool:
        name, left, right = key.split("_")
        nodes.append(node(name, ids(int(left), int(right), last=last), R40_CAPACITY[name]))
    decision = hccs.rank(hccs.parse_request({"request": size, "nodes": nodes}))
    assert decision.chosen == (() if winner == "n0" else (winner,))
    if winner == "n0":
        with pytest.raises(PlanError) as err:
            hccs.decide(hccs.parse_request({"request": size, "nodes": nodes}))
        assert err.value.code == "unsatisfiable"


# --- real formats (fixtures) --------------------------------------------------------------------


def _annotation_value(text: str, key: str) -> str:
    for line in text.splitlines():
        name, _, value = line.strip().partition(": ")
        if name == key:
            return value.strip()
    raise AssertionError(f"{key} not in fixture")


def test_whole_node_pod_gets_the_device_plugin_list_as_its_annotation() -> None:
    # The device plugin's ConfigMap (real format) lists the node's NPUs; an 8-NPU pod on it carries
    # the annotation MindCluster's documented 1×8 pod shows.
    cfg = json.loads((ASCEND910 / "mindx-dl-deviceinfo_DeviceInfoCfg.json").read_text())
    listed = cfg["DeviceInfo"]["DeviceList"]["huawei.com/Ascend910"]
    available = [int(token.removeprefix("Ascend910-")) for token in listed.split(",")]
    (result,) = plan(8, node("node-1", available)).nodes
    pod = (ASCEND910 / "kubectl_describe_pod_annotations_910x8.txt").read_text()
    assert result.annotation == _annotation_value(pod, "huawei.com/Ascend910")
    assert result.fit.group == "A" and result.fit.score == 8 * 32


# --- fleet behaviour ----------------------------------------------------------------------------


def test_eight_times_n_takes_n_whole_nodes_best_first() -> None:
    decision = plan(
        16,
        node("b", list(range(8)), 8),
        node("a", list(range(8)), 8),
        node("c", [7, 6, 5, 4, 3, 2, 1, 0], 8),
        node("d", list(range(7)), 8),
    )
    assert decision.pods == 2 and decision.per_pod == 8
    assert decision.chosen == ("a", "b")  # equal scores: by name
    assert [r.node.name for r in decision.nodes] == ["a", "b", "c", "d"]
    assert decision.nodes[2].npus == (7, 6, 5, 4, 3, 2, 1, 0)  # whole list, node order
    assert not decision.nodes[3].fit.fits
    assert "7/8 free" in (decision.nodes[3].fit.reason or "")


def test_eight_times_n_is_all_or_nothing() -> None:
    req = hccs.parse_request({"request": 24, "nodes": [node("a", list(range(8))), node("b", list(range(8)))]})
    assert hccs.rank(req).chosen == ()
    with pytest.raises(PlanError) as err:
        hccs.decide(req)
    assert err.value.code == "unsatisfiable"
    assert "3 pods of 8 need 3 nodes" in err.value.message and "2 have them" in err.value.message


def test_unsatisfiable_names_each_node_and_its_reason() -> None:
    with pytest.raises(PlanError) as err:
        plan(4, node("x", [0, 1, 4, 5, 6]), node("y", [], 8))
    assert err.value.code == "unsatisfiable"
    assert "x: no HCCS ring is entirely free (ring 0–3: 2 free, ring 4–7: 3 free)" in err.value.message
    assert "y: no HCCS ring is entirely free (ring 0–3: 0 free, ring 4–7: 0 free)" in err.value.message


def test_capacity_band_beats_group() -> None:
    # Full-priority rule: capacity 8 first (A→D), then capacity 7 (A→D): a D node of capacity 8 beats an A
    # node of capacity 7.
    decision = plan(1, node("worn", [3, 4, 5], 7), node("fresh", list(range(8)), 8))
    assert decision.chosen == ("fresh",)
    assert [r.fit.group for r in decision.nodes] == ["D", "A"]


def test_default_capacity_is_the_available_count() -> None:
    # Capacity defaults to the number available, so a partly used node without a
    # capacity field ranks in a lower band than a full one (callers who want binpack pass capacity).
    decision = plan(1, node("used", [0, 4, 5, 6, 7]), node("fresh", list(range(8))))
    assert decision.chosen == ("fresh",)
    decision = plan(1, node("used", [0, 4, 5, 6, 7], 8), node("fresh", list(range(8))))
    assert decision.chosen == ("used",)


def test_to_json_shape() -> None:
    out = plan(2, node("a", [4, 5, 0], 8), node("b", [0, 4], 8)).to_json()
    assert out == {
        "policy": "hccs",
        "request": 2,
        "pods": 1,
        "npus_per_pod": 2,
        "chosen": ["a"],
        "nodes": [
            {
                "name": "a",
                "capacity": 8,
                "available": [4, 5, 0],
                "fits": True,
                "group": "A",
                "score": 8 * 32 + 5,
                "npus": [4, 5],
                "annotation": {"huawei.com/Ascend910": "Ascend910-4,Ascend910-5"},
            },
            {
                "name": "b",
                "capacity": 8,
                "available": [0, 4],
                "fits": False,
                "reason": "no HCCS ring has 2 free NPUs (ring 0–3: 1 free, ring 4–7: 1 free); "
                "a 2-NPU pod must stay inside one ring",
            },
        ],
    }
    json.dumps(out)


def test_nodes_with_the_same_free_set_share_one_fit() -> None:
    decision = plan(2, node("a", [0, 1, 4], 8), node("b", [4, 1, 0], 8), node("c", [0, 1, 4], 7))
    fits = {r.node.name: r.fit for r in decision.nodes}
    assert fits["a"] is fits["b"]
    assert fits["a"].score is not None and fits["c"].score is not None
    assert fits["c"] is not fits["a"] and fits["c"].score == fits["a"].score - 32  # one capacity band


# --- properties ---------------------------------------------------------------------------------

requests = st.sampled_from([1, 2, 4, 8, 16])
availability = st.lists(st.integers(0, 7), unique=True, max_size=8)


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, Any]:
    lists = draw(st.lists(availability, min_size=1, max_size=12))
    nodes = []
    for k, available in enumerate(lists):
        capacity = draw(st.integers(len(available), 8))
        nodes.append(node(f"n{k}", available, capacity))
    return {"request": draw(requests), "nodes": nodes}


@given(fleets())
def test_npus_are_available_in_one_ring_and_as_many_as_asked(body: dict[str, Any]) -> None:
    decision = hccs.rank(hccs.parse_request(body))
    for result in decision.nodes:
        npus = result.npus
        if not result.fit.fits:
            assert npus == () and result.fit.reason and result.fit.score is None
            continue
        assert len(npus) == decision.per_pod == len(set(npus))
        assert set(npus) <= set(result.node.available)
        if decision.per_pod < 8:
            assert len({i // 4 for i in npus}) == 1  # one HCCS ring
        # order is the node's own order
        positions = [result.node.available.index(i) for i in npus]
        assert positions == sorted(positions)
        assert result.remaining == tuple(i for i in result.node.available if i not in npus)


@given(fleets(), st.randoms())
def test_ranking_does_not_depend_on_node_order(body: dict[str, Any], rnd: Any) -> None:
    shuffled = dict(body, nodes=list(body["nodes"]))
    rnd.shuffle(shuffled["nodes"])
    assert hccs.rank(hccs.parse_request(body)).to_json() == hccs.rank(hccs.parse_request(shuffled)).to_json()


@given(fleets())
def test_ranking_is_score_then_name_and_scores_follow_the_design_order(body: dict[str, Any]) -> None:
    decision = hccs.rank(hccs.parse_request(body))
    fitting = [r for r in decision.nodes if r.fit.fits]
    rejected = [r for r in decision.nodes if not r.fit.fits]
    assert decision.nodes == tuple(fitting + rejected)
    keys = [(-(r.fit.score or 0), r.node.name) for r in fitting]
    assert keys == sorted(keys)
    assert [r.node.name for r in rejected] == sorted(r.node.name for r in rejected)
    for a in fitting:
        for b in fitting:
            # Design order: higher capacity, then better group, then fewer NPUs left.
            order_a = (a.node.capacity, -"ABCD".index(a.fit.group or "A"), -len(a.node.available))
            order_b = (b.node.capacity, -"ABCD".index(b.fit.group or "A"), -len(b.node.available))
            if order_a > order_b:
                assert (a.fit.score or 0) > (b.fit.score or 0)
    if len(fitting) >= decision.pods:
        assert decision.chosen == tuple(r.node.name for r in fitting[: decision.pods])


JSON_KEYS = st.sampled_from(["request", "nodes", "name", "available", "capacity", "x"])
GARBAGE = json_like(
    st.none() | st.booleans() | st.integers(-3, 20) | st.text(max_size=4) | st.floats(allow_nan=False),
    JSON_KEYS, max_leaves=20,
)


@settings(max_examples=300)
@given(GARBAGE)
def test_garbage_requests_give_typed_errors(body: Any) -> None:
    try:
        req = hccs.parse_request(body)
    except PlanError as exc:
        assert exc.code == "invalid_request"
        return
    try:
        hccs.decide(req)
    except PlanError as exc:
        assert exc.code == "unsatisfiable"


# --- speed --------------------------------------------------------------------------------------


def test_example_fleet_is_deterministic_and_valid() -> None:
    assert hccs_example_fleet(200, 7) == hccs_example_fleet(200, 7)
    assert hccs_example_fleet(200, 7) != hccs_example_fleet(200, 8)
    req = hccs.parse_request(hccs_example_fleet(200, 7, request=4))
    assert len(req.nodes) == 200 and req.request == 4


def test_ranking_ten_thousand_nodes_is_not_quadratic() -> None:
    # The 50 ms target is bench/planner.py's job; here the work is counted (lines run), not timed, so
    # a busy machine cannot fail it: ten times the nodes is about ten times the lines, not a hundred.
    small = hccs.parse_request(hccs_example_fleet(1_000, 1, request=2))
    large = hccs.parse_request(hccs_example_fleet(10_000, 1, request=2))
    assert lines_run(lambda: hccs.rank(large)) < 15 * lines_run(lambda: hccs.rank(small))
