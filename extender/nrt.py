"""The API server's fleet: NodeResourceTopology objects and pods, watched, judged per node.

Three informers (``k8s.informer``) keep the view: the NodeResourceTopologies (each kept as
``k8s.nrt_read``'s compact model, or the reason it cannot be read), the pods bound to a node and the
unbound pods carrying a bind's claim (each kept as an ``inflight.PodRecord``). Everything a decision
reads lives in the API server, so any number of replicas hold the same view and decide alike.

Per node and pod shape (``ask.shape_key``), the judgement is:

1. the node's object: missing, unusable (``NrtReadError``'s reason) or stale (``inflight``: its pods
   fingerprint has not caught up for ``max_age``) → the node fails, unresolvable, with that reason;
2. what the kubelet will admit (``k8s.admission.admit``) on the zones' ``available`` less the pods in
   flight → the kubelet's reason (``TopologyAffinityError: …``, ``UnexpectedAdmissionError: …``);
   unresolvable when the node could not admit the pod even with nothing running;
3. for a pod memtopo places (hccs, xpu, place), memtopo's choice among the placements the kubelet
   accepts (``planner.zones``) → ``memtopo POLICY: …`` when none will do.

Judgements are cached per node and pod shape and dropped when that node's object, its pods or what is
in flight there changes: one changed object re-judges one node, never the fleet.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from memtopo.cpulist import format_cpulist
from memtopo.extender import inflight
from memtopo.extender.ask import DEVICE_RESOURCE, PodAsk, pod_ask, shape_key
from memtopo.extender.inflight import CLAIM_LABEL, Claims, InFlight, PodRecord, claim_label, pod_record
from memtopo.extender.wire import MAX_EXTENDER_PRIORITY, BindArgs, ExtenderError
from memtopo.k8s import kubeapi
from memtopo.k8s.admission import Alignment, PodError, PodRequest, admit, parse_pod
from memtopo.k8s.admission import Verdict as Admission
from memtopo.k8s.enforcement import PLACEMENT_ANNOTATION
from memtopo.k8s.informer import Informer, InformerStatus
from memtopo.k8s.kubeapi import KubeApi, KubeApiError
from memtopo.k8s.nrt_read import NodeTopology, NrtReadError, Zone, ZoneResource, read_nrt
from memtopo.k8s.resources import MEMORY, is_hugepages
from memtopo.k8s.scoring import Strategy, extender_score, score
from memtopo.logs import get_logger
from memtopo.planner import zones as zone_policies
from memtopo.text import shorten

log = get_logger(component="extender")

DEFAULT_MAX_AGE_S: Final = 120.0
DEFAULT_CLAIM_TTL_S: Final = 30.0
# memtopo's own score: its policy's rank where the pod has one, else LeastNUMANodes (see README).
MEMTOPO: Final = "memtopo"
STRATEGIES: Final = (MEMTOPO, *(s.value for s in Strategy))
# Pod shapes whose judgements are kept (the least recently asked goes first).
MAX_SHAPES: Final = 32
# Past this many nodes to judge afresh, the work leaves the event loop.
THREAD_THRESHOLD: Final = 64
# Node changes remembered for the pod shapes' views; a view further behind judges every node again.
CHANGE_LOG: Final = 1 << 16
BOUND: Final = "spec.nodeName!="
UNBOUND: Final = "spec.nodeName="


def read_object(obj: dict[str, Any]) -> NodeTopology | Exception:
    """The NodeResourceTopology informer's transform: the read model, or the reason it cannot be read."""
    try:
        return read_nrt(obj)
    except NrtReadError as exc:
        return exc


@dataclass(frozen=True, slots=True)
class NodeJudgement:
    """One node for one pod shape: the filter verdict (fits, or the reason and whether preemption could
    change it); for a fitting node the zones it goes to, what it holds there (claims) and memtopo's rank
    key (larger is better)."""

    fits: bool
    reason: str = ""
    unresolvable: bool = False
    key: tuple[float, ...] = ()
    placement: tuple[int, ...] = ()
    claims: Claims = ()
    detail: str = ""


def _keep_out_of_collections(event: str, **fields: int) -> None:
    """After the view gained objects by the ten thousand (the listing; a pod shape judged over the
    fleet), move every object out of the collector's generations (``gc.freeze``): they live until
    their node changes, and each full collection scanned them all, 17–45 ms of CPU that found
    nothing, in the middle of whatever verb it fell on (a filter over 5,000 nodes went from 40 to
    85 ms at p99). Collected first, so that no garbage cycle is frozen with them; frozen objects are
    still freed when their last reference goes. Costs this call one full collection."""
    collected = gc.collect()
    gc.freeze()
    log.info(event, collected=collected, frozen=gc.get_freeze_count(), **fields)


def _fail(reason: str, unresolvable: bool) -> NodeJudgement:
    return NodeJudgement(False, reason, unresolvable)


class NodeState:
    """One node as the informers show it: its object (or why it cannot be read), the pods bound to it,
    the unbound pods claiming it, and what is derived from them until the next change."""

    __slots__ = ("bound", "changed_at", "claims", "empty", "error", "facts", "flight", "name", "topology")

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.topology: NodeTopology | None = None
        self.error = ""
        self.bound: dict[str, PodRecord] = {}
        self.claims: dict[str, PodRecord] = {}
        self.changed_at = now
        self.flight: InFlight | None = None
        # (the object it was made from, that object with nothing running)
        self.empty: tuple[NodeTopology, NodeTopology] | None = None
        self.facts: dict[str, Mapping[int, zone_policies.ZoneFacts]] = {}

    def changed(self, now: float) -> None:
        self.changed_at = now
        self.flight = None
        self.empty = None
        self.facts = {}

    def set_flight(self, flight: InFlight) -> bool:
        """Keep ``flight``; True when it holds other amounts (or another staleness) than the last one."""
        old = self.flight
        self.flight = flight
        if old is not None and (old.reserved != flight.reserved or old.stale != flight.stale):
            self.facts = {}
            return True
        return False


@dataclass(frozen=True)
class PodInfo:
    """A pod as one request judges it: parsed once, its memtopo ask, its shape."""

    request: PodRequest
    ask: PodAsk
    shape: str
    zone_request: zone_policies.ZoneRequest | None

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> PodInfo:
        """The pod's info; pods of one shape (a ReplicaSet's) are read once (the last ones kept)."""
        shape = shape_key(pod)
        found = _INFOS.get(shape)
        if found is not None:
            return found
        try:
            request = parse_pod(pod)
        except PodError as exc:
            raise ExtenderError("invalid_pod", str(exc)) from None
        ask = pod_ask(pod)
        zreq = None
        if ask.policy in DEVICE_RESOURCE:
            zreq = zone_policies.ZoneRequest(ask.policy, devices=int(ask.request["request"]))
        elif ask.policy == "place":
            constraints = ask.request.get("constraints", {})
            zreq = zone_policies.ZoneRequest("place", allow_cxl=bool(constraints.get("allow_cxl_memory", False)))
        info = cls(request, ask, shape, zreq)
        if len(_INFOS) >= MAX_SHAPES:
            _INFOS.pop(next(iter(_INFOS)))
        _INFOS[shape] = info
        return info


_INFOS: dict[str, PodInfo] = {}


def _empty(topo: NodeTopology) -> NodeTopology:
    """The node with nothing running: every zone's available = allocatable."""
    zones = tuple(z._replace(resources=tuple(r._replace(available=r.allocatable) for r in z.resources))
                  for z in topo.zones)
    return topo._replace(zones=zones)


def _free(zone: Zone, resource: str, reserved: Mapping[int, Mapping[str, int]]) -> int:
    r = zone.resource(resource)
    if r is None:
        return 0
    return max(r.available - reserved.get(zone.numa_id, {}).get(resource, 0), 0)


def zone_facts(topo: NodeTopology, resource: str | None,
               reserved: Mapping[int, Mapping[str, int]]) -> dict[int, zone_policies.ZoneFacts]:
    """The node's alignable zones as ``planner.zones`` reads them; devices of ``resource``."""
    out: dict[int, zone_policies.ZoneFacts] = {}
    for z in topo.alignable_zones():
        m = z.memory
        groups: tuple[tuple[str, ...], ...] = ()
        if z.groups is not None and resource is not None:
            groups = z.groups.hccs_rings if resource == DEVICE_RESOURCE["hccs"] else z.groups.xpu_halves
        dev: ZoneResource | None = z.resource(resource) if resource is not None else None
        out[z.numa_id] = zone_policies.ZoneFacts(
            z.numa_id, (m.memory_type or "") if m is not None else "", m.tier if m is not None else None,
            m.read_bandwidth_mbps if m is not None else None, m.read_latency_ns if m is not None else None,
            groups, dev.allocatable if dev is not None else 0,
            _free(z, resource, reserved) if resource is not None else 0)
    return out


def _principal(admission: Admission, resource: str | None) -> Alignment | None:
    """The unit whose placement stands for the pod: the first app container (or the pod) hinting
    ``resource``, else the first with any hint."""
    units = [a for a in admission.alignments if not a.init] or list(admission.alignments)
    if resource is not None:
        found = next((a for a in units if resource in a.hinted), None)
        if found is not None:
            return found
    return next((a for a in units if a.hinted), units[0] if units else None)


def _kubelet_zones(admission: Admission) -> tuple[int, ...]:
    """Where the kubelet puts the pod's exclusive amounts: the zones of its claims, else of its choices."""
    zones = {z for z, _, _ in admission.claims}
    if not zones:
        zones = {z for a in admission.alignments if not a.init and a.choice for z in a.choice}
    return tuple(sorted(zones))


def claims_in(topo: NodeTopology, reserved: Mapping[int, Mapping[str, int]], demand: Iterable[tuple[str, int]],
              placement: Sequence[int]) -> Claims:
    """Each demanded amount taken from ``placement``'s zones first (NUMA order), then from any other zone
    with room, as the kubelet's allocators take leftovers."""
    free: dict[tuple[int, str], int] = {}
    order = sorted(placement) + sorted(z.numa_id for z in topo.zones if z.numa_id not in placement)
    zones = {z.numa_id: z for z in topo.zones}
    out: list[tuple[int, str, int]] = []
    for name, need in demand:
        left = need
        for zid in order:
            if left <= 0 or zid not in zones:
                break
            have = free.setdefault((zid, name), _free(zones[zid], name, reserved))
            part = min(left, have)
            if part > 0:
                free[zid, name] = have - part
                out.append((zid, name, part))
                left -= part
    return tuple(out)


def judge_node(topo: NodeTopology | None, error: str, flight: InFlight | None, info: PodInfo,
               empty: Callable[[], NodeTopology], facts: Callable[[str | None], Mapping[int, zone_policies.ZoneFacts]],
               name: str) -> NodeJudgement:
    """One node's judgement for one pod (see the module's description)."""
    if topo is None:
        # NrtReadError's message names the object and the field.
        reason = (f"memtopo: {error}" if error else
                  f"memtopo: no NodeResourceTopology named {shorten(name, 63)} (no publisher has written one)")
        return _fail(reason, True)
    assert flight is not None
    if flight.stale:
        return _fail(f"memtopo: {flight.stale}", True)
    admission = admit(topo, info.request, flight.reserved)
    if not admission.admit:
        unresolvable = not admit(empty(), info.request).admit
        return _fail(f"{admission.reason}: {admission.message}", unresolvable)
    kubelet = _kubelet_zones(admission)
    zreq = info.zone_request
    if zreq is None:
        return NodeJudgement(True, placement=kubelet, claims=admission.claims)
    resource = DEVICE_RESOURCE.get(zreq.policy)
    unit = _principal(admission, resource)
    accepted = unit.accepted if unit is not None else ()
    # The kubelet picks a device's zone itself wherever it aligns devices; CPUs and memory too under
    # its static managers. memtopo's node enforcement places them otherwise (the placement it writes).
    kubelet_places = topo.policy != "none" and unit is not None and unit.choice is not None and (
        resource is not None or topo.cpu_manager_policy == "static" or topo.memory_manager_policy == "Static")
    choice = zone_policies.choose(zreq, facts(resource), accepted, unit.choice if kubelet_places and unit else None)
    if choice.placement is None:
        return _fail(f"memtopo {zreq.policy}: {choice.reason}", choice.unresolvable)
    placement = tuple(sorted(choice.placement))
    claims = admission.claims
    if unit is None or unit.choice is None or placement != tuple(sorted(unit.choice)):
        # memtopo's placement, not the kubelet's: what the pod holds goes where memtopo puts it (the
        # node's enforcement pins it there).
        claims = claims_in(topo, flight.reserved, _demand(info.request), placement)
    return NodeJudgement(True, "", False, choice.key, placement, claims, choice.detail)


def _demand(request: PodRequest) -> tuple[tuple[str, int], ...]:
    d = request.pod_demand
    return tuple((n, q) for n, q in (("cpu", d.cpu), *d.memory, *d.devices) if q > 0)


class ShapeView:
    """Every node judged so far for one pod shape, kept until that node changes: the judgements, the
    failing ones apart (filter answers from them without looking at every passing node) and the scores
    asked for (strategy → 0–10 per node). ``seen``: the fleet's change log position it has caught up to."""

    __slots__ = ("failed", "info", "judged", "scores", "seen")

    def __init__(self, info: PodInfo, seen: int) -> None:
        self.info = info
        self.seen = seen
        self.judged: dict[str, NodeJudgement] = {}
        self.failed: dict[str, NodeJudgement] = {}
        self.scores: dict[str, dict[str, int]] = {}

    def forget(self, name: str) -> None:
        self.judged.pop(name, None)
        self.failed.pop(name, None)
        for table in self.scores.values():
            table.pop(name, None)

    def forget_all(self) -> None:
        self.judged.clear()
        self.failed.clear()
        self.scores.clear()

    def put(self, name: str, j: NodeJudgement) -> None:
        self.judged[name] = j
        if not j.fits:
            self.failed[name] = j


@dataclass
class NrtJudgement:
    """A request's judgements: those of its pod shape's view, and the candidates no object names."""

    info: PodInfo
    view: ShapeView
    unknown: Mapping[str, NodeJudgement] = field(default_factory=dict)

    def failures(self, names: Sequence[str]) -> dict[str, NodeJudgement]:
        """The failing candidates among ``names``."""
        failed = self.view.failed
        out: dict[str, NodeJudgement]
        if len(failed) * 4 < len(names):
            wanted = set(names)
            out = {n: j for n, j in failed.items() if n in wanted}
        else:
            out = {n: failed[n] for n in names if n in failed}
        out.update(self.unknown)
        return out

    def node(self, name: str) -> NodeJudgement | None:
        return self.view.judged.get(name) or self.unknown.get(name)


class NrtFleet:
    """The fleet from the API server (see the module's description). Run :meth:`run` as a task."""

    def __init__(self, api: KubeApi, *, max_age: float = DEFAULT_MAX_AGE_S, claim_ttl: float = DEFAULT_CLAIM_TTL_S,
                 strategy: str = MEMTOPO, weights: Mapping[str, int] | None = None,
                 wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic,
                 **informer_options: Any) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"score strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.api = api
        self.max_age = max_age
        self.claim_ttl = claim_ttl
        self.strategy = strategy
        self.weights = dict(weights or {})
        self.wall = wall
        self.clock = clock
        self.states: dict[str, NodeState] = {}
        # Which node changed, in order: each pod shape's view forgets those nodes when it catches up.
        self._seq = 0
        self._log: deque[tuple[int, str]] = deque(maxlen=CHANGE_LOG)
        self._views: OrderedDict[str, ShapeView] = OrderedDict()
        # (Unix seconds, node) when a node's pods in flight may change with time alone.
        self._expiries: list[tuple[float, str]] = []
        self._score_strategy = Strategy.LEAST_NUMA_NODES if strategy == MEMTOPO else Strategy(strategy)
        self._pod_node: dict[str, str] = {}
        self._claim_node: dict[str, str] = {}
        self.nrts: Informer[NodeTopology] = Informer(api, kubeapi.nrt_path(), read_object, on_upsert=self.nrt_changed,
                                                     on_delete=self._nrt_delete, clock=clock, **informer_options)
        self.pods: Informer[PodRecord] = Informer(api, kubeapi.core("pods"), pod_record, field_selector=BOUND,
                                                  on_upsert=self._pod_upsert, on_delete=self._pod_delete,
                                                  clock=clock, **informer_options)
        self.claims: Informer[PodRecord] = Informer(api, kubeapi.core("pods"), pod_record, label_selector=CLAIM_LABEL,
                                                    field_selector=UNBOUND, on_upsert=self._claim_upsert,
                                                    on_delete=self._claim_delete, clock=clock, **informer_options)

    # ---- the informers' callbacks (on the loop) --------------------------------------------------
    def _logged(self, name: str) -> None:
        self._seq += 1
        self._log.append((self._seq, name))

    def _state(self, name: str) -> NodeState:
        st = self.states.get(name)
        if st is None:
            st = self.states[name] = NodeState(name, self.clock())
        return st

    def _drop_if_empty(self, st: NodeState) -> None:
        if st.topology is None and not st.error and not st.bound and not st.claims:
            self.states.pop(st.name, None)

    def nrt_changed(self, key: str, value: NodeTopology | Exception) -> None:
        """A node's object as the informer read it (``read_object``): the node is judged afresh."""
        st = self._state(key)
        if isinstance(value, Exception):
            st.topology, st.error = None, shorten(str(value), 300)
        else:
            st.topology, st.error = value, ""
        st.changed(self.clock())
        self._logged(key)

    def _nrt_delete(self, key: str, value: NodeTopology | Exception) -> None:
        st = self.states.get(key)
        if st is not None:
            st.topology, st.error = None, ""
            st.changed(self.clock())
            self._logged(key)
            self._drop_if_empty(st)

    def _move(self, where: dict[str, str], key: str, node: str, record: PodRecord | None,
              slot: Callable[[NodeState], dict[str, PodRecord]]) -> None:
        old = where.pop(key, None)
        now = self.clock()
        if old is not None:
            st = self.states.get(old)
            if st is not None:
                slot(st).pop(key, None)
                st.changed(now)
                self._logged(old)
                self._drop_if_empty(st)
        if record is not None and node:
            where[key] = node
            st = self._state(node)
            slot(st)[key] = record
            st.changed(now)
            self._logged(node)

    def _pod_upsert(self, key: str, value: PodRecord | Exception) -> None:
        record = value if isinstance(value, PodRecord) else None
        self._move(self._pod_node, key, record.node if record else "", record, lambda st: st.bound)

    def _pod_delete(self, key: str, value: PodRecord | Exception) -> None:
        self._move(self._pod_node, key, "", None, lambda st: st.bound)

    def _claim_upsert(self, key: str, value: PodRecord | Exception) -> None:
        record = value if isinstance(value, PodRecord) and value.claim is not None and not value.node else None
        node = record.claim.node if record is not None and record.claim is not None else ""
        self._move(self._claim_node, key, node, record, lambda st: st.claims)

    def _claim_delete(self, key: str, value: PodRecord | Exception) -> None:
        self._move(self._claim_node, key, "", None, lambda st: st.claims)

    # ---- running --------------------------------------------------------------------------------
    async def run(self) -> None:
        """The informers, until cancelled. Once all three have listed, the objects of the view are moved
        out of the garbage collector's generations (see _keep_out_of_collections)."""
        async with asyncio.TaskGroup() as group:
            for informer in (self.nrts, self.pods, self.claims):
                group.create_task(informer.run())
            for informer in (self.nrts, self.pods, self.claims):
                await informer.wait_synced()
            _keep_out_of_collections("extender_view_synced", nodes=len(self.states))

    def stop(self) -> None:
        for informer in (self.nrts, self.pods, self.claims):
            informer.stop()

    def informers(self) -> dict[str, InformerStatus]:
        return {"noderesourcetopologies": self.nrts.status(), "pods": self.pods.status(),
                "claims": self.claims.status()}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready once every informer listed, and while none has been stale for longer than max_age."""
        now = self.clock()
        out: dict[str, Any] = {"fleet": "nrt", "nodes": len(self.states)}
        ready = True
        for name, st in self.informers().items():
            stale_for = st.stale_for(now)
            ok = st.synced and stale_for <= self.max_age
            ready = ready and ok
            out[name] = {"synced": st.synced, "stale_seconds": round(stale_for, 3), "objects": st.objects,
                         "errors": st.errors, "relists": st.relists, "restarts": st.restarts,
                         **({"last_error": st.last_error} if st.last_error else {})}
        out["status"] = "ok" if ready else "stale" if all(s.synced for s in self.informers().values()) else "syncing"
        return ready, out

    def gauges(self) -> Iterable[tuple[str, str, dict[str, str], float]]:
        now = self.clock()
        for name, st in self.informers().items():
            labels = {"resource": name}
            yield "view_synced", "1 once the informer's first list is stored", labels, float(st.synced)
            yield "view_stale_seconds", "Seconds the informer's watch has been broken (0 while it works)", \
                labels, st.stale_for(now)
            yield "view_relists", "Lists after the first (410 Gone)", labels, float(st.relists)
            yield "view_watch_restarts", "Watches started again after one ended or broke", labels, float(st.restarts)
            yield "view_objects", "Objects the informer holds", labels, float(st.objects)
            yield "view_bad_objects", "Objects the informer holds as the reason they cannot be read", labels, \
                float(st.errors)

    # ---- judging --------------------------------------------------------------------------------
    def _flight(self, st: NodeState, now: float) -> InFlight | None:
        topo = st.topology
        if topo is None:
            return None
        flight = st.flight
        if flight is None or flight.valid_until < now:
            flight = inflight.in_flight(topo, list(st.bound.values()), list(st.claims.values()), now=now,
                                        quiet_for=self.clock() - st.changed_at, max_age=self.max_age,
                                        claim_ttl=self.claim_ttl)
            if st.set_flight(flight):
                self._logged(st.name)
            if flight.valid_until != float("inf"):
                heapq.heappush(self._expiries, (flight.valid_until, st.name))
        return flight

    def _expire(self, now: float) -> None:
        """Nodes whose pods in flight change with time alone (a window closes, a claim lapses, an object
        turns stale): judged again."""
        heap = self._expiries
        while heap and heap[0][0] < now:
            _, name = heapq.heappop(heap)
            st = self.states.get(name)
            if st is not None and st.flight is not None and st.flight.valid_until < now:
                self._flight(st, now)
                self._logged(name)

    def _view(self, info: PodInfo) -> ShapeView:
        view = self._views.get(info.shape)
        if view is None:
            view = self._views[info.shape] = ShapeView(info, self._seq)
            while len(self._views) > MAX_SHAPES:
                self._views.popitem(last=False)
            return view
        self._views.move_to_end(info.shape)
        if view.seen != self._seq:
            log = self._log
            if not log or log[0][0] > view.seen + 1:
                view.forget_all()  # further behind than the log remembers
            else:
                for seq, name in reversed(log):
                    if seq <= view.seen:
                        break
                    view.forget(name)
            view.seen = self._seq
        return view

    def _judge_state(self, st: NodeState, flight: InFlight | None, info: PodInfo) -> NodeJudgement:
        """One node's judgement; may run in a worker thread while the loop changes the node: what it
        derives goes into the caches it started with (replaced whole by a change), never the new ones."""
        topo = st.topology
        cache = st.facts

        def empty() -> NodeTopology:
            assert topo is not None
            held = st.empty
            if held is not None and held[0] is topo:
                return held[1]
            found = _empty(topo)
            st.empty = (topo, found)
            return found

        def facts(resource: str | None) -> Mapping[int, zone_policies.ZoneFacts]:
            key = resource or ""
            found = cache.get(key)
            if found is None:
                assert topo is not None and flight is not None
                found = cache[key] = zone_facts(topo, resource, flight.reserved)
            return found

        return judge_node(topo, st.error, flight, info, empty, facts, st.name)

    async def judge(self, pod: Mapping[str, Any], names: Sequence[str]) -> NrtJudgement:
        """Every candidate judged for the pod: from its shape's view where that node did not change
        since, afresh otherwise (off the loop when there are many)."""
        info = PodInfo.of(pod)
        now = self.wall()
        self._expire(now)
        view = self._view(info)
        judged = view.judged
        missing = [n for n in names if n not in judged]
        if not missing:
            return NrtJudgement(info, view)
        unknown: dict[str, NodeJudgement] = {}
        todo: list[tuple[str, NodeState, InFlight | None]] = []
        get = self.states.get
        for name in missing:
            st = get(name)
            if st is None:
                unknown[name] = _missing(name)
            else:
                todo.append((name, st, self._flight(st, now)))
        if todo:
            def work() -> list[tuple[str, NodeJudgement]]:
                return [(name, self._judge_state(st, flight, info)) for name, st, flight in todo]
            done = await asyncio.to_thread(work) if len(todo) > THREAD_THRESHOLD else work()
            # A node that changed meanwhile is logged after the view's position: forgotten at the next
            # catch-up, so its judgement here serves this request only.
            for name, j in done:
                view.put(name, j)
            if len(todo) > THREAD_THRESHOLD:
                _keep_out_of_collections("extender_view_judged", shape_nodes=len(todo))
        return NrtJudgement(info, view, unknown)

    def scores(self, judgement: NrtJudgement, names: Sequence[str]) -> list[int]:
        """0–10 per name: the configured strategy (see ``STRATEGIES``); 0 for a node that does not fit."""
        info = judgement.info
        view = judgement.view
        judged = view.judged
        if self.strategy == MEMTOPO and info.zone_request is not None:
            keys: list[tuple[float, ...] | None] = []
            for n in names:
                j = judged.get(n)
                keys.append(j.key if j is not None and j.fits else None)
            present = sorted({k for k in keys if k is not None}, reverse=True)
            rank = {k: max(1, MAX_EXTENDER_PRIORITY - i) for i, k in enumerate(present)}
            return [rank[k] if k is not None else 0 for k in keys]
        strategy = self._score_strategy
        table = view.scores.setdefault(strategy.value, {})
        for name in names:
            if name in table:
                continue
            j = judged.get(name)
            st = self.states.get(name)
            if j is None or not j.fits or st is None or st.topology is None:
                continue
            reserved = st.flight.reserved if st.flight is not None else None
            table[name] = extender_score(score(st.topology, info.request, strategy, self.weights, reserved))
        get = table.get
        return [get(n, 0) for n in names]

    # ---- bind -----------------------------------------------------------------------------------
    async def _fresh(self, api: KubeApi, node: str) -> tuple[list[PodRecord], list[PodRecord]]:
        """The pods bound to ``node`` and the unbound pods claiming it, read from the API server now
        (not from the informers, which may lag another replica's bind)."""
        pods = kubeapi.core("pods")
        bound = await api.list(pods, {"fieldSelector": f"spec.nodeName={node}"})
        claims = await api.list(pods, {"labelSelector": f"{CLAIM_LABEL}={claim_label(node)}"})
        records: list[list[PodRecord]] = [[], []]
        for i, listed in enumerate((bound.items, claims.items)):
            for obj in listed:
                try:
                    records[i].append(pod_record(obj))
                except ValueError:
                    continue
        return records[0], [r for r in records[1] if not r.node]

    async def _node(self, api: KubeApi, node: str) -> NodeTopology:
        try:
            obj = await api.get(kubeapi.nrt_path(node), action=f"read NRT {node}")
        except KubeApiError as exc:
            if exc.kind == "not_found":
                raise ExtenderError("no_fit", f"bind: no NodeResourceTopology named {node}") from None
            raise ExtenderError("api", f"bind: {exc}") from exc
        try:
            return read_nrt(obj)
        except NrtReadError as exc:
            raise ExtenderError("no_fit", f"bind: {exc}") from None

    async def _judge_fresh(self, api: KubeApi, topo: NodeTopology, info: PodInfo,
                           key: str) -> tuple[NodeJudgement, InFlight]:
        bound, claiming = await self._fresh(api, topo.name)
        st = self.states.get(topo.name)
        quiet = self.clock() - st.changed_at if st is not None else 0.0
        flight = inflight.in_flight(topo, bound, claiming, now=self.wall(), quiet_for=quiet, max_age=self.max_age,
                                    claim_ttl=self.claim_ttl, exclude=key)
        empty = _empty(topo)
        j = judge_node(topo, "", flight, info, lambda: empty,
                       lambda resource: zone_facts(topo, resource, flight.reserved), topo.name)
        return j, flight

    async def bind(self, api: KubeApi, args: BindArgs, pod: Mapping[str, Any]) -> dict[str, str]:
        """Claim the zones (the placement annotation and the claim label), read every claim and bound pod
        on the node back from the API server, and bind only if the pod still fits with all of them
        counted: of two binds racing for one zone, at least the later one sees the earlier one's claim.
        A bind that loses takes its claim back and answers an Error (kube-scheduler tries the pod again)."""
        info = PodInfo.of(pod)
        key = f"{args.namespace}/{args.name}"
        topo = await self._node(api, args.node)
        first, _ = await self._judge_fresh(api, topo, info, key)
        if not first.fits:
            raise ExtenderError("no_fit", f"bind: {args.node} no longer fits pod {key}: {first.reason}")
        doc = _placement(args.node, info, first, self.wall())
        annotations = {PLACEMENT_ANNOTATION: json.dumps(doc, separators=(",", ":"))}
        path = kubeapi.core("pods", args.name, namespace=args.namespace)
        try:
            await api.merge_patch(path, {"metadata": {"annotations": annotations,
                                                      "labels": {CLAIM_LABEL: claim_label(args.node)}}},
                                  action=f"claim {key} on {args.node}")
            second, flight = await self._judge_fresh(api, topo, info, key)
            lost = _lost(topo, second, first.claims, flight.reserved)
            if lost:
                await self._unclaim(api, path, key)
                raise ExtenderError("conflict", f"bind: {key} → {args.node}: {lost} (another bind claimed it "
                                                "meanwhile); kube-scheduler will try the pod again")
            await api.bind_pod(args.namespace, args.name, args.uid, args.node)
        except KubeApiError as exc:
            await self._unclaim(api, path, key)
            raise ExtenderError("api", f"bind: {key} → {args.node}: {exc}") from exc
        log.info("extender_bound", pod=key, node=args.node, policy=info.ask.policy, zones=list(first.placement),
                 detail=first.detail or None)
        return annotations

    async def _unclaim(self, api: KubeApi, path: kubeapi.ApiPath, key: str) -> None:
        try:
            await api.merge_patch(path, {"metadata": {"annotations": {PLACEMENT_ANNOTATION: None},
                                                      "labels": {CLAIM_LABEL: None}}}, action=f"unclaim {key}")
        except KubeApiError as exc:  # the claim then lapses after claim_ttl
            log.warning("extender_unclaim_failed", pod=key, error=shorten(str(exc), 200))


def _missing(name: str) -> NodeJudgement:
    return _fail(f"memtopo: no NodeResourceTopology named {shorten(name, 63)} (no publisher has written one)", True)


def _lost(topo: NodeTopology, judgement: NodeJudgement, claims: Claims,
          reserved: Mapping[int, Mapping[str, int]]) -> str:
    """Why the claimed amounts no longer fit with every other claim and pod in flight counted ("" when
    they do): the pod must still be admitted, and each zone must still hold what this pod claimed there."""
    if not judgement.fits:
        return judgement.reason
    wanted: dict[tuple[int, str], int] = {}
    for zone, name, amount in claims:
        wanted[zone, name] = wanted.get((zone, name), 0) + amount
    zones = {z.numa_id: z for z in topo.zones}
    for (zone, name), amount in sorted(wanted.items()):
        z = zones.get(zone)
        have = _free(z, name, reserved) if z is not None else 0
        if have < amount:
            return f"zone node-{zone} has {have} {name} left for the {amount} this pod claimed"
    return ""


def _placement(node: str, info: PodInfo, j: NodeJudgement, now: float) -> dict[str, Any]:
    """The ``memtopo.io/placement`` a bind writes: the NUMA zones, what the pod holds in each (its claim,
    which every replica counts until the node's object does) and, for the node's enforcement, the
    memory nodes."""
    amounts: dict[str, dict[str, int]] = {}
    for zone, name, amount in j.claims:
        amounts.setdefault(str(zone), {})[name] = amounts.get(str(zone), {}).get(name, 0) + amount
    memory = sorted({z for z, n, _ in j.claims if n == MEMORY or is_hugepages(n)}) or list(j.placement)
    doc: dict[str, Any] = {"node": node, "source": "nrt", "policy": info.ask.policy or "kubelet",
                           "zones": list(j.placement), "claims": amounts, "at": round(now, 3)}
    if memory:
        doc["memory"] = {"nodes": format_cpulist(memory)}
    if j.detail:
        doc["detail"] = j.detail
    return doc
