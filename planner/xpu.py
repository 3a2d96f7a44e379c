"""Kunlunxin P800 topology-aware allocation (HAMi's kunlun policy): devices, MTF and score per node.

A P800 node has 8 XPUs in two NUMA halves, 0–3 and 4–7, each a full XPU-link mesh. The rules: only
1, 2, 4 or 8 cards; 1, 2 and 4 never span the halves (a task is fastest inside one NUMA node);
minimise fragmentation. Fragmentation is MTF ("minimized tasks to fill"): the fewest 1/2/4/8-card
tasks that would fill the node's free XPUs, and a node scores by how an allocation changes it:
score = 1000·(1 − ΔMTF), ΔMTF = MTF(occupancy after this allocation) − MTF(before).

Occupancy strings are bitmasks: bit i counted from the right is XPU i ("00000011" = XPUs 0 and 1
used). MTF is symmetric in the halves, so only the design's score examples fix the order: read this
way, each "before→after" pair is what the selector produces (00000111→00001111 takes XPU 3); read
left to right, none of them is.

HAMi's "interconnect" fallback, which gives 2- or 4-card tasks XPUs from both halves when neither
half can hold them, breaks the no-spanning rule; it runs only when the request sets
``cross_half_fallback``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from operator import itemgetter
from typing import Any, Final, NamedTuple

from memtopo.planner.errors import PlanError, unsatisfiable
from memtopo.planner.request import (
    as_object,
    get_bool,
    get_int,
    get_int_list,
    get_named_nodes,
    get_str,
    id_mask,
    reject_unknown,
)

DEVICES = 8
HALF = 4
ANNOTATION_KEY = "BAIDU_COM_DEVICE_IDX"
REQUEST_SIZES = (1, 2, 4, 8)

# Free-count sizes to look for in a half, best first (HAMi's order): take from the half the task
# empties or leaves even. Note 2 prefers a half with 3 free over one with 4 (unlike Ascend's 2,4,3).
_ORDER: Final[Mapping[int, tuple[int, ...]]] = {1: (1, 3, 2, 4), 2: (2, 3, 4), 4: (4,)}
# Cross-half XPU links (i ↔ i+4) and the 4-card cross-half groups, in HAMi's order.
_INTERCONNECT: Final = ((0, 4), (1, 5), (2, 6), (3, 7))
_CROSS_GROUPS: Final = ((0, 1, 4, 5), (2, 3, 6, 7), (0, 2, 4, 6), (1, 3, 5, 7), (0, 3, 4, 7), (1, 2, 5, 6))
_LOW_HALF: Final = 0x0F

_RULE = "only 1, 2, 4 or 8-card allocations are allowed: 1, 2 and 4 fit one NUMA half, 8 is the whole node"


# --- MTF ---------------------------------------------------------------------------------------


def _half_tasks(free: int) -> int:
    # Task sizes are powers of two and any set of XPUs inside a half is fully linked, so the fewest
    # 1/2/4-card tasks filling k free XPUs of a half is the number of 1-bits of k (3 = 2+1, 4 = 4).
    return free.bit_count()


def _compute_mtf(occupancy: int) -> int:
    if occupancy == 0:
        return 1  # one 8-card task fills an empty node
    used_low = (occupancy & _LOW_HALF).bit_count()
    used_high = (occupancy >> HALF).bit_count()
    return _half_tasks(HALF - used_low) + _half_tasks(HALF - used_high)


# Built once: every node's MTF is a lookup, never recomputed (ranking 10,000 nodes must stay fast).
_MTF: Final[tuple[int, ...]] = tuple(_compute_mtf(o) for o in range(1 << DEVICES))


def mtf(occupancy: int) -> int:
    """MTF of a node whose used XPUs are the 1-bits of ``occupancy`` (bit i = XPU i)."""
    if isinstance(occupancy, bool) or not isinstance(occupancy, int) or not 0 <= occupancy < 1 << DEVICES:
        raise PlanError("invalid_request", f"occupancy: expected an 8-bit mask 0–255, got {occupancy!r}")
    return _MTF[occupancy]


def parse_occupancy(text: Any, field: str = "occupancy") -> int:
    """``"00000011"`` → 0b11: 8 characters of 0/1, bit i counted from the right = XPU i."""
    if not isinstance(text, str) or len(text) != DEVICES or text.strip("01"):
        raise PlanError(
            "invalid_request",
            f"{field}: expected 8 characters of 0 and 1 (the rightmost is XPU 0), got {text!r}",
        )
    return int(text, 2)


def _ids(mask: int) -> list[int]:
    return [i for i in range(DEVICES) if mask >> i & 1]


def mtf_of(occupancy: str) -> dict[str, Any]:
    """``memtopo plan mtf OCCUPANCY``: the node's MTF with its used and free XPUs."""
    mask = parse_occupancy(occupancy)
    return {"occupancy": occupancy, "used": _ids(mask), "free": _ids(~mask & 0xFF), "mtf": _MTF[mask]}


def score_for_delta(delta: int) -> int:
    """The design's table (−1→2000, 0→1000, 1→0, 2→−1000), extended linearly beyond it."""
    return 1000 * (1 - delta)


# --- selection ---------------------------------------------------------------------------------


def half_sizes(request: int) -> tuple[int, ...]:
    """The free counts a NUMA half may have to take a task of ``request`` (1, 2 or 4) cards, best first."""
    return _ORDER.get(request, ())


def _fallback(request: int, free: list[int]) -> tuple[int, ...]:
    """HAMi's cross-half choice when no half can hold a task of 2 or 4 cards; () if none."""
    free_set = set(free)
    if request == 2:
        for pair in _INTERCONNECT:
            if free_set.issuperset(pair):
                return pair
        return ()
    if request != 4 or len(free) not in (4, 5, 6):
        return ()
    last: tuple[int, ...] = ()
    for group in _CROSS_GROUPS:
        if not free_set.issuperset(group):
            continue
        if len(free) < 6:
            return group
        last = group
        # With 6 free, prefer the group whose two leftover XPUs are still linked to each other.
        a, b = sorted(free_set.difference(group))
        if a // HALF == b // HALF or b == a + HALF:
            return group
    return last


def select(request: int, occupancy: int, cross_half_fallback: bool = False) -> tuple[int, ...]:
    """XPUs a task of ``request`` cards gets on a node with this occupancy, in selection order; () if none."""
    return _outcome(request, cross_half_fallback, occupancy).devices


def _select(request: int, occupancy: int, cross_half_fallback: bool) -> tuple[int, ...]:
    free = [i for i in range(DEVICES) if not occupancy >> i & 1]
    if request == DEVICES:
        return tuple(free) if len(free) == DEVICES else ()
    low = [i for i in free if i < HALF]
    high = [i for i in free if i >= HALF]
    for size in _ORDER[request]:
        # The lower half first at each size (HAMi's order); the lowest free indices, ascending.
        if len(low) == size:
            return tuple(low[:request])
        if len(high) == size:
            return tuple(high[:request])
    return _fallback(request, free) if cross_half_fallback else ()


# --- per-occupancy outcomes ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """A task of ``request`` cards on a node with this occupancy. Shared by every node with that occupancy."""

    occupancy: int
    devices: tuple[int, ...]  # selection order; () when the node does not fit
    mtf_before: int
    mtf_after: int | None  # whole node after the allocation, old and new XPUs together
    delta: int | None
    score: int | None
    spans_halves: bool  # only ever True with cross_half_fallback
    reason: str | None  # why the node does not fit; None when it does

    @property
    def fits(self) -> bool:
        return bool(self.devices)

    @property
    def annotation(self) -> str | None:
        """``BAIDU_COM_DEVICE_IDX=<ids in selection order>`` as the bind phase writes it."""
        if not self.devices:
            return None
        return f"{ANNOTATION_KEY}={','.join(map(str, self.devices))}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "occupancy": format(self.occupancy, "08b"),
            "used": _ids(self.occupancy),
            "fits": self.fits,
            "mtf_before": self.mtf_before,
        }
        if not self.devices:
            out["reason"] = self.reason
            return out
        out |= {
            "devices": list(self.devices),
            "mtf_after": self.mtf_after,
            "delta": self.delta,
            "score": self.score,
            "annotation": self.annotation,
            "spans_halves": self.spans_halves,
        }
        return out


def _reason(request: int, occupancy: int, cross_half_fallback: bool) -> str:
    free_low = HALF - (occupancy & _LOW_HALF).bit_count()
    free_high = HALF - (occupancy >> HALF).bit_count()
    if request == DEVICES:
        return f"an 8-card task takes the whole node; {free_low + free_high}/8 free"
    if free_low + free_high == 0:
        return "NumaNotFit: no free XPU"
    text = (
        f"NumaNotFit: no NUMA half has {request} free XPUs (0–3: {free_low} free, 4–7: {free_high} free); "
        "1-, 2- and 4-card tasks must not span NUMA halves"
    )
    return text + ", and no cross-half group is free" if cross_half_fallback else text


def _make_outcome(request: int, cross_half_fallback: bool, occupancy: int) -> Outcome:
    before = _MTF[occupancy]
    devices = _select(request, occupancy, cross_half_fallback)
    if not devices:
        return Outcome(occupancy, (), before, None, None, None, False, _reason(request, occupancy, cross_half_fallback))
    after_mask = occupancy
    for i in devices:
        after_mask |= 1 << i
    after = _MTF[after_mask]
    spans = min(devices) < HALF <= max(devices) and request < DEVICES
    return Outcome(occupancy, devices, before, after, after - before, score_for_delta(after - before), spans, None)


class _Table(NamedTuple):
    outcomes: tuple[Outcome, ...]  # indexed by occupancy
    keys: tuple[int, ...]  # ascending = better: score desc, then more XPUs used (binpack)


@cache
def _table(request: int, cross_half_fallback: bool) -> _Table:
    """All 256 outcomes of one request size, computed once per process."""
    outcomes = tuple(_make_outcome(request, cross_half_fallback, o) for o in range(1 << DEVICES))
    keys = tuple(-((o.score or 0) * 16 + o.occupancy.bit_count()) for o in outcomes)
    return _Table(outcomes, keys)


def _outcome(request: int, cross_half_fallback: bool, occupancy: int) -> Outcome:
    check_request(request)
    return _table(request, cross_half_fallback).outcomes[occupancy]


def evaluate(request: int, occupancy: int, cross_half_fallback: bool = False) -> Outcome:
    """Devices, MTF before/after, delta and score of one task on one node."""
    mtf(occupancy)  # validates the mask
    return _outcome(request, cross_half_fallback, occupancy)


# --- request ------------------------------------------------------------------------------------


def check_request(n: int) -> int:
    """``n`` if a task of that many XPUs is allowed (1, 2, 4, 8), else PlanError naming the rule."""
    if n not in REQUEST_SIZES:
        raise PlanError("invalid_request", f"request: {n} XPUs is not allowed ({_RULE})")
    return n


class Node(NamedTuple):
    """One node of the request. A NamedTuple, not a frozen dataclass: a fleet request builds 10,000
    of these per call and a NamedTuple is just as immutable at half the construction cost."""

    name: str
    occupancy: int  # bit i = XPU i is used

    @property
    def used(self) -> tuple[int, ...]:
        return tuple(_ids(self.occupancy))


@dataclass(frozen=True, slots=True)
class Request:
    request: int  # cards per task: 1, 2, 4 or 8
    nodes: tuple[Node, ...]
    cross_half_fallback: bool = False


def _checked_used(node: Mapping[str, Any]) -> int:
    mask = 0
    for i in get_int_list(node, "used"):
        if i >= DEVICES:
            raise PlanError("invalid_request", f"used: XPU id {i} is outside 0–7 (a P800 node has 8 XPUs)")
        if mask >> i & 1:
            raise PlanError("invalid_request", f"used: XPU {i} is listed twice")
        mask |= 1 << i
    return mask


REQUEST_KEYS = frozenset({"request", "nodes", "cross_half_fallback"})
_NODE_KEYS = frozenset({"name", "used", "occupancy"})


def _parse_node(obj: Any) -> Node:
    node = obj if type(obj) is dict else as_object(obj, "node")
    if not node.keys() <= _NODE_KEYS:
        reject_unknown(node, _NODE_KEYS, "node")
    name = node.get("name")
    if type(name) is not str or not name:
        name = get_str(node, "name")
        if not name:
            raise PlanError("invalid_request", "name: must not be empty")
    used = node.get("used")
    text = node.get("occupancy")
    if (used is None) == (text is None):
        raise PlanError(
            "invalid_request", 'used: give exactly one of used (a list of XPU ids) or occupancy ("00000011")'
        )
    if text is not None:
        return Node(name, parse_occupancy(text))
    mask = id_mask(used, DEVICES)
    return Node(name, mask if mask >= 0 else _checked_used(node))


def parse_request(obj: Any) -> Request:
    """``{"request": n, "nodes": [{"name", "used": [ids]} | {"name", "occupancy": "00000011"}],
    "cross_half_fallback"?: false}`` → Request."""
    body = as_object(obj)
    # A misspelt "cross_half_fallback" must not silently leave the fallback off (or on).
    reject_unknown(body, REQUEST_KEYS, "request")
    n = check_request(get_int(body, "request"))
    fallback = get_bool(body, "cross_half_fallback", False)
    return Request(n, get_named_nodes(body, _parse_node), fallback)


# --- ranking ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeResult:
    node: Node
    outcome: Outcome

    def to_json(self) -> dict[str, Any]:
        return {"name": self.node.name, **self.outcome.to_json()}


@dataclass(frozen=True, slots=True)
class Decision:
    request: int
    cross_half_fallback: bool
    chosen: str | None  # None when no node fits
    # Every node, fitting ones best first, then the rest by name; ``outcomes`` is parallel to it.
    # Two flat tuples rather than per-node objects keep ranking a fleet allocation-free; ``nodes``
    # builds the NodeResults when they are wanted.
    ranked: tuple[Node, ...]
    outcomes: tuple[Outcome, ...]

    @property
    def nodes(self) -> tuple[NodeResult, ...]:
        return tuple(NodeResult(node, outcome) for node, outcome in zip(self.ranked, self.outcomes, strict=True))

    def to_json(self) -> dict[str, Any]:
        # Nodes with one occupancy share one outcome, so its JSON is built once per occupancy.
        memo: dict[int, dict[str, Any]] = {}
        nodes: list[dict[str, Any]] = []
        for node, outcome in zip(self.ranked, self.outcomes, strict=True):
            part = memo.get(outcome.occupancy)
            if part is None:
                part = memo[outcome.occupancy] = outcome.to_json()
            nodes.append({"name": node.name, **part})
        return {
            "policy": "xpu",
            "request": self.request,
            "cross_half_fallback": self.cross_half_fallback,
            "chosen": self.chosen,
            "nodes": nodes,
        }


_NAME = itemgetter(0)


def rank(req: Request) -> Decision:
    """Every node's outcome, best first; ``chosen`` is the best node, or None.

    Order: score descending, then the node with more XPUs already used (binpack, the direction of
    HAMi's base score under its default policy), then node name ascending (the final tie-break;
    names are unique, so the result is the same for any order of ``req.nodes``). Non-fitting nodes
    follow, by name.
    """
    check_request(req.request)
    table, keys = _table(req.request, req.cross_half_fallback)
    nodes = req.nodes
    occupancies = [node.occupancy for node in nodes]
    fitting = [i for i, o in enumerate(occupancies) if table[o].devices]
    rejected = [i for i, o in enumerate(occupancies) if not table[o].devices]
    names = list(map(_NAME, nodes))
    # Two stable single-key sorts (name, then the table's score/binpack key) give the full order
    # without building a key object per node.
    fitting.sort(key=names.__getitem__)
    fitting.sort(key=lambda i: keys[occupancies[i]])
    rejected.sort(key=names.__getitem__)
    order = fitting + rejected
    chosen = names[fitting[0]] if fitting else None
    return Decision(
        req.request,
        req.cross_half_fallback,
        chosen,
        tuple(map(nodes.__getitem__, order)),
        tuple(table[occupancies[i]] for i in order),
    )


def decide(req: Request) -> Decision:
    """``rank`` for one task; PlanError("unsatisfiable") naming each node's reason when no node fits."""
    return decide_ranked(rank(req))


def decide_ranked(decision: Decision) -> Decision:
    """``decision`` when a node takes the task, else the PlanError ``decide`` raises."""
    if decision.chosen is None:
        reasons = (f"{node.name}: {outcome.reason}"
                   for node, outcome in zip(decision.ranked, decision.outcomes, strict=True))
        raise unsatisfiable(f"no node can take {decision.request} XPUs", reasons, len(decision.ranked))
    return decision
