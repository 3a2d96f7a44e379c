"""Kunlunxin XPUs through xpu-smi.

No Kunlunxin hardware here: the parsers are checked against the recorded outputs in
``../shared/fixtures/kunlunxin`` (facts from its README), and the probe against the synthesized
``tests/fixtures/kunlunxin-p800-8xpu`` host (tools replayed, expected topology from its README and the
shared README's P800 rules), plus small trees for the cases around it.
"""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.cpulist import parse_cpulist
from memtopo.discovery import kunlunxin
from memtopo.discovery.kunlunxin import (
    AsymmetricLink,
    XpuSmiError,
    numa_groups,
    parse_list,
    parse_machine,
    parse_topo,
)
from memtopo.discovery.kunlunxin import (
    strict_bdf as normalize_bdf,
)
from memtopo.discovery.parts import AcceleratorPart, AccelLink
from memtopo.discovery.source import ProbeContext, ProbeResult, State
from memtopo.runner import DEFAULT_TIMEOUT_S, RecordedRunner, Runner, ToolResult
from tests.fixtures import SHARED, extracted
from tests.sysfs_tree import write_tree

FIX = SHARED / "fixtures" / "kunlunxin"
LIST = FIX / "xpu-smi_L_p800_x8.txt"
MACHINE = FIX / "xpu_smi_m_p800_x2.txt"
TOPO_RDMA = FIX / "xpu-smi_topo_m_p800_x8_rdma-columns.txt"
TOPO_LEGEND = FIX / "xpu-smi_topo_m_p800_x8_nic-legend_asymmetric.txt"
HOST = Path(__file__).parents[1] / "fixtures" / "kunlunxin-p800-8xpu"

L_ARGV = ("xpu-smi", "-L")
M_ARGV = ("xpu-smi", "-m")
TOPO_ARGV = ("xpu-smi", "topo", "-m")

# The shared README's P800 facts: XL inside each half and between i and i+4, SYS elsewhere.
HALVES = ((0, 1, 2, 3), (4, 5, 6, 7))
XL_PAIRS = {(a, b) for half in HALVES for a, b in itertools.combinations(half, 2)} | {(i, i + 4) for i in range(4)}
ALL_PAIRS = set(itertools.combinations(range(8), 2))
CPUS = {0: parse_cpulist("0-51,104-155"), 1: parse_cpulist("52-103,156-207")}


def node_of(index: int) -> int:
    return 0 if index < 4 else 1


def link_kinds(links: Sequence[AccelLink]) -> dict[tuple[int, int], str]:
    return {(lk.a, lk.b): lk.kind for lk in links}


# ---- the recorded outputs ------------------------------------------------------------------------------
def test_list_fixture() -> None:
    entries = parse_list(LIST.read_text())
    assert [e.index for e in entries] == list(range(8))
    assert {e.model for e in entries} == {"P800 OAM"}
    assert entries[0].uuid == "GPU-ed733bb8-c4a8-5bb5-9431-14512597fc12"
    assert len({e.uuid for e in entries}) == 8
    assert all(e.uuid.startswith("GPU-") for e in entries)


def test_machine_fixture() -> None:
    text = MACHINE.read_text()
    # The README counts 32 tokens with the quoted model as one: check with an independent tokenizer.
    assert [len(shlex.split(line)) for line in text.splitlines()] == [32, 32]
    lines = parse_machine(text)
    assert [(m.bdf, m.index, m.index2) for m in lines] == [("0000:03:00.0", 0, 0), ("0000:05:00.0", 1, 1)]
    assert [m.serial for m in lines] == ["02K15K624CV00304", "02K15K624CV0030V"]
    assert [m.temperature_c for m in lines] == [36, 39]
    for m in lines:
        assert m.power_w == 86
        assert m.clocks_mhz == (1450,) * 6
        assert (m.l3_used_mib, m.l3_total_mib) == (2, 96)
        assert (m.memory_used_mib, m.memory_total_mib) == (90440, 98304)
        assert m.utilization_pct == 0
        assert m.firmware == "1.0:2.6:1.39.1.7"
        assert m.model == "P800 OAM"


def test_topo_rdma_columns_fixture() -> None:
    topo = parse_topo(TOPO_RDMA.read_text())
    assert topo.xpus == tuple(range(8))
    assert topo.nics == tuple(f"mlx5_{k}" for k in range(5))
    assert topo.asymmetric == ()
    kinds = link_kinds(topo.links)
    assert set(kinds) == ALL_PAIRS
    assert {p for p, k in kinds.items() if k == "XL"} == XL_PAIRS
    assert {k for p, k in kinds.items() if p not in XL_PAIRS} == {"SYS"}
    for aff in topo.affinity:
        assert aff.numa_node == node_of(aff.index)
        assert aff.local_cpus == CPUS[node_of(aff.index)]
    # Row XPU0 of the file: NODE PIX NODE SYS SYS; row XPU6: SYS SYS SYS NODE PIX.
    assert dict(topo.affinity[0].nics) == {"mlx5_0": "NODE", "mlx5_1": "PIX", "mlx5_2": "NODE",
                                           "mlx5_3": "SYS", "mlx5_4": "SYS"}
    assert dict(topo.affinity[6].nics) == {"mlx5_0": "SYS", "mlx5_1": "SYS", "mlx5_2": "SYS",
                                           "mlx5_3": "NODE", "mlx5_4": "PIX"}


def test_topo_nic_legend_asymmetric_fixture() -> None:
    topo = parse_topo(TOPO_LEGEND.read_text())
    sym = parse_topo(TOPO_RDMA.read_text())
    assert topo.nics == tuple(f"mlx5_{k}" for k in range(5))  # NICk resolved through the legend
    assert topo.asymmetric == (AsymmetricLink(0, 4, a_says="SYS", b_says="XL"),)
    # Everything else matches the symmetric file; the disputed pair is in neither list.
    assert link_kinds(topo.links) == {p: k for p, k in link_kinds(sym.links).items() if p != (0, 4)}
    assert topo.affinity == sym.affinity


def test_topo_header_at_column_zero_and_without_leading_blank() -> None:
    lines = TOPO_RDMA.read_text().splitlines()
    assert lines[0] == ""
    text = "\n".join([lines[1].lstrip(), *lines[2:]])
    assert parse_topo(text) == parse_topo(TOPO_RDMA.read_text())


def test_topo_without_affinity_columns_and_na() -> None:
    text = ("      XPU0 XPU1 CPU Affinity NUMA Affinity\n"
            "XPU0  X    XL   N/A          N/A\n"
            "XPU1  XL   X    0-3          -1\n")
    topo = parse_topo(text)
    assert [(a.local_cpus, a.numa_node) for a in topo.affinity] == [((), None), ((0, 1, 2, 3), None)]
    bare = parse_topo("  XPU0 XPU1\nXPU0 X PIX\nXPU1 PIX X\n")
    assert bare.links == (AccelLink(0, 1, "PIX"),)
    assert [(a.local_cpus, a.numa_node, dict(a.nics)) for a in bare.affinity] == [((), None, {})] * 2


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty"),
    ("  GPU0 GPU1\nGPU0 X NV1\n", "no XPU column"),
    ("  XPU0 XPU1\nXPU0 X XL\n", "no row for XPU1"),
    ("  XPU0 XPU1\nXPU0 XL XL\nXPU1 XL X\n", "not 'X' to itself"),
    ("  XPU0 XPU1\nXPU0 X X\nXPU1 X X\n", "'X' \\(self\\) to another"),
    ("  XPU0 XPU1\nXPU0 X\nXPU1 XL X\n", "cells"),
    ("  XPU0 XPU1\nXPU0 X XL\nXPU1 XL X\nXPU1 XL X\n", "two rows"),
    ("  XPU0 XPU1\nXPU0 X XL\nXPU2 XL X\n", "not a column"),
    ("  XPU0 XPU1\nXPU0 X XL\nfoo XL X\n", "neither an XPU nor a NIC"),
    ("  XPU0 XPU0\nXPU0 X X\n", "twice"),
    ("  XPU0 mlx5_0 XPU1\n", "after the NIC columns"),
    ("  XPU0 CPU Affinity mlx5_0\n", "after the affinity columns"),
    ("  XPU0 CPU Affinity\nXPU0 X 0-3-5\n", "CPU Affinity"),
    ("  XPU0 NUMA Affinity\nXPU0 X zero\n", "NUMA Affinity"),
])
def test_topo_garbage_is_a_typed_error(text: str, message: str) -> None:
    with pytest.raises(XpuSmiError, match=message):
        parse_topo(text)


@pytest.mark.parametrize(("text", "message"), [
    ("", "no 'XPU <i>:' lines"),
    ("No devices were found\n", "not an 'XPU"),
    ("XPU 0: P800 OAM\n", "no UUID"),
    ("XPU 0:\n", "no UUID"),
    ("XPU 0: P800  GPU-ed733bb8-c4a8-5bb5-9431-14512597fc12\nXPU 0: P800  GPU-b3509946-0bc6-5744-bd7c-a0b87dadef02\n",
     "twice"),
    ("XPU 99999999: P800 GPU-ed733bb8-c4a8-5bb5-9431-14512597fc12\n", "out of range"),
])
def test_list_garbage_is_a_typed_error(text: str, message: str) -> None:
    with pytest.raises(XpuSmiError, match=message):
        parse_list(text)


def test_list_model_may_be_absent_and_blank_lines_are_skipped() -> None:
    (entry,) = parse_list("\nXPU 3:  GPU-ed733bb8-c4a8-5bb5-9431-14512597fc12\n\n")
    assert (entry.index, entry.model) == (3, "")


def _machine_line(**over: str) -> str:
    tok = shlex.split(MACHINE.read_text().splitlines()[0])
    names = {"bdf": 0, "index": 1, "memory": 18, "model": 21}
    for key, value in over.items():
        tok[names[key]] = value
    return " ".join(t if " " not in t else f'"{t}"' for t in tok)


@pytest.mark.parametrize(("line", "message"), [
    ("00000000:03:00.0 0 0 SERIAL 36", "fields"),
    (_machine_line(bdf="03:00"), "not a PCI address"),
    (_machine_line(index="x"), "device index"),
    (_machine_line(memory="96G"), "memory total"),
    (_machine_line(model="P800"), "quoted model"),
    (_machine_line() + "\n" + _machine_line(), "twice"),
    ("\n\n", "no device lines"),
])
def test_machine_garbage_is_a_typed_error(line: str, message: str) -> None:
    with pytest.raises(XpuSmiError, match=message):
        parse_machine(line)


@pytest.mark.parametrize(("raw", "want"), [
    ("00000000:03:00.0", "0000:03:00.0"),
    ("0000:C1:00.0", "0000:c1:00.0"),
    ("00000009:01:00.0", "0009:01:00.0"),
    ("10000:e1:00.7", "10000:e1:00.7"),
])
def test_normalize_bdf(raw: str, want: str) -> None:
    assert normalize_bdf(raw) == want


@pytest.mark.parametrize("raw", ["", "0000:03:00.8", "0000:3:00.0", "zzzz:03:00.0"])
def test_normalize_bdf_rejects(raw: str) -> None:
    with pytest.raises(XpuSmiError):
        normalize_bdf(raw)


@pytest.mark.parametrize(("indices", "nodes", "want"), [
    (range(8), {}, HALVES),  # the P800 allocation design's positional halves, XPU 0-3 and 4-7
    (range(8), {i: node_of(i) for i in range(8)}, HALVES),
    (range(8), {i: 0 for i in range(8)}, (tuple(range(8)),)),  # one socket: nothing to split
    (range(8), {i: 3 - i % 2 for i in range(8)}, ((1, 3, 5, 7), (0, 2, 4, 6))),  # node order, not index
    (range(8), {i: 0 for i in range(7)}, HALVES),  # one XPU without a node: positional rule for all
    (range(5), {}, ((0, 1), (2, 3, 4))),  # HAMi: index >= n // 2 is the second half
    ((2, 9, 4, 7), {}, ((2, 4), (7, 9))),
    ((0,), {}, ((0,),)),
    ((), {}, ()),
])
def test_numa_groups(indices: Sequence[int], nodes: dict[int, int], want: tuple[tuple[int, ...], ...]) -> None:
    assert numa_groups(list(indices), nodes) == want


# ---- the synthesized host ------------------------------------------------------------------------------
# Extracted once and cached across runs (tests.fixtures.extracted): these tests only read the tree.
@pytest.fixture(scope="module")
def host_root() -> Path:
    return extracted(HOST / "root.tar.gz")


@dataclass
class FakeRunner:
    """The host's recordings, with some argvs answered differently; records every call."""

    base: Runner
    overrides: dict[tuple[str, ...], ToolResult] = field(default_factory=dict)
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def run(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> ToolResult:
        args = tuple(argv)
        self.calls.append(args)
        if args in self.overrides:
            return self.overrides[args]
        return self.base.run(args, timeout)


def run_probe(root: Path, **overrides: ToolResult) -> tuple[ProbeResult[AcceleratorPart], FakeRunner]:
    argvs = {"L": L_ARGV, "m": M_ARGV, "topo": TOPO_ARGV}
    runner = FakeRunner(RecordedRunner.from_dir(root / ".memtopo" / "tools"),
                        {argvs[k]: v for k, v in overrides.items()})
    return kunlunxin.probe(ProbeContext.at_root(root, runner=runner)), runner


def test_synthesized_host(host_root: Path) -> None:
    res, runner = run_probe(host_root)
    assert res.status.state is State.OK, res.status.reasons
    assert res.status.source == kunlunxin.SOURCE == "xpu-smi"
    assert sorted(runner.calls) == sorted([L_ARGV, M_ARGV, TOPO_ARGV])
    part = res.data
    uuids = [e.uuid for e in parse_list(LIST.read_text())]
    assert [d.index for d in part.devices] == list(range(8))
    for dev in part.devices:
        node = node_of(dev.index)
        assert (dev.kind, dev.vendor, dev.model) == ("XPU", "Kunlunxin", "P800 OAM")
        assert dev.uuid == uuids[dev.index]
        assert dev.memory_bytes == 98304 * 2**20
        assert dev.health == ""  # no xpu-smi view that we run states it
        assert dev.numa_node == node
        assert dev.attributes["firmware_version"] == "1.0:2.6:1.39.1.7"
        assert "index_field2" not in dev.attributes
        # Cross-check against the tree itself: the BDF exists, is a 1d22 function on that node, and
        # the CPUs the tool names are that node's.
        pci = host_root / "sys/bus/pci/devices" / dev.bdf
        assert (pci / "vendor").read_text().strip() == "0x1d22"
        assert int((pci / "numa_node").read_text()) == node
        assert dev.local_cpus == parse_cpulist((host_root / f"sys/devices/system/node/node{node}/cpulist")
                                               .read_text())
    assert [d.bdf for d in part.devices[:2]] == ["0000:03:00.0", "0000:05:00.0"]  # the real capture's
    assert [d.attributes["serial"] for d in part.devices[:2]] == ["02K15K624CV00304", "02K15K624CV0030V"]
    assert [d.attributes["pix_nics"] for d in part.devices] == ["mlx5_1"] * 2 + ["mlx5_2"] * 2 + \
        ["mlx5_3"] * 2 + ["mlx5_4"] * 2
    kinds = link_kinds(part.links)
    assert set(kinds) == ALL_PAIRS
    assert {p for p, k in kinds.items() if k == "XL"} == XL_PAIRS
    assert all(k == "SYS" for p, k in kinds.items() if p not in XL_PAIRS)
    assert all(lk.a < lk.b and lk.count == 0 for lk in part.links)
    assert part.groups == HALVES


def test_fallback_tool_name(host_root: Path) -> None:
    """Older SDKs install only ``xpu_smi``."""
    base = RecordedRunner.from_dir(host_root / ".memtopo" / "tools")
    renamed = RecordedRunner({("xpu_smi", *a[1:]): r for a, r in base.recordings.items()})
    res = kunlunxin.probe(ProbeContext.at_root(host_root, runner=renamed))
    assert res.status.state is State.OK, res.status.reasons
    assert len(res.data.devices) == 8 and res.data.groups == HALVES


# ---- fault table ---------------------------------------------------------------------------------------
def _fault(argv: tuple[str, ...], fault: str) -> ToolResult:
    return {
        "missing": ToolResult(argv, None, "", failure=f"{argv[0]}: not found"),
        "timeout": ToolResult(argv, None, "", failure=f"{argv[0]}: timed out after 10s"),
        "exit1": ToolResult(argv, 1, "", "xpu-smi: internal error\n", failure=f"{argv[0]}: exit status 1"),
        "garbage": ToolResult(argv, 0, "Segmentation fault\n\x00\x01 ### \n"),
    }[fault]


FAULTS = ("missing", "timeout", "exit1", "garbage")


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_list(host_root: Path, fault: str) -> None:
    res, _ = run_probe(host_root, L=_fault(L_ARGV, fault))
    assert res.status.state is State.DEGRADED
    assert any(r.startswith("xpu-smi -L: ") for r in res.status.reasons), res.status.reasons
    devs = res.data.devices
    # -m and topo still give every device, its BDF, memory, NUMA node; the serial stands in for the UUID.
    assert [d.index for d in devs] == list(range(8))
    assert [d.uuid for d in devs] == [m.attributes["serial"] for m in devs]
    assert all(d.bdf and d.memory_bytes == 98304 * 2**20 and d.model == "P800 OAM" for d in devs)
    assert [d.numa_node for d in devs] == [node_of(i) for i in range(8)]
    assert {(lk.a, lk.b) for lk in res.data.links if lk.kind == "XL"} == XL_PAIRS
    assert res.data.groups == HALVES


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_machine(host_root: Path, fault: str) -> None:
    res, _ = run_probe(host_root, m=_fault(M_ARGV, fault))
    assert res.status.state is State.DEGRADED
    assert any(r.startswith("xpu-smi -m: ") for r in res.status.reasons), res.status.reasons
    devs = res.data.devices
    assert [d.index for d in devs] == list(range(8))
    assert all(d.uuid.startswith("GPU-") and d.model == "P800 OAM" for d in devs)
    assert all(d.bdf == "" and d.memory_bytes == 0 and "serial" not in d.attributes for d in devs)
    assert [d.local_cpus for d in devs] == [CPUS[node_of(i)] for i in range(8)]
    assert len(res.data.links) == 28
    assert res.data.groups == HALVES  # from the topo's NUMA Affinity


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_topo(host_root: Path, fault: str) -> None:
    res, _ = run_probe(host_root, topo=_fault(TOPO_ARGV, fault))
    assert res.status.state is State.DEGRADED
    assert any(r.startswith("xpu-smi topo -m: ") for r in res.status.reasons), res.status.reasons
    devs = res.data.devices
    assert [d.index for d in devs] == list(range(8))
    assert all(d.uuid.startswith("GPU-") and d.bdf for d in devs)
    # The tool no longer states locality, so the devices carry none ...
    assert all(d.numa_node is None and d.local_cpus == () for d in devs)
    assert res.data.links == ()
    # ... but the halves still come from each BDF's sysfs numa_node.
    assert res.data.groups == HALVES


@pytest.mark.parametrize("fault", ["missing", "timeout", "exit1"])
def test_every_call_failing(host_root: Path, fault: str) -> None:
    res, _ = run_probe(host_root, L=_fault(L_ARGV, fault), m=_fault(M_ARGV, fault),
                       topo=_fault(TOPO_ARGV, fault))
    if fault == "missing":
        assert res.status.state is State.UNAVAILABLE
        assert "not found" in res.status.reasons[0]
    else:
        assert res.status.state is State.DEGRADED
        assert len(res.status.reasons) == 3
    assert res.data == AcceleratorPart()


def test_output_of_a_failed_call_is_still_used(host_root: Path) -> None:
    text = (host_root / ".memtopo/tools/xpu-smi_m.txt").read_text()
    res, _ = run_probe(host_root, m=ToolResult(M_ARGV, 1, text, failure="xpu-smi: exit status 1"))
    assert res.status.reasons == ("xpu-smi -m: xpu-smi: exit status 1",)
    assert all(d.bdf for d in res.data.devices)


def test_asymmetric_matrix_degrades_and_drops_the_pair(host_root: Path) -> None:
    res, _ = run_probe(host_root, topo=ToolResult(TOPO_ARGV, 0, TOPO_LEGEND.read_text()))
    assert res.status.state is State.DEGRADED
    (reason,) = res.status.reasons
    assert "asymmetric" in reason and "XPU0–XPU4" in reason and "SYS" in reason and "XL" in reason
    kinds = link_kinds(res.data.links)
    assert (0, 4) not in kinds and set(kinds) == ALL_PAIRS - {(0, 4)}
    assert res.data.groups == HALVES


def test_views_that_disagree_are_named(host_root: Path) -> None:
    lines = (host_root / ".memtopo/tools/xpu-smi_L.txt").read_text().splitlines()[:6]
    res, _ = run_probe(host_root, L=ToolResult(L_ARGV, 0, "\n".join(lines)))
    assert res.status.state is State.DEGRADED
    assert any("disagree" in r and "xpu-smi -L lists 0,1,2,3,4,5" in r for r in res.status.reasons)
    assert len(res.data.devices) == 8  # the union: XPU6/7 still come from -m and topo


def test_topo_numa_disagreeing_with_sysfs_is_named(host_root: Path) -> None:
    text = TOPO_RDMA.read_text().replace("XPU7   SYS  SYS  SYS  XL   XL   XL   XL   X    SYS    SYS    SYS    "
                                         "NODE   PIX    52-103,156-207 1",
                                         "XPU7   SYS  SYS  SYS  XL   XL   XL   XL   X    SYS    SYS    SYS    "
                                         "NODE   PIX    52-103,156-207 0")
    assert text != TOPO_RDMA.read_text()
    res, _ = run_probe(host_root, topo=ToolResult(TOPO_ARGV, 0, text))
    assert any("XPU7" in r and "NUMA 0" in r and "numa_node says 1" in r for r in res.status.reasons)
    assert res.data.devices[7].numa_node == 0  # the tool's word is reported, the conflict named


def test_index_columns_that_differ_are_kept(host_root: Path) -> None:
    text = (host_root / ".memtopo/tools/xpu-smi_m.txt").read_text().replace(
        "00000000:AC:00.0 7 7 ", "00000000:AC:00.0 7 2 ")
    res, _ = run_probe(host_root, m=ToolResult(M_ARGV, 0, text))
    assert res.status.state is State.OK
    assert res.data.devices[7].attributes["index_field2"] == "2"


def test_bdf_not_on_pci_is_named(host_root: Path) -> None:
    text = (host_root / ".memtopo/tools/xpu-smi_m.txt").read_text().replace("00000000:AC:00.0", "00000000:AD:00.0")
    res, _ = run_probe(host_root, m=ToolResult(M_ARGV, 0, text))
    assert any("0000:ad:00.0" in r and "not a Kunlunxin device" in r for r in res.status.reasons)


# ---- when the probe must not run the tool --------------------------------------------------------------
def _pci(bdf: str, vendor: int, device: int, cls: int, node: int = 0) -> dict[str, str]:
    base = f"sys/bus/pci/devices/{bdf}"
    return {f"{base}/vendor": f"0x{vendor:04x}", f"{base}/device": f"0x{device:04x}",
            f"{base}/class": f"0x{cls:06x}", f"{base}/numa_node": str(node)}


def _probe_tree(tmp_path: Path, spec: dict[str, str]) -> tuple[ProbeResult[AcceleratorPart], FakeRunner]:
    root = write_tree(tmp_path, {"proc/self/status": "Name:\tx", **spec})
    runner = FakeRunner(RecordedRunner({
        L_ARGV: ToolResult(L_ARGV, 0, "XPU 0: P800 OAM  GPU-ed733bb8-c4a8-5bb5-9431-14512597fc12\n"),
        M_ARGV: ToolResult(M_ARGV, 0, MACHINE.read_text().splitlines()[0]),
        TOPO_ARGV: ToolResult(TOPO_ARGV, 0, "  XPU0 CPU Affinity NUMA Affinity\nXPU0 X 0-3 0\n"),
    }))
    return kunlunxin.probe(ProbeContext.at_root(root, runner=runner)), runner


@pytest.mark.parametrize("spec", [
    {},  # no PCI at all
    _pci("0000:03:00.0", 0x10DE, 0x2330, 0x030200),  # an NVIDIA GPU only
    _pci("0000:03:00.0", 0x1D22, 0x1380, 0x018000),  # Baidu's storage function shares the vendor id
    _pci("0000:03:00.0", 0x8086, 0x0BD5, 0x038000),  # Intel GPU: their xpu-smi must not be run
])
def test_no_kunlunxin_device_means_unavailable_and_no_tool_run(tmp_path: Path, spec: dict[str, str]) -> None:
    res, runner = _probe_tree(tmp_path, spec)
    assert res.status.state is State.UNAVAILABLE
    assert "no Kunlunxin devices" in res.status.reasons[0]
    assert runner.calls == []
    assert res.data == AcceleratorPart()


@pytest.mark.parametrize("spec", [
    _pci("0000:03:00.0", 0x1D22, 0x3688, 0x120000),  # P800
    _pci("0000:03:00.0", 0x1D22, 0x9999, 0x120000),  # an unknown Kunlunxin accelerator id
    {"dev/xpuctrl": ""},  # the control node alone (PCI not in the capture)
])
def test_kunlunxin_evidence_runs_the_tool(tmp_path: Path, spec: dict[str, str]) -> None:
    res, runner = _probe_tree(tmp_path, spec)
    assert len(runner.calls) == 3
    (dev,) = res.data.devices
    assert (dev.index, dev.bdf, dev.numa_node, dev.local_cpus) == (0, "0000:03:00.0", 0, (0, 1, 2, 3))
    assert res.data.groups == ((0,),)
    if "dev/xpuctrl" in spec:  # the BDF from -m is not on this tree's PCI bus, and that is said
        assert res.status.state is State.DEGRADED
    else:
        assert res.status.state is State.OK, res.status.reasons


def test_xml_input_is_unavailable() -> None:
    res = kunlunxin.probe(ProbeContext.at_root("/", hwloc_xml=Path("a.xml")))
    assert res.status.state is State.UNAVAILABLE


# ---- property tests ------------------------------------------------------------------------------------
FIXTURE_TEXTS = [p.read_text() for p in (LIST, MACHINE, TOPO_RDMA, TOPO_LEGEND)]


def parse_or_error(parser: str, text: str) -> None:
    """Either a typed error, or a result that holds together: nothing in between, nothing else raised."""
    try:
        if parser == "list":
            entries = parse_list(text)
            assert entries and [e.index for e in entries] == sorted({e.index for e in entries})
        elif parser == "machine":
            lines = parse_machine(text)
            assert lines and [m.index for m in lines] == sorted({m.index for m in lines})
            assert all(normalize_bdf(m.bdf) == m.bdf for m in lines)
        else:
            topo = parse_topo(text)
            n = len(topo.xpus)
            assert [a.index for a in topo.affinity] == sorted(topo.xpus)
            assert len(topo.links) + len(topo.asymmetric) == n * (n - 1) // 2
            assert all(lk.a < lk.b and {lk.a, lk.b} <= set(topo.xpus) for lk in topo.links)
    except XpuSmiError:
        pass


PARSERS = ("list", "machine", "topo")


@settings(max_examples=300)
@given(st.text(), st.sampled_from(PARSERS))
def test_parsers_on_garbage(text: str, parser: str) -> None:
    parse_or_error(parser, text)


@st.composite
def mutated_fixture(draw: st.DrawFn) -> str:
    """A real output with a few characters replaced, deleted or inserted: reaches the deep paths."""
    chars = list(draw(st.sampled_from(FIXTURE_TEXTS)))
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(chars) - 1))
        op = draw(st.sampled_from(("replace", "delete", "insert")))
        ch = draw(st.sampled_from([*" \n\tX0-9:,\"ALSYmlxNIC", draw(st.characters())]))
        if op == "replace":
            chars[pos] = ch
        elif op == "delete":
            del chars[pos]
        else:
            chars.insert(pos, ch)
    return "".join(chars)


@settings(max_examples=300)
@given(mutated_fixture(), st.sampled_from(PARSERS))
def test_parsers_on_mutated_fixtures(text: str, parser: str) -> None:
    parse_or_error(parser, text)


@settings(max_examples=100)
@given(st.lists(st.tuples(st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12),
                          st.uuids()), min_size=1, max_size=16))
def test_list_round_trip(devices: list[tuple[str, object]]) -> None:
    text = "".join(f"XPU {i}: {model} OAM  GPU-{uuid}\n" for i, (model, uuid) in enumerate(devices))
    entries = parse_list(text)
    assert [(e.index, e.model, e.uuid) for e in entries] == \
        [(i, f"{m} OAM", f"GPU-{u}") for i, (m, u) in enumerate(devices)]


@st.composite
def topo_case(draw: st.DrawFn) -> tuple[int, dict[tuple[int, int], str], list[int], list[str]]:
    n = draw(st.integers(1, 10))
    kinds = {p: draw(st.sampled_from(("XL", "SYS", "NODE", "PIX", "PXB", "PHB")))
             for p in itertools.combinations(range(n), 2)}
    nodes = [draw(st.integers(0, 3)) for _ in range(n)]
    nics = [f"mlx5_{k}" for k in range(draw(st.integers(0, 3)))]
    return n, kinds, nodes, nics


@settings(max_examples=100)
@given(topo_case(), st.booleans())
def test_topo_round_trip(case: tuple[int, dict[tuple[int, int], str], list[int], list[str]], legend: bool) -> None:
    n, kinds, nodes, nics = case
    labels = [f"NIC{k}" for k in range(len(nics))] if legend else nics
    rows = ["", "      " + " ".join([*(f"XPU{i}" for i in range(n)), *labels, "CPU Affinity", "NUMA Affinity"])]
    for i in range(n):
        cells = ["X" if i == j else kinds[(min(i, j), max(i, j))] for j in range(n)]
        rows.append(" ".join([f"XPU{i}", *cells, *("SYS" for _ in nics), f"{nodes[i] * 8}-{nodes[i] * 8 + 7}",
                              str(nodes[i])]))
    rows += ["", "Legend:", "  X = Self"]
    if legend:
        rows += ["", "NIC Legend:", *(f"  NIC{k}: {name}" for k, name in enumerate(nics))]
    topo = parse_topo("\n".join(rows))
    assert link_kinds(topo.links) == kinds
    assert topo.nics == tuple(nics)
    assert [(a.numa_node, a.local_cpus) for a in topo.affinity] == \
        [(nd, tuple(range(nd * 8, nd * 8 + 8))) for nd in nodes]
    groups = numa_groups(range(n), {a.index: a.numa_node for a in topo.affinity if a.numa_node is not None})
    assert sorted(i for g in groups for i in g) == list(range(n))
    assert all(len({nodes[i] for i in g}) == 1 for g in groups)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300), st.text(max_size=300), st.text(max_size=300), st.booleans())
def test_probe_never_raises(host_root: Path, l_out: str, m_out: str, topo_out: str, fail: bool) -> None:
    failure = "xpu-smi: exit status 3" if fail else None
    res, _ = run_probe(host_root, L=ToolResult(L_ARGV, 3 if fail else 0, l_out, failure=failure),
                       m=ToolResult(M_ARGV, 0, m_out), topo=ToolResult(TOPO_ARGV, 0, topo_out))
    assert res.status.state in (State.OK, State.DEGRADED)
    if fail:
        assert res.status.state is State.DEGRADED


def test_given_the_pci_part_the_probe_reads_no_vendor_ids(host_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given sysfs.pci's part (as collect() passes it, discovery/probes.py) the probe takes the PCI
    functions from it instead of reading every function's vendor again, and reports the same
    devices as when it scans alone."""
    from memtopo.discovery import sysfs_pci

    alone = kunlunxin.probe(ProbeContext.at_root(host_root)).data
    ctx = ProbeContext.at_root(host_root)
    pci = sysfs_pci.probe(ctx)
    assert pci.status.state is State.OK
    opened: list[str] = []
    real_read_int = type(ctx.fs).read_int

    def counting(fs: object, rel: str, base: int = 10) -> int:
        opened.append(rel)
        return real_read_int(fs, rel, base)  # type: ignore[arg-type]

    monkeypatch.setattr(type(ctx.fs), "read_int", counting)
    assert kunlunxin.probe(ctx, pci).data == alone
    assert not [r for r in opened if r.endswith("/vendor")]
    assert len(alone.devices) == 8


def test_when_the_pci_probe_fails_the_probe_scans_for_itself(host_root: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """In a discovery whose sysfs.pci probe raised, kunlunxin still runs (its part is None) and
    finds the devices by scanning the bus itself."""
    from memtopo.discovery import discover, sysfs_pci
    from memtopo.v1 import topology_pb2 as pb

    def broken(ctx: ProbeContext) -> object:
        raise RuntimeError("bug")

    monkeypatch.setattr(sysfs_pci, "probe", broken)
    topo = discover.discover(ProbeContext.at_root(host_root))
    states = {s.source: s for s in topo.sources}
    assert states["sysfs.pci"].state == pb.SOURCE_STATE_DEGRADED
    assert states["sysfs.pci"].reasons[0].startswith("probe failed: RuntimeError")
    assert states["xpu-smi"].state == pb.SOURCE_STATE_OK
    assert len([a for a in topo.accelerators if a.vendor == "Kunlunxin"]) == 8
