"""AMD GPUs and APUs from the KFD topology (/sys/class/kfd/kfd/topology) and amdgpu's PCI attributes.

KFD sysfs is the source this probe is tested on: every fact comes from files a capture carries.
amdsmi is consulted only on the live host (``ctx.libraries_live``) and only when it imports; it
then fills the marketing name and partition modes where sysfs left them out, nothing else.

What the kernel writes (``drivers/gpu/drm/amd/amdkfd/kfd_topology.c``, ``kfd_crat.[ch]``):

* ``nodes/<k>/properties``: ``name value`` lines, values ``%u``/``%llu``. ``k`` is a KFD node
  (proximity domain), not a Linux NUMA node. CPU nodes have ``simd_count 0``; a GPU (or one
  partition of one) has ``simd_count > 0``. Its PCI address is ``domain`` plus ``location_id``
  (``bus << 8 | devfn``); on a partitioned device the kernel ORs the partition's node id into
  ``location_id`` (bits 0–2, so partition p reads as function p of the device; a since-reverted
  change used bits 28–31), so all partitions of one device share ``domain``, bus, device and
  ``unique_id``.
* ``mem_banks/<i>/properties``: ``heap_type`` (0 system, 1 FB public, 2 FB private) and
  ``size_in_bytes``. Every GPU node gets one FB heap, an APU included: there it is the share of
  system RAM the GPU may allocate (the TTM limit per node), so the presence of a heap says nothing.
* ``io_links/<i>/properties`` and ``p2p_links/<i>/properties``: ``type`` (CRAT: 2 PCIe, 11 XGMI),
  ``node_from``, ``node_to``, ``weight`` (PCIe 20; XGMI 15 per hop, 13 inside one socket/package,
  41 between partitions of different devices; CPU–CPU the SLIT distance) and bandwidths in MB/s.

APU evidence (MI300A: its HBM is the system RAM of the NUMA node holding its CPUs), any of:

1. one KFD node with both CPU cores and SIMDs (older APUs describe CPU and GPU as one node);
2. the GPU's direct link to a CPU node is XGMI with the intra-socket weight 13, which
   ``kfd_fill_gpu_direct_io_link_to_cpu`` sets only for a GC 9.4.3 die in an APU package;
3. a PCI device id known to be an APU (0x74a0, MI300A), for kernels that typed the link PCIe.

Not evidence: ``gfx_target_version`` (90402/gfx942 is MI300A, MI300X and MI325X alike) and the
FB heap (see above). The APU's memory node is its PCI ``numa_node``; the CPU link's ``node_to`` is
no second opinion, since the kernel fills it from that same attribute (0 when it is unknown).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

from memtopo.discovery import presence
from memtopo.discovery.parts import AccelDevice, AcceleratorPart, AccelLink, Ids
from memtopo.discovery.pci_ids import VENDOR_AMD
from memtopo.discovery.presence import KFD_NODES
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.hostfs import HostFS, HostReadError
from memtopo.text import excerpt

SOURCE = "amd.kfd"

PCI_DEVICES = "sys/bus/pci/devices"
NUMA_NODES = "sys/devices/system/node"

# CRAT io_interface_type values (kfd_crat.h).
IOLINK_PCIE = 2
IOLINK_XGMI = 11
_IOLINK_KINDS: Mapping[int, str] = {
    0: "UNDEFINED", 1: "HYPERTRANSPORT", IOLINK_PCIE: "PCIE", 3: "AMBA", 4: "MIPI", 5: "QPI",
    8: "RAPIDIO", 9: "INFINIBAND", IOLINK_XGMI: "XGMI", 12: "XGOP", 13: "GZ", 14: "ETHERNET_RDMA",
    15: "RDMA_OTHER", 16: "OTHER",
}
# KFD_CRAT_INTRA_SOCKET_WEIGHT: GPU and CPU (or two partitions) inside one package.
INTRA_SOCKET_WEIGHT = 13
HEAP_SYSTEM = 0

# PCI device ids whose GPU shares the CPUs' memory (0x74a0 = MI300A APU in pci.ids).
APU_DEVICE_IDS: frozenset[int] = frozenset({0x74A0})
# Marketing names by PCI device id, as pci.ids names them; unknown ids keep model "" and say gfx_target.
MODELS: Mapping[int, str] = {
    0x74A0: "MI300A", 0x74A1: "MI300X", 0x74A2: "MI308X", 0x74A5: "MI325X", 0x74B5: "MI300X VF",
    0x75A0: "MI350X", 0x75A3: "MI355X", 0x7408: "MI250X", 0x740C: "MI250X", 0x740F: "MI210",
}

_KEY = re.compile(r"[a-z_][a-z0-9_]*\Z")
_MODE = re.compile(r"[A-Z0-9_]{1,16}\Z")
_U64 = 1 << 64


class KfdFormatError(ValueError):
    """A KFD properties file or amdgpu partition attribute that does not parse."""


# ---- pure parsers -----------------------------------------------------------------------------------
def parse_properties(text: str) -> dict[str, int]:
    """``name value`` lines as KFD prints them (unsigned decimal) → {name: value}.

    Blank lines and trailing NULs (hwloc-gathered trees pad files) are tolerated; anything else
    that is not one lower-case name and one unsigned 64-bit number, or a repeated name, is garbage.
    """
    out: dict[str, int] = {}
    for lineno, line in enumerate(text.rstrip("\0").splitlines(), 1):
        words = line.split()
        if not words:
            continue
        if len(words) != 2:
            raise KfdFormatError(f"line {lineno}: expected 'name value', got {excerpt(line, 60)}")
        key, value = words
        if not _KEY.match(key):
            raise KfdFormatError(f"line {lineno}: bad property name {excerpt(key)}")
        if not (value.isascii() and value.isdigit()) or len(value) > 20 or int(value) >= _U64:
            raise KfdFormatError(f"line {lineno}: {key}: not an unsigned 64-bit number: {excerpt(value)}")
        if key in out:
            raise KfdFormatError(f"line {lineno}: {key} repeated")
        out[key] = int(value)
    if not out:
        raise KfdFormatError("no properties")
    return out


def format_properties(values: Mapping[str, int]) -> str:
    """The inverse of :func:`parse_properties`, in the kernel's layout (synthesized trees use it)."""
    return "".join(f"{k} {v}\n" for k, v in values.items())


def _require(props: Mapping[str, int], keys: Iterable[str]) -> None:
    missing = [k for k in keys if k not in props]
    if missing:
        raise KfdFormatError(f"missing {', '.join(missing)}")


@dataclass(frozen=True)
class KfdMemBank:
    heap_type: int
    size_bytes: int


def parse_mem_bank(text: str) -> KfdMemBank:
    props = parse_properties(text)
    _require(props, ("heap_type", "size_in_bytes"))
    return KfdMemBank(props["heap_type"], props["size_in_bytes"])


@dataclass(frozen=True)
class KfdIoLink:
    type: int
    node_from: int
    node_to: int
    weight: int = 0
    min_bandwidth_mbps: int = 0
    max_bandwidth_mbps: int = 0

    @property
    def kind(self) -> str:
        """The CRAT interface type by name ("XGMI", "PCIE" …); unknown numbers stay visible."""
        return _IOLINK_KINDS.get(self.type, f"TYPE{self.type}")


def parse_io_link(text: str) -> KfdIoLink:
    props = parse_properties(text)
    _require(props, ("type", "node_from", "node_to"))
    return KfdIoLink(props["type"], props["node_from"], props["node_to"], props.get("weight", 0),
                     props.get("min_bandwidth", 0), props.get("max_bandwidth", 0))


def parse_partition_mode(text: str) -> str:
    """``current_compute_partition`` / ``current_memory_partition``: one word, e.g. ``CPX``, ``NPS4``."""
    mode = text.strip().strip("\0").strip()
    if not _MODE.match(mode):
        raise KfdFormatError(f"not a partition mode: {excerpt(mode)}")
    return mode


def parse_partition_list(text: str) -> tuple[str, ...]:
    """``available_*_partition``: ``SPX, DPX, QPX, CPX`` → the modes, in the kernel's order."""
    body = text.strip().strip("\0").strip()
    if not body:
        return ()
    return tuple(parse_partition_mode(word) for word in body.split(","))


def gfx_target_name(version: int) -> str:
    """``gfx_target_version`` (major*10000 + minor*100 + stepping) → the LLVM target, 90402 → gfx942."""
    if version <= 0:
        return ""
    major, minor, stepping = version // 10000, version // 100 % 100, version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def location_bdf(domain: int, location_id: int) -> tuple[str, int]:
    """KFD ``domain`` + ``location_id`` → (BDF of the low 16 bits, partition id held in bits 28–31)."""
    loc = location_id & 0xFFFF
    bdf = f"{domain:04x}:{loc >> 8:02x}:{(loc & 0xFF) >> 3:02x}.{loc & 0x7}"
    return bdf, (location_id >> 28) & 0xF


# ---- the topology as read -----------------------------------------------------------------------------
@dataclass(frozen=True)
class KfdNode:
    index: int
    properties: Mapping[str, int]
    gpu_id: int = 0
    mem_banks: tuple[KfdMemBank, ...] = ()
    # io_links then p2p_links (the kernel's indirect peers), as listed.
    links: tuple[KfdIoLink, ...] = ()

    def prop(self, key: str) -> int:
        return self.properties.get(key, 0)

    @property
    def is_gpu(self) -> bool:
        return self.prop("simd_count") > 0

    @property
    def has_cpus(self) -> bool:
        return self.prop("cpu_cores_count") > 0

    @property
    def bdf(self) -> str:
        return location_bdf(self.prop("domain"), self.prop("location_id"))[0]

    @property
    def device_memory_bytes(self) -> int:
        return sum(b.size_bytes for b in self.mem_banks if b.heap_type != HEAP_SYSTEM)


@dataclass(frozen=True)
class Placement:
    """Where one KFD GPU node sits: its PCI function and, when partitioned, which partition."""

    physical_bdf: str
    partition_id: int
    partition_count: int
    partition_bdf: str  # the address KFD gives this partition (function = partition id)


def partition_layout(gpus: Sequence[KfdNode]) -> dict[int, Placement]:
    """KFD node index → placement. Nodes sharing domain, bus, device and ``unique_id`` are partitions
    of one device (partition ids follow KFD node order, as the kernel numbers them); the physical
    function is the lowest address among them, the one partition 0 keeps unmodified."""
    groups: dict[tuple[int, int, int], list[KfdNode]] = {}
    for node in gpus:
        loc = node.prop("location_id") & 0xFFFF
        groups.setdefault((node.prop("domain"), loc >> 3, node.prop("unique_id")), []).append(node)
    out: dict[int, Placement] = {}
    for members in groups.values():
        members.sort(key=lambda n: n.index)
        physical = min(n.prop("location_id") & 0xFFFF for n in members)
        physical_bdf = location_bdf(members[0].prop("domain"), physical)[0]
        for pid, node in enumerate(members):
            out[node.index] = Placement(physical_bdf, pid, len(members), node.bdf)
    return out


@dataclass(frozen=True)
class PciFacts:
    """What amdgpu's PCI function says about the device; "" / None where it says nothing."""

    numa_node: int | None = None
    compute_partition: str = ""
    memory_partition: str = ""
    available_compute_partitions: tuple[str, ...] = ()
    available_memory_partitions: tuple[str, ...] = ()


@dataclass(frozen=True)
class KfdLink(AccelLink):
    """An AccelLink with KFD's link weight (lower is closer). Drop once AccelLink has ``weight``."""

    weight: int = 0


@dataclass(frozen=True)
class _CpuLink:
    kind: str
    weight: int
    bandwidth_mbps: int


def build_part(nodes: Sequence[KfdNode], pci: Mapping[str, PciFacts],
               node_cpus: Mapping[int, Ids]) -> tuple[AcceleratorPart, tuple[str, ...]]:
    """The accelerator part from a read topology, the PCI facts by physical BDF and the CPUs of the
    NUMA nodes involved. Returns the part and the inconsistencies found (for the status)."""
    problems: list[str] = []
    by_index = {n.index: n for n in nodes}
    gpus = sorted((n for n in nodes if n.is_gpu), key=lambda n: n.index)
    layout = partition_layout(gpus)
    device_index = {node.index: i for i, node in enumerate(gpus)}
    devices: list[AccelDevice] = []
    for i, node in enumerate(gpus):
        place = layout[node.index]
        facts = pci.get(place.physical_bdf, PciFacts())
        cpu_link = _cpu_link(node, by_index)
        evidence = _apu_evidence(node, cpu_link)
        numa = facts.numa_node
        cpus = node_cpus.get(numa, ()) if numa is not None else ()
        memory_nodes: Ids = ()
        if evidence and numa is not None:
            memory_nodes = (numa,)
            if numa in node_cpus and not cpus:
                problems.append(f"APU {place.physical_bdf}: NUMA node {numa} has no CPUs, "
                                "yet an APU's memory is the RAM of its CPUs' node")
        devices.append(AccelDevice(
            kind="GPU", vendor="AMD", index=i,
            model=MODELS.get(node.prop("device_id"), ""),
            uuid=f"GPU-{node.prop('unique_id'):016x}" if node.prop("unique_id") else "",
            bdf=place.physical_bdf,
            memory_bytes=node.device_memory_bytes,
            numa_node=numa,
            local_cpus=cpus,
            memory_numa_nodes=memory_nodes,
            unified_memory=bool(evidence),
            attributes=_attributes(node, place, facts, cpu_link, evidence),
        ))
    links: dict[tuple[int, int], AccelLink] = {}
    for node in gpus:
        for link in node.links:
            peer = device_index.get(link.node_to)
            me = device_index[node.index]
            if peer is None or peer == me:
                continue
            key = (min(me, peer), max(me, peer))
            # The lower index's view wins: both directions are normally the same link.
            links.setdefault(key, KfdLink(key[0], key[1], link.kind, 0, link.max_bandwidth_mbps, link.weight))
    hives: dict[int, list[int]] = {}
    for i, node in enumerate(gpus):
        if node.prop("hive_id"):
            hives.setdefault(node.prop("hive_id"), []).append(i)
    groups = tuple(sorted(tuple(m) for m in hives.values() if len(m) > 1))
    part = AcceleratorPart(tuple(devices), tuple(links[k] for k in sorted(links)), groups)
    return part, tuple(problems)


def _cpu_link(node: KfdNode, by_index: Mapping[int, KfdNode]) -> _CpuLink | None:
    for link in node.links:
        target = by_index.get(link.node_to)
        if target is not None and target.has_cpus and not target.is_gpu:
            return _CpuLink(link.kind, link.weight, link.max_bandwidth_mbps)
    return None


def _apu_evidence(node: KfdNode, cpu_link: _CpuLink | None) -> tuple[str, ...]:
    evidence: list[str] = []
    if node.has_cpus:
        evidence.append("kfd_node_has_cpus")
    if cpu_link is not None and cpu_link.kind == "XGMI" and cpu_link.weight == INTRA_SOCKET_WEIGHT:
        evidence.append("cpu_link_xgmi_intra_socket")
    if node.prop("vendor_id") == VENDOR_AMD and node.prop("device_id") in APU_DEVICE_IDS:
        evidence.append("apu_device_id")
    return tuple(evidence)


def _attributes(node: KfdNode, place: Placement, facts: PciFacts, cpu_link: _CpuLink | None,
                evidence: tuple[str, ...]) -> dict[str, str]:
    attrs = {
        "kfd_node": str(node.index),
        "kfd_gpu_id": str(node.gpu_id),
        "device_id": f"0x{node.prop('device_id'):04x}",
        "gfx_target": gfx_target_name(node.prop("gfx_target_version")),
        "drm_render_minor": str(node.prop("drm_render_minor")),
    }
    if "num_xcc" in node.properties:
        attrs["num_xcc"] = str(node.prop("num_xcc"))
    if node.prop("hive_id"):
        attrs["xgmi_hive_id"] = f"0x{node.prop('hive_id'):x}"
    if cpu_link is not None:
        attrs["cpu_link"] = cpu_link.kind
        attrs["cpu_link_weight"] = str(cpu_link.weight)
        attrs["cpu_link_bandwidth_mbps"] = str(cpu_link.bandwidth_mbps)
    if evidence:
        attrs["apu_evidence"] = ",".join(evidence)
    if place.partition_count > 1:
        attrs["physical_bdf"] = place.physical_bdf
        attrs["partition_id"] = str(place.partition_id)
        attrs["partition_count"] = str(place.partition_count)
        attrs["partition_bdf"] = place.partition_bdf
    for key, mode in (("compute_partition", facts.compute_partition), ("memory_partition", facts.memory_partition)):
        if mode:
            attrs[key] = mode
    for key, modes in (("available_compute_partitions", facts.available_compute_partitions),
                       ("available_memory_partitions", facts.available_memory_partitions)):
        if modes:
            attrs[key] = ",".join(modes)
    return attrs


# ---- reading a host ------------------------------------------------------------------------------------
def probe(ctx: ProbeContext) -> ProbeResult[AcceleratorPart]:
    """KFD sysfs + PCI attributes (the tested path); amdsmi on top only for the live host."""
    sb = StatusBuilder(SOURCE)
    if (absent := presence.amd(ctx)) is not None:
        sb.unavailable(absent)
        return ProbeResult(AcceleratorPart(), sb.finish())
    nodes = read_topology(ctx.fs, sb)
    gpus = [n for n in nodes if n.is_gpu]
    if not gpus and not sb.reasons:
        sb.unavailable(f"no AMD devices: {KFD_NODES} lists CPU nodes only")
        return ProbeResult(AcceleratorPart(), sb.finish())
    layout = partition_layout(gpus)
    pci = {bdf: read_pci_facts(ctx.fs, bdf, sb) for bdf in sorted({p.physical_bdf for p in layout.values()})}
    numa_ids = sorted({f.numa_node for f in pci.values() if f.numa_node is not None})
    node_cpus: dict[int, Ids] = {}
    for nid in numa_ids:
        try:
            node_cpus[nid] = ctx.fs.read_cpulist(f"{NUMA_NODES}/node{nid}/cpulist")
        except HostReadError as exc:
            sb.problem(exc)
    part, problems = build_part(nodes, pci, node_cpus)
    for p in problems:
        sb.problem(p)
    if ctx.libraries_live:
        part = _amdsmi_enrich(part, sb)
    return ProbeResult(part, sb.finish())


def read_topology(fs: HostFS, sb: StatusBuilder) -> tuple[KfdNode, ...]:
    """Every KFD node that parses; each unreadable or garbage file is a problem, not the end."""
    try:
        entries = fs.listdir(KFD_NODES)
    except HostReadError as exc:
        sb.problem(exc)
        return ()
    indices: list[int] = []
    for name in entries:
        if name.isascii() and name.isdigit():
            indices.append(int(name))
        else:
            sb.problem(f"{KFD_NODES}/{name}: not a KFD node")
    nodes: list[KfdNode] = []
    for k in sorted(indices):
        node = _read_node(fs, sb, k)
        if node is not None:
            nodes.append(node)
    return tuple(nodes)


def _read_node(fs: HostFS, sb: StatusBuilder, k: int) -> KfdNode | None:
    base = f"{KFD_NODES}/{k}"
    props = _parsed(fs, sb, f"{base}/properties", parse_properties)
    if props is None:
        return None
    node = KfdNode(k, props)
    if not node.is_gpu:
        # CPU nodes matter only as link targets; their banks and links are not read.
        return node
    try:
        gpu_id = fs.read_int(f"{base}/gpu_id")
    except HostReadError as exc:
        sb.problem(exc)
        gpu_id = 0
    banks = tuple(_parsed_children(fs, sb, f"{base}/mem_banks", parse_mem_bank))
    links = (*_parsed_children(fs, sb, f"{base}/io_links", parse_io_link),
             *_parsed_children(fs, sb, f"{base}/p2p_links", parse_io_link))
    return dataclasses.replace(node, gpu_id=gpu_id, mem_banks=banks, links=links)


def _parsed[T](fs: HostFS, sb: StatusBuilder, rel: str, parse: Callable[[str], T]) -> T | None:
    try:
        return parse(fs.read_text(rel))
    except HostReadError as exc:
        sb.problem(exc)
    except KfdFormatError as exc:
        sb.problem(HostReadError(rel, str(exc)))
    return None


def _parsed_children[T](fs: HostFS, sb: StatusBuilder, rel: str, parse: Callable[[str], T]) -> list[T]:
    """``<rel>/<i>/properties`` for every numbered child, in number order."""
    try:
        names = fs.listdir(rel)
    except HostReadError as exc:
        sb.problem(exc)
        return []
    out: list[T] = []
    for i in sorted(int(n) for n in names if n.isascii() and n.isdigit()):
        item = _parsed(fs, sb, f"{rel}/{i}/properties", parse)
        if item is not None:
            out.append(item)
    return out


def read_pci_facts(fs: HostFS, bdf: str, sb: StatusBuilder) -> PciFacts:
    """NUMA node and partition modes of one amdgpu PCI function. The partition attributes exist only
    on partitionable parts (MI300 family): their absence is normal, a garbage value a problem."""
    base = f"{PCI_DEVICES}/{bdf}"
    if not fs.is_dir(base):
        sb.problem(f"{base}: missing (KFD lists a GPU there)")
        return PciFacts()
    numa: int | None = None
    try:
        value = fs.read_int(f"{base}/numa_node")
        if value < -1:
            sb.problem(f"{base}/numa_node: invalid node {value}")
        elif value >= 0:
            numa = value
    except HostReadError as exc:
        if exc.reason != "missing":
            sb.problem(exc)

    def attr[T](name: str, parse: Callable[[str], T], default: T) -> T:
        rel = f"{base}/{name}"
        if not fs.exists(rel):
            return default
        result = _parsed(fs, sb, rel, parse)
        return default if result is None else result

    return PciFacts(
        numa_node=numa,
        compute_partition=attr("current_compute_partition", parse_partition_mode, ""),
        memory_partition=attr("current_memory_partition", parse_partition_mode, ""),
        available_compute_partitions=attr("available_compute_partition", parse_partition_list, ()),
        available_memory_partitions=attr("available_memory_partition", parse_partition_list, ()),
    )


# ---- amdsmi (live host only) ------------------------------------------------------------------------
def _amdsmi_enrich(part: AcceleratorPart, sb: StatusBuilder) -> AcceleratorPart:
    """Fill model and partition modes that sysfs did not give, from amdsmi, matched by BDF.

    A partition is looked up by the address KFD gives it (``partition_bdf``), a whole device by its BDF.
    A missing amdsmi is the normal case (KFD alone); a failing one degrades, the KFD facts stay.
    """
    try:
        amdsmi = importlib.import_module("amdsmi")
    except ImportError:
        return part
    except Exception as exc:  # a broken install: the binding raises OSError when libamd_smi is absent
        sb.problem(f"amdsmi: import failed: {exc}")
        return part
    by_bdf = {d.attributes.get("partition_bdf", d.bdf): i for i, d in enumerate(part.devices)}
    devices = list(part.devices)
    try:
        amdsmi.amdsmi_init()
    except Exception as exc:  # the library's own exception types, plus anything ctypes raises
        sb.problem(f"amdsmi: amdsmi_init: {exc}")
        return part
    try:
        for handle in amdsmi.amdsmi_get_processor_handles():
            bdf = str(amdsmi.amdsmi_get_gpu_device_bdf(handle)).lower()
            i = by_bdf.get(bdf)
            if i is None:
                continue
            devices[i] = _amdsmi_device(amdsmi, handle, devices[i], sb)
    except Exception as exc:
        sb.problem(f"amdsmi: {exc}")
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception as exc:
            sb.problem(f"amdsmi: amdsmi_shut_down: {exc}")
    return dataclasses.replace(part, devices=tuple(devices))


def _amdsmi_device(amdsmi: ModuleType, handle: object, dev: AccelDevice, sb: StatusBuilder) -> AccelDevice:
    model = dev.model
    attrs = dict(dev.attributes)
    if not model:
        try:
            info = amdsmi.amdsmi_get_gpu_asic_info(handle)
        except Exception as exc:  # see _amdsmi_enrich
            sb.problem(f"amdsmi: amdsmi_get_gpu_asic_info({dev.bdf}): {exc}")
        else:
            name = info.get("market_name") if isinstance(info, Mapping) else None
            model = name.strip() if isinstance(name, str) else ""
    for key, fn in (("compute_partition", "amdsmi_get_gpu_compute_partition"),
                    ("memory_partition", "amdsmi_get_gpu_memory_partition")):
        if key in attrs:
            continue
        try:
            attrs[key] = parse_partition_mode(str(getattr(amdsmi, fn)(handle)))
        except Exception as exc:  # KfdFormatError, or the library's (see _amdsmi_enrich)
            sb.problem(f"amdsmi: {fn}({dev.bdf}): {exc}")
    return dataclasses.replace(dev, model=model, attributes=attrs)
