"""Huawei Ascend NPUs through ``npu-smi``: logical ids, the device and process tables, the link matrix.

Three independent calls run concurrently:

* ``npu-smi info -m`` — (NPU id, chip id) → Chip Logic ID. The logical id is the device id runtimes
  use (``ASCEND_RT_VISIBLE_DEVICES``) and the ``index`` of every device here. A3 cards carry two
  compute chips (logic = 2·card + chip on a full host); ``Mcu`` rows (logic ``-``) are not NPUs;
  Ascend 950 has no Chip Logic ID column, and its logical id is the NPU id.
* ``npu-smi info`` — per chip: name (``910B3``, ``Ascend910``), health as printed, Bus-Id, memory and
  HBM used/total; then the process table: which chips run something, and the pids.
* ``npu-smi info -t topo`` — the link matrix (``HCCS``, ``PIX``, ``PXB``, ``PHB``, ``SYS``, ``SIO``,
  ``HCCS_SW`` … kept as printed) and the ``CPU Affinity`` column. A2 labels rows ``NPU<logical id>``;
  A3 labels them ``Phy-ID<physical id>`` and prints no affinity column.

Where a row counts or not follows vllm-ascend's CPU-binding reader (``Mcu`` rows and
``No running processes`` rows skipped, non-digit ids dropped), so the planner sees the running set
and affinity map upstream computes from the same text.
Formats and their provenance: ``../shared/fixtures/ascend/README.md`` and ``../ascend910/README.md``.

For the planner: :func:`running_npus` and :func:`topo_affinity` read them back from the part.

Groups (:func:`hccs_groups`): the first-generation 910 (910A, Atlas 800-9000) has two HCCS rings of
four, 0–3 and 4–7 by logical id (rings cannot exchange gradients; Huawei's Volcano plugin splits by
id, and no 910A matrix was ever published), so exactly-eight-NPU 910 hosts get those two rings. Every
other model is grouped by what its matrix prints: NPUs joined by HCCS-family links (HCCS, HCCS_SW, SIO) form one
group. A 910B A2 server prints HCCS between all eight (full mesh, and Huawei's 910B×8 scheduler
has no ring split), so it is one group of eight; PCIe cards (PIX/PXB/SYS only) get none.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.discovery import presence
from memtopo.discovery.parts import AccelDevice, AcceleratorPart, AccelLink, Ids
from memtopo.discovery.presence import ASCEND_ARGVS
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.pci import normalize_bdf
from memtopo.runner import ToolResult, run_all
from memtopo.text import excerpt

SOURCE = "npu-smi"

KIND = "NPU"
VENDOR = "Huawei"
ARGV_MAP, ARGV_INFO, ARGV_TOPO = ASCEND_ARGVS
# What `memtopo gather` records with a capture, so `topo --root` replays this probe.
RECORDED_COMMANDS = (ARGV_MAP, ARGV_INFO, ARGV_TOPO)

MIB = 1 << 20
# Link kinds that are the HCCS fabric (on-package SIO between the two dies of an A3 card, the HCCS
# switch between A3 cards), as opposed to a PCIe or SMP path.
HCCS_KINDS = frozenset({"HCCS", "HCCS_SW", "SIO"})
# An 8-NPU Ascend 910 server is two HCCS rings of four, by logical id.
RINGS_910 = ((0, 1, 2, 3), (4, 5, 6, 7))


class NpuSmiError(ValueError):
    """npu-smi output that does not parse, or a process row no logical id can be found for."""


def _num(text: str) -> int | None:
    """A plain decimal id; None for ``-``, ``NA``, signs, non-ASCII digits or absurd lengths."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None


# ---- npu-smi info -m -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChipMapping:
    """One compute chip of ``npu-smi info -m``."""

    card: int  # NPU ID
    chip: int  # Chip ID (0 when the column is absent)
    logical: int  # Chip Logic ID (the NPU ID on Ascend 950)
    phy_id: int | None = None  # Chip Phy-ID, where printed
    name: str = ""  # Chip Name as printed ("Ascend 910B3", "Ascend910")


@dataclass(frozen=True)
class NpuMap:
    chips: tuple[ChipMapping, ...]
    has_logic_column: bool = True
    problems: tuple[str, ...] = ()

    @property
    def logical_ids(self) -> Ids:
        return tuple(sorted({c.logical for c in self.chips}))

    def chips_of(self, card: int) -> tuple[ChipMapping, ...]:
        return tuple(c for c in self.chips if c.card == card)

    def logical_of(self, card: int, chip: int | None) -> int:
        """The logical id of a process-table row, as upstream resolves it.

        Without a chip id (``NPU ID`` process tables) the card must map exactly one chip.
        """
        if chip is None:
            chips = self.chips_of(card)
            if len(chips) != 1:
                raise NpuSmiError(f"process row names NPU {card} without a chip id, and NPU {card} has "
                                  f"{len(chips)} mapped chips")
            return chips[0].logical
        for c in self.chips:
            if c.card == card and c.chip == chip:
                return c.logical
        raise NpuSmiError(f"NPU {card} chip {chip} has no Chip Logic ID in npu-smi info -m")


_WIDE_GAP = re.compile(r"\s{2,}")
# Some versions separate two header names by one space ("Chip Phy-ID Chip Name").
_NAME_START = re.compile(r" (?=(?:NPU|Chip|Slot) )")


def parse_npu_map(text: str) -> NpuMap:
    """``npu-smi info -m``: the header (split on runs of 2+ spaces) locates the columns; data rows
    are split on any whitespace and indexed by those positions. Rows whose logic id is not a number
    (``Mcu`` rows print ``-``) are not NPUs. Unreadable rows are listed in ``problems``."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise NpuSmiError("empty output")
    columns = [name for cell in _WIDE_GAP.split(lines[0]) for name in _NAME_START.split(cell)]
    pos: dict[str, int] = {}
    for i, name in enumerate(columns):
        pos.setdefault(name, i)
    if "NPU ID" not in pos:
        raise NpuSmiError(f"no 'NPU ID' column in the header {excerpt(lines[0], 80)}")
    card_at, chip_at, logic_at = pos["NPU ID"], pos.get("Chip ID"), pos.get("Chip Logic ID")
    phy_at, name_at = pos.get("Chip Phy-ID"), pos.get("Chip Name")
    need = max(p for p in (card_at, chip_at, logic_at) if p is not None)
    chips: list[ChipMapping] = []
    problems: list[str] = []
    seen: set[int] = set()
    for lineno, line in enumerate(lines[1:], start=2):
        tokens = line.split()
        if len(tokens) <= need:
            problems.append(f"line {lineno}: {len(tokens)} fields, the header needs {need + 1}: {excerpt(line, 80)}")
            continue
        logical = _num(tokens[logic_at if logic_at is not None else card_at])
        if logical is None:
            continue  # Mcu (management controller) rows: not an NPU
        card = _num(tokens[card_at])
        chip = _num(tokens[chip_at]) if chip_at is not None else 0
        if card is None or chip is None:
            problems.append(f"line {lineno}: NPU/chip id not a number: {excerpt(line, 80)}")
            continue
        if logical in seen:
            problems.append(f"line {lineno}: logical id {logical} listed twice")
            continue
        seen.add(logical)
        phy = _num(tokens[phy_at]) if phy_at is not None and phy_at < len(tokens) else None
        name = " ".join(tokens[name_at:]) if name_at is not None else ""
        chips.append(ChipMapping(card, chip, logical, phy, name))
    return NpuMap(tuple(chips), logic_at is not None, tuple(problems))


# ---- npu-smi info ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class NpuChipStatus:
    """One chip of the ``npu-smi info`` device table (its two rows)."""

    card: int  # NPU
    name: str  # Name as printed: "910B3", "Ascend910", "910A", "310P3"
    health: str  # as printed: "OK", "Warning", "Alarm", "Critical" …
    chip: int
    phy_id: int | None = None  # A3 second header row "Chip  Phy-ID"
    device_id: int | None = None  # 310P second header row "Chip  Device"
    bdf: str = ""  # normalised Bus-Id, "" when not printed as one
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None
    hbm_used_mb: int | None = None
    hbm_total_mb: int | None = None


@dataclass(frozen=True)
class NpuProcess:
    """One process-table row."""

    card: int
    chip: int | None  # None under an "NPU ID" header (Ascend 950: card id only)
    pid: int | None
    name: str = ""


@dataclass(frozen=True)
class NpuSmiInfo:
    chips: tuple[NpuChipStatus, ...]
    processes: tuple[NpuProcess, ...]
    # First cell of the process-table header, whitespace-normalised: "NPU Chip" or "NPU ID";
    # "" when the output has no process table at all.
    process_header: str
    version: str = ""  # the driver "Version:" of the banner
    problems: tuple[str, ...] = ()


_USAGE = re.compile(r"(\d{1,9})\s*/\s*(\d{1,9})")
_VERSION = re.compile(r"Version:\s*(\S+)")
# Column names of the second header row when the output has none (old tables print both).
_DEFAULT_USAGE = ("Memory-Usage(MB)", "HBM-Usage(MB)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_info(text: str) -> NpuSmiInfo:
    """``npu-smi info``: the device table (two rows per chip between borders), then the process table.

    The process section starts at the first line beginning ``| NPU`` that contains ``Process id``;
    in it only lines beginning ``| `` with at least two cells and numeric ids count (so ``No running
    processes found in NPU k`` rows and separators drop out), as upstream reads it.
    """
    chips: list[NpuChipStatus] = []
    procs: list[NpuProcess] = []
    problems: list[str] = []
    version = ""
    proc_header: str | None = None
    saw_device_header = False
    second_id = ""
    usage_names: tuple[str, ...] = _DEFAULT_USAGE
    pending: tuple[int, str, str] | None = None  # (card, name, health) awaiting its chip row

    def orphan() -> None:
        nonlocal pending
        if pending is not None:
            problems.append(f"NPU {pending[0]} row has no chip row")
        pending = None

    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if proc_header is not None:
            if line.startswith("| "):
                _process_row(_cells(line), proc_header, procs)
            continue
        if line.startswith("| NPU") and "Process id" in line:
            orphan()
            proc_header = " ".join(_cells(line)[0].split())
            continue
        if line.startswith("+"):
            orphan()  # a border closes a chip's pair of rows
            continue
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) < 3:
            found = _VERSION.search(line)
            if found and not version:
                version = found.group(1)
            continue
        first = cells[0].split()
        if first[:1] == ["NPU"]:
            saw_device_header = True
            continue
        if first[:1] == ["Chip"]:
            second_id = first[1] if len(first) > 1 else ""
            usage_names = tuple(t for t in cells[2].split() if "Usage" in t) or _DEFAULT_USAGE
            continue
        if pending is None:
            card = _num(first[0]) if first else None
            if card is None or len(first) < 2 or normalize_bdf(cells[1]) is not None:
                problems.append(f"line {lineno}: not an NPU row: {excerpt(line, 80)}")
                continue
            pending = (card, " ".join(first[1:]), cells[1])
            continue
        card, name, health = pending
        pending = None
        chip = _num(first[0]) if first else None
        if chip is None:
            problems.append(f"line {lineno}: NPU {card}: chip id not a number: {excerpt(line, 80)}")
            continue
        second = _num(first[1]) if len(first) > 1 else None
        bdf = normalize_bdf(cells[1])
        if bdf is None and cells[1] not in ("", "-", "NA"):
            problems.append(f"line {lineno}: NPU {card} chip {chip}: Bus-Id {excerpt(cells[1])} is not a PCI address")
        usage: dict[str, tuple[int, int]] = {}
        for col, (used, total) in zip(usage_names, _USAGE.findall(cells[2]), strict=False):
            usage[col.split("-", 1)[0].upper()] = (int(used), int(total))
        mem, hbm = usage.get("MEMORY"), usage.get("HBM")
        chips.append(NpuChipStatus(
            card=card, name=name, health=health, chip=chip,
            phy_id=second if second_id != "Device" else None,
            device_id=second if second_id == "Device" else None,
            bdf=bdf or "",
            memory_used_mb=mem[0] if mem else None, memory_total_mb=mem[1] if mem else None,
            hbm_used_mb=hbm[0] if hbm else None, hbm_total_mb=hbm[1] if hbm else None,
        ))
    orphan()
    if not chips and proc_header is None and not saw_device_header:
        raise NpuSmiError("neither a device table nor a process table")
    return NpuSmiInfo(tuple(chips), tuple(procs), proc_header or "", version, tuple(problems))


def _process_row(cells: list[str], header: str, out: list[NpuProcess]) -> None:
    if len(cells) < 2:
        return  # "No running processes found in NPU k"
    ids = cells[0].split()
    card = _num(ids[0]) if ids else None
    chip: int | None = None
    if header == "NPU Chip":
        chip = _num(ids[1]) if len(ids) > 1 else None
        if chip is None:
            return
    if card is None:
        return
    out.append(NpuProcess(card, chip, _num(cells[1]), cells[2] if len(cells) > 2 else ""))


def running_logical_ids(info: NpuSmiInfo, npu_map: NpuMap, visible: Iterable[int] | None = None) -> Ids:
    """Upstream's running set: logical ids of every chip with a process row, intersected with
    ``visible`` (``ASCEND_RT_VISIBLE_DEVICES``, host logical ids) when given. A row no logical id
    can be found for raises :class:`NpuSmiError`; an empty set is returned as () (upstream raises)."""
    found = {npu_map.logical_of(p.card, p.chip) for p in info.processes}
    if visible is not None:
        found &= set(visible)
    return tuple(sorted(found))


# ---- npu-smi info -t topo --------------------------------------------------------------------------
@dataclass(frozen=True)
class TopoRow:
    label: str  # "NPU0", "Phy-ID3", "NIC0" as printed
    # One cell per header column; without a header, every field between the label and the affinity.
    cells: tuple[str, ...]
    affinity: Ids | None  # the CPU Affinity column, None when absent or not a CPU list


@dataclass(frozen=True)
class NpuTopo:
    columns: tuple[str, ...]  # header labels in order; () when the output has no header line
    rows: tuple[TopoRow, ...]
    has_affinity_column: bool = False
    supported: bool = True  # False for "This device does not support querying topo."
    problems: tuple[str, ...] = ()


_LABEL = re.compile(r"([A-Za-z][A-Za-z_-]*?)(\d{1,9})")
# Digits bounded: a 5000-digit "id" must fail the match, not int()'s digit limit.
_CPU_LIST = re.compile(r"\d{1,9}(?:-\d{1,9})?(?:,\s*\d{1,9}(?:-\d{1,9})?)*")
_AFFINITY_WORDS = ("CPU", "Affinity")


def _label(token: str) -> tuple[str, int] | None:
    m = _LABEL.fullmatch(token)
    return (m.group(1), int(m.group(2))) if m else None


def parse_topo(text: str) -> NpuTopo:
    """``npu-smi info -t topo``. The header is the line made only of labels (``NPU0 … NPU7``, maybe
    followed by ``CPU Affinity``), wherever it starts: at column 0, or after a TAB or spaces. Rows
    start with a label; the ``Legend:`` block and other text are ignored. A CPU Affinity value must
    be a CPU list (``144-167``, ``0-63,128-191``), else that row has no affinity."""
    columns: tuple[str, ...] = ()
    has_affinity = False
    rows: list[TopoRow] = []
    problems: list[str] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        tokens = line.split()
        if not tokens or _label(tokens[0]) is None:
            continue
        tail_affinity = tuple(tokens[-2:]) == _AFFINITY_WORDS
        labels = tokens[:-2] if tail_affinity else tokens
        if labels and all(_label(t) for t in labels):  # a row always has a non-label cell (its X)
            if not columns:
                columns, has_affinity = tuple(labels), tail_affinity
            continue
        label, rest = tokens[0], tokens[1:]
        if label in seen:
            problems.append(f"line {lineno}: row {label} repeated")
            continue
        seen.add(label)
        if columns:
            cells, extra = rest[:len(columns)], rest[len(columns):]
            if len(cells) < len(columns):
                problems.append(f"line {lineno}: row {label} has {len(cells)} cells for {len(columns)} columns")
            if extra and not has_affinity:
                problems.append(f"line {lineno}: row {label} has {len(extra)} fields past the last column")
                extra = []
        elif rest and _CPU_LIST.fullmatch(rest[-1]):
            # No header (upstream's test strings): the last field is the affinity when it is a list.
            cells, extra = rest[:-1], rest[-1:]
        else:
            cells, extra = rest, []
        affinity: Ids | None = None
        value = "".join(extra)  # "0-23, 48-71" splits into two fields
        if value and _CPU_LIST.fullmatch(value):
            try:
                affinity = parse_cpulist(value)
            except CpuListError as exc:
                problems.append(f"line {lineno}: row {label}: CPU Affinity {exc}")
        rows.append(TopoRow(label, tuple(cells), affinity))
    if not rows and not columns:
        if "not support" in text.lower():
            return NpuTopo((), (), supported=False)
        raise NpuSmiError("empty output" if not text.strip() else "no link-matrix rows")
    return NpuTopo(columns, tuple(rows), has_affinity, True, tuple(problems))


def affinity_by_npu(topo: NpuTopo) -> dict[int, Ids]:
    """Upstream's topo affinity map: ``NPU<n>`` rows with a CPU list, keyed by n (a logical id).
    ``Phy-ID`` rows (A3) and NIC rows are not in it."""
    out: dict[int, Ids] = {}
    for row in topo.rows:
        lab = _label(row.label)
        if lab is not None and lab[0] == "NPU" and row.affinity is not None:
            out.setdefault(lab[1], row.affinity)
    return out


# ---- npu-smi info -t board -i N [-c C] -------------------------------------------------------------
@dataclass(frozen=True)
class BoardInfo:
    bdf: str  # normalised "PCIe Bus Info", "" when the output has none
    fields: Mapping[str, str]  # every "Key : value" line


# "Key<spaces>: value"; the space before the colon keeps a BDF's own colons out of the key.
_BOARD_FIELD = re.compile(r"\s*(\S.*?)\s+:(.*)")


def parse_board(text: str) -> BoardInfo:
    """Key/value lines. The BDF is the last field of the first line naming ``PCIe Bus Info`` (as
    upstream reads it, which also takes the colon-less ``PCIe Bus Info 0000:03:00.0``). Never
    raises: output without a PCI address gives ``bdf=""``, which upstream treats as "no PCI"."""
    fields: dict[str, str] = {}
    bdf: str | None = None
    for line in text.splitlines():
        if bdf is None and "PCIe Bus Info" in line:
            bdf = normalize_bdf(line.split()[-1]) or ""
        kv = _BOARD_FIELD.fullmatch(line)
        if kv:
            fields.setdefault(kv.group(1), kv.group(2).strip())
    return BoardInfo(bdf or "", fields)


# ---- the part --------------------------------------------------------------------------------------
def classify_series(name: str, chips_per_card: int = 1) -> str:
    """Product line from a chip name: "910" (first generation: 910A/Pro/Premium), "A2" (910B*),
    "A3" (910C, or a 910 with two chips per card), "310P", "310B", "310", "950"; "" if unknown."""
    n = re.sub(r"[\s_-]", "", name.upper()).removeprefix("ASCEND")
    if n.startswith("950"):
        return "950"
    if n.startswith("910B"):
        return "A2"
    if n.startswith(("910C", "91093")) or (n.startswith("910") and chips_per_card >= 2):
        return "A3"
    if n.startswith("910"):
        return "910"
    for prefix in ("310P", "310B", "310"):
        if n.startswith(prefix):
            return prefix
    return ""


def hccs_groups(devices: Sequence[AccelDevice], links: Sequence[AccelLink]) -> tuple[Ids, ...]:
    """HCCS domains by logical id (the rule is in the module docstring)."""
    ids = sorted(d.index for d in devices)
    if ids == list(range(8)) and all(d.attributes.get("series") == "910" for d in devices):
        return RINGS_910
    parent = {i: i for i in ids}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for link in links:
        if link.kind in HCCS_KINDS and link.a in parent and link.b in parent:
            parent[root(link.a)] = root(link.b)
    members: dict[int, list[int]] = {}
    for i in ids:
        members.setdefault(root(i), []).append(i)
    return tuple(sorted(tuple(m) for m in members.values() if len(m) > 1))


def build_part(npu_map: NpuMap | None, info: NpuSmiInfo | None,
               topo: NpuTopo | None) -> tuple[AcceleratorPart, tuple[str, ...]]:
    """Join the three views on the logical id; returns the part and what did not fit.

    Without a usable ``-m`` map, logical ids are numbered over the table's (card, chip) pairs in
    order, which is how the driver numbers them (cards 8/9 → 0/1; A3 → 2·card + chip).
    """
    problems: list[str] = []
    if (npu_map is None or not npu_map.chips) and info is not None and info.chips:
        if npu_map is not None:
            problems.append("npu-smi info -m maps no chip")
        pairs = sorted({(c.card, c.chip): c.phy_id for c in info.chips}.items())
        npu_map = NpuMap(tuple(ChipMapping(card, chip, i, phy) for i, ((card, chip), phy) in enumerate(pairs)))
        problems.append("logical ids numbered from the npu-smi info table in (NPU, chip) order")
    if npu_map is None or not npu_map.chips:
        return AcceleratorPart(), tuple(problems)
    by_logical = {c.logical: c for c in npu_map.chips}

    status: dict[int, NpuChipStatus] = {}
    running: dict[int, set[int]] = {}
    if info is not None:
        for st in info.chips:
            try:
                lid = npu_map.logical_of(st.card, st.chip)
            except NpuSmiError:
                problems.append(f"npu-smi info lists NPU {st.card} chip {st.chip}, which npu-smi info -m does not map")
                continue
            if lid in status:
                problems.append(f"npu-smi info lists NPU {st.card} chip {st.chip} twice")
                continue
            status[lid] = st
        if info.chips:
            problems.extend(f"npu-smi info has no row for NPU {c.card} chip {c.chip}"
                            for c in npu_map.chips if c.logical not in status)
        for proc in info.processes:
            try:
                lid = npu_map.logical_of(proc.card, proc.chip)
            except NpuSmiError as exc:
                problems.append(f"process table: {exc}")
                continue
            pids = running.setdefault(lid, set())
            if proc.pid is not None:
                pids.add(proc.pid)

    phy_to_logical = {c.phy_id: c.logical for c in npu_map.chips if c.phy_id is not None}
    for lid, st in status.items():
        if st.phy_id is not None:
            phy_to_logical.setdefault(st.phy_id, lid)

    def logical_of_label(label: str) -> int | None:
        lab = _label(label)
        if lab is None:
            return None
        kind, num = lab
        if kind == "NPU":
            return num if num in by_logical else None
        return phy_to_logical.get(num) if kind == "Phy-ID" else None

    affinity: dict[int, Ids] = {}
    links: list[AccelLink] = []
    if topo is not None:
        for row in topo.rows:
            lab, npu = _label(row.label), logical_of_label(row.label)
            if npu is None and lab is not None and lab[0] in ("NPU", "Phy-ID"):
                problems.append(f"npu-smi info -t topo: row {row.label} is no NPU npu-smi info -m lists")
            elif npu is not None and row.affinity is not None:
                affinity[npu] = row.affinity
        links = _links(topo, logical_of_label, problems)

    chips_per_card: dict[int, int] = {}
    for c in npu_map.chips:
        chips_per_card[c.card] = chips_per_card.get(c.card, 0) + 1
    devices: list[AccelDevice] = []
    for lid in sorted(by_logical):
        m = by_logical[lid]
        chip_st = status.get(lid)
        model = chip_st.name if chip_st is not None and chip_st.name else m.name
        attrs = {"card_id": str(m.card), "chip_id": str(m.chip)}
        phy = m.phy_id if m.phy_id is not None else (chip_st.phy_id if chip_st is not None else None)
        if phy is not None:
            attrs["phy_id"] = str(phy)
        if m.name:
            attrs["chip_name"] = m.name
        series = classify_series(model or m.name, chips_per_card[m.card])
        if series:
            attrs["series"] = series
        if info is not None and info.version:
            attrs["driver_version"] = info.version
        if info is not None and info.process_header:
            attrs["running"] = "true" if lid in running else "false"
            if running.get(lid):
                attrs["processes"] = ",".join(str(p) for p in sorted(running[lid]))
        memory_mb = 0
        if chip_st is not None:
            memory_mb = chip_st.hbm_total_mb or chip_st.memory_total_mb or 0
        devices.append(AccelDevice(
            kind=KIND, vendor=VENDOR, index=lid, model=model,
            bdf=chip_st.bdf if chip_st is not None else "",
            memory_bytes=memory_mb * MIB,
            health=chip_st.health if chip_st is not None else "",
            local_cpus=affinity.get(lid, ()),
            attributes=attrs,
        ))
    part = AcceleratorPart(tuple(devices), tuple(links), hccs_groups(devices, links))
    return part, tuple(problems)


def _links(topo: NpuTopo, logical_of_label: Callable[[str], int | None], problems: list[str]) -> list[AccelLink]:
    """One link per NPU pair with a known relation (not ``X`` self, not ``NA`` unknown), in a < b order.
    The matrix is symmetric; a pair whose two cells differ keeps the lower row's and is reported."""
    kinds: dict[tuple[int, int], str] = {}
    for row in topo.rows:
        a = logical_of_label(row.label)
        if a is None:
            continue
        for col, cell in zip(topo.columns, row.cells, strict=False):
            b = logical_of_label(col)
            if b is None or b == a or cell in ("X", "NA"):
                continue
            key = (min(a, b), max(a, b))
            known = kinds.setdefault(key, cell)
            if known != cell:
                problems.append(f"npu-smi info -t topo: NPUs {key[0]} and {key[1]} are {known} one way, "
                                f"{cell} the other")
    return [AccelLink(a, b, kind) for (a, b), kind in sorted(kinds.items())]


def running_npus(part: AcceleratorPart) -> Ids:
    """Logical ids of the NPUs with at least one process in ``npu-smi info`` (upstream's running set,
    before any ``ASCEND_RT_VISIBLE_DEVICES`` filter). () when nothing runs or the table was unread."""
    return tuple(sorted(d.index for d in part.devices
                        if d.vendor == VENDOR and d.attributes.get("running") == "true"))


def topo_affinity(part: AcceleratorPart) -> dict[int, Ids]:
    """Logical id → CPUs of the ``CPU Affinity`` column (upstream's topo affinity map). Empty on A3
    (no affinity column) or when the matrix is unsupported: the planner then slices globally."""
    return {d.index: d.local_cpus for d in part.devices if d.vendor == VENDOR and d.local_cpus}


# ---- probe -----------------------------------------------------------------------------------------
class _Parsed(Protocol):
    @property
    def problems(self) -> tuple[str, ...]: ...


def probe(ctx: ProbeContext) -> ProbeResult[AcceleratorPart]:
    sb = StatusBuilder(SOURCE)
    # With only an XML export the runner is this host's: its NPUs would be reported as the
    # exported machine's.
    if (absent := presence.ascend(ctx)) is not None:
        sb.unavailable(absent)
        return ProbeResult(AcceleratorPart(), sb.finish())
    results = run_all(ctx.runner, [ARGV_MAP, ARGV_INFO, ARGV_TOPO])
    if all(r.failure is not None and r.failure.endswith(": not found") for r in results):
        sb.unavailable(f"no Ascend devices/tool ({results[0].failure})")
        return ProbeResult(AcceleratorPart(), sb.finish())
    npu_map = _parsed(results[0], parse_npu_map, sb)
    info = _parsed(results[1], parse_info, sb)
    topo = _parsed(results[2], parse_topo, sb)
    part, problems = build_part(npu_map, info, topo)
    for p in problems:
        sb.problem(p)
    if not part.devices and not sb.reasons:
        sb.unavailable("no Ascend devices: npu-smi lists no NPU")
    return ProbeResult(part, sb.finish())


def _parsed[T: _Parsed](result: ToolResult, parse: Callable[[str], T], sb: StatusBuilder) -> T | None:
    cmd = " ".join(result.argv)
    if not result.ok:
        sb.problem(f"{cmd}: {result.failure}")
        return None
    try:
        value = parse(result.stdout)
    except NpuSmiError as exc:
        sb.problem(f"{cmd}: {exc}")
        return None
    for p in value.problems:
        sb.problem(f"{cmd}: {p}")
    return value
