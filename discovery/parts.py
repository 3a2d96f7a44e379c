"""The typed, immutable parts that probes return and the assembler combines.

One dataclass family per source. Sets of CPUs or nodes are sorted tuples of Linux ids. Sizes are
bytes, bandwidth MB/s, latency ns; 0 in a performance figure means unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from types import MappingProxyType
from typing import NamedTuple

from memtopo.model import frozen

Ids = tuple[int, ...]


# ---- sysfs NUMA (/sys/devices/system/node, /sys/devices/system/cpu) ------------------------------
@frozen
class HmatAccess:
    """One accessK/initiators directory of a target node: its best initiators and their figures."""

    access_class: int
    initiators: Ids
    read_bandwidth_mbps: int = 0
    write_bandwidth_mbps: int = 0
    read_latency_ns: int = 0
    write_latency_ns: int = 0

    @property
    def has_figures(self) -> bool:
        return any((self.read_bandwidth_mbps, self.write_bandwidth_mbps,
                    self.read_latency_ns, self.write_latency_ns))


@frozen
class SideCache:
    level: int
    size_bytes: int
    line_size_bytes: int
    indexing: int
    write_policy: int


@frozen
class SysNode:
    id: int
    cpus: Ids
    mem_total_bytes: int
    mem_free_bytes: int
    # SLIT row; column i is SysNuma.distance_nodes[i] (the nodes online when it was read).
    distances: tuple[int, ...]
    # access0 and/or access1, in class order; empty when the kernel has no HMAT data.
    access: tuple[HmatAccess, ...] = ()
    side_caches: tuple[SideCache, ...] = ()
    hugepages_bytes: int = 0


@frozen
class SysNuma:
    # None when the mask file is absent (old kernels, non-NUMA kernels).
    possible: Ids | None
    online: Ids | None
    has_cpu: Ids | None
    has_memory: Ids | None
    has_normal_memory: Ids | None
    has_generic_initiator: Ids | None
    nodes: tuple[SysNode, ...]
    distance_nodes: Ids
    cpus_online: Ids
    cpus_possible: Ids
    cpus_present: Ids
    # True when /sys/devices/system/node is absent and node 0 was made from /proc/meminfo.
    synthesized_single_node: bool = False


# ---- kernel memory tiers (/sys/devices/virtual/memory_tiering) -----------------------------------
@frozen
class KernelTier:
    id: int
    nodes: Ids


@frozen
class SysTiers:
    tiers: tuple[KernelTier, ...]
    demotion_enabled: bool | None


# ---- CXL bus and DAX (/sys/bus/cxl/devices, /sys/bus/dax/devices) --------------------------------
@frozen
class CxlDecoderInfo:
    name: str
    kind: str  # root | switch | endpoint
    start: int
    size: int
    interleave_ways: int
    interleave_granularity: int
    targets: tuple[str, ...] = ()
    mode: str = ""
    region: str = ""
    cap_ram: bool = False
    cap_pmem: bool = False


@frozen
class CxlMemdevInfo:
    name: str
    serial: int
    ram_size_bytes: int
    pmem_size_bytes: int
    host: str  # PCI BDF of the memdev
    host_bridge: str  # e.g. "pci0000:60"
    numa_node: int
    firmware_version: str
    decoders: tuple[CxlDecoderInfo, ...]  # its endpoint decoders


@frozen
class CxlRegionInfo:
    name: str
    size_bytes: int
    resource: int
    interleave_ways: int
    interleave_granularity: int
    targets: tuple[str, ...]  # endpoint decoders, position order
    memdevs: tuple[str, ...]  # position order
    mode: str  # ram | pmem
    committed: bool
    root_decoder: str = ""


@frozen
class DaxInfo:
    name: str
    target_node: int  # -1 when none
    numa_node: int
    size_bytes: int
    mode: str  # "system-ram" (kmem), "devdax" (device_dax) or ""
    cxl_region: str = ""  # the CXL region this memory comes from, "" if not CXL
    # Kind of the parent: "cxl", "nvdimm" (pmem namespace), "hmem" (soft-reserved SPM), "" unknown
    parent_kind: str = ""


@frozen
class SysCxl:
    memdevs: tuple[CxlMemdevInfo, ...]
    regions: tuple[CxlRegionInfo, ...]
    root_decoders: tuple[CxlDecoderInfo, ...]
    dax: tuple[DaxInfo, ...]


# ---- PCI (/sys/bus/pci/devices, /sys/bus/mdev/devices) --------------------------------------------
@frozen
class MdevInfo:
    uuid: str
    mdev_type: str
    parent: str  # parent BDF ("" for a non-PCI parent)
    numa_node: int


@frozen
class PciInfo:
    bdf: str
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int
    subsystem_device_id: int
    class_code: int
    driver: str
    numa_node: int
    local_cpus: Ids
    link_speed: str = ""
    link_width: int = 0
    max_link_speed: str = ""
    max_link_width: int = 0
    physfn: str = ""
    virtfns: tuple[str, ...] = ()
    sriov_total_vfs: int = 0
    sriov_num_vfs: int = 0
    msi_irqs: Ids = ()
    mdevs: tuple[MdevInfo, ...] = ()
    os_devices: tuple[str, ...] = ()
    numa_node_inherited: bool = False
    # The path down from the root complex: ("pci0000:00", "0000:00:01.0", …), the device excluded.
    # Bridges in it are what `nvidia-smi topo -m` counts for PIX / PXB / PHB.
    upstream: tuple[str, ...] = ()


@frozen
class SysPci:
    devices: tuple[PciInfo, ...]


# ---- allowed CPUs / memory nodes (/proc/self/status, cgroup cpuset) -------------------------------
@frozen
class Allowed:
    cpus: Ids
    mems: Ids
    cgroup_version: int  # 0 unknown, 1, 2
    cgroup_path: str
    effective_cpus: Ids
    effective_mems: Ids


# ---- host identity ---------------------------------------------------------------------------------
@frozen
class Identity:
    node_name: str
    machine_id: str
    boot_id: str


# ---- hwloc ----------------------------------------------------------------------------------------
@frozen
class HwlocNode:
    os_index: int
    subtype: str
    local_memory: int
    cpuset: Ids  # hwloc's locality cpuset (for a CPU-less node: the CPUs it is attached near)
    memory_tier: int | None  # hwloc's MemoryTier info, or numanode.memory_tier on newer hwloc
    package: int | None  # os_index of the package above it, if any
    info: Mapping[str, str] = field(default_factory=dict)


@frozen
class HwlocMemattrValue:
    """One memattr value for a target node: from an initiator cpuset, or from an object."""

    attribute: str  # Bandwidth, Latency, ReadBandwidth, WriteBandwidth, ReadLatency, WriteLatency ...
    target_node: int
    value: int
    initiator_cpus: Ids | None = None
    initiator_object: str | None = None  # e.g. "NUMANode#2", "PU#7", "Group#2"


@frozen
class HwlocDistances:
    name: str
    kind: int
    nodes: Ids  # NUMA os_index of each row/column
    matrix: tuple[tuple[int, ...], ...]


@frozen
class HwlocObjectDistances:
    """A matrix over objects other than NUMA nodes (NVLinkBandwidth over GPUs, NVSwitches and
    packages). Labels: an OS device's name (``nvml3``), else ``<Type>#<os_index>`` (``Package#0``),
    else ``<Type>@<bdf>`` for a PCI device (an NVSwitch)."""

    name: str
    labels: tuple[str, ...]
    matrix: tuple[tuple[int, ...], ...]


# hwloc's per-object parts are named tuples, not frozen dataclasses: extraction makes one per PCI
# function and OS device on every discovery, and a frozen dataclass's __init__ (one
# object.__setattr__ per field) cost as much as reading the object out of hwloc.
class HwlocOsDevice(NamedTuple):
    name: str
    kind: str  # gpu, coproc, memory, storage, network, openfabrics, dma, other
    subtype: str
    info: Mapping[str, str] = MappingProxyType({})


class HwlocPci(NamedTuple):
    bdf: str
    vendor_id: int
    device_id: int
    subsystem_vendor_id: int
    subsystem_device_id: int
    class_code: int  # 24-bit when hwloc has prog-if, else class<<8
    link_speed_gbps: float
    cpuset: Ids  # locality
    nodeset: Ids
    os_devices: tuple[HwlocOsDevice, ...]
    subtype: str = ""
    # As PciInfo.upstream, but bridges are named "bridge#<hwloc gp_index>" (host bridge first).
    upstream: tuple[str, ...] = ()


@frozen
class HwlocPackage:
    os_index: int
    cpus: Ids


@frozen
class HwlocPart:
    version: str
    nodes: tuple[HwlocNode, ...]
    packages: tuple[HwlocPackage, ...]
    pus: Ids
    cores: int
    allowed_cpus: Ids
    allowed_nodes: Ids
    distances: tuple[HwlocDistances, ...]
    memattrs: tuple[HwlocMemattrValue, ...]
    pci: tuple[HwlocPci, ...]
    # OS devices not under a PCI device (e.g. dax under a package, CXLMem, NVML GPUs without PCI).
    other_os_devices: tuple[HwlocOsDevice, ...]
    memory_tiers_nr: int = 0
    info: Mapping[str, str] = field(default_factory=dict)
    object_distances: tuple[HwlocObjectDistances, ...] = ()

    @property
    def loaded(self) -> bool:
        """False for the empty part of a probe that never loaded a topology (the library missing,
        a root hwloc must not read): it says nothing, not that the machine is empty."""
        return bool(self.version)


# ---- accelerators (NVML, KFD, npu-smi, xpu-smi) ----------------------------------------------------
@frozen
class AccelDevice:
    """One accelerator as its vendor source reports it. Unknown strings are "", unknown ints 0."""

    kind: str  # "GPU" | "NPU" | "XPU"
    vendor: str  # "NVIDIA", "AMD", "Huawei", "Kunlunxin"
    # The vendor tool's own id: nvidia-smi index, KFD gpu_id order, npu-smi logical id, xpu-smi id.
    index: int
    model: str = ""
    uuid: str = ""  # UUID, or serial where the vendor has no UUID
    bdf: str = ""  # "dddd:bb:dd.f", lower case, 4+ hex digit domain; "" when the tool does not say
    memory_bytes: int = 0
    health: str = ""  # vendor wording kept: "OK", "Warning", "Alarm", "Critical" …
    # What the vendor tool says this device is local to; None / () when it does not say.
    numa_node: int | None = None
    local_cpus: Ids = ()
    # NUMA nodes holding the device's own memory (NVML GetNumaNodeId, numa_status, KFD APU).
    memory_numa_nodes: Ids = ()
    # Memory is coherent with the CPUs' (C2C superchip, APU): the device belongs in a Unified domain.
    unified_memory: bool = False
    # Vendor facts worth showing that the schema has no field for (c2c_mode, mig_mode, card/chip
    # ids, compute/memory partition, addressing mode …). Keys are snake_case.
    attributes: Mapping[str, str] = field(default_factory=dict)


@frozen
class AccelLink:
    """A direct link between two accelerators of one part (by index), in the vendor tool's words."""

    a: int
    b: int
    # "NV4" style is split: kind "NV" + count 4. Other kinds: HCCS, HCCS_SW, SIO, XGMI, PIX, PXB,
    # PHB, NODE, SYS, XLINK … exactly as the tool prints them.
    kind: str
    count: int = 0
    bandwidth_mbps: int = 0


@frozen
class AcceleratorPart:
    devices: tuple[AccelDevice, ...] = ()
    links: tuple[AccelLink, ...] = ()
    # Devices that form one fast domain (HCCS ring, XPU NUMA half, NVLink island), by index.
    groups: tuple[Ids, ...] = ()
