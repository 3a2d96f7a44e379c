"""Pods in flight: bound to a node (or being bound) but not yet counted in the node's NodeResourceTopology.

Between a bind and the node's next object, the zones it shows still have room that is promised. Every
replica of the extender derives what is in flight from the same state — the API server's pods and the
node's object — never from its own memory of what it bound, so any number of replicas agree:

- **Which pods the object counts.** Its publisher signs the pods it counted into
  ``nodeTopologyPodsFingerprint`` (``k8s.podfingerprint``: namespace and name of each pod;
  ``nodeTopologyPodsFingerprintMethod: with-exclusive-resources`` counts only pods holding exclusive
  resources, as scheduler-plugins' ``AreExclusiveForPod`` decides). The candidate sets tried, in order:
  every unfinished pod bound to the node; every pod bound to it (finished ones included: the kubelet
  may still list them); the running ones only (what scheduler-plugins' resync counts); every
  unfinished pod less the 1, 2, … :data:`MAX_UNREFLECTED` most recently scheduled. The first set whose
  sign is the object's is what it counts; the unfinished pods outside it are in flight. A 64-bit sign
  matching by chance over these few tries is not a concern.
- **Without a fingerprint, or when none matches**: the unfinished pods not running yet, or scheduled
  less than ``max_age`` seconds ago (``PodScheduled``'s time, else the pod's creation), are in flight:
  a publisher is expected to catch up within ``max_age``.
- **Too old**: an object with a fingerprint that matches none of the sets while nothing on the node
  changed for more than ``max_age`` seconds is stale — its publisher is behind or gone — and the node
  is refused with that reason rather than judged on counts that are wrong.
- **Claims**: bind writes the pod's placement (``memtopo.io/placement``: the zones and the exclusive
  amounts per zone, and when) and a label naming the node's hash *before* the Binding, then reads the
  node's pods and claims back from the API server. An unbound pod's claim counts for ``claim_ttl``
  seconds; a bound pod's placement tells where its amounts go.
- **Where the amounts go**: a pod with a placement holds its exclusive demand in the zones its claim
  names (never more than its spec asks: the claim says where, the spec how much); one without (bound by
  another scheduler, or before this extender) holds its whole exclusive demand in *every* zone, as
  scheduler-plugins' overreserve does: it cannot be known which zone the kubelet gave it.

Only exclusive amounts count (the kubelet's hint providers' demand: a Guaranteed pod's integral CPUs,
memory and huge pages, and every pod's devices): a pod without them lowers no zone's ``available``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from memtopo.k8s import podfingerprint
from memtopo.k8s.admission import GUARANTEED, PodError, parse_pod
from memtopo.k8s.enforcement import MAX_PLACEMENT_BYTES, PLACEMENT_ANNOTATION, TERMINAL_PHASES
from memtopo.k8s.jsonvalue import json_object_or_none
from memtopo.k8s.nrt_read import NodeTopology
from memtopo.k8s.resources import CPU, MEMORY, is_hugepages, is_native
from memtopo.text import shorten

# A label on a pod being bound: the hash of the node it claims zones on (a label value holds 63
# characters, a node name 253), so a bind can list every claim on its node.
CLAIM_LABEL: Final = "memtopo.io/claim"
MAX_UNREFLECTED: Final = 32
MAX_CLAIM_ZONES: Final = 64
MAX_CLAIM_RESOURCES: Final = 32
_INT64: Final = (1 << 63) - 1
RUNNING: Final = "Running"

Demand = tuple[tuple[str, int], ...]
Claims = tuple[tuple[int, str, int], ...]


def claim_label(node: str) -> str:
    return hashlib.sha256(node.encode()).hexdigest()[:40]


@dataclass(frozen=True, slots=True)
class Claim:
    """A pod's ``memtopo.io/placement`` as the reservations read it: for which node, the NUMA zones,
    the exclusive amounts per zone, and when it was written (Unix seconds)."""

    node: str
    zones: tuple[int, ...]
    amounts: Claims
    at: float


@dataclass(frozen=True, slots=True)
class PodRecord:
    """What the extender keeps of one pod (the pod informer's compact value)."""

    namespace: str
    name: str
    node: str  # spec.nodeName; "" while unbound
    phase: str
    scheduled_at: float | None  # Unix seconds; None when the pod says nothing usable
    exclusive: bool
    demand: Demand
    claim: Claim | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES


def _time(value: object) -> float | None:
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def _scheduled_at(pod: Mapping[str, Any], meta: Mapping[str, Any]) -> float | None:
    status = pod.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    for c in conditions if isinstance(conditions, list) else ():
        if isinstance(c, dict) and c.get("type") == "PodScheduled" and c.get("status") == "True":
            found = _time(c.get("lastTransitionTime"))
            if found is not None:
                return found
    return _time(meta.get("creationTimestamp"))


def _exclusive(qos: str, requests: Iterable[Mapping[str, Any]]) -> bool:
    """scheduler-plugins' ``IsExclusive`` over the steady-state containers' requests."""
    for req in requests:
        for name, q in req.items():
            if not is_native(name):
                return True
            if qos != GUARANTEED:
                continue
            if name == CPU and q > 0 and q.denominator == 1:
                return True
            if (name == MEMORY or is_hugepages(name)) and q > 0:
                return True
    return False


def parse_claim(raw: object) -> Claim | None:
    """The claim in a ``memtopo.io/placement`` value; None when there is none or it is unusable (the
    pod then counts as unplaced: its demand in every zone)."""
    doc = json_object_or_none(raw, MAX_PLACEMENT_BYTES)
    if doc is None:
        return None
    node, zones, amounts, at = doc.get("node"), doc.get("zones"), doc.get("claims"), doc.get("at")
    if (not isinstance(node, str) or not isinstance(zones, list) or not isinstance(amounts, dict)
            or isinstance(at, bool) or not isinstance(at, int | float)):
        return None
    if len(zones) > MAX_CLAIM_ZONES or len(amounts) > MAX_CLAIM_ZONES:
        return None
    if not all(isinstance(z, int) and not isinstance(z, bool) and 0 <= z < 1024 for z in zones):
        return None
    out: list[tuple[int, str, int]] = []
    for zone, resources in amounts.items():
        if not (isinstance(zone, str) and zone.isascii() and zone.isdigit() and len(zone) <= 4):
            return None
        if not isinstance(resources, dict) or len(resources) > MAX_CLAIM_RESOURCES:
            return None
        for name, amount in resources.items():
            if (not isinstance(name, str) or len(name) > 320 or isinstance(amount, bool)
                    or not isinstance(amount, int) or not 0 <= amount <= _INT64):
                return None
            out.append((int(zone), name, amount))
    return Claim(node, tuple(zones), tuple(sorted(out)), float(at))


def pod_record(pod: Mapping[str, Any]) -> PodRecord:
    """The pod informer's transform. A pod the kubelet could not read either (broken resources) is kept
    with no demand: it holds nothing the kubelet would give it."""
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        raise ValueError("pod without metadata")
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not isinstance(namespace, str):
        raise ValueError("pod without a name or namespace")
    spec = pod.get("spec")
    node = spec.get("nodeName") if isinstance(spec, dict) else None
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, dict) else None
    demand: Demand = ()
    exclusive = False
    try:
        request = parse_pod(pod)
    except PodError:
        request = None
    if request is not None:
        d = request.pod_demand
        demand = tuple((n, q) for n, q in ((CPU, d.cpu), *d.memory, *d.devices) if q > 0)
        steady = [c.requests for c in request.init_containers if c.sidecar] + [c.requests for c in request.containers]
        exclusive = _exclusive(request.qos, steady)
    annotations = meta.get("annotations")
    claim = parse_claim(annotations.get(PLACEMENT_ANNOTATION)) if isinstance(annotations, dict) else None
    return PodRecord(shorten(namespace, 63), shorten(name, 253), node if isinstance(node, str) else "",
                     phase if isinstance(phase, str) else "", _scheduled_at(pod, meta), exclusive, demand, claim)


@dataclass(frozen=True)
class InFlight:
    """The pods a node's object does not count yet, what they hold per zone (zone id → resource →
    amount), how that was found (``fingerprint``: a pod set's sign matched; ``window``: by time), the
    reason the object is too old to judge by ("" when it is not), and until when (Unix seconds) this
    answer holds if nothing changes."""

    pods: tuple[PodRecord, ...]
    reserved: Mapping[int, Mapping[str, int]]
    how: str
    stale: str = ""
    valid_until: float = float("inf")


def _sign(pods: Iterable[PodRecord], exclusive_only: bool) -> str:
    return podfingerprint.sign((p.namespace, p.name) for p in pods if p.exclusive or not exclusive_only)


def _reflected(topo: NodeTopology, unfinished: Sequence[PodRecord], bound: Sequence[PodRecord]) -> set[str] | None:
    """The keys of the pods the object's fingerprint counts; None when no candidate set matches."""
    expected = topo.pods_fingerprint
    exclusive_only = topo.pods_fingerprint_method == podfingerprint.METHOD_WITH_EXCLUSIVE_RESOURCES
    candidates: list[Sequence[PodRecord]] = [unfinished]
    if len(bound) != len(unfinished):
        candidates.append(bound)
    running = [p for p in unfinished if p.phase == RUNNING]
    if len(running) != len(unfinished):
        candidates.append(running)
    by_time = sorted(unfinished, key=lambda p: (p.scheduled_at if p.scheduled_at is not None else float("inf"),
                                                p.key))
    candidates += [by_time[:len(by_time) - k] for k in range(1, min(MAX_UNREFLECTED, len(by_time)) + 1)]
    for pods in candidates:
        if _sign(pods, exclusive_only) == expected:
            return {p.key for p in pods}
    return None


def _add(reserved: dict[int, dict[str, int]], zone: int, name: str, amount: int) -> None:
    held = reserved.setdefault(zone, {})
    held[name] = held.get(name, 0) + amount


def in_flight(topo: NodeTopology, bound: Iterable[PodRecord], claiming: Iterable[PodRecord], *, now: float,
              quiet_for: float, max_age: float, claim_ttl: float, exclude: str = "") -> InFlight:
    """What is in flight on ``topo``'s node. ``bound``: the pods bound to it; ``claiming``: unbound pods
    whose claim names it; ``now``: Unix seconds; ``quiet_for``: seconds since the node's pods or object
    last changed; ``exclude``: a pod key left out (the pod a bind is judging)."""
    bound = [p for p in bound if p.key != exclude]
    unfinished = [p for p in bound if not p.terminal]
    reflected: set[str] | None = None
    compatible = podfingerprint.compatible(topo.pods_fingerprint)
    if compatible:
        reflected = _reflected(topo, unfinished, bound)
    valid_until = float("inf")
    stale = ""
    if reflected is not None:
        flying = [p for p in unfinished if p.key not in reflected]
        how = "fingerprint"
    else:
        how = "window"
        flying = []
        for p in unfinished:
            if p.phase != RUNNING or p.scheduled_at is None:
                flying.append(p)
            elif now - p.scheduled_at <= max_age:
                flying.append(p)
                valid_until = min(valid_until, p.scheduled_at + max_age)
        if compatible:
            if quiet_for > max_age:
                stale = (f"NodeResourceTopology {shorten(topo.name, 63)}: its {podfingerprint.ATTRIBUTE} counts "
                         f"none of the sets of the {len(unfinished)} pods bound to the node, and nothing there "
                         f"changed for {quiet_for:.0f} s (more than --nrt-max-age {max_age:g} s): its publisher "
                         "is behind or down")
            else:
                valid_until = min(valid_until, now + max_age - quiet_for)
    zone_ids = [z.numa_id for z in topo.zones]
    reserved: dict[int, dict[str, int]] = {}
    pods: list[PodRecord] = []
    for p in flying:
        if not p.demand:
            continue
        pods.append(p)
        claim = p.claim
        _hold(reserved, p.demand, claim.amounts if claim is not None and claim.node == topo.name else (), zone_ids)
    for p in claiming:
        claim = p.claim
        if (p.key == exclude or p.node or claim is None or claim.node != topo.name or not p.demand
                or not 0 <= now - claim.at <= claim_ttl):
            continue
        pods.append(p)
        valid_until = min(valid_until, claim.at + claim_ttl)
        _hold(reserved, p.demand, claim.amounts, zone_ids)
    return InFlight(tuple(pods), reserved, how, stale, valid_until)


def _hold(reserved: dict[int, dict[str, int]], demand: Demand, claimed: Claims, zone_ids: Sequence[int]) -> None:
    """What one pod holds: its own exclusive demand (what its spec asks, whatever its annotation says), in
    the zones its claim names as far as the claim goes, the rest in every zone. A claim only says where:
    a pod's owner can write one, and must not make a zone look fuller than the pod could make it."""
    for name, need in demand:
        left = need
        for zone, claimed_name, amount in claimed:
            if claimed_name != name or left <= 0:
                continue
            part = min(amount, left)
            _add(reserved, zone, name, part)
            left -= part
        if left > 0:
            for zone in zone_ids:
                _add(reserved, zone, name, left)
