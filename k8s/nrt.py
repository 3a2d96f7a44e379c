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

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from memtopo.k8s import names, podfingerprint
from memtopo.k8s.facts import DeviceGrant, EnforcedCpus, KubeletFacts, MemoryGrant, PodResourcesView
from memtopo.k8s.quantity import format_bytes
from memtopo.k8s.resources import accelerator_resource, device_plugin_id
from memtopo.v1 import topology_pb2 as pb

API_VERSION = "topology.node.k8s.io/v1alpha2"
KIND = "NodeResourceTopology"
ZONE_TYPE = "Node"
ATTR = "memtopo.io/"
_DOMAIN_WORDS = {
    pb.MEMORY_DOMAIN_TYPE_DRAM: "DRAM", pb.MEMORY_DOMAIN_TYPE_HBM: "HBM",
    pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED: "CXL", pb.MEMORY_DOMAIN_TYPE_NVM: "NVM",
    pb.MEMORY_DOMAIN_TYPE_GPU_MEMORY: "GPU_MEMORY", pb.MEMORY_DOMAIN_TYPE_UNIFIED: "UNIFIED",
}
# Accelerator groups that say which devices belong together on a node, shown on the zones they touch.
_GROUP_ATTRS = {"hccs-ring": ATTR + "hccs-ring", "numa-half": ATTR + "xpu-numa-half"}


class NrtError(ValueError):
    """The object cannot be built (a node name Kubernetes would refuse)."""


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
    return _place(grants, index)[0]


def _place(grants: Iterable[DeviceGrant], index: Mapping[str, int]) -> tuple[
        dict[int, dict[str, set[str]]], dict[str, set[str]]]:
    """:func:`_devices_by_node`, and resource → the device ids with no NUMA node at all (neither in the
    answer nor an accelerator memtopo knows)."""
    by_node: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    unplaced: dict[str, set[str]] = defaultdict(set)
    for grant in grants:
        for dev_id in grant.ids:
            nodes = _grant_nodes(grant, dev_id, index)
            if nodes:
                by_node[min(nodes)][grant.resource].add(dev_id)
            else:
                unplaced[grant.resource].add(dev_id)
    return by_node, unplaced


def _ids(grants: Iterable[DeviceGrant]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for grant in grants:
        out[grant.resource].update(grant.ids)
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
    """NUMA node → device resource → (capacity, allocatable, available), for the accelerators memtopo
    discovered and for every device-plugin resource the kubelet reports (NICs, SR-IOV VFs, RDMA
    devices, anything a plugin registers) whose devices have a NUMA node.

    An accelerator's capacity is the accelerators there; a resource only the kubelet reports has as
    much capacity as it reports allocatable, as NFD counts it. Allocatable is the kubelet's allocatable
    devices there when it reports that resource (a device plugin that is not registered hands out
    nothing), else capacity; available is allocatable less the allocatable devices running containers
    hold."""
    capacity = device_capacity(topo)
    index = _device_index(topo)
    allocatable = _devices_by_node(pods.allocatable_devices, index) if pods else {}
    assigned = _devices_by_node(pods.assigned_devices, index) if pods else {}
    held_ids = _ids(pods.assigned_devices) if pods else {}
    reported = {g.resource for g in pods.allocatable_devices} if pods else set()
    out: dict[int, dict[str, tuple[int, int, int]]] = {}
    for node in sorted(set(capacity) | set(allocatable)):
        counts: dict[str, tuple[int, int, int]] = {}
        found = capacity.get(node, {})
        for res in sorted(set(found) | set(allocatable.get(node, {}))):
            if res in reported:
                # Held devices by id: the kubelet's List may name a device's NUMA node where its
                # allocatable answer does not, and the other way round.
                ids = allocatable.get(node, {}).get(res, set())
                cap = found.get(res, len(ids))
                alloc, held = min(len(ids), cap), held_ids.get(res, set()) & ids
            else:
                cap = alloc = found[res]
                held = assigned.get(node, {}).get(res, set())
            counts[res] = (cap, alloc, max(alloc - len(held), 0))
        out[node] = counts
    return out


def node_level_devices(topo: pb.MemoryTopology, pods: PodResourcesView | None,
                       zone_ids: Iterable[int] = ()) -> dict[str, tuple[int, int]]:
    """Device resource → (allocatable, available) of the kubelet's devices that belong to no zone: no
    NUMA node in its answer nor an accelerator memtopo knows, or a NUMA node that is not a zone. As
    NFD does, they are in no zone's resources: a topology-aware scheduler then checks them against the
    node's allocatable alone."""
    if pods is None:
        return {}
    zones = set(zone_ids)
    by_node, unplaced = _place(pods.allocatable_devices, _device_index(topo))
    for node, resources in by_node.items():
        if node not in zones:
            for res, ids in resources.items():
                unplaced[res] |= ids
    held = _ids(pods.assigned_devices)
    return {res: (len(ids), len(ids - held.get(res, set()))) for res, ids in sorted(unplaced.items())}


def available_devices(topo: pb.MemoryTopology, pods: PodResourcesView | None) -> dict[str, dict[str, int]]:
    """Zone → device resource → devices still free for new pods (see :func:`device_counts`); without
    PodResources, every accelerator there. Zones with no devices are absent. For an object read
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


def _zone_resources(node: pb.NumaNode, facts: _NodeFacts, devices: Mapping[str, tuple[int, int, int]],
                    enforced: EnforcedCpus | None = None) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    kubelet, pods = facts.kubelet, facts.pods
    cpus = set(node.cpus)
    if cpus:
        if pods is not None and pods.allocatable_cpus:
            alloc = len(cpus & facts.allocatable_cpus)
        else:
            alloc = len(cpus - facts.reserved_cpus)
        exclusive = set(facts.assigned_cpus)
        if enforced is not None:
            # What memtopo's enforcement pinned is held as surely as what the kubelet pinned; while it
            # is not known yet, no CPU is offered as free rather than one that may be taken.
            exclusive |= enforced.cpus if enforced.known else cpus
        out.append(_resource("cpu", len(cpus), alloc, alloc - len(cpus & exclusive), count=True))
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
                    pods_problem: str, enforced: EnforcedCpus | None = None,
                    node_level: Mapping[str, tuple[int, int]] | None = None) -> list[dict[str, str]]:
    attrs: list[dict[str, str]] = []
    if kubelet.readable:
        # The kubelet's own defaults when its file leaves them out; NFD's attribute names, which the
        # scheduler plugin reads.
        attrs.append(_attr("topologyManagerPolicy", kubelet.topology_manager_policy or "none"))
        attrs.append(_attr("topologyManagerScope", kubelet.topology_manager_scope or "container"))
        # Which resources give NUMA hints at all (k8s/admission.py reads them; no other publisher writes them).
        attrs.append(_attr(ATTR + "cpu-manager-policy", kubelet.cpu_manager_policy or "none"))
        attrs.append(_attr(ATTR + "memory-manager-policy", kubelet.memory_manager_policy or "None"))
        attrs.append(_attr(ATTR + "kubelet-config", kubelet.config_path))
    else:
        attrs.append(_attr(ATTR + "kubelet-config", f"unreadable: {kubelet.problem or 'not found'}"))
    if pods is not None:
        attrs.append(_attr(ATTR + "pod-resources", f"kubelet: {pods.pods} pods"))
        if pods.pods_fingerprint:
            # NFD's attributes: the pods the object counts (every pod PodResources List names), so a
            # scheduler can tell whether the object already counts the pods it bound here.
            attrs.append(_attr(podfingerprint.ATTRIBUTE, pods.pods_fingerprint))
            attrs.append(_attr(podfingerprint.METHOD_ATTRIBUTE, podfingerprint.METHOD_ALL))
    else:
        attrs.append(_attr(ATTR + "pod-resources",
                           f"unavailable ({pods_problem or 'not read'}): available = allocatable"))
    if node_level:
        attrs.append(_attr(ATTR + "node-level-resources",
                           ",".join(f"{res}={avail}/{alloc}" for res, (alloc, avail) in sorted(node_level.items()))))
    if enforced is not None:
        attrs.append(_attr(ATTR + "cpu-enforcement", _enforcement_words(enforced)))
    attrs.append(_attr(ATTR + "fingerprint", topo.fingerprint))
    attrs.append(_attr(ATTR + "generation", topo.generation))
    return attrs


def _enforcement_words(enforced: EnforcedCpus) -> str:
    if not enforced.known:
        return f"not known yet ({enforced.note or 'no pass yet'}): cpu available = 0"
    if enforced.note:
        return enforced.note
    return f"memtopo: {enforced.pods} pods, {len(enforced.cpus)} exclusive CPUs"


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
              owner: Mapping[str, str] | None = None, enforced: EnforcedCpus | None = None) -> dict[str, Any]:
    """The NodeResourceTopology object for ``topo`` (``node_name`` defaults to the topology's).

    ``owner``: the Node's ``uid`` (and ``name``) for an owner reference, so the object is garbage-
    collected with its node. ``enforced``: the exclusive CPUs memtopo's enforcement holds, where it
    runs (None: it does not). Never larger than MAX_OBJECT_BYTES: what does not fit is left out, the
    least useful first (the zones' ``costs``, then their memtopo attributes; the resources the
    scheduler counts always stay), and the top-level attribute ``memtopo.io/left-out`` says what.
    Raises :class:`NrtError` for a name Kubernetes would refuse, or resources alone too large."""
    name = node_name or topo.node_name
    if not name:
        # An unprintable host name is discovered as none; host.identity's reason quotes it escaped.
        why = next((r for s in topo.sources if s.source == "host.identity" for r in s.reasons
                    if r.startswith("no host name")), "")
        raise NrtError(f"no node name{f' ({why})' if why else ''}: pass --node-name / set kubernetes.node_name")
    try:
        names.node_name(name)
    except names.InvalidNameError as exc:
        raise NrtError(f"{exc}: pass --node-name / set kubernetes.node_name") from None
    kubelet = kubelet or KubeletFacts()
    nodes = zone_nodes(topo)
    zone_ids = {n.id for n in nodes}
    devices = device_counts(topo, pods)
    groups = _groups_by_node(topo)
    facts = _NodeFacts(topo, kubelet, pods)
    resources = [_zone_resources(node, facts, devices.get(node.id, {}), enforced) for node in nodes]
    attributes = [_zone_attributes(node, facts, groups) for node in nodes]
    none: list[list[dict[str, Any]]] = [[] for _ in nodes]
    costs = none
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/managed-by": "memtopo"}}
    if owner is not None:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": owner.get("name", name),
                                        "uid": owner["uid"]}]
    top = _top_attributes(topo, kubelet, pods, pods_problem, enforced, node_level_devices(topo, pods, zone_ids))

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
