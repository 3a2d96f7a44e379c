"""Fleet placement: the hccs, xpu and place policies over the topologies a controller holds.

``memtopo plan hccs|xpu`` rank the nodes a request lists; here each node comes from its agent's own
``MemoryTopology`` instead:

* **hccs** — an 8-NPU Ascend 910 node is one whose topology holds NPU0–7 and the seed's two
  ``hccs-ring`` groups (NPU0–3, NPU4–7); discovery decides what the rings are, this module does not
  guess them again. Capacity is the node's healthy NPUs (npu-smi health ``OK`` or ``Warning``:
  ``Warning`` is a minor alarm the chip keeps working through); available are the healthy ones no
  process runs on and the request's ``allocated`` does not name.
* **xpu** — a P800 node holds XPU0–7 and ``numa-half`` groups XPU0–3 / XPU4–7 (seed 003's halves).
  An agent cannot see which XPUs a device plugin has handed out, so used = the request's
  ``allocated``.
* **place** — ``place.rank_nodes`` over every topology (its hard constraints filter first).

``allocated`` (``{"node": [ids]}``) is what the scheduler has given out and the node does not show
yet; ``node_names`` restricts the fleet to those nodes. A node the policy cannot use (not an Ascend
910 / P800 node, not connected, unknown health) is listed under ``skipped`` with its reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from memtopo.v1 import topology_pb2 as pb
from planner import hccs, place, xpu
from planner.errors import PlanError, unsatisfiable
from planner.request import as_object, get_int, get_int_list, get_list, parse_json, reject_unknown

POLICIES: Final = ("hccs", "xpu", "place")
FLEET_KEYS: Final = ("node_names", "allocated")
HEALTHY_NPU: Final = frozenset({"OK", "Warning"})

_HALVES: Final = ((0, 1, 2, 3), (4, 5, 6, 7))


@dataclass(frozen=True)
class FleetNode:
    """A node as the controller holds it: its latest topology (None before its first snapshot)
    and whether its link is up now."""

    name: str
    topology: pb.MemoryTopology | None
    connected: bool = True


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason}


class _UnusableNodeError(Exception):
    """This node cannot serve the policy at all (as opposed to not fitting this request)."""


def _seed_groups(topo: pb.MemoryTopology, kind: int, prefix: str, group_kind: str,
                 ) -> dict[int, pb.Accelerator]:
    """The node's accelerators of ``kind`` by index, if they are exactly 0–7 and the topology groups
    them in the seeds' two halves of four; _UnusableNodeError saying what is missing otherwise."""
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
    for name in wanted:
        if not isinstance(name, str) or name not in by_name:
            raise PlanError("invalid_request", f"node_names: {name!r} is not a node the controller holds")
        out.append(by_name[name])
    return out


def _hccs_node(name: str, topo: pb.MemoryTopology, allocated: frozenset[int]) -> dict[str, Any]:
    npus = _seed_groups(topo, pb.ACCELERATOR_KIND_NPU, "NPU", "hccs-ring")
    unknown = [i for i, a in sorted(npus.items()) if not a.health]
    if unknown:
        raise _UnusableNodeError(f"npu-smi gave no health for NPU{unknown[0]}")
    healthy = [i for i, a in sorted(npus.items()) if a.health in HEALTHY_NPU]
    available = [i for i in healthy
                 if i not in allocated and npus[i].attributes.get("running") != "true"]
    return {"name": name, "available": available, "capacity": len(healthy)}


def _xpu_node(name: str, topo: pb.MemoryTopology, allocated: frozenset[int]) -> dict[str, Any]:
    _seed_groups(topo, pb.ACCELERATOR_KIND_XPU, "XPU", "numa-half")
    return {"name": name, "used": sorted(allocated)}


_NODE_OF: Final = {"hccs": _hccs_node, "xpu": _xpu_node}
# The device policies: each has REQUEST_KEYS, check_request, parse_request and decide.
_MODULE: Final = {"hccs": hccs, "xpu": xpu}


def decide(policy: str, request: Any, nodes: Sequence[FleetNode]) -> dict[str, Any]:
    """The policy's decision over ``nodes`` as JSON, plus ``skipped``; PlanError as ``memtopo plan``."""
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
    usable: list[tuple[str, pb.MemoryTopology]] = []
    for node in chosen_nodes:
        if node.topology is None:
            skipped.append(Skipped(node.name, "no topology yet"))
        elif not node.connected:
            skipped.append(Skipped(node.name, "not connected: its topology may be stale"))
        else:
            usable.append((node.name, node.topology))

    if policy == "place":
        req = place.parse_request(body)
        if not usable:
            raise _empty(policy, skipped)
        fleet = place.rank_nodes(req, [topo for _, topo in usable])
        if fleet.chosen is None:
            raise unsatisfiable("no node can take the allocation",
                                (f"{r.node}: {r.constraint}: {r.reason}" for r in fleet.rejected), len(fleet.rejected))
        return {**fleet.to_json(), "skipped": [s.to_json() for s in skipped]}

    listed: list[dict[str, Any]] = []
    for name, topo in usable:
        try:
            listed.append(_NODE_OF[policy](name, topo, allocated.get(name, frozenset())))
        except _UnusableNodeError as exc:
            skipped.append(Skipped(name, str(exc)))
    # The policy's own parser checks request size and the derived nodes alike.
    body["nodes"] = listed
    if not listed:
        raise _empty(policy, skipped)
    device = _MODULE[policy]  # place has returned above
    doc = device.decide(device.parse_request(body)).to_json()
    return {**doc, "skipped": [s.to_json() for s in skipped]}


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


def device_view(topo: pb.MemoryTopology, allocated: frozenset[int] = frozenset()) -> dict[str, Any] | None:
    """What the hccs or xpu policy sees of one node, for display: derived exactly as ``decide`` derives
    it (``allocated`` as there). None for a node with neither NPUs nor XPUs; ``unusable`` with the
    reason for one the policy cannot use.

    hccs: the available NPUs, the free count of each ring and, per pod size, the priority group
    (A–D) the node falls into (None: the pod does not fit). xpu: the used XPUs and the node's MTF.
    """
    kinds = {a.kind for a in topo.accelerators}
    name = topo.node_name
    if pb.ACCELERATOR_KIND_NPU in kinds:
        try:
            node = _hccs_node(name, topo, allocated)
        except _UnusableNodeError as exc:
            return {"policy": "hccs", "unusable": str(exc)}
        available: list[int] = node["available"]
        rings = [sum(1 for i in available if i in half) for half in _HALVES]
        fits = {str(size): hccs.group_of(size, rings[0], rings[1]) for size in (1, 2, 4, hccs.NODE_NPUS)}
        return {"policy": "hccs", "available": available, "capacity": node["capacity"],
                "ring_free": rings, "free_rings": sum(1 for r in rings if r == hccs.RING_NPUS), "groups": fits}
    if pb.ACCELERATOR_KIND_XPU in kinds:
        try:
            used: list[int] = _xpu_node(name, topo, allocated)["used"]
        except _UnusableNodeError as exc:
            return {"policy": "xpu", "unusable": str(exc)}
        occupancy = sum(1 << i for i in used)
        return {"policy": "xpu", "used": used, "mtf": xpu.mtf(occupancy)}
    return None
