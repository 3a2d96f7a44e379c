"""PCI functions from /sys/bus/pci/devices, with SR-IOV links, MSI vectors, OS devices and mdevs.

Each device directory is listed once and only the attributes it actually has are read: on a host
with hundreds of functions, opening absent files (link speed on conventional PCI, sriov_* on
non-PFs) would cost more than the reads themselves, and their absence is normal, not a problem.
"""

from __future__ import annotations

import dataclasses
import posixpath

from memtopo.discovery.parts import Ids, MdevInfo, PciInfo, SysPci
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.discovery.sysfs_read import PCI_DEVICES, AttrReader
from memtopo.hostfs import MAX_PCI_FUNCTIONS, HostDir, HostReadError, attr_value
from memtopo.pci import is_bdf, parse_bdf
from memtopo.text import excerpt

SOURCE = "sysfs.pci"

MDEV_DEVICES = "sys/bus/mdev/devices"


# Subdirectories whose children are the kernel's names for the device (eth0, mlx5_0, nvme0, card0,
# ve0, accel0); virtio functions put them one level down, under virtioN/.
_OS_DEVICE_DIRS = ("net", "infiniband", "nvme", "block", "drm", "ve", "accel")
_VIRTIO_OS_DEVICE_DIRS = ("net", "block")

_UNKNOWN_SPEEDS = frozenset({"unknown", "unknown speed"})


def probe(ctx: ProbeContext) -> ProbeResult[SysPci]:
    sb = StatusBuilder(SOURCE)
    if not ctx.sysfs_available:
        sb.unavailable("input is an hwloc XML export")
        return ProbeResult(SysPci(()), sb.finish())
    if not ctx.fs.is_dir(PCI_DEVICES):
        sb.unavailable(f"{PCI_DEVICES}: missing (no PCI bus)")
        return ProbeResult(SysPci(()), sb.finish())
    rd = AttrReader(ctx.fs, sb)
    found: list[tuple[tuple[int, int, int, int], str]] = []
    names = rd.listdir(PCI_DEVICES)
    if len(names) > MAX_PCI_FUNCTIONS:
        sb.problem(f"{PCI_DEVICES}: {len(names)} entries, more than any host has; read the first {MAX_PCI_FUNCTIONS}")
        names = names[:MAX_PCI_FUNCTIONS]
    for name in names:
        key = parse_bdf(name)
        if key is None:
            sb.problem(f"{PCI_DEVICES}/{name}: not a PCI address")
            continue
        found.append((key, name))
    found.sort()
    devices: dict[str, PciInfo] = {}
    try:
        bus = ctx.fs.open_dir(PCI_DEVICES)
    except HostReadError as exc:
        sb.unavailable(str(exc))
        return ProbeResult(SysPci(()), sb.finish())
    with bus:
        for _, name in found:
            try:
                if (dev := _device(rd, bus, name)) is not None:
                    devices[name] = dev
            except (HostReadError, ValueError, OSError) as exc:  # belt and braces: one device, not all
                sb.problem(f"{PCI_DEVICES}/{name}: {exc}")
    _inherit_vf_nodes(devices)
    _attach_mdevs(rd, devices)
    return ProbeResult(SysPci(tuple(devices.values())), sb.finish())


def _upstream(rd: AttrReader, bus: HostDir, bdf: str) -> tuple[str, ...]:
    """The device link's target names the root complex and every bridge above the device."""
    try:
        target = bus.readlink(bdf)
    except HostReadError:
        return ()  # a plain directory (some hand-made trees): no path, no PIX/PXB classes
    parts = target.split("/")
    try:
        start = next(i for i, p in enumerate(parts) if p.startswith("pci"))
    except StopIteration:
        return ()
    chain = parts[start:]
    return tuple(chain[:-1]) if chain and chain[-1] == bdf else ()


def _device(bus_rd: AttrReader, bus: HostDir, bdf: str) -> PciInfo | None:
    base = f"{PCI_DEVICES}/{bdf}"
    try:
        directory = bus.open_dir(bdf)
    except HostReadError:
        directory = None
    if directory is not None:
        with directory:
            if entries := directory.names():
                return _device_in(bus_rd.within(directory), bus_rd, bus, directory, bdf, entries)
    # A link to a device directory the capture does not have: one problem, not one per attribute.
    bus_rd.sb.problem(f"{base}: not a device directory (a dangling link, or empty)")
    return None


# The attributes read as one-record files, in one call and in this order (those the function has):
# NUMA locality, identity, link and SR-IOV. local_cpus (a mask) only stands in for a missing list.
_RECORDS = ("numa_node", "local_cpulist", "local_cpus", "uevent", "current_link_speed", "current_link_width",
            "max_link_speed", "max_link_width", "sriov_totalvfs", "sriov_numvfs")


def _device_in(rd: AttrReader, bus_rd: AttrReader, bus: HostDir, directory: HostDir, bdf: str,
               entries: set[str]) -> PciInfo:
    """The function in ``directory`` (its entries: ``entries``)."""
    base = f"{PCI_DEVICES}/{bdf}"
    wanted = [name for name in _RECORDS if name in entries]
    if "local_cpulist" in entries and "local_cpus" in entries:
        wanted.remove("local_cpus")
    texts = rd.records(directory, wanted)

    numa_node = rd.int_of(f"{base}/numa_node", texts.get("numa_node"), 10, -1)
    if numa_node < -1:
        rd.sb.problem(f"{base}/numa_node: invalid node {numa_node}")
        numa_node = -1

    local_cpus: Ids = ()
    if (cpulist := texts.get("local_cpulist")) is not None:
        local_cpus = rd.cpus_of(f"{base}/local_cpulist", cpulist, mask=False)
    elif (cpumask := texts.get("local_cpus")) is not None:
        local_cpus = rd.cpus_of(f"{base}/local_cpus", cpumask, mask=True)

    virtfns: list[tuple[int, str]] = []
    for entry in entries:
        if entry[0] == "v" and entry.startswith("virtfn") and entry[6:].isdigit():
            virtfns.append((int(entry[6:]), rd.link_name(entry)))
    virtfns.sort()

    # uevent carries ids, class and driver in one read instead of six; the separate attributes are
    # the fallback for trees without it (trimmed dumps) or with a key missing.
    uevent = texts.get("uevent")
    ids = _uevent_ids(rd, base, uevent) if uevent is not None else {}
    driver = ids.pop("driver", None)
    if not isinstance(driver, str):  # no DRIVER= line means unbound, and then there is no link either
        driver = rd.link_name("driver") if "driver" in entries else ""

    def ident(attr: str, required: bool) -> int:
        value = ids.get(attr)
        if isinstance(value, int):
            return value
        if attr not in entries:
            if required:
                rd.sb.problem(f"{base}/{attr}: missing")
            return 0
        return rd.int_attr(attr, 16, 0)

    def dec_attr(attr: str) -> int:
        return rd.int_of(f"{base}/{attr}", texts.get(attr), 10, 0)

    return PciInfo(
        bdf=bdf,
        vendor_id=ident("vendor", True),
        device_id=ident("device", True),
        subsystem_vendor_id=ident("subsystem_vendor", False),
        subsystem_device_id=ident("subsystem_device", False),
        class_code=ident("class", True),
        driver=driver,
        numa_node=numa_node,
        local_cpus=local_cpus,
        link_speed=_speed(texts.get("current_link_speed")),
        link_width=dec_attr("current_link_width"),
        max_link_speed=_speed(texts.get("max_link_speed")),
        max_link_width=dec_attr("max_link_width"),
        physfn=rd.link_name("physfn") if "physfn" in entries else "",
        virtfns=tuple(vf for _, vf in virtfns if vf),
        sriov_total_vfs=dec_attr("sriov_totalvfs"),
        sriov_num_vfs=dec_attr("sriov_numvfs"),
        msi_irqs=_msi_irqs(rd, base) if "msi_irqs" in entries else (),
        upstream=_upstream(bus_rd, bus, bdf),
        os_devices=_os_devices(rd, entries),
    )


def _uevent_ids(rd: AttrReader, base: str, text: str) -> dict[str, int | str]:
    """vendor, device, subsystem ids, class (ints) and driver (str) from ``uevent``'s text."""
    out: dict[str, int | str] = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if not eq:
            continue
        try:
            if key == "PCI_ID":
                vendor, device = value.split(":")
                out["vendor"], out["device"] = int(vendor, 16), int(device, 16)
            elif key == "PCI_SUBSYS_ID":
                vendor, device = value.split(":")
                out["subsystem_vendor"], out["subsystem_device"] = int(vendor, 16), int(device, 16)
            elif key == "PCI_CLASS":
                out["class"] = int(value, 16)
            elif key == "DRIVER":
                out["driver"] = value
        except ValueError:
            rd.sb.problem(f"{base}/uevent: malformed {key}={excerpt(value)}")
    return out


def _speed(record: str | None) -> str:
    text = attr_value(record) if record is not None else ""
    return "" if text.lower() in _UNKNOWN_SPEEDS else text


def _msi_irqs(rd: AttrReader, base: str) -> Ids:
    irqs: list[int] = []
    for name in rd.listdir("msi_irqs"):
        if name.isdigit() and name.isascii():
            irqs.append(int(name))
        else:
            rd.sb.problem(f"{base}/msi_irqs/{name}: not an IRQ number")
    return tuple(sorted(irqs))


def _os_devices(rd: AttrReader, entries: set[str]) -> tuple[str, ...]:
    names: set[str] = set()
    for sub in _OS_DEVICE_DIRS:
        if sub in entries:
            names.update(rd.listdir(sub))
    if "nvme" in entries:
        # hwloc and users name the namespace (nvme0n1), the kernel's nvme/ dir names the controller.
        for ctrl in [n for n in names if n.startswith("nvme")]:
            names.update(n for n in rd.listdir(f"nvme/{ctrl}") if n.startswith(f"{ctrl}n"))
    for entry in entries:
        first = entry[0]
        if first == "v" and entry.startswith("virtio") and entry[6:].isdigit():
            for sub in _VIRTIO_OS_DEVICE_DIRS:
                names.update(rd.listdir(f"{entry}/{sub}"))
        elif first == "m" and entry.startswith("mem") and entry[3:].isdigit():
            names.add(entry)  # CXL memdev (cxl_pci registers memN as a child of the function)
    return tuple(sorted(names))


def _inherit_vf_nodes(devices: dict[str, PciInfo]) -> None:
    """A VF with no node takes its PF's, flagged, as KubeVirt does; nothing else is ever guessed."""
    for bdf, dev in devices.items():
        if dev.numa_node != -1 or not dev.physfn:
            continue
        pf = devices.get(dev.physfn)
        if pf is not None and pf.numa_node >= 0:
            devices[bdf] = dataclasses.replace(dev, numa_node=pf.numa_node, numa_node_inherited=True)


def _attach_mdevs(rd: AttrReader, devices: dict[str, PciInfo]) -> None:
    if not rd.fs.is_dir(MDEV_DEVICES):
        return
    by_parent: dict[str, list[MdevInfo]] = {}
    for uuid in rd.listdir(MDEV_DEVICES):
        rel = f"{MDEV_DEVICES}/{uuid}"
        try:
            real = rd.fs.resolve(rel)
        except HostReadError as exc:
            rd.sb.problem(exc)
            continue
        parent = posixpath.basename(posixpath.dirname(real))
        if not is_bdf(parent):
            continue  # e.g. vfio_ap/matrix: no PCI parent, so no PCI device to hang it on
        mdev_type = rd.link_name(f"{rel}/mdev_type")
        parent_dev = devices.get(parent)
        # VF inheritance already ran, so a VF parent with -1 carries its PF's node here.
        node = parent_dev.numa_node if parent_dev is not None else -1
        by_parent.setdefault(parent, []).append(MdevInfo(uuid, mdev_type, parent, node))
    for parent, mdevs in by_parent.items():
        dev = devices.get(parent)
        if dev is None:
            rd.sb.problem(f"{MDEV_DEVICES}: parent {parent} of {mdevs[0].uuid} is not in {PCI_DEVICES}")
            continue
        devices[parent] = dataclasses.replace(dev, mdevs=tuple(sorted(mdevs, key=lambda m: m.uuid)))
