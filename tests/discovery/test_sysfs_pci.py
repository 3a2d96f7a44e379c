from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.cpulist import parse_cpulist
from memtopo.discovery import sysfs_pci
from memtopo.discovery.parts import PciInfo, SysPci
from memtopo.discovery.pci_ids import classify
from memtopo.discovery.source import ProbeContext, ProbeResult, State
from memtopo.pci import parse_bdf
from tests.fixtures import HWLOC_XML, hwloc_root, lab_root
from tests.sysfs_tree import Dir, Link, write_tree


def run(root: Path) -> ProbeResult[SysPci]:
    return sysfs_pci.probe(ProbeContext.at_root(root))


def by_bdf(result: ProbeResult[SysPci]) -> dict[str, PciInfo]:
    return {d.bdf: d for d in result.data.devices}


# ---- lab captures (README "Profiles") ---------------------------------------------------------------

def proc_interrupt_actions(root: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in (root / "proc/interrupts").read_text().splitlines()[1:]:
        head, _, rest = line.partition(":")
        if head.strip().isdigit() and rest.split():
            out[int(head)] = rest.split()[-1]
    return out


DUAL_PCI = {
    # bdf: (numa_node, local cpus, vendor, device, class, os devices)
    "0000:20:00.0": (0, (0, 1), 0x1B36, 0x000C, 0x060400, ()),
    "0000:20:01.0": (0, (0, 1), 0x1B36, 0x000C, 0x060400, ()),
    "0000:21:00.0": (0, (0, 1), 0x1AF4, 0x1041, 0x020000, ("eth0",)),
    "0000:22:00.0": (0, (0, 1), 0x1B36, 0x0010, 0x010802, ("nvme1", "nvme1n1")),
    "0000:40:00.0": (1, (2, 3), 0x1B36, 0x000C, 0x060400, ()),
    "0000:40:01.0": (1, (2, 3), 0x1B36, 0x000C, 0x060400, ()),
    "0000:41:00.0": (1, (2, 3), 0x8086, 0x10D3, 0x020000, ("eth1",)),
    "0000:42:00.0": (1, (2, 3), 0x1B36, 0x0010, 0x010802, ("nvme0", "nvme0n1")),
    "0000:60:00.0": (1, (2, 3), 0x8086, 0x7075, 0x060400, ()),
    "0000:61:00.0": (1, (2, 3), 0x8086, 0x0D93, 0x050210, ("mem0",)),
}
DUAL_ROOT_BUS = ["0000:00:00.0", "0000:00:01.0", "0000:00:02.0", "0000:00:03.0", "0000:00:10.0", "0000:00:11.0",
                 "0000:00:1f.0", "0000:00:1f.2", "0000:00:1f.3"]


@pytest.mark.parametrize("profile", ["dual-socket-cxl", "dual-socket-cxl-tiered", "dual-socket-tiered"])
def test_lab_dual_socket_pci_table(profile: str) -> None:
    result = run(lab_root(profile))
    assert result.status.state is State.OK, result.status.reasons
    devs = by_bdf(result)
    assert list(devs) == DUAL_ROOT_BUS + sorted(DUAL_PCI)
    for bdf in DUAL_ROOT_BUS:
        assert devs[bdf].numa_node == -1 and not devs[bdf].numa_node_inherited
        assert devs[bdf].local_cpus == (0, 1, 2, 3)
    for bdf, (node, cpus, vendor, device, cls, osdevs) in DUAL_PCI.items():
        d = devs[bdf]
        assert (d.numa_node, d.local_cpus, d.vendor_id, d.device_id, d.class_code, d.os_devices) == (
            node, cpus, vendor, device, cls, osdevs), bdf
    cxl = devs["0000:61:00.0"]
    assert classify(cxl.vendor_id, cxl.device_id, cxl.class_code) == "cxl_memory"
    assert cxl.driver == "cxl_pci"
    nvme = devs["0000:22:00.0"]
    assert classify(nvme.vendor_id, nvme.device_id, nvme.class_code) == "nvme"
    assert nvme.driver == "nvme"
    # msi_irqs must be exactly the vectors /proc/interrupts names after the device's queues.
    actions = proc_interrupt_actions(lab_root(profile))
    for bdf in ("0000:22:00.0", "0000:42:00.0"):
        ctrl = devs[bdf].os_devices[0]
        assert devs[bdf].msi_irqs == tuple(sorted(i for i, a in actions.items() if a.startswith(f"{ctrl}q")))
    for bdf in ("0000:21:00.0", "0000:00:01.0", "0000:00:02.0", "0000:00:03.0"):
        assert devs[bdf].msi_irqs, bdf
        assert all(actions[i].startswith("virtio") for i in devs[bdf].msi_irqs), bdf
    assert devs["0000:41:00.0"].driver == "e1000e"
    # PCIe link attributes on the root ports and endpoints; absent on the conventional root bus.
    assert (nvme.link_speed, nvme.link_width, nvme.max_link_speed) == ("2.5 GT/s PCIe", 1, "2.5 GT/s PCIe")
    assert devs["0000:20:00.0"].max_link_speed == "16.0 GT/s PCIe"
    assert (devs["0000:00:01.0"].link_speed, devs["0000:00:01.0"].link_width) == ("", 0)


def test_lab_single() -> None:
    result = run(lab_root("single"))
    assert result.status.state is State.OK
    devs = by_bdf(result)
    assert list(devs) == ["0000:00:00.0", "0000:00:01.0", "0000:00:02.0", "0000:00:03.0", "0000:00:05.0",
                          "0000:00:06.0", "0000:00:1f.0", "0000:00:1f.2", "0000:00:1f.3"]
    assert all(d.numa_node == -1 and d.local_cpus == (0, 1) for d in devs.values())
    net, nvme = devs["0000:00:05.0"], devs["0000:00:06.0"]
    assert (net.vendor_id, net.device_id, net.os_devices) == (0x1AF4, 0x1000, ("eth0",))
    assert (nvme.vendor_id, nvme.device_id, nvme.class_code) == (0x1B36, 0x0010, 0x010802)
    assert nvme.os_devices == ("nvme0", "nvme0n1")
    assert net.msi_irqs and nvme.msi_irqs


# ---- hwloc fixtures --------------------------------------------------------------------------------

def test_hwloc_8ve_vector_engines_and_sriov_nics() -> None:
    result = run(hwloc_root("32intel64-2p8co2t+8ve"))
    assert result.status.state is State.OK
    devs = by_bdf(result)
    ves = ["0000:1b:00.0", "0000:1c:00.0", "0000:1d:00.0", "0000:1e:00.0",
           "0000:3d:00.0", "0000:3f:00.0", "0000:40:00.0", "0000:41:00.0"]
    expected_cpus = (*range(0, 8), *range(16, 24))
    for i, bdf in enumerate(ves):
        d = devs[bdf]
        assert (d.numa_node, d.local_cpus, d.os_devices) == (0, expected_cpus, (f"ve{i}",)), bdf
        assert (d.vendor_id, d.class_code, d.driver) == (0x1BCF, 0x0B4000, "ve_drv")
        assert classify(d.vendor_id, d.device_id, d.class_code) == "accelerator"
        assert (d.link_speed, d.link_width) == ("8 GT/s", 16)
    for bdf in ("0000:60:00.0", "0000:60:00.1"):
        assert (devs[bdf].sriov_total_vfs, devs[bdf].sriov_num_vfs, devs[bdf].virtfns) == (64, 0, ())
    assert devs["0000:60:00.0"].os_devices == ("enp96s0f0",)


def test_hwloc_dax_nvme_mic() -> None:
    result = run(hwloc_root("32em64t-2n8c+dax+nvme+mic+dimms"))
    assert result.status.state is State.OK
    devs = by_bdf(result)
    assert len(devs) == 137
    eth0, ib = devs["0000:02:00.0"], devs["0000:82:00.0"]
    assert (eth0.numa_node, eth0.os_devices, eth0.driver) == (0, ("eth0",), "igb")
    assert (ib.numa_node, ib.os_devices, ib.driver) == (1, ("ib0", "mlx4_0"), "mlx4_core")
    assert ib.local_cpus == (8, 9, 10, 11, 12, 13, 14, 15)
    # Old kernel layout: the NVMe namespace sits in block/ directly under the function.
    nvme = devs["0000:00:02.0"]
    assert (nvme.os_devices, nvme.numa_node, nvme.local_cpus) == (("nvme0n1",), -1, (0, 1, 2, 3))
    assert classify(nvme.vendor_id, nvme.device_id, nvme.class_code) == "nvme"
    mic = devs["0000:83:00.0"]
    assert classify(mic.vendor_id, mic.device_id, mic.class_code) == "accelerator"


def test_hwloc_32bit_pci_domain() -> None:
    result = run(hwloc_root("2pa-pcidomain32bits"))
    assert result.status.state is State.OK
    bdfs = [d.bdf for d in result.data.devices]
    # Domain 0x10000 sorts numerically after domain 0, not as a string.
    assert bdfs[-2:] == ["10000:00:00.0", "10000:00:04.0"]
    vmd = by_bdf(result)["10000:00:04.0"]
    assert (vmd.vendor_id, vmd.device_id, vmd.os_devices, vmd.msi_irqs) == (0x1AF4, 0x1001, ("vda",), (27, 28))
    assert by_bdf(result)["0000:00:02.0"].os_devices == ("card0", "controlD64")


def test_hwloc_nvidia_gpus_from_a_trimmed_dump() -> None:
    # This dump keeps only class and local_cpus: the GPUs still classify by class, missing vendor
    # ids are reported, and numa_node stays -1 (absent), never derived from local_cpus.
    result = run(hwloc_root("nvidiagpunumanodes"))
    assert result.status.state is State.DEGRADED
    assert "sys/bus/pci/devices/0004:05:00.0/vendor: missing" in result.status.reasons
    devs = by_bdf(result)
    assert list(devs) == ["0004:05:00.0", "0004:06:00.0", "0006:00:00.0", "0007:00:00.0",
                          "0035:04:00.0", "0035:05:00.0"]
    for bdf, d in devs.items():
        assert classify(d.vendor_id, d.device_id, d.class_code) == "gpu"
        assert d.numa_node == -1
        expected = tuple(range(16)) if bdf.startswith(("0004", "0006")) else tuple(range(88, 104))
        assert d.local_cpus == expected, bdf


def test_hwloc_pcilocality_numa_node_as_reported() -> None:
    result = run(hwloc_root("40intel64-2g2n4c+pcilocality"))
    assert result.status.state is State.OK
    devs = by_bdf(result)
    assert len(devs) == 37
    # The kernel's numa_node is reported as is (HWLOC_PCI_LOCALITY is hwloc's override, not ours).
    qib = devs["0000:43:00.0"]
    assert (qib.numa_node, qib.os_devices, qib.local_cpus) == (2, ("ib0", "qib0"), tuple(range(40)))
    assert classify(qib.vendor_id, qib.device_id, qib.class_code) == "infiniband"
    assert [devs[f"0000:0{b}:00.{f}"].os_devices for b, f in ((2, 0), (2, 1), (3, 0), (3, 1))] == [
        ("eth0",), ("eth1",), ("eth2",), ("eth3",)]
    assert all(d.numa_node == -1 for b, d in devs.items() if b != "0000:43:00.0")


def test_hwloc_xml_input_is_unavailable() -> None:
    ctx = ProbeContext.at_root("/nonexistent", hwloc_xml=HWLOC_XML / "heteromem.xml")
    result = sysfs_pci.probe(ctx)
    assert result.status.state is State.UNAVAILABLE
    assert result.status.reasons == ("input is an hwloc XML export",)


def test_no_pci_bus_is_unavailable(tmp_path: Path) -> None:
    write_tree(tmp_path, {"sys/devices/system/node": Dir()})
    assert run(tmp_path).status.state is State.UNAVAILABLE


# ---- synthetic trees -------------------------------------------------------------------------------

def pci_dev(bdf: str, *, vendor: str = "0x15b3", device: str = "0x101b", cls: str = "0x020000",
            node: str = "0", cpulist: str = "0-3", parent: str = "pci0000:3a") -> dict[str, str | Link | Dir]:
    real = f"sys/devices/{parent}/{bdf}"
    return {
        f"sys/bus/pci/devices/{bdf}": Link(f"../../../devices/{parent}/{bdf}"),
        f"{real}/vendor": vendor,
        f"{real}/device": device,
        f"{real}/subsystem_vendor": "0x15b3",
        f"{real}/subsystem_device": "0x0007",
        f"{real}/class": cls,
        f"{real}/numa_node": node,
        f"{real}/local_cpulist": cpulist,
    }


PF, VF0, VF1 = "0000:3b:00.0", "0000:3b:00.2", "0000:3b:00.3"
PLAIN = "0000:5e:00.0"
UUID_PF = "4b20d080-1b54-4048-85b3-a6a62d165c01"
UUID_VF = "c3b2a1f0-0000-4000-8000-000000000002"


def sriov_tree(root: Path) -> Path:
    spec: dict[str, str | Link | Dir] = {}
    spec |= pci_dev(PF, node="1", cpulist="4-7")
    spec |= pci_dev(VF0, device="0x101c", node="-1", cpulist="0-7")
    spec |= pci_dev(VF1, device="0x101c", node="1", cpulist="4-7")
    spec |= pci_dev(PLAIN, vendor="0x10de", device="0x2330", cls="0x030200", node="-1", cpulist="0-7")
    pf = f"sys/devices/pci0000:3a/{PF}"
    spec |= {
        f"{pf}/sriov_totalvfs": "8",
        f"{pf}/sriov_numvfs": "2",
        # virtfn10 must sort after virtfn2: by number, not by name.
        f"{pf}/virtfn1": Link(f"../{VF1}"),
        f"{pf}/virtfn0": Link(f"../{VF0}"),
        f"{pf}/driver": Link("../../../bus/pci/drivers/mlx5_core"),
        f"{pf}/msi_irqs/120": "msix",
        f"{pf}/msi_irqs/36": "msix",
        f"{pf}/msi_irqs/9": "msix",
        f"{pf}/net/ens1f0np0": Dir(),
        f"{pf}/infiniband/mlx5_0": Dir(),
        f"{pf}/current_link_speed": "Unknown",
        f"{pf}/max_link_speed": "16.0 GT/s PCIe",
        f"{pf}/current_link_width": "0",
        f"{pf}/max_link_width": "16",
        f"sys/devices/pci0000:3a/{VF0}/physfn": Link(f"../{PF}"),
        f"sys/devices/pci0000:3a/{VF1}/physfn": Link(f"../{PF}"),
        "sys/bus/pci/drivers/mlx5_core": Dir(),
        # mdev under the PF and under VF0 (whose numa_node is -1)
        f"{pf}/mdev_supported_types/mlx5_core-local": Dir(),
        f"{pf}/{UUID_PF}/mdev_type": Link("../mdev_supported_types/mlx5_core-local"),
        f"sys/bus/mdev/devices/{UUID_PF}": Link(f"../../../devices/pci0000:3a/{PF}/{UUID_PF}"),
        f"sys/devices/pci0000:3a/{VF0}/mdev_supported_types/nvidia-999": Dir(),
        f"sys/devices/pci0000:3a/{VF0}/{UUID_VF}/mdev_type": Link("../mdev_supported_types/nvidia-999"),
        f"sys/bus/mdev/devices/{UUID_VF}": Link(f"../../../devices/pci0000:3a/{VF0}/{UUID_VF}"),
    }
    return write_tree(root, spec)


def test_sriov_vf_inherits_pf_node_and_is_flagged(tmp_path: Path) -> None:
    result = run(sriov_tree(tmp_path))
    assert result.status.state is State.OK, result.status.reasons
    devs = by_bdf(result)
    pf, vf0, vf1 = devs[PF], devs[VF0], devs[VF1]
    assert (pf.virtfns, pf.sriov_total_vfs, pf.sriov_num_vfs, pf.physfn) == ((VF0, VF1), 8, 2, "")
    assert (vf0.physfn, vf0.numa_node, vf0.numa_node_inherited) == (PF, 1, True)
    assert (vf1.numa_node, vf1.numa_node_inherited) == (1, False)
    assert vf0.local_cpus == tuple(range(8))  # the kernel's value, not rewritten
    assert pf.msi_irqs == (9, 36, 120)
    assert pf.os_devices == ("ens1f0np0", "mlx5_0")
    assert pf.driver == "mlx5_core" and vf0.driver == ""
    assert (pf.link_speed, pf.link_width, pf.max_link_speed, pf.max_link_width) == ("", 0, "16.0 GT/s PCIe", 16)


def test_plain_device_minus_one_is_kept(tmp_path: Path) -> None:
    devs = by_bdf(run(sriov_tree(tmp_path)))
    plain = devs[PLAIN]
    assert (plain.numa_node, plain.numa_node_inherited) == (-1, False)
    assert classify(plain.vendor_id, plain.device_id, plain.class_code) == "gpu"


def test_mdevs_attach_to_parent_with_its_node(tmp_path: Path) -> None:
    devs = by_bdf(run(sriov_tree(tmp_path)))
    (on_pf,) = devs[PF].mdevs
    assert (on_pf.uuid, on_pf.mdev_type, on_pf.parent, on_pf.numa_node) == (UUID_PF, "mlx5_core-local", PF, 1)
    (on_vf,) = devs[VF0].mdevs
    # The VF says -1; the mdev falls back to the VF's PF, like the VF itself.
    assert (on_vf.uuid, on_vf.mdev_type, on_vf.parent, on_vf.numa_node) == (UUID_VF, "nvidia-999", VF0, 1)
    assert devs[VF1].mdevs == () and devs[PLAIN].mdevs == ()


def test_mdev_with_non_pci_parent_is_skipped(tmp_path: Path) -> None:
    sriov_tree(tmp_path)
    write_tree(tmp_path, {
        "sys/devices/vfio_ap/matrix/11111111-2222-3333-4444-555555555555/mdev_type": "x",
        "sys/bus/mdev/devices/11111111-2222-3333-4444-555555555555":
            Link("../../../devices/vfio_ap/matrix/11111111-2222-3333-4444-555555555555"),
    })
    result = run(tmp_path)
    assert result.status.state is State.OK
    assert sum(len(d.mdevs) for d in result.data.devices) == 2


def test_garbage_class_degrades_only_that_device(tmp_path: Path) -> None:
    sriov_tree(tmp_path)
    (tmp_path / f"sys/devices/pci0000:3a/{PLAIN}/class").write_text("0xzzzz\n")
    result = run(tmp_path)
    assert result.status.state is State.DEGRADED
    assert len(result.status.reasons) == 1
    assert f"sys/bus/pci/devices/{PLAIN}/class" in result.status.reasons[0]
    devs = by_bdf(result)
    assert devs[PLAIN].class_code == 0 and devs[PLAIN].vendor_id == 0x10DE
    assert devs[PF].class_code == 0x020000 and devs[VF0].numa_node == 1


def test_dangling_bus_symlink_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    sriov_tree(tmp_path)
    write_tree(tmp_path, {"sys/bus/pci/devices/0000:99:00.0": Link("../../../devices/pci0000:99/0000:99:00.0")})
    result = run(tmp_path)
    assert result.status.state is State.DEGRADED
    assert "sys/bus/pci/devices/0000:99:00.0: not a device directory (a dangling link, or empty)" \
        in result.status.reasons
    # Nothing is known of it (not even its vendor): it is not reported as a device.
    assert "0000:99:00.0" not in by_bdf(result)
    assert len(result.data.devices) == 4 and by_bdf(result)[PF].numa_node == 1


def test_msi_irqs_non_numeric_entry(tmp_path: Path) -> None:
    sriov_tree(tmp_path)
    write_tree(tmp_path, {f"sys/devices/pci0000:3a/{PF}/msi_irqs/bogus": "msix"})
    result = run(tmp_path)
    assert by_bdf(result)[PF].msi_irqs == (9, 36, 120)
    assert any("msi_irqs/bogus" in r for r in result.status.reasons)


def test_local_cpus_mask_fallback(tmp_path: Path) -> None:
    spec = pci_dev(PLAIN)
    del spec[f"sys/devices/pci0000:3a/{PLAIN}/local_cpulist"]
    spec[f"sys/devices/pci0000:3a/{PLAIN}/local_cpus"] = "00000000,000000f0"
    result = run(write_tree(tmp_path, spec))
    assert by_bdf(result)[PLAIN].local_cpus == (4, 5, 6, 7)


def test_non_bdf_entry_is_reported(tmp_path: Path) -> None:
    spec = pci_dev(PLAIN)
    spec["sys/bus/pci/devices/0000:5e:00.8"] = Dir()  # function 8 does not exist
    result = run(write_tree(tmp_path, spec))
    assert [d.bdf for d in result.data.devices] == [PLAIN]
    assert result.status.reasons == ("sys/bus/pci/devices/0000:5e:00.8: not a PCI address",)


@pytest.mark.parametrize(
    ("name", "key"),
    [("0000:00:1f.3", (0, 0, 0x1F, 3)), ("10000:e1:00.7", (0x10000, 0xE1, 0, 7)), ("0000:00:1f.8", None),
     ("000:00:1f.0", None), ("0000:0:1f.0", None), ("0000:00:1F.0", None), ("0000:00:1f", None), ("", None)],
)
def test_parse_bdf(name: str, key: tuple[int, int, int, int] | None) -> None:
    assert parse_bdf(name) == key


# ---- properties ------------------------------------------------------------------------------------

PCI_ATTRS = ["vendor", "device", "subsystem_vendor", "subsystem_device", "class", "numa_node", "local_cpulist",
             "current_link_width", "sriov_numvfs"]
garbage = st.one_of(st.binary(max_size=40), st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")))


HEX_ATTRS = frozenset({"vendor", "device", "subsystem_vendor", "subsystem_device", "class"})


def _parses(attr: str, data: bytes) -> bool:
    """The oracle: would a correct reader accept these bytes for this attribute?"""
    try:
        raw = data.decode("utf-8")
        text = raw.strip().strip("\0").strip()  # HostFS.read_attr tolerates NUL padding
        if attr in HEX_ATTRS:
            int(text, 16)
        elif attr == "local_cpulist":
            parse_cpulist(raw)
        elif attr == "numa_node":
            return int(text) >= -1
        else:
            int(text)
    except (UnicodeDecodeError, ValueError):
        return False
    return True


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attr=st.sampled_from(PCI_ATTRS), data=garbage)
def test_garbage_pci_attribute_never_raises(attr: str, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = sriov_tree(Path(tmp))
        (root / f"sys/devices/pci0000:3a/{PF}/{attr}").write_bytes(data)
        result = run(root)
        assert len(result.data.devices) == 4
        if _parses(attr, data):
            return
        assert result.status.state is State.DEGRADED
        assert any(f"sys/bus/pci/devices/{PF}/{attr}" in r for r in result.status.reasons)
        assert by_bdf(result)[VF1].numa_node == 1  # the others are untouched


def test_uevent_is_preferred_and_malformed_keys_fall_back(tmp_path: Path) -> None:
    spec = pci_dev(PLAIN, vendor="0x10de", device="0x2330", cls="0x030200")
    real = f"sys/devices/pci0000:3a/{PLAIN}"
    spec[f"{real}/uevent"] = ("DRIVER=nvidia\nPCI_CLASS=30200\nPCI_ID=10DE:ZZZZ\nPCI_SUBSYS_ID=10DE:1839\n"
                              f"PCI_SLOT_NAME={PLAIN}\n")
    result = run(write_tree(tmp_path, spec))
    (dev,) = result.data.devices
    # driver and subsystem ids come from uevent (no driver link, different subsystem files)
    assert (dev.driver, dev.subsystem_device_id, dev.class_code) == ("nvidia", 0x1839, 0x030200)
    # the malformed PCI_ID is reported and the vendor/device files fill in
    assert (dev.vendor_id, dev.device_id) == (0x10DE, 0x2330)
    assert result.status.reasons == (f"sys/bus/pci/devices/{PLAIN}/uevent: malformed PCI_ID='10DE:ZZZZ'",)
