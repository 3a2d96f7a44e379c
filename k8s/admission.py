"""What the kubelet will admit: a node's NodeResourceTopology and a pod in, the kubelet's verdict out.

Pure (no I/O): :func:`parse_pod` reads the Pod JSON the scheduler extender receives (once per pod);
:func:`admit` judges it against one node's :class:`~memtopo.k8s.nrt_read.NodeTopology`, less what the
caller holds reserved in flight, as the kubelet's Topology Manager and its hint providers would: admit or
reject with the kubelet's reason, the NUMA placements it would accept as aligned, the one it would pick,
and the exclusive amounts it would take per NUMA zone.

The kubelet's rules mirrored here, each with the source it was read from (kubernetes/kubernetes unless
named otherwise):

1. QoS class (``pkg/apis/core/v1/helper/qos/qos.go``, ``GetPodQOS``): ``status.qosClass`` when set;
   else BestEffort when no container requests or limits CPU or memory above zero, Guaranteed when every
   container (init ones included) has CPU and memory limits above zero and the summed requests equal the
   summed limits, Burstable otherwise. Requests a container leaves out default to its limits
   (``pkg/apis/core/v1/defaults.go``, ``SetDefaults_Pod``), as the API server stores the pod.
2. CPU hints (``pkg/kubelet/cm/cpumanager/policy_static.go``, ``guaranteedCPUs``,
   ``GetTopologyHints``): only under the ``static`` CPU manager, only for Guaranteed pods, only for an
   integral CPU request (``Value()*1000 == MilliValue()``); anything else runs in the shared pool and
   gives no hint. Under the ``none`` CPU manager CPUs never give a hint.
3. CPU hint generation (``generateCPUTopologyHints``): every combination of the NUMA nodes that have
   CPUs; a combination is a hint when its available CPUs cover the request; it is *preferred* when its
   size equals the smallest combination whose CPUs in total (NRT ``capacity``: reserved ones included,
   as ``CPUDetails`` counts them) could cover it.
4. Memory and ``hugepages-*`` hints (``pkg/kubelet/cm/memorymanager/policy_static.go``,
   ``GetTopologyHints``, ``calculateHints``, ``getRequestedResources``): only under the ``Static``
   memory manager and only for Guaranteed pods; all memory types of a container are hinted together
   (one combination must hold every type); the smallest combination is counted on ``allocatable``, a
   hint needs the free (NRT ``available``) amounts. A request that is not a whole number of bytes is an
   allocation error. When no combination can hold the request the memory manager gives no hint at all
   (the Topology Manager reads that as "no preference") and its ``Allocate`` then fails.
5. Device hints (``pkg/kubelet/cm/devicemanager/topology_hints.go``, ``GetTopologyHints``,
   ``generateDeviceTopologyHints``, ``getPodDeviceRequest``): for every QoS class; the request is the
   container's *limit*; the smallest combination is counted on all devices (NRT ``capacity``); when
   fewer devices are available than requested the hint list is empty (a preference that cannot be
   met). A zero request still gives hints: every single NUMA node is a preferred one.
6. What has NUMA affinity at all: a resource listed in no zone of the node is node-level only and never
   checked per zone (scheduler-plugins' ``isHostLevelResource``; the kubelet's device manager gives no
   hint for a device without topology, ``deviceHasTopologyAlignment``). Every other resource a zone
   lists, ``nvidia.com/gpu``, ``vendor/nic1`` or any other name besides ``cpu``, ``memory`` and
   ``hugepages-*``, is a device-plugin resource.
7. Merging (``pkg/kubelet/cm/topologymanager/policy.go``, ``filterProvidersHints``,
   ``mergePermutation``, ``HintMerger``): a provider with no hints is "no preference"; an empty list is
   a preference that cannot be met; a permutation merges to the AND of its masks and is preferred only
   when every hint in it is preferred *and* all their masks are equal. So an aligned placement is a
   combination every hinted resource prefers: the intersection of their preferred sets. The best hint is
   the narrowest preferred one (fewest NUMA nodes, then lowest-numbered); without one, the non-preferred
   merged mask with the most nodes up to the largest of the resources' narrowest hints
   (``BestNonPreferredAffinityCount``), else the narrowest.
8. Policies: ``single-numa-node`` (``policy_single_numa_node.go``: only preferred single-NUMA hints
   survive ``filterSingleNumaHints``; admit when the best hint is preferred), ``restricted``
   (``policy_restricted.go``: admit when the best hint is preferred), ``best-effort``
   (``policy_best_effort.go``: always admits the merge) and ``none`` (``policy_none.go``, scope
   ``none``: no hints, every container goes straight to allocation). A rejection by the merge is the
   kubelet's ``TopologyAffinityError``; a failed allocation afterwards (too few CPUs, devices or memory
   left on the node for an exclusive request: ``allocateCPUs``, ``devicesToAllocate``, the memory
   manager's ``getDefaultHint``) is its ``UnexpectedAdmissionError``.
9. Container scope (``scope_container.go``): each container in order, init containers first, merged and
   allocated on its own. An init container's exclusive resources are reused by the containers after it
   (``cpusToReuse``, ``initContainersReusableMemory``, ``devicesToReuse``), so each init container is
   judged alone against what the node has, and only app containers and restartable init containers
   (sidecars, which keep theirs) take resources from the zones for the next ones — as scheduler-plugins'
   ``singleNUMAContainerLevelHandler`` does too.
10. Pod scope (``scope_pod.go``; ``podGuaranteedCPUs``, ``getPodRequestedResources``,
    component-helpers ``PodLimits``): one merge for the whole pod, over max(the largest init container
    plus the sidecars started before it, the app containers plus all sidecars), resource by resource.
    The memory manager only counts memory types an app container requests.

What a scheduler-side mirror cannot know, and so assumes:

- The kubelet's exact free CPUs and devices, only their counts per NUMA zone (the NRT's ``available``,
  which the caller lowers by its own in-flight reservations). The free counts decide hints exactly.
- The memory manager's multi-NUMA groups (a NUMA node that already serves a cross-NUMA allocation cannot
  serve a single-NUMA one, and the reverse): the NRT does not say; none are assumed, so a node whose
  memory is split into groups may still reject what is admitted here.
- In container scope, which CPUs and devices an init container got: the kubelet requires a later
  container's CPU and device hints to cover the NUMA nodes of the CPUs and devices it may reuse from
  an init container (the reusable loop in ``generateCPUTopologyHints``). Not followed here: a pod
  whose init container lands on another NUMA node than its app containers may be admitted here and
  rejected by the kubelet.
- Topology Manager policy options (``prefer-closest-numa-nodes``, ``max-allowable-numa-nodes``) and CPU
  manager options (``full-pcpus-only``, ``distribute-cpus-across-numa``): the NRT carries none; their
  defaults are assumed. Pod-level resources (``spec.resources``) are not read.
- Zones with NUMA id 64 or more cannot be aligned to (the kubelet's mask is 64 bits); they are left out,
  as scheduler-plugins leaves them out. ``restricted`` and ``best-effort`` enumerate NUMA combinations
  as the kubelet does; past :data:`MAX_ENUMERATED_ZONES` zones (the kubelet itself refuses more than 8
  unless raised) a pod with hinted resources gets the reason ``TopologyTooWide`` instead of a guess.

Where scheduler-plugins' filter departs from these rules (``tests/test_k8s_admission.py`` shows each):
it requires a zone with enough CPU for Guaranteed pods with a fractional CPU request (rule 2), checks
memory per zone whatever the memory manager policy (rule 4), ignores zero requests (rule 5), does not
judge ``restricted`` at all (rule 8) and counts the pod overhead in pod scope (rule 10 leaves it out).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from itertools import combinations
from types import MappingProxyType
from typing import Any, Final, NamedTuple, NoReturn

from memtopo.k8s.nrt_read import NodeTopology, Zone
from memtopo.k8s.quantity import QuantityError, ceil_int, format_bytes, format_milli, milli, parse_nonnegative
from memtopo.k8s.resources import CPU, MEMORY, is_hugepages
from memtopo.text import excerpt, shorten

GUARANTEED: Final = "Guaranteed"
BURSTABLE: Final = "Burstable"
BEST_EFFORT: Final = "BestEffort"
QOS_CLASSES: Final = (GUARANTEED, BURSTABLE, BEST_EFFORT)

# The kubelet's admission reasons (lifecycle.PodAdmitResult.Reason), and memtopo's own for a node it
# will not guess about.
TOPOLOGY_AFFINITY_ERROR: Final = "TopologyAffinityError"
UNEXPECTED_ADMISSION_ERROR: Final = "UnexpectedAdmissionError"
TOPOLOGY_TOO_WIDE: Final = "TopologyTooWide"
# TopologyAffinityError.Error() in the kubelet.
AFFINITY_MESSAGE: Final = "Resources cannot be allocated with Topology locality"

# restricted and best-effort look at NUMA combinations, 2^n of them; past this many zones memtopo
# gives a reason rather than a long computation (the kubelet refuses more than 8 by default).
MAX_ENUMERATED_ZONES: Final = 16
# best-effort's pick among unaligned hints merges every permutation of the hints: only this small.
MAX_MERGED_ZONES: Final = 8
# A pod with more containers, or a container with more resources, than this is refused as malformed.
MAX_CONTAINERS: Final = 256
MAX_RESOURCES: Final = 64
MAX_NAME: Final = 320

# Zone id → resource → amount the caller holds in flight there (binds the NRT does not show yet).
Reserved = Mapping[int, Mapping[str, Fraction | int]]


class PodError(ValueError):
    """The pod JSON is not one memtopo can judge; the message names the field and quotes an excerpt."""


class ContainerRequest(NamedTuple):
    name: str
    requests: Mapping[str, Fraction]
    limits: Mapping[str, Fraction]
    # An init container with restartPolicy Always (a sidecar): it keeps running beside the app containers.
    sidecar: bool = False


class UnitDemand(NamedTuple):
    """What a container, or the pod as a whole, asks of the kubelet's hint providers, before a node's
    manager policies and resource lists narrow it: integral CPUs and memory types in bytes (Guaranteed
    pods only), and every other resource as a count of devices (its limit)."""

    cpu: int
    memory: tuple[tuple[str, int], ...]
    devices: tuple[tuple[str, int], ...]
    # Why the memory manager cannot read the request (a size that is not whole bytes); "" when it can.
    broken: str = ""

    def names(self) -> set[str]:
        return {CPU, *(n for n, _ in self.memory), *(n for n, _ in self.devices)}


class PodRequest(NamedTuple):
    """What the kubelet reads of a pod: its QoS class, every container's requests and limits, and the
    demands its hint providers derive from them: ``demands[i]`` for the i-th of the init containers then
    the app containers, ``pod_demand`` for the pod as a whole (pod scope)."""

    name: str
    qos: str
    init_containers: tuple[ContainerRequest, ...]
    containers: tuple[ContainerRequest, ...]
    overhead: Mapping[str, Fraction]
    demands: tuple[UnitDemand, ...] = ()
    pod_demand: UnitDemand = UnitDemand(0, (), ())


class Alignment(NamedTuple):
    """The Topology Manager's view of one unit it aligns: a container (container scope) or the pod.

    ``accepted``: the NUMA placements (zone ids) the kubelet would take as aligned — its preferred merged
    hints — narrowest first; ``choice``: the one it picks (its best hint), None when nothing in the unit
    gives a NUMA hint (any placement) or when best-effort's unaligned pick is not mirrored (more than
    :data:`MAX_MERGED_ZONES` zones); ``aligned``: the choice is one of ``accepted``."""

    container: str | None
    init: bool
    hinted: tuple[str, ...]
    accepted: tuple[tuple[int, ...], ...]
    choice: tuple[int, ...] | None
    aligned: bool


class Verdict(NamedTuple):
    """The kubelet's answer. ``reason`` and ``message`` are empty when it admits; ``claims`` are the
    exclusive amounts it would take per zone (zone id, resource, amount) for the app containers and
    sidecars, which the caller can hold as reserved until the node's NRT shows them: from the chosen
    placement's zones, lowest NUMA id first; where there is no choice (the none policy) the zones are
    the lowest-numbered with room, a guess at where the kubelet's allocators take them."""

    admit: bool
    reason: str
    message: str
    qos: str
    alignments: tuple[Alignment, ...] = ()
    claims: tuple[tuple[int, str, int], ...] = ()

    def claimed(self) -> dict[int, dict[str, int]]:
        """``claims`` as zone id → resource → amount, the shape of a :data:`Reserved` map."""
        out: dict[int, dict[str, int]] = {}
        for zone, name, amount in self.claims:
            out.setdefault(zone, {})[name] = out.get(zone, {}).get(name, 0) + amount
        return out


# ---- the pod ---------------------------------------------------------------------------------------

class _PodReader:
    def __init__(self, who: str) -> None:
        self.who = who

    def fail(self, where: str, problem: str) -> NoReturn:
        raise PodError(f"pod {self.who}: {where}: {problem}")

    def mapping(self, value: object, where: str) -> Mapping[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(where, f"not an object: {excerpt(repr(value))}")
        return value

    def quantities(self, value: object, where: str) -> dict[str, Fraction]:
        out: dict[str, Fraction] = {}
        items = self.mapping(value, where)
        if len(items) > MAX_RESOURCES:
            self.fail(where, f"{len(items)} resources, more than the {MAX_RESOURCES} memtopo reads")
        for name, raw in items.items():
            if not isinstance(name, str) or not name or len(name) > MAX_NAME:
                self.fail(where, f"{excerpt(repr(name))} is not a resource name")
            try:
                out[name] = parse_nonnegative(raw)
            except QuantityError as exc:
                self.fail(f"{where}[{shorten(name)}]", str(exc))
        return out

    def container(self, value: object, where: str, init: bool) -> ContainerRequest:
        entry = self.mapping(value, where)
        name = entry.get("name", "")
        if not isinstance(name, str) or len(name) > MAX_NAME:
            self.fail(f"{where}.name", f"not a container name: {excerpt(repr(name))}")
        resources = self.mapping(entry.get("resources"), f"{where}.resources")
        limits = self.quantities(resources.get("limits"), f"{where}.resources.limits")
        requests = self.quantities(resources.get("requests"), f"{where}.resources.requests")
        # The API server's defaulting: a request left out is the limit.
        requests = {**limits, **requests}
        policy = entry.get("restartPolicy")
        if policy is not None and not isinstance(policy, str):
            self.fail(f"{where}.restartPolicy", f"not a string: {excerpt(repr(policy))}")
        return ContainerRequest(name, MappingProxyType(requests), MappingProxyType(limits),
                                init and policy == "Always")

    def containers(self, value: object, where: str, init: bool) -> tuple[ContainerRequest, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            self.fail(where, f"not a list: {excerpt(repr(value))}")
        if len(value) > MAX_CONTAINERS:
            self.fail(where, f"{len(value)} containers, more than the {MAX_CONTAINERS} memtopo reads")
        return tuple(self.container(c, f"{where}[{i}]", init) for i, c in enumerate(value))


def qos_class(containers: Iterable[ContainerRequest]) -> str:
    """The QoS class as ``ComputePodQOS`` computes it from the containers (init ones included)."""
    requests: dict[str, Fraction] = {}
    limits: dict[str, Fraction] = {}
    guaranteed = True
    for c in containers:
        for name, q in c.requests.items():
            if name in (CPU, MEMORY) and q > 0:
                requests[name] = requests.get(name, Fraction(0)) + q
        found = set()
        for name, q in c.limits.items():
            if name in (CPU, MEMORY) and q > 0:
                found.add(name)
                limits[name] = limits.get(name, Fraction(0)) + q
        if found != {CPU, MEMORY}:
            guaranteed = False
    if not requests and not limits:
        return BEST_EFFORT
    if guaranteed and all(limits.get(name) == q for name, q in requests.items()) and len(requests) == len(limits):
        return GUARANTEED
    return BURSTABLE


def parse_pod(pod: object) -> PodRequest:
    """What the kubelet reads of a Pod (parsed JSON); :class:`PodError` when it cannot be read."""
    if not isinstance(pod, Mapping):
        raise PodError(f"pod: not an object: {excerpt(repr(pod))}")
    meta = pod.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    name, namespace = meta.get("name"), meta.get("namespace")
    who = "/".join(shorten(p, 63) for p in (namespace, name) if isinstance(p, str) and p) or "?"
    reader = _PodReader(who)
    spec = reader.mapping(pod.get("spec"), "spec")
    init = reader.containers(spec.get("initContainers"), "spec.initContainers", init=True)
    app = reader.containers(spec.get("containers"), "spec.containers", init=False)
    if len(init) + len(app) > MAX_CONTAINERS:
        reader.fail("spec", f"{len(init) + len(app)} containers, more than the {MAX_CONTAINERS} memtopo reads")
    overhead = reader.quantities(spec.get("overhead"), "spec.overhead")
    status = reader.mapping(pod.get("status"), "status")
    qos = status.get("qosClass")
    if qos is None or qos == "":
        qos = qos_class((*app, *init))
    elif qos not in QOS_CLASSES:
        reader.fail("status.qosClass", f"{excerpt(qos if isinstance(qos, str) else repr(qos))} is not a QoS class")
    demands = tuple(_container_demand(qos, c) for c in (*init, *app))
    return PodRequest(who, qos, init, app, MappingProxyType(overhead), demands, _pod_demand(qos, init, app))


# ---- what one unit asks for, per hint provider -------------------------------------------------------

class _Source(NamedTuple):
    """One hint list of the Topology Manager: the CPU manager's, the memory manager's (all memory types
    of the unit together), or one device resource's."""

    names: tuple[str, ...]
    needs: tuple[int, ...]
    universe: tuple[int, ...]
    # The memory manager counts a combination only when its allocatable memory could hold the request.
    gated: bool
    # The device manager and CPU manager give an empty list when too little is free; the memory manager
    # gives none at all (no preference) and fails at allocation.
    silent_when_short: bool

    @property
    def label(self) -> str:
        return ", ".join(f"{n} {_show(n, q)}" for n, q in zip(self.names, self.needs, strict=True))


def _show(name: str, amount: Fraction | int) -> str:
    """An amount as Kubernetes writes it: ``2Gi``, ``4``, ``1500m``."""
    if amount == int(amount):
        return format_bytes(int(amount)) if name == MEMORY or is_hugepages(name) else str(int(amount))
    return format_milli(milli(Fraction(amount)))


class _Node:
    """A node's alignable zones and the free amounts of ``names`` as a pod's containers take them."""

    def __init__(self, node: NodeTopology, reserved: Reserved | None, names: frozenset[str]) -> None:
        self.node = node
        self.zones: tuple[Zone, ...] = tuple(sorted(node.alignable_zones(), key=lambda z: z.numa_id))
        self.ids = tuple(z.numa_id for z in self.zones)
        self.listed = frozenset(r.name for z in self.zones for r in z.resources)
        self.capacity: dict[tuple[int, str], int] = {}
        self.allocatable: dict[tuple[int, str], int] = {}
        # Whole units: every request judged here is whole, so available less a fractional reservation
        # decides as its floor does.
        self.free: dict[tuple[int, str], int] = {}
        for z in self.zones:
            held = reserved.get(z.numa_id, {}) if reserved else {}
            for r in z.resources:
                if r.name not in names:
                    continue
                self.capacity[z.numa_id, r.name] = r.capacity
                self.allocatable[z.numa_id, r.name] = r.allocatable
                taken = max(math.ceil(held.get(r.name, 0)), 0)
                self.free[z.numa_id, r.name] = max(r.available - taken, 0)
        self.cpu_zones = tuple(z.numa_id for z in self.zones if self.capacity.get((z.numa_id, CPU), 0) > 0)

    def zone_name(self, numa_id: int) -> str:
        return next(z.name for z in self.zones if z.numa_id == numa_id)


class _Ask(NamedTuple):
    cpu: int
    memory: Mapping[str, int]
    devices: Mapping[str, int]
    # An allocation error the request itself causes (memory that is not a whole number of bytes).
    broken: str = ""


def _integral_cpus(q: Fraction | None) -> int:
    """``guaranteedCPUs``: the CPU count when ``Value()*1000 == MilliValue()``, else 0."""
    if q is None:
        return 0
    return ceil_int(q) if ceil_int(q) * 1000 == milli(q) else 0


def _device_limit(c: ContainerRequest, name: str) -> int | None:
    q = c.limits.get(name, c.requests.get(name))
    return None if q is None else ceil_int(q)


def _is_device(name: str) -> bool:
    return name not in (CPU, MEMORY) and not is_hugepages(name)


def _memory_of(c: ContainerRequest) -> tuple[dict[str, int], str]:
    """``getRequestedResources``: memory and huge pages in bytes, or why AsInt64 fails."""
    out: dict[str, int] = {}
    for name, q in c.requests.items():
        if name == MEMORY or is_hugepages(name):
            if q.denominator != 1:
                return {}, f"{name} {_show(CPU, q)} is not a whole number of bytes (the memory manager's AsInt64 fails)"
            out[name] = int(q)
    return out, ""


def _pod_total(init: Sequence[tuple[int, bool]], app: Iterable[int]) -> int:
    """max(the largest init container plus the sidecars started before it, app containers plus all
    sidecars): the kubelet's pod-level sum (``podGuaranteedCPUs``, ``getPodRequestedResources``,
    ``PodLimits``)."""
    sidecars = 0
    peak = 0
    for amount, sidecar in init:
        if sidecar:
            sidecars += amount
        else:
            peak = max(peak, sidecars + amount)
    return max(peak, sum(app) + sidecars)


def _container_demand(qos: str, c: ContainerRequest) -> UnitDemand:
    guaranteed = qos == GUARANTEED
    memory, broken = _memory_of(c) if guaranteed else ({}, "")
    devices = sorted((n, _device_limit(c, n) or 0) for n in {*c.limits, *c.requests} if _is_device(n))
    return UnitDemand(_integral_cpus(c.requests.get(CPU)) if guaranteed else 0, tuple(sorted(memory.items())),
                      tuple(devices), broken)


def _pod_demand(qos: str, init: Sequence[ContainerRequest], app: Sequence[ContainerRequest]) -> UnitDemand:
    guaranteed = qos == GUARANTEED
    cpu = 0
    if guaranteed:
        cpu = _pod_total([(_integral_cpus(c.requests[CPU]), c.sidecar) for c in init if CPU in c.requests],
                         (_integral_cpus(c.requests[CPU]) for c in app if CPU in c.requests))
    memory: dict[str, int] = {}
    broken = ""
    if guaranteed:
        per_init = [(*_memory_of(c), c.sidecar) for c in init]
        per_app = [_memory_of(c) for c in app]
        broken = next((problem for _, problem, _ in per_init if problem), "") or next(
            (problem for _, problem in per_app if problem), "")
        # getPodRequestedResources counts the memory types of the app containers only.
        for name in sorted({n for asked, _ in per_app for n in asked}):
            memory[name] = _pod_total([(asked.get(name, 0), sidecar) for asked, _, sidecar in per_init],
                                      (asked.get(name, 0) for asked, _ in per_app))
    devices = []
    for name in sorted({n for c in (*init, *app) for n in (*c.limits, *c.requests) if _is_device(n)}):
        devices.append((name, _pod_total([(_device_limit(c, name) or 0, c.sidecar) for c in init],
                                         (_device_limit(c, name) or 0 for c in app))))
    return UnitDemand(cpu, tuple(memory.items()), tuple(devices), broken)


def _ask(node: _Node, demand: UnitDemand) -> _Ask:
    """What of a unit's demand gives hints on this node: CPUs under the static CPU manager, memory under
    the Static memory manager, and only resources some zone lists."""
    static_cpu = node.node.cpu_manager_policy == "static" and CPU in node.listed
    static_memory = node.node.memory_manager_policy == "Static"
    return _Ask(demand.cpu if static_cpu else 0,
                {n: q for n, q in demand.memory if n in node.listed} if static_memory else {},
                {n: q for n, q in demand.devices if n in node.listed},
                demand.broken if static_memory else "")


def _sources(node: _Node, ask: _Ask) -> list[_Source]:
    out: list[_Source] = []
    if ask.cpu > 0 and node.cpu_zones:
        out.append(_Source((CPU,), (ask.cpu,), node.cpu_zones, gated=False, silent_when_short=False))
    if ask.memory:
        names = tuple(sorted(ask.memory))
        out.append(_Source(names, tuple(ask.memory[n] for n in names), node.ids, gated=True, silent_when_short=True))
    for name in sorted(ask.devices):
        out.append(_Source((name,), (ask.devices[name],), node.ids, gated=False, silent_when_short=False))
    return out


# ---- hints -------------------------------------------------------------------------------------------

class _TooWideError(Exception):
    pass


def _mask(ids: Iterable[int]) -> int:
    out = 0
    for i in ids:
        out |= 1 << i
    return out


def _bits(mask: int) -> tuple[int, ...]:
    return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)


def _narrowness(mask: int) -> tuple[int, int]:
    """``IsNarrowerThan``: fewer NUMA nodes, then more lower-numbered ones (a smaller mask value)."""
    return mask.bit_count(), mask


class _Hints(NamedTuple):
    minimum: int
    preferred: frozenset[int]
    # Some combination holds the request (the whole universe, the widest, does if any does).
    fits: bool


def _sum(table: Mapping[tuple[int, str], int], ids: Iterable[int], name: str) -> int:
    return sum(table.get((i, name), 0) for i in ids)


def _holds(node: _Node, src: _Source, ids: Sequence[int]) -> bool:
    if src.gated and any(_sum(node.allocatable, ids, n) < q for n, q in zip(src.names, src.needs, strict=True)):
        return False
    return all(_sum(node.free, ids, n) >= q for n, q in zip(src.names, src.needs, strict=True))


def _could_hold(node: _Node, src: _Source, ids: Sequence[int]) -> bool:
    basis = node.allocatable if src.gated else node.capacity
    return all(_sum(basis, ids, n) >= q for n, q in zip(src.names, src.needs, strict=True))


def _minimum(node: _Node, src: _Source, single_only: bool) -> int:
    """minAffinitySize of several memory types together: the fewest NUMA nodes whose allocatable
    amounts could hold every one.
    ``single_only``: whether it is 1 is all that matters (any larger answer may be returned as 2)."""
    n = len(src.universe)
    if single_only:
        return 1 if any(_could_hold(node, src, (i,)) for i in src.universe) else min(2, n)
    if n > MAX_ENUMERATED_ZONES:
        raise _TooWideError
    for k in range(1, n + 1):
        if any(_could_hold(node, src, ids) for ids in combinations(src.universe, k)):
            return k
    return n


def _one_resource_hints(node: _Node, src: _Source, single_only: bool) -> _Hints:
    """:func:`_hints` for one resource, on per-zone lists (the common case, and the fast one)."""
    name, need, ids = src.names[0], src.needs[0], src.universe
    free = [node.free.get((i, name), 0) for i in ids]
    basis = [(node.allocatable if src.gated else node.capacity).get((i, name), 0) for i in ids]
    fits = sum(free) >= need and (not src.gated or sum(basis) >= need)
    minimum, total = len(ids), 0
    for k, amount in enumerate(sorted(basis, reverse=True), 1):
        total += amount
        if total >= need:
            minimum = k
            break
    if not fits or (single_only and minimum != 1):
        return _Hints(minimum, frozenset(), fits)
    if minimum == 1:
        return _Hints(1, frozenset(1 << i for i, f, b in zip(ids, free, basis, strict=True)
                                   if f >= need and (not src.gated or b >= need)), fits)
    if math.comb(len(ids), minimum) > 1 << MAX_ENUMERATED_ZONES:
        raise _TooWideError
    preferred = frozenset(
        _mask(ids[j] for j in combo) for combo in combinations(range(len(ids)), minimum)
        if sum(free[j] for j in combo) >= need and (not src.gated or sum(basis[j] for j in combo) >= need))
    return _Hints(minimum, preferred, fits)


def _hints(node: _Node, src: _Source, single_only: bool) -> _Hints:
    """The unit's hints from one provider: the minimum combination size, the preferred combinations
    (only single zones under single-numa-node) and whether any combination holds the request."""
    if len(src.names) == 1:
        return _one_resource_hints(node, src, single_only)
    fits = _holds(node, src, src.universe)
    minimum = _minimum(node, src, single_only)
    if not fits or (single_only and minimum != 1):
        return _Hints(minimum, frozenset(), fits)
    if minimum > 1 and math.comb(len(src.universe), minimum) > 1 << MAX_ENUMERATED_ZONES:
        raise _TooWideError
    preferred = frozenset(_mask(ids) for ids in combinations(src.universe, minimum) if _holds(node, src, ids))
    return _Hints(minimum, preferred, fits)


def _all_hints(node: _Node, src: _Source) -> list[int]:
    return [_mask(ids) for k in range(1, len(src.universe) + 1)
            for ids in combinations(src.universe, k) if _holds(node, src, ids)]


def _unaligned_choice(node: _Node, sources: Sequence[_Source]) -> int | None:
    """best-effort's pick when no permutation is preferred: every merged mask, then the one with the
    most NUMA nodes up to BestNonPreferredAffinityCount (else the narrowest), lowest-numbered first."""
    if len(node.ids) > MAX_MERGED_ZONES:
        return None
    default = _mask(node.ids)
    merged = {default}
    target = 0
    for src in sources:
        hints = _all_hints(node, src)
        if not hints:
            continue
        target = max(target, min(h.bit_count() for h in hints))
        merged = {m & h for m in merged for h in hints if m & h}
    if not merged:
        return default
    below = [m for m in merged if m.bit_count() <= target]
    if below:
        return min(below, key=lambda m: (-m.bit_count(), m))
    return min(merged, key=_narrowness)


# ---- one unit: a container or the pod -------------------------------------------------------------------

class _Outcome(NamedTuple):
    alignment: Alignment
    reason: str = ""
    message: str = ""
    mask: int | None = None


def _zones_text(node: _Node, masks: Iterable[int]) -> str:
    shown = ("{" + ",".join(node.zone_name(i) for i in _bits(m)) + "}" for m in sorted(masks, key=_narrowness))
    return " or ".join(shown)


def _judge(node: _Node, ask: _Ask, who: str, container: str | None, init: bool) -> _Outcome:
    policy = node.node.policy
    sources = _sources(node, ask)
    hinted = tuple(n for s in sources for n in s.names)
    if ask.broken:
        return _Outcome(Alignment(container, init, hinted, (), None, False), UNEXPECTED_ADMISSION_ERROR,
                        f"{who}: {ask.broken}")
    if policy == "none":
        return _allocated(node, sources, _Outcome(Alignment(container, init, (), (), None, False)), who)
    if not sources:
        return _Outcome(Alignment(container, init, (), (), None, True))
    single = policy == "single-numa-node"
    try:
        hint_sets = [(src, _hints(node, src, single)) for src in sources]
    except _TooWideError:
        return _Outcome(Alignment(container, init, hinted, (), None, False), TOPOLOGY_TOO_WIDE,
                        f"{who}: {len(node.ids)} NUMA zones are more than memtopo mirrors the {policy} policy for")
    # The memory manager gives no hint at all when nothing holds the request: no preference to merge.
    voting = [(src, h) for src, h in hint_sets if h.fits or not src.silent_when_short]
    accepted: frozenset[int] | None = None
    for _, h in voting:
        accepted = h.preferred if accepted is None else accepted & h.preferred
    aligned = sorted(accepted, key=_narrowness) if accepted is not None else [_mask(node.ids)]
    if aligned:
        choice: int | None = aligned[0]
    elif policy == "best-effort":
        choice = _unaligned_choice(node, [src for src, h in voting if h.fits])
    else:
        return _Outcome(Alignment(container, init, hinted, (), None, False), TOPOLOGY_AFFINITY_ERROR,
                        f"{who}: {AFFINITY_MESSAGE}: {_why_unaligned(node, voting, single)}")
    placements = tuple(_bits(m) for m in aligned)
    outcome = _Outcome(Alignment(container, init, hinted, placements, None if choice is None else _bits(choice),
                                 bool(aligned)), mask=choice)
    return _allocated(node, sources, outcome, who, [h.fits for _, h in hint_sets])


def _why_unaligned(node: _Node, voting: Sequence[tuple[_Source, _Hints]], single: bool) -> str:
    for src, h in voting:
        if not h.fits:
            free = ", ".join(f"{n} {_show(n, _sum(node.free, src.universe, n))}" for n in src.names)
            return f"{src.label} is more than the node's NUMA zones have free ({free})"
        if not h.preferred:
            if single:
                return f"no single NUMA zone can hold {src.label}"
            return f"{src.label} has no free placement on {h.minimum} NUMA zone(s), the fewest that could hold it"
    return "; ".join(f"{src.label} aligns on {_zones_text(node, h.preferred)}" for src, h in voting) + \
        ", and these do not meet"


def _allocated(node: _Node, sources: Sequence[_Source], outcome: _Outcome, who: str,
               fits: Sequence[bool] | None = None) -> _Outcome:
    """The allocation that follows the merge: it fails when the node has too little left for an exclusive
    request, whatever the policy. ``fits``: per source, whether the node holds it, when already known."""
    for k, src in enumerate(sources):
        if not (fits[k] if fits is not None else _holds(node, src, src.universe)):
            free = ", ".join(f"{n} {_show(n, _sum(node.free, src.universe, n))}" for n in src.names)
            return outcome._replace(reason=UNEXPECTED_ADMISSION_ERROR,
                                    message=f"{who}: Allocate failed: {src.label} requested, {free} free on the node")
    return outcome


def _take(node: _Node, sources: Sequence[_Source], mask: int | None) -> list[tuple[int, str, int]]:
    """Takes the unit's exclusive amounts from the zones: those of the chosen placement first, in
    NUMA id order (as the memory manager fills its mask), then any other zone for what is left (as the
    CPU manager takes leftover CPUs anywhere)."""
    taken: list[tuple[int, str, int]] = []
    for src in sources:
        inside = [i for i in src.universe if mask is not None and mask >> i & 1]
        order = inside + [i for i in src.universe if i not in inside]
        for name, need in zip(src.names, src.needs, strict=True):
            left = need
            for i in order:
                if left <= 0:
                    break
                part = min(left, node.free.get((i, name), 0))
                if part > 0:
                    node.free[i, name] -= part
                    taken.append((i, name, part))
                    left -= part
    return taken


def admit(node: NodeTopology, pod: PodRequest, reserved: Reserved | None = None) -> Verdict:
    """The kubelet's admission of ``pod`` on ``node``, whose zones have ``available`` less ``reserved``.

    Never raises: what the node's object or the pod cannot tell is said in the verdict's reason."""
    state = _Node(node, reserved, frozenset().union(pod.pod_demand.names(), *(d.names() for d in pod.demands)))
    alignments: list[Alignment] = []
    claims: list[tuple[int, str, int]] = []
    # Under the none policy the kubelet's scope is "none" whatever is configured: container by container.
    if node.scope == "pod" and node.policy != "none":
        ask = _ask(state, pod.pod_demand)
        outcome = _judge(state, ask, "pod", None, False)
        if outcome.reason:
            return Verdict(False, outcome.reason, outcome.message, pod.qos, (outcome.alignment,))
        claims = _take(state, _sources(state, ask), outcome.mask)
        return Verdict(True, "", "", pod.qos, (outcome.alignment,), tuple(claims))
    units = [(c, True) for c in pod.init_containers] + [(c, False) for c in pod.containers]
    for (c, init), demand in zip(units, pod.demands, strict=True):
        kind = ("sidecar" if c.sidecar else "init container") if init else "container"
        who = f"{kind} {shorten(c.name or '?', 63)!r}"
        ask = _ask(state, demand)
        outcome = _judge(state, ask, who, c.name, init)
        alignments.append(outcome.alignment)
        if outcome.reason:
            return Verdict(False, outcome.reason, outcome.message, pod.qos, tuple(alignments))
        if not init or c.sidecar:
            claims += _take(state, _sources(state, ask), outcome.mask)
    return Verdict(True, "", "", pod.qos, tuple(alignments), tuple(claims))
