"""What the node's CPU enforcement decides, as pure functions of what it observed (no I/O).

The agent's loop (``agent/enforce.py``) gathers the facts — the pods bound to this node, the running
containers the runtime lists with the kubelet's labels, each container's cpuset as its cgroup has it —
and carries the decision out through CRI ``UpdateContainerResources``. The rules:

- **Who**: the containers the kubelet's static policy would pin (``cpumanager.exclusive_cpus``: a
  Guaranteed pod, an integer CPU request). The pod's exclusive set is cut into each such container's
  share (``cpumanager.split``); its other containers, and every other kubelet container on the node,
  run on the shared pool (allocatable less every exclusive set, reserved CPUs included).
- **Which CPUs**: the scheduler extender's decision in ``memtopo.io/placement`` when it is usable:
  written for this node, naming CPUs and memory nodes that exist, as many CPUs as the pod asks, none
  of them held by another pod or reserved. A placement decided from the node's NodeResourceTopology
  names NUMA zones (``zones``) rather than CPUs: the CPUs are then chosen by the kubelet's rule within
  those NUMA nodes, memory on them. A placement with CPUs that do not exist here, for another
  node, or that is not a placement at all is refused (the pod stays on the shared pool and is told
  why). One whose CPUs are taken, or of the wrong count, is a stale decision: the CPUs are chosen
  again by the kubelet's rule within the NUMA nodes it named, and the status says so. A pod without
  a placement gets its CPUs by the kubelet's rule, memory on their NUMA nodes.
- **Adoption after a restart**: before its first change the agent takes over what the runtime
  already runs: a pod whose pinned containers each run on a disjoint set of exactly its count, of
  CPUs that may be handed out and no other pod holds, keeps those CPUs (no container moves twice,
  no CPU goes to two pods).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from memtopo.cpulist import CpuListError, format_cpulist, parse_cpulist
from memtopo.k8s import cpumanager
from memtopo.k8s.cputopo import CpuTopology
from memtopo.k8s.jsonvalue import JsonObjectError, json_object
from memtopo.text import excerpt, shorten

# Written by the scheduler extender at bind (extender/): the place policy's decision (CPUs, memory nodes),
# or, decided from NodeResourceTopology objects, the NUMA zones and what the pod holds in each.
PLACEMENT_ANNOTATION: Final = "memtopo.io/placement"
# Written by the node's enforcement: what it did with the pod (JSON, see ``status_annotation``).
STATUS_ANNOTATION: Final = "memtopo.io/enforcement"
# A placement is a few hundred bytes; the API server caps all annotations at 256 KiB together.
MAX_PLACEMENT_BYTES: Final = 64 << 10
TERMINAL_PHASES: Final = ("Succeeded", "Failed")

APPLIED: Final = "applied"  # every running pinned container is on its exclusive CPUs
PENDING: Final = "pending"  # CPUs held for the pod; a container is not running yet or an update is retried
FAILED: Final = "failed"  # no exclusive CPUs for the pod: ``reason`` says why
STATES: Final = (APPLIED, PENDING, FAILED)


class PlacementError(ValueError):
    """A ``memtopo.io/placement`` annotation that is not a usable placement for this node."""


@dataclass(frozen=True)
class Placement:
    node: str
    cpus: frozenset[int]  # empty: a placement of NUMA zones, CPUs chosen within them
    mems: tuple[int, ...]
    zones: tuple[int, ...] = ()


@dataclass(frozen=True)
class PodView:
    """One bound pod as the enforcement reads it. ``problem`` is set when its spec or placement cannot
    be used (then it gets no exclusive CPUs)."""

    uid: str
    namespace: str
    name: str
    generation: int
    created: str
    exclusive: Mapping[str, int]  # container name → exclusive CPU count (spec order)
    placement: Placement | None = None
    problem: str = ""

    @property
    def total(self) -> int:
        return sum(self.exclusive.values())

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class NodeFacts:
    node_name: str
    topo: CpuTopology
    reserved: frozenset[int]
    memory_nodes: frozenset[int]

    @property
    def allocatable(self) -> frozenset[int]:
        return self.topo.cpus


@dataclass(frozen=True)
class Assignment:
    uid: str
    cpus: frozenset[int]
    shares: Mapping[str, frozenset[int]]  # container name → its exclusive CPUs
    mems: tuple[int, ...]  # memory nodes of the pinned containers; () = leave them as they are
    how: str  # placement | chosen | adopted
    note: str = ""


@dataclass(frozen=True)
class Observed:
    """A container's cpuset as its cgroup has it (None when it could not be read)."""

    cpus: frozenset[int] | None
    mems: frozenset[int] | None


@dataclass(frozen=True)
class Target:
    cpus: frozenset[int]
    mems: tuple[int, ...] = ()


@dataclass(frozen=True)
class Outcome:
    state: str
    reason: str = ""
    assignment: Assignment | None = None
    generation: int = 0


# ---- reading pods ----------------------------------------------------------------------------------
def _cpus(value: object, what: str, limit: int = 1 << 16) -> frozenset[int]:
    if not isinstance(value, str) or len(value) > 4096:
        raise PlacementError(f"{what} is not a CPU list: {excerpt(str(value))}")
    try:
        ids = parse_cpulist(value)
    except CpuListError as exc:
        raise PlacementError(f"{what}: {exc}") from None
    if len(ids) > limit:
        raise PlacementError(f"{what} names {len(ids)} ids")
    return frozenset(ids)


def parse_placement(raw: object) -> Placement:
    """The CPUs and memory nodes of a ``memtopo.io/placement`` value (the place policy's JSON)."""
    try:
        doc = json_object(raw, MAX_PLACEMENT_BYTES, "a placement")
    except JsonObjectError as exc:
        raise PlacementError(str(exc)) from None
    node = doc.get("node", "")
    if not isinstance(node, str):
        raise PlacementError("node is not a string")
    zones = doc.get("zones")
    numa: tuple[int, ...] = ()
    if zones is not None:
        if (not isinstance(zones, list) or len(zones) > 1024
                or not all(isinstance(z, int) and not isinstance(z, bool) and 0 <= z < 1024 for z in zones)):
            raise PlacementError("zones is not a list of NUMA node ids")
        numa = tuple(sorted(set(zones)))
    cpus = _cpus(doc.get("cpus"), "cpus") if doc.get("cpus") is not None or not numa else frozenset()
    if not cpus and not numa:
        raise PlacementError("names no CPUs")
    memory = doc.get("memory")
    mems: frozenset[int] = frozenset()
    if memory is not None:
        if not isinstance(memory, dict):
            raise PlacementError("memory is not an object")
        mems = _cpus(memory.get("nodes", ""), "memory.nodes")
    if not mems:
        policy = doc.get("memory_policy")
        if isinstance(policy, dict) and policy.get("nodes"):
            mems = _cpus(policy.get("nodes"), "memory_policy.nodes")
    return Placement(node, cpus, tuple(sorted(mems)), numa)


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """The pod as the enforcement reads it; None for one it has nothing to do with (no uid, or a
    terminal phase: its containers are gone)."""
    meta = _meta(pod)
    uid, name, ns = meta.get("uid"), meta.get("name"), meta.get("namespace", "default")
    if not (isinstance(uid, str) and uid and isinstance(name, str) and isinstance(ns, str)):
        return None
    status = pod.get("status")
    if isinstance(status, Mapping) and status.get("phase") in TERMINAL_PHASES:
        return None
    gen = meta.get("generation")
    generation = gen if isinstance(gen, int) and not isinstance(gen, bool) else 0
    created = meta.get("creationTimestamp")
    base = PodView(shorten(uid, 64), shorten(ns, 63), shorten(name, 253), generation,
                   created if isinstance(created, str) else "", {})
    try:
        exclusive = cpumanager.exclusive_cpus(pod)
    except cpumanager.PodSpecError as exc:
        return _replace(base, problem=f"pod spec: {exc}")
    base = _replace(base, exclusive=exclusive)
    annotations = meta.get("annotations")
    raw = annotations.get(PLACEMENT_ANNOTATION) if isinstance(annotations, Mapping) else None
    if raw is None or not exclusive:
        return base
    try:
        return _replace(base, placement=parse_placement(raw))
    except PlacementError as exc:
        return _replace(base, problem=f"{PLACEMENT_ANNOTATION}: {exc}")


def _replace(view: PodView, **changes: Any) -> PodView:
    fields = {**view.__dict__, **changes}
    return PodView(**fields)


# ---- choosing CPUs ---------------------------------------------------------------------------------
class AssignError(Exception):
    """The pod cannot have exclusive CPUs here; the message says why."""


def _held(assignments: Iterable[Assignment]) -> frozenset[int]:
    return frozenset(c for a in assignments for c in a.cpus)


def _mems_of(node: NodeFacts, cpus: Iterable[int]) -> tuple[int, ...]:
    return tuple(n for n in node.topo.numa_of(cpus) if n in node.memory_nodes)


def assign(node: NodeFacts, pod: PodView, others: Iterable[Assignment]) -> Assignment:
    """The pod's exclusive CPUs and memory nodes, given what ``others`` hold; AssignError says why not."""
    others = list(others)
    if pod.problem:
        raise AssignError(pod.problem)
    free = cpumanager.assignable(node.allocatable, node.reserved, (a.cpus for a in others))
    want = pod.total
    shares = dict(pod.exclusive)
    place = pod.placement
    if place is not None:
        if place.node and place.node != node.node_name:
            raise AssignError(f"{PLACEMENT_ANNOTATION} is for node {shorten(place.node)}, not this node")
        unknown = place.cpus - node.allocatable
        if unknown:
            raise AssignError(f"{PLACEMENT_ANNOTATION} names CPUs {format_cpulist(unknown)} that this node "
                              f"does not have (allocatable {format_cpulist(node.allocatable)})")
        bad_zones = set(place.zones) - set(node.topo.numa_of(node.allocatable))
        if bad_zones:
            raise AssignError(f"{PLACEMENT_ANNOTATION} names NUMA nodes {format_cpulist(bad_zones)} where this node "
                              f"has no allocatable CPU")
        bad_mems = set(place.mems) - node.memory_nodes
        if bad_mems:
            raise AssignError(f"{PLACEMENT_ANNOTATION} names memory nodes {format_cpulist(bad_mems)} that this "
                              f"node does not have (memory nodes {format_cpulist(node.memory_nodes)})")
    if want > len(free):
        held = len(_held(others))
        raise AssignError(f"asks {want} exclusive CPUs; {len(free)} can be handed out "
                          f"({len(node.allocatable)} allocatable, {len(node.reserved)} reserved, "
                          f"{held} held by {len(others)} pods)")
    if place is not None and not place.cpus:
        cpus = cpumanager.allocate(node.topo, free, want, numa_affinity=place.zones)
        mems = place.mems or tuple(n for n in place.zones if n in node.memory_nodes) or _mems_of(node, cpus)
        inside = set(node.topo.numa_of(cpus)) <= set(place.zones)
        return Assignment(pod.uid, cpus, cpumanager.split(node.topo, cpus, shares), mems, "placement",
                          "" if inside else f"the placement's NUMA nodes {format_cpulist(place.zones)} had too few "
                                            f"free CPUs: chose {format_cpulist(cpus)}")
    if place is not None:
        mems = place.mems or _mems_of(node, place.cpus)
        if len(place.cpus) == want and place.cpus <= free:
            return Assignment(pod.uid, place.cpus, cpumanager.split(node.topo, place.cpus, shares), mems, "placement")
        taken = place.cpus - free
        why = (f"placement CPUs {format_cpulist(taken)} are held by another pod or reserved" if taken else
               f"placement names {len(place.cpus)} CPUs, the pod asks {want}")
        numa = node.topo.numa_of(place.cpus)
        cpus = cpumanager.allocate(node.topo, free, want, numa_affinity=numa)
        return Assignment(pod.uid, cpus, cpumanager.split(node.topo, cpus, shares), mems or _mems_of(node, cpus),
                          "chosen", f"{why}: chose {format_cpulist(cpus)} within NUMA nodes {format_cpulist(numa)}")
    cpus = cpumanager.allocate(node.topo, free, want)
    return Assignment(pod.uid, cpus, cpumanager.split(node.topo, cpus, shares), _mems_of(node, cpus), "chosen")


def _order(pods: Iterable[PodView]) -> list[PodView]:
    """First come, first served: by creation time, then uid (stable across restarts)."""
    return sorted(pods, key=lambda p: (p.created, p.uid))


def adopt(node: NodeFacts, pods: Iterable[PodView],
          running: Mapping[str, Mapping[str, Observed]]) -> dict[str, Assignment]:
    """What the runtime already runs, taken over after a restart: pod uid → assignment, for each pod
    whose pinned containers (all running) each sit on a disjoint set of exactly their count, made of
    CPUs that may be handed out and that no earlier pod holds. ``running``: pod uid → container name →
    its cpuset. A pod that does not fit is left out (it is assigned afresh)."""
    out: dict[str, Assignment] = {}
    for pod in _order(pods):
        if pod.problem or not pod.exclusive:
            continue
        seen = running.get(pod.uid, {})
        shares: dict[str, frozenset[int]] = {}
        mems: set[int] = set()
        for name, count in pod.exclusive.items():
            obs = seen.get(name)
            if obs is None or obs.cpus is None or len(obs.cpus) != count:
                break
            shares[name] = obs.cpus
            if obs.mems is not None and obs.mems < node.memory_nodes:
                mems |= obs.mems
        else:
            cpus = frozenset(c for s in shares.values() for c in s)
            free = cpumanager.assignable(node.allocatable, node.reserved, (a.cpus for a in out.values()))
            if len(cpus) == pod.total and cpus <= free:
                out[pod.uid] = Assignment(pod.uid, cpus, shares, tuple(sorted(mems)), "adopted")
    return out


@dataclass
class Decision:
    """One pass's result: the assignments to hold, the outcome per pod, and the cpuset each running
    container should have (container id → target), the pinned ones by pod."""

    assignments: dict[str, Assignment]
    outcomes: dict[str, Outcome]
    pool: frozenset[int]
    pinned: dict[str, dict[str, Target]] = field(default_factory=dict)  # pod uid → container id → target
    shared: dict[str, Target] = field(default_factory=dict)  # container id → target


@dataclass(frozen=True)
class RunningContainer:
    id: str
    pod_uid: str
    name: str


def decide(node: NodeFacts, pods: Sequence[PodView], containers: Sequence[RunningContainer],
           held: Mapping[str, Assignment]) -> Decision:
    """Keep what ``held`` still applies to, assign pods that have none, and give every running kubelet
    container its target: its share for a pinned container, the shared pool for the rest."""
    by_uid = {p.uid: p for p in pods}
    assignments = {uid: a for uid, a in held.items() if uid in by_uid and by_uid[uid].exclusive
                   and not by_uid[uid].problem and set(a.shares) == set(by_uid[uid].exclusive)}
    outcomes: dict[str, Outcome] = {}
    for pod in _order(pods):
        if not pod.exclusive and not pod.problem:
            continue
        if pod.uid in assignments:
            continue
        try:
            assignments[pod.uid] = assign(node, pod, assignments.values())
        except (AssignError, cpumanager.NotEnoughCpusError) as exc:
            outcomes[pod.uid] = Outcome(FAILED, str(exc), None, pod.generation)
    pool = cpumanager.shared_pool(node.allocatable, (a.cpus for a in assignments.values()))
    all_mems = tuple(sorted(node.memory_nodes))
    decision = Decision(assignments, outcomes, pool)
    for c in containers:
        a = assignments.get(c.pod_uid)
        if a is not None and c.name in a.shares:
            decision.pinned.setdefault(c.pod_uid, {})[c.id] = Target(a.shares[c.name], a.mems)
        elif c.pod_uid:
            decision.shared[c.id] = Target(pool, all_mems)
    for uid, a in assignments.items():
        pod = by_uid[uid]
        running = {c.name for c in containers if c.pod_uid == uid} & set(a.shares)
        note = a.note
        if len(running) < len(a.shares):
            outcomes[uid] = Outcome(PENDING, f"{len(running)} of {len(a.shares)} pinned containers running"
                                    + (f"; {note}" if note else ""), a, pod.generation)
        else:
            outcomes[uid] = Outcome(APPLIED, note, a, pod.generation)
    return decision


def needs_update(target: Target, seen: Observed | None, *, pinned: bool) -> bool:
    """Whether a container is off its target: its CPUs differ, or (pinned) its memory nodes do."""
    if seen is None or seen.cpus is None:
        return True
    if seen.cpus != target.cpus:
        return True
    return pinned and bool(target.mems) and seen.mems is not None and seen.mems != frozenset(target.mems)


def memory_move(target: Target, node: NodeFacts) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The memory nodes a pinned container's pages should leave and the ones they go to, or None when
    there is nowhere wrong for them to be: its memory nodes are left as they are, or are all of the
    node's. Setting ``cpuset.mems`` does not move pages already allocated (cgroup v1's
    ``cpuset.memory_migrate`` is off by default), so a container pinned after it touched memory keeps
    it on the nodes it had until it is moved."""
    if not target.mems:
        return None
    away = node.memory_nodes - set(target.mems)
    if not away:
        return None
    return tuple(sorted(away)), tuple(sorted(target.mems))


def status_annotation(outcome: Outcome, memory: str = "") -> str:
    """The ``memtopo.io/enforcement`` value: state, CPUs and memory nodes (and each container's share),
    the pod generation it was decided for, the reason or note, and (``memory``) how moving its pinned
    containers' pages onto their memory nodes went, once it has."""
    doc: dict[str, Any] = {"state": outcome.state, "generation": outcome.generation}
    if memory:
        doc["memory"] = memory
    a = outcome.assignment
    if a is not None:
        doc.update(cpus=format_cpulist(a.cpus), mems=format_cpulist(a.mems), source=a.how,
                   containers={n: format_cpulist(s) for n, s in a.shares.items()})
    if outcome.reason:
        doc["reason"] = outcome.reason
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)
