"""k8s/scoring.py: scheduler-plugins' NodeResourceTopologyMatch scores, ported table by table.

Every case of ``score_test.go`` (``TestNodeResourceScorePlugin``, ``TestNodeResourceScorePluginLeastNUMA``,
``TestNodeResourcePartialDataScorePlugin``) and ``least_numa_test.go`` (``TestNUMANodesRequired``,
``TestNormalizeScore``, ``TestMinDistance``) is a row named as upstream names it, asserting upstream's
numbers through memtopo's functions; then memtopo's own cases (weights, reservations, the extender scale)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import pytest

from memtopo.k8s.admission import GUARANTEED, parse_pod
from memtopo.k8s.nrt_read import NodeTopology, Zone, ZoneResource, read_nrt
from memtopo.k8s.quantity import parse
from memtopo.k8s.scoring import (
    Strategy,
    extender_score,
    min_avg_distance,
    normalize_score,
    numa_nodes_required,
    score,
)
from tests.nrt_upstream import CPU, GPU, MEMORY, nrt, pod_by_resource_list, pod_by_resource_lists, res_info, zone
from tests.nrt_upstream_cases import (
    PARTIAL_DATA,
    POD1,
    SCORE_PLUGIN,
    SCORE_PLUGIN_LEAST_NUMA,
    default_numa_nodes,
    four_numa_nodes,
)

# ---- score_test.go -----------------------------------------------------------------------------------








def _scores(nodes: Mapping[str, dict[str, Any] | None], pod: dict[str, Any], strategy: Strategy) -> dict[str, int]:
    request = parse_pod(pod)
    return {name: score(None if obj is None else read_nrt(obj), request, strategy) for name, obj in nodes.items()}


def find_max_score_node(scores: Mapping[str, int]) -> str:
    """``findMaxScoreNode`` (its map order aside: every table here has one highest score)."""
    best = max(scores.values())
    (name,) = [n for n, s in scores.items() if s == best]
    return name




@pytest.mark.parametrize(("name", "strategy", "wanted"), SCORE_PLUGIN)
def test_node_resource_score_plugin(name: str, strategy: Strategy, wanted: tuple[str, int]) -> None:
    scores = _scores(default_numa_nodes("SingleNUMANodeContainerLevel"), POD1, strategy)
    node = find_max_score_node(scores)
    assert (node, scores[node]) == wanted








@pytest.mark.parametrize(("name", "requests", "wanted", "nodes"), SCORE_PLUGIN_LEAST_NUMA)
def test_node_resource_score_plugin_least_numa(name: str, requests: list[dict[str, str]], wanted: dict[str, int],
                                               nodes: str) -> None:
    objects = four_numa_nodes() if nodes == "four" else default_numa_nodes(nodes)
    assert _scores(objects, pod_by_resource_lists(*requests), Strategy.LEAST_NUMA_NODES) == wanted






@pytest.mark.parametrize(("name", "strategy", "keep", "wanted"), PARTIAL_DATA)
def test_node_resource_partial_data_score_plugin(
        name: str, strategy: Strategy, keep: Callable[[str, dict[str, Any]], dict[str, Any] | None],
        wanted: tuple[str, int] | None) -> None:
    nodes = {n: keep(n, obj) for n, obj in default_numa_nodes("SingleNUMANodeContainerLevel").items()}
    scores = _scores(nodes, POD1, strategy)
    if wanted is None:
        assert set(scores.values()) == {0}
    else:
        node = find_max_score_node(scores)
        assert (node, scores[node]) == wanted and sorted(scores.values()) == [0, 0, wanted[1]]


# ---- least_numa_test.go ------------------------------------------------------------------------------------

def numa(numa_id: int, resources: Mapping[str, str], costs: Mapping[int, int] | None = None) -> Zone:
    """A ``NUMANode`` of upstream's tables: its resources are what is available."""
    res = tuple(ZoneResource(n, *(int(parse(q)),) * 3) for n, q in resources.items())
    costs = costs or {}
    return Zone(numa_id, f"node-{numa_id}", res, tuple(costs), tuple(costs.values()))


def _full(cost_rows: Sequence[Mapping[int, int]], ids: Sequence[int], gpus: Sequence[str],
          memoryless: Sequence[int] = ()) -> list[Zone]:
    return [numa(i, {GPU: g, CPU: "4", **({} if i in memoryless else {MEMORY: "5Gi"})}, c)
            for i, g, c in zip(ids, gpus, cost_rows, strict=True)]


FOUR = [{0: 10, 1: 12, 2: 20, 3: 20}, {0: 12, 1: 10, 2: 20, 3: 20}, {0: 20, 1: 20, 2: 10, 3: 12},
        {0: 20, 1: 20, 2: 10, 3: 12}]
# "4 NUMA node non optimal distance" gives node 3 the row 20, 20, 12, 10.
FOUR_B = [*FOUR[:3], {0: 20, 1: 20, 2: 12, 3: 10}]
EIGHT = {0: {0: 10, 1: 20, 2: 40, 3: 30, 4: 20, 5: 30, 6: 50, 7: 40},
         3: {0: 30, 1: 40, 2: 20, 3: 10, 4: 30, 5: 20, 6: 40, 7: 50},
         5: {0: 30, 1: 20, 2: 50, 3: 20, 4: 50, 5: 10, 6: 50, 7: 40},
         7: {0: 40, 1: 50, 2: 30, 3: 50, 4: 20, 5: 40, 6: 30, 7: 10},
         1: {0: 20, 1: 10, 2: 30, 3: 40, 4: 50, 5: 20, 6: 40, 7: 50},
         6: {0: 50, 1: 40, 2: 20, 3: 40, 4: 30, 5: 50, 6: 10, 7: 30},
         2: {0: 40, 1: 30, 2: 10, 3: 20, 4: 40, 5: 50, 6: 20, 7: 30},
         4: {0: 20, 1: 50, 2: 40, 3: 30, 4: 10, 5: 50, 6: 30, 7: 20}}
SPARSE = [{0: 10, 2: 12, 4: 20, 6: 20}, {0: 12, 2: 10, 4: 20, 6: 20}, {0: 20, 2: 20, 4: 10, 6: 12},
          {0: 20, 2: 20, 4: 12, 6: 10}]
POD_GPU2 = {CPU: "2", MEMORY: "2Gi", GPU: "2"}


NUMA_NODES_REQUIRED = [
    ("simple case, fit on 1 NUMA node", [numa(0, {CPU: "8", MEMORY: "10Gi"})], {CPU: "2", MEMORY: "2Gi"}, (0,),
     True),
    ("simple case, fit on 2 NUMA node", [numa(0, {CPU: "8", MEMORY: "10Gi"}), numa(1, {CPU: "8", MEMORY: "10Gi"})],
     {CPU: "12", MEMORY: "2Gi"}, (0, 1), True),
    ("can't fit", [numa(0, {CPU: "8", MEMORY: "10Gi"}), numa(1, {CPU: "8", MEMORY: "10Gi"})],
     {CPU: "22", MEMORY: "2Gi"}, None, False),
    ("4 NUMA node optimal distance", _full(FOUR, [0, 1, 2, 3], "1100"), POD_GPU2, (0, 1), True),
    ("4 NUMA node non optimal distance", _full(FOUR_B, [0, 1, 2, 3], "1010"), POD_GPU2, (0, 2), False),
    ("8 NUMA node optimal distance, not sorted ids", _full([EIGHT[i] for i in (0, 3, 5, 7, 1, 6, 2, 4)],
                                                           [0, 3, 5, 7, 1, 6, 2, 4], "1" * 8),
     {CPU: "3", MEMORY: "2Gi", GPU: "3"}, (0, 1, 5), True),
    ("8 NUMA node non optimal distance, not sorted ids, odd digit NUMA node without memory",
     _full([EIGHT[i] for i in (0, 3, 5, 7, 1, 6, 2, 4)], [0, 3, 5, 7, 1, 6, 2, 4], "1" * 8, memoryless=(3, 5, 7, 1)),
     {CPU: "3", MEMORY: "2Gi", GPU: "3"}, (2, 4, 6), False),
    ("4 NUMA node optimal distance, non sequential ids", _full(SPARSE, [0, 2, 4, 6], "1100"), POD_GPU2, (0, 2), True),
    ("4 NUMA node non optimal distance, non sequential ids", _full(SPARSE, [0, 2, 4, 6], "1001"), POD_GPU2, (0, 6),
     False),
    ("4 NUMA node non optimal distance, non sequential ids, NUMA node-2 and node-6 without memory",
     _full(SPARSE, [0, 2, 4, 6], "1111", memoryless=(2, 6)), POD_GPU2, (0, 4), False),
]


@pytest.mark.parametrize(("description", "zones", "pod", "bits", "optimal"), NUMA_NODES_REQUIRED)
def test_numa_nodes_required(description: str, zones: list[Zone], pod: dict[str, str], bits: tuple[int, ...] | None,
                             optimal: bool) -> None:
    requests = {n: parse(q) for n, q in pod.items()}
    assert numa_nodes_required(zones, requests, GUARANTEED) == (bits, optimal)


NORMALIZE_SCORE = [
    ("1 numa node, non optimal distance", 1, 88, False),
    ("2 numa nodes, non optimal distance", 2, 76, False),
    ("8 numa nodes, non optimal distance", 8, 4, False),
    ("1 numa node, optimal distance", 1, 94, True),
    ("2 numa nodes, optimal distance", 2, 82, True),
    ("8 numa nodes, optimal distance", 8, 10, True),
]


@pytest.mark.parametrize(("description", "count", "expected", "optimal"), NORMALIZE_SCORE)
def test_normalize_score(description: str, count: int, expected: int, optimal: bool) -> None:
    assert normalize_score(count, optimal) == expected


NUMA_NODES = [numa(i, {}, c) for i, c in enumerate(FOUR_B)]
NUMA_NODES_NO_COSTS = [numa(i, {}) for i in range(4)]
PAIRS = [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]


MIN_DISTANCE = [
    ("single numa node combination", [[0], [1], [2], [3]], NUMA_NODES, 10.0),
    ("two numa node combination", PAIRS, NUMA_NODES, 11.0),
    ("three numa node combination", [[0, 1, 2], [1, 2, 3], [0, 2, 3]], NUMA_NODES, 14.888889),
    ("two numa node combination, no costs", PAIRS, NUMA_NODES_NO_COSTS, 255.0),
]


@pytest.mark.parametrize(("description", "combos", "zones", "expected"), MIN_DISTANCE)
def test_min_distance(description: str, combos: list[list[int]], zones: list[Zone], expected: float) -> None:
    # Upstream compares float32 averages; memtopo's are exact (134/9 for the three-node case).
    assert float(min_avg_distance(zones, combos)) == pytest.approx(expected, abs=1e-5)


def test_the_port_counts_every_upstream_case() -> None:
    counted = [len(t) for t in (SCORE_PLUGIN, SCORE_PLUGIN_LEAST_NUMA, PARTIAL_DATA, NUMA_NODES_REQUIRED,
                                   NORMALIZE_SCORE, MIN_DISTANCE)]
    assert counted == [3, 14, 6, 10, 6, 4]


# ---- memtopo's own -------------------------------------------------------------------------------------

def _node(policy: str = "SingleNUMANodePodLevel") -> NodeTopology:
    return read_nrt(nrt("n", [zone("node-0", res_info(CPU, "8", "8"), res_info(MEMORY, "16Gi", "4Gi")),
                              zone("node-1", res_info(CPU, "8", "2"), res_info(MEMORY, "16Gi", "16Gi"))], policy))


POD = parse_pod(pod_by_resource_list({CPU: "2", MEMORY: "2Gi"}))


def test_hand_computed_scores_per_strategy() -> None:
    # node-0: cpu (8-2)/8 → 75, memory (4-2)/4 → 50: 62; node-1: cpu 0, memory 87: 43 → the lowest non-zero.
    assert score(_node(), POD, Strategy.LEAST_ALLOCATED) == 43
    # node-0: 25 and 50 → 37; node-1: 100 and 12 → 56.
    assert score(_node(), POD, Strategy.MOST_ALLOCATED) == 37
    # node-0: fractions 0.25, 0.5 → sample variance 0.03125 → 96; node-1: 1.0, 0.125 → 61.
    assert score(_node(), POD, Strategy.BALANCED_ALLOCATION) == 61


def test_weights_shift_the_average() -> None:
    # node-0: (75*3 + 50) / 4 = 68; node-1: (0*3 + 87) / 4 = 21.
    assert score(_node(), POD, Strategy.LEAST_ALLOCATED, {CPU: 3}) == 21
    assert score(_node(), POD, Strategy.LEAST_ALLOCATED, {CPU: 0, MEMORY: -5}) == 43  # below 1 counts 1


def test_only_single_numa_node_is_scored_by_allocation_and_burstable_pods_score_max() -> None:
    assert score(_node("BestEffortPodLevel"), POD, Strategy.LEAST_ALLOCATED) == 0
    # Without costs every combination is 255 apart, so the first that fits is also the closest.
    assert score(_node("BestEffortPodLevel"), POD, Strategy.LEAST_NUMA_NODES) == 94
    burstable = parse_pod({"spec": {"containers": [{"resources": {"requests": {CPU: "2"}}}]}})
    assert score(_node(), burstable, Strategy.LEAST_ALLOCATED) == 100


def test_reservations_lower_what_is_scored() -> None:
    # With node-0's CPUs all reserved its CPU scores 0, and the zone's average (0 + 50) / 2 = 25 is the
    # lowest: upstream averages per zone, so a zone short of one resource still scores.
    assert score(_node(), POD, Strategy.MOST_ALLOCATED, reserved={0: {CPU: Fraction(8)}}) == 25
    assert score(_node(), POD, Strategy.MOST_ALLOCATED, reserved={1: {MEMORY: 14 << 30}}) == 37


def test_balanced_allocation_rejects_a_zone_the_request_exceeds() -> None:
    pod = parse_pod(pod_by_resource_list({CPU: "3", MEMORY: "2Gi"}))
    # node-1 has 2 CPUs: 3/2 > 1 scores 0; node-0: 0.375, 0.5 → 99.
    assert score(_node(), pod, Strategy.BALANCED_ALLOCATION) == 99


@pytest.mark.parametrize(("plugin", "extender"), [(0, 0), (4, 0), (5, 1), (14, 1), (15, 2), (73, 7), (94, 9),
                                                  (95, 10), (100, 10), (-3, 0), (250, 10)])
def test_extender_scale(plugin: int, extender: int) -> None:
    assert extender_score(plugin) == extender
