"""Accelerators from the PCI/hwloc view (the fallback every vendor source sits on), against hwloc's
captured machines: the facts asserted are INDEX.md's (../shared/fixtures/hwloc/INDEX.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtopo.cli.render import render_links
from memtopo.discovery.accelerators import path_class
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.links import link_word, pair_links
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_XML, hwloc_root, hwloc_test_env
from tests.sysfs_tree import Link, write_tree


def xml(name: str) -> pb.MemoryTopology:
    return discover(ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / name))


def by_bdf(topo: pb.MemoryTopology) -> dict[str, pb.Accelerator]:
    return {a.bdf: a for a in topo.accelerators}


def test_dgx2_sixteen_gpus_by_numa_node_with_uuids_and_nvswitch_fabric() -> None:
    topo = xml("nvidiaDGX2.xml")
    accels = by_bdf(topo)
    node0 = ["0000:34:00.0", "0000:36:00.0", "0000:39:00.0", "0000:3b:00.0",
             "0000:57:00.0", "0000:59:00.0", "0000:5c:00.0", "0000:5e:00.0"]
    node1 = ["0000:b7:00.0", "0000:b9:00.0", "0000:bc:00.0", "0000:be:00.0",
             "0000:e0:00.0", "0000:e2:00.0", "0000:e5:00.0", "0000:e7:00.0"]
    assert sorted(accels) == sorted(node0 + node1)
    for i, bdf in enumerate(node0 + node1):
        a = accels[bdf]
        assert a.id == f"GPU{i}"  # nvml<i> names the index
        assert a.kind == pb.ACCELERATOR_KIND_GPU and a.vendor == "NVIDIA"
        assert a.model == "Tesla V100-SXM3-32GB-H" and a.uuid.startswith("GPU-")
        assert a.numa_node == (0 if bdf in node0 else 1)
        assert a.domain == a.numa_node  # the Dram domain of its node
    assert len({a.uuid for a in topo.accelerators}) == 16
    # NVSwitch fabric: every GPU uses 6 switch ports, so every pair reads NV6 (as nvidia-smi prints),
    # carried by one group instead of 120 pair links.
    assert list(topo.accelerator_links) == []
    (fabric,) = [g for g in topo.accelerator_groups if g.link_kind]
    assert (fabric.kind, fabric.link_kind, fabric.link_count, fabric.bandwidth_mbps) == (
        "nvswitch-fabric", "NV", 6, 6 * 25000)
    assert sorted(fabric.members) == sorted(f"GPU{i}" for i in range(16))
    pairs = list(pair_links(topo))
    assert len(pairs) == 16 * 15 // 2 and {link_word(lk) for _, _, lk in pairs} == {"NV6"}
    matrix = render_links(topo).splitlines()
    assert matrix[1].split()[:4] == ["GPU0", "X", "NV6", "NV6"]
    assert list(topo.domains[0].attached_accelerators) == list(range(8))


def test_power8_direct_nvlinks_and_pcie_sys_between_sockets() -> None:
    topo = xml("power8gpudistances.xml")
    accels = by_bdf(topo)
    assert {b: a.numa_node for b, a in accels.items()} == {
        "0002:01:00.0": 0, "0003:01:00.0": 0, "000a:01:00.0": 1, "000b:01:00.0": 1}
    words = {frozenset((lk.a, lk.b)): (lk.kind, lk.bandwidth_mbps) for lk in topo.accelerator_links}

    def word(x: str, y: str) -> tuple[str, int]:
        return words[frozenset((accels[x].id, accels[y].id))]

    assert word("0002:01:00.0", "0003:01:00.0") == ("NV", 40000)
    assert word("000a:01:00.0", "000b:01:00.0") == ("NV", 40000)
    assert word("0002:01:00.0", "000a:01:00.0") == ("SYS", 0)


def test_wholeio_nvidia_and_amd_gpus_on_node1_bmc_vga_is_not_an_accelerator() -> None:
    accels = by_bdf(xml("32em64t-2n8c2t-pci-wholeio.xml"))
    assert accels["0000:84:00.0"].model == "Tesla K40m" and accels["0000:84:00.0"].numa_node == 1
    assert "Radeon" in accels["0000:84:00.1"].model and accels["0000:84:00.1"].numa_node == 1
    assert "0000:05:03.0" not in accels  # Matrox G200 on the BMC
    a, b = accels["0000:84:00.0"].id, accels["0000:84:00.1"].id
    assert render_links(xml("32em64t-2n8c2t-pci-wholeio.xml")).count("PIX") >= 2, (a, b)


def test_vector_engines_all_local_to_node0_with_memory() -> None:
    topo = discover(ProbeContext.at_root(hwloc_root("32intel64-2p8co2t+8ve")))
    accels = by_bdf(topo)
    assert sorted(accels) == [f"0000:{b}:00.0" for b in ("1b", "1c", "1d", "1e", "3d", "3f", "40", "41")]
    for a in accels.values():
        assert a.kind == pb.ACCELERATOR_KIND_OTHER and a.vendor == "NEC"
        assert a.numa_node == 0 and a.model == "VectorEngine 1"
        assert a.memory_bytes == 50331648 * 1024
    assert sorted(a.id for a in accels.values()) == [f"ACC{i}" for i in range(8)]


@pytest.mark.parametrize("keep", [False, True])
def test_power9_gpus_with_gpu_memory_nodes(keep: bool) -> None:
    env = {"HWLOC_KEEP_NVIDIA_GPU_NUMA_NODES": "1"} if keep else {}
    topo = discover(ProbeContext.at_root(hwloc_root("nvidiagpunumanodes"), hwloc_env=env))
    accels = by_bdf(topo)
    assert len(accels) == 6
    package0 = {"0006:00:00.0", "0004:06:00.0", "0004:05:00.0"}
    for bdf, a in accels.items():
        assert a.numa_node == (0 if bdf in package0 else 8)
    if keep:  # hwloc names each GPUMemory node's GPU (info PCIBusID)
        assert {b: list(a.memory_numa_nodes) for b, a in accels.items()} == {
            "0006:00:00.0": [253], "0004:06:00.0": [254], "0004:05:00.0": [255],
            "0035:05:00.0": [250], "0035:04:00.0": [251], "0007:00:00.0": [252]}


@pytest.mark.parametrize("name", ["nvidia-dgx-gb10", "40intel64-2g2n4c+pcilocality"])
def test_machines_without_accelerators(name: str) -> None:
    env = hwloc_test_env(name) if name.startswith("40intel") else {}
    topo = discover(ProbeContext.at_root(hwloc_root(name), hwloc_env=env))
    assert list(topo.accelerators) == []
    assert render_links(topo) == "no accelerators\n"


def test_pci_numa_node_minus_one_is_no_affinity(tmp_path: Path) -> None:
    """A GPU whose firmware gave no proximity keeps -1 and belongs to no domain; nothing is guessed."""
    dev = "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0"
    write_tree(tmp_path, {
        "sys/devices/system/node/online": "0-1", "sys/devices/system/node/possible": "0-1",
        "sys/devices/system/node/node0/cpulist": "0-1", "sys/devices/system/node/node1/cpulist": "2-3",
        "sys/devices/system/node/node0/meminfo": "Node 0 MemTotal: 1048576 kB\n",
        "sys/devices/system/node/node1/meminfo": "Node 1 MemTotal: 1048576 kB\n",
        f"{dev}/vendor": "0x10de", f"{dev}/device": "0x2330", f"{dev}/class": "0x030200",
        f"{dev}/numa_node": "-1", f"{dev}/local_cpulist": "0-3",
        "sys/bus/pci/devices/0000:01:00.0": Link("../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0"),
    })
    (a,) = discover(ProbeContext.at_root(tmp_path)).accelerators
    assert (a.id, a.numa_node, a.domain, a.source) == ("GPU0", -1, -1, "pci")


@pytest.mark.parametrize(("up_a", "up_b", "na", "nb", "word"), [
    (("pci0000:00", "0000:00:01.0", "0000:01:00.0"), ("pci0000:00", "0000:00:01.0", "0000:01:00.0"), 0, 0, "PIX"),
    (("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0"),
     ("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:08.0"), 0, 0, "PIX"),
    (("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"),
     ("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:08.0"), 0, 0, "PXB"),
    (("pci0000:00", "0000:00:01.0"), ("pci0000:00", "0000:00:02.0"), 0, 0, "PHB"),
    (("pci0000:00", "0000:00:01.0"), ("pci0000:40", "0000:40:01.0"), 0, 0, "NODE"),
    (("pci0000:00", "0000:00:01.0"), ("pci0000:80", "0000:80:01.0"), 0, 1, "SYS"),
    ((), ("pci0000:80",), -1, -1, "SYS"),
])
def test_pcie_path_classes(up_a: tuple[str, ...], up_b: tuple[str, ...], na: int, nb: int, word: str) -> None:
    assert path_class(up_a, up_b, na, nb) == word
