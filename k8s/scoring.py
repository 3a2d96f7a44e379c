"""scheduler-plugins' NodeResourceTopologyMatch scores: how well a pod fits a node's NUMA zones, 0–100.

Pure, as upstream computes them (``pkg/noderesourcetopology/score.go``, ``least_allocated.go``,
``most_allocated.go``, ``balanced_allocation.go``, ``least_numa.go``) over the zones' ``available``
amounts (less what the caller holds reserved), for the pod's requests:

- A pod that is not Guaranteed scores :data:`MAX_NODE_SCORE` on every node (it is not aligned).
- **LeastAllocated / MostAllocated / BalancedAllocation** score only nodes whose Topology Manager policy
  is ``single-numa-node`` (0 elsewhere). Each zone is scored on the requested resources (a resource the
  zone lacks scores 0): LeastAllocated ``(available - requested) * 100 / available``, MostAllocated
  ``requested * 100 / available``, both averaged with the resource weights (a weight below 1 or absent
  counts 1), integer division throughout on ``Value()`` (rounded up); BalancedAllocation
  ``(1 - variance) * 100`` of the requested/available fractions (0 when one exceeds 1; the sample
  variance, as gonum's ``stat.Variance``). The node's score is the lowest non-zero zone score (a zone
  scoring 0 cannot hold the pod and the kubelet will not use it). Pod scope scores the pod's effective
  request (max of the largest init container and the app containers' sum, plus the overhead); container
  scope averages the containers' scores (init containers included), truncated.
- **LeastNUMANodes** scores every policy: the fewest NUMA zones that hold the request
  (:func:`numa_nodes_required`; in container scope each container in turn, taking what it uses from
  those zones, the widest counts), ``100 - count * (100 / max NUMA nodes)``, plus half a step when no
  other combination of that many zones is closer by average distance (``costs``; 255 where a cost is
  missing). A request of resources no zone lists scores 100; one no combination holds scores 0.

Where this differs from upstream, deliberately: averages of distances are exact fractions (upstream uses
float32, which decides the same for combinations of equal size); LeastNUMANodes takes a container's share
from the zones with the chosen NUMA ids (upstream indexes its zone list by NUMA id, which is the same
zone only when the zones are ``node-0``… in order); a score below 0 (more zones needed than the max
NUMA nodes) is 0 rather than an error; BalancedAllocation over one resource is 100 (gonum's variance of
one value is NaN; a Guaranteed pod always requests CPU and memory, so upstream never meets it).

:func:`extender_score` maps a 0–100 score to kube-scheduler's extender scale, 0–10.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from fractions import Fraction
from itertools import combinations
from typing import Final

from memtopo.k8s.admission import GUARANTEED, ContainerRequest, PodRequest, Reserved
from memtopo.k8s.nrt_read import DEFAULT_MAX_NUMA_NODES, NodeTopology, Zone
from memtopo.k8s.quantity import ceil_int
from memtopo.k8s.resources import CPU, MEMORY, is_hugepages

MAX_NODE_SCORE: Final = 100
MIN_NODE_SCORE: Final = 0
# k8s.io/kube-scheduler/extender/v1: an extender scores 0..MaxExtenderPriority; kube-scheduler multiplies
# by MaxNodeScore / MaxExtenderPriority (10) and by the extender's weight.
MAX_EXTENDER_PRIORITY: Final = 10
# The ACPI SLIT's "unknown" distance, counted where a zone has no cost to another.
MAX_DISTANCE: Final = 255
DEFAULT_WEIGHT: Final = 1


class Strategy(StrEnum):
    """``NodeResourceTopologyMatchArgs.scoringStrategy.type``."""

    LEAST_ALLOCATED = "LeastAllocated"
    MOST_ALLOCATED = "MostAllocated"
    BALANCED_ALLOCATION = "BalancedAllocation"
    LEAST_NUMA_NODES = "LeastNUMANodes"


class _Cell:
    """A zone being scored: its NUMA id, what it has available (as scored), its distances."""

    __slots__ = ("amounts", "costs", "numa_id")

    def __init__(self, zone: Zone, reserved: Reserved | None) -> None:
        held = reserved.get(zone.numa_id, {}) if reserved else {}
        self.numa_id = zone.numa_id
        self.amounts: dict[str, Fraction] = {
            r.name: max(Fraction(r.available) - Fraction(held.get(r.name, 0)), Fraction(0)) for r in zone.resources}
        self.costs = dict(zip(zone.cost_ids, zone.cost_values, strict=True))


def _cells(zones: Iterable[Zone], reserved: Reserved | None) -> list[_Cell]:
    return [_Cell(z, reserved) for z in zones]


def _weight(weights: Mapping[str, int] | None, name: str) -> int:
    w = (weights or {}).get(name, DEFAULT_WEIGHT)
    return w if w >= 1 else DEFAULT_WEIGHT


def _least_allocated(requested: Fraction, available: Fraction) -> int:
    if available == 0 or requested > available:
        return 0
    return (ceil_int(available) - ceil_int(requested)) * MAX_NODE_SCORE // ceil_int(available)


def _most_allocated(requested: Fraction, available: Fraction) -> int:
    if available == 0 or requested > available:
        return 0
    return ceil_int(requested) * MAX_NODE_SCORE // ceil_int(available)


def _weighted(requested: Mapping[str, Fraction], amounts: Mapping[str, Fraction],
              weights: Mapping[str, int] | None, per_resource: Callable[[Fraction, Fraction], int]) -> int:
    total = weight_sum = 0
    for name, q in requested.items():
        w = _weight(weights, name)
        total += per_resource(q, amounts.get(name, Fraction(0))) * w
        weight_sum += w
    return total // weight_sum if weight_sum else 0


def _balanced(requested: Mapping[str, Fraction], amounts: Mapping[str, Fraction]) -> int:
    fractions: list[float] = []
    for name, q in requested.items():
        have = ceil_int(amounts.get(name, Fraction(0)))
        fraction = 1.0 if have == 0 else ceil_int(q) / have
        if fraction > 1:
            return 0
        fractions.append(fraction)
    if len(fractions) < 2:
        return MAX_NODE_SCORE
    # gonum's stat.Variance: the corrected two-pass sample variance.
    mean = sum(fractions) / len(fractions)
    ss = sum((f - mean) ** 2 for f in fractions)
    compensation = sum(f - mean for f in fractions)
    variance = (ss - compensation * compensation / len(fractions)) / (len(fractions) - 1)
    return int((1 - variance) * MAX_NODE_SCORE)


def _zone_score(strategy: Strategy, requested: Mapping[str, Fraction], amounts: Mapping[str, Fraction],
                weights: Mapping[str, int] | None) -> int:
    if strategy is Strategy.LEAST_ALLOCATED:
        return _weighted(requested, amounts, weights, _least_allocated)
    if strategy is Strategy.MOST_ALLOCATED:
        return _weighted(requested, amounts, weights, _most_allocated)
    return _balanced(requested, amounts)


def _score_for_each_zone(strategy: Strategy, requested: Mapping[str, Fraction], cells: Sequence[_Cell],
                         weights: Mapping[str, int] | None) -> int:
    """scoreForEachNUMANode: the lowest non-zero zone score, read in the zones' order."""
    lowest = 0
    for cell in cells:
        score = _zone_score(strategy, requested, cell.amounts, weights)
        if lowest == 0 or (score != 0 and score < lowest):
            lowest = score
    return lowest


def pod_effective_request(pod: PodRequest) -> dict[str, Fraction]:
    """scheduler-plugins' ``GetPodEffectiveRequest``: per resource, the larger of the largest init
    container's request and the app containers' sum, plus the pod overhead."""
    init: dict[str, Fraction] = {}
    for c in pod.init_containers:
        for name, q in c.requests.items():
            init[name] = max(init.get(name, Fraction(0)), q)
    total: dict[str, Fraction] = {}
    for c in pod.containers:
        for name, q in c.requests.items():
            total[name] = total.get(name, Fraction(0)) + q
    for name, q in init.items():
        total[name] = max(total.get(name, Fraction(0)), q)
    for name, q in pod.overhead.items():
        total[name] = total.get(name, Fraction(0)) + q
    return total


# ---- LeastNUMANodes ---------------------------------------------------------------------------------

def _numa_affine(name: str) -> bool:
    return name in (CPU, MEMORY) or is_hugepages(name)


def resource_set_suitable(qos: str, name: str, requested: Fraction, available: Fraction) -> bool:
    """``isResourceSetSuitable``: CPU, memory and huge pages of a pod that is not Guaranteed go anywhere."""
    if qos != GUARANTEED and _numa_affine(name):
        return True
    return available >= requested


def _avg_distance(cells: Sequence[_Cell], combination: Sequence[int]) -> Fraction:
    if not combination:
        return Fraction(MAX_DISTANCE)
    total = sum(cells[a].costs.get(cells[b].numa_id, MAX_DISTANCE) for a in combination for b in combination)
    return Fraction(total, len(combination) ** 2)


def min_avg_distance(zones: Sequence[Zone], combos: Iterable[Sequence[int]]) -> Fraction:
    """``minAvgDistanceInCombinations``: the smallest average distance among combinations of zone
    positions (indexes into ``zones``); 255 when there are none."""
    return _min_avg_distance(_cells(zones, None), combos)


def _min_avg_distance(cells: Sequence[_Cell], combos: Iterable[Sequence[int]]) -> Fraction:
    return min((_avg_distance(cells, c) for c in combos), default=Fraction(MAX_DISTANCE))


def _required(cells: Sequence[_Cell], requests: Mapping[str, Fraction],
              qos: str) -> tuple[tuple[int, ...] | None, bool]:
    for size in range(1, len(cells) + 1):
        combos = list(combinations(range(len(cells)), size))
        best_distance = _min_avg_distance(cells, combos)
        found: tuple[int, ...] | None = None
        found_distance = Fraction(MAX_DISTANCE + 1)
        for combo in combos:
            if any(name not in cells[i].amounts for i in combo for name in requests):
                continue
            fits = all(q == 0 or resource_set_suitable(qos, name, q, sum((cells[i].amounts[name] for i in combo),
                                                                          start=Fraction(0)))
                       for name, q in requests.items())
            if not fits:
                continue
            distance = _avg_distance(cells, combo)
            if distance == best_distance:
                return combo, True
            if distance < found_distance:
                found, found_distance = combo, distance
        if found is not None:
            return found, False
    return None, False


def numa_nodes_required(zones: Sequence[Zone], requests: Mapping[str, Fraction], qos: str,
                        reserved: Reserved | None = None) -> tuple[tuple[int, ...] | None, bool]:
    """``numaNodesRequired``: the NUMA ids of the fewest zones (the combination of least average
    distance among them, the first in the zones' order on a tie) that hold ``requests``, and whether no
    combination of that size is closer; (None, False) when none holds it."""
    cells = _cells(zones, reserved)
    combo, optimal = _required(cells, requests, qos)
    return (None, False) if combo is None else (tuple(sorted(cells[i].numa_id for i in combo)), optimal)


def normalize_score(count: int, optimal: bool, max_numa_nodes: int = DEFAULT_MAX_NUMA_NODES) -> int:
    """``normalizeScore``: fewer NUMA zones score higher; half a step more for the optimal distance."""
    step = MAX_NODE_SCORE // max_numa_nodes
    score = MAX_NODE_SCORE - count * step + (step // 2 if optimal else 0)
    return max(score, MIN_NODE_SCORE)


def _only_non_numa(cells: Sequence[_Cell], requests: Mapping[str, Fraction]) -> bool:
    return not any(name in cell.amounts for name in requests for cell in cells)


def _take(cells: Sequence[_Cell], requests: Mapping[str, Fraction], combo: Sequence[int]) -> None:
    """``subtractFromNUMAs``: each requested amount from the combination's zones in turn."""
    for name, q in requests.items():
        left = q
        for i in combo:
            if left == 0:
                break
            if name in cells[i].amounts:
                part = min(left, cells[i].amounts[name])
                cells[i].amounts[name] -= part
                left -= part


def _least_numa(node: NodeTopology, pod: PodRequest, cells: list[_Cell]) -> int:
    if node.scope == "pod":
        requests = pod_effective_request(pod)
        if _only_non_numa(cells, requests):
            return MAX_NODE_SCORE
        combo, optimal = _required(cells, requests, pod.qos)
        return MIN_NODE_SCORE if combo is None else normalize_score(len(combo), optimal, node.max_numa_nodes)
    widest, optimal_all = 0, True
    units: list[ContainerRequest] = [*pod.init_containers, *pod.containers]
    for c in units:
        if _only_non_numa(cells, c.requests):
            continue
        combo, optimal = _required(cells, c.requests, pod.qos)
        if combo is None:
            return MIN_NODE_SCORE
        optimal_all = optimal_all and optimal
        widest = max(widest, len(combo))
        _take(cells, c.requests, combo)
    return MAX_NODE_SCORE if widest == 0 else normalize_score(widest, optimal_all, node.max_numa_nodes)


def score(node: NodeTopology | None, pod: PodRequest, strategy: Strategy = Strategy.LEAST_ALLOCATED,
          weights: Mapping[str, int] | None = None, reserved: Reserved | None = None) -> int:
    """The plugin's ``Score`` of ``pod`` on ``node``, 0–100 (see the module's description); a node
    without a NodeResourceTopology object (None) scores 0 for a Guaranteed pod, below every node with one."""
    if pod.qos != GUARANTEED:
        return MAX_NODE_SCORE
    if node is None:
        return MIN_NODE_SCORE
    cells = _cells(node.alignable_zones(), reserved)
    if strategy is Strategy.LEAST_NUMA_NODES:
        return _least_numa(node, pod, cells)
    if node.policy != "single-numa-node":
        return MIN_NODE_SCORE
    if node.scope == "pod":
        return _score_for_each_zone(strategy, pod_effective_request(pod), cells, weights)
    units = [*pod.init_containers, *pod.containers]
    if not units:
        return MIN_NODE_SCORE
    scores = [_score_for_each_zone(strategy, c.requests, cells, weights) for c in units]
    return int(sum(scores) / len(scores))


def extender_score(node_score: int) -> int:
    """A 0–100 score on kube-scheduler's extender scale, 0–10, rounded half up: kube-scheduler multiplies
    it back by 10 (and the extender's weight), so the node's rank among the others stays within 5 points
    of the plugin's own."""
    clamped = min(max(node_score, MIN_NODE_SCORE), MAX_NODE_SCORE)
    return (clamped * MAX_EXTENDER_PRIORITY + MAX_NODE_SCORE // 2) // MAX_NODE_SCORE
