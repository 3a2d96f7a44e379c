"""The hwloc probe against every hwloc fixture (INDEX.md), the lab captures, bad inputs and this host.

The probe always loads with INCLUDE_DISALLOWED, so cgroup-restricted fixtures show the whole machine
and the restriction only in allowed_cpus/allowed_nodes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from memtopo.cpulist import parse_cpulist
from memtopo.discovery import hwloc
from memtopo.discovery.parts import HwlocPart, HwlocPci
from memtopo.discovery.source import ProbeContext, State
from tests.fixtures import HWLOC_LINUX, HWLOC_XML, hwloc_root, hwloc_test_env, lab_root


def cpus(text: str) -> tuple[int, ...]:
    return parse_cpulist(text)


@cache
def from_root(tarball: str, test: str | None = None) -> HwlocPart:
    env = hwloc_test_env(test) if test else {}
    result = hwloc.probe(ProbeContext.at_root(hwloc_root(tarball), hwloc_env=env))
    assert result.status.state is State.OK, result.status
    return result.data


@cache
def from_xml(name: str) -> HwlocPart:
    result = hwloc.probe(ProbeContext.at_root("/nonexistent", hwloc_xml=HWLOC_XML / name))
    assert result.status.state is State.OK, result.status
    return result.data


@cache
def from_lab(profile: str) -> HwlocPart:
    result = hwloc.probe(ProbeContext.at_root(lab_root(profile)))
    assert result.status.state is State.OK, result.status
    return result.data


def node_cpus(part: HwlocPart) -> dict[int, tuple[int, ...]]:
    return {n.os_index: n.cpuset for n in part.nodes}


def node_mem(part: HwlocPart) -> dict[int, int]:
    return {n.os_index: n.local_memory for n in part.nodes}


def subtypes(part: HwlocPart) -> dict[int, str]:
    return {n.os_index: n.subtype for n in part.nodes}


def tiers(part: HwlocPart) -> dict[int, int | None]:
    return {n.os_index: n.memory_tier for n in part.nodes}


def numa_matrix(part: HwlocPart) -> dict[tuple[int, int], int]:
    (latency,) = [d for d in part.distances if d.name == "NUMALatency"]
    return {(a, b): latency.matrix[i][j]
            for i, a in enumerate(latency.nodes) for j, b in enumerate(latency.nodes)}


def row(part: HwlocPart, node: int) -> list[int]:
    (latency,) = [d for d in part.distances if d.name == "NUMALatency"]
    return list(latency.matrix[latency.nodes.index(node)])


def memattr(part: HwlocPart, name: str) -> set[tuple[int, int, object]]:
    """(target, value, initiator) for one attribute; initiator is a cpuset, an object label or None."""
    out: set[tuple[int, int, object]] = set()
    for v in part.memattrs:
        if v.attribute == name:
            out.add((v.target_node, v.value,
                     v.initiator_cpus if v.initiator_cpus is not None else v.initiator_object))
    return out


def pci_by_bdf(part: HwlocPart) -> dict[str, HwlocPci]:
    return {p.bdf: p for p in part.pci}


def osdev_locality(part: HwlocPart) -> dict[str, tuple[str, tuple[int, ...]]]:
    """OS device name → (PCI BDF, nodeset) for every OS device under a PCI device."""
    return {o.name: (p.bdf, p.nodeset) for p in part.pci for o in p.os_devices}


# ---- every fixture: NUMA os indexes, PU count and total memory ---------------------------------------
# (tarball, .test env or None) → (NUMA P#s, PUs, total bytes). With INCLUDE_DISALLOWED the cgroup
# fixtures show all nodes/PUs, so their figures are the "with disallowed" ones.
SYSFS: dict[tuple[str, str | None], tuple[tuple[int, ...], int, int]] = {
    ("2arm-2c", None): ((0,), 2, 287580160),
    ("20em64t-hybrid-1p6c2t+2ca4co1t", None): ((0,), 20, 33269227520),
    ("16amd64-8n2c", None): (tuple(range(8)), 16, 68717527040),
    ("48amd64-4pa2n6c-sparse", None): ((0, 1, 2, 33, 34, 45, 72, 73), 48, 103077015552),
    ("128ia64-17n4s2c", None): (tuple(range(17)), 128, 1648141123584),
    ("256ia64-64n2s2c", None): (tuple(range(64)), 256, 529318068224),
    ("128arm-2pa2n8cluster4co", None): ((0, 1, 2, 3), 128, 539679973376),
    ("nvidia-dgx-gb10", None): ((0,), 20, 128520671232),
    ("nvidiagpunumanodes", "nvidiagpunumanodes"): ((0, 8), 32, 270122090496),
    ("nvidiagpunumanodes", "nvidiagpunumanodes-kept"): ((0, 8, 250, 251, 252, 253, 254, 255), 32, 366758854656),
    ("fakeheteromemtiers", None): ((0, 1, 2, 4, 6, 8, 9), 6, 6385741824),
    # Kernel nodes 0-4 (CPU-only and generic initiator, no memory) appear with INCLUDE_DISALLOWED.
    ("fakememinitiators-1np2c+1npp+gi", None): (tuple(range(11)), 8, 1998146248704),
    ("memorysidecaches", None): ((0, 1, 2, 3), 80, 1596398403584),
    ("32em64t-2n8c+dax+nvme+mic+dimms", None): ((0, 1), 16, 34328924160),
    ("32intel64-2p8co2t+8ve", None): ((0, 1), 32, 99784286208),
    ("40intel64-2g2n4c+pcilocality", "40intel64-2g2n4c+pcilocality"): ((0, 1, 2, 3), 40, 549742014464),
    ("40intel64-2g2n4c+pcilocality", None): ((0, 1, 2, 3), 40, 549742014464),
    ("2pa-pcidomain32bits", None): ((0,), 2, 2101800960),
    ("16amd64-8n2c-cpusets", "16amd64-8n2c-cpusets"): (tuple(range(8)), 15, 68717527040),
    ("16amd64-8n2c-cpusets", "16amd64-8n2c-cpusets-disallowed"): (tuple(range(8)), 15, 68717527040),
    ("32amd64-4s2n4c-cgroup2", "32amd64-4s2n4c-cgroup2"): (tuple(range(8)), 32, 137436770304),
    ("offline-cpu0-node0", None): ((1,), 17, 68719476736),
}

XML: dict[str, tuple[tuple[int, ...], int, int]] = {
    "8intel64-4n2t-memattrs.xml": ((0, 1, 2, 3), 8, 4294967296),
    "64intel64-heteromem.xml": (tuple(range(8)), 64, 12884901888),
    "cxlmem+dax.v3.xml": ((0,), 4, 3061719040),
    "cxlmem+dax.v2.xml": ((0,), 4, 3061719040),
    "heteromem.xml": ((0, 1, 2, 3, 4), 8, 5368709120),
    "nvidiaDGX2.xml": ((0, 1), 4, 1621972275200),
    "power8gpudistances.xml": ((0, 1), 16, 137007529984),
    "32em64t-2n8c2t-pci-wholeio.xml": ((0, 1), 32, 68689911808),
    "16amd64-4distances.xml": (tuple(range(8)), 16, 68717527040),
    "192em64t-24n8c2t.xml": (tuple(range(24)), 384, 798447374336),
    "16intel64-manyVFs.xml": ((0, 1), 16, 137402286080),
}


def test_tables_cover_every_fixture() -> None:
    tarballs = {p.name.removesuffix(".tar.bz2") for p in HWLOC_LINUX.glob("*.tar.bz2")}
    tests = {p.name.removesuffix(".test") for p in HWLOC_LINUX.glob("*.test")}
    assert {t for t, _ in SYSFS} == tarballs
    assert {e for _, e in SYSFS if e} | {t for t, e in SYSFS if e is None} >= tests
    assert set(XML) == {p.name for p in HWLOC_XML.glob("*.xml")}


@pytest.mark.parametrize(("tarball", "test"), list(SYSFS), ids=[f"{t}[{e}]" for t, e in SYSFS])
def test_sysfs_fixture_numa_pus_memory(tarball: str, test: str | None) -> None:
    numa, n_pus, total = SYSFS[tarball, test]
    part = from_root(tarball, test)
    assert sorted(n.os_index for n in part.nodes) == list(numa)
    assert len(part.pus) == n_pus
    assert sum(n.local_memory for n in part.nodes) == total
    assert part.version.startswith("3.")
    assert part.info.get("Backend") == "Linux"


@pytest.mark.parametrize("name", list(XML))
def test_xml_fixture_numa_pus_memory(name: str) -> None:
    numa, n_pus, total = XML[name]
    part = from_xml(name)
    assert sorted(n.os_index for n in part.nodes) == list(numa)
    assert len(part.pus) == n_pus
    assert sum(n.local_memory for n in part.nodes) == total
    # The library's own version, not the exporter's hwlocVersion kept in part.info.
    assert part.version.startswith("3.")


# ---- sysfs tarballs ----------------------------------------------------------------------------------
def test_2arm_no_node_dir() -> None:
    part = from_root("2arm-2c")
    assert node_cpus(part) == {0: (0, 1)}
    assert [(p.os_index, p.cpus) for p in part.packages] == [(3, (0, 1))]
    assert part.nodes[0].package == 3
    assert part.distances == ()


def test_20em64t_hybrid() -> None:
    part = from_root("20em64t-hybrid-1p6c2t+2ca4co1t")
    assert node_cpus(part) == {0: cpus("0-19")}
    assert part.cores == 14
    assert part.distances == ()


def test_16amd64_flat_distances() -> None:
    part = from_root("16amd64-8n2c")
    assert node_cpus(part) == {i: (2 * i, 2 * i + 1) for i in range(8)}
    assert node_mem(part)[0] == 8587984896
    assert all(node_mem(part)[i] == 8589934592 for i in range(1, 8))
    m = numa_matrix(part)
    assert all(v == (10 if a == b else 20) for (a, b), v in m.items())
    assert {n.os_index: n.package for n in part.nodes} == {i: i for i in range(8)}


def test_48amd64_sparse() -> None:
    part = from_root("48amd64-4pa2n6c-sparse")
    assert node_cpus(part) == {0: cpus("0-5"), 1: cpus("6-11"), 2: cpus("12-17"), 33: cpus("18-23"),
                               34: cpus("24-29"), 45: cpus("30-35"), 72: cpus("36-41"), 73: cpus("42-47")}
    assert row(part, 0) == [10, 16, 16, 22, 16, 22, 16, 22]
    (latency,) = part.distances
    assert latency.nodes == (0, 1, 2, 33, 34, 45, 72, 73)
    assert latency.kind == 5


def test_128ia64_cpuless_node() -> None:
    part = from_root("128ia64-17n4s2c")
    c = node_cpus(part)
    assert all(c[i] == tuple(range(8 * i, 8 * i + 8)) for i in range(16))
    assert c[16] == ()
    assert node_mem(part)[16] == 1044660224
    assert row(part, 0) == [10, 17, 17, 17] + [20] * 12 + [14]
    m = numa_matrix(part)
    assert all(m[16, i] == 14 for i in range(16))


def test_256ia64() -> None:
    part = from_root("256ia64-64n2s2c")
    assert node_cpus(part) == {i: tuple(range(4 * i, 4 * i + 4)) for i in range(64)}
    assert node_mem(part)[0] == 8257945600
    assert set(numa_matrix(part).values()) == {10, 22, 26, 30, 34}
    assert row(part, 0)[:13] == [10, 22, 22, 22] + [26] * 8 + [30]


def test_128arm_kunpeng() -> None:
    part = from_root("128arm-2pa2n8cluster4co")
    assert node_cpus(part) == {0: cpus("0-31"), 1: cpus("32-63"), 2: cpus("64-95"), 3: cpus("96-127")}
    assert node_mem(part) == {0: 134894530560, 1: 135288770560, 2: 135288766464, 3: 134207905792}
    (latency,) = part.distances
    assert latency.matrix == ((10, 16, 32, 33), (16, 10, 25, 32), (32, 25, 10, 16), (33, 32, 16, 10))
    assert len(part.packages) == 2


def test_nvidia_dgx_gb10() -> None:
    part = from_root("nvidia-dgx-gb10")
    assert node_cpus(part) == {0: cpus("0-19")}
    assert [p.os_index for p in part.packages] == [36]
    assert part.pci == ()


def test_nvidiagpunumanodes_default_hides_gpu_nodes() -> None:
    part = from_root("nvidiagpunumanodes", "nvidiagpunumanodes")
    assert node_cpus(part) == {0: cpus("0-15"), 8: cpus("88-103")}
    assert node_mem(part) == {0: 132955242496, 8: 137166848000}
    assert numa_matrix(part)[0, 8] == 40
    assert len(part.pci) == 6
    assert all(p.class_code >> 8 == 0x0300 for p in part.pci)


def test_nvidiagpunumanodes_kept() -> None:
    part = from_root("nvidiagpunumanodes", "nvidiagpunumanodes-kept")
    gpu = {n.os_index: n for n in part.nodes if n.subtype == "GPUMemory"}
    assert set(gpu) == {250, 251, 252, 253, 254, 255}
    assert all(n.local_memory == 16106127360 for n in gpu.values())
    assert {i: n.info["PCIBusID"] for i, n in gpu.items()} == {
        253: "0006:00:00.0", 254: "0004:06:00.0", 255: "0004:05:00.0",
        250: "0035:05:00.0", 251: "0035:04:00.0", 252: "0007:00:00.0"}
    for i in (253, 254, 255):
        assert (gpu[i].package, gpu[i].cpuset) == (0, cpus("0-15"))
    for i in (250, 251, 252):
        assert (gpu[i].package, gpu[i].cpuset) == (8, cpus("88-103"))
    m = numa_matrix(part)
    assert all(m[g, n] == 80 for g in gpu for n in (0, 8))
    t = tiers(part)
    assert (t[0], t[8]) == (0, 0)
    assert all(t[g] == 1 for g in gpu)
    assert part.memory_tiers_nr == 2


def test_fakeheteromemtiers() -> None:
    part = from_root("fakeheteromemtiers")
    assert subtypes(part) == {0: "DRAM", 8: "NVM", 1: "DRAM", 4: "HBM", 6: "NVM", 2: "HBM", 9: "NVM"}
    assert node_cpus(part) == {0: (0, 1), 8: (0, 1), 1: (2, 3), 4: (2, 3), 6: (2, 3), 2: (4, 5), 9: (4, 5)}
    assert node_mem(part)[0] == 3077521408
    assert node_mem(part)[8] == 402653184
    assert node_mem(part)[1] == 1026519040
    assert node_mem(part)[4] == node_mem(part)[2] == 536870912
    assert tiers(part) == {0: 1, 1: 1, 2: 0, 4: 0, 6: 2, 8: 2, 9: 2}
    assert part.memory_tiers_nr == 3
    by_node = {n.os_index: n for n in part.nodes}
    assert by_node[8].info["DAXDevice"] == "dax7.0"
    assert (by_node[4].info["DAXDevice"], by_node[4].info["DAXType"]) == ("dax1.0", "SPM")
    expected = {(0, 1000, (0, 1)), (1, 1000, (2, 3)), (2, 10000, (4, 5)), (4, 10000, (2, 3)),
                (6, 100, (2, 3)), (8, 100, (0, 1)), (9, 100, (4, 5))}
    for attr in ("Bandwidth", "ReadBandwidth", "WriteBandwidth"):
        assert memattr(part, attr) == expected
    assert memattr(part, "Latency") == set()
    others = {o.name: o for o in part.other_os_devices}
    assert {n: (o.kind, o.subtype) for n, o in others.items()} == {
        "dax0.0": ("memory", "SPM"), "dax2.0": ("memory", "SPM"), "dax6.0": ("memory", "NVM")}
    m = numa_matrix(part)
    assert all(v == (10 if a == b else 20) for (a, b), v in m.items())


def test_fakememinitiators() -> None:
    part = from_root("fakememinitiators-1np2c+1npp+gi")
    c = node_cpus(part)
    assert {i: c[i] for i in range(5, 11)} == {5: (0, 1), 6: (4, 5), 7: (0, 1, 4, 5), 8: (2, 3),
                                              9: (6, 7), 10: (2, 3, 6, 7)}
    assert subtypes(part)[7] == subtypes(part)[10] == "NVM"
    assert node_mem(part)[7] == 796716433408
    # The memory-less kernel nodes are disallowed (not in the cgroup's mems).
    assert all(node_mem(part)[i] == 0 for i in range(5))
    assert part.allowed_nodes == tuple(range(5, 11))
    dram = {(5, (0, 1)), (6, (4, 5)), (8, (2, 3)), (9, (6, 7))}
    nvm = {(7, (0, 1, 4, 5)), (10, (2, 3, 6, 7))}
    for attr in ("Bandwidth", "ReadBandwidth", "WriteBandwidth"):
        assert memattr(part, attr) == {(n, 131072, i) for n, i in dram} | {(n, 78644, i) for n, i in nvm}
    for attr in ("Latency", "ReadLatency", "WriteLatency"):
        assert memattr(part, attr) == {(n, 26, i) for n, i in dram} | {(n, 77, i) for n, i in nvm}
    # INDEX (default load) has DRAM = tier 0, NVM = tier 1. With the disallowed memory-less nodes in
    # the topology, hwloc numbers the tiers the other way round; the grouping is what holds.
    t = tiers(part)
    assert len({t[i] for i in (5, 6, 8, 9)}) == 1
    assert t[7] == t[10] != t[5]
    assert part.memory_tiers_nr == 2
    assert row(part, 5)[5:] == [10, 13, 17, 21, 21, 28]


def test_memorysidecaches_zero_hmat_gives_no_values() -> None:
    part = from_root("memorysidecaches")
    assert {n.os_index: n.package for n in part.nodes} == {0: 0, 2: 0, 1: 1, 3: 1}
    assert node_cpus(part)[0] == tuple(range(0, 80, 4))
    assert node_cpus(part)[3] == tuple(range(3, 80, 4))
    assert node_mem(part)[0] == 397816131584
    assert not [v for v in part.memattrs if "Bandwidth" in v.attribute or "Latency" in v.attribute]
    (latency,) = part.distances
    assert latency.matrix == ((10, 21, 11, 21), (21, 10, 21, 11), (11, 21, 10, 21), (21, 11, 21, 10))


def test_32em64t_dax_pci_locality() -> None:
    part = from_root("32em64t-2n8c+dax+nvme+mic+dimms")
    assert node_cpus(part) == {0: cpus("0-7"), 1: cpus("8-15")}
    assert node_mem(part) == {0: 17149054976, 1: 17179869184}
    loc = osdev_locality(part)
    assert loc["eth0"] == ("0000:02:00.0", (0,))
    assert loc["eth1"] == ("0000:02:00.3", (0,))
    assert loc["nvme0n1"][1] == (0,)
    assert loc["sda"][1] == (0,)
    assert all(loc[f"dma{i}chan0"][1] == (0,) for i in range(8))
    assert all(loc[f"dma{i}chan0"][1] == (1,) for i in range(8, 16))
    assert loc["ib0"] == loc["mlx4_0"] == ("0000:82:00.0", (1,))
    assert pci_by_bdf(part)["0000:82:00.0"].cpuset == cpus("8-15")
    kinds = {o.name: o.kind for p in part.pci for o in p.os_devices}
    assert (kinds["eth0"], kinds["ib0"], kinds["mlx4_0"], kinds["sda"], kinds["dma0chan0"]) == (
        "network", "network", "openfabrics", "storage", "dma")
    others = {o.name: o for o in part.other_os_devices}
    assert {"dax0.0", "dax1.3", "pmem0.1", "pmem1"} <= set(others)
    assert others["dax0.0"].subtype == "NVM"
    assert len(part.pci) == 128
    assert numa_matrix(part)[0, 1] == 21


def test_32intel64_ve_cards_all_on_numa0() -> None:
    part = from_root("32intel64-2p8co2t+8ve")
    assert node_cpus(part) == {0: cpus("0-7,16-23"), 1: cpus("8-15,24-31")}
    loc = osdev_locality(part)
    bdfs = ["0000:1b:00.0", "0000:1c:00.0", "0000:1d:00.0", "0000:1e:00.0",
            "0000:3d:00.0", "0000:3f:00.0", "0000:40:00.0", "0000:41:00.0"]
    assert [loc[f"ve{i}"] for i in range(8)] == [(b, (0,)) for b in bdfs]
    for b in bdfs:
        (ve,) = pci_by_bdf(part)[b].os_devices
        assert (ve.kind, ve.subtype) == ("coproc", "VectorEngine")
        assert ve.info["VectorEngineMemorySize"] == "50331648KiB"
        assert pci_by_bdf(part)[b].cpuset == cpus("0-7,16-23")
    assert loc["enp96s0f0"] == ("0000:60:00.0", (0,))
    assert loc["enp96s0f1"] == ("0000:60:00.1", (0,))
    assert pci_by_bdf(part)["0000:1a:00.0"].nodeset == (0,)
    assert pci_by_bdf(part)["0000:3e:00.0"].os_devices == ()
    assert len(part.pci) == 12
    assert all(p.nodeset == (0,) for p in part.pci)


def test_40intel64_pci_locality_from_env() -> None:
    part = from_root("40intel64-2g2n4c+pcilocality", "40intel64-2g2n4c+pcilocality")
    even, odd = tuple(range(0, 40, 2)), tuple(range(1, 40, 2))
    assert node_cpus(part) == {0: tuple(range(0, 40, 4)), 2: tuple(range(2, 40, 4)),
                               1: tuple(range(1, 40, 4)), 3: tuple(range(3, 40, 4))}
    assert all(v == 137438953472 for k, v in node_mem(part).items() if k)
    for p in part.pci:
        bus = int(p.bdf.split(":")[1], 16)
        if bus <= 0x09:
            assert (p.cpuset, p.nodeset) == (even, (0, 2)), p.bdf
        elif 0x40 <= bus <= 0x46:
            assert (p.cpuset, p.nodeset) == (odd, (1, 3)), p.bdf
    loc = osdev_locality(part)
    assert loc["sda"] == ("0000:01:00.0", (0, 2))
    assert {loc[f"eth{i}"][0] for i in range(4)} == {"0000:02:00.0", "0000:02:00.1", "0000:03:00.0",
                                                     "0000:03:00.1"}
    assert all(loc[f"eth{i}"][1] == (0, 2) for i in range(4))
    assert loc["sr0"][1] == (0, 2)
    assert loc["ib0"] == loc["qib0"] == ("0000:43:00.0", (1, 3))
    assert len(part.pci) == 23


def test_40intel64_without_env_attaches_io_to_machine() -> None:
    part = from_root("40intel64-2g2n4c+pcilocality")
    assert len(part.pci) == 23
    assert all((p.cpuset, p.nodeset) == (tuple(range(40)), (0, 1, 2, 3)) for p in part.pci)


def test_2pa_pcidomain32bits() -> None:
    part = from_root("2pa-pcidomain32bits")
    assert node_cpus(part) == {0: (0, 1)}
    assert part.nodes[0].package is None
    by = pci_by_bdf(part)
    assert "10000:00:04.0" in by
    assert (by["10000:00:04.0"].cpuset, [o.name for o in by["10000:00:04.0"].os_devices]) == ((1,), ["vda"])
    gpu = by["0000:00:02.0"]
    assert gpu.cpuset == (0,)
    assert {(o.name, o.kind) for o in gpu.os_devices} == {("card0", "gpu"), ("controlD64", "gpu")}
    loc = osdev_locality(part)
    assert by[loc["ens3"][0]].cpuset == (0,)
    assert by[loc["sr0"][0]].cpuset == (0,)


@pytest.mark.parametrize("test", ["16amd64-8n2c-cpusets", "16amd64-8n2c-cpusets-disallowed"])
def test_16amd64_cpusets_whole_machine_with_allowed_sets(test: str) -> None:
    part = from_root("16amd64-8n2c-cpusets", test)
    assert len(part.nodes) == 8
    assert 4 not in part.pus
    assert part.allowed_cpus == cpus("0-3,5-6,12-15")
    assert part.allowed_nodes == (1, 2, 3, 4)
    assert node_cpus(part)[2] == (5,)
    assert node_cpus(part)[4] == (8, 9)
    assert part.info["LinuxCgroup"] == "/dummy"


def test_32amd64_cgroup2() -> None:
    part = from_root("32amd64-4s2n4c-cgroup2", "32amd64-4s2n4c-cgroup2")
    assert part.allowed_cpus == cpus("0-5")
    assert part.allowed_nodes == cpus("0-5")
    assert node_cpus(part)[0] == (0, 1, 2, 3)
    assert all(node_mem(part)[i] == 17179869184 for i in range(1, 8))
    assert set(numa_matrix(part).values()) == {10, 16, 22}
    assert part.info["LinuxCgroup"] == "/uid_2008/job_15389/step_0"


def test_offline_cpu0_node0() -> None:
    part = from_root("offline-cpu0-node0")
    assert node_cpus(part) == {1: cpus("5,7,9,11,13,15,17,19")}
    assert 0 not in part.pus
    # "7 processors not represented: 0x00e0000f" is CPUs 0-3 and 21-23 (INDEX's prose says 0-4).
    assert not set(cpus("0-3,21-23")) & set(part.pus)
    assert part.pus == cpus("4-20")
    pkg0 = next(p for p in part.packages if p.os_index == 0)
    assert pkg0.cpus and all(n.package != 0 for n in part.nodes)


# ---- XML exports -------------------------------------------------------------------------------------
def test_8intel64_memattrs() -> None:
    part = from_xml("8intel64-4n2t-memattrs.xml")
    assert node_cpus(part) == {i: (2 * i, 2 * i + 1) for i in range(4)}
    assert memattr(part, "Bandwidth") == {(1, 20, tuple(range(8)))}
    assert memattr(part, "foobar") == {
        (0, 2345, "PU#7"), (0, 10, (0, 1)), (1, 20, (0, 1)), (2, 30, (0, 1)), (2, 123, (0, 4)),
        (3, 40, (0, 1)), (3, 2345, (0, 4)), (3, 23456, (1, 4)), (3, 23456, "Group#2"),
        (3, 789, "NUMANode#2")}
    assert memattr(part, "barnoinit") == {(0, 10, None), (1, 2345, None), (2, 23456, None), (3, 2345, None)}
    assert memattr(part, "coincoin") == set()
    assert not {v.attribute for v in part.memattrs} & {"Capacity", "Locality"}


def test_64intel64_heteromem_tiers_with_refresh() -> None:
    part = from_xml("64intel64-heteromem.xml")
    st = subtypes(part)
    assert all(st[i] == "DRAM" for i in range(4))
    assert all(st[i] == "HBM" for i in (4, 5, 6, 7))
    assert all(node_mem(part)[i] == 1 << 30 for i in range(4))
    assert all(node_mem(part)[i] == 2 << 30 for i in range(4, 8))
    pairs = {0: 7, 1: 4, 2: 5, 3: 6}
    c = node_cpus(part)
    for dram, hbm in pairs.items():
        assert c[dram] == c[hbm]
        assert c[dram][:4] == tuple(range(4 * dram, 4 * dram + 4))
        assert memattr(part, "Bandwidth") >= {(dram, 22500, c[dram]), (hbm, 90000, c[hbm])}
    assert c[0] == cpus("0-3,16-19,32-35,48-51")
    t = tiers(part)
    assert all(t[i] == 1 for i in range(4)) and all(t[i] == 0 for i in range(4, 8))
    assert part.memory_tiers_nr == 2


@pytest.mark.parametrize("name", ["cxlmem+dax.v3.xml", "cxlmem+dax.v2.xml"])
def test_cxlmem_os_devices(name: str) -> None:
    part = from_xml(name)
    cxl = {o.name: (p.bdf, dict(o.info)) for p in part.pci for o in p.os_devices if o.subtype == "CXLMem"}
    assert cxl == {
        "mem2": ("0000:11:00.0", {"CXLRAMSize": "262144KiB"}),
        "mem0": ("0000:12:00.0", {"CXLPMEMSize": "262144KiB"}),
        "mem3": ("0000:15:00.0", {"CXLRAMSize": "262144KiB"}),
        "mem1": ("0000:16:00.0", {"CXLRAMSize": "262144KiB", "CXLPMEMSize": "262144KiB"}),
    }
    assert all(o.kind == "memory" for p in part.pci for o in p.os_devices if o.subtype == "CXLMem")
    assert all(p.cpuset == (0, 1, 2, 3) for p in part.pci)
    (dax,) = [o for o in part.other_os_devices if o.name == "dax0.0"]
    assert (dax.subtype, dax.info["Size"], dax.info["DAXParent"]) == ("SPM", "1048576KiB", "hmem.0")
    assert [n.subtype for n in part.nodes] == [""]


def test_heteromem_cxl_dram_node() -> None:
    part = from_xml("heteromem.xml")
    assert subtypes(part) == {0: "DRAM", 1: "HBM", 2: "DRAM", 3: "HBM", 4: "CXL-DRAM"}
    assert node_cpus(part) == {0: cpus("0-3"), 1: cpus("0-3"), 2: cpus("4-7"), 3: cpus("4-7"), 4: cpus("0-7")}
    assert {n.os_index: n.package for n in part.nodes} == {0: 0, 1: 0, 2: 1, 3: 1, 4: None}
    assert part.memattrs == () and part.distances == ()
    # No bandwidth data, so even a refresh yields no tiers: consumers fall back to subtypes.
    assert all(t is None for t in tiers(part).values())


def test_nvidia_dgx2_gpus() -> None:
    part = from_xml("nvidiaDGX2.xml")
    assert node_cpus(part) == {0: (0, 1), 1: (24, 25)}
    loc = osdev_locality(part)
    n0 = ["34", "36", "39", "3b", "57", "59", "5c", "5e"]
    n1 = ["b7", "b9", "bc", "be", "e0", "e2", "e5", "e7"]
    assert [loc[f"nvml{i}"] for i in range(8)] == [(f"0000:{b}:00.0", (0,)) for b in n0]
    assert [loc[f"nvml{i}"] for i in range(8, 16)] == [(f"0000:{b}:00.0", (1,)) for b in n1]
    gpus = [o for p in part.pci for o in p.os_devices if o.kind == "gpu"]
    assert len(gpus) == 16
    assert all(o.info["NVIDIAUUID"].startswith("GPU-") for o in gpus)
    assert all(o.info["GPUModel"] == "Tesla V100-SXM3-32GB-H" for o in gpus)
    assert sum(p.subtype == "NVSwitch" for p in part.pci) == 12
    # NVLinkBandwidth is over GPUs and NVSwitches, not NUMA nodes: only NUMALatency is kept.
    assert [d.name for d in part.distances] == ["NUMALatency"]
    assert numa_matrix(part) == {(0, 0): 10, (0, 1): 21, (1, 0): 21, (1, 1): 10}


def test_power8_gpus() -> None:
    part = from_xml("power8gpudistances.xml")
    loc = osdev_locality(part)
    gpus = {p.bdf: p.nodeset for p in part.pci if any(o.kind == "gpu" for o in p.os_devices)}
    assert gpus == {"0002:01:00.0": (0,), "0003:01:00.0": (0,), "000a:01:00.0": (1,), "000b:01:00.0": (1,)}
    assert pci_by_bdf(part)["0002:01:00.0"].cpuset == cpus("0-1,8-9,16-17,24-25")
    assert loc["cuda0"][1] == (0,)
    assert [d.name for d in part.distances] == ["NUMALatency"]


def test_32em64t_wholeio_gpus() -> None:
    part = from_xml("32em64t-2n8c2t-pci-wholeio.xml")
    loc = osdev_locality(part)
    assert loc["cuda0"] == loc["card0"] == ("0000:84:00.0", (1,))
    assert loc["opencl0d1"] == ("0000:84:00.1", (1,))
    (ocl,) = [o for p in part.pci for o in p.os_devices if o.name == "opencl0d1"]
    assert ocl.kind == "gpu" and "Radeon" in ocl.info["GPUModel"]
    for name in ("ib0", "mlx5_0", "eth0", "eth1", "dma2chan0", "dma2chan1"):
        assert loc[name][1] == (1,), name
    assert loc["sda"][1] == (0,)
    # Three 10de:1094 (Tesla M2075) functions; the hand-assembled XML hangs cuda0 off one of them.
    m2075 = [p for p in part.pci if (p.vendor_id, p.device_id) == (0x10DE, 0x1094)]
    assert len(m2075) == 3
    assert sum(not p.os_devices for p in m2075) == 2


def test_16amd64_4distances_keeps_numa_matrix_only() -> None:
    part = from_xml("16amd64-4distances.xml")
    assert [n.os_index for n in part.nodes] == [1, 0, 2, 5, 4, 3, 6, 7]
    assert node_cpus(part)[1] == (0, 1) and node_cpus(part)[0] == (2, 3)
    (latency,) = part.distances
    assert latency.nodes == (1, 0, 2, 5, 4, 3, 6, 7)
    assert all(v == (10 if a == b else 20) for (a, b), v in numa_matrix(part).items())


def test_192em64t_uv2000() -> None:
    part = from_xml("192em64t-24n8c2t.xml")
    assert node_cpus(part) == {i: tuple(range(8 * i, 8 * i + 8)) + tuple(range(192 + 8 * i, 200 + 8 * i))
                               for i in range(24)}
    assert set(numa_matrix(part).values()) == {10, 50, 65, 79}
    loc = osdev_locality(part)
    assert loc["eth0"] == ("0000:01:00.0", (0,)) and loc["eth1"] == ("0000:01:00.1", (0,))
    assert loc["sda"] == loc["sdb"] == ("0001:02:00.0", (1,))
    assert all(loc[f"eth{i}"][1] == (4,) and loc[f"eth{i}"][0].startswith("0002:0") for i in range(2, 6))
    assert loc["ib0"] == loc["mlx4_0"] == ("0003:01:00.0", (6,))


def test_16intel64_many_vfs() -> None:
    part = from_xml("16intel64-manyVFs.xml")
    assert len(part.pci) == 18
    loc = osdev_locality(part)
    for name in ("eth0", "eth1", "eth4", "usnic_0", "eth5", "usnic_1"):
        assert loc[name][1] == (0,), name
    for name in ("eth6", "usnic_2", "eth7"):
        assert loc[name][1] == (1,), name
    assert loc["usnic_0"][0] == "0000:0b:00.0" and loc["usnic_2"][0] == "0000:88:00.0"


# ---- lab captures (numa-vm) --------------------------------------------------------------------------
lab = pytest.mark.lab_capture


@lab
def test_lab_single() -> None:
    part = from_lab("single")
    assert len(part.packages) == 1
    assert [(n.os_index, n.subtype) for n in part.nodes] == [(0, "")]
    assert not [v for v in part.memattrs if v.attribute in ("Bandwidth", "Latency")]


@lab
@pytest.mark.parametrize("profile", ["dual-socket-cxl", "dual-socket-cxl-tiered", "dual-socket-tiered"])
def test_lab_dual_socket(profile: str) -> None:
    part = from_lab(profile)
    assert [(p.os_index, p.cpus) for p in part.packages] == [(0, (0, 1)), (1, (2, 3))]
    pkg = {n.os_index: n.package for n in part.nodes}
    assert (pkg[0], pkg[2], pkg[1]) == (0, 0, 1)
    assert memattr(part, "Bandwidth") == {(0, 20480, (0, 1)), (2, 10240, (0, 1)), (1, 20480, (2, 3))}
    assert memattr(part, "Latency") == {(0, 100, (0, 1)), (2, 250, (0, 1)), (1, 100, (2, 3))}
    by = pci_by_bdf(part)
    for bdf in ("0000:21:00.0", "0000:22:00.0"):
        assert (by[bdf].cpuset, by[bdf].nodeset) == ((0, 1), (0, 2))
    for bdf in ("0000:41:00.0", "0000:42:00.0", "0000:61:00.0"):
        assert by[bdf].cpuset == (2, 3)
    names = {o.name for p in part.pci for o in p.os_devices}
    assert names >= {"eth0", "eth1", "nvme0n1", "nvme1n1", "mem0"}
    (mem0,) = by["0000:61:00.0"].os_devices
    assert (mem0.name, mem0.subtype, mem0.kind) == ("mem0", "CXLMem", "memory")
    st = subtypes(part)
    if profile == "dual-socket-cxl":
        assert st == {0: "", 1: "", 2: ""}
    elif profile == "dual-socket-cxl-tiered":
        assert st == {0: "", 1: "", 2: "", 3: "CXL-NVM"}
        assert node_cpus(part)[3] == ()
    else:
        assert st == {0: "", 1: "", 2: "NVM"}


# ---- bad inputs, environment, live host -----------------------------------------------------------
def test_garbage_xml_is_unavailable(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.xml"
    bad.write_text("this is <not xml")
    result = hwloc.probe(ProbeContext.at_root("/nonexistent", hwloc_xml=bad))
    assert result.status.state is not State.OK
    assert result.status.reasons
    assert result.data.nodes == ()


def test_missing_xml_is_unavailable(tmp_path: Path) -> None:
    result = hwloc.probe(ProbeContext.at_root("/nonexistent", hwloc_xml=tmp_path / "absent.xml"))
    assert result.status.state is State.UNAVAILABLE


def test_nonexistent_root_is_unavailable(tmp_path: Path) -> None:
    result = hwloc.probe(ProbeContext.at_root(tmp_path / "does-not-exist"))
    assert result.status.state is State.UNAVAILABLE
    assert "does-not-exist" in result.status.reasons[0]


def test_empty_root_does_not_raise(tmp_path: Path) -> None:
    result = hwloc.probe(ProbeContext.at_root(tmp_path))
    assert result.status.source == hwloc.SOURCE


def test_import_failure_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> hwloc._Api:
        raise ImportError("no pyhwloc here")

    monkeypatch.setattr(hwloc, "_api", boom)
    result = hwloc.probe(ProbeContext.at_root(hwloc_root("2arm-2c")))
    assert result.status.state is State.UNAVAILABLE
    assert "no pyhwloc here" in result.status.reasons[0]


def test_environment_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HWLOC_COMPONENTS", "sentinel")
    monkeypatch.delenv("HWLOC_FSROOT", raising=False)
    monkeypatch.delenv("HWLOC_KEEP_NVIDIA_GPU_NUMA_NODES", raising=False)
    env = hwloc_test_env("nvidiagpunumanodes-kept")
    result = hwloc.probe(ProbeContext.at_root(hwloc_root("nvidiagpunumanodes"), hwloc_env=env))
    assert len(result.data.nodes) == 8
    assert os.environ["HWLOC_COMPONENTS"] == "sentinel"
    assert "HWLOC_FSROOT" not in os.environ
    assert "HWLOC_KEEP_NVIDIA_GPU_NUMA_NODES" not in os.environ


def test_concurrent_probes_keep_their_own_environment() -> None:
    cases: list[tuple[str, Mapping[str, str], int]] = [
        ("nvidiagpunumanodes", hwloc_test_env("nvidiagpunumanodes-kept"), 8),
        ("nvidiagpunumanodes", {}, 2),
        ("16amd64-8n2c", {}, 8),
    ] * 4
    errors: list[str] = []

    def run(root: str, env: Mapping[str, str], expected: int) -> None:
        got = len(hwloc.probe(ProbeContext.at_root(hwloc_root(root), hwloc_env=env)).data.nodes)
        if got != expected:
            errors.append(f"{root} {dict(env)}: {got} nodes, expected {expected}")

    for root, _, _ in cases:
        hwloc_root(root)  # extract before racing
    threads = [threading.Thread(target=run, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_live_host() -> None:
    result = hwloc.probe(ProbeContext.live())
    assert result.status.state is State.OK, result.status
    part = result.data
    assert len(part.nodes) == 1
    assert set(os.sched_getaffinity(0)) <= set(part.pus)
    assert len(part.pus) == os.cpu_count()
    assert part.nodes[0].local_memory > 0
    assert part.version.startswith("3.")


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_every_loaded_topology_is_freed() -> None:
    """A topology never freed would grow the process by ~70 KiB a probe here (~14 MiB over these
    200); one freed stays flat."""
    ctx = ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml")
    for _ in range(20):  # the library's version topology, lru caches, malloc's arenas
        hwloc.probe(ctx)
    before = _resident_bytes()
    for _ in range(200):
        assert hwloc.probe(ctx).status.state == State.OK
    assert _resident_bytes() - before < 3 * 2**20


def test_a_failed_extraction_still_frees_its_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml")
    hwloc.probe(ctx)
    destroyed: list[object] = []
    real = hwloc._destroy

    def counting(api: object, hdl: object) -> None:
        destroyed.append(hdl)
        real(api, hdl)  # type: ignore[arg-type]

    def broken(*args: object) -> object:
        raise RuntimeError("bug")

    monkeypatch.setattr(hwloc, "_destroy", counting)
    monkeypatch.setattr(hwloc, "_extract", broken)
    res = hwloc.probe(ctx)
    assert res.status.state is State.UNAVAILABLE and "extraction failed" in res.status.reasons[0]
    assert len(destroyed) == 1


def _recording_destroy(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """Records every topology free from here on; the library's version topology (made and freed
    once per process, on the first probe) is made before."""
    hwloc._library_version(hwloc._api())
    real = hwloc._destroy

    def recording(api: object, hdl: object) -> None:
        events.append("destroy")
        real(api, hdl)  # type: ignore[arg-type]

    monkeypatch.setattr(hwloc, "_destroy", recording)


def _spy_order(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from memtopo.discovery import discover as discover_mod
    from memtopo.discovery.assemble import assemble as real_assemble
    from memtopo.discovery.fingerprint import fingerprint as real_fingerprint

    events: list[str] = []
    _recording_destroy(monkeypatch, events)

    def assemble(*args: Any, **kw: Any) -> Any:
        events.append("assemble")
        return real_assemble(*args, **kw)

    def fingerprint(topo: Any) -> str:
        events.append("fingerprint")
        return real_fingerprint(topo)

    monkeypatch.setattr(discover_mod, "assemble", assemble)
    monkeypatch.setattr(discover_mod, "fingerprint", fingerprint)
    return events


def test_in_a_live_discovery_the_topology_is_freed_after_the_message_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from memtopo.discovery import discover as discover_mod

    events = _spy_order(monkeypatch)
    topo = discover_mod.discover(ProbeContext.live())
    assert events == ["assemble", "fingerprint", "destroy"]
    assert topo.domains and topo.fingerprint


@pytest.mark.parametrize("ctx", [
    pytest.param(lambda: ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml"), id="xml"),
    pytest.param(lambda: ProbeContext.at_root(hwloc_root("nvidiagpunumanodes")), id="fsroot"),
])
def test_a_plugin_free_topology_is_freed_before_the_assembly(monkeypatch: pytest.MonkeyPatch,
                                                             ctx: Any) -> None:
    from memtopo.discovery import discover as discover_mod

    events = _spy_order(monkeypatch)
    topo = discover_mod.discover(ctx())
    assert events == ["destroy", "assemble", "fingerprint"]
    assert topo.pci_devices and topo.fingerprint


def test_a_discovery_whose_assembly_fails_still_frees_its_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    from memtopo.discovery import discover as discover_mod

    events: list[str] = []
    _recording_destroy(monkeypatch, events)

    def broken(*args: object, **kw: object) -> object:
        raise RuntimeError("bug")

    monkeypatch.setattr(discover_mod, "assemble", broken)
    with pytest.raises(RuntimeError, match="bug"):
        discover_mod.discover(ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml"))
    assert events == ["destroy"]


def test_a_probe_outside_a_discovery_frees_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    _recording_destroy(monkeypatch, events)
    assert hwloc.probe(ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml")).status.state is State.OK
    assert events == ["destroy"]


def test_scope_runs_every_deferred_release_newest_first_even_when_one_raises() -> None:
    from memtopo.discovery.source import DiscoveryScope

    ran: list[str] = []

    def failing() -> None:
        ran.append("failing")
        raise OSError("release failed")

    scope = DiscoveryScope()
    scope.defer(lambda: ran.append("first"))
    scope.defer(failing)
    scope.defer(lambda: ran.append("last"))
    with pytest.raises(OSError, match="release failed"):
        scope.close()
    assert ran == ["last", "failing", "first"]
    scope.close()  # nothing left: a second close runs nothing
    assert ran == ["last", "failing", "first"]


def _mapped_plugins() -> set[str]:
    """hwloc plugins (hwloc_cuda, hwloc_pci ...) mapped into this process right now."""
    maps = Path("/proc/self/maps").read_text()
    return {line.rsplit("/", 1)[1].removesuffix(".so") for line in maps.splitlines()
            if "/hwloc/hwloc_" in line and line.endswith(".so")}


def _spy_plugins(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, set[str]]]:
    """(input kind, plugins mapped) at each extraction, while the probe's topology is alive."""
    seen: list[tuple[str, set[str]]] = []
    real = hwloc._extract_and_free

    def spy(api: Any, hdl: Any, version: str, src: Any, status: Any, release: Any) -> Any:
        seen.append((src.kind, _mapped_plugins()))
        return real(api, hdl, version, src, status, release)

    monkeypatch.setattr(hwloc, "_extract_and_free", spy)
    return seen


def test_only_a_live_load_loads_hwloc_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """An XML export or a captured root cannot use a plugin; this host's live load loads what it can
    (hwloc_pci and hwloc_cuda here: no libnvidia-ml, so hwloc_nvml does not load)."""
    seen = _spy_plugins(monkeypatch)
    assert hwloc.probe(ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml")).status.state is State.OK
    assert hwloc.probe(ProbeContext.at_root(hwloc_root("nvidiagpunumanodes"))).status.state is State.OK
    assert hwloc.probe(ProbeContext.live()).status.state is State.OK
    assert [kind for kind, _ in seen] == ["xml", "fsroot", "live"]
    assert seen[0][1] == seen[1][1] == set()
    assert seen[2][1] and seen[2][1] <= set(hwloc._api().plugin_blacklist.split(","))
    assert _mapped_plugins() == set()  # and the live topology's free unloaded them


@pytest.mark.parametrize("ctx", [
    pytest.param(lambda env: ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml", hwloc_env=env),
                 id="nvidiaDGX2.xml"),
    pytest.param(lambda env: ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "16intel64-manyVFs.xml",
                                                  hwloc_env=env), id="16intel64-manyVFs.xml"),
    pytest.param(lambda env: ProbeContext.at_root(hwloc_root("nvidiagpunumanodes"), hwloc_env=env),
                 id="nvidiagpunumanodes"),
    pytest.param(lambda env: ProbeContext.at_root(hwloc_root("32em64t-2n8c+dax+nvme+mic+dimms"), hwloc_env=env),
                 id="32em64t-dax-nvme-mic"),
])
def test_plugins_change_nothing_for_an_xml_or_a_captured_root(ctx: Any) -> None:
    """What the probe skips is what could not have contributed: the same part with every plugin loaded
    (an empty blacklist from the context's environment wins over the probe's)."""
    without = hwloc.probe(ctx({}))
    with_plugins = hwloc.probe(ctx({"HWLOC_PLUGINS_BLACKLIST": ""}))
    assert without.status.state is State.OK and without.data.pci
    assert without.data == with_plugins.data


def test_a_live_load_beside_plugin_free_ones_still_gets_its_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """hwloc loads plugins once per process while any topology lives: a live load that started while
    a plugin-free topology was alive would run without them (and lose NVML's GPUs)."""
    seen = _spy_plugins(monkeypatch)
    hwloc.probe(ProbeContext.live())
    host_plugins = seen[0][1]
    if not host_plugins:
        pytest.skip("no hwloc plugin loads on this host")
    xml = ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml")
    root = ProbeContext.at_root(hwloc_root("nvidiagpunumanodes"))
    contexts = [xml, ProbeContext.live(), root] * 6

    def run(ctx: ProbeContext) -> None:
        for _ in range(3):
            hwloc.probe(ctx)

    threads = [threading.Thread(target=run, args=(c,)) for c in contexts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    live = [plugins for kind, plugins in seen[1:] if kind == "live"]
    assert len(live) == 18 and all(plugins == host_plugins for plugins in live)
