"""The node's NodeResourceTopology object (``topology.node.k8s.io/v1alpha2``) from its MemoryTopology.

Pure: a topology, the kubelet's facts and its PodResources answers in, a JSON-ready dict out. One zone
per online NUMA node with CPUs or memory (``node-<id>``, type ``Node``), each with ``cpu``, ``memory``,
huge pages and accelerators under their device-plugin resource names, ``costs`` to every zone (its own
included, as the kubelet's SLIT row has it) and memtopo's own facts as ``memtopo.io/…`` attributes.

Quantities: ``capacity`` is what the node has (memory: the node's MemTotal less its huge page pool, as
the kubelet's memory manager counts it); ``allocatable`` is what the kubelet may hand out (its own
PodResources figure when it reports one, else capacity less ``reservedSystemCPUs``/``reservedMemory``);
``available`` is allocatable less what running containers hold exclusively (PodResources ``List``).
Without PodResources, available = allocatable and the top-level ``memtopo.io/pod-resources``
attribute says so.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from memtopo.k8s.facts import DeviceGrant, KubeletFacts, MemoryGrant, PodResourcesView
from memtopo.k8s.quantity import format_bytes
from memtopo.k8s.resources import accelerator_resource, device_plugin_id
from memtopo.v1 import topology_pb2 as pb

API_VERSION = "topology.node.k8s.io/v1alpha2"
KIND = "NodeResourceTopology"
ZONE_TYPE = "Node"
ATTR = "memtopo.io/"
# Kubernetes object names (nodes included) are DNS subdomains.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DOMAIN_WORDS = {
    pb.MEMORY_DOMAIN_TYPE_DRAM: "DRAM", pb.MEMORY_DOMAIN_TYPE_HBM: "HBM",
    pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED: "CXL", pb.MEMORY_DOMAIN_TYPE_NVM: "NVM",
    pb.MEMORY_DOMAIN_TYPE_GPU_MEMORY: "GPU_MEMORY", pb.MEMORY_DOMAIN_TYPE_UNIFIED: "UNIFIED",
}
# Accelerator groups that say which devices belong together on a node, shown on the zones they touch.
_GROUP_ATTRS = {"hccs-ring": ATTR + "hccs-ring", "numa-half": ATTR + "xpu-numa-half"}


class NrtError(ValueError):
    """The object cannot be built (a node name Kubernetes would refuse)."""


def valid_object_name(name: str) -> bool:
    return 0 < len(name) <= 253 and _NAME.fullmatch(name) is not None


def zone_name(node_id: int) -> str:
    return f"node-{node_id}"


def zone_nodes(topo: pb.MemoryTopology) -> list[pb.NumaNode]:
    """The NUMA nodes that become zones: online, with CPUs or memory, by id."""
    return sorted((n for n in topo.numa_nodes
                   if n.state == pb.NUMA_NODE_STATE_ONLINE and (n.cpus or n.memory_bytes > 0)),
                  key=lambda n: n.id)


# ---- devices --------------------------------------------------------------------------------------

def _device_index(topo: pb.MemoryTopology) -> dict[str, int]:
    """Device-plugin id spellings → NUMA node, for PodResources answers that carry no topology: NVIDIA's
    plugin uses UUIDs, AMD's the PCI address, Ascend's ``Ascend910-<index>``, and memtopo's own id."""
    out: dict[str, int] = {}
    for acc in topo.accelerators:
        if acc.numa_node < 0:
            continue
        res = accelerator_resource(acc)
        names = [acc.uuid, acc.bdf, acc.id, device_plugin_id(res, acc.index) if res else None]
        for name in names:
            if name:
                out.setdefault(name.lower(), acc.numa_node)
    return out


def _grant_nodes(grant: DeviceGrant, dev_id: str, index: Mapping[str, int]) -> tuple[int, ...]:
    if grant.numa_nodes:
        return grant.numa_nodes
    node = index.get(dev_id.lower())
    return (node,) if node is not None else ()


def _devices_by_node(grants: Iterable[DeviceGrant], index: Mapping[str, int]) -> dict[int, dict[str, set[str]]]:
    """NUMA node → resource → device ids. A device spanning several nodes counts on the first (the
    kubelet lists a device's nodes in order; one device is one unit, never split)."""
    out: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for grant in grants:
        for dev_id in grant.ids:
            nodes = _grant_nodes(grant, dev_id, index)
            if nodes:
                out[min(nodes)][grant.resource].add(dev_id)
    return out


def devices_in_use(topo: pb.MemoryTopology, pods: PodResourcesView) -> dict[str, dict[str, tuple[str, ...]]]:
    """Zone → resource → the device ids running containers hold (sorted). Devices whose NUMA node is
    unknown (no topology in the answer, no accelerator of that id) are left out."""
    by_node = _devices_by_node(pods.assigned_devices, _device_index(topo))
    return {zone_name(n): {res: tuple(sorted(ids)) for res, ids in sorted(r.items())}
            for n, r in sorted(by_node.items())}


def device_capacity(topo: pb.MemoryTopology) -> dict[int, dict[str, int]]:
    """NUMA node → resource → accelerators there (those with a known device plugin and a NUMA node)."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for acc in topo.accelerators:
        res = accelerator_resource(acc)
        if res is not None and acc.numa_node >= 0:
            out[acc.numa_node][res] += 1
    return out


def device_counts(topo: pb.MemoryTopology,
                  pods: PodResourcesView | None) -> dict[int, dict[str, tuple[int, int, int]]]:
    """NUMA node → device resource → (capacity, allocatable, available). Capacity is the accelerators
    there; allocatable the kubelet's allocatable devices there when it reports that resource (a device
    plugin that is not registered hands out nothing), else capacity; available is allocatable less the
    allocatable devices running containers hold."""
    capacity = device_capacity(topo)
    index = _device_index(topo)
    allocatable = _devices_by_node(pods.allocatable_devices, index) if pods else {}
    assigned = _devices_by_node(pods.assigned_devices, index) if pods else {}
    reported = {g.resource for g in pods.allocatable_devices} if pods else set()
    out: dict[int, dict[str, tuple[int, int, int]]] = {}
    for node in sorted(capacity):
        counts: dict[str, tuple[int, int, int]] = {}
        for res, cap in sorted(capacity[node].items()):
            held = assigned.get(node, {}).get(res, set())
            if res in reported:
                ids = allocatable.get(node, {}).get(res, set())
                alloc, held = min(len(ids), cap), held & ids
            else:
                alloc = cap
            counts[res] = (cap, alloc, max(alloc - len(held), 0))
        out[node] = counts
    return out


def available_devices(topo: pb.MemoryTopology, pods: PodResourcesView | None) -> dict[str, dict[str, int]]:
    """Zone → device resource → devices still free for new pods (see :func:`device_counts`); without
    PodResources, every accelerator there. Zones with no accelerators are absent. For an object read
    back from the API server, use :func:`available_from_nrt`."""
    return {zone_name(node): {res: c[2] for res, c in counts.items()}
            for node, counts in device_counts(topo, pods).items()}


def available_from_nrt(obj: Mapping[str, Any], resource_prefixes: Sequence[str] = (
        "nvidia.com/", "amd.com/", "huawei.com/", "kunlunxin.com/")) -> dict[str, dict[str, int]]:
    """Zone → device resource → ``available`` count, read from a NodeResourceTopology object (as
    memtopo or another publisher wrote it). Quantities that are not whole counts are skipped."""
    out: dict[str, dict[str, int]] = {}
    zones = obj.get("zones")
    for zone in zones if isinstance(zones, list) else ():
        if not isinstance(zone, Mapping) or not isinstance(zone.get("name"), str):
            continue
        devices: dict[str, int] = {}
        resources = zone.get("resources")
        for res in resources if isinstance(resources, list) else ():
            if not isinstance(res, Mapping):
                continue
            name, value = res.get("name"), res.get("available")
            if not isinstance(name, str) or not name.startswith(tuple(resource_prefixes)):
                continue
            if isinstance(value, bool):
                continue
            # A count, never a 4300-digit string (int() refuses those: a ValueError here).
            if (isinstance(value, int) and value >= 0) or (isinstance(value, str) and value.isascii()
                                                           and value.isdigit() and len(value) <= 18):
                devices[name] = int(value)
        if devices:
            out[zone["name"]] = devices
    return out


# ---- memory and CPUs ------------------------------------------------------------------------------

def _memory_by_node(grants: Iterable[MemoryGrant]) -> dict[int, dict[str, int]]:
    """NUMA node → memory type → bytes. A grant over several nodes (the memory manager's multi-NUMA
    group) is split evenly, the remainder on its first node, so totals stay exact."""
    out: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for g in grants:
        nodes = sorted(set(g.numa_nodes))
        if not nodes:
            continue
        share, rest = divmod(max(g.size, 0), len(nodes))
        for i, node in enumerate(nodes):
            out[node][g.memory_type] += share + (rest if i == 0 else 0)
    return out


def _resource(name: str, capacity: int, allocatable: int, available: int, *, count: bool) -> dict[str, str]:
    allocatable = min(max(allocatable, 0), capacity)
    available = min(max(available, 0), allocatable)
    fmt = str if count else format_bytes
    return {"name": name, "capacity": fmt(capacity), "allocatable": fmt(allocatable), "available": fmt(available)}


class _NodeFacts:
    """What every zone looks up, indexed once: per zone it would be a pass over the whole topology
    (1,024 zones made that a million steps)."""

    def __init__(self, topo: pb.MemoryTopology, kubelet: KubeletFacts, pods: PodResourcesView | None) -> None:
        self.kubelet = kubelet
        self.pods = pods
        self.allocatable_cpus = set(pods.allocatable_cpus) if pods is not None else set()
        self.assigned_cpus = set(pods.assigned_cpus) if pods is not None else set()
        self.reserved_cpus = set(kubelet.reserved_cpus)
        self.memory_alloc = _memory_by_node(pods.allocatable_memory) if pods is not None else {}
        self.memory_held = _memory_by_node(pods.assigned_memory) if pods is not None else {}
        self.domains = {d.id: d for d in topo.domains}
        self.memory_of: dict[int, list[str]] = defaultdict(list)
        self.local: dict[int, list[pb.Accelerator]] = defaultdict(list)
        for a in topo.accelerators:
            for n in a.memory_numa_nodes:
                self.memory_of[n].append(a.id)
            self.local[a.numa_node].append(a)


def _zone_resources(node: pb.NumaNode, facts: _NodeFacts,
                    devices: Mapping[str, tuple[int, int, int]]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    kubelet, pods = facts.kubelet, facts.pods
    cpus = set(node.cpus)
    if cpus:
        if pods is not None and pods.allocatable_cpus:
            alloc = len(cpus & facts.allocatable_cpus)
        else:
            alloc = len(cpus - facts.reserved_cpus)
        held = len(cpus & facts.assigned_cpus) if pods is not None else 0
        out.append(_resource("cpu", len(cpus), alloc, alloc - held, count=True))
    huge = dict(kubelet.hugepages.get(node.id, {}))
    reserved = kubelet.reserved_memory.get(node.id, {})
    pods_alloc = facts.memory_alloc.get(node.id, {})
    pods_held = facts.memory_held.get(node.id, {})
    if node.memory_bytes > 0:
        cap = max(node.memory_bytes - sum(huge.values()), 0)
        alloc = pods_alloc.get("memory", cap - reserved.get("memory", 0))
        out.append(_resource("memory", cap, alloc, alloc - pods_held.get("memory", 0), count=False))
    for res, cap in sorted(huge.items()):
        if cap <= 0:
            continue
        alloc = pods_alloc.get(res, cap - reserved.get(res, 0))
        out.append(_resource(res, cap, alloc, alloc - pods_held.get(res, 0), count=False))
    for res, (cap, alloc, avail) in sorted(devices.items()):
        out.append(_resource(res, cap, alloc, avail, count=True))
    return out


# ---- attributes -----------------------------------------------------------------------------------

def _attr(name: str, value: object) -> dict[str, str]:
    return {"name": name, "value": str(value).lower() if isinstance(value, bool) else str(value)}


def _zone_attributes(node: pb.NumaNode, facts: _NodeFacts,
                     groups_by_node: Mapping[int, Mapping[str, list[str]]]) -> list[dict[str, str]]:
    attrs: list[dict[str, str]] = []
    domain = facts.domains.get(node.domain) if node.domain >= 0 else None
    if domain is not None:
        attrs.append(_attr(ATTR + "memory-type", _DOMAIN_WORDS.get(domain.type, "UNKNOWN")))
        attrs.append(_attr(ATTR + "memory-domain", domain.id))
        if domain.subtype:
            attrs.append(_attr(ATTR + "memory-subtype", domain.subtype))
        if domain.kernel_tier >= 0:
            attrs.append(_attr(ATTR + "memory-tier", domain.kernel_tier))
        perf = domain.local_performance
        # 0 is unknown, never zero: only figures the firmware (HMAT) or hwloc actually gave.
        for key, value in (("read-bandwidth-mbps", perf.read_bandwidth_mbps),
                           ("write-bandwidth-mbps", perf.write_bandwidth_mbps),
                           ("read-latency-ns", perf.read_latency_ns), ("write-latency-ns", perf.write_latency_ns)):
            if value:
                attrs.append(_attr(ATTR + key, value))
        if any((perf.read_bandwidth_mbps, perf.write_bandwidth_mbps, perf.read_latency_ns, perf.write_latency_ns)):
            attrs.append(_attr(ATTR + "performance-source",
                               pb.PerformanceSource.Name(perf.source).removeprefix("PERFORMANCE_SOURCE_")))
    attrs.append(_attr(ATTR + "cpuless", not node.cpus))
    owners = sorted(facts.memory_of.get(node.id, ()))
    if owners:
        attrs.append(_attr(ATTR + "accelerator-memory-of", ",".join(owners)))
    local = sorted(facts.local.get(node.id, ()), key=lambda a: (a.kind, a.index))
    if local:
        attrs.append(_attr(ATTR + "accelerators", ",".join(a.id for a in local)))
    for attr_name, groups in sorted(groups_by_node.get(node.id, {}).items()):
        attrs.append(_attr(attr_name, ";".join(groups)))
    return attrs


def _groups_by_node(topo: pb.MemoryTopology) -> dict[int, dict[str, list[str]]]:
    """NUMA node → group attribute → the groups (members comma-joined) with an accelerator there."""
    node_of = {a.id: a.numa_node for a in topo.accelerators}
    out: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for g in topo.accelerator_groups:
        attr_name = _GROUP_ATTRS.get(g.kind)
        if attr_name is None:
            continue
        members = ",".join(g.members)
        for node in sorted({node_of[m] for m in g.members if node_of.get(m, -1) >= 0}):
            out[node][attr_name].append(members)
    return out


def _costs(node: pb.NumaNode, zone_ids: set[int]) -> list[dict[str, Any]]:
    return [{"name": zone_name(other), "value": int(dist)}
            for other, dist in sorted(zip(node.distance_nodes, node.distances, strict=False))
            if other in zone_ids]


def _top_attributes(topo: pb.MemoryTopology, kubelet: KubeletFacts, pods: PodResourcesView | None,
                    pods_problem: str) -> list[dict[str, str]]:
    attrs: list[dict[str, str]] = []
    if kubelet.readable:
        # The kubelet's own defaults when its file leaves them out; NFD's attribute names, which the
        # scheduler plugin reads.
        attrs.append(_attr("topologyManagerPolicy", kubelet.topology_manager_policy or "none"))
        attrs.append(_attr("topologyManagerScope", kubelet.topology_manager_scope or "container"))
        attrs.append(_attr(ATTR + "kubelet-config", kubelet.config_path))
    else:
        attrs.append(_attr(ATTR + "kubelet-config", f"unreadable: {kubelet.problem or 'not found'}"))
    if pods is not None:
        attrs.append(_attr(ATTR + "pod-resources", f"kubelet: {pods.pods} pods"))
    else:
        attrs.append(_attr(ATTR + "pod-resources",
                           f"unavailable ({pods_problem or 'not read'}): available = allocatable"))
    attrs.append(_attr(ATTR + "fingerprint", topo.fingerprint))
    attrs.append(_attr(ATTR + "generation", topo.generation))
    return attrs


# The API server keeps an object in etcd, which refuses a request over 1.5 MiB (--max-request-bytes);
# 1.5 MB of the object's JSON leaves room for the request around it and the server's metadata.
MAX_OBJECT_BYTES = 1_500_000
# The least a `costs` entry can take ({"name":"node-N","value":D} and a comma).
_MIN_COST_BYTES = len('{"name":"node-0","value":10},')
# What the attribute saying what was left out may take.
_NOTE_ROOM = 1024


def object_bytes(obj: Mapping[str, Any]) -> int:
    """The size of ``obj`` as the API server stores it (compact JSON)."""
    import json

    return len(json.dumps(obj, separators=(",", ":")))


def build_nrt(topo: pb.MemoryTopology, node_name: str | None = None, *, kubelet: KubeletFacts | None = None,
              pods: PodResourcesView | None = None, pods_problem: str = "",
              owner: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The NodeResourceTopology object for ``topo`` (``node_name`` defaults to the topology's).

    ``owner``: the Node's ``uid`` (and ``name``) for an owner reference, so the object is garbage-
    collected with its node. Never larger than MAX_OBJECT_BYTES: what does not fit is left out, the
    least useful first (the zones' ``costs``, then their memtopo attributes; the resources the
    scheduler counts always stay), and the top-level attribute ``memtopo.io/left-out`` says what.
    Raises :class:`NrtError` for a name Kubernetes would refuse, or resources alone too large."""
    name = node_name or topo.node_name
    if not valid_object_name(name):
        raise NrtError(f"{name[:80]!r} is not a Kubernetes node name (lowercase DNS subdomain): "
                       "pass --node-name / set kubernetes.node_name")
    kubelet = kubelet or KubeletFacts()
    nodes = zone_nodes(topo)
    zone_ids = {n.id for n in nodes}
    devices = device_counts(topo, pods)
    groups = _groups_by_node(topo)
    facts = _NodeFacts(topo, kubelet, pods)
    resources = [_zone_resources(node, facts, devices.get(node.id, {})) for node in nodes]
    attributes = [_zone_attributes(node, facts, groups) for node in nodes]
    none: list[list[dict[str, Any]]] = [[] for _ in nodes]
    costs = none
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "memtopo"}}
    if owner is not None:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": owner.get("name", name),
                                        "uid": owner["uid"]}]
    top = _top_attributes(topo, kubelet, pods, pods_problem)

    def whole(left_out: Sequence[str]) -> dict[str, Any]:
        zones: list[dict[str, Any]] = []
        for node, cost, res, attrs in zip(nodes, costs, resources, attributes, strict=True):
            zone: dict[str, Any] = {"name": zone_name(node.id), "type": ZONE_TYPE}
            if cost:
                zone["costs"] = cost
            zone["resources"] = res
            zone["attributes"] = attrs
            zones.append(zone)
        said = [_attr(ATTR + "left-out", "; ".join(left_out))] if left_out else []
        return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata,
                "attributes": top + said, "zones": zones}

    # The optional parts are added while the object fits, the most useful first; room is kept for
    # the attribute that says what was left out.
    fits = MAX_OBJECT_BYTES - _NOTE_ROOM
    every_attribute, attributes = attributes, none
    if object_bytes(whole(())) > fits:
        raise NrtError(f"the resources of {len(nodes)} zones alone exceed the {MAX_OBJECT_BYTES} bytes an "
                       "object may have")
    left_out: list[str] = []
    attributes = every_attribute
    if object_bytes(whole(())) > fits:
        attributes = none
        left_out.append(f"attributes (the memtopo.io/ facts of {len(nodes)} zones)")
    entries = sum(len(zone_ids.intersection(node.distance_nodes)) for node in nodes)
    if entries and object_bytes(whole(())) + entries * _MIN_COST_BYTES <= fits:
        costs = [_costs(node, zone_ids) for node in nodes]
        if object_bytes(whole(())) > fits:
            costs = none
    if entries and costs is none:
        left_out.insert(0, f"costs (the SLIT rows of {len(nodes)} zones, {entries} entries; memtopo's "
                           "topology has them)")
    if left_out:
        left_out[-1] += f": the object would exceed the {MAX_OBJECT_BYTES} bytes the API server stores"
    return whole(left_out)
