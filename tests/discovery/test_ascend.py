"""npu-smi probe: every recorded npu-smi output in ../shared/fixtures/ascend{,910} parses to the facts
its README states, upstream's unit-test vectors give upstream's answers, the two synthesized hosts
(A2 8×910B, A3 16 NPUs) come out of ``probe`` as their READMEs say, and faults degrade the source.

No Ascend hardware here: everything runs on real captured outputs and trees synthesized in the
documented formats (tests/fixtures/ascend-*/README.md).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.cpulist import parse_cpulist
from memtopo.discovery import ascend
from memtopo.discovery.ascend import (
    ARGV_INFO,
    ARGV_MAP,
    ARGV_TOPO,
    NpuMap,
    NpuSmiError,
    NpuSmiInfo,
    NpuTopo,
    affinity_by_npu,
    build_part,
    classify_series,
    parse_board,
    parse_info,
    parse_npu_map,
    parse_topo,
    running_logical_ids,
    running_npus,
    topo_affinity,
)
from memtopo.discovery.parts import AcceleratorPart
from memtopo.discovery.source import ProbeContext, ProbeResult, State
from memtopo.runner import DEFAULT_TIMEOUT_S, RECORDED_TOOLS_DIR, RecordedRunner, ToolResult
from tests.fixtures import SHARED, extracted

ASCEND = SHARED / "fixtures" / "ascend"
ASCEND910 = SHARED / "fixtures" / "ascend910"
UT = ASCEND / "upstream-ut"
SYNTH = ASCEND / "synthesized"
HOSTS = Path(__file__).parents[1] / "fixtures"
MIB = 1 << 20


def text(path: Path) -> str:
    return path.read_text()


def as_map(m: NpuMap) -> dict[int, dict[int, int]]:
    """The upstream {card: {chip: logic}} shape, for comparing with the README."""
    out: dict[int, dict[int, int]] = {}
    for c in m.chips:
        out.setdefault(c.card, {})[c.chip] = c.logical
    return out


def cpus(spec: str) -> tuple[int, ...]:
    return parse_cpulist(spec)


# ---- npu-smi info -m: every file, README facts ------------------------------------------------------
MAP_FACTS: dict[Path, dict[int, dict[int, int]]] = {
    ASCEND / "npu-smi-info-m-a2-910b3.txt": {0: {0: 0}, 1: {0: 1}},
    ASCEND / "npu-smi-info-m-a3-partial.txt": {0: {0: 0, 1: 1}, 1: {0: 2}},
    UT / "ut-npu-smi-info-m-basic.txt": {0: {0: 0}, 1: {0: 1}},  # P1
    UT / "ut-npu-smi-info-m-phyid.txt": {0: {0: 0, 1: 1}},  # P2
    UT / "ut-npu-smi-info-m-npuid8.txt": {8: {0: 0}, 9: {0: 1}},  # P3
    UT / "ut-npu-smi-info-m-ascend950.txt": {0: {0: 0}, 1: {0: 1}, 2: {0: 2}},  # P4
    SYNTH / "npu-smi-info-m-a2-8npu.txt": {i: {0: i} for i in range(8)},
    SYNTH / "npu-smi-info-m-a3-16npu.txt": {c: {0: 2 * c, 1: 2 * c + 1} for c in range(8)},
}


@pytest.mark.parametrize("path", list(MAP_FACTS), ids=lambda p: p.name)
def test_map_files(path: Path) -> None:
    m = parse_npu_map(text(path))
    assert as_map(m) == MAP_FACTS[path]
    assert m.logical_ids == tuple(sorted(lid for chips in MAP_FACTS[path].values() for lid in chips.values()))
    assert m.problems == ()
    # Mcu rows never become NPUs
    assert all("Mcu" not in c.name for c in m.chips)


def test_map_details() -> None:
    a2 = parse_npu_map(text(ASCEND / "npu-smi-info-m-a2-910b3.txt"))
    assert [c.name for c in a2.chips] == ["Ascend 910B3", "Ascend 910B3"]  # the name keeps its space
    a3 = parse_npu_map(text(SYNTH / "npu-smi-info-m-a3-16npu.txt"))
    assert all(c.phy_id == c.logical for c in a3.chips)
    # "Chip Phy-ID Chip Name" separated by one space still locates both columns
    phy = parse_npu_map(text(UT / "ut-npu-smi-info-m-phyid.txt"))
    assert [(c.phy_id, c.name) for c in phy.chips] == [(0, "Ascend"), (1, "Ascend")]
    a950 = parse_npu_map(text(UT / "ut-npu-smi-info-m-ascend950.txt"))
    assert not a950.has_logic_column and [c.name for c in a950.chips] == ["Ascend950DT"] * 3


@pytest.mark.parametrize(("body", "problem"), [
    ("NPU ID  Chip ID  Chip Logic ID\n0 0 0\n0 1 0\n", "listed twice"),
    ("NPU ID  Chip ID  Chip Logic ID\n0\n1 0 1\n", "fields"),
    ("NPU ID  Chip ID  Chip Logic ID\nx 0 0\n1 0 1\n", "not a number"),
])
def test_map_bad_rows_are_problems_not_crashes(body: str, problem: str) -> None:
    m = parse_npu_map(body)
    assert any(problem in p for p in m.problems)
    assert m.logical_ids in ((0,), (1,))


@pytest.mark.parametrize("body", ["", "  \n\t\n", "Chip ID  Chip Name\n0 x\n", "garbage"])
def test_map_garbage_raises(body: str) -> None:
    with pytest.raises(NpuSmiError):
        parse_npu_map(body)


# ---- npu-smi info: device table and process table ---------------------------------------------------
@dataclass(frozen=True)
class InfoFacts:
    name: str
    health: Sequence[str]
    buses: Sequence[str]  # per table row, in order
    process_header: str
    processes: Sequence[tuple[int, int | None, int | None]] = ()  # (card, chip, pid)
    memory: Sequence[tuple[int, int]] | None = None  # Memory-Usage used/total per row
    hbm: Sequence[tuple[int, int]] | None = None
    chips: Sequence[tuple[int, int, int | None]] | None = None  # (card, chip, phy) per row


A3_16_BUSES = ["9D", "9F", "99", "9B", "95", "97", "91", "93", "8D", "8F", "89", "8B", "85", "87", "81", "83"]
INFO_FACTS: dict[Path, InfoFacts] = {
    ASCEND / "npu-smi-info-a2-910b3-8npu-noproc.txt": InfoFacts(
        "910B3", ["OK"] * 8, ["C1", "C2", "81", "82", "01", "02", "41", "42"], process_header=""),
    ASCEND / "npu-smi-info-a2-910b2c-2npu-proc.txt": InfoFacts(
        "910B2C", ["OK"] * 2, ["5A", "19"], "NPU Chip", [(0, 0, 124528)],
        hbm=[(20701, 65536), (20687, 65536)]),
    ASCEND / "npu-smi-info-a3-2card-4chip-proc.txt": InfoFacts(
        "Ascend910", ["OK"] * 4, ["9C", "9E", "37", "39"], "NPU Chip", [(1, 1, 990711)],
        chips=[(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]),
    ASCEND / "npu-smi-info-a3-8card-16chip-noproc.txt": InfoFacts(
        "Ascend910", ["OK"] * 16, A3_16_BUSES, "NPU Chip",
        chips=[(p // 2, p % 2, p) for p in range(16)]),
    ASCEND910 / "npu-smi_info_910A_x8.txt": InfoFacts(
        "910A", ["OK"] * 8, ["C1", "81", "41", "01", "C2", "82", "42", "02"], process_header="",
        memory=[(591, 14795), (303, 15177), (1821, 15177), (3168, 15088),
                (295, 14795), (455, 15177), (1517, 15177), (3319, 15088)],
        hbm=[(0, 32768)] * 8),
    ASCEND910 / "npu-smi_info_910A_x4_warning_proc.txt": InfoFacts(
        "910A", ["Warning"] * 4, ["C1", "81", "41", "01"], "NPU Chip",
        memory=[(938, 15137), (1820, 15137), (1667, 15137), (2777, 15039)],
        hbm=[(3, 32768), (3, 32768), (30750, 32768), (0, 32768)]),
}


@pytest.mark.parametrize("path", list(INFO_FACTS), ids=lambda p: p.name)
def test_info_files(path: Path) -> None:
    facts = INFO_FACTS[path]
    info = parse_info(text(path))
    assert info.problems == ()
    assert [c.name for c in info.chips] == [facts.name] * len(facts.buses)
    assert [c.health for c in info.chips] == list(facts.health)
    assert [c.bdf for c in info.chips] == [f"0000:{b.lower()}:00.0" for b in facts.buses]
    assert info.process_header == facts.process_header
    assert [(p.card, p.chip, p.pid) for p in info.processes] == list(facts.processes)
    if facts.memory is not None:
        assert [(c.memory_used_mb, c.memory_total_mb) for c in info.chips] == list(facts.memory)
    if facts.hbm is not None:
        assert [(c.hbm_used_mb, c.hbm_total_mb) for c in info.chips] == list(facts.hbm)
    if facts.chips is not None:
        assert [(c.card, c.chip, c.phy_id) for c in info.chips] == list(facts.chips)
    else:
        assert [(c.card, c.chip) for c in info.chips] == [(i, 0) for i in range(len(facts.buses))]


def test_info_versions() -> None:
    assert parse_info(text(ASCEND / "npu-smi-info-a2-910b3-8npu-noproc.txt")).version == "24.1.rc1.b030"
    assert parse_info(text(ASCEND910 / "npu-smi_info_910A_x8.txt")).version == "20.2.2.spc001"


def test_info_310p_duo_device_column() -> None:
    # 310P Duo (public nvtop issue #421, npu-smi 25.2.0): second header row "Chip    Device", no HBM column.
    body = "\n".join([
        "| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |",
        "| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |",
        "+===============================+=================+======================================================+",
        "| 2       310P3                 | OK              | NA           45                0     / 0             |",
        "| 0       0                     | 0000:01:00.0    | 0            1529 / 44280                            |",
        "+-------------------------------+-----------------+------------------------------------------------------+",
        "| 2       310P3                 | OK              | NA           43                0     / 0             |",
        "| 1       1                     | 0000:01:00.0    | 0            1412 / 43693                            |",
        "+===============================+=================+======================================================+",
    ])
    info = parse_info(body)
    assert [(c.card, c.chip, c.device_id, c.phy_id) for c in info.chips] == [(2, 0, 0, None), (2, 1, 1, None)]
    assert [(c.memory_total_mb, c.hbm_total_mb) for c in info.chips] == [(44280, None), (43693, None)]
    part, problems = build_part(None, info, None)
    assert problems and [d.memory_bytes for d in part.devices] == [44280 * MIB, 43693 * MIB]
    assert {d.attributes["series"] for d in part.devices} == {"310P"}


def test_info_broken_rows_are_problems() -> None:
    body = "\n".join([
        "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|",
        "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
        "+===========================+===============+====================================================+",
        "| 0     910B3               | OK            | 101.8       43                0    / 0             |",
        "+===========================+===============+====================================================+",
        "| 1     910B3               | OK            | 92.0        39                0    / 0             |",
        "| 0                         | bogus         | 0           0    / 0          3314 / 65536         |",
        "+===========================+===============+====================================================+",
        "| 0                         | 0000:C1:00.0  | 0           0    / 0          3318 / 65536         |",
    ])
    info = parse_info(body)
    assert [(c.card, c.bdf, c.hbm_total_mb) for c in info.chips] == [(1, "", 65536)]
    assert any("NPU 0 row has no chip row" in p for p in info.problems)
    assert any("not a PCI address" in p for p in info.problems)
    assert any("not an NPU row" in p for p in info.problems)


@pytest.mark.parametrize("body", ["", "garbage\n", "+----+\n|  |\n", "| a | b | c |"])
def test_info_garbage_raises(body: str) -> None:
    with pytest.raises(NpuSmiError):
        parse_info(body)


# ---- upstream process-table vectors (vllm-ascend's npu-smi parser unit tests) ------------------------
BASIC = parse_npu_map(text(UT / "ut-npu-smi-info-m-basic.txt"))
TWO_DIE = parse_npu_map(text(UT / "ut-npu-smi-info-m-phyid.txt"))


@pytest.mark.parametrize(("name", "npu_map", "visible", "want"), [
    ("ut-npu-smi-info-proc-basic.txt", BASIC, None, (0, 1)),
    ("ut-npu-smi-info-proc-npu1.txt", BASIC, None, (1,)),  # P8
    ("ut-npu-smi-info-proc-malformed-rows.txt", TWO_DIE, (1, 5), (1,)),  # P9
    ("ut-npu-smi-info-proc-malformed-rows.txt", TWO_DIE, None, (0, 1)),
    ("ut-npu-smi-info-proc-separator.txt", parse_npu_map("NPU ID  Chip ID  Chip Logic ID\n0 0 0"), None, (0,)),
    ("ut-npu-smi-info-proc-npu-id.txt", BASIC, None, (0, 1)),  # P11
    ("ut-npu-smi-info-proc-npu-chip-wide.txt", BASIC, None, (0, 1)),  # P12
])
def test_upstream_running_vectors(name: str, npu_map: NpuMap, visible: tuple[int, ...] | None,
                                  want: tuple[int, ...]) -> None:
    assert running_logical_ids(parse_info(text(UT / name)), npu_map, visible) == want


@pytest.mark.parametrize(("name", "npu_map", "match"), [
    ("ut-npu-smi-info-proc-unknown-chip.txt", BASIC, "no Chip Logic ID"),  # P6
    ("ut-npu-smi-info-proc-npu-id-ambiguous.txt", TWO_DIE, "2 mapped chips"),  # P13
])
def test_upstream_unresolvable_rows(name: str, npu_map: NpuMap, match: str) -> None:
    with pytest.raises(NpuSmiError, match=match):
        running_logical_ids(parse_info(text(UT / name)), npu_map)


def test_upstream_resolve_and_empty() -> None:
    assert parse_npu_map("NPU ID  Chip ID  Chip Logic ID\n7 0 7").logical_of(7, None) == 7  # P14
    assert TWO_DIE.logical_of(0, 1) == 1  # P15
    with pytest.raises(NpuSmiError):  # P7: upstream "Can not get running npu info."
        parse_info("")
    # P5: ids that are not numbers never become logical ids
    assert parse_npu_map("NPU ID  Chip ID  Chip Logic ID\n0 0 0\n0 2 abc\n1 0 2").logical_ids == (0, 2)


def test_real_process_tables_running_sets() -> None:
    # README: (0, 0) pid 124528 → logical 0; A3 (1, 1) pid 990711 → logical 3 with card*2+chip.
    b2c = parse_info(text(ASCEND / "npu-smi-info-a2-910b2c-2npu-proc.txt"))
    assert running_logical_ids(b2c, BASIC) == (0,)
    a3 = parse_info(text(ASCEND / "npu-smi-info-a3-2card-4chip-proc.txt"))
    a3_map = parse_npu_map("NPU ID  Chip ID  Chip Logic ID\n" + "\n".join(
        f"{c} {k} {2 * c + k}" for c in range(2) for k in range(2)))
    assert running_logical_ids(a3, a3_map) == (3,)
    for noproc in (ASCEND / "npu-smi-info-a3-8card-16chip-noproc.txt",
                   ASCEND910 / "npu-smi_info_910A_x4_warning_proc.txt",
                   ASCEND / "npu-smi-info-a2-910b3-8npu-noproc.txt"):
        assert parse_info(text(noproc)).processes == ()


@pytest.mark.parametrize(("name", "count"), [
    ("npu-smi-info-proc-a2-8npu-all-running.txt", 8), ("npu-smi-info-proc-a3-16npu-all-running.txt", 16)])
def test_synthesized_process_tables(name: str, count: int) -> None:
    m = parse_npu_map(text(SYNTH / name.replace("proc", "m").replace("-all-running", "")))
    assert running_logical_ids(parse_info(text(SYNTH / name)), m) == tuple(range(count))


# ---- npu-smi info -t topo -----------------------------------------------------------------------------
INTERLEAVED = {0: "144-167", 1: "0-23", 2: "144-167", 3: "0-23", 4: "96-119", 5: "48-71", 6: "96-119", 7: "48-71"}
TOPO_FACTS: dict[Path, dict[int, str]] = {
    ASCEND / "npu-smi-info-t-topo-a2-8npu-interleaved.txt": INTERLEAVED,
    ASCEND / "npu-smi-info-t-topo-a2-8npu-header-col0.txt": INTERLEAVED,
    ASCEND / "npu-smi-info-t-topo-a2-8npu-paired.txt": {
        0: "144-167", 1: "144-167", 2: "96-119", 3: "96-119", 4: "0-23", 5: "0-23", 6: "48-71", 7: "48-71"},
    ASCEND / "npu-smi-info-t-topo-4npu-pcie.txt": {0: "144-167", 1: "96-119", 2: "48-71", 3: "0-23"},
    ASCEND / "npu-smi-info-t-topo-not-supported.txt": {},
    ASCEND910 / "npu-smi_info_t_topo_x8_pcie_sys.txt": {
        i: "0-63,128-191" if i < 4 else "64-127,192-255" for i in range(8)},
    UT / "ut-topo-single-row.txt": {0: "0-3"},  # P16
    UT / "ut-topo-header-and-noise.txt": {0: "2-3"},  # P17 (current upstream, not v0.19's {1: …})
    UT / "ut-topo-matrix-no-affinity.txt": {},  # P18
}


@pytest.mark.parametrize("path", list(TOPO_FACTS), ids=lambda p: p.name)
def test_topo_files(path: Path) -> None:
    topo = parse_topo(text(path))
    assert affinity_by_npu(topo) == {k: cpus(v) for k, v in TOPO_FACTS[path].items()}
    assert topo.problems == ()


@pytest.mark.parametrize("path", [p for p in TOPO_FACTS if "a2-8npu" in p.name or "x8_pcie" in p.name],
                         ids=lambda p: p.name)
def test_topo_matrix_cells(path: Path) -> None:
    topo = parse_topo(text(path))
    assert topo.columns == tuple(f"NPU{i}" for i in range(8)) and topo.has_affinity_column
    link = "SYS" if "pcie_sys" in path.name else "HCCS"
    for i, row in enumerate(topo.rows):
        assert row.label == f"NPU{i}"
        assert row.cells == tuple("X" if j == i else link for j in range(8))


def test_topo_4npu_pcie_cells_and_unsupported() -> None:
    topo = parse_topo(text(ASCEND / "npu-smi-info-t-topo-4npu-pcie.txt"))
    assert [r.cells for r in topo.rows] == [("X", "PXB", "SYS", "PXB"), ("PXB", "X", "PXB", "SYS"),
                                             ("SYS", "PXB", "X", "PXB"), ("PXB", "SYS", "PXB", "X")]
    unsupported = parse_topo(text(ASCEND / "npu-smi-info-t-topo-not-supported.txt"))
    assert not unsupported.supported and unsupported.rows == ()
    nic = parse_topo(text(UT / "ut-topo-matrix-no-affinity.txt"))
    assert nic.columns == ("NPU0", "NPU1", "NIC0") and [r.label for r in nic.rows] == ["NPU0", "NPU1", "NIC0"]


def test_topo_single_npu_header_and_spaced_affinity() -> None:
    topo = parse_topo("        NPU0   CPU Affinity\nNPU0    X      0-23, 48-71\n")
    assert topo.columns == ("NPU0",) and affinity_by_npu(topo) == {0: (*range(24), *range(48, 72))}


@pytest.mark.parametrize(("body", "problem"), [
    ("  NPU0  NPU1  CPU Affinity\nNPU0 X\n", "1 cells for 2 columns"),
    ("  NPU0  NPU1\nNPU0 X HCCS 0-3\n", "past the last column"),
    ("  NPU0  NPU1  CPU Affinity\nNPU0 X HCCS 5-3\n", "descending"),
    ("  NPU0  NPU1  CPU Affinity\nNPU0 X HCCS 0-3\nNPU0 X HCCS 0-3\n", "repeated"),
])
def test_topo_bad_rows_are_problems(body: str, problem: str) -> None:
    topo = parse_topo(body)
    assert any(problem in p for p in topo.problems), topo.problems


@pytest.mark.parametrize("body", ["", "\n\n", "Legend:\n  X = Self\n", "HEADER\nNPU Chip Affinity\n"])
def test_topo_garbage_raises(body: str) -> None:
    with pytest.raises(NpuSmiError):
        parse_topo(body)


# ---- npu-smi info -t board ---------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "bdf"), [
    (ASCEND / "npu-smi-info-t-board-a2.txt", "0000:c1:00.0"),
    (ASCEND / "npu-smi-info-t-board-i-c-chip.txt", "0000:81:00.0"),
    (UT / "ut-board-pci.txt", "0000:03:00.0"),
    (UT / "ut-board-no-pci.txt", ""),
], ids=lambda v: v.name if isinstance(v, Path) else v)
def test_board_files(path: Path, bdf: str) -> None:
    assert parse_board(text(path)).bdf == bdf


def test_board_fields() -> None:
    fields = parse_board(text(ASCEND / "npu-smi-info-t-board-a2.txt")).fields
    assert fields["PCI Device ID"] == "0xD802" and fields["Serial Number"] == "1025C9048791"
    assert fields["PCIe Bus Info"] == "0000:C1:00.0"  # the key is not cut at the BDF's own colons


def test_every_npu_smi_fixture_is_covered() -> None:
    covered = {*MAP_FACTS, *INFO_FACTS, *TOPO_FACTS, ASCEND / "npu-smi-info-t-board-a2.txt",
               ASCEND / "npu-smi-info-t-board-i-c-chip.txt"}
    on_disk = {p for d in (ASCEND, ASCEND910, SYNTH) for p in d.glob("npu-smi*") if "proc" not in p.name}
    on_disk |= {p for p in UT.glob("ut-npu-smi-info-m-*")} | {p for p in UT.glob("ut-topo-*")}
    assert on_disk <= covered, sorted(p.name for p in on_disk - covered)


# ---- the part from real captures ---------------------------------------------------------------------
def test_part_910a_x8_rings_by_id_and_enumerated_ids() -> None:
    info = parse_info(text(ASCEND910 / "npu-smi_info_910A_x8.txt"))
    part, problems = build_part(None, info, None)
    assert any("numbered from the npu-smi info table" in p for p in problems)
    assert [d.index for d in part.devices] == list(range(8))
    assert {d.attributes["series"] for d in part.devices} == {"910"}
    assert part.groups == ((0, 1, 2, 3), (4, 5, 6, 7))  # two HCCS rings by id: not derivable from the Bus-Ids
    assert [d.memory_bytes for d in part.devices] == [32768 * MIB] * 8  # HBM, not the 15 GB DDR
    assert "running" not in part.devices[0].attributes  # this old format has no process table


def test_part_910a_x4_warning_health_surfaced() -> None:
    part, _ = build_part(None, parse_info(text(ASCEND910 / "npu-smi_info_910A_x4_warning_proc.txt")), None)
    assert [d.health for d in part.devices] == ["Warning"] * 4
    assert part.groups == ()  # four NPUs: no 8-NPU ring layout to claim
    assert running_npus(part) == () and {d.attributes["running"] for d in part.devices} == {"false"}


def test_part_a3_two_cards_enumerated_like_the_driver() -> None:
    part, _ = build_part(None, parse_info(text(ASCEND / "npu-smi-info-a3-2card-4chip-proc.txt")), None)
    assert [(d.index, d.attributes["card_id"], d.attributes["chip_id"], d.attributes["phy_id"])
            for d in part.devices] == [(0, "0", "0", "0"), (1, "0", "1", "1"), (2, "1", "0", "2"), (3, "1", "1", "3")]
    assert running_npus(part) == (3,)
    assert part.devices[3].attributes["processes"] == "990711"
    assert {d.attributes["series"] for d in part.devices} == {"A3"}


def test_part_a2_paired_host_joins_map_table_and_topo() -> None:
    m = parse_npu_map(text(SYNTH / "npu-smi-info-m-a2-8npu.txt"))
    info = parse_info(text(ASCEND / "npu-smi-info-a2-910b3-8npu-noproc.txt"))
    topo = parse_topo(text(ASCEND / "npu-smi-info-t-topo-a2-8npu-paired.txt"))
    part, problems = build_part(m, info, topo)
    assert problems == ()
    paired = TOPO_FACTS[ASCEND / "npu-smi-info-t-topo-a2-8npu-paired.txt"]
    assert topo_affinity(part) == {k: cpus(v) for k, v in paired.items()}
    assert part.devices[0].bdf == "0000:c1:00.0" and part.devices[0].model == "910B3"
    assert len(part.links) == 28 and {lk.kind for lk in part.links} == {"HCCS"}
    assert part.groups == (tuple(range(8)),)


def test_part_pcie_cards_have_no_groups() -> None:
    m = parse_npu_map("NPU ID  Chip ID  Chip Logic ID  Chip Name\n"
                      + "\n".join(f"{i} 0 {i} Ascend 910B4" for i in range(4)))
    part, _ = build_part(m, None, parse_topo(text(ASCEND / "npu-smi-info-t-topo-4npu-pcie.txt")))
    assert part.groups == ()
    assert {(lk.a, lk.b): lk.kind for lk in part.links} == {
        (0, 1): "PXB", (0, 2): "SYS", (0, 3): "PXB", (1, 2): "PXB", (1, 3): "SYS", (2, 3): "PXB"}


def test_part_topo_mismatches_are_reported() -> None:
    m = parse_npu_map(text(ASCEND / "npu-smi-info-m-a2-910b3.txt"))  # two NPUs
    part, problems = build_part(m, None, parse_topo(text(ASCEND / "npu-smi-info-t-topo-4npu-pcie.txt")))
    assert [d.index for d in part.devices] == [0, 1]
    assert any("row NPU2" in p for p in problems) and any("row NPU3" in p for p in problems)
    asym = parse_topo("  NPU0 NPU1\nNPU0 X HCCS\nNPU1 PIX X\n")
    _, problems = build_part(m, None, asym)
    assert any("HCCS one way, PIX the other" in p for p in problems)


def test_part_process_rows_without_logical_id_are_problems() -> None:
    info = parse_info(text(UT / "ut-npu-smi-info-proc-unknown-chip.txt"))
    part, problems = build_part(BASIC, info, None)
    assert running_npus(part) == () and any("no Chip Logic ID" in p for p in problems)


@pytest.mark.parametrize(("name", "chips", "series"), [
    ("910B3", 1, "A2"), ("Ascend 910B3", 1, "A2"), ("910B2C", 1, "A2"), ("Ascend910", 2, "A3"),
    ("Ascend910", 1, "910"), ("910A", 1, "910"), ("910ProB", 1, "910"), ("310P3", 2, "310P"),
    ("Ascend950DT", 1, "950"), ("Mcu", 1, ""), ("", 1, ""),
])
def test_classify_series(name: str, chips: int, series: str) -> None:
    assert classify_series(name, chips) == series


# ---- synthesized hosts through probe -------------------------------------------------------------------
# Extracted once and cached across runs (tests.fixtures.extracted): these tests only read the trees.
@pytest.fixture(scope="module")
def a2_root() -> Path:
    return extracted(HOSTS / "ascend-a2-8x910b" / "root.tar.gz")


@pytest.fixture(scope="module")
def a3_root() -> Path:
    return extracted(HOSTS / "ascend-a3-16npu" / "root.tar.gz")


def pci_local_cpus(root: Path, bdf: str) -> tuple[int, ...]:
    return cpus((root / "sys/bus/pci/devices" / bdf / "local_cpulist").read_text())


def test_a2_host(a2_root: Path) -> None:
    res = ascend.probe(ProbeContext.at_root(a2_root))
    assert res.status.state is State.OK, res.status.reasons
    part = res.data
    want_bus = {0: "c1", 1: "01", 2: "c2", 3: "02", 4: "81", 5: "41", 6: "82", 7: "42"}
    assert [d.index for d in part.devices] == list(range(8))
    for d in part.devices:
        assert (d.kind, d.vendor, d.model) == ("NPU", "Huawei", "910B3")
        assert d.bdf == f"0000:{want_bus[d.index]}:00.0"
        assert d.memory_bytes == 64 << 30
        assert d.health == ("Warning" if d.index == 7 else "OK")
        assert d.local_cpus == cpus(INTERLEAVED[d.index])
        # the topo's CPU Affinity agrees with the PCI tree's NUMA placement of the same BDF
        assert d.local_cpus == pci_local_cpus(a2_root, d.bdf)
        assert d.numa_node is None  # npu-smi does not state it; the integrator takes it from PCI
        assert d.attributes["series"] == "A2" and d.attributes["chip_name"] == "Ascend 910B3"
        assert d.attributes["card_id"] == str(d.index) and d.attributes["chip_id"] == "0"
    assert running_npus(part) == (0, 2, 5)
    assert part.devices[5].attributes["processes"] == "3428815,3428830"
    assert "processes" not in part.devices[1].attributes
    assert topo_affinity(part) == {k: cpus(v) for k, v in INTERLEAVED.items()}
    assert len(part.links) == 28 and all(lk.kind == "HCCS" and lk.a < lk.b for lk in part.links)
    assert part.groups == (tuple(range(8)),)


def test_a3_host(a3_root: Path) -> None:
    res = ascend.probe(ProbeContext.at_root(a3_root))
    assert res.status.state is State.OK, res.status.reasons
    part = res.data
    assert [d.index for d in part.devices] == list(range(16))
    for d in part.devices:
        assert (d.model, d.health, d.memory_bytes) == ("Ascend910", "OK", 64 << 30)
        assert d.bdf == f"0000:{A3_16_BUSES[d.index].lower()}:00.0"
        assert (a3_root / "sys/bus/pci/devices" / d.bdf).exists()
        assert d.attributes["card_id"] == str(d.index // 2) and d.attributes["chip_id"] == str(d.index % 2)
        assert d.attributes["phy_id"] == str(d.index) and d.attributes["series"] == "A3"
        assert d.local_cpus == ()
    assert topo_affinity(part) == {}  # no CPU Affinity column on A3: the planner slices globally
    assert running_npus(part) == tuple(range(16))
    kinds = {(lk.a, lk.b): lk.kind for lk in part.links}
    assert len(kinds) == 120
    assert {k for k, v in kinds.items() if v == "SIO"} == {(2 * c, 2 * c + 1) for c in range(8)}
    assert set(kinds.values()) == {"SIO", "HCCS_SW"}
    assert part.groups == (tuple(range(16)),)


# ---- fault table ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FaultRunner:
    """The A2 host's recordings, with some argv replaced."""

    base: RecordedRunner
    faults: Mapping[tuple[str, ...], ToolResult] = field(default_factory=dict)

    def run(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> ToolResult:
        return self.faults.get(tuple(argv)) or self.base.run(argv, timeout)


def fault(argv: tuple[str, ...], kind: str) -> ToolResult:
    return {
        "missing": ToolResult(argv, None, "", failure="npu-smi: not found"),
        "timeout": ToolResult(argv, None, "", failure="npu-smi: timed out after 10s"),
        "exit1": ToolResult(argv, 1, "dcmi module initialize failed. ret is -8005\n", failure="npu-smi: exit status 1"),
        "garbage": ToolResult(argv, 0, "\x00\x7f\ufffd not npu-smi at all ☃\n|||\n"),
    }[kind]


def run_a2(root: Path, faults: Mapping[tuple[str, ...], ToolResult]) -> ProbeResult[AcceleratorPart]:
    runner = FaultRunner(RecordedRunner.from_dir(root / RECORDED_TOOLS_DIR), faults)
    return ascend.probe(ProbeContext.at_root(root, runner=runner))


KINDS = ("missing", "timeout", "exit1", "garbage")


@pytest.mark.parametrize("kind", KINDS)
def test_fault_map(a2_root: Path, kind: str) -> None:
    res = run_a2(a2_root, {ARGV_MAP: fault(ARGV_MAP, kind)})
    assert res.status.state is State.DEGRADED
    assert any(r.startswith("npu-smi info -m: ") for r in res.status.reasons)
    part = res.data  # logical ids numbered from the table; everything else still there
    assert [d.index for d in part.devices] == list(range(8))
    assert part.devices[0].bdf == "0000:c1:00.0" and part.devices[0].local_cpus == cpus("144-167")
    assert "chip_name" not in part.devices[0].attributes
    assert running_npus(part) == (0, 2, 5) and len(part.links) == 28


@pytest.mark.parametrize("kind", KINDS)
def test_fault_info(a2_root: Path, kind: str) -> None:
    res = run_a2(a2_root, {ARGV_INFO: fault(ARGV_INFO, kind)})
    assert res.status.state is State.DEGRADED
    assert any(r.startswith("npu-smi info: ") for r in res.status.reasons)
    part = res.data
    assert [d.index for d in part.devices] == list(range(8))
    assert all(d.bdf == "" and d.health == "" and d.memory_bytes == 0 for d in part.devices)
    assert part.devices[0].model == "Ascend 910B3"  # from -m
    assert running_npus(part) == () and "running" not in part.devices[0].attributes
    assert topo_affinity(part) == {k: cpus(v) for k, v in INTERLEAVED.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_fault_topo(a2_root: Path, kind: str) -> None:
    res = run_a2(a2_root, {ARGV_TOPO: fault(ARGV_TOPO, kind)})
    assert res.status.state is State.DEGRADED
    assert any(r.startswith("npu-smi info -t topo: ") for r in res.status.reasons)
    part = res.data
    assert len(part.devices) == 8 and part.devices[7].health == "Warning"
    assert topo_affinity(part) == {} and part.links == () and part.groups == ()
    assert running_npus(part) == (0, 2, 5)


def test_fault_reasons_name_the_failure(a2_root: Path) -> None:
    res = run_a2(a2_root, {ARGV_TOPO: fault(ARGV_TOPO, "timeout"), ARGV_INFO: fault(ARGV_INFO, "exit1")})
    assert "npu-smi info -t topo: npu-smi: timed out after 10s" in res.status.reasons
    assert "npu-smi info: npu-smi: exit status 1" in res.status.reasons
    assert len(res.data.devices) == 8


def test_tool_missing_everywhere_is_unavailable(tmp_path: Path) -> None:
    res = ascend.probe(ProbeContext.at_root(tmp_path))
    assert res.status.state is State.UNAVAILABLE and "not found" in res.status.reasons[0]
    assert res.data == AcceleratorPart()


def test_hwloc_xml_input_is_unavailable() -> None:
    res = ascend.probe(ProbeContext.at_root("/", hwloc_xml=Path("x.xml")))
    assert res.status.state is State.UNAVAILABLE


def test_no_npus_listed_is_unavailable(a2_root: Path) -> None:
    empty = {
        ARGV_MAP: ToolResult(ARGV_MAP, 0, "\tNPU ID    Chip ID    Chip Logic ID    Chip Name\n"),
        ARGV_INFO: ToolResult(ARGV_INFO, 0, text(a2_root / RECORDED_TOOLS_DIR / "npu-smi-info.txt").split("+===")[0]),
        ARGV_TOPO: ToolResult(ARGV_TOPO, 0, text(ASCEND / "npu-smi-info-t-topo-not-supported.txt")),
    }
    res = run_a2(a2_root, empty)
    assert res.status.state is State.UNAVAILABLE, res.status.reasons
    assert "no Ascend devices" in res.status.reasons[0]


def test_topo_not_supported_is_not_a_fault(a2_root: Path) -> None:
    res = run_a2(a2_root, {ARGV_TOPO: ToolResult(ARGV_TOPO, 0, text(ASCEND / "npu-smi-info-t-topo-not-supported.txt"))})
    assert res.status.state is State.OK
    assert topo_affinity(res.data) == {} and res.data.links == ()


def test_calls_run_concurrently(a2_root: Path) -> None:
    """One slow view costs its own time, not the sum: the three calls are in flight at once. Each
    waits at a barrier for the other two, so calls made one after another would break it (no clock)."""
    base = RecordedRunner.from_dir(a2_root / RECORDED_TOOLS_DIR)
    barrier = threading.Barrier(3, timeout=60)
    broken: list[str] = []

    @dataclass(frozen=True)
    class Slow:
        def run(self, argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S) -> ToolResult:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                broken.append(" ".join(argv))
            return base.run(argv, timeout)

    res = ascend.probe(ProbeContext.at_root(a2_root, runner=Slow()))
    assert broken == [] and res.status.state is State.OK


# ---- property tests ------------------------------------------------------------------------------------
GARBAGE = st.text(alphabet=st.sampled_from(list("NPU ChipLogcIDX|+-=/:0123456789 \t\nHCSAfinty.AB")), max_size=400)


@settings(max_examples=300, deadline=None)
@given(st.one_of(GARBAGE, st.text(max_size=300)))
def test_parsers_never_crash(body: str) -> None:
    results: list[NpuMap | NpuSmiInfo | NpuTopo | None] = []
    for parse in (parse_npu_map, parse_info, parse_topo):
        try:
            results.append(parse(body))
        except NpuSmiError:
            results.append(None)
    parse_board(body)
    m, info, topo = results
    part, _ = build_part(m if isinstance(m, NpuMap) else None, info if isinstance(info, NpuSmiInfo) else None,
                         topo if isinstance(topo, NpuTopo) else None)
    assert len({d.index for d in part.devices}) == len(part.devices)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(GARBAGE, st.text(max_size=200)), argv=st.sampled_from([ARGV_MAP, ARGV_INFO, ARGV_TOPO]))
def test_probe_on_garbage_degrades(a2_root: Path, body: str, argv: tuple[str, ...]) -> None:
    res = run_a2(a2_root, {argv: ToolResult(argv, 0, body)})
    assert res.status.state in (State.OK, State.DEGRADED)
    # The other two views still name every NPU (garbage that happens to parse as a -m map can
    # only narrow the set: its rows are then the logical ids).
    assert len(res.data.devices) == 8 if argv != ARGV_MAP else res.data.devices


@st.composite
def map_tables(draw: st.DrawFn) -> tuple[str, dict[int, dict[int, int]]]:
    cards = draw(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True))
    per_card = draw(st.integers(1, 2))
    indent = draw(st.sampled_from(["", "\t", "    "]))
    width = draw(st.integers(2, 30))
    header = ["NPU ID", "Chip ID", "Chip Logic ID", "Chip Name"]
    rows: list[list[str]] = []
    want: dict[int, dict[int, int]] = {}
    logical = 0
    for card in sorted(cards):
        for chip in range(per_card):
            rows.append([str(card), str(chip), str(logical), draw(st.sampled_from(["Ascend910", "Ascend 910B3"]))])
            want.setdefault(card, {})[chip] = logical
            logical += 1
        rows.append([str(card), str(per_card), "-", "Mcu"])
    lines = [indent + (" " * width).join(header)] + [indent + (" " * draw(st.integers(1, width))).join(r) for r in rows]
    return "\n".join(lines), want


@settings(max_examples=100, deadline=None)
@given(map_tables())
def test_map_round_trip(case: tuple[str, dict[int, dict[int, int]]]) -> None:
    body, want = case
    assert as_map(parse_npu_map(body)) == want


@st.composite
def topo_matrices(draw: st.DrawFn) -> tuple[str, dict[int, tuple[int, ...]], list[list[str]]]:
    n = draw(st.integers(1, 8))
    lead = draw(st.sampled_from(["", "\t   ", "       "]))
    with_affinity = draw(st.booleans())
    cells = [["X" if i == j else draw(st.sampled_from(["HCCS", "PIX", "PXB", "PHB", "SYS", "SIO", "HCCS_SW", "NA"]))
              for j in range(n)] for i in range(n)]
    affinity: dict[int, tuple[int, ...]] = {}
    lines = [lead + "   ".join(f"NPU{i}" for i in range(n)) + ("   CPU Affinity" if with_affinity else "")]
    for i in range(n):
        row = [f"NPU{i}", *cells[i]]
        if with_affinity:
            lo = draw(st.integers(0, 200))
            hi = lo + draw(st.integers(0, 23))
            row.append(f"{lo}-{hi}")
            affinity[i] = tuple(range(lo, hi + 1))
        lines.append("   ".join(row))
    lines += ["", "Legend:", "  X    = Self", "  HCCS = Connection traversing HCCS."]
    return "\n".join(lines), affinity, cells


@settings(max_examples=100, deadline=None)
@given(topo_matrices())
def test_topo_round_trip(case: tuple[str, dict[int, tuple[int, ...]], list[list[str]]]) -> None:
    body, affinity, cells = case
    topo = parse_topo(body)
    assert affinity_by_npu(topo) == affinity
    assert [list(r.cells) for r in topo.rows] == cells
    m = parse_npu_map("NPU ID  Chip ID  Chip Logic ID\n" + "\n".join(f"{i} 0 {i}" for i in range(len(cells))))
    part, _ = build_part(m, None, topo)
    links = {(lk.a, lk.b): lk.kind for lk in part.links}
    assert all(links.get((i, j)) == cells[i][j] for i in range(len(cells)) for j in range(i + 1, len(cells))
               if cells[i][j] not in ("X", "NA") and cells[i][j] == cells[j][i])
    for group in part.groups:  # every group is held together by HCCS-family links
        assert all(any(lk.kind in ascend.HCCS_KINDS and i in (lk.a, lk.b) for lk in part.links) for i in group)
