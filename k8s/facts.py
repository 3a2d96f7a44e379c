"""What memtopo knows about a node besides its MemoryTopology, as plain immutable data.

``k8s/kubelet.py`` reads :class:`KubeletFacts` through a root, ``k8s/podresources.py`` turns the
kubelet's PodResources answers into a :class:`PodResourcesView`; ``k8s/nrt.py`` combines them with the
topology without any I/O, so tests and other callers (the scheduler extender) can build either by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


def _frozen(m: Mapping[int, Mapping[str, int]] | None = None) -> Mapping[int, Mapping[str, int]]:
    return MappingProxyType({k: MappingProxyType(dict(v)) for k, v in (m or {}).items()})


@dataclass(frozen=True)
class KubeletFacts:
    """The kubelet configuration facts the NRT object needs, and the node's huge pages per NUMA node.

    ``config_path`` is the root-relative file read ("" when none was); ``problem`` says why it could not
    be used ("" when it was). Policies are None when the file does not set them (the kubelet's default
    applies: topology manager ``none``/``container``)."""

    config_path: str = ""
    problem: str = ""
    topology_manager_policy: str | None = None
    topology_manager_scope: str | None = None
    cpu_manager_policy: str | None = None
    memory_manager_policy: str | None = None
    reserved_cpus: tuple[int, ...] = ()
    # NUMA node → resource name ("memory", "hugepages-2Mi") → bytes the kubelet keeps back there.
    reserved_memory: Mapping[int, Mapping[str, int]] = field(default_factory=_frozen)
    # NUMA node → "hugepages-<size>" → bytes in the node's huge page pool (sysfs nr_hugepages × size).
    hugepages: Mapping[int, Mapping[str, int]] = field(default_factory=_frozen)

    def __post_init__(self) -> None:
        object.__setattr__(self, "reserved_memory", _frozen(self.reserved_memory))
        object.__setattr__(self, "hugepages", _frozen(self.hugepages))

    @property
    def readable(self) -> bool:
        return bool(self.config_path) and not self.problem


@dataclass(frozen=True)
class DeviceGrant:
    """Devices of one resource name (the kubelet's ``ContainerDevices``), with their NUMA affinity."""

    resource: str
    ids: tuple[str, ...]
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class MemoryGrant:
    """Memory of one type (``memory``, ``hugepages-1Gi``) on a set of NUMA nodes (``ContainerMemory``)."""

    memory_type: str
    size: int
    numa_nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PodResourcesView:
    """The kubelet's PodResources answers: what it can hand out (``GetAllocatableResources``) and what
    running containers hold exclusively (``List``). Shared (non-exclusive) CPUs are not in ``List``."""

    allocatable_cpus: tuple[int, ...] = ()
    allocatable_devices: tuple[DeviceGrant, ...] = ()
    allocatable_memory: tuple[MemoryGrant, ...] = ()
    assigned_cpus: tuple[int, ...] = ()
    assigned_devices: tuple[DeviceGrant, ...] = ()
    assigned_memory: tuple[MemoryGrant, ...] = ()
    pods: int = 0
    # The pods fingerprint of every pod ``List`` named (k8s/podfingerprint.py; "" when not computed).
    pods_fingerprint: str = ""


@dataclass(frozen=True)
class EnforcedCpus:
    """The exclusive CPUs memtopo's own enforcement (agent/enforce.py) holds for pods, on a node where
    it is the CPU manager (the kubelet's ``cpuManagerPolicy`` is ``none``): the kubelet's PodResources
    does not know them, so the NRT's ``available`` would otherwise count them as free.

    ``known`` is False until the enforcement has decided once since it started (until then what is
    pinned is not known; ``note`` says why). ``note`` also says who owns cpusets when it is not memtopo
    (the kubelet's static policy: then ``cpus`` is empty and PodResources has the kubelet's own)."""

    known: bool
    cpus: frozenset[int] = frozenset()
    pods: int = 0
    note: str = ""
