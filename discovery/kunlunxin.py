"""Kunlunxin (Baidu) XPUs through ``xpu-smi``: the device list, the per-device machine lines and the
``topo -m`` link matrix.

Three calls, independent of each other, run concurrently: ``xpu-smi -L`` (index, model, UUID),
``xpu-smi -m`` (one line per device: PCI address, serial, HBM size, firmware) and
``xpu-smi topo -m`` (XPU×XPU link matrix, XPU×NIC relations, ``CPU Affinity`` / ``NUMA Affinity``).
``-m`` already covers every device, so no per-device call is needed. The three are joined on the
xpu-smi device index: only ``-m`` prints a PCI address, only ``-L`` a UUID, and the index is the one
key they all share. Formats and provenance: ``../shared/fixtures/kunlunxin/README.md``.

Intel's XPU Manager installs a tool with the same name, so the binary name proves nothing: the probe
runs only when the host has a Kunlunxin accelerator on PCI (vendor 0x1d22) or ``/dev/xpuctrl``.

Groups are the XPUs' NUMA halves, which 1-, 2- and 4-XPU jobs must not span (see :func:`numa_groups`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.discovery import presence
from memtopo.discovery.parts import AccelDevice, AcceleratorPart, AccelLink, Ids, SysPci
from memtopo.discovery.pci_ids import VENDOR_KUNLUNXIN, classify
from memtopo.discovery.presence import XPUCTRL
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.discovery.sysfs_read import PCI_DEVICES
from memtopo.hostfs import HostReadError
from memtopo.pci import normalize_bdf
from memtopo.runner import Runner, ToolResult, run_all
from memtopo.text import excerpt

SOURCE = "xpu-smi"

KIND = "XPU"
VENDOR = "Kunlunxin"
# Both spellings ship: /usr/local/bin/xpu-smi on current drivers, xpu_smi in older SDKs and in the
# vendor FAQ. The second is tried only when the first is not installed at all.
TOOLS = ("xpu-smi", "xpu_smi")
# What `memtopo gather` records with a capture, so `topo --root` replays this probe.
RECORDED_COMMANDS = tuple((tool, *args) for tool in TOOLS for args in (("-L",), ("-m",), ("topo", "-m")))

MIB = 1 << 20


class XpuSmiError(ValueError):
    """xpu-smi output that does not parse."""


# ---- xpu-smi -L ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class XpuListEntry:
    index: int
    model: str  # as printed, may contain spaces ("P800 OAM")
    uuid: str  # "GPU-ed733bb8-…" as printed


_LIST_LINE = re.compile(r"XPU\s+(\d+)\s*:\s*(.*)")
_UUID = re.compile(r"(?:[A-Za-z]+-)?[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")


def parse_list(text: str) -> tuple[XpuListEntry, ...]:
    """``xpu-smi -L``: ``XPU <i>: <model>  GPU-<uuid>`` per line, in index order.

    Every non-blank line must be a device line; at least one is required.
    """
    entries: dict[int, XpuListEntry] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _LIST_LINE.fullmatch(line.strip())
        if m is None:
            raise XpuSmiError(f"line {n}: not an 'XPU <i>: <model> <uuid>' line: {excerpt(line, 80)}")
        index = _small_int(m.group(1), f"line {n}: device index")
        words = m.group(2).rsplit(None, 1)
        model, uuid = (words[0], words[1]) if len(words) == 2 else ("", "".join(words))
        if _UUID.fullmatch(uuid) is None:
            raise XpuSmiError(f"line {n}: no UUID at the end: {excerpt(line, 80)}")
        if index in entries:
            raise XpuSmiError(f"line {n}: XPU {index} listed twice")
        entries[index] = XpuListEntry(index, model.strip(), uuid)
    if not entries:
        raise XpuSmiError("no 'XPU <i>:' lines")
    return tuple(entries[i] for i in sorted(entries))


# ---- xpu-smi -m ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class XpuMachineLine:
    """One ``xpu-smi -m`` line. Column meanings come from independent public parsers and a capture
    from hardware, not from a vendor manual: only the columns they agree on are kept."""

    bdf: str  # token 0, normalised "dddd:bb:dd.f"
    index: int  # token 1, the xpu-smi device index
    index2: int  # token 2; equal to token 1 in every sample seen, kept to notice when it is not
    serial: str  # token 3
    temperature_c: int  # token 4
    power_w: int  # token 8
    clocks_mhz: tuple[int, ...]  # tokens 9–14
    l3_used_mib: int  # tokens 15/16: on-chip L3 SRAM, not device memory
    l3_total_mib: int
    memory_used_mib: int  # tokens 17/18: HBM
    memory_total_mib: int
    utilization_pct: int  # token 19
    firmware: str  # token 20
    model: str  # token 21, unquoted


_TOKEN = re.compile(r'"[^"]*"|\S+')
# The quoted model is token 21: everything before it is positional, so it doubles as the check that
# this driver's columns are the ones described above. Later tokens (32 in total on P800) are unused.
_M_MIN_TOKENS = 22
_M_MODEL = 21


def parse_machine(text: str) -> tuple[XpuMachineLine, ...]:
    """``xpu-smi -m``: one whitespace-separated line per device (the quoted model is one token)."""
    lines: dict[int, XpuMachineLine] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        tok = _TOKEN.findall(line)
        where = f"line {n}"
        if len(tok) < _M_MIN_TOKENS:
            raise XpuSmiError(f"{where}: {len(tok)} fields, expected at least {_M_MIN_TOKENS}: {excerpt(line, 80)}")
        model = tok[_M_MODEL]
        if len(model) < 2 or not (model.startswith('"') and model.endswith('"')):
            raise XpuSmiError(f"{where}: field {_M_MODEL} is not the quoted model: {excerpt(model)}")
        entry = XpuMachineLine(
            bdf=strict_bdf(tok[0]),
            index=_small_int(tok[1], f"{where}: device index"),
            index2=_small_int(tok[2], f"{where}: device index"),
            serial=tok[3],
            temperature_c=_int(tok[4], f"{where}: temperature"),
            power_w=_int(tok[8], f"{where}: power"),
            clocks_mhz=tuple(_int(t, f"{where}: clock") for t in tok[9:15]),
            l3_used_mib=_int(tok[15], f"{where}: L3 used"),
            l3_total_mib=_int(tok[16], f"{where}: L3 total"),
            memory_used_mib=_int(tok[17], f"{where}: memory used"),
            memory_total_mib=_int(tok[18], f"{where}: memory total"),
            utilization_pct=_int(tok[19], f"{where}: utilization"),
            firmware=tok[20],
            model=model[1:-1].strip(),
        )
        if entry.index in lines:
            raise XpuSmiError(f"{where}: XPU {entry.index} listed twice")
        lines[entry.index] = entry
    if not lines:
        raise XpuSmiError("no device lines")
    return tuple(lines[i] for i in sorted(lines))


def strict_bdf(text: str) -> str:
    """The kernel's spelling of a BDF xpu-smi printed; garbage is a parse error here."""
    bdf = normalize_bdf(text)
    if bdf is None:
        raise XpuSmiError(f"not a PCI address: {excerpt(text)}")
    return bdf


# ---- xpu-smi topo -m -------------------------------------------------------------------------------
@dataclass(frozen=True)
class XpuAffinity:
    """One XPU row of the matrix: what the tool says the XPU is local to."""

    index: int
    local_cpus: Ids  # () when the column is absent or says N/A
    numa_node: int | None  # None when absent, N/A or negative
    nics: Mapping[str, str] = field(default_factory=dict)  # NIC name → relation (PIX, NODE, SYS …)


@dataclass(frozen=True)
class AsymmetricLink:
    """A pair whose two rows disagree; neither side is believed."""

    a: int
    b: int
    a_says: str  # cell (row a, column b)
    b_says: str  # cell (row b, column a)


@dataclass(frozen=True)
class XpuTopology:
    xpus: Ids  # in header order
    nics: tuple[str, ...]  # NIC names, resolved through the "NIC Legend:" block when it has one
    affinity: tuple[XpuAffinity, ...]  # index order
    links: tuple[AccelLink, ...]  # a < b, only pairs both rows agree on
    asymmetric: tuple[AsymmetricLink, ...] = ()


_XPU_LABEL = re.compile(r"XPU(\d+)")
_NIC_LEGEND = re.compile(r"\s*(\S+)\s*:\s*(\S+)\s*")
_AFFINITY_COLUMNS = (("CPU", "Affinity"), ("NUMA", "Affinity"))
_NOT_APPLICABLE = frozenset({"N/A", "NA", "-", "--"})


def parse_topo(text: str) -> XpuTopology:
    """``xpu-smi topo -m``: both layouts seen — NIC columns named by their RDMA device
    (``mlx5_0``, with NIC rows under the XPU rows) or ``NIC0…`` resolved through a ``NIC Legend:``.

    A pair whose two rows disagree is reported in ``asymmetric`` and left out of ``links``.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip()), None)
    if start is None:
        raise XpuSmiError("empty output")
    xpus, nic_labels, aff_cols = _topo_header(lines[start])
    legend = _nic_legend(lines[start + 1:])
    nics = tuple(legend.get(label, label) for label in nic_labels)
    nic_rows = set(nic_labels) | set(nics)
    nx, nn = len(xpus), len(nic_labels)
    cells: dict[int, tuple[str, ...]] = {}
    affinity: dict[int, XpuAffinity] = {}
    for n, line in enumerate(lines[start + 1:], start + 2):
        if not line.strip() or line.rstrip().endswith(":"):
            break  # the matrix ends at the blank line before "Legend:"
        tok = line.split()
        where = f"line {n}"
        label = tok[0]
        m = _XPU_LABEL.fullmatch(label)
        if m is None:
            if label not in nic_rows:
                raise XpuSmiError(f"{where}: row {excerpt(label, 20)} is neither an XPU nor a NIC of the header")
            if len(tok) != 1 + nx + nn:
                raise XpuSmiError(f"{where}: NIC row has {len(tok) - 1} cells, expected {nx + nn}")
            continue  # NIC↔NIC and NIC→XPU add nothing the XPU rows do not say
        index = _small_int(m.group(1), where)
        if index not in xpus:
            raise XpuSmiError(f"{where}: XPU{index} is not a column of the header")
        if index in cells:
            raise XpuSmiError(f"{where}: XPU{index} has two rows")
        if len(tok) != 1 + nx + nn + len(aff_cols):
            raise XpuSmiError(f"{where}: {len(tok) - 1} cells, expected {nx + nn + len(aff_cols)}")
        row = tuple(tok[1:1 + nx])
        self_at = xpus.index(index)
        if row[self_at] != "X":
            raise XpuSmiError(f"{where}: XPU{index} is not 'X' to itself")
        if "X" in row[:self_at] + row[self_at + 1:]:
            raise XpuSmiError(f"{where}: XPU{index} is 'X' (self) to another XPU")
        cells[index] = row
        nic_cells = dict(zip(nics, tok[1 + nx:1 + nx + nn], strict=True))
        affinity[index] = _affinity(index, tok[1 + nx + nn:], aff_cols, nic_cells, where)
    missing = [i for i in xpus if i not in cells]
    if missing:
        raise XpuSmiError(f"no row for {', '.join(f'XPU{i}' for i in missing)}")
    links: list[AccelLink] = []
    asym: list[AsymmetricLink] = []
    for ai, a in enumerate(xpus):
        for bi, b in enumerate(xpus):
            if a >= b:
                continue
            ab, ba = cells[a][bi], cells[b][ai]
            if ab == ba:
                links.append(AccelLink(a, b, ab))
            else:
                asym.append(AsymmetricLink(a, b, ab, ba))
    links.sort(key=lambda lk: (lk.a, lk.b))
    asym.sort(key=lambda x: (x.a, x.b))
    return XpuTopology(xpus, nics, tuple(affinity[i] for i in sorted(affinity)), tuple(links), tuple(asym))


def _topo_header(line: str) -> tuple[Ids, tuple[str, ...], tuple[str, ...]]:
    """XPU columns, NIC column labels, affinity columns ("CPU", "NUMA") in order."""
    tok = line.split()
    xpus: list[int] = []
    nics: list[str] = []
    aff: list[str] = []
    i = 0
    while i < len(tok):
        pair = (tok[i], tok[i + 1]) if i + 1 < len(tok) else None
        m = _XPU_LABEL.fullmatch(tok[i])
        if pair in _AFFINITY_COLUMNS:
            aff.append(tok[i])
            i += 2
            continue
        if aff:
            raise XpuSmiError(f"header: column {tok[i][:20]!r} after the affinity columns")
        if m is not None:
            if nics:
                raise XpuSmiError(f"header: XPU column {tok[i]!r} after the NIC columns")
            index = _small_int(m.group(1), "header")
            if index in xpus:
                raise XpuSmiError(f"header: XPU{index} twice")
            xpus.append(index)
        else:
            if tok[i] in nics:
                raise XpuSmiError(f"header: NIC {tok[i][:20]!r} twice")
            nics.append(tok[i])
        i += 1
    if not xpus:
        raise XpuSmiError(f"header names no XPU column: {excerpt(line, 80)}")
    if len(set(aff)) != len(aff):
        raise XpuSmiError("header: an affinity column twice")
    return tuple(xpus), tuple(nics), tuple(aff)


def _nic_legend(lines: Sequence[str]) -> dict[str, str]:
    """``NICk: name`` entries of the ``NIC Legend:`` block (the plain ``Legend:`` says nothing we use)."""
    legend: dict[str, str] = {}
    inside = False
    for line in lines:
        stripped = line.strip()
        if stripped.endswith(":"):  # a section title; entries ("NIC0: mlx5_0") never end with ':'
            inside = stripped == "NIC Legend:"
            continue
        if inside:
            m = _NIC_LEGEND.fullmatch(line)
            if m is not None:
                legend[m.group(1)] = m.group(2)
    return legend


def _affinity(index: int, values: Sequence[str], columns: Sequence[str], nics: Mapping[str, str],
              where: str) -> XpuAffinity:
    cpus: Ids = ()
    node: int | None = None
    for col, value in zip(columns, values, strict=True):
        if value in _NOT_APPLICABLE:
            continue
        if col == "CPU":
            try:
                cpus = parse_cpulist(value)
            except CpuListError as exc:
                raise XpuSmiError(f"{where}: CPU Affinity: {exc}") from exc
        else:
            n = _int(value.lstrip("-"), f"{where}: NUMA Affinity")
            node = None if value.startswith("-") else n
    return XpuAffinity(index, cpus, node, nics)


# ---- helpers ---------------------------------------------------------------------------------------
# Device indices and NUMA ids are small; a bound keeps a corrupted "XPU99999999999" from becoming a key.
_MAX_INDEX = 1 << 16


def _int(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise XpuSmiError(f"{what}: not a number: {excerpt(text)}")
    return int(text)


def _small_int(text: str, what: str) -> int:
    value = _int(text, what)
    if value >= _MAX_INDEX:
        raise XpuSmiError(f"{what}: {value} out of range")
    return value


def numa_groups(indices: Sequence[int], nodes: Mapping[int, int]) -> tuple[Ids, ...]:
    """The XPUs' NUMA halves (jobs of 1, 2 or 4 XPUs must not span NUMA nodes).

    With a NUMA node for every XPU: one group per node, in node order. Without one for every XPU:
    HAMi's positional rule — the first ``n // 2`` XPUs by index, then the rest (0–3 / 4–7 on an
    8-XPU P800; for an odd count the second half is the larger, as in HAMi; one XPU is one group).
    """
    ordered = sorted(set(indices))
    if not ordered:
        return ()
    if all(i in nodes for i in ordered):
        by_node: dict[int, list[int]] = {}
        for i in ordered:
            by_node.setdefault(nodes[i], []).append(i)
        return tuple(tuple(by_node[n]) for n in sorted(by_node))
    half = len(ordered) // 2
    return tuple(g for g in (tuple(ordered[:half]), tuple(ordered[half:])) if g)


# ---- probe -----------------------------------------------------------------------------------------
def probe(ctx: ProbeContext, pci: ProbeResult[SysPci] | None = None) -> ProbeResult[AcceleratorPart]:
    """``pci``: sysfs.pci's part, when the probe runs in a discovery (its functions are not read twice)."""
    sb = StatusBuilder(SOURCE)
    if (absent := presence.kunlunxin(ctx, pci)) is not None:
        sb.unavailable(absent)
        return ProbeResult(AcceleratorPart(), sb.finish())
    pci_nodes = _kunlunxin_pci(ctx, pci)
    if not pci_nodes and not ctx.fs.exists(XPUCTRL):
        sb.unavailable(presence.kunlunxin_absent())
        return ProbeResult(AcceleratorPart(), sb.finish())
    results = _run_tool(ctx.runner)
    if results is None:
        sb.unavailable(f"{' / '.join(TOOLS)}: not found")
        return ProbeResult(AcceleratorPart(), sb.finish())
    listed = _parsed(results[0], parse_list, sb)
    machine = _parsed(results[1], parse_machine, sb)
    topo = _parsed(results[2], parse_topo, sb)
    return ProbeResult(_assemble(listed, machine, topo, pci_nodes, sb), sb.finish())


def _kunlunxin_pci(ctx: ProbeContext, pci: ProbeResult[SysPci] | None) -> dict[str, int]:
    """Kunlunxin accelerators on PCI: BDF → sysfs numa_node. Unreadable attributes are skipped here;
    the PCI probe reports them. Within a discovery, from what the PCI probe read."""
    listed = presence.kunlunxin_pci(pci)
    if listed is not None:
        return listed
    found: dict[str, int] = {}
    try:
        names = ctx.fs.listdir(PCI_DEVICES)
    except HostReadError:
        return found
    for name in names:
        base = f"{PCI_DEVICES}/{name}"
        try:
            if ctx.fs.read_int(f"{base}/vendor", 16) != VENDOR_KUNLUNXIN:
                continue
            device = ctx.fs.read_int(f"{base}/device", 16)
            class_code = ctx.fs.read_int(f"{base}/class", 16)
        except HostReadError:
            continue
        if classify(VENDOR_KUNLUNXIN, device, class_code) != "xpu":
            continue  # Baidu's storage functions share the vendor id
        try:
            found[name] = ctx.fs.read_int(f"{base}/numa_node")
        except HostReadError:
            found[name] = -1
    return found


def _run_tool(runner: Runner) -> list[ToolResult] | None:
    """The three views from the first tool name that is installed; None when neither is."""
    for tool in TOOLS:
        results = run_all(runner, [[tool, "-L"], [tool, "-m"], [tool, "topo", "-m"]])
        if not all(_not_found(r) for r in results):
            return results
    return None


def _not_found(result: ToolResult) -> bool:
    return result.failure is not None and result.failure.endswith(": not found")


def _parsed[T](result: ToolResult, parser: Callable[[str], T], sb: StatusBuilder) -> T | None:
    """The parsed output, or None with the reason noted. Output of a call that failed is still used
    when it parses (the failure stays in the status): a tool that exits non-zero because one device
    is in error usually still prints the others."""
    cmd = " ".join(result.argv)
    if result.failure is not None:
        sb.problem(f"{cmd}: {result.failure}")
        if not result.stdout.strip():
            return None
    try:
        return parser(result.stdout)
    except XpuSmiError as exc:
        if result.failure is None:
            sb.problem(f"{cmd}: unparseable output: {exc}")
        return None


def _assemble(listed: tuple[XpuListEntry, ...] | None, machine: tuple[XpuMachineLine, ...] | None,
              topo: XpuTopology | None, pci_nodes: Mapping[str, int], sb: StatusBuilder) -> AcceleratorPart:
    by_list = {e.index: e for e in listed or ()}
    by_m = {e.index: e for e in machine or ()}
    by_topo = {a.index: a for a in topo.affinity} if topo is not None else {}
    views = [(name, set(v)) for name, v, ok in (("xpu-smi -L", by_list, listed is not None),
                                                 ("xpu-smi -m", by_m, machine is not None),
                                                 ("xpu-smi topo -m", by_topo, topo is not None)) if ok]
    if len({frozenset(s) for _, s in views}) > 1:
        sb.problem("xpu-smi views disagree on the devices: " +
                   "; ".join(f"{name} lists {_ids(s)}" for name, s in views))
    devices: list[AccelDevice] = []
    group_nodes: dict[int, int] = {}
    for index in sorted(set(by_list) | set(by_m) | set(by_topo)):
        lst, m, aff = by_list.get(index), by_m.get(index), by_topo.get(index)
        attrs: dict[str, str] = {}
        if m is not None:
            attrs["serial"] = m.serial
            attrs["firmware_version"] = m.firmware
            if m.index2 != m.index:
                attrs["index_field2"] = str(m.index2)
            pci_node = pci_nodes.get(m.bdf)
            if pci_node is None:
                sb.problem(f"XPU{index}: {m.bdf} from xpu-smi -m is not a Kunlunxin device in {PCI_DEVICES}")
            elif pci_node >= 0:
                group_nodes[index] = pci_node
        if aff is not None:
            pix = [nic for nic, rel in aff.nics.items() if rel == "PIX"]
            if pix:
                attrs["pix_nics"] = ",".join(pix)
            if aff.numa_node is not None:
                pci_node = group_nodes.get(index)
                if pci_node is not None and pci_node != aff.numa_node:
                    sb.problem(f"XPU{index}: xpu-smi topo -m says NUMA {aff.numa_node}, "
                               f"{PCI_DEVICES}/{m.bdf if m else '?'}/numa_node says {pci_node}")
                group_nodes[index] = aff.numa_node
        devices.append(AccelDevice(
            kind=KIND, vendor=VENDOR, index=index,
            model=(lst.model if lst and lst.model else m.model if m else ""),
            uuid=lst.uuid if lst else m.serial if m else "",
            bdf=m.bdf if m else "",
            memory_bytes=m.memory_total_mib * MIB if m else 0,
            numa_node=aff.numa_node if aff else None,
            local_cpus=aff.local_cpus if aff else (),
            attributes=attrs,
        ))
    links: tuple[AccelLink, ...] = ()
    if topo is not None:
        links = topo.links
        for x in topo.asymmetric:
            sb.problem(f"xpu-smi topo -m: asymmetric link XPU{x.a}–XPU{x.b} (row XPU{x.a} says {x.a_says}, "
                       f"row XPU{x.b} says {x.b_says}); left out")
    indices = [d.index for d in devices]
    return AcceleratorPart(tuple(devices), links, numa_groups(indices, group_nodes))


def _ids(ids: set[int]) -> str:
    return ",".join(str(i) for i in sorted(ids)) or "none"
