"""Fleet placement: the hccs, xpu and place policies over the topologies a controller holds.

``memtopo plan hccs|xpu`` rank the nodes a request lists; here each node comes from its agent's own
``MemoryTopology`` instead:

* **hccs** — an 8-NPU Ascend 910 node is one whose topology holds NPU0–7 and the two
  ``hccs-ring`` groups (NPU0–3, NPU4–7); discovery decides what the rings are, this module does not
  guess them again. Capacity is the node's healthy NPUs (npu-smi health ``OK`` or ``Warning``:
  ``Warning`` is a minor alarm the chip keeps working through); available are the healthy ones no
  process runs on and the request's ``allocated`` does not name.
* **xpu** — a P800 node holds XPU0–7 and ``numa-half`` groups XPU0–3 / XPU4–7 (its NUMA halves).
  An agent cannot see which XPUs a device plugin has handed out, so used = the request's
  ``allocated``.
* **place** — ``place.rank_nodes`` over every topology (its hard constraints filter first).

``allocated`` (``{"node": [ids]}``) is what the scheduler has given out and the node does not show
yet; ``node_names`` restricts the fleet to those nodes. A node the policy cannot use (not an Ascend
910 / P800 node, not connected, unknown health) is listed under ``skipped`` with its reason.

Every node's verdict (fits, reason, rank, whether preemption could change it) is
``Evaluation.verdicts()``, and a fitting node's own result (devices, the device plugin's annotation,
place's decision) ``Evaluation.pick(name)``: one table per policy, so a front end (the scheduler
extender, ``memtopo controller place``) never looks inside the policies' decisions.
``SnapshotNodes`` is the one road from a stored snapshot (the agent's serialized topology) to a
``FleetNode``, deriving a node's device views once per snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from memtopo.planner import hccs, place, xpu
from memtopo.planner.errors import PlanError, unsatisfiable
from memtopo.planner.names import FLEET_POLICIES
from memtopo.planner.request import as_object, get_bool, get_int, get_int_list, get_list, parse_json, reject_unknown
from memtopo.v1 import topology_pb2 as pb

POLICIES: Final = FLEET_POLICIES
# The policies that hand out devices by id (0–7) and read a DeviceView of each node.
DEVICE_POLICIES: Final = ("hccs", "xpu")
FLEET_KEYS: Final = ("node_names", "allocated")
HEALTHY_NPU: Final = frozenset({"OK", "Warning"})

_HALVES: Final = ((0, 1, 2, 3), (4, 5, 6, 7))


@dataclass(frozen=True, slots=True)
class DeviceView:
    """What a device policy (hccs, xpu) reads from one node's topology before any allocation: the
    usable device ids and, of those, the ones no process runs on. Depends on the topology only, so a
    caller that holds many nodes may derive it once per snapshot (``device_view``) and pass it in."""

    healthy: tuple[int, ...]
    idle: tuple[int, ...]


@dataclass(frozen=True)
class FleetNode:
    """A node as the controller holds it: its latest topology (None before its first snapshot)
    and whether its link is up now. ``views`` (policy → DeviceView, or the reason the node cannot
    serve that policy) stands in for deriving them from ``topology`` again; a node with views and
    no topology is a held node to every policy but place."""

    name: str
    topology: pb.MemoryTopology | None
    connected: bool = True
    views: Mapping[str, DeviceView | str] | None = None


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason}


class _UnusableNodeError(Exception):
    """This node cannot serve the policy at all (as opposed to not fitting this request)."""


def _groups_of_four(topo: pb.MemoryTopology, kind: int, prefix: str, group_kind: str,
                    ) -> dict[int, pb.Accelerator]:
    """The node's accelerators of ``kind`` by index, if they are exactly 0–7 and the topology groups
    them in two halves of four (0–3, 4–7); _UnusableNodeError saying what is missing otherwise."""
    devices = {a.index: a for a in topo.accelerators if a.kind == kind}
    if sorted(devices) != list(range(8)):
        shown = ",".join(str(i) for i in sorted(devices)) or "none"
        raise _UnusableNodeError(f"not an 8-{prefix} node ({prefix} ids {shown})")
    groups = {tuple(sorted(g.members)) for g in topo.accelerator_groups if g.kind == group_kind}
    for half in _HALVES:
        members = tuple(sorted(f"{prefix}{i}" for i in half))
        if members not in groups:
            raise _UnusableNodeError(f"no {group_kind} group {prefix}{half[0]}–{prefix}{half[-1]} in its topology")
    return devices


def _allocated(obj: Mapping[str, Any], names: set[str]) -> dict[str, frozenset[int]]:
    raw = as_object(obj.get("allocated", {}), "allocated")
    out: dict[str, frozenset[int]] = {}
    for name in raw:
        if name not in names:
            raise PlanError("invalid_request", f"allocated: {name!r} is not a node the controller holds")
        ids = get_int_list(raw, name)
        bad = [i for i in ids if i >= 8]
        if bad:
            raise PlanError("invalid_request", f"allocated.{name}: id {bad[0]} is outside 0–7")
        out[name] = frozenset(ids)
    return out


def _selected(obj: Mapping[str, Any], nodes: Sequence[FleetNode]) -> list[FleetNode]:
    if obj.get("node_names") is None:
        return list(nodes)
    wanted = get_list(obj, "node_names")
    by_name = {n.name: n for n in nodes}
    out: list[FleetNode] = []
    seen: set[str] = set()
    for name in wanted:
        if not isinstance(name, str) or name not in by_name:
            raise PlanError("invalid_request", f"node_names: {name!r} is not a node the controller holds")
        if name in seen:
            raise PlanError("invalid_request", f"node_names: {name!r} appears twice")
        seen.add(name)
        out.append(by_name[name])
    return out


def _hccs_view(topo: pb.MemoryTopology) -> DeviceView:
    npus = _groups_of_four(topo, pb.ACCELERATOR_KIND_NPU, "NPU", "hccs-ring")
    unknown = [i for i, a in sorted(npus.items()) if not a.health]
    if unknown:
        raise _UnusableNodeError(f"npu-smi gave no health for NPU{unknown[0]}")
    healthy = tuple(i for i, a in sorted(npus.items()) if a.health in HEALTHY_NPU)
    return DeviceView(healthy, tuple(i for i in healthy if npus[i].attributes.get("running") != "true"))


def _xpu_view(topo: pb.MemoryTopology) -> DeviceView:
    _groups_of_four(topo, pb.ACCELERATOR_KIND_XPU, "XPU", "numa-half")
    # An agent cannot see which XPUs a device plugin handed out: every XPU is usable until allocated.
    ids = tuple(range(8))
    return DeviceView(ids, ids)


_VIEW_OF: Final = {"hccs": _hccs_view, "xpu": _xpu_view}


def device_view(policy: str, topo: pb.MemoryTopology) -> DeviceView | str:
    """The node's DeviceView for ``policy`` (hccs or xpu), or why the node cannot serve it."""
    try:
        return _VIEW_OF[policy](topo)
    except _UnusableNodeError as exc:
        return str(exc)


def _hccs_node(name: str, view: DeviceView, allocated: frozenset[int]) -> hccs.Node:
    available = view.idle if not allocated else tuple(i for i in view.idle if i not in allocated)
    return hccs.Node(name, available, len(view.healthy))


def _xpu_node(name: str, view: DeviceView, allocated: frozenset[int]) -> xpu.Node:
    mask = 0
    for i in allocated:
        mask |= 1 << i
    return xpu.Node(name, mask)


Decision = hccs.Decision | xpu.Decision | place.FleetDecision
# The device policies: each has REQUEST_KEYS, check_request, rank and decide_ranked.
_MODULE: Final = {"hccs": hccs, "xpu": xpu}


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    """One node under one policy: whether it fits, why not, whether preemption (freeing busy devices)
    could change that, and its dense rank among the fitting nodes (0 = the policy's best score, one
    more per distinct lower score)."""

    fits: bool
    reason: str = ""
    unresolvable: bool = False
    level: int = 0


@dataclass(frozen=True)
class NodePick:
    """A fitting node's result: the devices one pod gets (hccs, xpu: ids 0–7) with the annotation
    their device plugin reads, or place's decision as JSON (CPUs, GPUs, memory nodes and policy)."""

    policy: str
    node: str
    devices: tuple[int, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    placement: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Evaluation:
    """Every node's verdict under one policy: ``decision`` is the policy's ranking (every node with
    its fit, score or reason; its chosen may be empty), None when no node was usable; ``error`` is
    what ``decide`` raises (the request cannot be placed), None when it can."""

    policy: str
    decision: Decision | None
    skipped: tuple[Skipped, ...]
    error: PlanError | None

    def to_json(self) -> dict[str, Any]:
        """The decision as ``memtopo controller place`` prints it; the PlanError when there is none."""
        if self.error is not None:
            raise self.error
        assert self.decision is not None
        return {**self.decision.to_json(), "skipped": [s.to_json() for s in self.skipped]}

    def verdicts(self) -> dict[str, NodeVerdict]:
        """Every evaluated node's verdict: the fitting ones with their dense rank under the policy's
        score (0 = its best), the others with its reason; skipped nodes are unresolvable (no
        preemption makes a node the policy cannot use fit)."""
        out: dict[str, NodeVerdict] = {s.name: NodeVerdict(False, s.reason, True) for s in self.skipped}
        if self.decision is not None:
            _VERDICTS[self.policy](self.decision, out)
        return out

    def pick(self, name: str) -> NodePick | None:
        """The node's own result (what a bind writes from); None unless it fits."""
        return _PICKS[self.policy](self.decision, name) if self.decision is not None else None


def evaluate(policy: str, request: Any, nodes: Sequence[FleetNode]) -> Evaluation:
    """Rank ``nodes`` under ``policy`` without refusing an unplaceable request (``Evaluation.error``
    says why it is one); PlanError only for an invalid request. ``decide`` is this plus the refusal."""
    if policy not in POLICIES:
        raise PlanError("invalid_request", f"policy: {policy!r} is not a fleet policy ({', '.join(POLICIES)})")
    body = dict(as_object(request))
    if "nodes" in body:
        raise PlanError("invalid_request", "nodes: the fleet is the controller's nodes; name some with node_names")
    module = _MODULE.get(policy)
    if module is not None:
        # Checked before any node is derived: a bad request is refused as such even on an empty fleet.
        reject_unknown(body, (module.REQUEST_KEYS - {"nodes"}) | set(FLEET_KEYS), "request")
        module.check_request(get_int(body, "request"))
    chosen_nodes = _selected(body, nodes)
    if policy == "place" and "allocated" in body:
        raise PlanError("invalid_request", "allocated: place takes no device allocations")
    allocated = _allocated(body, {n.name for n in nodes})
    for key in FLEET_KEYS:
        body.pop(key, None)

    skipped: list[Skipped] = []
    usable: list[FleetNode] = []
    for node in chosen_nodes:
        if node.topology is None and (node.views is None or policy == "place"):
            skipped.append(Skipped(node.name, "no topology yet"))
        elif not node.connected:
            skipped.append(Skipped(node.name, "not connected: its topology may be stale"))
        else:
            usable.append(node)

    if policy == "place":
        req = place.parse_request(body)
        if not usable:
            return Evaluation(policy, None, tuple(skipped), _empty(policy, skipped))
        fleet = place.rank_nodes(req, [n.topology for n in usable if n.topology is not None])
        error = None
        if fleet.chosen is None:
            error = unsatisfiable("no node can take the allocation",
                                  (f"{r.node}: {r.constraint}: {r.reason}" for r in fleet.rejected),
                                  len(fleet.rejected))
        return Evaluation(policy, fleet, tuple(skipped), error)

    # The derived nodes are valid by construction (ids 0–7 from the topology, allocations checked
    # above, names unique): they go to the policy's ranking without its JSON parser.
    decision: hccs.Decision | xpu.Decision
    if policy == "hccs":
        hnodes = [_hccs_node(n.name, v, allocated.get(n.name, _NONE))
                  for n, v in _views(policy, usable, skipped)]
        if not hnodes:
            return Evaluation(policy, None, tuple(skipped), _empty(policy, skipped))
        decision = hccs.rank(hccs.Request(hccs.check_request(get_int(body, "request")), tuple(hnodes)))
    else:
        xnodes = [_xpu_node(n.name, v, allocated.get(n.name, _NONE)) for n, v in _views(policy, usable, skipped)]
        if not xnodes:
            return Evaluation(policy, None, tuple(skipped), _empty(policy, skipped))
        decision = xpu.rank(xpu.Request(xpu.check_request(get_int(body, "request")), tuple(xnodes),
                                        get_bool(body, "cross_half_fallback", False)))
    error = None
    try:
        if isinstance(decision, hccs.Decision):
            hccs.decide_ranked(decision)
        else:
            xpu.decide_ranked(decision)
    except PlanError as exc:
        error = exc
    return Evaluation(policy, decision, tuple(skipped), error)


_NONE: Final[frozenset[int]] = frozenset()


def _views(policy: str, usable: Sequence[FleetNode], skipped: list[Skipped]) -> list[tuple[FleetNode, DeviceView]]:
    out: list[tuple[FleetNode, DeviceView]] = []
    for node in usable:
        view = node.views.get(policy) if node.views is not None else None
        if view is None:
            assert node.topology is not None
            view = device_view(policy, node.topology)
        if isinstance(view, str):
            skipped.append(Skipped(node.name, view))
        else:
            out.append((node, view))
    return out


# ---- verdicts and picks, one table per policy ---------------------------------------------------------
def _levels(out: dict[str, NodeVerdict], fitting: Iterable[tuple[Any, str]]) -> None:
    """Fitting nodes in the policy's order (best first) → verdicts with their dense rank (one shared
    verdict object per rank: a 5,000-node answer builds a handful, not 5,000)."""
    level, previous = -1, object()
    verdict = NodeVerdict(True)
    for key, name in fitting:
        if key != previous:
            level, previous = level + 1, key
            verdict = NodeVerdict(True, level=level)
        out[name] = verdict


class _Failures:
    """Nodes that fail alike share one verdict."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, bool], NodeVerdict] = {}

    def __call__(self, reason: str, unresolvable: bool) -> NodeVerdict:
        v = self._seen.get((reason, unresolvable))
        if v is None:
            v = self._seen[(reason, unresolvable)] = NodeVerdict(False, reason, unresolvable)
        return v


def _hccs_verdicts(d: Any, out: dict[str, NodeVerdict]) -> None:
    assert isinstance(d, hccs.Decision)
    fail = _Failures()
    # Fewer healthy NPUs than the pod asks is for good; busy ones preemption may free.
    for node, fit in zip(d.ranked, d.fits, strict=True):
        if fit.score is None:
            out[node.name] = fail(fit.reason or "", node.capacity < d.per_pod)
    _levels(out, ((fit.score, node.name) for node, fit in zip(d.ranked, d.fits, strict=True) if fit.score is not None))


def _xpu_verdicts(d: Any, out: dict[str, NodeVerdict]) -> None:
    assert isinstance(d, xpu.Decision)
    fail = _Failures()
    # Every XPU of a P800 node is usable once freed: a node that does not fit now is resolvable.
    for xnode, outcome in zip(d.ranked, d.outcomes, strict=True):
        if not outcome.devices:
            out[xnode.name] = fail(outcome.reason or "", False)
    _levels(out, (((outcome.score, xnode.occupancy.bit_count()), xnode.name)
                  for xnode, outcome in zip(d.ranked, d.outcomes, strict=True) if outcome.devices))


def _place_verdicts(d: Any, out: dict[str, NodeVerdict]) -> None:
    assert isinstance(d, place.FleetDecision)
    fail = _Failures()
    # place weighs the node's topology as a whole, not what runs on it: no preemption helps.
    for r in d.rejected:
        out[r.node] = fail(f"{r.constraint}: {r.reason}", True)
    # The score place prints (rounded to 6 digits) is the one its order is read by.
    _levels(out, ((round(p.intra_node_fitness, 6), p.node) for p in d.ranked))


def _hccs_pick(d: Any, name: str) -> NodePick | None:
    assert isinstance(d, hccs.Decision)
    for node, fit in zip(d.ranked, d.fits, strict=True):
        if node.name == name and fit.fits:
            result = hccs.NodeResult(node, fit, d.per_pod)
            return NodePick("hccs", name, result.npus, {hccs.ANNOTATION_KEY: result.annotation})
    return None


def _xpu_pick(d: Any, name: str) -> NodePick | None:
    assert isinstance(d, xpu.Decision)
    for node, outcome in zip(d.ranked, d.outcomes, strict=True):
        if node.name == name and outcome.devices:
            return NodePick("xpu", name, outcome.devices,
                            {xpu.ANNOTATION_KEY: ",".join(map(str, outcome.devices))})
    return None


def _place_pick(d: Any, name: str) -> NodePick | None:
    assert isinstance(d, place.FleetDecision)
    chosen = next((p for p in d.ranked if p.node == name), None)
    return NodePick("place", name, placement=chosen.to_json()) if chosen is not None else None


_VERDICTS: Final[Mapping[str, Callable[[Any, dict[str, NodeVerdict]], None]]] = {
    "hccs": _hccs_verdicts, "xpu": _xpu_verdicts, "place": _place_verdicts}
_PICKS: Final[Mapping[str, Callable[[Any, str], NodePick | None]]] = {
    "hccs": _hccs_pick, "xpu": _xpu_pick, "place": _place_pick}


# ---- stored snapshots → FleetNodes ---------------------------------------------------------------------
# (node, link up, the serialized MemoryTopology or None before the first) as a controller holds it.
Held = tuple[str, bool, bytes | None]


class SnapshotNodes:
    """Stored snapshots → ``FleetNode``s, for every front end alike (the Place RPC, the scheduler
    extender). A device policy's view of a node (``device_view``) is derived once per snapshot: the
    cache is keyed by the snapshot's bytes object, which a new snapshot replaces. place reads the
    whole topology, parsed per call (a parsed topology is several times its wire size, too much to
    keep for every node of a large fleet). Safe to use from worker threads: an entry is replaced
    whole, so two threads deriving one node at once only do the work twice."""

    def __init__(self) -> None:
        # node → (snapshot bytes, link up, its FleetNode carrying the views: policy → DeviceView or
        # the reason the node cannot serve it, filled per policy on first use).
        self._entries: dict[str, tuple[bytes, bool, FleetNode, dict[str, DeviceView | str]]] = {}

    def node(self, name: str, connected: bool, payload: bytes | None, policy: str) -> FleetNode:
        if payload is None:
            return FleetNode(name, None, connected)
        if policy not in DEVICE_POLICIES:
            return FleetNode(name, pb.MemoryTopology.FromString(payload), connected)
        entry = self._entries.get(name)
        if entry is not None and entry[0] is payload and entry[1] == connected and policy in entry[3]:
            return entry[2]
        return self._derive(name, connected, payload, (policy,))

    def nodes(self, held: Iterable[Held], policy: str) -> list[FleetNode]:
        return [self.node(name, connected, payload, policy) for name, connected, payload in held]

    def warm(self, held: Iterable[Held]) -> None:
        """Derive every device view of these nodes now (a background task calls this as snapshots
        arrive, so the first decision after a start does not pay for thousands of them)."""
        for name, connected, payload in held:
            if payload is not None:
                self._derive(name, connected, payload, DEVICE_POLICIES)

    def views(self, name: str) -> Mapping[str, DeviceView | str]:
        """The device views derived so far for ``name`` (empty when none)."""
        entry = self._entries.get(name)
        return dict(entry[3]) if entry is not None else {}

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self._entries.pop(name, None)

    def _derive(self, name: str, connected: bool, payload: bytes, policies: Sequence[str]) -> FleetNode:
        entry = self._entries.get(name)
        if entry is None or entry[0] is not payload or entry[1] != connected:
            views: dict[str, DeviceView | str] = dict(entry[3]) if entry is not None and entry[0] is payload else {}
            entry = self._entries[name] = (payload, connected, FleetNode(name, None, connected, views), views)
        missing = [p for p in policies if p not in entry[3]]
        if missing:
            topo = pb.MemoryTopology.FromString(payload)
            for p in missing:
                entry[3][p] = device_view(p, topo)
        return entry[2]


def decide(policy: str, request: Any, nodes: Sequence[FleetNode]) -> dict[str, Any]:
    """The policy's decision over ``nodes`` as JSON, plus ``skipped``; PlanError as ``memtopo plan``."""
    return evaluate(policy, request, nodes).to_json()


def decide_json(policy: str, request_json: str | bytes, nodes: Sequence[FleetNode]) -> dict[str, Any]:
    """``decide`` on a JSON text; a refused request is its error document, as ``memtopo plan`` prints it."""
    try:
        return decide(policy, parse_json(request_json), nodes)
    except PlanError as exc:
        return exc.to_json()


def _empty(policy: str, skipped: Sequence[Skipped]) -> PlanError:
    if not skipped:
        return PlanError("unsatisfiable", f"no node the {policy} policy can use: the controller holds none")
    return unsatisfiable(f"no node the {policy} policy can use", (f"{s.name}: {s.reason}" for s in skipped),
                         len(skipped))


def node_device_view(topo: pb.MemoryTopology) -> tuple[str, DeviceView | str] | None:
    """The device policy a node's accelerators belong to (hccs for NPUs, xpu for XPUs) and its
    DeviceView under it (or why the node cannot serve it); None for a node with neither."""
    kinds = {a.kind for a in topo.accelerators}
    policy = ("hccs" if pb.ACCELERATOR_KIND_NPU in kinds else "xpu" if pb.ACCELERATOR_KIND_XPU in kinds
              else None)
    return (policy, device_view(policy, topo)) if policy is not None else None


def view_json(policy: str, view: DeviceView | str, allocated: frozenset[int] = _NONE) -> dict[str, Any]:
    """What ``policy`` sees of a node with ``allocated`` handed out, for display; derived as
    ``evaluate`` derives its nodes. ``unusable``: why the policy cannot use the node.

    hccs: the available NPUs, the free count of each ring and, per pod size, the priority group
    (A–D) the node falls into (None: the pod does not fit). xpu: the used XPUs and the node's MTF.
    """
    if isinstance(view, str):
        return {"policy": policy, "unusable": view}
    if policy == "hccs":
        node = _hccs_node("", view, allocated)
        rings = [sum(1 for i in node.available if i in half) for half in _HALVES]
        fits = {str(size): hccs.group_of(size, rings[0], rings[1]) for size in (1, 2, 4, hccs.NODE_NPUS)}
        return {"policy": policy, "available": list(node.available), "capacity": node.capacity,
                "ring_free": rings, "free_rings": sum(1 for r in rings if r == hccs.RING_NPUS), "groups": fits}
    used = _xpu_node("", view, allocated)
    return {"policy": policy, "used": list(used.used), "mtf": xpu.mtf(used.occupancy)}
