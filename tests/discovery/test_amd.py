"""amd.kfd against synthesized MI300A / MI300X trees, hand-built KFD trees and garbage.

No AMD hardware is here: the two hosts under tests/fixtures/ are synthesized in the kernel's own
formats (their READMEs name the sources and state the facts asserted below). The KFD sysfs path is
the tested one; amdsmi is exercised only through a stand-in module with the real binding's names.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from memtopo.discovery import amd, presence
from memtopo.discovery.amd import (
    KfdFormatError,
    KfdIoLink,
    KfdLink,
    KfdMemBank,
    KfdNode,
    PciFacts,
    build_part,
    format_properties,
    gfx_target_name,
    location_bdf,
    parse_io_link,
    parse_mem_bank,
    parse_partition_list,
    parse_partition_mode,
    parse_properties,
    partition_layout,
)
from memtopo.discovery.capture import open_root
from memtopo.discovery.parts import AcceleratorPart
from memtopo.discovery.source import ProbeContext, ProbeResult, State
from tests.fixtures import extracted
from tests.sysfs_tree import Dir, Link, write_tree

FIXTURES = Path(__file__).parents[1] / "fixtures"
GIB = 1 << 30
NODES = "sys/devices/virtual/kfd/kfd/topology/nodes"  # where the fixtures' class symlink points


# Extracted once and cached across runs (tests.fixtures.extracted, keyed by the tarball's version);
# tests that change files work on a copy.
@pytest.fixture(scope="module")
def mi300a() -> Path:
    return extracted(FIXTURES / "mi300a-4apu" / "root.tar.gz")


@pytest.fixture(scope="module")
def mi300x() -> Path:
    return extracted(FIXTURES / "mi300x-8gpu-cpx-nps4" / "root.tar.gz")


def test_tarball_opens_as_a_root() -> None:
    """What `memtopo topo --root` does with the tarball (open_root) gives the same answer."""
    with open_root(FIXTURES / "mi300a-4apu" / "root.tar.gz") as root:
        res = run(root)
    assert res.status.state is State.OK and len(res.data.devices) == 4


def run(root: Path, **kw: object) -> ProbeResult[AcceleratorPart]:
    return amd.probe(ProbeContext.at_root(root, **kw))


# ---- the synthesized hosts ----------------------------------------------------------------------
def test_mi300a_four_apus(mi300a: Path) -> None:
    res = run(mi300a)
    assert res.status.state is State.OK, res.status.reasons
    part = res.data
    assert [d.index for d in part.devices] == [0, 1, 2, 3]
    for k, d in enumerate(part.devices):
        assert (d.kind, d.vendor, d.model) == ("GPU", "AMD", "MI300A")
        assert d.bdf == f"{k:04x}:02:00.0"
        assert d.uuid == f"GPU-4a8e21d07c3b9f0{k + 1}"
        assert d.memory_bytes == 63 * GIB
        assert d.health == ""
        # The APU: its memory is the RAM of its own socket's node, which holds its CPUs.
        assert d.unified_memory is True
        assert d.numa_node == k
        assert d.memory_numa_nodes == (k,)
        assert d.local_cpus == tuple(range(48 * k, 48 * k + 48))
        a = d.attributes
        assert a["apu_evidence"] == "cpu_link_xgmi_intra_socket,apu_device_id"
        assert (a["cpu_link"], a["cpu_link_weight"], a["cpu_link_bandwidth_mbps"]) == ("XGMI", "13", "819200")
        assert a["kfd_node"] == str(4 + k)
        assert a["gfx_target"] == "gfx942"
        assert a["device_id"] == "0x74a0"
        assert a["num_xcc"] == "6"
        assert a["drm_render_minor"] == str(128 + k)
        assert a["compute_partition"] == "SPX"
        assert a["memory_partition"] == "NPS1"
        assert a["available_compute_partitions"] == "SPX,TPX,CPX"
        assert a["available_memory_partitions"] == "NPS1"
        assert "partition_id" not in a  # SPX: one KFD node per device
    pairs = [(lk.a, lk.b) for lk in part.links]
    assert pairs == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert {(lk.kind, lk.bandwidth_mbps, lk.count) for lk in part.links} == {("XGMI", 128000, 0)}
    assert all(isinstance(lk, KfdLink) and lk.weight == 15 for lk in part.links)
    assert part.groups == ((0, 1, 2, 3),)


def test_mi300x_cpx_nps4_sixty_four_partitions(mi300x: Path) -> None:
    res = run(mi300x)
    assert res.status.state is State.OK, res.status.reasons
    part = res.data
    buses = ("05", "26", "46", "65", "85", "a6", "c6", "e5")
    assert len(part.devices) == 64
    for i, d in enumerate(part.devices):
        g, p = divmod(i, 8)
        physical = f"0000:{buses[g]}:00.0"
        assert (d.index, d.model, d.bdf) == (i, "MI300X", physical)
        assert d.memory_bytes == 205822885888 // 8
        assert d.numa_node == g
        assert d.local_cpus == tuple(range(24 * g, 24 * g + 24))
        assert d.unified_memory is False and d.memory_numa_nodes == ()
        assert d.uuid == f"GPU-3f0c5a2b19e47d0{g}"
        a = d.attributes
        assert "apu_evidence" not in a
        assert a["physical_bdf"] == physical
        assert a["partition_bdf"] == f"0000:{buses[g]}:00.{p}"
        assert (a["partition_id"], a["partition_count"]) == (str(p), "8")
        assert (a["compute_partition"], a["memory_partition"]) == ("CPX", "NPS4")
        assert a["available_compute_partitions"] == "SPX,DPX,QPX,CPX"
        assert a["available_memory_partitions"] == "NPS1,NPS4"
        assert (a["num_xcc"], a["kfd_node"], a["drm_render_minor"]) == ("1", str(8 + i), str(128 + i))
        assert (a["cpu_link"], a["cpu_link_weight"], a["cpu_link_bandwidth_mbps"]) == ("PCIE", "20", "64000")
    # XGMI all-to-all: every pair once, lower index first.
    assert len(part.links) == 64 * 63 // 2
    assert [(lk.a, lk.b) for lk in part.links] == [(a, b) for a in range(64) for b in range(a + 1, 64)]
    same = [lk for lk in part.links if lk.a // 8 == lk.b // 8]
    cross = [lk for lk in part.links if lk.a // 8 != lk.b // 8]
    assert len(same) == 8 * 28 and len(cross) == 1792
    assert all(lk.kind == "XGMI" for lk in part.links)
    assert {(lk.bandwidth_mbps, getattr(lk, "weight", None)) for lk in same} == {(819200, 13)}
    assert {(lk.bandwidth_mbps, getattr(lk, "weight", None)) for lk in cross} == {(0, 41)}
    assert part.groups == (tuple(range(64)),)


def _integrated(root: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    from memtopo.discovery import discover
    from memtopo.discovery.probes import ACCELERATORS, PROBES

    only_amd = tuple(s for s in PROBES if s.part != ACCELERATORS or s.source == amd.SOURCE)
    monkeypatch.setattr(discover, "PROBES", only_amd)
    return discover.discover(ProbeContext.at_root(root))


def test_mi300a_integrates_as_four_unified_domains(mi300a: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memtopo.v1 import topology_pb2 as pb

    topo = _integrated(mi300a, monkeypatch)
    assert isinstance(topo, pb.MemoryTopology)
    assert [(list(d.numa_nodes), d.type) for d in topo.domains] == [
        ([k], pb.MEMORY_DOMAIN_TYPE_UNIFIED) for k in range(4)]
    for k, d in enumerate(topo.domains):
        assert list(d.attached_cpus) == list(range(48 * k, 48 * k + 48))
        (acc,) = [topo.accelerators[i] for i in d.attached_accelerators]
        assert (acc.bdf, acc.source, acc.unified_memory) == (f"{k:04x}:02:00.0", amd.SOURCE, True)


def test_mi300x_integrates_as_discrete_partitions(mi300x: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memtopo.v1 import topology_pb2 as pb

    topo = _integrated(mi300x, monkeypatch)
    assert isinstance(topo, pb.MemoryTopology)
    assert {d.type for d in topo.domains} == {pb.MEMORY_DOMAIN_TYPE_DRAM}
    assert len(topo.accelerators) == 64  # the partitions; no PCI-fallback duplicates of the 8 functions
    for d in topo.domains:
        (node,) = d.numa_nodes
        attached = [topo.accelerators[i] for i in d.attached_accelerators]
        assert len(attached) == 8 and {a.numa_node for a in attached} == {node}


# ---- pure parsers ---------------------------------------------------------------------------------
def test_parse_properties_kernel_layout() -> None:
    text = "cpu_cores_count 0\nsimd_count 304\nhive_id 18446744073709551615\nunique_id 0\n\0\0"
    assert parse_properties(text) == {"cpu_cores_count": 0, "simd_count": 304,
                                      "hive_id": (1 << 64) - 1, "unique_id": 0}


@pytest.mark.parametrize("text", [
    "", "\n\n", "simd_count\n", "simd_count 1 2\n", "simd_count -1\n", "simd_count 0x10\n",
    "SIMD 1\n", "simd_count 18446744073709551616\n", "a 1\na 2\n", "simd_count \u0661\n",
])
def test_parse_properties_rejects(text: str) -> None:
    with pytest.raises(KfdFormatError):
        parse_properties(text)


def test_mem_bank_and_io_link() -> None:
    assert parse_mem_bank("heap_type 1\nsize_in_bytes 25727860736\nflags 0\nwidth 8192\nmem_clk_max 1300\n") == \
        KfdMemBank(1, 25727860736)
    link = parse_io_link("type 11\nversion_major 0\nnode_from 8\nnode_to 9\nweight 13\nmin_latency 0\n"
                         "max_latency 0\nmin_bandwidth 819200\nmax_bandwidth 819200\nflags 1\n")
    assert link == KfdIoLink(11, 8, 9, 13, 819200, 819200)
    assert (link.kind, KfdIoLink(2, 0, 1).kind, KfdIoLink(99, 0, 1).kind) == ("XGMI", "PCIE", "TYPE99")
    with pytest.raises(KfdFormatError, match="size_in_bytes"):
        parse_mem_bank("heap_type 1\n")
    with pytest.raises(KfdFormatError, match="node_to"):
        parse_io_link("type 2\nnode_from 1\n")


def test_partition_attributes() -> None:
    assert parse_partition_mode("CPX\n") == "CPX"
    assert parse_partition_list("SPX, DPX, QPX, CPX\n") == ("SPX", "DPX", "QPX", "CPX")
    assert parse_partition_list("NPS1, NPS4") == ("NPS1", "NPS4")
    assert parse_partition_list("\n") == ()
    for bad in ("", "cpx", "SPX DPX", "S" * 17):
        with pytest.raises(KfdFormatError):
            parse_partition_mode(bad)
    with pytest.raises(KfdFormatError):
        parse_partition_list("SPX,,CPX")


def test_gfx_target_and_location() -> None:
    assert [gfx_target_name(v) for v in (90402, 90010, 100300, 110502, 0)] == \
        ["gfx942", "gfx90a", "gfx1030", "gfx1152", ""]
    # bus 0x0c, device 0, function 3: a CPX partition in current kernels (node id in the low bits).
    assert location_bdf(0, 0x0C03) == ("0000:0c:00.3", 0)
    # The 6.9-era variant kept the node id in bits 28-31.
    assert location_bdf(0x10000, (5 << 28) | 0xC100) == ("10000:c1:00.0", 5)


def _gpu(index: int, loc: int, *, domain: int = 0, uid: int = 7, **extra: int) -> KfdNode:
    props = {"simd_count": 152, "vendor_id": 4098, "device_id": 0x74A1, "location_id": loc,
             "domain": domain, "unique_id": uid, **extra}
    return KfdNode(index, props, gpu_id=100 + index, mem_banks=(KfdMemBank(1, 8 * GIB),))


def test_partition_layout_both_kernel_encodings() -> None:
    low_bits = partition_layout([_gpu(2, 0x0C00), _gpu(3, 0x0C01), _gpu(4, 0x0C02), _gpu(5, 0x0C03)])
    assert [(p.physical_bdf, p.partition_id, p.partition_count, p.partition_bdf) for p in low_bits.values()] == [
        ("0000:0c:00.0", i, 4, f"0000:0c:00.{i}") for i in range(4)]
    high_bits = partition_layout([_gpu(1, 0x0C00), _gpu(2, (1 << 28) | 0x0C00)])
    assert [(p.physical_bdf, p.partition_id, p.partition_bdf) for p in high_bits.values()] == [
        ("0000:0c:00.0", 0, "0000:0c:00.0"), ("0000:0c:00.0", 1, "0000:0c:00.0")]
    # Two devices behind one bus/device number but with their own unique_id stay two devices.
    apart = partition_layout([_gpu(1, 0x0C00, uid=1), _gpu(2, 0x0C01, uid=2)])
    assert [(p.physical_bdf, p.partition_count) for p in apart.values()] == [
        ("0000:0c:00.0", 1), ("0000:0c:00.1", 1)]


def test_build_part_classic_apu_and_p2p_links() -> None:
    cpu = KfdNode(0, {"cpu_cores_count": 8})
    # Older APUs: CPU cores and SIMDs in one KFD node.
    apu = KfdNode(1, {"cpu_cores_count": 4, "simd_count": 32, "vendor_id": 4098, "device_id": 0x15DD,
                      "location_id": 0x0300, "gfx_target_version": 90200})
    dgpu = KfdNode(2, {"simd_count": 240, "vendor_id": 4098, "device_id": 0x740F, "location_id": 0x8300},
                   mem_banks=(KfdMemBank(0, 1), KfdMemBank(1, 64 * GIB)),
                   links=(KfdIoLink(2, 2, 0, 20, 312, 32000), KfdIoLink(2, 2, 1, 40, 0, 0)))
    pci = {"0000:03:00.0": PciFacts(numa_node=0), "0000:83:00.0": PciFacts(numa_node=None)}
    part, problems = build_part([cpu, apu, dgpu], pci, {0: (0, 1, 2, 3)})
    assert problems == ()
    a, d = part.devices
    assert (a.unified_memory, a.memory_numa_nodes, a.attributes["apu_evidence"]) == (True, (0,), "kfd_node_has_cpus")
    assert (a.model, a.attributes["gfx_target"], a.memory_bytes) == ("", "gfx920", 0)
    # A discrete MI210 without NUMA affinity: none is guessed; its system heap is not device memory.
    assert (d.model, d.numa_node, d.local_cpus, d.memory_bytes) == ("MI210", None, (), 64 * GIB)
    assert (d.unified_memory, d.attributes["cpu_link"], d.attributes["cpu_link_weight"]) == (False, "PCIE", "20")
    # A PCIe peer link (p2p_links) between the two GPUs is reported in its own words.
    assert part.links == (KfdLink(0, 1, "PCIE", 0, 0, 40),)
    assert part.groups == ()


def test_build_part_apu_evidence_without_numa_or_cpus() -> None:
    cpu = KfdNode(0, {"cpu_cores_count": 48})
    apu = KfdNode(1, {"simd_count": 912, "vendor_id": 4098, "device_id": 0x74A0, "location_id": 0x0200},
                  links=(KfdIoLink(11, 1, 0, 13, 819200, 819200),))
    part, problems = build_part([cpu, apu], {"0000:02:00.0": PciFacts(numa_node=None)}, {})
    (d,) = part.devices
    # Still an APU, but with NUMA node -1 its memory node is unknown, never guessed.
    assert (d.unified_memory, d.numa_node, d.memory_numa_nodes) == (True, None, ())
    assert problems == ()
    part, problems = build_part([cpu, apu], {"0000:02:00.0": PciFacts(numa_node=3)}, {3: ()})
    assert part.devices[0].memory_numa_nodes == (3,)
    assert len(problems) == 1 and "NUMA node 3 has no CPUs" in problems[0]


def test_mi300x_is_not_taken_for_an_apu() -> None:
    """gfx942 and an FB heap are shared with MI300A; only the link marker or the id decide."""
    cpu = KfdNode(0, {"cpu_cores_count": 24})
    x = KfdNode(1, {"simd_count": 1216, "vendor_id": 4098, "device_id": 0x74A1, "location_id": 0x0500,
                    "gfx_target_version": 90402}, mem_banks=(KfdMemBank(1, 192 * GIB),),
                links=(KfdIoLink(2, 1, 0, 20, 312, 64000),))
    part, _ = build_part([cpu, x], {"0000:05:00.0": PciFacts(numa_node=0)}, {0: (0, 1)})
    assert (part.devices[0].unified_memory, part.devices[0].memory_numa_nodes) == (False, ())


# ---- fault table --------------------------------------------------------------------------------
def _copy_amd_tree(src: Path, dst: Path) -> Path:
    """The parts of a root the AMD probe reads (KFD, PCI, NUMA nodes), symlinks kept."""
    for sub in ("sys/class/kfd", "sys/devices/virtual/kfd", "sys/bus/pci", "sys/devices/system/node"):
        shutil.copytree(src / sub, dst / sub, symlinks=True)
    for pci_root in (src / "sys/devices").glob("pci*"):
        shutil.copytree(pci_root, dst / "sys/devices" / pci_root.name, symlinks=True)
    return dst


Mutation = Callable[[Path], None]


def _remove(rel: str) -> Mutation:
    def act(root: Path) -> None:
        p = root / rel
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return act


def _write(rel: str, content: bytes) -> Mutation:
    def act(root: Path) -> None:
        (root / rel).write_bytes(content)
    return act


def _cpu_only(root: Path) -> None:
    for k in range(4, 8):
        shutil.rmtree(root / NODES / str(k))


def _odd_entry(root: Path) -> None:
    (root / NODES / "lost+found").mkdir()


GPU5 = f"{NODES}/5"
SEEN5 = f"{presence.KFD_NODES}/5"  # the path as the probe reads it (through the class symlink)
PCI1 = "sys/devices/pci0001:02/0001:02:00.0"

# (id, mutation, state, reason fragment, what must still hold)
FAULTS: list[tuple[str, Mutation, State, str, str]] = [
    ("no-topology", _remove("sys/devices/virtual/kfd"), State.UNAVAILABLE, "no AMD devices", "none"),
    ("cpu-nodes-only", _cpu_only, State.UNAVAILABLE, "CPU nodes only", "none"),
    ("gpu-properties-garbage", _write(f"{GPU5}/properties", b"simd_count lots\n"), State.DEGRADED,
     f"{SEEN5}/properties", "three"),
    ("gpu-properties-binary", _write(f"{GPU5}/properties", b"\xff\xfe\x00"), State.DEGRADED, "not UTF-8", "three"),
    ("gpu-properties-missing", _remove(f"{GPU5}/properties"), State.DEGRADED, "missing", "three"),
    ("cpu-properties-garbage", _write(f"{NODES}/1/properties", b"cpu_cores_count\n"), State.DEGRADED,
     f"{presence.KFD_NODES}/1/properties", "gpu1-apu-by-id"),
    ("mem-bank-garbage", _write(f"{GPU5}/mem_banks/0/properties", b"heap_type 1\n"), State.DEGRADED,
     "size_in_bytes", "gpu1-no-memory"),
    ("io-link-garbage", _write(f"{GPU5}/io_links/1/properties", b"type eleven\n"), State.DEGRADED,
     f"{SEEN5}/io_links/1/properties", "link-0-1-lost"),
    ("gpu-id-garbage", _write(f"{GPU5}/gpu_id", b"x\n"), State.DEGRADED, f"{SEEN5}/gpu_id", "gpu1-id-0"),
    ("partition-garbage", _write(f"{PCI1}/current_compute_partition", b"spx?\n"), State.DEGRADED,
     "current_compute_partition", "gpu1-no-compute-partition"),
    ("partition-attrs-absent", _remove(f"{PCI1}/current_compute_partition"), State.OK, "",
     "gpu1-no-compute-partition"),
    ("pci-device-missing", _remove("sys/bus/pci/devices/0001:02:00.0"), State.DEGRADED,
     "sys/bus/pci/devices/0001:02:00.0: missing", "gpu1-no-numa"),
    ("numa-node-garbage", _write(f"{PCI1}/numa_node", b"one\n"), State.DEGRADED, "numa_node", "gpu1-no-numa"),
    ("node-cpulist-garbage", _write("sys/devices/system/node/node1/cpulist", b"48-x\n"), State.DEGRADED,
     "node1/cpulist", "gpu1-no-cpus"),
    ("odd-node-entry", _odd_entry, State.DEGRADED, "lost+found: not a KFD node", "all"),
]


@pytest.mark.parametrize(("mutate", "state", "fragment", "rest"), [f[1:] for f in FAULTS],
                         ids=[f[0] for f in FAULTS])
def test_fault_table(mi300a: Path, tmp_path: Path, mutate: Mutation, state: State, fragment: str,
                     rest: str) -> None:
    root = _copy_amd_tree(mi300a, tmp_path)
    mutate(root)
    res = run(root)
    assert res.status.state is state, res.status.reasons
    assert any(fragment in r for r in res.status.reasons) or (state is State.OK and not res.status.reasons)
    devs = {d.bdf: d for d in res.data.devices}
    gpu1 = devs.get("0001:02:00.0")
    if rest == "none":
        assert res.data == AcceleratorPart()
        return
    if rest == "three":  # the broken GPU is lost, the other three are whole
        assert sorted(devs) == ["0000:02:00.0", "0002:02:00.0", "0003:02:00.0"]
        assert all(d.unified_memory and d.memory_numa_nodes == (d.numa_node,) for d in devs.values())
        assert len(res.data.links) == 3 and res.data.groups == ((0, 1, 2),)
        return
    assert len(devs) == 4 and gpu1 is not None
    others = [d for b, d in devs.items() if b != "0001:02:00.0"]
    assert all(d.unified_memory and d.memory_bytes == 63 * GIB and d.attributes["compute_partition"] == "SPX"
               for d in others)
    if rest == "gpu1-apu-by-id":  # its CPU node is lost, so no link marker; the device id still says APU
        assert "cpu_link" not in gpu1.attributes
        assert (gpu1.attributes["apu_evidence"], gpu1.memory_numa_nodes) == ("apu_device_id", (1,))
    elif rest == "gpu1-no-memory":
        assert gpu1.memory_bytes == 0 and gpu1.unified_memory
    elif rest == "link-0-1-lost":  # node 5's link to node 4 is broken; node 4's view of the pair stays
        assert [(lk.a, lk.b) for lk in res.data.links] == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    elif rest == "gpu1-id-0":
        assert gpu1.attributes["kfd_gpu_id"] == "0" and gpu1.unified_memory
    elif rest == "gpu1-no-compute-partition":
        assert "compute_partition" not in gpu1.attributes
        assert gpu1.attributes["memory_partition"] == "NPS1"
    elif rest == "gpu1-no-numa":  # still an APU, its node unknown: nothing guessed
        assert (gpu1.unified_memory, gpu1.numa_node, gpu1.memory_numa_nodes, gpu1.local_cpus) == (True, None, (), ())
    elif rest == "gpu1-no-cpus":
        assert (gpu1.numa_node, gpu1.memory_numa_nodes, gpu1.local_cpus) == (1, (1,), ())
    else:
        assert rest == "all"
        assert all(d.unified_memory for d in devs.values()) and len(res.data.links) == 6


def test_hwloc_xml_input_is_unavailable() -> None:
    res = amd.probe(ProbeContext.at_root("/", hwloc_xml=Path("a.xml")))
    assert res.status.state is State.UNAVAILABLE
    assert res.data == AcceleratorPart()


# ---- amdsmi (live host only) ---------------------------------------------------------------------
class FakeAmdSmiError(Exception):
    pass


def _fake_amdsmi(**overrides: object) -> types.ModuleType:
    """A stand-in with the binding's function names; handles are the BDFs amdsmi would print."""
    mod = types.ModuleType("amdsmi")
    calls: list[str] = []

    def record(name: str, value: object) -> object:
        def fn(*args: object) -> object:
            calls.append(name)
            if isinstance(value, Exception):
                raise value
            return value(*args) if callable(value) else value
        return fn

    defaults: dict[str, object] = {
        "amdsmi_init": None, "amdsmi_shut_down": None,
        "amdsmi_get_processor_handles": ["0000:02:00.0", "0001:02:00.0"],
        "amdsmi_get_gpu_device_bdf": lambda h: h.upper(),
        "amdsmi_get_gpu_asic_info": {"market_name": "AMD Instinct MI300A"},
        "amdsmi_get_gpu_compute_partition": "SPX",
        "amdsmi_get_gpu_memory_partition": "NPS1",
    }
    defaults.update(overrides)
    for name, value in defaults.items():
        setattr(mod, name, record(name, value))
    mod.calls = calls  # type: ignore[attr-defined]
    return mod


def _strip_sysfs_extras(root: Path) -> None:
    """No model from the id table and no partition attributes: what amdsmi can fill in."""
    for k in range(4):
        props = root / NODES / str(4 + k) / "properties"
        props.write_text(props.read_text().replace("device_id 29856", "device_id 29855"))
        pci = root / f"sys/devices/pci{k:04x}:02/{k:04x}:02:00.0"
        for attr in ("current_compute_partition", "current_memory_partition"):
            (pci / attr).unlink()


def test_amdsmi_fills_what_sysfs_lacks(mi300a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _copy_amd_tree(mi300a, tmp_path)
    _strip_sysfs_extras(root)
    fake = _fake_amdsmi()
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    res = run(root, libraries_live=True)
    assert res.status.state is State.OK, res.status.reasons
    d0, d1, d2, _ = res.data.devices
    for d in (d0, d1):  # the two handles amdsmi knows
        assert d.model == "AMD Instinct MI300A"
        assert (d.attributes["compute_partition"], d.attributes["memory_partition"]) == ("SPX", "NPS1")
    assert d2.model == "" and "compute_partition" not in d2.attributes
    # Without the device id an APU is still recognised by its XGMI intra-socket CPU link.
    assert all(d.unified_memory for d in res.data.devices)
    assert fake.calls[0] == "amdsmi_init" and fake.calls[-1] == "amdsmi_shut_down"


def test_amdsmi_not_consulted_for_a_capture(mi300a: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_amdsmi()
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    res = run(mi300a)
    assert res.status.state is State.OK and fake.calls == []


def test_amdsmi_absent_is_kfd_alone(mi300a: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import raises ImportError
    res = run(mi300a, libraries_live=True)
    assert res.status.state is State.OK and res.status.reasons == ()
    assert [d.model for d in res.data.devices] == ["MI300A"] * 4


@pytest.mark.parametrize(("override", "fragment"), [
    ({"amdsmi_init": FakeAmdSmiError("AMDSMI_STATUS_INIT_ERROR")}, "amdsmi_init: AMDSMI_STATUS_INIT_ERROR"),
    ({"amdsmi_get_processor_handles": FakeAmdSmiError("AMDSMI_STATUS_DRM_ERROR")}, "AMDSMI_STATUS_DRM_ERROR"),
    ({"amdsmi_get_gpu_compute_partition": FakeAmdSmiError("AMDSMI_STATUS_NOT_SUPPORTED")},
     "amdsmi_get_gpu_compute_partition(0000:02:00.0): AMDSMI_STATUS_NOT_SUPPORTED"),
    ({"amdsmi_get_gpu_memory_partition": "N/A?"}, "not a partition mode"),
    ({"amdsmi_shut_down": FakeAmdSmiError("busy")}, "amdsmi_shut_down: busy"),
])
def test_amdsmi_failures_degrade_and_keep_kfd(mi300a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              override: dict[str, object], fragment: str) -> None:
    root = _copy_amd_tree(mi300a, tmp_path)
    _strip_sysfs_extras(root)
    monkeypatch.setitem(sys.modules, "amdsmi", _fake_amdsmi(**override))
    res = run(root, libraries_live=True)
    assert res.status.state is State.DEGRADED
    assert any(fragment in r for r in res.status.reasons), res.status.reasons
    assert len(res.data.devices) == 4 and all(d.unified_memory for d in res.data.devices)
    assert [d.memory_numa_nodes for d in res.data.devices] == [(0,), (1,), (2,), (3,)]


def test_amdsmi_broken_install_degrades(mi300a: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def boom(name: str, package: str | None = None) -> types.ModuleType:
        if name == "amdsmi":
            raise OSError("libamd_smi.so: cannot open shared object file")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", boom)
    res = run(mi300a, libraries_live=True)
    assert res.status.state is State.DEGRADED
    assert any("amdsmi: import failed: libamd_smi.so" in r for r in res.status.reasons)
    assert len(res.data.devices) == 4


# ---- hypothesis: garbage never escapes as anything but KfdFormatError / a degraded status ----------
@settings(max_examples=200)
@given(st.text(max_size=200))
def test_parsers_total_on_text(text: str) -> None:
    for parse in (parse_properties, parse_mem_bank, parse_io_link, parse_partition_mode, parse_partition_list):
        with contextlib.suppress(KfdFormatError):
            parse(text)


names = st.from_regex(r"[a-z_][a-z0-9_]{0,30}", fullmatch=True)


@given(st.dictionaries(names, st.integers(0, (1 << 64) - 1), min_size=1, max_size=40))
def test_properties_round_trip(values: dict[str, int]) -> None:
    assert parse_properties(format_properties(values)) == values


def _mini_tree(root: Path) -> Path:
    """One CPU node and two discrete GPUs on PCIe, written as the kernel would."""
    spec: dict[str, str | Link | Dir] = {
        "sys/class/kfd/kfd/topology/nodes/0/properties": format_properties({"cpu_cores_count": 16, "simd_count": 0}),
        "sys/class/kfd/kfd/topology/nodes/0/gpu_id": "0",
        "sys/devices/system/node/node0/cpulist": "0-15",
    }
    for k, bus in ((1, 0x41), (2, 0xC1)):
        base = f"sys/class/kfd/kfd/topology/nodes/{k}"
        spec[f"{base}/properties"] = format_properties({
            "cpu_cores_count": 0, "simd_count": 1216, "vendor_id": 4098, "device_id": 0x74A1,
            "location_id": bus << 8, "domain": 0, "gfx_target_version": 90402, "unique_id": k})
        spec[f"{base}/gpu_id"] = str(1000 + k)
        spec[f"{base}/mem_banks/0/properties"] = format_properties({"heap_type": 1, "size_in_bytes": 192 * GIB})
        spec[f"{base}/io_links/0/properties"] = format_properties({"type": 2, "node_from": k, "node_to": 0,
                                                                   "weight": 20})
        spec[f"sys/bus/pci/devices/0000:{bus:02x}:00.0/numa_node"] = "0"
    return write_tree(root, spec)


def test_mini_tree_is_clean(tmp_path: Path) -> None:
    res = run(_mini_tree(tmp_path))
    assert res.status.state is State.OK, res.status.reasons
    assert [(d.bdf, d.numa_node, d.local_cpus, d.memory_bytes, d.unified_memory) for d in res.data.devices] == [
        ("0000:41:00.0", 0, tuple(range(16)), 192 * GIB, False), ("0000:c1:00.0", 0, tuple(range(16)), 192 * GIB,
                                                                  False)]
    assert res.data.links == ()


garbage = st.one_of(
    st.binary(max_size=80),
    st.text(max_size=80).map(lambda t: ("simd_count 1216\n" + t + " x\n").encode()),
    st.sampled_from([b"", b"simd_count\n", b"simd_count -5\n", b"location_id 0x4100\n"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rel=st.sampled_from(["nodes/2/properties", "nodes/2/mem_banks/0/properties", "nodes/2/io_links/0/properties"]),
       content=garbage)
def test_probe_garbage_degrades_rest_parsed(tmp_path_factory: pytest.TempPathFactory, rel: str,
                                            content: bytes) -> None:
    parse = {"properties": parse_properties, "mem_banks": parse_mem_bank, "io_links": parse_io_link}[rel.split("/")[2]]
    try:
        parse(content.decode())
        assume(False)  # a valid file by chance: not garbage
    except (UnicodeDecodeError, KfdFormatError):
        pass
    root = _mini_tree(tmp_path_factory.mktemp("kfd"))
    path = root / "sys/class/kfd/kfd/topology" / rel
    path.write_bytes(content)
    res = run(root)
    assert res.status.state is State.DEGRADED
    assert any(rel in r for r in res.status.reasons), res.status.reasons
    first = res.data.devices[0]
    assert (first.bdf, first.numa_node, first.memory_bytes) == ("0000:41:00.0", 0, 192 * GIB)
