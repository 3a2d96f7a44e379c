from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.discovery import sysfs_cxl
from memtopo.discovery.parts import DaxInfo, SysCxl
from memtopo.discovery.source import ProbeContext, ProbeResult, State
from memtopo.hostfs import HostFS, HostReadError
from tests.fixtures import HWLOC_XML, hwloc_root, lab_root
from tests.sysfs_tree import Dir, Link, write_tree


def run(root: Path) -> ProbeResult[SysCxl]:
    return sysfs_cxl.probe(ProbeContext.at_root(root))


def dax_by_name(result: ProbeResult[SysCxl]) -> dict[str, DaxInfo]:
    return {d.name: d for d in result.data.dax}


# ---- lab captures ----------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["dual-socket-cxl", "dual-socket-cxl-tiered", "dual-socket-tiered"])
def test_lab_memdev_and_root_decoder(profile: str) -> None:
    result = run(lab_root(profile))
    assert result.status.state is State.OK, result.status.reasons
    (mem,) = result.data.memdevs
    assert (mem.name, mem.pmem_size_bytes, mem.ram_size_bytes, mem.numa_node, mem.serial) == (
        "mem0", 0x20000000, 0, 1, 0)
    assert (mem.host, mem.host_bridge, mem.firmware_version) == ("0000:61:00.0", "pci0000:60", "BWFW VERSION 00")
    (ep,) = mem.decoders
    assert (ep.name, ep.kind) == ("decoder2.0", "endpoint")
    (root,) = result.data.root_decoders
    assert (root.name, root.kind, root.start, root.size) == ("decoder0.0", "root", 0x150000000, 0x100000000)
    assert (root.cap_pmem, root.cap_ram, root.targets, root.interleave_ways) == (True, True, ("96",), 1)


def test_lab_untiered_has_no_region_and_idle_endpoint_decoder() -> None:
    result = run(lab_root("dual-socket-cxl"))
    assert result.data.regions == () and result.data.dax == ()
    (ep,) = result.data.memdevs[0].decoders
    assert (ep.size, ep.mode, ep.region) == (0, "none", "")


def test_lab_cxl_tiered_region_and_dax() -> None:
    result = run(lab_root("dual-socket-cxl-tiered"))
    assert result.status.state is State.OK
    (region,) = result.data.regions
    assert (region.name, region.size_bytes, region.interleave_ways, region.interleave_granularity) == (
        "region0", 0x20000000, 1, 256)
    # Kernel 6.1 has no region mode file: pmem comes from the endpoint decoder.
    assert (region.targets, region.memdevs, region.committed, region.mode, region.root_decoder) == (
        ("decoder2.0",), ("mem0",), True, "pmem", "decoder0.0")
    (ep,) = result.data.memdevs[0].decoders
    assert (ep.mode, ep.region, ep.start, ep.size) == ("pmem", "region0", 0x150000000, 0x20000000)
    # The DAX device reaches region0 only through pmem_region0 → nvdimm bridge → nd region0.
    (dax,) = result.data.dax
    assert (dax.name, dax.target_node, dax.numa_node, dax.size_bytes, dax.mode) == (
        "dax0.0", 3, 0, 526385152, "system-ram")
    assert (dax.cxl_region, dax.parent_kind) == ("region0", "cxl")


def test_lab_e820_pmem_dax_is_not_cxl() -> None:
    result = run(lab_root("dual-socket-tiered"))
    assert result.data.regions == ()
    (dax,) = result.data.dax
    assert (dax.name, dax.target_node, dax.mode, dax.cxl_region, dax.parent_kind) == (
        "dax0.0", 2, "system-ram", "", "nvdimm")


def test_lab_single_has_empty_cxl_bus() -> None:
    result = run(lab_root("single"))
    assert result.status.state is State.OK
    assert result.data == SysCxl((), (), (), ())


# ---- hwloc fixtures (no CXL bus, DAX only) ------------------------------------------------------------

def test_hwloc_hmem_and_nvdimm_dax() -> None:
    result = run(hwloc_root("fakeheteromemtiers"))
    assert result.status.state is State.OK
    assert result.data.memdevs == () and result.data.regions == ()
    got = {d.name: (d.target_node, d.numa_node, d.mode, d.parent_kind) for d in result.data.dax}
    assert got == {
        "dax0.0": (3, 0, "devdax", "hmem"),
        "dax1.0": (4, 1, "system-ram", "hmem"),
        "dax2.0": (5, 1, "devdax", "hmem"),
        "dax3.0": (2, 2, "system-ram", "hmem"),
        "dax5.0": (6, 0, "system-ram", "nvdimm"),
        "dax6.0": (7, 2, "devdax", "nvdimm"),
        "dax7.0": (8, 0, "system-ram", "nvdimm"),
        "dax8.0": (9, 2, "system-ram", "nvdimm"),
    }
    assert all(d.cxl_region == "" for d in result.data.dax)


def test_hwloc_meminitiators_dax() -> None:
    result = run(hwloc_root("fakememinitiators-1np2c+1npp+gi"))
    assert result.status.state is State.OK
    assert [(d.name, d.target_node, d.numa_node, d.size_bytes) for d in result.data.dax] == [
        ("dax0.0", 7, 4, 799063146496), ("dax1.0", 10, 4, 799063146496)]


def test_hwloc_old_kernel_dax_without_numa_node() -> None:
    result = run(hwloc_root("32em64t-2n8c+dax+nvme+mic+dimms"))
    assert result.status.state is State.OK  # numa_node absent on that kernel: -1, not a problem
    assert [(d.name, d.target_node, d.numa_node, d.mode, d.parent_kind) for d in result.data.dax] == [
        ("dax0.0", 4, -1, "devdax", "nvdimm"),
        ("dax1.3", 5, -1, "devdax", "nvdimm"),
        ("dax1.4", 5, -1, "system-ram", "nvdimm"),
    ]


def test_no_cxl_bus_no_dax_is_unavailable() -> None:
    result = run(hwloc_root("16amd64-8n2c"))
    assert result.status.state is State.UNAVAILABLE
    assert result.status.reasons == ("no CXL bus",)


def test_hwloc_xml_input_is_unavailable() -> None:
    result = sysfs_cxl.probe(ProbeContext.at_root("/nonexistent", hwloc_xml=HWLOC_XML / "cxlmem+dax.v3.xml"))
    assert result.status.state is State.UNAVAILABLE
    assert result.status.reasons == ("input is an hwloc XML export",)


# ---- synthetic: a 2-way interleaved ram region (kernel ≥ 6.3 layout) -----------------------------------

ROOT = "sys/devices/platform/ACPI0017:00/root0"
BUS = "sys/bus/cxl/devices"


def memdev(n: int, bdf: str, hb: str) -> dict[str, str | Link | Dir]:
    real = f"sys/devices/{hb}/{hb[3:]}:00.0/{bdf}/mem{n}"
    return {
        f"{BUS}/mem{n}": Link(f"../../../devices/{hb}/{hb[3:]}:00.0/{bdf}/mem{n}"),
        f"{real}/serial": f"{n + 0xab:#x}",
        f"{real}/ram/size": "0x40000000",
        f"{real}/pmem/size": "0",
        f"{real}/numa_node": str(n),
        f"{real}/firmware_version": "fw1",
    }


def interleaved_tree(root: Path) -> Path:
    spec: dict[str, str | Link | Dir] = {}
    spec |= memdev(0, "0000:36:00.0", "pci0000:34")
    spec |= memdev(1, "0000:b6:00.0", "pci0000:b4")
    dec0 = f"{ROOT}/decoder0.0"
    region = f"{dec0}/region4"
    spec |= {
        f"{BUS}/root0": Link("../../../devices/platform/ACPI0017:00/root0"),
        f"{BUS}/port1": Link("../../../devices/platform/ACPI0017:00/root0/port1"),
        f"{BUS}/port2": Link("../../../devices/platform/ACPI0017:00/root0/port2"),
        f"{BUS}/decoder0.0": Link("../../../devices/platform/ACPI0017:00/root0/decoder0.0"),
        f"{BUS}/decoder1.0": Link("../../../devices/platform/ACPI0017:00/root0/port1/decoder1.0"),
        f"{dec0}/start": "0x1050000000",
        f"{dec0}/size": "0x800000000",
        f"{dec0}/interleave_ways": "2",
        f"{dec0}/interleave_granularity": "4096",
        f"{dec0}/target_list": "0,1",
        f"{dec0}/cap_ram": "1",
        f"{dec0}/cap_pmem": "0",
        f"{ROOT}/port1/decoder1.0/size": "0x80000000",
        f"{BUS}/region4": Link("../../../devices/platform/ACPI0017:00/root0/decoder0.0/region4"),
        f"{region}/size": "0x80000000",
        f"{region}/resource": "0x1050000000",
        f"{region}/interleave_ways": "2",
        f"{region}/interleave_granularity": "4096",
        f"{region}/mode": "ram",
        f"{region}/commit": "1",
        # position order differs from name order: memdevs must follow target0, target1
        f"{region}/target0": "decoder4.0",
        f"{region}/target1": "decoder3.0",
        f"{region}/dax_region4/dax4.0/target_node": "2",
        f"{region}/dax_region4/dax4.0/numa_node": "0",
        f"{region}/dax_region4/dax4.0/size": str(0x80000000),
        f"{region}/dax_region4/dax4.0/driver": Link("../../../../../../../../bus/dax/drivers/kmem"),
        "sys/bus/dax/drivers/kmem": Dir(),
        "sys/bus/dax/devices/dax4.0": Link(
            "../../../devices/platform/ACPI0017:00/root0/decoder0.0/region4/dax_region4/dax4.0"),
    }
    for port, ep, mem in ((1, 3, 0), (2, 4, 1)):
        ep_real = f"{ROOT}/port{port}/endpoint{ep}"
        hb = "pci0000:34" if mem == 0 else "pci0000:b4"
        bdf = "0000:36:00.0" if mem == 0 else "0000:b6:00.0"
        spec |= {
            f"{BUS}/endpoint{ep}": Link(f"../../../devices/platform/ACPI0017:00/root0/port{port}/endpoint{ep}"),
            f"{ep_real}/uport": Link(f"../../../../../{hb}/{hb[3:]}:00.0/{bdf}/mem{mem}"),
            f"{BUS}/decoder{ep}.0": Link(
                f"../../../devices/platform/ACPI0017:00/root0/port{port}/endpoint{ep}/decoder{ep}.0"),
            f"{ep_real}/decoder{ep}.0/start": "0x1050000000",
            f"{ep_real}/decoder{ep}.0/size": "0x40000000",
            f"{ep_real}/decoder{ep}.0/interleave_ways": "2",
            f"{ep_real}/decoder{ep}.0/interleave_granularity": "4096",
            f"{ep_real}/decoder{ep}.0/mode": "ram",
            f"{ep_real}/decoder{ep}.0/region": "region4",
        }
    return write_tree(root, spec)


def test_interleaved_ram_region(tmp_path: Path) -> None:
    result = run(interleaved_tree(tmp_path))
    assert result.status.state is State.OK, result.status.reasons
    (region,) = result.data.regions
    assert (region.targets, region.memdevs) == (("decoder4.0", "decoder3.0"), ("mem1", "mem0"))
    assert (region.size_bytes, region.resource, region.mode, region.interleave_ways) == (
        0x80000000, 0x1050000000, "ram", 2)
    assert region.root_decoder == "decoder0.0" and region.committed
    mem0, mem1 = result.data.memdevs
    assert (mem0.serial, mem0.ram_size_bytes, mem0.host, mem0.host_bridge) == (0xAB, 0x40000000, "0000:36:00.0",
                                                                                "pci0000:34")
    assert (mem1.numa_node, mem1.host_bridge) == (1, "pci0000:b4")
    assert [d.name for d in mem0.decoders] == ["decoder3.0"] and [d.name for d in mem1.decoders] == ["decoder4.0"]
    (root,) = result.data.root_decoders
    assert (root.targets, root.cap_ram, root.cap_pmem, root.interleave_granularity) == (("0", "1"), True, False, 4096)
    (dax,) = result.data.dax
    assert (dax.cxl_region, dax.parent_kind, dax.target_node, dax.mode) == ("region4", "cxl", 2, "system-ram")


def test_root_only_start_is_a_problem_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    interleaved_tree(tmp_path)
    real_open = HostFS._open

    def no_root(self: HostFS, rel: str, *rest: int) -> int:
        # Every read opens through _open: what it raises for EACCES as non-root.
        if rel.endswith("/start"):
            raise HostReadError(rel, "Permission denied")
        return real_open(self, rel, *rest)

    monkeypatch.setattr(HostFS, "_open", no_root)
    result = run(tmp_path)
    assert result.status.state is State.DEGRADED
    assert f"{BUS}/decoder0.0/start: Permission denied" in result.status.reasons
    (root,) = result.data.root_decoders
    assert (root.start, root.size) == (0, 0x800000000)
    assert result.data.regions[0].memdevs == ("mem1", "mem0")  # everything else still there


def test_dax_without_cxl_bus_is_ok(tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "sys/devices/platform/hmem.0/dax0.0/target_node": "2",
        "sys/devices/platform/hmem.0/dax0.0/numa_node": "0",
        "sys/devices/platform/hmem.0/dax0.0/size": "1073741824",
        "sys/bus/dax/devices/dax0.0": Link("../../../devices/platform/hmem.0/dax0.0"),
    })
    result = run(tmp_path)
    assert result.status.state is State.OK
    assert result.data.dax == (DaxInfo("dax0.0", 2, 0, 1 << 30, "", "", "hmem"),)


def test_region_target_without_endpoint_is_reported(tmp_path: Path) -> None:
    interleaved_tree(tmp_path)
    (tmp_path / f"{ROOT}/decoder0.0/region4/target1").write_text("decoder9.0\n")
    result = run(tmp_path)
    assert result.status.state is State.DEGRADED
    assert result.data.regions[0].memdevs == ("mem1", "")
    assert any("region4" in r and "decoder9.0" in r for r in result.status.reasons)


# ---- properties ------------------------------------------------------------------------------------

HEX_FILES = {  # %#llx files, read with base 0
    "mem_serial": "sys/devices/pci0000:34/0000:34:00.0/0000:36:00.0/mem0/serial",
    "mem_ram": "sys/devices/pci0000:34/0000:34:00.0/0000:36:00.0/mem0/ram/size",
    "region_size": f"{ROOT}/decoder0.0/region4/size",
    "root_size": f"{ROOT}/decoder0.0/size",
}
BUS_PATH = {
    "mem_serial": f"{BUS}/mem0/serial",
    "mem_ram": f"{BUS}/mem0/ram/size",
    "region_size": f"{BUS}/region4/size",
    "root_size": f"{BUS}/decoder0.0/size",
    "dax_size": "sys/bus/dax/devices/dax4.0/size",
}
garbage = st.one_of(st.binary(max_size=40), st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")))


def _parses(key: str, data: bytes) -> bool:
    try:
        # HostFS.read_attr tolerates NUL padding
        int(data.decode("utf-8").strip().strip("\0").strip(), 10 if key == "dax_size" else 0)
    except (UnicodeDecodeError, ValueError):
        return False
    return True


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(BUS_PATH)), data=garbage)
def test_garbage_cxl_numbers_never_raise(key: str, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = interleaved_tree(Path(tmp))
        real = HEX_FILES.get(key, f"{ROOT}/decoder0.0/region4/dax_region4/dax4.0/size")
        (root / real).write_bytes(data)
        result = run(root)
        assert len(result.data.memdevs) == 2 and len(result.data.regions) == 1 and len(result.data.dax) == 1
        if _parses(key, data):
            return
        assert result.status.state is State.DEGRADED
        assert any(BUS_PATH[key] in r for r in result.status.reasons), result.status.reasons
