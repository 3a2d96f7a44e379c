"""The assembled MemoryTopology on real captured machines (hwloc's fixtures and the numa-vm lab).

These run every probe plus the assembler, so they check what a consumer of the message sees:
domains and their types, interconnect figures and where they came from, tiers, CXL, PCI locality.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_XML, hwloc_root, hwloc_test_env, lab_root

DRAM, HBM, CXL, NVM, GPUMEM = (pb.MEMORY_DOMAIN_TYPE_DRAM, pb.MEMORY_DOMAIN_TYPE_HBM,
                               pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED, pb.MEMORY_DOMAIN_TYPE_NVM,
                               pb.MEMORY_DOMAIN_TYPE_GPU_MEMORY)
GIB = 1 << 30


def topo_of(root: Path, **env: str) -> pb.MemoryTopology:
    return discover(ProbeContext.at_root(root, hwloc_env=env))


def topo_of_xml(name: str) -> pb.MemoryTopology:
    return discover(ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / name))


def domain_of_node(topo: pb.MemoryTopology, node: int) -> pb.MemoryDomain:
    (d,) = [d for d in topo.domains if node in d.numa_nodes]
    return d


def link(topo: pb.MemoryTopology, a: int, b: int) -> pb.MemoryInterconnect:
    (i,) = [i for i in topo.interconnects if (i.domain_a, i.domain_b) == (a, b)]
    return i


def source(topo: pb.MemoryTopology, name: str) -> pb.SourceStatus:
    (s,) = [s for s in topo.sources if s.source == name]
    return s


# ---- the lab: a real 6.1 kernel with SLIT, HMAT, a far-memory node and CXL ---------------------------
@pytest.fixture(scope="module")
def cxl_default() -> pb.MemoryTopology:
    return topo_of(lab_root("dual-socket-cxl"))


@pytest.fixture(scope="module")
def cxl_tiered() -> pb.MemoryTopology:
    return topo_of(lab_root("dual-socket-cxl-tiered"))


def test_lab_default_domains_and_offline_cxl_window_node(cxl_default: pb.MemoryTopology) -> None:
    t = cxl_default
    assert [list(d.numa_nodes) for d in t.domains] == [[0], [1], [2]]
    assert [d.type for d in t.domains] == [DRAM, DRAM, DRAM]  # far memory at half bandwidth is not HBM
    assert [list(d.attached_cpus) for d in t.domains] == [[0, 1], [2, 3], []]
    assert list(t.domains[2].local_cpus) == [0, 1]  # its HMAT initiator's CPUs
    node3 = next(n for n in t.numa_nodes if n.id == 3)
    assert node3.state == pb.NUMA_NODE_STATE_POSSIBLE_OFFLINE and node3.domain == -1
    assert [list(d.distances) for d in t.domains] == [[10, 21, 24], [21, 10, 28], [24, 28, 10]]
    assert 0.9 * GIB < t.domains[0].capacity_bytes < GIB
    assert t.total_capacity_bytes == sum(d.capacity_bytes for d in t.domains)


def test_lab_default_hmat_figures_only_where_the_kernel_has_them(cxl_default: pb.MemoryTopology) -> None:
    t = cxl_default
    far = t.domains[2].local_performance
    assert (far.read_latency_ns, far.read_bandwidth_mbps, far.source, far.access_class) == (
        250, 10240, pb.PERFORMANCE_SOURCE_HMAT, 1)
    local = t.domains[0].local_performance
    assert (local.read_latency_ns, local.write_bandwidth_mbps) == (100, 20480)
    assert link(t, 0, 2).a_to_b.read_latency_ns == 250
    # node1 -> node2 (300 ns) exists only in the raw ACPI table; sysfs shows the best initiator only.
    assert link(t, 1, 2).a_to_b.source == pb.PERFORMANCE_SOURCE_SLIT
    assert link(t, 1, 2).a_to_b.read_latency_ns == 0
    assert (link(t, 0, 1).distance_a_to_b, link(t, 1, 2).distance_a_to_b) == (21, 28)
    assert all(i.link_type == pb.MEMORY_LINK_TYPE_NUMA_LINK for i in t.interconnects)


def test_lab_default_tiers_cxl_and_pci_locality(cxl_default: pb.MemoryTopology) -> None:
    t = cxl_default
    kernel = [(m.id, list(m.numa_nodes)) for m in t.memory_tiers if m.source == pb.TIER_SOURCE_KERNEL]
    assert kernel == [(4, [0, 1, 2])]
    (mem0,) = t.cxl_devices
    assert (mem0.name, mem0.host, mem0.numa_node, mem0.pmem_size_bytes) == ("mem0", "0000:61:00.0", 1, 0x20000000)
    assert not t.cxl_regions
    pci = {p.bdf: p for p in t.pci_devices}
    assert (pci["0000:21:00.0"].numa_node, pci["0000:21:00.0"].kind) == (0, pb.PCI_DEVICE_KIND_NIC)
    assert (pci["0000:42:00.0"].numa_node, pci["0000:42:00.0"].kind) == (1, pb.PCI_DEVICE_KIND_NVME)
    assert (pci["0000:61:00.0"].numa_node, pci["0000:61:00.0"].kind) == (1, pb.PCI_DEVICE_KIND_CXL_MEMORY)
    assert pci["0000:00:01.0"].numa_node == -1  # no affinity stays -1
    assert list(pci["0000:21:00.0"].local_numa_nodes) == [0, 2]  # hwloc: package 0 holds nodes 0 and 2
    assert "eth0" in pci["0000:21:00.0"].os_devices


def test_lab_tiered_cxl_region_becomes_cxl_domain_in_its_own_tier(cxl_tiered: pb.MemoryTopology) -> None:
    t = cxl_tiered
    cxl = domain_of_node(t, 3)
    assert cxl.type == CXL and cxl.subtype == "CXL-NVM"
    assert cxl.movable_only and not domain_of_node(t, 0).movable_only
    assert (cxl.kernel_tier, domain_of_node(t, 0).kernel_tier) == (22, 4)
    assert cxl.capacity_bytes == 393216 * 1024
    (region,) = t.cxl_regions
    assert (region.name, region.numa_node, region.dax_mode, list(region.memdevs)) == (
        "region0", 3, "system-ram", ["mem0"])
    assert t.cxl_regions[cxl.cxl_region].name == "region0"
    cxl_links = [i for i in t.interconnects if cxl.id in (i.domain_a, i.domain_b)]
    assert len(cxl_links) == 3 and all(i.link_type == pb.MEMORY_LINK_TYPE_CXL_SWITCH for i in cxl_links)
    assert all(i.distance_a_to_b == 20 for i in cxl_links)


def test_lab_pmem_via_kmem_is_nvm_not_cxl() -> None:
    t = topo_of(lab_root("dual-socket-tiered"))
    assert domain_of_node(t, 2).type == NVM and domain_of_node(t, 2).kernel_tier == 22
    assert not t.cxl_regions


def test_lab_single_node_host_shape() -> None:
    t = topo_of(lab_root("single"))
    assert [list(d.numa_nodes) for d in t.domains] == [[0]]
    assert all(p.numa_node == -1 for p in t.pci_devices)
    assert source(t, "sysfs.cxl").state == pb.SOURCE_STATE_UNAVAILABLE or not t.cxl_devices


# ---- hwloc's captured machines -----------------------------------------------------------------------
def test_heterogeneous_memory_types_and_tiers() -> None:
    t = topo_of(hwloc_root("fakeheteromemtiers"))
    types = {d.numa_nodes[0]: d.type for d in t.domains}
    assert types == {0: DRAM, 1: DRAM, 2: HBM, 4: HBM, 6: NVM, 8: NVM, 9: NVM}
    hw = {m.id: sorted(m.numa_nodes) for m in t.memory_tiers if m.source == pb.TIER_SOURCE_HWLOC}
    assert hw == {0: [2, 4], 1: [0, 1], 2: [6, 8, 9]}
    assert domain_of_node(t, 4).local_performance.read_bandwidth_mbps == 10000


def test_hmat_bandwidth_and_latency_reach_the_domains() -> None:
    t = topo_of(hwloc_root("fakememinitiators-1np2c+1npp+gi"))
    dram, nvm = domain_of_node(t, 5).local_performance, domain_of_node(t, 7).local_performance
    assert (dram.read_bandwidth_mbps, dram.read_latency_ns) == (131072, 26)
    assert (nvm.read_bandwidth_mbps, nvm.read_latency_ns) == (78644, 77)
    assert domain_of_node(t, 7).type == NVM


def test_firmware_zero_hmat_is_unknown_and_side_caches_are_reported() -> None:
    t = topo_of(hwloc_root("memorysidecaches"))
    for d in t.domains:
        assert d.local_performance.read_bandwidth_mbps == 0
        assert d.local_performance.source != pb.PERFORMANCE_SOURCE_HMAT
        assert [c.size_bytes for c in d.memory_side_caches] == [103079215104]


def test_gpu_memory_numa_nodes_are_their_own_domains() -> None:
    t = topo_of(hwloc_root("nvidiagpunumanodes"), **hwloc_test_env("nvidiagpunumanodes-kept"))
    gpu = sorted(d.numa_nodes[0] for d in t.domains if d.type == GPUMEM)
    assert gpu == [250, 251, 252, 253, 254, 255]
    assert all(not domain_of_node(t, n).attached_cpus for n in gpu)
    assert domain_of_node(t, 0).type == DRAM


def test_gpu_memory_nodes_hidden_by_hwloc_are_reported_as_a_disagreement() -> None:
    t = topo_of(hwloc_root("nvidiagpunumanodes"))  # hwloc hides GPU nodes on POWER by default
    hw = source(t, "hwloc")
    assert hw.state == pb.SOURCE_STATE_DEGRADED
    assert any("250-255" in r for r in hw.reasons)
    assert len(t.domains) == 8  # sysfs is authoritative: the GPU nodes still have memory


def test_sixty_four_nodes_all_pairs_linked() -> None:
    t = topo_of(hwloc_root("256ia64-64n2s2c"))
    assert len(t.domains) == 64 and len(t.interconnects) == 64 * 63 // 2
    assert sorted({v for d in t.domains for v in d.distances}) == [10, 22, 26, 30, 34]


def test_sparse_node_ids_keep_their_ids() -> None:
    t = topo_of(hwloc_root("48amd64-4pa2n6c-sparse"))
    assert [d.numa_nodes[0] for d in t.domains] == [0, 1, 2, 33, 34, 45, 72, 73]
    assert list(t.domains[0].distances) == [10, 16, 16, 22, 16, 22, 16, 22]


def test_cgroup_v1_restriction_keeps_the_whole_machine() -> None:
    t = topo_of(hwloc_root("16amd64-8n2c-cpusets"))
    assert len(t.domains) == 8
    assert list(t.allowed_memory_nodes) == [1, 2, 3, 4]
    assert list(t.allowed_cpus) == [0, 1, 2, 3, 5, 6, 12, 13, 14, 15]


def test_cgroup_v2_restriction() -> None:
    t = topo_of(hwloc_root("32amd64-4s2n4c-cgroup2"))
    assert list(t.allowed_cpus) == [0, 1, 2, 3, 4, 5]
    assert t.cgroup.version == pb.Cgroup.VERSION_V2


def test_offline_cpus_and_offline_node() -> None:
    t = topo_of(hwloc_root("offline-cpu0-node0"))
    assert [d.numa_nodes[0] for d in t.domains] == [1]
    assert set(t.cpus.offline) == {0, 1, 2, 3, 21, 22, 23}  # mask 0x00e0000f


def test_xml_hbm_pairs_share_cpus_with_dram_owning_them() -> None:
    t = topo_of_xml("64intel64-heteromem.xml")
    assert sorted(d.numa_nodes[0] for d in t.domains if d.type == HBM) == [4, 5, 6, 7]
    hbm, dram = domain_of_node(t, 7), domain_of_node(t, 0)
    assert not hbm.attached_cpus and list(hbm.local_cpus) == list(dram.attached_cpus)
    assert (dram.local_performance.read_bandwidth_mbps, hbm.local_performance.read_bandwidth_mbps) == (22500, 90000)
    assert source(t, "sysfs.numa").state == pb.SOURCE_STATE_UNAVAILABLE


def test_xml_cxl_dram_node_is_cxl_attached() -> None:
    t = topo_of_xml("heteromem.xml")
    assert domain_of_node(t, 4).type == CXL
    assert [domain_of_node(t, n).type for n in (0, 1, 2, 3)] == [DRAM, HBM, DRAM, HBM]


def test_xml_pci_locality_gives_gpu_numa_nodes() -> None:
    t = topo_of_xml("nvidiaDGX2.xml")
    gpus = [p for p in t.pci_devices if p.kind == pb.PCI_DEVICE_KIND_GPU]
    assert len(gpus) == 16
    by_bdf = {p.bdf: p.numa_node for p in gpus}
    assert by_bdf["0000:34:00.0"] == 0 and by_bdf["0000:e7:00.0"] == 1


# ---- robustness and fingerprint ----------------------------------------------------------------------
def test_garbage_files_degrade_their_source_and_the_rest_reports(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(lab_root("dual-socket-cxl"), root, symlinks=True)
    (root / "sys/devices/system/node/node1/meminfo").write_bytes(b"\xff\xfe garbage")
    (root / "sys/devices/system/node/node0/distance").write_text("ten twenty\n")
    (root / "sys/devices/virtual/memory_tiering/memory_tier4/nodelist").write_text("0-")
    t = topo_of(root)
    assert source(t, "sysfs.numa").state == pb.SOURCE_STATE_DEGRADED
    assert any("node1/meminfo" in r for r in source(t, "sysfs.numa").reasons)
    assert source(t, "sysfs.memory_tiers").state == pb.SOURCE_STATE_DEGRADED
    assert {p.bdf for p in t.pci_devices} >= {"0000:21:00.0", "0000:41:00.0"}
    assert len(t.cxl_devices) == 1


def test_fingerprint_ignores_time_and_free_memory_but_not_content(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(lab_root("dual-socket-cxl"), root, symlinks=True)
    first = topo_of(root)
    meminfo = root / "sys/devices/system/node/node0/meminfo"
    meminfo.write_text(meminfo.read_text().replace("MemFree:", "MemFree:  1", 1))
    second = topo_of(root)
    assert second.domains[0].free_bytes != first.domains[0].free_bytes
    assert second.fingerprint == first.fingerprint
    (root / "sys/bus/pci/devices/0000:21:00.0/numa_node").unlink()
    (root / "sys/bus/pci/devices/0000:21:00.0/numa_node").write_text("1\n")
    assert topo_of(root).fingerprint != first.fingerprint


def test_fingerprint_leaves_the_message_as_it_was(cxl_default: pb.MemoryTopology) -> None:
    from memtopo.discovery.fingerprint import fingerprint

    before = cxl_default.SerializeToString(deterministic=True)
    assert fingerprint(cxl_default) == cxl_default.fingerprint
    assert cxl_default.SerializeToString(deterministic=True) == before
