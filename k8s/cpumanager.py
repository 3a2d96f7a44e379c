"""Exclusive CPUs as the kubelet's static CPU manager policy hands them out, rule by rule (pure: no I/O).

Mirrors ``pkg/kubelet/cm/cpumanager``:

- **Who gets exclusive CPUs** (``policy_static.go`` ``guaranteedCPUs``): a container of a pod whose QoS
  class is Guaranteed (every container and init container has CPU and memory limits, and requests equal
  to them) and whose CPU request is an integer. Every other container runs on the shared pool.
- **The pools**: the shared pool is the allocatable CPUs less every exclusive assignment; reserved CPUs
  (``reservedSystemCPUs``) stay in the shared pool but are never handed out exclusively
  (``GetAvailableCPUs`` = default set − reserved).
- **Which CPUs** (``cpu_assignment.go`` ``takeByTopologyNUMAPacked``): whole NUMA nodes or sockets first
  (whichever is the larger unit), then the other of the two, then whole cores, then single threads,
  always from the emptiest unit first (fewest available CPUs, then lowest id) so that allocations pack.
  With a NUMA affinity (``allocateCPUs``), the CPUs of those nodes are taken first and only the rest
  may come from elsewhere.

It lives in ``k8s/`` beside the kubelet configuration reader: it is the kubelet's rule, and its caller,
the agent's enforcement, stands on ``k8s/`` (not on the planner).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from memtopo.k8s import quantity
from memtopo.k8s.cputopo import CpuTopology

GUARANTEED = "Guaranteed"
BURSTABLE = "Burstable"
BEST_EFFORT = "BestEffort"
_QOS_RESOURCES = ("cpu", "memory")


class NotEnoughCpusError(Exception):
    """The request is larger than the CPUs that may be handed out."""


class PodSpecError(ValueError):
    """A pod object memtopo cannot read (not the shape the API server gives)."""


# ---- takeByTopology --------------------------------------------------------------------------------
class _Accumulator:
    """``cpuAccumulator``: what is still available, what has been taken, how many are still needed."""

    def __init__(self, topo: CpuTopology, available: Iterable[int], n: int) -> None:
        self.topo = topo
        self.avail = set(available) & topo.cpus
        self.result: set[int] = set()
        self.needed = n
        # If NUMA nodes are at least as large as sockets, whole NUMA nodes come first.
        self.numa_first = len(topo.ids("socket")) >= len(topo.ids("numa"))

    def count(self, kind: str, ident: int) -> int:
        return len(self.topo.cpus_in(kind, ident) & self.avail)

    def present(self, kind: str, idents: Iterable[int] | None = None) -> list[int]:
        pool = self.topo.ids(kind) if idents is None else idents
        return [i for i in pool if self.count(kind, i)]

    def sort(self, kind: str, idents: Iterable[int]) -> list[int]:
        return sorted(idents, key=lambda i: (self.count(kind, i), i))

    def within(self, kind: str, outer: str, outer_id: int) -> list[int]:
        """Ids of ``kind`` units having available CPUs inside one ``outer`` unit."""
        return sorted({getattr(self.topo.places[c], kind) for c in self.topo.cpus_in(outer, outer_id) & self.avail})

    def sorted_numa(self) -> list[int]:
        if self.numa_first:
            return self.sort("numa", self.present("numa"))
        return _unique(n for s in self.sorted_sockets() for n in self.sort("numa", self.within("numa", "socket", s)))

    def sorted_sockets(self) -> list[int]:
        if self.numa_first:
            return _unique(s for n in self.sorted_numa() for s in self.sort("socket", self.within("socket", "numa", n)))
        return self.sort("socket", self.present("socket"))

    def sorted_cores(self) -> list[int]:
        if self.numa_first:
            return _unique(c for s in self.sorted_sockets() for c in self._cores_in("socket", s))
        return _unique(c for n in self.sorted_numa() for c in self._cores_in("numa", n))

    def _cores_in(self, outer: str, ident: int) -> list[int]:
        return self.sort("core", self.within("core", outer, ident))

    def sorted_cpus(self) -> list[int]:
        return [cpu for core in self.sorted_cores() for cpu in sorted(self.topo.cpus_in("core", core) & self.avail)]

    def free(self, kind: str) -> list[int]:
        order = {"numa": self.sorted_numa, "socket": self.sorted_sockets, "core": self.sorted_cores}[kind]()
        return [i for i in order if self.count(kind, i) == len(self.topo.cpus_in(kind, i))]

    def take(self, cpus: Iterable[int]) -> None:
        got = set(cpus)
        self.result |= got
        self.avail -= got
        self.needed -= len(got)

    def take_full(self, kind: str) -> None:
        for ident in self.free(kind):
            cpus = self.topo.cpus_in(kind, ident)
            if self.needed >= len(cpus):
                self.take(cpus)

    @property
    def satisfied(self) -> bool:
        return self.needed < 1


def _unique(items: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(items))


def take_by_topology(topo: CpuTopology, available: Iterable[int], n: int) -> frozenset[int]:
    """``n`` CPUs of ``available`` chosen as ``takeByTopologyNUMAPacked`` chooses them."""
    acc = _Accumulator(topo, available, n)
    if acc.satisfied:
        return frozenset()
    if n > len(acc.avail):
        raise NotEnoughCpusError(f"not enough cpus available to satisfy request: {n} asked, {len(acc.avail)} free")
    first, second = ("numa", "socket") if acc.numa_first else ("socket", "numa")
    for kind in (first, second, "core"):
        acc.take_full(kind)
        if acc.satisfied:
            return frozenset(acc.result)
    for cpu in acc.sorted_cpus():
        acc.take((cpu,))
        if acc.satisfied:
            break
    return frozenset(acc.result)


def allocate(topo: CpuTopology, assignable: Iterable[int], n: int,
             numa_affinity: Sequence[int] = ()) -> frozenset[int]:
    """``allocateCPUs``: with a NUMA affinity, as many CPUs as those nodes can give first, the rest
    from anywhere assignable; NotEnoughCpusError when ``assignable`` has fewer than ``n``."""
    free = set(assignable)
    if n > len(free):
        raise NotEnoughCpusError(f"not enough cpus available to satisfy request: {n} asked, {len(free)} free")
    result: set[int] = set()
    if numa_affinity:
        aligned = {c for node in numa_affinity for c in topo.cpus_in("numa", node)} & free
        result |= take_by_topology(topo, aligned, min(n, len(aligned)))
    result |= take_by_topology(topo, free - result, n - len(result))
    return frozenset(result)


# ---- who gets exclusive CPUs -----------------------------------------------------------------------
def _map(value: object, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PodSpecError(f"{what} is not an object")
    return value


def _list(value: object, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PodSpecError(f"{what} is not a list")
    return value


def _quantities(resources: Mapping[str, Any], key: str, where: str) -> dict[str, Fraction]:
    out: dict[str, Fraction] = {}
    for name, q in _map(resources.get(key), f"{where}.{key}").items():
        if name in _QOS_RESOURCES:
            try:
                value = quantity.parse_nonnegative(q)
            except quantity.QuantityError as exc:
                raise PodSpecError(f"{where}.{key}.{name}: {exc}") from None
            if value > 0:
                out[name] = value
    return out


def containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    listed = _list(_map(pod.get("spec"), "spec").get("containers"), "spec.containers")
    return [_map(c, "spec.containers[]") for c in listed]


def qos_class(pod: Mapping[str, Any]) -> str:
    """The pod's QoS class (``GetPodQOS``: cpu and memory only; requests default to limits)."""
    spec = _map(pod.get("spec"), "spec")
    every = [*_list(spec.get("initContainers"), "spec.initContainers"),
             *_list(spec.get("containers"), "spec.containers")]
    requests: dict[str, Fraction] = {}
    limits: dict[str, Fraction] = {}
    guaranteed = True
    for i, c in enumerate(every):
        res = _map(_map(c, f"container {i}").get("resources"), f"container {i}.resources")
        lim = _quantities(res, "limits", f"container {i}.resources")
        req = {**lim, **_quantities(res, "requests", f"container {i}.resources")}
        for name, q in req.items():
            requests[name] = requests.get(name, Fraction(0)) + q
        for name, q in lim.items():
            limits[name] = limits.get(name, Fraction(0)) + q
        if set(lim) != set(_QOS_RESOURCES):
            guaranteed = False
    if not requests and not limits:
        return BEST_EFFORT
    if guaranteed and requests == limits:
        return GUARANTEED
    return BURSTABLE


def exclusive_cpus(pod: Mapping[str, Any]) -> dict[str, int]:
    """Container name → exclusive CPU count, for the containers the static policy pins (empty when the
    pod is not Guaranteed or no container asks a whole number of CPUs)."""
    if qos_class(pod) != GUARANTEED:
        return {}
    out: dict[str, int] = {}
    for i, c in enumerate(containers(pod)):
        name = c.get("name")
        if not isinstance(name, str) or not name:
            raise PodSpecError(f"spec.containers[{i}] has no name")
        res = _map(c.get("resources"), f"{name}.resources")
        cpu = {**_quantities(res, "limits", name), **_quantities(res, "requests", name)}.get("cpu", Fraction(0))
        if cpu >= 1 and cpu.denominator == 1:
            out[name] = int(cpu)
    return out


def shared_pool(allocatable: Iterable[int], exclusive: Iterable[Iterable[int]]) -> frozenset[int]:
    """Allocatable CPUs less every exclusive assignment (reserved CPUs stay in it)."""
    taken = {c for cpus in exclusive for c in cpus}
    return frozenset(allocatable) - taken


def assignable(allocatable: Iterable[int], reserved: Iterable[int],
               exclusive: Iterable[Iterable[int]]) -> frozenset[int]:
    """What may still be handed out exclusively: the shared pool less the reserved CPUs."""
    return shared_pool(allocatable, exclusive) - frozenset(reserved)


def split(topo: CpuTopology, cpus: Iterable[int], counts: Mapping[str, int],
          order: Callable[[str], int] | None = None) -> dict[str, frozenset[int]]:
    """A pod's CPUs cut into each container's exclusive share (containers in spec order), each share
    chosen from what is left by the same rule, so shares are whole cores where the counts allow."""
    left = set(cpus)
    out: dict[str, frozenset[int]] = {}
    for name in sorted(counts, key=order) if order else counts:
        share = take_by_topology(topo, left, counts[name])
        out[name] = share
        left -= share
    return out
