"""Accelerators for the assembler: vendor records first, then the PCI/hwloc view as the fallback.

Every GPU, NPU and XPU on the PCI bus is reported. A vendor source (NVML, KFD, npu-smi, xpu-smi)
that knows the device supplies its name, memory, health and links; a device no vendor source
claims (driver missing, tool failing) still appears from the PCI view with its sysfs NUMA node and,
where hwloc saw an OS device for it, hwloc's model and UUID (hwloc stands in when no vendor API
answers). NUMA node −1 stays −1 ("no affinity"); nothing is guessed.

Pairs of accelerators get a link class in `nvidia-smi topo -m` words: the vendor's own (NV#, HCCS,
XGMI …) where it reports one, else the PCIe path class from the bridge tree: PIX (one switch
between them), PXB (several switches, same root port), PHB (through the host bridge), NODE
(different host bridges, same NUMA node), SYS (across the inter-socket link).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import field
from functools import lru_cache
from typing import NamedTuple

from memtopo.discovery.parts import AccelDevice, AcceleratorPart, HwlocOsDevice, HwlocPart, HwlocPci, Ids, PciInfo
from memtopo.discovery.pci_ids import classify
from memtopo.model import frozen, mutable
from memtopo.pci import bdf_sort_key
from memtopo.text import natural_key
from memtopo.v1 import topology_pb2 as pb

_KIND = {"GPU": pb.ACCELERATOR_KIND_GPU, "NPU": pb.ACCELERATOR_KIND_NPU, "XPU": pb.ACCELERATOR_KIND_XPU}
# PCI classifications that are accelerators, and the kind each is reported as.
_PCI_ACCEL = {"gpu": "GPU", "npu": "NPU", "xpu": "XPU", "accelerator": "ACC"}
# bdf_sort_key and classify are pure and see the same few BDFs and ids on every discovery; parsing
# and classifying cost more than the rest of the walks that use them. Bounded for a long-lived agent.
bdf_order = lru_cache(maxsize=4096)(bdf_sort_key)
pci_kind = lru_cache(maxsize=4096)(classify)
_VENDOR_NAME = {0x10DE: "NVIDIA", 0x1002: "AMD", 0x19E5: "Huawei", 0x1D22: "Kunlunxin", 0x8086: "Intel",
                0x1BCF: "NEC"}
# What each vendor source's groups mean.
GROUP_KIND = {"npu-smi": "hccs-ring", "xpu-smi": "numa-half", "nvml": "nvlink-island", "amd.kfd": "xgmi-hive"}
# hwloc OS device names that carry a vendor index: nvml3, cuda3, rsmi3, ve3, opencl0d3 (platform 0).
_OSDEV_INDEX = re.compile(r"^(?:nvml|cuda|rsmi|ve|opencl\d+d)(\d+)$")
# hwloc info keys with a model name or a UUID, by preference.
_MODEL_KEYS = ("GPUModel", "AMDProductName", "CoProcModel", "VectorEngineModel", "Model")
_UUID_KEYS = ("NVIDIAUUID", "AMDUUID", "AMDSerialNumber", "VectorEngineSerialNumber", "UUID")


@mutable
class Record:
    """One accelerator while assembling; becomes an ``Accelerator`` message."""

    kind: str
    vendor: str
    index: int
    source: str
    model: str = ""
    uuid: str = ""
    bdf: str = ""
    memory_bytes: int = 0
    health: str = ""
    numa_node: int = -1
    local_cpus: Ids = ()
    memory_numa_nodes: Ids = ()
    unified: bool = False
    attributes: dict[str, str] = field(default_factory=dict)
    id: str = ""


class PciView(NamedTuple):
    """What the accelerator code needs of a PCI function, from sysfs or (XML input) hwloc. A tuple
    rather than a frozen dataclass, like Link: one is made per accelerator on every discovery."""

    bdf: str
    vendor_id: int
    device_id: int
    class_code: int
    numa_node: int
    local_cpus: Ids
    upstream: tuple[str, ...]
    # hwloc OS devices below the function.
    os_devices: tuple[HwlocOsDevice, ...] = ()
    # pci_ids.classify of the ids above.
    pci_kind: str = ""


class Link(NamedTuple):
    """An accelerator pair's link, ``a < b``. A tuple rather than a dataclass: a 16-GPU box has 120
    of them per discovery, and tuples are several times cheaper to make."""

    a: str
    b: str
    kind: str
    link_count: int = 0  # not "count": that is tuple.count
    bandwidth_mbps: int = 0
    source: str = "pci"


def _ordered(x: str, y: str) -> tuple[str, str]:
    return (x, y) if x < y else (y, x)


@frozen
class Fabric:
    """A switched fabric: every pair of ``members`` linked the same way (see AcceleratorGroup)."""

    members: tuple[str, ...]
    link_kind: str
    link_count: int
    bandwidth_mbps: int
    source: str


@frozen
class Accelerators:
    records: tuple[Record, ...]
    links: tuple[Link, ...]
    groups: tuple[tuple[str, tuple[str, ...]], ...]
    fabrics: tuple[Fabric, ...]
    # Node sets that each form one Unified domain (superchip CPU node + its GPU memory nodes).
    unified_groups: tuple[Ids, ...]


def hwloc_pci_node(h: HwlocPci, cpu_nodes: set[int]) -> int:
    """An hwloc-only PCI device's NUMA node: its locality's CPU node when it names exactly one."""
    local = [n for n in h.nodeset if n in cpu_nodes]
    return local[0] if len(local) == 1 else -1


def vendor_bdfs(vendor: Mapping[str, AcceleratorPart]) -> set[str]:
    """The functions vendor sources claim: their views are needed whatever their PCI class."""
    return {dev.bdf for part in vendor.values() for dev in part.devices if dev.bdf}


# The views build() needs are those of accelerators by PCI class and of the functions a vendor
# claims; the walk over every PCI function (the assembler's, which emits the device list) asks for
# each through these two, so the functions are walked once and other functions get no view.
def sysfs_view(dev: PciInfo, h: HwlocPci | None, cpu_nodes: set[int], dev_kind: str,
               claimed: Collection[str]) -> PciView | None:
    """sysfs first; hwloc fills what a trimmed capture lacks. A missing numa_node file reads as -1
    too, and then hwloc's locality (itself from the kernel's local_cpus) may still name one node.
    ``dev_kind`` is the classification of ``dev``'s own ids. None when build() has no use for it."""
    if h is None:
        if dev_kind not in _PCI_ACCEL and dev.bdf not in claimed:
            return None
        return PciView(dev.bdf, dev.vendor_id, dev.device_id, dev.class_code, dev.numa_node, dev.local_cpus,
                       dev.upstream, (), dev_kind)
    vendor_id, device_id, class_code = dev.vendor_id or h.vendor_id, dev.device_id or h.device_id, (
        dev.class_code or h.class_code)
    kind = dev_kind if (vendor_id, device_id, class_code) == (dev.vendor_id, dev.device_id, dev.class_code) else (
        pci_kind(vendor_id, device_id, class_code))
    if kind not in _PCI_ACCEL and dev.bdf not in claimed:
        return None
    return PciView(dev.bdf, vendor_id, device_id, class_code,
                   dev.numa_node if dev.numa_node >= 0 else hwloc_pci_node(h, cpu_nodes),
                   dev.local_cpus or h.cpuset, dev.upstream or h.upstream, h.os_devices, kind)


def hwloc_view(h: HwlocPci, numa_node: int, kind: str, claimed: Collection[str]) -> PciView | None:
    """A function only hwloc knows (XML input); ``numa_node`` from hwloc_pci_node, ``kind`` its
    classification. None when build() has no use for it."""
    if kind not in _PCI_ACCEL and h.bdf not in claimed:
        return None
    return PciView(h.bdf, h.vendor_id, h.device_id, h.class_code, numa_node, h.cpuset, h.upstream,
                   h.os_devices, kind)


def build(vendor: Mapping[str, AcceleratorPart], views: Mapping[str, PciView], hw: HwlocPart | None,
          node_memory: Mapping[int, int]) -> Accelerators:
    """``views``: at least those of the accelerator functions and the vendors' BDFs (sysfs_view,
    hwloc_view); any other is ignored."""
    records: list[Record] = []
    claimed: set[str] = set()
    per_source: dict[str, dict[int, Record]] = {}
    for source in sorted(vendor):
        for dev in vendor[source].devices:
            rec = _from_vendor(source, dev, views)
            records.append(rec)
            per_source.setdefault(source, {})[dev.index] = rec
            if rec.bdf:
                claimed.add(rec.bdf)
    gpu_memory = _hwloc_gpu_memory_nodes(hw)
    unclaimed = [v for v in views.values() if v.pci_kind in _PCI_ACCEL and v.bdf not in claimed]
    for view in sorted(unclaimed, key=lambda v: bdf_order(v.bdf)):
        records.append(_from_pci(_PCI_ACCEL[view.pci_kind], view, gpu_memory.get(view.bdf, ())))
    _assign_ids(records)
    for rec in records:
        if not rec.memory_numa_nodes and rec.bdf in gpu_memory:
            rec.memory_numa_nodes = gpu_memory[rec.bdf]

    links = _vendor_links(vendor, per_source)
    have = {(lk.a, lk.b) for lk in links}
    nvlinks, fabrics = _hwloc_nvlinks(hw, records, have)
    links += nvlinks
    have |= {(lk.a, lk.b) for lk in nvlinks}
    links += _pci_links(records, views, have, fabrics)
    groups = tuple(
        (GROUP_KIND.get(source, "vendor-group"), tuple(per_source[source][i].id for i in g if i in per_source[source]))
        for source in sorted(vendor) for g in vendor[source].groups)
    unified = _unified_groups(records, node_memory)
    records.sort(key=lambda r: (r.kind, r.index, r.id))
    return Accelerators(tuple(records), tuple(sorted(links)), groups, tuple(fabrics), unified)


def _from_vendor(source: str, dev: AccelDevice, views: Mapping[str, PciView]) -> Record:
    view = views.get(dev.bdf) if dev.bdf else None
    # The kernel's numa_node is authoritative for a PCI function; the tool's word fills in when the
    # device is not on the PCI view (or the kernel says -1 and the tool knows better).
    numa = view.numa_node if view is not None and view.numa_node >= 0 else (
        dev.numa_node if dev.numa_node is not None else -1)
    local = dev.local_cpus or (view.local_cpus if view is not None else ())
    return Record(kind=dev.kind, vendor=dev.vendor, index=dev.index, source=source, model=dev.model,
                  uuid=dev.uuid, bdf=dev.bdf, memory_bytes=dev.memory_bytes, health=dev.health,
                  numa_node=numa, local_cpus=local, memory_numa_nodes=dev.memory_numa_nodes,
                  unified=dev.unified_memory, attributes=dict(dev.attributes))


def _first(info: Mapping[str, str], keys: tuple[str, ...]) -> str:
    for k in keys:
        value = info.get(k)
        if value:
            return value
    return ""


def _memory_size(info: Mapping[str, str]) -> int:
    for k, v in info.items():
        if k.endswith("MemorySize"):
            size = _kib(v)
            if size:
                return size
    return 0


@lru_cache(maxsize=4096)
def _osdev_index(name: str) -> int:
    """The vendor index in an OS device name (nvml3 → 3), -1 if it has none. Cached: the same
    names come back on every discovery, and the regex costs more than the rest of a device."""
    m = _OSDEV_INDEX.match(name)
    return int(m.group(1)) if m else -1


def _from_pci(kind: str, view: PciView, memory_nodes: Ids) -> Record:
    model = uuid = ""
    index = -1
    memory = 0
    source = "pci"
    for osdev in view.os_devices:
        if index < 0:
            index = _osdev_index(osdev.name)
        info = osdev.info
        if not model:
            found = _first(info, _MODEL_KEYS)
            # A bare model number (VectorEngineModel=1) means nothing without the device family.
            model = f"{osdev.subtype} {found}".strip() if found.isdigit() else found
        if not uuid:
            uuid = _first(info, _UUID_KEYS)
        if not memory:
            memory = _memory_size(info)
        if model or uuid:
            source = "hwloc"
    vendor = _VENDOR_NAME.get(view.vendor_id) or (f"0x{view.vendor_id:04x}" if view.vendor_id else "")
    return Record(kind=kind, vendor=vendor, index=index,
                  source=source, model=model, uuid=uuid, bdf=view.bdf, numa_node=view.numa_node,
                  local_cpus=view.local_cpus, memory_numa_nodes=memory_nodes, memory_bytes=memory)


def _kib(text: str) -> int:
    """hwloc's size infos: "50331648KiB"."""
    digits = text.removesuffix("KiB").removesuffix("kB").strip()
    return int(digits) * 1024 if digits.isdigit() else 0


def _assign_ids(records: list[Record]) -> None:
    """``<KIND><index>``; PCI-only devices without an index are numbered after the known ones, in
    BDF order. Two vendors with the same index (an NVIDIA and an AMD GPU0) are told apart by vendor."""
    used: dict[str, set[int]] = {}
    for rec in records:
        if rec.index >= 0:
            used.setdefault(rec.kind, set()).add(rec.index)
    for rec in records:
        if rec.index < 0:
            taken = used.setdefault(rec.kind, set())
            rec.index = next(i for i in range(len(taken) + 1) if i not in taken)
            taken.add(rec.index)
    seen: set[str] = set()
    for rec in records:
        rec.id = f"{rec.kind}{rec.index}"
        if rec.id in seen:
            rec.id = f"{rec.kind}{rec.index}-{rec.vendor.lower()}"
        seen.add(rec.id)


def _hwloc_gpu_memory_nodes(hw: HwlocPart | None) -> dict[str, Ids]:
    """GPUMemory NUMA nodes name their GPU in info PCIBusID (POWER9 + V100, GH200)."""
    out: dict[str, list[int]] = {}
    for node in hw.nodes if hw else ():
        bdf = node.info.get("PCIBusID", "").lower()
        if node.subtype == "GPUMemory" and bdf:
            out.setdefault(bdf, []).append(node.os_index)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _vendor_links(vendor: Mapping[str, AcceleratorPart], per_source: Mapping[str, Mapping[int, Record]]
                  ) -> list[Link]:
    out: dict[tuple[str, str], Link] = {}
    for source in sorted(vendor):
        recs = per_source.get(source, {})
        for lk in vendor[source].links:
            ra, rb = recs.get(lk.a), recs.get(lk.b)
            if ra is None or rb is None or ra is rb:
                continue
            a, b = _ordered(ra.id, rb.id)
            out.setdefault((a, b), Link(a, b, lk.kind, lk.count, lk.bandwidth_mbps, source))
    return list(out.values())


def _hwloc_nvlinks(hw: HwlocPart | None, records: Sequence[Record], have: set[tuple[str, str]]
                   ) -> tuple[list[Link], list[Fabric]]:
    """NVLink from hwloc's NVLinkBandwidth matrix (its NVML backend, or an XML export): direct GPU
    pairs as links, and GPUs on an NVSwitch fabric as fabrics, one per (ports, bandwidth) class, so
    every pair inside reads NV<ports> as nvidia-smi prints it (DGX-2: NV6). Pairs across classes get
    a link with the smaller figures. For direct links only the bandwidth is known, not the count."""
    nvlink = [d for d in hw.object_distances if d.name == "NVLinkBandwidth"] if hw is not None else []
    if hw is None or not nvlink:
        return [], []
    by_osdev: dict[str, Record] = {}
    views_bdf = {r.bdf: r for r in records if r.bdf}
    for p in hw.pci:
        rec = views_bdf.get(p.bdf)
        if rec is not None:
            for o in p.os_devices:
                by_osdev[o.name] = rec
    links: list[Link] = []
    fabrics: list[Fabric] = []
    for dist in nvlink:
        labels, matrix = dist.labels, dist.matrix
        gpus = [i for i, lbl in enumerate(labels) if lbl in by_osdev]
        switches = [i for i, lbl in enumerate(labels) if lbl.startswith("PCIDev@")]
        ids = {i: by_osdev[labels[i]].id for i in gpus}
        for x, i in enumerate(gpus):
            row = matrix[i]
            for j in [j for j in gpus[x + 1:] if row[j] > 0]:  # none behind NVSwitches: one pass
                a, b = _ordered(ids[i], ids[j])
                if (a, b) not in have:
                    links.append(Link(a, b, "NV", 0, int(row[j]), "hwloc"))
        classes: dict[tuple[int, int], list[str]] = {}
        for i in gpus:
            row = matrix[i]
            # Bandwidths are unsigned: the sum over the linked switches is the sum over all.
            linked = [row[sw] for sw in switches if row[sw] > 0]
            if linked:
                classes.setdefault((len(linked), sum(linked)), []).append(ids[i])
        keys = sorted(classes)
        for n, key in enumerate(keys):
            members = tuple(sorted(classes[key], key=natural_key))
            if len(members) > 1:
                fabrics.append(Fabric(members, "NV", key[0], int(key[1]), "hwloc"))
            for other in keys[n + 1:]:
                for a0 in members:
                    for b0 in classes[other]:
                        a, b = _ordered(a0, b0)
                        if (a, b) not in have:
                            links.append(Link(a, b, "NV", min(key[0], other[0]), int(min(key[1], other[1])), "hwloc"))
    return links, fabrics


def _pci_links(records: Sequence[Record], views: Mapping[str, PciView], have: set[tuple[str, str]],
               fabrics: Sequence[Fabric]) -> list[Link]:
    """The PCIe path class of every located pair that has no link yet (``have``, or both in one
    fabric: a 16-GPU NVSwitch box has all 120 pairs there, so they are skipped by membership)."""
    out: list[Link] = []
    located = [r for r in records if r.bdf]
    ids = {r.id for r in located}
    if len(ids) == len(located) and any(ids.issubset(f.members) for f in fabrics):
        return out  # one fabric holds every located device (an NVSwitch box): no pair is left
    fabric_peers: dict[str, set[str]] = {}
    for fab in fabrics:
        for m in fab.members:
            fabric_peers.setdefault(m, set()).update(fab.members)
    no_peers: set[str] = set()
    for x, ra in enumerate(located):
        peers = fabric_peers.get(ra.id, no_peers)
        for rb in [r for r in located[x + 1:] if r.id not in peers or r.id == ra.id]:
            a, b = _ordered(ra.id, rb.id)
            if (a, b) in have or ra.bdf == rb.bdf:
                continue
            va, vb = views.get(ra.bdf), views.get(rb.bdf)
            ua = va.upstream if va else ()
            ub = vb.upstream if vb else ()
            out.append(Link(a, b, path_class(ua, ub, ra.numa_node, rb.numa_node)))
    return out


def path_class(up_a: Sequence[str], up_b: Sequence[str], node_a: int, node_b: int) -> str:
    """`nvidia-smi topo -m`'s PCIe classes from two devices' upstream paths (root complex first)."""
    same_node = node_a >= 0 and node_a == node_b
    if not up_a or not up_b or up_a[0] != up_b[0]:
        return "NODE" if same_node else "SYS"
    common = 0
    for x, y in zip(up_a, up_b, strict=False):
        if x != y:
            break
        common += 1
    if common <= 1:
        return "PHB"
    # Below the shared bridge each device hangs off at most its own downstream port: one switch.
    if len(up_a) - common <= 1 and len(up_b) - common <= 1:
        return "PIX"
    return "PXB"


def _unified_groups(records: Iterable[Record], node_memory: Mapping[int, int]) -> tuple[Ids, ...]:
    """Each unified-memory device's CPU node and its memory nodes (those that hold memory: MIG
    placeholder nodes are empty and stay out). Overlapping sets merge."""
    groups: list[set[int]] = []
    for rec in records:
        if not rec.unified:
            continue
        nodes = {n for n in rec.memory_numa_nodes if node_memory.get(n, 0) > 0}
        if rec.numa_node >= 0:
            nodes.add(rec.numa_node)
        if not nodes:
            continue
        merged = [g for g in groups if g & nodes]
        for g in merged:
            nodes |= g
            groups.remove(g)
        groups.append(nodes)
    return tuple(sorted(tuple(sorted(g)) for g in groups))
