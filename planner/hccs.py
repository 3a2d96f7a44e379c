"""Ascend 910 HCCS affinity (the Volcano NPU plugin's policy): which node, and which NPUs on it, for a job.

An Atlas 800-9000 module has 8 NPUs on two HCCS rings, ids 0–3 and 4–7; NPUs on different rings
cannot exchange gradients, so a pod of 1, 2 or 4 NPUs must stay inside one ring and a pod of 8 takes
the whole node. Every node is classified into a priority group A–D by the free count of the ring the
pod would use and scored with the upstream master formula ``8·(capacity·4 − g) + (8 − available)``,
which is the design's "capacity 8 first, then A→D, then fullest node" ordering as one integer. Ties
on score are broken by node name, so the ranking never depends on the order the nodes were given in.

Pure functions; ``rank`` is the fleet entry point (the controller runs it over all its nodes) and
``decide`` is ``rank`` that refuses a request no node can take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from operator import itemgetter
from typing import Any, Literal, NamedTuple

from memtopo.planner.errors import PlanError, unsatisfiable
from memtopo.planner.request import (
    as_object,
    get_int,
    get_int_list,
    get_named_nodes,
    get_str,
    id_mask,
    reject_unknown,
)

Group = Literal["A", "B", "C", "D"]
GROUPS: tuple[Group, ...] = ("A", "B", "C", "D")

NODE_NPUS = 8
RING_NPUS = 4
ANNOTATION_KEY = "huawei.com/Ascend910"
_ID_PREFIX = "Ascend910-"

# Ring sizes in priority order for a pod of r NPUs: a node's group is the first size either ring
# matches exactly. Prefer the ring the pod leaves empty or even (1→0, 3→2, 4→2 …) so later pods still
# find whole pairs and whole rings. Index = g. Request 2 lists 3 after 4: a 3-free ring left with 1 is
# a worse fragment than a 4 left with 2. A 3/3 node lands in C and stays schedulable for 2 NPUs, as in
# every upstream version, although the design's scenario table prints group C as "3−[0,1]" only.
_PRIORITY: Mapping[int, tuple[int, ...]] = {1: (1, 3, 2, 4), 2: (2, 4, 3), 4: (4,)}

_RULE = (
    "NPUs on different HCCS rings (0–3, 4–7) cannot exchange gradients, so a job asks for 1, 2 or 4 "
    "NPUs (kept inside one ring), 8 (a whole node) or 8·N (N pods of 8 NPUs, one node each)"
)


def _request_error(n: int) -> PlanError:
    if n == 0:
        return PlanError("invalid_request", f"request: a job must ask for at least one NPU ({_RULE})")
    return PlanError("invalid_request", f"request: {n} NPUs is not allowed ({_RULE})")


def check_request(n: int) -> int:
    """``n`` when it is a legal job size, else PlanError naming the allowed sizes and why."""
    if n in _PRIORITY or (n > 0 and n % NODE_NPUS == 0):
        return n
    raise _request_error(n)


class Node(NamedTuple):
    """One node of the request. A NamedTuple, not a frozen dataclass: a fleet request builds 10,000
    of these per call and a NamedTuple is just as immutable at half the construction cost."""

    name: str
    available: tuple[int, ...]  # free healthy NPU ids, in the order the node lists them
    capacity: int  # healthy NPUs (allocatable); a bad chip lowers it and drops the node a band


@dataclass(frozen=True, slots=True)
class Request:
    request: int  # total NPUs of the job: 1, 2, 4, 8 or 8·N
    nodes: tuple[Node, ...]

    @property
    def per_pod(self) -> int:
        return min(self.request, NODE_NPUS)

    @property
    def pods(self) -> int:
        return max(1, self.request // NODE_NPUS)


@dataclass(frozen=True, slots=True)
class Fit:
    """How a node with a given free set and capacity takes one pod.

    Shared by every node with the same free set and capacity (the order of ids does not matter here;
    it only decides which ids ``NodeResult.npus`` returns).
    """

    left_free: int  # free NPUs in ring 0–3
    right_free: int  # free NPUs in ring 4–7
    group: Group | None  # None: the node cannot take the pod
    ring: int | None  # 0 or 1: the ring the NPUs come from; None for a whole-node pod or no fit
    score: int | None
    reason: str | None  # why the node does not fit; None when it does

    @property
    def fits(self) -> bool:
        return self.group is not None


def _npus(per_pod: int, fit: Fit, available: tuple[int, ...]) -> tuple[int, ...]:
    # The first per_pod ids of the chosen ring in the node's own order (upstream does not sort, and
    # the ids go into the pod annotation in this order); the left ring wins when both match a size.
    if fit.group is None:
        return ()
    if fit.ring is None:
        return available
    right = fit.ring == 1
    return tuple(i for i in available if (i >= RING_NPUS) == right)[:per_pod]


def _annotation(npus: tuple[int, ...]) -> str:
    return ",".join(f"{_ID_PREFIX}{i}" for i in npus)


@dataclass(frozen=True, slots=True)
class NodeResult:
    node: Node
    fit: Fit
    per_pod: int

    @property
    def npus(self) -> tuple[int, ...]:
        """NPUs one pod would get on this node; () when it does not fit."""
        return _npus(self.per_pod, self.fit, self.node.available)

    @property
    def annotation(self) -> str:
        """Value of the pod annotation ``huawei.com/Ascend910`` (same order as ``npus``)."""
        return _annotation(self.npus)

    @property
    def remaining(self) -> tuple[int, ...]:
        """The node's available list after the allocation (order kept, as upstream updates it)."""
        taken = set(self.npus)
        return tuple(i for i in self.node.available if i not in taken)

    def to_json(self) -> dict[str, Any]:
        return _node_json(self.per_pod, self.node, self.fit, {})


def _node_json(
    per_pod: int, node: Node, fit: Fit, memo: dict[tuple[tuple[int, ...], int | None], tuple[list[int], str]]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": node.name,
        "capacity": node.capacity,
        "available": list(node.available),
        "fits": fit.group is not None,
    }
    if fit.group is None:
        out["reason"] = fit.reason
        return out
    key = (node.available, fit.ring)
    picked = memo.get(key)
    if picked is None:
        npus = _npus(per_pod, fit, node.available)
        picked = memo[key] = (list(npus), _annotation(npus))
    out["group"] = fit.group
    out["score"] = fit.score
    out["npus"] = list(picked[0])
    out["annotation"] = {ANNOTATION_KEY: picked[1]}
    return out


@dataclass(frozen=True, slots=True)
class Decision:
    request: int
    pods: int
    per_pod: int
    chosen: tuple[str, ...]  # one node per pod, best first; empty when the job cannot be placed as a whole
    # Every node, chosen first, then the other fitting nodes by rank, then the rest by name; ``fits``
    # is parallel to it. Two flat tuples rather than per-node objects keep ranking a fleet
    # allocation-free; ``nodes`` builds the NodeResults when they are wanted.
    ranked: tuple[Node, ...]
    fits: tuple[Fit, ...]

    @property
    def nodes(self) -> tuple[NodeResult, ...]:
        return tuple(NodeResult(node, fit, self.per_pod) for node, fit in zip(self.ranked, self.fits, strict=True))

    def to_json(self) -> dict[str, Any]:
        memo: dict[tuple[tuple[int, ...], int | None], tuple[list[int], str]] = {}
        return {
            "policy": "hccs",
            "request": self.request,
            "pods": self.pods,
            "npus_per_pod": self.per_pod,
            "chosen": list(self.chosen),
            "nodes": [
                _node_json(self.per_pod, node, fit, memo) for node, fit in zip(self.ranked, self.fits, strict=True)
            ],
        }


def _check_pod(per_pod: int) -> None:
    if per_pod not in _PRIORITY and per_pod != NODE_NPUS:
        raise PlanError("invalid_request", f"a pod holds 1, 2, 4 or 8 NPUs, got {per_pod} ({_RULE})")


# --- classification -------------------------------------------------------------------------


def ring_group(per_pod: int, free: int) -> int | None:
    """The priority group index (0 = A) a ring with ``free`` NPUs falls into for a pod of ``per_pod``
    (1, 2 or 4) taken from that ring; None when the ring cannot hold it under the rule."""
    sizes = _PRIORITY.get(per_pod, ())
    return sizes.index(free) if free in sizes else None


def node_score(capacity: int, group: int, available: int) -> int:
    """The upstream master formula: capacity first, then the group (A best), then the fullest node.
    The +(8 − available) term is binpack inside a group; it is ≤ 7 so it never crosses a group
    boundary (8 points apart), and a capacity step is 32 points, so capacity 8 always wins first."""
    return 8 * (capacity * RING_NPUS - group) + (NODE_NPUS - available)


def _classify(per_pod: int, left: int, right: int) -> tuple[int, int | None] | None:
    """(group index, ring) for a pod of ``per_pod`` NPUs on a node with these free ring counts."""
    if per_pod == NODE_NPUS:
        return (0, None) if left + right == NODE_NPUS else None
    for g, size in enumerate(_PRIORITY[per_pod]):
        # Left ring first at each size: the upstream choice, kept so picks match its vectors.
        if left == size:
            return g, 0
        if right == size:
            return g, 1
    return None


def group_of(per_pod: int, left_free: int, right_free: int) -> Group | None:
    """Priority group (A–D) of a node for one pod, from the free count of each ring; None if it does not fit."""
    _check_pod(per_pod)
    found = _classify(per_pod, left_free, right_free)
    return None if found is None else GROUPS[found[0]]


def _reason(per_pod: int, left: int, right: int) -> str:
    rings = f"ring 0–3: {left} free, ring 4–7: {right} free"
    if per_pod == NODE_NPUS:
        return f"a pod of 8 NPUs takes the whole node; {left + right}/8 free ({rings})"
    if per_pod == 1:
        return "no free NPU"
    if per_pod == 2:
        return f"no HCCS ring has 2 free NPUs ({rings}); a 2-NPU pod must stay inside one ring"
    return f"no HCCS ring is entirely free ({rings}); a 4-NPU pod takes a whole ring"


@cache
def _fit(per_pod: int, mask: int, capacity: int) -> Fit:
    """Fit of one free set (bitmask, bit i = NPU i); cached so equal nodes share one object."""
    left = (mask & 0x0F).bit_count()
    right = (mask >> RING_NPUS).bit_count()
    found = _classify(per_pod, left, right)
    if found is None:
        return Fit(left, right, None, None, None, _reason(per_pod, left, right))
    g, ring = found
    score = node_score(capacity, g, left + right)
    return Fit(left, right, GROUPS[g], ring, score, None)


def _mask(available: Sequence[int]) -> int:
    mask = 0
    for i in available:
        mask |= 1 << i
    return mask


def evaluate(per_pod: int, node: Node) -> NodeResult:
    """One node's result for one pod of ``per_pod`` NPUs (1, 2, 4 or 8)."""
    _check_pod(per_pod)
    return NodeResult(node, _fit(per_pod, _mask(node.available), node.capacity), per_pod)


def select_npus(per_pod: int, available: Sequence[int]) -> tuple[int, ...]:
    """NPUs a pod of ``per_pod`` gets from this available list (the chosen ring's first ids, in list
    order); () when it does not fit."""
    ids = tuple(available)
    return evaluate(per_pod, Node("", ids, len(ids))).npus


# --- request ----------------------------------------------------------------------------------


def _checked_ids(node: Mapping[str, Any]) -> tuple[int, ...]:
    """The ``available`` list, or PlanError saying what is wrong with it."""
    available = get_int_list(node, "available")
    seen = 0
    for i in available:
        if i >= NODE_NPUS:
            raise PlanError(
                "invalid_request",
                f"available: NPU id {i} is outside 0–7 (an Ascend 910 module has two HCCS rings, 0–3 and 4–7)",
            )
        if seen >> i & 1:
            raise PlanError("invalid_request", f"available: NPU {i} is listed twice")
        seen |= 1 << i
    return available


def _checked_capacity(node: Mapping[str, Any], available: tuple[int, ...]) -> int:
    capacity = get_int(node, "capacity", len(available), minimum=0)
    if capacity > NODE_NPUS:
        raise PlanError("invalid_request", f"capacity: {capacity} is more than the module's 8 NPUs")
    if capacity < len(available):
        raise PlanError(
            "invalid_request", f"capacity: {capacity} healthy NPUs but {len(available)} listed as available"
        )
    return capacity


REQUEST_KEYS = frozenset({"request", "nodes"})
_NODE_KEYS = frozenset({"name", "available", "capacity"})


def _parse_node(obj: Any) -> Node:
    node = obj if type(obj) is dict else as_object(obj, "node")
    if not node.keys() <= _NODE_KEYS:  # a misspelt "capacity" would silently drop the node a band
        reject_unknown(node, _NODE_KEYS, "node")
    name = node.get("name")
    if type(name) is not str or not name:
        name = get_str(node, "name")
        if not name:
            raise PlanError("invalid_request", "name: must not be empty")
    raw: Any = node.get("available")
    # The fleet path: one pass over a well-formed list; anything odd goes to _checked_ids for the message.
    available: tuple[int, ...] = tuple(raw) if id_mask(raw, NODE_NPUS) >= 0 else _checked_ids(node)
    capacity = node.get("capacity", len(available))
    if type(capacity) is not int or not len(available) <= capacity <= NODE_NPUS:
        capacity = _checked_capacity(node, available)
    return Node(name, available, capacity)


def parse_request(obj: Any) -> Request:
    """``{"request": n, "nodes": [{"name", "available": [ids], "capacity"?}]}`` → Request."""
    body = as_object(obj)
    reject_unknown(body, REQUEST_KEYS, "request")
    n = check_request(get_int(body, "request"))
    return Request(n, get_named_nodes(body, _parse_node))


# --- ranking ----------------------------------------------------------------------------------


_NAME = itemgetter(0)


def rank(req: Request) -> Decision:
    """Every node's fit and score, best first; ``chosen`` holds one node per pod, or is empty.

    Order: score descending, then node name ascending (the final tie-break; names are unique, so the
    result is the same for any order of ``req.nodes``). Non-fitting nodes follow, by name.
    """
    per_pod = req.per_pod
    nodes = req.nodes
    # Nodes with the same list share one mask; nodes with the same free set and capacity share one
    # Fit (a list slot, no key object per node: a 10,000-node fleet would otherwise feed the cyclic
    # GC tens of thousands of tuples).
    masks: dict[tuple[int, ...], int] = {}
    by_capacity: list[list[Fit | None]] = [[None] * (1 << NODE_NPUS) for _ in range(NODE_NPUS + 1)]
    fits: list[Fit] = []
    fitting: list[int] = []
    rejected: list[int] = []
    for index, node in enumerate(nodes):
        mask = masks.get(node.available)
        if mask is None:
            mask = masks[node.available] = _mask(node.available)
        row = by_capacity[node.capacity]
        fit = row[mask]
        if fit is None:
            fit = row[mask] = _fit(per_pod, mask, node.capacity)
        fits.append(fit)
        (rejected if fit.score is None else fitting).append(index)
    names = list(map(_NAME, nodes))
    neg_scores = [-(fit.score or 0) for fit in fits]
    # Two stable single-key sorts (name, then score) give the (score desc, name) order.
    fitting.sort(key=names.__getitem__)
    fitting.sort(key=neg_scores.__getitem__)
    rejected.sort(key=names.__getitem__)
    # A distributed job is a gang: placing some of its pods is no placement at all.
    chosen = tuple(names[i] for i in fitting[: req.pods]) if len(fitting) >= req.pods else ()
    order = fitting + rejected
    return Decision(
        req.request,
        req.pods,
        per_pod,
        chosen,
        tuple(map(nodes.__getitem__, order)),
        tuple(map(fits.__getitem__, order)),
    )


def _unsatisfiable(decision: Decision) -> PlanError:
    fitting = [fit for fit in decision.fits if fit.fits]
    rejected = [(node, fit) for node, fit in zip(decision.ranked, decision.fits, strict=True) if not fit.fits]
    if decision.pods > 1:
        head = (
            f"{decision.request} NPUs = {decision.pods} pods of 8 need {decision.pods} nodes with all 8 NPUs "
            f"free; {len(fitting)} have them"
        )
    else:
        head = f"no node can take {decision.request} NPUs"
    return unsatisfiable(head, (f"{node.name}: {fit.reason}" for node, fit in rejected), len(rejected))


def decide(req: Request) -> Decision:
    """``rank`` for one job; PlanError("unsatisfiable") naming each node's reason when it cannot be placed."""
    return decide_ranked(rank(req))


def decide_ranked(decision: Decision) -> Decision:
    """``decision`` when it places the job, else the PlanError ``decide`` raises."""
    if not decision.chosen:
        raise _unsatisfiable(decision)
    return decision
