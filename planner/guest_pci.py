"""guest-pci: a NUMA-aware guest PCIe topology for passthrough devices (KubeVirt VEP 115).

The reference is what KubeVirt implements (``pkg/virt-launcher/virtwrap/converter/pci-placement.go``
and ``pkg/util/hardware/hw_utils.go`` in github.com/kubevirt/kubevirt), not the VEP's own XML
example, which puts endpoints on expander buses, where libvirt accepts only root ports:

* one ``pcie-expander-bus`` per *guest* NUMA cell that has devices, one ``pcie-root-port`` per
  device behind it (slot k for the k-th device of the cell), the device at slot 0 of its port;
* cells in ascending id, devices inside a cell in ascending source BDF; controller indexes follow
  the highest existing one in creation order (pxb, its ports, next pxb …);
* after a cell's ports exist its pxb gets ``busNr = 256 − controllers created so far``;
* a device that cannot be mapped stays without a guest address (libvirt's default placement on
  pcie.0), or, in strict mode (upstream's ``guestMappingPassthrough``), fails the whole request.

Deliberate differences from upstream are listed in ``docs/planner-guest-pci-place.md``.
"""

from __future__ import annotations

import re
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.planner.errors import PlanError
from memtopo.planner.request import as_object, get_bool, get_cpulist_map, get_int, get_list, reject_unknown

POLICY = "guest-pci"

# Upstream's "last assigned expander bus number" before any cell is finished; busNr counts down
# from here so that every pxb owns the bus numbers above it up to the previous pxb's.
MAX_BUS_NR = 255
# A pcie-expander-bus has slots 0–31 and each root port takes one. Upstream does not check this;
# a 33rd device would get slot 0x20, and libvirt refuses that domain.
PXB_SLOTS = 32

EXPANDER_BUS = "pcie-expander-bus"
ROOT_PORT = "pcie-root-port"

_BDF = re.compile(r"([0-9a-f]{4}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")
_COORDINATES = ("domain", "bus", "slot", "function")

DeviceStatus = Literal["placed", "kept", "default"]


# ---- request --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """One passthrough device. For an mdev, ``bdf``/``numa_node`` are its parent's."""

    bdf: str
    numa_node: int | None  # None: the host gave no affinity (numa_node -1 or absent)
    mdev: str | None = None
    # Coordinates the caller already fixed ({"bus": 0, "slot": 7}); any one makes the device
    # "explicitly placed", which upstream never moves.
    guest_address: Mapping[str, int] | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.bdf, self.mdev or "")

    @property
    def label(self) -> str:
        return f"mdev {self.mdev} (parent {self.bdf})" if self.mdev else self.bdf


@dataclass(frozen=True)
class GuestNuma:
    """The VM's own NUMA description, from which host node → guest cell is derived.

    ``cells``, ``vcpupins`` and ``memnodes`` keep the raw strings: upstream skips a malformed entry
    with a warning instead of refusing the VM, and strict mode turns those warnings into failures.
    """

    cells: Mapping[str, str] = field(default_factory=dict)  # guest cell id → vCPU cpulist
    vcpupins: Mapping[str, str] = field(default_factory=dict)  # vCPU → host pCPU cpulist
    memnodes: Mapping[str, str] = field(default_factory=dict)  # guest cell id → host nodeset
    host_node_cpus: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # host node → CPUs


@dataclass(frozen=True)
class GuestPciRequest:
    devices: tuple[Device, ...]
    strict: bool = False
    highest_controller_index: int = 0
    # Exactly one of the two (or neither: no mapping is available).
    numa_mapping: Mapping[int, int] | None = None  # host node → guest cell, given directly
    guest_numa: GuestNuma | None = None


def _bad(field_name: str, why: str) -> PlanError:
    return PlanError("invalid_request", f"{field_name}: {why}")


def _parse_bdf(value: Any, field_name: str) -> str:
    if not isinstance(value, str):
        raise _bad(field_name, f'expected a PCI address "DDDD:BB:SS.F", got {value!r}')
    bdf = value.strip().lower()
    m = _BDF.fullmatch(bdf)
    if m is None:
        raise _bad(field_name, f'expected a PCI address "DDDD:BB:SS.F" (hex), got {value!r}')
    if int(m.group(3), 16) > 0x1F:
        raise _bad(field_name, f"slot {m.group(3)} is above 0x1f in {value!r}")
    return bdf


def _parse_number(value: Any, field_name: str) -> int:
    """A libvirt address number: an int, or a string read like libvirt (strtoul base 0)."""
    if isinstance(value, bool):
        raise _bad(field_name, f"expected a number, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            if text.startswith("0x"):
                number = int(text[2:], 16)
            elif len(text) > 1 and text.startswith("0"):
                number = int(text[1:], 8)
            else:
                number = int(text, 10)
        except ValueError:
            raise _bad(field_name, f"not a number: {value!r}") from None
    else:
        raise _bad(field_name, f"expected a number, got {value!r}")
    if number < 0:
        raise _bad(field_name, f"must be ≥ 0, got {value!r}")
    return number


def _parse_guest_address(value: Any, field_name: str) -> Mapping[str, int] | None:
    if value is None:
        return None
    obj = as_object(value, field_name)
    unknown = sorted(set(obj) - {*_COORDINATES, "type"})
    if unknown:
        raise _bad(field_name, f"unknown keys {unknown}; expected {list(_COORDINATES)}")
    if obj.get("type", "pci") != "pci":
        raise _bad(f"{field_name}.type", f"only type 'pci' is a PCI address, got {obj['type']!r}")
    coords = {k: _parse_number(obj[k], f"{field_name}.{k}") for k in _COORDINATES if obj.get(k) is not None}
    # An address with only a type sets no coordinate: upstream treats it as unplaced.
    return coords or None


def _parse_device(value: Any, i: int) -> Device:
    name = f"devices[{i}]"
    obj = as_object(value, name)
    unknown = sorted(set(obj) - {"bdf", "numa_node", "mdev", "guest_address"})
    if unknown:
        raise _bad(name, f"unknown keys {unknown}")
    if "bdf" not in obj:
        raise _bad(f"{name}.bdf", "required field is missing")
    bdf = _parse_bdf(obj["bdf"], f"{name}.bdf")
    # Absent is an error rather than "no affinity": a forgotten field must not silently send a
    # device to pcie.0. null and -1 (the kernel's "no affinity") are both accepted.
    if "numa_node" not in obj:
        raise _bad(f"{name}.numa_node", "required field is missing (use -1 or null for no affinity)")
    node: int | None = None
    if obj["numa_node"] is not None:
        # A one-key mapping lets get_int name the field with its full path in the error.
        node = get_int({f"{name}.numa_node": obj["numa_node"]}, f"{name}.numa_node", minimum=-1)
        node = None if node < 0 else node
    mdev: str | None = None
    if obj.get("mdev") is not None:
        raw = obj["mdev"]
        try:
            mdev = str(uuid.UUID(raw)) if isinstance(raw, str) else None
        except ValueError:
            mdev = None
        if mdev is None:
            raise _bad(f"{name}.mdev", f"expected an mdev UUID, got {raw!r}")
    return Device(
        bdf=bdf,
        numa_node=node,
        mdev=mdev,
        guest_address=_parse_guest_address(obj.get("guest_address"), f"{name}.guest_address"),
    )


def _string_map(obj: Mapping[str, Any], field_name: str) -> dict[str, str]:
    value = obj.get(field_name)
    if value is None:
        return {}
    mapping = as_object(value, field_name)
    out: dict[str, str] = {}
    for key, text in mapping.items():
        if not isinstance(text, str):
            raise _bad(f"{field_name}[{key}]", f"expected a cpulist string, got {text!r}")
        out[str(key)] = text
    return out


def _parse_numa_mapping(value: Any) -> dict[int, int]:
    mapping = as_object(value, "numa_mapping")
    out: dict[int, int] = {}
    for key in mapping:
        if not isinstance(key, str) or _int_key(key) is None:
            raise _bad("numa_mapping", f"key {key!r} is not a host NUMA node id")
        out[int(key)] = get_int({f"numa_mapping[{key}]": mapping[key]}, f"numa_mapping[{key}]", minimum=0)
    return out


def parse_request(obj: Any) -> GuestPciRequest:
    req = as_object(obj)
    unknown = sorted(set(req) - {"devices", "strict", "highest_controller_index", "numa_mapping", "guest_numa"})
    if unknown:
        raise _bad("request", f"unknown keys {unknown}")
    devices = tuple(_parse_device(d, i) for i, d in enumerate(get_list(req, "devices")))
    seen: dict[tuple[str, str], int] = {}
    whole: dict[str, int] = {}
    for i, dev in enumerate(devices):
        if dev.key in seen:
            raise _bad(f"devices[{i}]", f"{dev.label} is listed twice (also devices[{seen[dev.key]}])")
        seen[dev.key] = i
        if dev.mdev is None:
            whole[dev.bdf] = i
    for i, dev in enumerate(devices):
        if dev.mdev is not None and dev.bdf in whole:
            raise _bad(
                f"devices[{i}]",
                f"{dev.bdf} is passed through whole (devices[{whole[dev.bdf]}]) and also as the parent of {dev.label}",
            )
    if "numa_mapping" in req and "guest_numa" in req:
        raise _bad("request", "give either numa_mapping or guest_numa, not both")
    numa_mapping = _parse_numa_mapping(req["numa_mapping"]) if req.get("numa_mapping") is not None else None
    guest_numa: GuestNuma | None = None
    if req.get("guest_numa") is not None:
        g = as_object(req["guest_numa"], "guest_numa")
        reject_unknown(g, ("cells", "vcpupins", "memnodes", "host_node_cpus"), "guest_numa")
        guest_numa = GuestNuma(
            cells=_string_map(g, "cells"),
            vcpupins=_string_map(g, "vcpupins"),
            memnodes=_string_map(g, "memnodes"),
            host_node_cpus=get_cpulist_map(g, "host_node_cpus") or {},
        )
    return GuestPciRequest(
        devices=devices,
        strict=get_bool(req, "strict", False),
        highest_controller_index=get_int(req, "highest_controller_index", 0, minimum=0),
        numa_mapping=numa_mapping,
        guest_numa=guest_numa,
    )


# ---- host node → guest cell ---------------------------------------------------------------------
@dataclass(frozen=True)
class CellMapping:
    """Which guest cell each host node maps to, why the others do not, and global warnings."""

    cells: Mapping[int, int]  # host node → guest cell
    unmapped: Mapping[int, str]  # host node → reason
    warnings: tuple[str, ...] = ()
    # False when nothing at all could be derived (no cells, or neither memnodes nor pins).
    available: bool = True


def _int_key(key: str) -> int | None:
    # isdigit() alone accepts "²" and other Unicode digits that int() refuses.
    return int(key) if key.isascii() and key.isdigit() else None


def _id_order(key: str) -> tuple[bool, int, str]:
    """Numeric ids in numeric order, then anything else, so JSON key order never matters."""
    n = _int_key(key)
    return (n is None, n or 0, key)


def map_host_nodes(guest: GuestNuma, host_nodes: Iterable[int]) -> CellMapping:
    """Host NUMA node → guest cell as upstream's lookup does it: NUMATune memnodes
    first, then the cell of the first pinned pCPU of the host node. Malformed entries are skipped
    with a warning, never fatal here (strict mode decides)."""
    warnings: list[str] = []
    known_cells: set[int] = set()
    vcpu_cell: dict[int, int] = {}
    for key in sorted(guest.cells, key=_id_order):
        text = guest.cells[key]
        cell = _int_key(key)
        if cell is None:
            warnings.append(f"ignoring guest NUMA cell {key!r}: the id is not an integer")
            continue
        known_cells.add(cell)
        if not text.strip():
            continue  # a memory-only (CPU-less) cell: nothing to pin, silently skipped upstream
        try:
            vcpus = parse_cpulist(text)
        except CpuListError as exc:
            warnings.append(f"ignoring guest NUMA cell {cell} with invalid CPU set {text!r}: {exc}")
            continue
        for vcpu in vcpus:
            if vcpu in vcpu_cell:
                warnings.append(
                    f"vCPU {vcpu} is in guest NUMA cells {vcpu_cell[vcpu]} and {cell}; keeping {vcpu_cell[vcpu]}"
                )
                continue
            vcpu_cell[vcpu] = cell
    if not known_cells:
        return CellMapping({}, {}, tuple(warnings), available=False)

    memnode: dict[int, int] = {}
    ambiguous: dict[int, set[int]] = {}
    for key in sorted(guest.memnodes, key=_id_order):
        text = guest.memnodes[key]
        cell = _int_key(key)
        if cell is None or cell not in known_cells:
            warnings.append(f"ignoring NUMATune memnode for unknown guest NUMA cell {key}")
            continue
        try:
            nodes = parse_cpulist(text)
        except CpuListError as exc:
            warnings.append(
                f"ignoring NUMATune memnode for guest NUMA cell {cell} with invalid nodeset {text!r}: {exc}"
            )
            continue
        for node in nodes:
            if node in ambiguous:
                ambiguous[node].add(cell)
            elif node in memnode and memnode[node] != cell:
                ambiguous[node] = {memnode.pop(node), cell}
            else:
                memnode[node] = cell
    for node in sorted(ambiguous):
        a, b, *_ = sorted(ambiguous[node])
        warnings.append(
            f"host NUMA node {node} is mapped to multiple guest NUMA cells ({a} and {b}); "
            "falling back to vCPU pinning for it"
        )

    # Pins are applied in ascending vCPU order so that the JSON key order cannot change the result;
    # a later pin of the same pCPU wins, as in upstream.
    pcpu_vcpu: dict[int, int] = {}
    for key in sorted(guest.vcpupins, key=_id_order):
        pinned = _int_key(key)
        text = guest.vcpupins[key]
        try:
            pcpus = parse_cpulist(text) if pinned is not None else None
        except CpuListError:
            pcpus = None
        if pinned is None or pcpus is None:
            warnings.append(f"ignoring invalid vCPU pinning for vCPU {key}: {text!r}")
            continue
        for pcpu in pcpus:
            pcpu_vcpu[pcpu] = pinned

    if not memnode and not pcpu_vcpu:
        return CellMapping({}, {}, tuple(warnings), available=False)

    cells: dict[int, int] = {}
    unmapped: dict[int, str] = {}
    for node in sorted(set(host_nodes)):
        if node in memnode:
            cells[node] = memnode[node]
            continue
        cpus = guest.host_node_cpus.get(node)
        if cpus is None:
            unmapped[node] = f"failed to read CPU list for host NUMA node {node}"
            continue
        found = next((vcpu_cell[pcpu_vcpu[c]] for c in cpus if c in pcpu_vcpu and pcpu_vcpu[c] in vcpu_cell), None)
        if found is None:
            unmapped[node] = f"host NUMA node {node} cannot be mapped to a guest NUMA cell"
        else:
            cells[node] = found
    return CellMapping(cells, unmapped, tuple(warnings))


def _direct_mapping(mapping: Mapping[int, int], host_nodes: Iterable[int]) -> CellMapping:
    if not mapping:
        return CellMapping({}, {}, available=False)
    unmapped = {
        n: f"host NUMA node {n} cannot be mapped to a guest NUMA cell"
        for n in sorted(set(host_nodes))
        if n not in mapping
    }
    return CellMapping(dict(mapping), unmapped)


# ---- decision -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PciAddress:
    """A guest PCI address; ``bus`` is a controller *index* (libvirt semantics), not a bus number."""

    bus: int
    slot: int
    domain: int = 0
    function: int = 0

    def to_json(self) -> dict[str, int]:
        return {"domain": self.domain, "bus": self.bus, "slot": self.slot, "function": self.function}


@dataclass(frozen=True)
class Controller:
    index: int
    model: str  # EXPANDER_BUS or ROOT_PORT
    bus_nr: int | None = None  # expander bus only
    node: int | None = None  # expander bus only: the guest cell
    address: PciAddress | None = None  # root port only: on its expander bus

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "model": self.model}
        if self.model == EXPANDER_BUS:
            out.update(bus_nr=self.bus_nr, node=self.node)
        elif self.address is not None:
            out["address"] = self.address.to_json()
        return out


@dataclass(frozen=True)
class DevicePlacement:
    device: Device
    status: DeviceStatus  # placed behind a root port | kept (caller's address) | default (pcie.0)
    guest_cell: int | None = None
    root_port: int | None = None
    address: PciAddress | None = None
    # Where the guest will enumerate it (pxb busNr + 1 + port slot), from libvirt's pxb docs.
    guest_bdf: str | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        dev = self.device
        out: dict[str, Any] = {"bdf": dev.bdf}
        if dev.mdev:
            out["mdev"] = dev.mdev
        out.update(host_numa_node=dev.numa_node if dev.numa_node is not None else -1, status=self.status)
        if self.status == "placed":
            out.update(
                guest_cell=self.guest_cell,
                root_port=self.root_port,
                address=self.address.to_json() if self.address else None,
                guest_bdf=self.guest_bdf,
            )
        elif self.status == "kept":
            out["address"] = dict(dev.guest_address or {})
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class GuestPciDecision:
    strict: bool
    controllers: tuple[Controller, ...]
    devices: tuple[DevicePlacement, ...]
    warnings: tuple[str, ...]

    @property
    def xml(self) -> str:
        return devices_xml(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": POLICY,
            "strict": self.strict,
            "controllers": [c.to_json() for c in self.controllers],
            "devices": [d.to_json() for d in self.devices],
            "warnings": list(self.warnings),
            "xml": self.xml,
        }


class _FallbackError(Exception):
    """The NUMA topology cannot be built at all; upstream then abandons it (relaxed) or fails."""


_Placed = dict[tuple[str, str], DevicePlacement]


def _build(groups: Mapping[int, list[Device]], start_index: int) -> tuple[list[Controller], _Placed]:
    controllers: list[Controller] = []
    placed: _Placed = {}
    index, created, last_bus_nr = start_index, 0, MAX_BUS_NR
    for cell in sorted(groups):
        devices = groups[cell]
        if len(devices) > PXB_SLOTS:
            raise _FallbackError(
                f"guest NUMA cell {cell} has {len(devices)} devices; a {EXPANDER_BUS} has "
                f"{PXB_SLOTS} slots for root ports"
            )
        index += 1
        created += 1
        pxb_index = index
        ports: list[tuple[int, Device]] = []
        for dev in devices:
            # Upstream's guard: controller indexes stand in for the bus numbers pcie.0 needs, so
            # they must stay below the bus numbers already handed to expander buses.
            if index >= last_bus_nr - 1:
                raise _FallbackError(
                    f"failed to place device {dev.label}: insufficient bus numbers for NUMA-aligned "
                    f"PCIe topology: current controller index {index}, last assigned expander bus "
                    f"number {last_bus_nr}"
                )
            index += 1
            created += 1
            ports.append((index, dev))
        bus_nr = MAX_BUS_NR - created + 1
        last_bus_nr = bus_nr
        controllers.append(Controller(pxb_index, EXPANDER_BUS, bus_nr=bus_nr, node=cell))
        for slot, (port_index, dev) in enumerate(ports):
            controllers.append(Controller(port_index, ROOT_PORT, address=PciAddress(bus=pxb_index, slot=slot)))
            placed[dev.key] = DevicePlacement(
                dev,
                "placed",
                guest_cell=cell,
                root_port=port_index,
                address=PciAddress(bus=port_index, slot=0),
                guest_bdf=f"0000:{bus_nr + 1 + slot:02x}:00.0",
            )
    return controllers, placed


def decide(req: GuestPciRequest) -> GuestPciDecision:
    """Build the guest PCIe topology; raises PlanError("unsatisfiable") only in strict mode."""
    devices = sorted(req.devices, key=lambda d: d.key)
    host_nodes = [d.numa_node for d in devices if d.numa_node is not None]
    if req.numa_mapping is not None:
        mapping = _direct_mapping(req.numa_mapping, host_nodes)
    elif req.guest_numa is not None:
        mapping = map_host_nodes(req.guest_numa, host_nodes)
    else:
        mapping = CellMapping({}, {}, available=False)

    messages: list[str] = []
    results: dict[tuple[str, str], DevicePlacement] = {}
    for dev in devices:
        if dev.guest_address is not None:
            msg = f"device {dev.label} already has a guest PCI address, skipping {EXPANDER_BUS} assignment"
            messages.append(msg)
            results[dev.key] = DevicePlacement(dev, "kept", reason=msg)
    messages.extend(mapping.warnings)
    groups: dict[int, list[Device]] = {}
    for dev in devices:
        if dev.key in results:
            continue
        if dev.numa_node is None:
            reason = f"failed to read host NUMA affinity: device {dev.bdf} has no NUMA node affinity"
        elif not mapping.available:
            reason = "no guest NUMA node mapping is available"
        elif dev.numa_node in mapping.cells:
            groups.setdefault(mapping.cells[dev.numa_node], []).append(dev)
            continue
        else:
            reason = mapping.unmapped.get(
                dev.numa_node, f"host NUMA node {dev.numa_node} cannot be mapped to a guest NUMA cell"
            )
        msg = f"device {dev.label} cannot be placed on a NUMA-aware PCIe topology: {reason}"
        messages.append(msg)
        results[dev.key] = DevicePlacement(dev, "default", reason=msg)
    if req.strict and messages:
        raise PlanError("unsatisfiable", "strict PCI NUMA-aware placement failed: " + "; ".join(messages))

    try:
        controllers, placed = _build(groups, req.highest_controller_index)
    except _FallbackError as exc:
        msg = f"failed to create PCIe topology with NUMA alignment: {exc}"
        if req.strict:
            raise PlanError("unsatisfiable", msg) from None
        # Nothing is half-applied: every candidate goes back to default placement.
        messages.append(f"{msg}; falling back to default placement")
        controllers, placed = [], {}
        for cell_devices in groups.values():
            for dev in cell_devices:
                placed[dev.key] = DevicePlacement(dev, "default", reason=msg)
    results.update(placed)
    return GuestPciDecision(
        strict=req.strict,
        controllers=tuple(controllers),
        devices=tuple(results[d.key] for d in devices),
        warnings=tuple(messages),
    )


# ---- libvirt XML ----------------------------------------------------------------------------------
def _address_attrs(coords: Mapping[str, int]) -> dict[str, str]:
    # libvirt's canonical spelling (what it writes back): hex with a fixed width per field.
    widths = {"domain": 4, "bus": 2, "slot": 2, "function": 1}
    attrs = {"type": "pci"}
    for name in _COORDINATES:
        if name in coords:
            attrs[name] = f"0x{coords[name]:0{widths[name]}x}"
    return attrs


def _source_attrs(bdf: str) -> dict[str, str]:
    m = _BDF.fullmatch(bdf)
    assert m is not None  # validated by parse_request
    dom, bus, slot, fn = m.groups()
    return {"domain": f"0x{dom}", "bus": f"0x{bus}", "slot": f"0x{slot}", "function": f"0x{fn}"}


def devices_xml(decision: GuestPciDecision) -> str:
    """The ``<devices>`` fragment: new controllers (pxb, then its root ports, by guest cell) and one
    ``<hostdev>`` per requested device, addressed when placed or kept."""
    root = ET.Element("devices")
    for c in decision.controllers:
        el = ET.SubElement(root, "controller", {"type": "pci", "index": str(c.index), "model": c.model})
        if c.model == EXPANDER_BUS:
            # No <address> and no <model name>: libvirt picks the pcie.0 slot and pxb-pcie itself,
            # as it does for upstream's controllers.
            target = ET.SubElement(el, "target", {"busNr": str(c.bus_nr)})
            ET.SubElement(target, "node").text = str(c.node)
        elif c.address is not None:
            ET.SubElement(el, "address", _address_attrs(c.address.to_json()))
    for p in decision.devices:
        dev = p.device
        if dev.mdev:
            host = ET.SubElement(root, "hostdev", {"mode": "subsystem", "type": "mdev", "model": "vfio-pci"})
            ET.SubElement(ET.SubElement(host, "source"), "address", {"uuid": dev.mdev})
        else:
            # managed='no': KubeVirt's device plugins bind vfio-pci themselves.
            host = ET.SubElement(root, "hostdev", {"mode": "subsystem", "type": "pci", "managed": "no"})
            ET.SubElement(ET.SubElement(host, "source"), "address", _source_attrs(dev.bdf))
        if p.status == "placed" and p.address is not None:
            ET.SubElement(host, "address", _address_attrs(p.address.to_json()))
        elif p.status == "kept" and dev.guest_address:
            ET.SubElement(host, "address", _address_attrs(dev.guest_address))
    ET.indent(root, space="  ")
    return ET.tostring(root, encoding="unicode")
