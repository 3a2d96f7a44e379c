"""guest-pci: the upstream KubeVirt vectors, the VEP example as upstream would build it, our
additions, invalid requests and properties.

The upstream vectors are the cases of kubevirt's ``pci-placement_test.go`` and ``converter_test.go``
(``pkg/virt-launcher/virtwrap/converter/``) and ``hw_utils_test.go`` (``pkg/util/hardware/``),
restated as requests. Test names carry this project's label for the case (a, p, b, s, m, d for the
placement tests' groups, among them s strict mode, m memnodes, d determinism; h the lookup tests;
c the converter tests), and each test says what it checks.

The vectors' fake sysfs becomes request data: a device's ``numa_node`` is what upstream reads from
``/sys/bus/pci/devices/<BDF>/numa_node`` (a missing file is ``null``), ``host_node_cpus`` what it
reads from ``/sys/bus/node/devices/nodeN/cpulist``.
"""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.planner.errors import PlanError
from memtopo.planner.guest_pci import (
    EXPANDER_BUS,
    ROOT_PORT,
    GuestNuma,
    GuestPciDecision,
    decide,
    map_host_nodes,
    parse_request,
)

# pci-placement_test.go's fake sysfs: device bus → host node; 06 has no sysfs entry.
NODE_OF = {"01": 0, "02": 1, "03": 0, "04": 1, "05": 0, "06": None}
HOST_NODE_CPUS = {"0": "0-3", "1": "4-7"}
# Default domain: cells {0: vCPUs 0-1}, {1: vCPUs 2-3}; vCPU0 → pCPU0, vCPU2 → pCPU4.
DEFAULT_NUMA: dict[str, Any] = {"cells": {"0": "0-1", "1": "2-3"}, "vcpupins": {"0": "0", "2": "4"},
                                "host_node_cpus": HOST_NODE_CPUS}


def dev(bus: str, **extra: Any) -> dict[str, Any]:
    return {"bdf": f"0000:{bus}:00.0", "numa_node": NODE_OF[bus], **extra}


def run(devices: list[dict[str, Any]], *, guest_numa: dict[str, Any] | None = None, strict: bool = False,
        highest: int = 0, no_numa: bool = False) -> GuestPciDecision:
    req: dict[str, Any] = {"devices": devices, "strict": strict, "highest_controller_index": highest}
    if not no_numa:
        req["guest_numa"] = DEFAULT_NUMA if guest_numa is None else guest_numa
    return decide(parse_request(req))


def pxbs(d: GuestPciDecision) -> list[tuple[int, int | None, int | None]]:
    return [(c.index, c.bus_nr, c.node) for c in d.controllers if c.model == EXPANDER_BUS]


def ports(d: GuestPciDecision) -> list[tuple[int, int, int]]:
    return [(c.index, c.address.bus, c.address.slot) for c in d.controllers
            if c.model == ROOT_PORT and c.address is not None]


def placed_bus(d: GuestPciDecision) -> dict[str, int | None]:
    return {p.device.bdf: (p.address.bus if p.address else None) for p in d.devices}


def accepted(d: GuestPciDecision) -> int:
    return sum(p.status == "placed" for p in d.devices)


# ---- pci-placement_test.go ---------------------------------------------------------------------------
def test_a1_a6_two_pci_devices_are_candidates() -> None:
    # A1's usb/scsi hostdevs cannot be expressed: the request only carries PCI devices.
    d = run([dev("01"), dev("02")])
    assert accepted(d) == 2


def test_a2_pci_device_without_source_address_is_refused() -> None:
    # Upstream skips such a hostdev; a request without a BDF is malformed input here.
    with pytest.raises(PlanError) as exc:
        run([dev("01"), {"numa_node": 0}])
    assert exc.value.code == "invalid_request" and "devices[1].bdf" in exc.value.message


@pytest.mark.parametrize("address", [{"bus": "0x00", "slot": "0x07"}, {"type": "pci", "bus": "0x00"}],
                         ids=["A3-full", "A4-partial"])
def test_a3_a4_device_with_guest_address_is_not_a_candidate(address: dict[str, Any]) -> None:
    d = run([dev("01"), dev("02", guest_address=address)])
    assert accepted(d) == 1
    kept = next(p for p in d.devices if p.device.bdf == "0000:02:00.0")
    assert kept.status == "kept" and "already has a guest PCI address" in kept.reason


def test_a5_p5_no_cells_no_pins_places_nothing() -> None:
    for d in (run([dev("01")], no_numa=True), run([dev("01")], guest_numa={})):
        assert accepted(d) == 0 and d.controllers == ()
        assert "no guest NUMA node mapping is available" in d.devices[0].reason


def test_p1_no_devices_no_controllers() -> None:
    assert run([]).controllers == ()


@pytest.mark.parametrize(("buses", "n_pxb", "n_ports"), [(["01"], 1, 1), (["01", "03"], 1, 2),
                                                          (["01", "02"], 2, 2)], ids=["P2", "P3", "P4"])
def test_p2_p4_controller_counts(buses: list[str], n_pxb: int, n_ports: int) -> None:
    d = run([dev(b) for b in buses])
    assert len(pxbs(d)) == n_pxb and len(ports(d)) == n_ports


def test_p6_cells_without_pins_places_nothing() -> None:
    d = run([dev("01")], guest_numa={"cells": {"0": "0-1"}, "host_node_cpus": HOST_NODE_CPUS})
    assert d.controllers == () and d.devices[0].status == "default"


def test_b1_insufficient_bus_numbers() -> None:
    relaxed = run([dev("01")], highest=255)
    assert relaxed.controllers == () and relaxed.devices[0].status == "default"
    text = " ".join(relaxed.warnings)
    assert "insufficient bus numbers" in text
    assert "current controller index 256" in text and "last assigned expander bus number 255" in text
    with pytest.raises(PlanError) as exc:
        run([dev("01")], highest=255, strict=True)
    assert "current controller index 256" in exc.value.message
    assert "last assigned expander bus number 255" in exc.value.message


def test_b2_bus_numbers_one_device_per_node() -> None:
    assert [bus_nr for _, bus_nr, _ in pxbs(run([dev("01"), dev("02")]))] == [254, 252]


def test_b3_every_placed_device_sits_at_slot_zero_of_a_root_port() -> None:
    d = run([dev("01"), dev("02")])
    port_indexes = {i for i, _, _ in ports(d)}
    for p in d.devices:
        assert p.address is not None and p.address.slot == 0 and p.address.function == 0
        assert p.address.bus in port_indexes


def test_b4_explicit_address_kept_other_device_placed() -> None:
    d = run([dev("01", guest_address={"bus": "0x00", "slot": "0x07"}), dev("02")])
    assert pxbs(d) == [(1, 254, 1)]
    assert ports(d) == [(2, 1, 0)]
    by = {p.device.bdf: p for p in d.devices}
    assert by["0000:01:00.0"].status == "kept"
    assert by["0000:01:00.0"].device.guest_address == {"bus": 0, "slot": 7}
    assert placed_bus(d)["0000:02:00.0"] == 2


def test_b5_device_without_numa_file_stays_unaddressed() -> None:
    d = run([dev("06")])
    assert d.controllers == () and d.devices[0].address is None


def test_b6_missing_numa_device_beside_a_placed_one() -> None:
    d = run([dev("06"), dev("01")])
    assert pxbs(d) == [(1, 254, 0)] and ports(d) == [(2, 1, 0)]
    assert placed_bus(d) == {"0000:01:00.0": 2, "0000:06:00.0": None}


def test_s1_strict_missing_numa_fails() -> None:
    with pytest.raises(PlanError) as exc:
        run([dev("06")], strict=True)
    assert exc.value.code == "unsatisfiable"
    assert "strict PCI NUMA-aware placement failed" in exc.value.message and "0000:06:00.0" in exc.value.message


def test_s2_strict_explicit_address_fails() -> None:
    with pytest.raises(PlanError, match="already has a guest PCI address"):
        run([dev("01", guest_address={"bus": "0x00", "slot": "0x07"})], strict=True)


def test_s3_strict_unmappable_host_node_fails() -> None:
    numa = {"cells": {"0": "0-1"}, "vcpupins": {"0": "4"}, "host_node_cpus": HOST_NODE_CPUS}
    with pytest.raises(PlanError, match="cannot be mapped to a guest NUMA cell"):
        run([dev("01")], guest_numa=numa, strict=True)
    relaxed = run([dev("01")], guest_numa=numa)
    assert relaxed.controllers == () and "cannot be mapped" in relaxed.devices[0].reason


def test_m1_memnode_beats_vcpu_pinning() -> None:
    d = run([dev("01")], guest_numa={**DEFAULT_NUMA, "memnodes": {"1": "0"}})
    assert pxbs(d) == [(1, 254, 1)] and placed_bus(d)["0000:01:00.0"] == 2


def test_m2_ambiguous_memnode_falls_back_to_pinning() -> None:
    d = run([dev("01")], guest_numa={**DEFAULT_NUMA, "memnodes": {"0": "0", "1": "0"}})
    assert pxbs(d) == [(1, 254, 0)] and placed_bus(d)["0000:01:00.0"] == 2
    assert any("mapped to multiple guest NUMA cells" in w for w in d.warnings)


def test_m3_strict_ambiguous_memnode_fails() -> None:
    with pytest.raises(PlanError, match="mapped to multiple guest NUMA cells"):
        run([dev("01")], guest_numa={**DEFAULT_NUMA, "memnodes": {"0": "0", "1": "0"}}, strict=True)


def test_d1_deterministic_order() -> None:
    d = run([dev("04"), dev("03"), dev("01"), dev("02")])
    assert pxbs(d) == [(1, 253, 0), (4, 250, 1)]
    assert ports(d) == [(2, 1, 0), (3, 1, 1), (5, 4, 0), (6, 4, 1)]
    assert [c.index for c in d.controllers] == [1, 2, 3, 4, 5, 6]  # pxb, its ports, next pxb …
    assert placed_bus(d) == {"0000:01:00.0": 2, "0000:03:00.0": 3, "0000:02:00.0": 5, "0000:04:00.0": 6}


def test_d2_indexes_follow_the_highest_existing_controller() -> None:
    # Existing pcie-root (0) and a root port (7): the caller passes the highest index, 7.
    d = run([dev("01")], highest=7)
    assert pxbs(d) == [(8, 254, 0)] and ports(d) == [(9, 8, 0)]
    assert placed_bus(d)["0000:01:00.0"] == 9


# ---- hw_utils_test.go: host node → guest cell --------------------------------------------------------
HW_CPUS = {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}  # dev0 = 00:01.0 on node 0, dev1 = 00:02.0 on node 1


def lookup(cells: dict[str, str], pins: dict[str, str] | None = None, memnodes: dict[str, str] | None = None,
           nodes: tuple[int, ...] = (0,)) -> tuple[dict[int, int], tuple[str, ...], dict[int, str]]:
    m = map_host_nodes(GuestNuma(cells=cells, vcpupins=pins or {}, memnodes=memnodes or {},
                                 host_node_cpus=HW_CPUS), nodes)
    return dict(m.cells), m.warnings, dict(m.unmapped)


def test_h1_no_devices() -> None:
    assert lookup({"0": "0-3"}, {"0": "0"}, nodes=())[0] == {}


def test_h2_h3_no_domain_or_no_numa() -> None:
    m = map_host_nodes(GuestNuma(host_node_cpus=HW_CPUS), [0])
    assert m.cells == {} and not m.available
    # Through decide: the device gets the "no mapping" reason and nothing is built.
    d = run([{"bdf": "0000:00:01.0", "numa_node": 0}], no_numa=True)
    assert d.controllers == () and d.devices[0].status == "default"


def test_h4_cells_without_pins() -> None:
    cells, warnings, unmapped = lookup({"0": "0-3", "1": "4-7"})
    assert cells == {} and unmapped == {} and warnings == ()


def test_h5_pins() -> None:
    assert lookup({"0": "0-3", "1": "4-7"}, {"0": "0", "1": "4"})[0] == {0: 0}


def test_h6_memnode() -> None:
    assert lookup({"0": "0-3", "1": "4-7"}, memnodes={"1": "0"})[0] == {0: 1}


def test_h7_memnode_beats_pin() -> None:
    assert lookup({"0": "0", "1": "1"}, {"0": "0"}, {"1": "0"})[0] == {0: 1}


def test_h8_ambiguous_memnode_warns_and_uses_pin() -> None:
    cells, warnings, _ = lookup({"0": "0", "1": "1"}, {"0": "0"}, {"0": "0", "1": "0"})
    assert cells == {0: 0}
    assert any("mapped to multiple guest NUMA cells" in w for w in warnings)


def test_h9_memnode_for_unknown_cell_is_ignored() -> None:
    cells, warnings, _ = lookup({"0": "0"}, {"0": "0"}, {"1": "0"})
    assert cells == {0: 0}
    assert any("unknown guest NUMA cell 1" in w for w in warnings)


def test_h10_cpu_less_cells_are_skipped_silently() -> None:
    cells, warnings, _ = lookup({"0": "0-7", "1": "", "2": ""}, {"0": "0"}, {"0": "0"})
    assert cells == {0: 0} and warnings == ()


def test_h11_ambiguous_node_without_pins_is_unmapped() -> None:
    cells, _, unmapped = lookup({"0": "0", "1": "1"}, memnodes={"0": "0", "1": "0-1"}, nodes=(0, 1))
    assert cells == {1: 1}
    assert "cannot be mapped" in unmapped[0]


def test_h12_device_without_sysfs_entry() -> None:
    d = run([{"bdf": "0000:ff:00.0", "numa_node": None}], guest_numa={"cells": {"0": "0"}, "vcpupins": {"0": "0"}})
    assert "failed to read host NUMA affinity" in d.devices[0].reason and d.controllers == ()


def test_h13_pinned_vcpu_in_no_cell() -> None:
    cells, _, unmapped = lookup({"0": "1"}, {"0": "0"})
    assert cells == {} and "cannot be mapped to a guest NUMA cell" in unmapped[0]


def test_h14_invalid_memnodes_are_skipped() -> None:
    cells, warnings, _ = lookup({"0": "0", "1": "1"}, memnodes={"0": "invalid", "2": "0", "1": "1"}, nodes=(0, 1))
    assert cells == {1: 1}
    assert any("invalid nodeset" in w for w in warnings) and any("unknown guest NUMA cell 2" in w for w in warnings)


def test_h15_numa_node_minus_one_means_no_affinity() -> None:
    d = run([{"bdf": "0000:00:01.0", "numa_node": -1}])
    assert "has no NUMA node affinity" in d.devices[0].reason


def test_strict_fails_on_a_global_warning_even_when_every_device_maps() -> None:
    numa = {**DEFAULT_NUMA, "memnodes": {"5": "0"}}  # memnode for an unknown cell
    assert accepted(run([dev("01")], guest_numa=numa)) == 1
    with pytest.raises(PlanError, match="unknown guest NUMA cell 5"):
        run([dev("01")], guest_numa=numa, strict=True)


def test_missing_host_node_cpulist_is_reported() -> None:
    d = run([dev("01")], guest_numa={"cells": {"0": "0-1"}, "vcpupins": {"0": "0"}})
    assert "failed to read CPU list for host NUMA node 0" in d.devices[0].reason


# ---- converter_test.go -------------------------------------------------------------------------------
C_DEVICES = ["0000:81:01.0", "0000:81:02.0", "0000:82:01.0", "0000:82:02.0"]
# guestMappingPassthrough over host node 0 (CPUs 0,1): one guest cell 0 with memnode 0 ← 0.
C_NUMA = {"cells": {"0": "0-1"}, "vcpupins": {"0": "0", "1": "1"}, "memnodes": {"0": "0"},
          "host_node_cpus": {"0": "0-1"}}


def test_c1_one_pxb_four_root_ports() -> None:
    d = run([{"bdf": b, "numa_node": 0} for b in C_DEVICES], guest_numa=C_NUMA, strict=True)
    assert pxbs(d) == [(1, 251, 0)]
    assert ports(d) == [(2, 1, 0), (3, 1, 1), (4, 1, 2), (5, 1, 3)]
    assert [placed_bus(d)[b] for b in C_DEVICES] == [2, 3, 4, 5]


def test_c2_strict_missing_device_numa_fails() -> None:
    devices = [{"bdf": b, "numa_node": None if b.endswith("82:02.0") else 0} for b in C_DEVICES]
    with pytest.raises(PlanError) as exc:
        run(devices, guest_numa=C_NUMA, strict=True)
    assert "strict PCI NUMA-aware placement failed" in exc.value.message and "0000:82:02.0" in exc.value.message


# ---- the VEP example: as upstream builds it, not as the VEP draws it ---------------------------------
VEP_NODE0 = ["03", "04", "05", "06", "07", "08", "41"]
VEP_NODE1 = ["83", "84", "85", "86", "87", "88", "89"]


def vep_decision() -> GuestPciDecision:
    devices = [{"bdf": f"0000:{b}:00.0", "numa_node": 0} for b in VEP_NODE0]
    devices += [{"bdf": f"0000:{b}:00.0", "numa_node": 1} for b in VEP_NODE1]
    random.Random(7).shuffle(devices)
    return decide(parse_request({"devices": devices, "numa_mapping": {"0": 0, "1": 1},
                                 "highest_controller_index": 0, "strict": True}))


def test_vep_example_controllers_and_addresses() -> None:
    d = vep_decision()
    # busNr 248 and 240 are the one thing the VEP's XML and upstream agree on.
    assert pxbs(d) == [(1, 248, 0), (9, 240, 1)]
    assert ports(d) == [(2 + k, 1, k) for k in range(7)] + [(10 + k, 9, k) for k in range(7)]
    bus = placed_bus(d)
    assert [bus[f"0000:{b}:00.0"] for b in VEP_NODE0] == list(range(2, 9))
    assert [bus[f"0000:{b}:00.0"] for b in VEP_NODE1] == list(range(10, 17))
    # A pxb with busNr B is guest bus B and its k-th port's device lands on bus B+1+k (libvirt's
    # docs/pci-addresses.rst): seven devices behind busNr 248 enumerate at f9:00.0 … ff:00.0.
    guest = {p.device.bdf: p.guest_bdf for p in d.devices}
    assert [guest[f"0000:{b}:00.0"] for b in VEP_NODE0] == [f"0000:{x:02x}:00.0" for x in range(0xF9, 0x100)]
    assert [guest[f"0000:{b}:00.0"] for b in VEP_NODE1] == [f"0000:{x:02x}:00.0" for x in range(0xF1, 0xF8)]


def _bus(attr: str) -> int:
    return int(attr, 16)


def test_vep_example_xml_obeys_libvirt_bus_rules() -> None:
    root = ET.fromstring(vep_decision().xml)
    assert root.tag == "devices"
    models = {int(c.get("index", "-1")): c.get("model") for c in root.iter("controller")}
    for c in root.iter("controller"):
        if c.get("model") == EXPANDER_BUS:
            # No <address>, no <model name>: libvirt picks both (upstream emits neither).
            assert c.find("address") is None and c.find("model") is None
            target = c.find("target")
            assert target is not None and target.get("busNr") in {"248", "240"}
            assert target.findtext("node") in {"0", "1"}
        else:
            addr = c.find("address")
            assert addr is not None and models[_bus(addr.get("bus", ""))] == EXPANDER_BUS
    hostdevs = root.findall("hostdev")
    assert len(hostdevs) == 14
    for h in hostdevs:
        addr = h.find("address")
        assert addr is not None and addr.get("slot") == "0x00"
        # The VEP text puts endpoints on the expander buses (bus 0x01/0x02); libvirt refuses that.
        assert models[_bus(addr.get("bus", ""))] == ROOT_PORT
    src = hostdevs[0].find("source/address")
    assert src is not None and src.attrib == {"domain": "0x0000", "bus": "0x03", "slot": "0x00", "function": "0x0"}


# ---- beyond upstream: mdevs, VFs, slot overflow ----------------------------------------------------
MDEV = "4b20d080-1b54-4048-85b3-a6a62d165c01"


def test_mdev_follows_its_parent_node() -> None:
    d = run([{"bdf": "0000:02:00.0", "numa_node": 1, "mdev": MDEV.upper()}, dev("01")])
    by = {p.device.label: p for p in d.devices}
    mdev = by[f"mdev {MDEV} (parent 0000:02:00.0)"]
    assert mdev.status == "placed" and mdev.guest_cell == 1
    host = next(h for h in ET.fromstring(d.xml).iter("hostdev") if h.get("type") == "mdev")
    assert host.get("model") == "vfio-pci"
    src = host.find("source/address")
    assert src is not None and src.get("uuid") == MDEV
    assert host.find("address") is not None


def test_vf_uses_its_own_numa_node() -> None:
    # A VF on host node 1 while its PF sits elsewhere: the VF's own node decides.
    d = run([{"bdf": "0000:3b:00.2", "numa_node": 1}, dev("01")])
    vf = next(p for p in d.devices if p.device.bdf == "0000:3b:00.2")
    assert vf.guest_cell == 1


def test_more_devices_than_pxb_slots() -> None:
    devices = [{"bdf": f"0000:{b:02x}:00.0", "numa_node": 0} for b in range(0x10, 0x31)]  # 33
    relaxed = decide(parse_request({"devices": devices, "numa_mapping": {"0": 0}}))
    assert relaxed.controllers == () and all(p.status == "default" for p in relaxed.devices)
    assert any("32 slots" in w for w in relaxed.warnings)
    with pytest.raises(PlanError, match="32 slots"):
        decide(parse_request({"devices": devices, "numa_mapping": {"0": 0}, "strict": True}))
    ok = decide(parse_request({"devices": devices[:32], "numa_mapping": {"0": 0}}))
    assert max(s for _, _, s in ports(ok)) == 31


def test_direct_mapping_unmapped_node() -> None:
    d = decide(parse_request({"devices": [dev("01"), dev("02")], "numa_mapping": {"1": 0}}))
    by = {p.device.bdf: p for p in d.devices}
    assert by["0000:02:00.0"].guest_cell == 0 and pxbs(d) == [(1, 254, 0)]
    assert by["0000:01:00.0"].status == "default" and "cannot be mapped" in by["0000:01:00.0"].reason


def test_to_json_shape() -> None:
    out = run([dev("01"), dev("06")]).to_json()
    assert out["policy"] == "guest-pci"
    assert out["controllers"][0] == {"index": 1, "model": EXPANDER_BUS, "bus_nr": 254, "node": 0}
    placed, unplaced = out["devices"]
    assert placed["address"] == {"domain": 0, "bus": 2, "slot": 0, "function": 0}
    assert unplaced["status"] == "default" and unplaced["host_numa_node"] == -1
    assert out["xml"].startswith("<devices>")


# ---- invalid requests ------------------------------------------------------------------------------
OK_DEVICE = {"bdf": "0000:01:00.0", "numa_node": 0}


@pytest.mark.parametrize(("request_obj", "field"), [
    ([], "request"),
    ({}, "devices"),
    ({"devices": "0000:01:00.0"}, "devices"),
    ({"devices": ["0000:01:00.0"]}, "devices[0]"),
    ({"devices": [{"bdf": "0000:01:00", "numa_node": 0}]}, "devices[0].bdf"),
    ({"devices": [{"bdf": "0000:01:20.0", "numa_node": 0}]}, "devices[0].bdf"),
    ({"devices": [{"bdf": 1, "numa_node": 0}]}, "devices[0].bdf"),
    ({"devices": [{"bdf": "0000:01:00.0"}]}, "devices[0].numa_node"),
    ({"devices": [{"bdf": "0000:01:00.0", "numa_node": "0"}]}, "devices[0].numa_node"),
    ({"devices": [{"bdf": "0000:01:00.0", "numa_node": -2}]}, "devices[0].numa_node"),
    ({"devices": [{"bdf": "0000:01:00.0", "numa_node": True}]}, "devices[0].numa_node"),
    ({"devices": [{**OK_DEVICE, "vf": True}]}, "devices[0]"),
    ({"devices": [OK_DEVICE, {**OK_DEVICE, "bdf": "0000:01:00.0".upper()}]}, "devices[1]"),
    ({"devices": [{**OK_DEVICE, "mdev": "not-a-uuid"}]}, "devices[0].mdev"),
    ({"devices": [OK_DEVICE, {**OK_DEVICE, "mdev": MDEV}]}, "devices[1]"),
    ({"devices": [{**OK_DEVICE, "guest_address": {"bus": "0xzz"}}]}, "devices[0].guest_address.bus"),
    ({"devices": [{**OK_DEVICE, "guest_address": {"type": "drive", "bus": 0}}]}, "devices[0].guest_address.type"),
    ({"devices": [OK_DEVICE], "strict": "yes"}, "strict"),
    ({"devices": [OK_DEVICE], "highest_controller_index": -1}, "highest_controller_index"),
    ({"devices": [OK_DEVICE], "numa_mapping": {"0": 0}, "guest_numa": {}}, "request"),
    ({"devices": [OK_DEVICE], "numa_mapping": {"a": 0}}, "numa_mapping"),
    ({"devices": [OK_DEVICE], "numa_mapping": {"0": -1}}, "numa_mapping[0]"),
    ({"devices": [OK_DEVICE], "guest_numa": {"host_node_cpus": {"0": "0-"}}}, "host_node_cpus[0]"),
    ({"devices": [OK_DEVICE], "guest_numa": {"cells": {"0": 1}}}, "cells[0]"),
    ({"devices": [OK_DEVICE], "guest_numa": {"host_node_cpus": {"²": "0"}}}, "host_node_cpus"),
    ({"devices": [OK_DEVICE], "numa_mapping": {"²": 0}}, "numa_mapping"),
    ({"devices": [OK_DEVICE], "guest_numa": {"pins": {}}}, "guest_numa"),
    ({"devices": [OK_DEVICE], "controllers": 3}, "request"),
])
def test_invalid_requests(request_obj: Any, field: str) -> None:
    with pytest.raises(PlanError) as exc:
        parse_request(request_obj)
    assert exc.value.code == "invalid_request"
    assert exc.value.message.startswith(f"{field}:"), exc.value.message


def test_libvirt_number_spellings_in_guest_address() -> None:
    req = parse_request({"devices": [{**OK_DEVICE, "guest_address": {"bus": "0x0a", "slot": "010", "function": 3}}]})
    assert req.devices[0].guest_address == {"bus": 10, "slot": 8, "function": 3}


# ---- properties ------------------------------------------------------------------------------------
bdfs = st.builds(lambda b, s, f: f"0000:{b:02x}:{s:02x}.{f}", st.integers(0, 255), st.integers(0, 31),
                 st.integers(0, 7))
device_lists = st.lists(st.tuples(bdfs, st.integers(-1, 4)), max_size=40, unique_by=lambda t: t[0])
mappings = st.dictionaries(st.integers(0, 4), st.integers(0, 3), max_size=5)


@settings(max_examples=300, deadline=None)
@given(device_lists, mappings, st.integers(0, 300), st.randoms(use_true_random=False))
def test_bus_numbers_unique_every_device_one_address_deterministic(
        devices: list[tuple[str, int]], mapping: dict[int, int], highest: int, rnd: random.Random) -> None:
    obj: dict[str, Any] = {"devices": [{"bdf": b, "numa_node": n} for b, n in devices],
           "numa_mapping": {str(k): v for k, v in mapping.items()}, "highest_controller_index": highest}
    d = decide(parse_request(obj))
    bus_nrs = [c.bus_nr for c in d.controllers if c.model == EXPANDER_BUS]
    assert len(bus_nrs) == len(set(bus_nrs))
    assert all(nr is not None and 1 <= nr <= 254 for nr in bus_nrs)
    indexes = [c.index for c in d.controllers]
    assert len(indexes) == len(set(indexes)) and all(i > highest for i in indexes)
    # Every requested device appears once; placed ones own exactly one root port each.
    assert sorted(p.device.bdf for p in d.devices) == sorted(b for b, _ in devices)
    port_index = {c.index for c in d.controllers if c.model == ROOT_PORT}
    used = [p.address.bus for p in d.devices if p.status == "placed" and p.address is not None]
    assert sorted(used) == sorted(port_index)
    for p in d.devices:
        assert (p.status == "placed") == (p.address is not None)
        if p.status == "default":
            assert p.reason
    for h in ET.fromstring(d.xml).iter("hostdev"):
        assert len(h.findall("address")) <= 1
    # Input order never matters.
    shuffled = list(obj["devices"])
    rnd.shuffle(shuffled)
    assert decide(parse_request({**obj, "devices": shuffled})).to_json() == d.to_json()


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=3), st.text(max_size=6), max_size=4),
       st.dictionaries(st.text(max_size=3), st.text(max_size=6), max_size=4),
       st.dictionaries(st.text(max_size=3), st.text(max_size=6), max_size=4),
       st.lists(st.integers(0, 7), max_size=4))
def test_lookup_never_raises_on_garbage(cells: dict[str, str], pins: dict[str, str], memnodes: dict[str, str],
                                        nodes: list[int]) -> None:
    m = map_host_nodes(GuestNuma(cells=cells, vcpupins=pins, memnodes=memnodes, host_node_cpus=HW_CPUS), nodes)
    assert set(m.cells) | set(m.unmapped) <= set(nodes)
    assert not set(m.cells) & set(m.unmapped)
