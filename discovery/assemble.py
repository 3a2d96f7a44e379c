"""Assembler: combine the probes' parts into one ``MemoryTopology``.

Precedence where sources overlap: the kernel's own files (sysfs) are authoritative for what the
kernel decides (node ids, CPUs, capacity, PCI ``numa_node``, HMAT figures, tiers); hwloc supplies
what it derives (packages, subtypes, tier ranks, PCI locality, OS device names) and everything when
the input is an hwloc XML export. Where both know a fact and disagree, the hwloc source status says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field
from functools import lru_cache

from memtopo.cpulist import CpuListError, format_cpulist, parse_cpulist
from memtopo.discovery.accelerators import (
    Accelerators,
    PciView,
    Record,
    bdf_order,
    hwloc_pci_node,
    hwloc_view,
    pci_kind,
    sysfs_view,
    vendor_bdfs,
)
from memtopo.discovery.accelerators import build as build_accelerators
from memtopo.discovery.parts import (
    AcceleratorPart,
    Allowed,
    CxlDecoderInfo,
    DaxInfo,
    HmatAccess,
    HwlocNode,
    HwlocPart,
    Identity,
    Ids,
    SysCxl,
    SysNode,
    SysNuma,
    SysPci,
    SysTiers,
)
from memtopo.discovery.source import ProbeResult, SourceStatus, State
from memtopo.model import frozen, mutable
from memtopo.v1 import topology_pb2 as pb

# hwloc's own rule for calling memory HBM from bandwidth: more than twice the DRAM figure.
HBM_BANDWIDTH_FACTOR = 2
# hwloc's local_memory excludes huge pages; beyond that, sizes may differ by rounding only.
CAPACITY_TOLERANCE = 0.01

_STATE = {
    State.OK: pb.SOURCE_STATE_OK,
    State.DEGRADED: pb.SOURCE_STATE_DEGRADED,
    State.UNAVAILABLE: pb.SOURCE_STATE_UNAVAILABLE,
}
_ACCEL_KIND = {"GPU": pb.ACCELERATOR_KIND_GPU, "NPU": pb.ACCELERATOR_KIND_NPU, "XPU": pb.ACCELERATOR_KIND_XPU}
_KIND = {
    "gpu": pb.PCI_DEVICE_KIND_GPU,
    "nic": pb.PCI_DEVICE_KIND_NIC,
    "infiniband": pb.PCI_DEVICE_KIND_INFINIBAND,
    "nvme": pb.PCI_DEVICE_KIND_NVME,
    "npu": pb.PCI_DEVICE_KIND_NPU,
    "xpu": pb.PCI_DEVICE_KIND_XPU,
    "accelerator": pb.PCI_DEVICE_KIND_ACCELERATOR,
    "cxl_memory": pb.PCI_DEVICE_KIND_CXL_MEMORY,
    "bridge": pb.PCI_DEVICE_KIND_BRIDGE,
    "storage": pb.PCI_DEVICE_KIND_STORAGE,
    "other": pb.PCI_DEVICE_KIND_OTHER,
}


@frozen
class Parts:
    """Every probe's result; a probe that did not run is None."""

    identity: ProbeResult[Identity] | None = None
    numa: ProbeResult[SysNuma] | None = None
    tiers: ProbeResult[SysTiers] | None = None
    cxl: ProbeResult[SysCxl] | None = None
    pci: ProbeResult[SysPci] | None = None
    allowed: ProbeResult[Allowed] | None = None
    hwloc: ProbeResult[HwlocPart] | None = None
    # Vendor accelerator sources by name (nvml, amd.kfd, npu-smi, xpu-smi).
    accelerators: Mapping[str, ProbeResult[AcceleratorPart]] = field(default_factory=dict)
    extra_statuses: tuple[SourceStatus, ...] = field(default=())


def _data[T](result: ProbeResult[T] | None) -> T | None:
    """A part's data, unless its source was unavailable (then it has nothing to say)."""
    if result is None or result.status.state is State.UNAVAILABLE:
        return None
    return result.data


@mutable
class _Node:
    """Working record for one NUMA node while assembling."""

    id: int
    online: bool
    cpus: tuple[int, ...] = ()
    memory: int = 0
    free: int = 0
    distances: tuple[int, ...] = ()
    distance_nodes: tuple[int, ...] = ()
    sys: SysNode | None = None
    hw: HwlocNode | None = None
    domain: int = -1

    def distance_to(self, other: int) -> int:
        """SLIT distance to ``other``; 0 when unknown."""
        if self._distance_map is None:
            self._distance_map = dict(zip(self.distance_nodes, self.distances, strict=False))
        return self._distance_map.get(other, 0)

    _distance_map: dict[int, int] | None = None


def assemble(parts: Parts, source_root: str = "/") -> pb.MemoryTopology:
    numa = _data(parts.numa)
    hw = _data(parts.hwloc)
    hw = hw if hw is not None and hw.loaded else None
    tiers = _data(parts.tiers)
    cxl = _data(parts.cxl)
    pci = _data(parts.pci)
    allowed = _data(parts.allowed)
    identity = parts.identity.data if parts.identity else None

    consistency: list[str] = []
    nodes = _nodes(numa, hw, consistency)
    by_id = {n.id: n for n in nodes}
    kernel_tier_of = {node: t.id for t in (tiers.tiers if tiers else ()) for node in t.nodes}
    dax_by_node = _dax_by_target(cxl)
    regions = list(cxl.regions) if cxl else []
    region_index = {r.name: i for i, r in enumerate(regions)}

    topo = pb.MemoryTopology(source_root=source_root)
    if identity:
        topo.node_name, topo.machine_id, topo.boot_id = (
            identity.node_name, identity.machine_id, identity.boot_id)

    node_memory = {n.id: n.memory for n in nodes if n.online}
    cpu_nodes = {n.id for n in nodes if n.cpus}
    vendor = {src: r.data for src, r in parts.accelerators.items() if r.status.state is not State.UNAVAILABLE}
    views = _pci(topo, pci, hw, cpu_nodes, consistency, vendor_bdfs(vendor))
    accels = build_accelerators(vendor, views, hw, node_memory)

    # Domains: one per online node with memory, in node order, except that a superchip's CPU node
    # and GPU-memory node(s) form one Unified domain (numbered at its first node).
    mem_nodes = [n for n in nodes if n.online and n.memory > 0]
    group_of = {node: g for g in accels.unified_groups for node in g}
    members: list[list[_Node]] = []
    domain_of_group: dict[Ids, int] = {}
    for node in mem_nodes:
        g = group_of.get(node.id)
        if g is not None and g in domain_of_group:
            node.domain = domain_of_group[g]
            members[node.domain].append(node)
            continue
        node.domain = len(members)
        members.append([node])
        if g is not None:
            domain_of_group[g] = node.domain
    unified_domains = set(domain_of_group.values())
    # The node that speaks for a domain in distances and links: its first node with CPUs.
    primaries = [next((n for n in ms if n.cpus), ms[0]) for ms in members]
    dram_bw = _dram_reference_bandwidth(mem_nodes)
    memattrs = _MemattrIndex(hw)
    normal = set(numa.has_normal_memory) if numa and numa.has_normal_memory is not None else None
    for domain_id, (ms, primary) in enumerate(zip(members, primaries, strict=True)):
        unified = domain_id in unified_domains
        kinds = {n.hw.subtype for n in ms if n.hw and n.hw.subtype}
        if unified and kinds:
            # hwloc names only the superchip's GPU side (GPUMemory); its CPU side is plain DRAM, and
            # the domain is both.
            kinds |= {"DRAM" for n in ms if n.hw and not n.hw.subtype and n.memory}
        subtype = "+".join(sorted(kinds))
        dax = dax_by_node.get(primary.id)
        dtype = pb.MEMORY_DOMAIN_TYPE_UNIFIED if unified else _domain_type(primary, subtype, dax, dram_bw)
        d = topo.domains.add(
            id=domain_id,
            type=dtype,
            capacity_bytes=sum(n.memory for n in ms),
            free_bytes=sum(n.free for n in ms),
            numa_nodes=[n.id for n in ms],
            attached_cpus=sorted({c for n in ms for c in n.cpus}),
            kernel_tier=kernel_tier_of.get(primary.id, -1),
            hwloc_tier=primary.hw.memory_tier if primary.hw and primary.hw.memory_tier is not None else -1,
            subtype=subtype,
            distances=[primary.distance_to(other.id) for other in primaries],
            local_cpus=sorted({c for n in ms for c in _local_cpus(n, by_id)}),
            movable_only=normal is not None and all(n.id not in normal for n in ms),
            cxl_region=region_index.get(dax.cxl_region, -1) if dax and dax.cxl_region else -1,
        )
        for n in ms:
            for c in n.sys.side_caches if n.sys else ():
                d.memory_side_caches.add(
                    level=c.level, size_bytes=c.size_bytes, line_size_bytes=c.line_size_bytes,
                    indexing=c.indexing, write_policy=c.write_policy)
        best = _best_initiator_perf(primary, memattrs)
        if best is not None:
            d.local_performance.CopyFrom(best)
    topo.total_capacity_bytes = sum(d.capacity_bytes for d in topo.domains)

    _interconnects(topo, primaries, memattrs)
    _numa_nodes(topo, nodes, numa, hw)
    _accelerators(topo, accels, by_id)
    _tiers(topo, tiers, mem_nodes)
    _cxl(topo, cxl)
    _cpus_and_allowed(topo, numa, hw, allowed)
    topo.demotion_enabled = bool(tiers and tiers.demotion_enabled)
    _statuses(topo, parts, consistency)
    return topo


# ---- nodes ---------------------------------------------------------------------------------------
def _nodes(numa: SysNuma | None, hw: HwlocPart | None, consistency: list[str]) -> list[_Node]:
    sys_nodes = {n.id: n for n in numa.nodes} if numa else {}
    hw_nodes = {n.os_index: n for n in hw.nodes} if hw else {}
    online = set(numa.online) if numa and numa.online is not None else set(sys_nodes) | set(hw_nodes)
    possible = set(numa.possible) if numa and numa.possible is not None else set()
    own_cpus = _hwloc_own_cpus(hw) if hw and not numa else {}
    hw_distance = _hwloc_distance_rows(hw) if hw else {}

    out: list[_Node] = []
    for nid in sorted(online | possible | set(sys_nodes) | set(hw_nodes)):
        s, h = sys_nodes.get(nid), hw_nodes.get(nid)
        node = _Node(id=nid, online=nid in online and (s is not None or h is not None), sys=s, hw=h)
        if s is not None:
            node.cpus, node.memory, node.free = s.cpus, s.mem_total_bytes, s.mem_free_bytes
            node.distances, node.distance_nodes = s.distances, numa.distance_nodes if numa else ()
        elif h is not None:
            node.cpus, node.memory = own_cpus.get(nid, ()), h.local_memory
            node.distance_nodes, node.distances = hw_distance.get(nid, ((), ()))
        if s is not None and h is not None:
            _check_node(s, h, consistency)
        out.append(node)
    if numa and hw:
        hidden = sorted(nid for nid in sys_nodes if nid in online and nid not in hw_nodes
                        and sys_nodes[nid].mem_total_bytes > 0)
        if hidden:
            consistency.append(f"hwloc does not show NUMA nodes {_fmt(hidden)} that sysfs has with memory")
    return out


def _check_node(s: SysNode, h: HwlocNode, consistency: list[str]) -> None:
    if s.cpus and not set(s.cpus) <= set(h.cpuset):
        consistency.append(
            f"node {s.id}: sysfs cpus {_fmt(s.cpus)} not within hwloc cpuset {_fmt(h.cpuset)}")
    explained = s.hugepages_bytes + CAPACITY_TOLERANCE * s.mem_total_bytes
    if abs(s.mem_total_bytes - h.local_memory) > explained:
        consistency.append(
            f"node {s.id}: sysfs MemTotal {s.mem_total_bytes} vs hwloc local_memory {h.local_memory}")


def _hwloc_own_cpus(hw: HwlocPart) -> dict[int, tuple[int, ...]]:
    """Which node owns each PU when only hwloc is known (XML input).

    hwloc gives CPU-less memory the cpuset of its locality, so several nodes can share a PU. A PU
    belongs to the node with the smallest cpuset containing it; among equals, to plain DRAM (no
    subtype or "DRAM") first, then the lowest id.
    """
    owner: dict[int, int] = {}
    ranked = sorted(hw.nodes, key=lambda n: (len(n.cpuset), n.subtype not in ("", "DRAM"), n.os_index))
    for n in ranked:
        for cpu in n.cpuset:
            owner.setdefault(cpu, n.os_index)
    own: dict[int, list[int]] = {}
    for cpu, nid in owner.items():
        own.setdefault(nid, []).append(cpu)
    return {nid: tuple(sorted(cpus)) for nid, cpus in own.items()}


def _hwloc_distance_rows(hw: HwlocPart) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rows of hwloc's NUMA latency matrix (NUMALatency preferred, else the first one)."""
    if not hw.distances:
        return {}
    matrix = next((d for d in hw.distances if d.name == "NUMALatency"), hw.distances[0])
    order = sorted(range(len(matrix.nodes)), key=lambda i: matrix.nodes[i])
    cols = tuple(matrix.nodes[i] for i in order)
    return {matrix.nodes[i]: (cols, tuple(matrix.matrix[i][j] for j in order)) for i in order}


def _local_cpus(node: _Node, by_id: Mapping[int, _Node]) -> tuple[int, ...]:
    if node.hw is not None and node.hw.cpuset:
        return node.hw.cpuset
    if node.cpus:
        return node.cpus
    initiators = _hmat_initiators(node)
    return tuple(sorted({c for i in initiators if i in by_id for c in by_id[i].cpus}))


def _hmat_access(node: _Node) -> HmatAccess | None:
    """The access class to trust: access1 (CPU initiators) first, as the kernel does for tiers."""
    if node.sys is None or not node.sys.access:
        return None
    by_class = {a.access_class: a for a in node.sys.access}
    return by_class.get(1) or by_class.get(0)


def _hmat_initiators(node: _Node) -> tuple[int, ...]:
    acc = _hmat_access(node)
    return acc.initiators if acc else ()


# ---- domain classification -------------------------------------------------------------------------
def _dram_reference_bandwidth(mem_nodes: Sequence[_Node]) -> int:
    """HMAT read bandwidth of CPU-bearing nodes (the DRAM reference), 0 when unknown."""
    figures = sorted(a.read_bandwidth_mbps for n in mem_nodes if n.cpus
                     if (a := _hmat_access(n)) is not None and a.read_bandwidth_mbps)
    return figures[len(figures) // 2] if figures else 0


def _domain_type(
    node: _Node, subtype: str, dax: DaxInfo | None, dram_bw: int
) -> pb.MemoryDomainType.ValueType:
    """Evidence in order of strength: CXL region, hwloc subtype, DAX parent, HMAT bandwidth."""
    if (dax and (dax.cxl_region or dax.parent_kind == "cxl")) or subtype.startswith("CXL-"):
        return pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED
    if subtype == "HBM":
        return pb.MEMORY_DOMAIN_TYPE_HBM
    if subtype == "GPUMemory":
        return pb.MEMORY_DOMAIN_TYPE_GPU_MEMORY
    if subtype == "NVM" or (dax and dax.parent_kind == "nvdimm"):
        return pb.MEMORY_DOMAIN_TYPE_NVM
    acc = _hmat_access(node)
    if not node.cpus and acc and dram_bw and acc.read_bandwidth_mbps > HBM_BANDWIDTH_FACTOR * dram_bw:
        return pb.MEMORY_DOMAIN_TYPE_HBM
    return pb.MEMORY_DOMAIN_TYPE_DRAM


def _dax_by_target(cxl: SysCxl | None) -> dict[int, DaxInfo]:
    """The DAX device onlined as each node (system-ram mode only: devdax memory is not a node)."""
    out: dict[int, DaxInfo] = {}
    for dax in cxl.dax if cxl else ():
        if dax.target_node >= 0 and dax.mode == "system-ram":
            out.setdefault(dax.target_node, dax)
    return out


# ---- performance -----------------------------------------------------------------------------------
_MEMATTR_FIELDS = {
    "ReadBandwidth": ("read_bandwidth_mbps",),
    "WriteBandwidth": ("write_bandwidth_mbps",),
    "Bandwidth": ("read_bandwidth_mbps", "write_bandwidth_mbps"),
    "ReadLatency": ("read_latency_ns",),
    "WriteLatency": ("write_latency_ns",),
    "Latency": ("read_latency_ns", "write_latency_ns"),
}
# Specific attributes override the averaged ones.
_MEMATTR_ORDER = ("Bandwidth", "Latency", "ReadBandwidth", "WriteBandwidth", "ReadLatency", "WriteLatency")


class _MemattrIndex:
    """hwloc memattr values by (target node, initiator cpuset) for O(1) pair lookups."""

    def __init__(self, hw: HwlocPart | None) -> None:
        self.values: dict[tuple[int, tuple[int, ...]], dict[str, int]] = {}
        for v in hw.memattrs if hw else ():
            if v.attribute in _MEMATTR_FIELDS and v.initiator_cpus is not None and v.value > 0:
                self.values.setdefault((v.target_node, v.initiator_cpus), {})[v.attribute] = v.value
        self.targets = {target for target, _ in self.values}

    def has_target(self, target: int) -> bool:
        return target in self.targets

    def perf(self, target: int, initiator_cpus: tuple[int, ...]) -> pb.LinkPerformance | None:
        attrs = self.values.get((target, initiator_cpus))
        if not attrs:
            return None
        figures: dict[str, int] = {}
        for name in _MEMATTR_ORDER:
            if name in attrs:
                for f in _MEMATTR_FIELDS[name]:
                    figures[f] = attrs[name]
        return pb.LinkPerformance(source=pb.PERFORMANCE_SOURCE_HWLOC_MEMATTR, access_class=-1, **figures)


def _hmat_perf(acc: HmatAccess) -> pb.LinkPerformance:
    return pb.LinkPerformance(
        read_bandwidth_mbps=acc.read_bandwidth_mbps, write_bandwidth_mbps=acc.write_bandwidth_mbps,
        read_latency_ns=acc.read_latency_ns, write_latency_ns=acc.write_latency_ns,
        source=pb.PERFORMANCE_SOURCE_HMAT, access_class=acc.access_class)


def _pair_perf(initiator: _Node, target: _Node, memattrs: _MemattrIndex) -> pb.LinkPerformance:
    """Figures for initiator's CPUs reaching target's memory; SLIT-only when nothing better is known."""
    acc = _hmat_access(target)
    if acc is not None and acc.has_figures and initiator.id in acc.initiators:
        return _hmat_perf(acc)
    if initiator.cpus:
        found = memattrs.perf(target.id, _initiator_cpus(initiator))
        if found is not None:
            return found
    return pb.LinkPerformance(source=pb.PERFORMANCE_SOURCE_SLIT, access_class=-1)


def _best_initiator_perf(node: _Node, memattrs: _MemattrIndex) -> pb.LinkPerformance | None:
    """Figures from the memory's own best initiator: HMAT's, else hwloc's local cpuset."""
    acc = _hmat_access(node)
    if acc is not None and acc.has_figures:
        return _hmat_perf(acc)
    cpus = _initiator_cpus(node)
    return memattrs.perf(node.id, cpus) if cpus else None


# Up to this many domains every pair is an interconnect (2,016 pairs); above, only the pairs with
# figures beyond SLIT (the schema's MemoryTopology.slit_only_pairs_omitted).
MAX_ALL_PAIRS_DOMAINS = 64


def _initiator_cpus(node: _Node) -> tuple[int, ...]:
    """The CPUs hwloc's memattrs name for accesses from ``node`` (its locality, else its own)."""
    return node.hw.cpuset if node.hw and node.hw.cpuset else node.cpus


def _interconnects(topo: pb.MemoryTopology, primaries: Sequence[_Node], memattrs: _MemattrIndex) -> None:
    """Every domain pair, between the nodes speaking for each domain, up to MAX_ALL_PAIRS_DOMAINS
    domains; past that, the pairs with figures beyond SLIT, found from the figures rather than by
    trying every pair (1,024 domains make 523,776 pairs), and the rest counted."""
    mem_nodes = primaries
    has_figures = [((acc := _hmat_access(n)) is not None and acc.has_figures) or memattrs.has_target(n.id)
                   for n in mem_nodes]
    slit = pb.LinkPerformance(source=pb.PERFORMANCE_SOURCE_SLIT, access_class=-1)
    template = {link: pb.MemoryInterconnect(link_type=link, a_to_b=slit, b_to_a=slit)
                for link in (pb.MEMORY_LINK_TYPE_NUMA_LINK, pb.MEMORY_LINK_TYPE_CXL_SWITCH)}
    types = [d.type for d in topo.domains]
    cxl = pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED
    links = topo.interconnects

    def add(i: int, j: int) -> pb.MemoryInterconnect:
        # Each pair starts as a copy of a SLIT-only template; only targets with figures are looked up.
        a, b = mem_nodes[i], mem_nodes[j]
        m = links.add()
        m.CopyFrom(template[pb.MEMORY_LINK_TYPE_CXL_SWITCH if cxl in (types[i], types[j])
                            else pb.MEMORY_LINK_TYPE_NUMA_LINK])
        m.domain_a, m.domain_b = i, j
        m.numa_node_a, m.numa_node_b = a.id, b.id
        m.distance_a_to_b, m.distance_b_to_a = a.distance_to(b.id), b.distance_to(a.id)
        if has_figures[j]:
            m.a_to_b.CopyFrom(_pair_perf(a, b, memattrs))
        if has_figures[i]:
            m.b_to_a.CopyFrom(_pair_perf(b, a, memattrs))
        return m

    n = len(mem_nodes)
    if n <= MAX_ALL_PAIRS_DOMAINS:
        for i in range(n):
            for j in range(i + 1, n):
                add(i, j)
        return
    kept = 0
    for i, j in sorted(_pairs_with_figures(mem_nodes, memattrs)):
        m = add(i, j)
        if m.a_to_b.source == pb.PERFORMANCE_SOURCE_SLIT and m.b_to_a.source == pb.PERFORMANCE_SOURCE_SLIT:
            del links[-1]
        else:
            kept += 1
    topo.slit_only_pairs_omitted = n * (n - 1) // 2 - kept


def _pairs_with_figures(mem_nodes: Sequence[_Node], memattrs: _MemattrIndex) -> set[tuple[int, int]]:
    """Index pairs (i < j) where one side may have figures for the other: HMAT names the initiator,
    or hwloc has a memattr for the target from the initiator's CPUs (what _pair_perf looks up)."""
    index_of = {node.id: k for k, node in enumerate(mem_nodes)}
    by_cpus: dict[tuple[int, ...], list[int]] = {}
    for k, node in enumerate(mem_nodes):
        if node.cpus:
            by_cpus.setdefault(_initiator_cpus(node), []).append(k)
    pairs: set[tuple[int, int]] = set()
    for j, target in enumerate(mem_nodes):
        acc = _hmat_access(target)
        if acc is not None and acc.has_figures:
            pairs.update((min(i, j), max(i, j)) for ini in acc.initiators
                         if (i := index_of.get(ini, j)) != j)
    for target_id, cpus in memattrs.values:
        t = index_of.get(target_id)
        if t is not None:
            pairs.update((min(i, t), max(i, t)) for i in by_cpus.get(cpus, ()) if i != t)
    return pairs


def _accelerators(topo: pb.MemoryTopology, accels: Accelerators, by_id: Mapping[int, _Node]) -> None:
    """Each device belongs to the domain of its NUMA node (a Unified one for superchips; none for
    node -1) and is attached to that domain and to the domains holding its own memory."""
    noting = [rec for rec in accels.records if rec.memory_numa_nodes or rec.attributes.get("mig_placeholder_nodes")]
    node_msgs = {n.id: n for n in topo.numa_nodes} if noting else {}
    for rec in noting:
        for n in rec.memory_numa_nodes:
            if n in node_msgs:
                node_msgs[n].note = f"GPU memory of {rec.id}" if rec.kind == "GPU" else f"memory of {rec.id}"
        if rec.attributes.get("mig_placeholder_nodes"):
            for n in _placeholder_nodes(rec):
                if n in node_msgs and not node_msgs[n].note:
                    node_msgs[n].note = f"MIG placeholder of {rec.id}"
    # Indices per domain, appended to each domain once at the end: in record order either way.
    attached_to: dict[int, list[int]] = {}
    add = topo.accelerators.add
    for idx, rec in enumerate(accels.records):
        node = by_id.get(rec.numa_node)
        domain = node.domain if node is not None else -1
        msg = add(
            index=rec.index, kind=_ACCEL_KIND.get(rec.kind, pb.ACCELERATOR_KIND_OTHER), vendor=rec.vendor,
            model=rec.model, uuid=rec.uuid, bdf=rec.bdf, memory_bytes=rec.memory_bytes, health=rec.health,
            numa_node=rec.numa_node, local_cpus=rec.local_cpus, domain=domain, source=rec.source, id=rec.id,
            unified_memory=rec.unified)
        # An empty list or map passed to the constructor costs as much as a full one: only when set.
        if rec.memory_numa_nodes:
            msg.memory_numa_nodes.extend(rec.memory_numa_nodes)
            attached = {by_id[n].domain for n in rec.memory_numa_nodes if n in by_id}
            attached.add(domain)
            attached.discard(-1)
            for d in attached:
                attached_to.setdefault(d, []).append(idx)
        elif domain >= 0:
            attached_to.setdefault(domain, []).append(idx)
        if rec.attributes:
            msg.attributes.update(rec.attributes)
        if rec.unified and domain >= 0:
            _coherent_fabric(topo, rec, domain, by_id)
            if rec.attributes.get("cdmm") == "true":
                # CDMM: the driver keeps the HBM; still one coherent superchip, but only the CPU
                # side's memory is in this domain's capacity.
                dom = topo.domains[domain]
                cdmm = f"{rec.id} memory is driver-managed (CDMM), not OS-visible"
                dom.note = "; ".join(filter(None, [dom.note, cdmm]))
    for d, indices in attached_to.items():
        topo.domains[d].attached_accelerators.extend(indices)
    for link in accels.links:
        topo.accelerator_links.add(a=link.a, b=link.b, kind=link.kind, count=link.link_count,
                                   bandwidth_mbps=link.bandwidth_mbps, source=link.source)
    for kind, ids in accels.groups:
        topo.accelerator_groups.add(kind=kind, members=ids)
    for fab in accels.fabrics:
        topo.accelerator_groups.add(kind="nvswitch-fabric", members=fab.members, link_kind=fab.link_kind,
                                    link_count=fab.link_count, bandwidth_mbps=fab.bandwidth_mbps, source=fab.source)


def _coherent_fabric(topo: pb.MemoryTopology, rec: Record, domain: int, by_id: Mapping[int, _Node]) -> None:
    """The CPU↔GPU link inside a Unified domain (a CoherentFabric interconnect carrying the
    C2C bandwidth: NVML's for GH200/GB200, KFD's CPU io_link for MI300A). Only the vendor's figure
    is used; without one the link is reported with 0 (unknown), never a datasheet number."""
    bw = _int_attr(rec.attributes.get("c2c_bandwidth_mbps") or rec.attributes.get("cpu_link_bandwidth_mbps", ""))
    perf = pb.LinkPerformance(read_bandwidth_mbps=bw, write_bandwidth_mbps=bw,
                              source=pb.PERFORMANCE_SOURCE_VENDOR_API if bw else pb.PERFORMANCE_SOURCE_UNSPECIFIED,
                              access_class=-1)
    cpu_node = rec.numa_node
    gpu_node = next(iter(rec.memory_numa_nodes), -1)
    cpu, gpu = by_id.get(cpu_node), by_id.get(gpu_node)
    topo.interconnects.add(domain_a=domain, domain_b=domain, link_type=pb.MEMORY_LINK_TYPE_COHERENT_FABRIC,
                           a_to_b=perf, b_to_a=perf, numa_node_a=cpu_node, numa_node_b=gpu_node,
                           accelerator=rec.id,
                           distance_a_to_b=cpu.distance_to(gpu_node) if cpu and gpu else 0,
                           distance_b_to_a=gpu.distance_to(cpu_node) if cpu and gpu else 0)


def _placeholder_nodes(rec: Record) -> tuple[int, ...]:
    try:
        return parse_cpulist(rec.attributes.get("mig_placeholder_nodes", ""))
    except CpuListError:
        return ()


def _int_attr(text: str) -> int:
    """A vendor attribute's figure for a uint64 field; 0 (unknown) when it is none or too large."""
    try:
        value = max(0, int(float(text)))
    except (ValueError, OverflowError):
        return 0
    return value if value < 1 << 64 else 0


# ---- the rest of the message -------------------------------------------------------------------------
def _numa_nodes(
    topo: pb.MemoryTopology, nodes: Sequence[_Node], numa: SysNuma | None, hw: HwlocPart | None
) -> None:
    def mask(name: str, derived: Iterable[int]) -> set[int]:
        value = getattr(numa, name) if numa else None
        return set(value) if value is not None else set(derived)

    has_cpu = mask("has_cpu", (n.id for n in nodes if n.cpus))
    has_mem = mask("has_memory", (n.id for n in nodes if n.memory))
    has_normal = mask("has_normal_memory", has_mem)
    gi = mask("has_generic_initiator", ())
    pkg_of_cpu = {c: p.os_index for p in (hw.packages if hw else ()) for c in p.cpus}
    for n in nodes:
        topo.numa_nodes.add(
            id=n.id,
            state=pb.NUMA_NODE_STATE_ONLINE if n.online else pb.NUMA_NODE_STATE_POSSIBLE_OFFLINE,
            cpus=n.cpus, memory_bytes=n.memory,
            has_cpu=n.id in has_cpu, has_memory=n.id in has_mem,
            has_normal_memory=n.id in has_normal, generic_initiator=n.id in gi,
            distances=n.distances, distance_nodes=n.distance_nodes, domain=n.domain,
            initiator_nodes=_hmat_initiators(n),
            packages=sorted({pkg_of_cpu[c] for c in n.cpus if c in pkg_of_cpu}),
        )


def _tiers(topo: pb.MemoryTopology, tiers: SysTiers | None, mem_nodes: Sequence[_Node]) -> None:
    domain_of = {n.id: n.domain for n in mem_nodes}
    for t in tiers.tiers if tiers else ():
        topo.memory_tiers.add(id=t.id, source=pb.TIER_SOURCE_KERNEL, numa_nodes=t.nodes,
                              domains=sorted(domain_of[n] for n in t.nodes if n in domain_of))
    ranks: dict[int, list[_Node]] = {}
    for n in mem_nodes:
        if n.hw is not None and n.hw.memory_tier is not None:
            ranks.setdefault(n.hw.memory_tier, []).append(n)
    for rank, members in sorted(ranks.items()):
        kinds = sorted({m.hw.subtype or "DRAM" for m in members if m.hw})
        topo.memory_tiers.add(id=rank, source=pb.TIER_SOURCE_HWLOC, numa_nodes=[m.id for m in members],
                              domains=[m.domain for m in members], kind="+".join(kinds))


def _cxl(topo: pb.MemoryTopology, cxl: SysCxl | None) -> None:
    if cxl is None:
        return
    for m in cxl.memdevs:
        dev = topo.cxl_devices.add(
            name=m.name, serial=m.serial, ram_size_bytes=m.ram_size_bytes, pmem_size_bytes=m.pmem_size_bytes,
            host=m.host, host_bridge=m.host_bridge, numa_node=m.numa_node,
            firmware_version=m.firmware_version)
        for dec in m.decoders:
            dev.decoders.add(**_decoder_fields(dec))
    roots = {d.name: d for d in cxl.root_decoders}
    for r in cxl.regions:
        daxes = [d for d in cxl.dax if d.cxl_region == r.name]
        onlined = [d.target_node for d in daxes if d.mode == "system-ram" and d.target_node >= 0]
        region = topo.cxl_regions.add(
            name=r.name, size_bytes=r.size_bytes, resource=r.resource, interleave_ways=r.interleave_ways,
            interleave_granularity=r.interleave_granularity, targets=r.targets, memdevs=r.memdevs,
            mode=r.mode, committed=r.committed, dax_devices=[d.name for d in daxes],
            numa_node=onlined[0] if onlined else -1, dax_mode=daxes[0].mode if daxes else "")
        if r.root_decoder in roots:
            region.root_decoders.add(**_decoder_fields(roots[r.root_decoder]))


def _decoder_fields(dec: CxlDecoderInfo) -> dict[str, object]:
    """CxlDecoderInfo's fields are the CxlDecoder message's, one for one."""
    return dataclasses.asdict(dec)


def _pci(topo: pb.MemoryTopology, pci: SysPci | None, hw: HwlocPart | None, cpu_nodes: set[int],
         consistency: list[str], claimed: set[str]) -> dict[str, PciView]:
    """The PCI device list, and in the same walk the views accelerator assembly needs (those of
    accelerators and of the ``claimed`` BDFs vendor sources name), by BDF."""
    hw_pci = {p.bdf: p for p in hw.pci} if hw else {}
    views: dict[str, PciView] = {}
    seen: set[str] = set()
    for dev in pci.devices if pci else ():
        seen.add(dev.bdf)
        h = hw_pci.get(dev.bdf)
        os_devs = set(dev.os_devices) | ({o.name for o in h.os_devices} if h else set())
        local_nodes = h.nodeset if h else ((dev.numa_node,) if dev.numa_node >= 0 else ())
        if h is not None and dev.numa_node >= 0 and h.nodeset and dev.numa_node not in h.nodeset:
            consistency.append(f"pci {dev.bdf}: sysfs numa_node {dev.numa_node} not in hwloc locality "
                               f"nodes {_fmt(h.nodeset)}")
        kind = pci_kind(dev.vendor_id, dev.device_id, dev.class_code)
        p = topo.pci_devices.add(
            bdf=dev.bdf, vendor_id=dev.vendor_id, device_id=dev.device_id,
            subsystem_vendor_id=dev.subsystem_vendor_id, subsystem_device_id=dev.subsystem_device_id,
            class_code=dev.class_code, kind=_KIND[kind],
            driver=dev.driver, numa_node=dev.numa_node, local_cpus=dev.local_cpus,
            local_numa_nodes=local_nodes, link_speed=dev.link_speed, link_width=dev.link_width,
            max_link_speed=dev.max_link_speed, max_link_width=dev.max_link_width, physfn=dev.physfn,
            sriov_total_vfs=dev.sriov_total_vfs, sriov_num_vfs=dev.sriov_num_vfs,
            msi_irqs=dev.msi_irqs, numa_node_inherited=dev.numa_node_inherited)
        # Usually empty, and an empty list costs the constructor as much as a short one.
        if dev.virtfns:
            p.virtfns.extend(dev.virtfns)
        if os_devs:
            p.os_devices.extend(sorted(os_devs))
        for m in dev.mdevs:
            p.mdevs.add(uuid=m.uuid, mdev_type=m.mdev_type, parent=m.parent, numa_node=m.numa_node)
        view = sysfs_view(dev, h, cpu_nodes, kind, claimed)
        if view is not None:
            views[dev.bdf] = view
    # Devices only hwloc knows (XML input): their node is hwloc's locality when it names one CPU node.
    # Sorted from hwloc's order, so that even BDFs that do not parse (they tie) keep one order.
    add = topo.pci_devices.add
    for bdf in sorted([b for b in hw_pci if b not in seen], key=bdf_order):
        h = hw_pci[bdf]
        kind = pci_kind(h.vendor_id, h.device_id, h.class_code)
        node = hwloc_pci_node(h, cpu_nodes)
        p = add(bdf=bdf, vendor_id=h.vendor_id, device_id=h.device_id,
                subsystem_vendor_id=h.subsystem_vendor_id, subsystem_device_id=h.subsystem_device_id,
                class_code=h.class_code, kind=_KIND[kind], numa_node=node,
                local_cpus=h.cpuset, local_numa_nodes=h.nodeset, link_speed=_link_speed(h.link_speed_gbps))
        if h.os_devices:
            p.os_devices.extend(sorted([o.name for o in h.os_devices]))
        view = hwloc_view(h, node, kind, claimed)
        if view is not None:
            views[bdf] = view
    return views


@lru_cache(maxsize=64)
def _link_speed(gbps: float) -> str:
    """hwloc's per-lane-summed link speed as PciDevice.link_speed text; a handful of distinct values."""
    return f"{gbps:g} GB/s" if gbps else ""


def _cpus_and_allowed(topo: pb.MemoryTopology, numa: SysNuma | None, hw: HwlocPart | None,
                      allowed: Allowed | None) -> None:
    online = numa.cpus_online if numa and numa.cpus_online else (hw.pus if hw else ())
    present = numa.cpus_present if numa else ()
    topo.cpus.online.extend(online)
    topo.cpus.possible.extend(numa.cpus_possible if numa else ())
    topo.cpus.present.extend(present)
    topo.cpus.offline.extend(sorted(set(present) - set(online)))
    if hw:
        topo.cpus.packages = len(hw.packages)
        topo.cpus.cores = hw.cores
    if allowed is not None:
        topo.allowed_cpus.extend(allowed.cpus)
        topo.allowed_memory_nodes.extend(allowed.mems)
        topo.cgroup.version = {1: pb.Cgroup.VERSION_V1, 2: pb.Cgroup.VERSION_V2}.get(
            allowed.cgroup_version, pb.Cgroup.VERSION_UNSPECIFIED)
        topo.cgroup.path = allowed.cgroup_path
        topo.cgroup.effective_cpus.extend(allowed.effective_cpus)
        topo.cgroup.effective_mems.extend(allowed.effective_mems)
    elif hw:
        topo.allowed_cpus.extend(hw.allowed_cpus)
        topo.allowed_memory_nodes.extend(hw.allowed_nodes)


def _statuses(topo: pb.MemoryTopology, parts: Parts, consistency: list[str]) -> None:
    results = [parts.identity, parts.hwloc, parts.numa, parts.tiers, parts.cxl, parts.pci, parts.allowed,
               *parts.accelerators.values()]
    statuses = [r.status for r in results if r is not None] + list(parts.extra_statuses)
    for st in sorted(statuses, key=lambda s: s.source):
        state, reasons = st.state, list(st.reasons)
        if st.source == "hwloc" and consistency and state is not State.UNAVAILABLE:
            state = State.DEGRADED
            reasons += [f"disagrees with sysfs: {c}" for c in consistency]
        msg = topo.sources.add(source=st.source, state=_STATE[state], duration_seconds=st.duration_s)
        if reasons:
            msg.reasons.extend(reasons)


def _fmt(ids: Iterable[int]) -> str:
    return format_cpulist(ids) or "(none)"
