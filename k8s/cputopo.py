"""The node's CPUs as the kubelet's CPU manager sees them: each logical CPU in one core, one socket
(package) and one NUMA node (``topology.CPUTopology`` in ``pkg/kubelet/cm/cpumanager``).

Built from memtopo's ``MemoryTopology`` (which CPUs each NUMA node has, which packages are on it)
plus each CPU's core, which the topology does not carry: ``read_cpu_places`` reads it from sysfs
(``cpuN/topology/thread_siblings_list`` and ``physical_package_id``) through a root. Like the kubelet,
a core is named by its lowest CPU id, so core ids are unique across packages. Where sysfs does not
say (a captured root without those files), every CPU is a core of its own and the model says so in
``assumed``: exclusive CPUs are then still exclusive, only not kept to whole cores.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

from memtopo.hostfs import HostFS, HostReadError
from memtopo.v1 import topology_pb2 as pb

_CPU_DIR = "sys/devices/system/cpu"


@dataclass(frozen=True)
class CpuPlace:
    core: int
    socket: int
    numa: int


@dataclass(frozen=True)
class CpuPlaces:
    """What sysfs says of each CPU: its package and the lowest CPU id of its core (its siblings)."""

    package: Mapping[int, int]
    core: Mapping[int, int]
    problems: tuple[str, ...] = ()


def read_cpu_places(fs: HostFS, cpus: Iterable[int]) -> CpuPlaces:
    """Package and core of each of ``cpus`` from ``sys/devices/system/cpu/cpuN/topology``; a CPU whose
    files are missing or garbage is left out and named in ``problems``. Never raises."""
    package: dict[int, int] = {}
    core: dict[int, int] = {}
    problems: list[str] = []
    for cpu in sorted(set(cpus)):
        base = f"{_CPU_DIR}/cpu{cpu}/topology"
        try:
            pkg = fs.read_int(f"{base}/physical_package_id")
            siblings = fs.read_cpulist(f"{base}/thread_siblings_list")
        except (HostReadError, ValueError) as exc:
            if len(problems) < 8:
                problems.append(f"cpu{cpu}: {exc}")
            continue
        if cpu not in siblings or not 0 <= pkg < 1 << 16:
            if len(problems) < 8:
                problems.append(f"cpu{cpu}: its topology files disagree with it")
            continue
        package[cpu], core[cpu] = pkg, min(siblings)
    return CpuPlaces(MappingProxyType(package), MappingProxyType(core), tuple(problems))


@dataclass(frozen=True)
class CpuTopology:
    """Logical CPU → (core, socket, NUMA node), with the lookups the kubelet's accumulator makes."""

    places: Mapping[int, CpuPlace]
    # Why part of the model is assumed rather than read ("" when nothing is).
    assumed: str = ""
    _by: dict[str, dict[int, frozenset[int]]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, places: Mapping[int, CpuPlace], assumed: str = "") -> CpuTopology:
        return cls(MappingProxyType(dict(sorted(places.items()))), assumed)

    @classmethod
    def from_topology(cls, topo: pb.MemoryTopology, sysfs: CpuPlaces | None = None) -> CpuTopology:
        """The model of ``topo``'s NUMA nodes' CPUs (those in ``allowed_cpus`` when it names any), each
        in the core and package ``sysfs`` gives it; without that, a core of its own in the NUMA node's
        only package (else a package per NUMA node)."""
        allowed = set(topo.allowed_cpus)
        places: dict[int, CpuPlace] = {}
        missing: list[int] = []
        for node in topo.numa_nodes:
            node_pkgs = sorted(set(node.packages))
            for cpu in node.cpus:
                if (allowed and cpu not in allowed) or cpu in places:
                    continue
                if sysfs is not None and cpu in sysfs.core:
                    places[cpu] = CpuPlace(sysfs.core[cpu], sysfs.package[cpu], node.id)
                    continue
                missing.append(cpu)
                # Far above any real package id: a package made up for the node cannot clash with one.
                pkg = node_pkgs[0] if len(node_pkgs) == 1 else (1 << 20) + node.id
                places[cpu] = CpuPlace(cpu, pkg, node.id)
        assumed = ""
        if missing:
            why = "; ".join(sysfs.problems[:2]) if sysfs is not None and sysfs.problems else "no sysfs CPU topology"
            assumed = f"{len(missing)} CPUs taken as cores of their own ({why})"
        return cls.of(places, assumed)

    def _index(self, kind: str) -> dict[int, frozenset[int]]:
        if kind not in self._by:
            out: dict[int, set[int]] = {}
            for cpu, p in self.places.items():
                out.setdefault(getattr(p, kind), set()).add(cpu)
            self._by[kind] = {k: frozenset(v) for k, v in out.items()}
        return self._by[kind]

    @cached_property
    def cpus(self) -> frozenset[int]:
        return frozenset(self.places)

    def cpus_in(self, kind: str, ident: int) -> frozenset[int]:
        """CPUs of one ``core``, ``socket`` or ``numa`` node."""
        return self._index(kind).get(ident, frozenset())

    def ids(self, kind: str) -> tuple[int, ...]:
        return tuple(sorted(self._index(kind)))

    def numa_of(self, cpus: Iterable[int]) -> tuple[int, ...]:
        return tuple(sorted({self.places[c].numa for c in cpus if c in self.places}))
