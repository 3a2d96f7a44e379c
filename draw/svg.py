"""A self-contained SVG drawing of one node's MemoryTopology.

The layout is computed here (no graphviz, no fonts, no scripts): packages with their memory domains
and the accelerators local to each, the memory without CPUs apart, then panels for the interconnect
between domains, the links between accelerators and CXL, and a legend. Everything is sorted and every
coordinate is an integer, so the same message always gives the same bytes. Text from the message
(node, model and device names) is untrusted: it is escaped and stripped of characters XML forbids.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

from memtopo.cpulist import format_cpulist
from memtopo.draw.metrics import BOLD, REGULAR, UNITS_PER_EM
from memtopo.links import link_word, pair_links
from memtopo.text import human_bytes, natural_key
from memtopo.v1 import topology_pb2 as pb

FONT = 11
# Text classes: (font size px or None, bold or None). The stylesheet's font rules are written from
# this table and every text is measured with it (draw/metrics.py: DejaVu Sans, the first font named).
TEXT_CLASSES: dict[str, tuple[int | None, bool | None]] = {
    "h": (17, True), "t": (13, True), "b": (None, True), "s": (10, None), "m": (9, None),
}
# A character outside the metrics table counts a full em wide: a text is never measured short.
UNKNOWN_ADVANCE = UNITS_PER_EM
LINE = 14
PAD = 8
GAP = 10
MAX_W = 1400
LEGEND_W = 460
# The panels are packed no wider than the widest of them or this: a drawing is as wide as its
# content needs, not as wide as it may be.
PACK_MIN_W = 900
DOMAIN_W = 250
DOMAIN_W_COMPACT = 214
CARD_W = 122
CARD_W_MAX = 196  # a longer model is cut (the tooltip has it whole)
CARD_H = 46
CARD_GAP = 6
CARD_W_SMALL = 118
CARD_W_SMALL_MAX = 170
CARD_H_SMALL = 33
SMALL_CARDS_FROM = 32  # accelerators on the node
GRAPH_MAX_DOMAINS = 16  # above this the interconnect is a SLIT matrix, not a graph
GRAPH_ALL_PAIRS = 12  # up to this many pairs every edge is drawn; above, the commonest distance is not
GRAPH_MAX_EDGES = 40
PERF_ROWS = 10
TEXT_ROWS = 40  # lines of a text panel (degraded sources)
CXL_ROWS = 400  # every region of a real host, but not a hostile message's millions
MATRIX_MAX = 128  # domains or accelerators: above, a matrix would be mostly area (and n² work)
# Where along an edge its label may sit, in the order tried.
LABEL_SPOTS = (0.5, 0.38, 0.62, 0.3, 0.7, 0.44, 0.56, 0.22, 0.78, 0.16, 0.84)
LABEL_MARGIN = 4

TYPE_CLASS = {
    pb.MEMORY_DOMAIN_TYPE_DRAM: "dram", pb.MEMORY_DOMAIN_TYPE_HBM: "hbm",
    pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED: "cxl", pb.MEMORY_DOMAIN_TYPE_UNIFIED: "uni",
    pb.MEMORY_DOMAIN_TYPE_NVM: "nvm", pb.MEMORY_DOMAIN_TYPE_GPU_MEMORY: "gpum",
}
TYPE_WORD = {
    pb.MEMORY_DOMAIN_TYPE_DRAM: "DRAM", pb.MEMORY_DOMAIN_TYPE_HBM: "HBM",
    pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED: "CXL", pb.MEMORY_DOMAIN_TYPE_UNIFIED: "Unified",
    pb.MEMORY_DOMAIN_TYPE_NVM: "NVM", pb.MEMORY_DOMAIN_TYPE_GPU_MEMORY: "GPU memory",
}
# Fill, stroke per domain class; the legend and the stylesheet are both made from this table.
DOMAIN_COLORS = {
    "dram": ("#e3eefa", "#3b72b0"), "hbm": ("#fdebd3", "#c87912"), "cxl": ("#f0e4f9", "#8547b8"),
    "uni": ("#e0f3e2", "#36904a"), "nvm": ("#f7f0d2", "#9a8220"), "gpum": ("#ddf3ee", "#22907a"),
    "unk": ("#eeeeee", "#888888"),
}
# Fast accelerator links by vendor word; PCIe path classes in greys, nearest darkest.
LINK_COLORS = {
    "NV": "#2e8b57", "HCCS": "#c0392b", "HCCS_SW": "#e8613c", "SIO": "#e39b2d", "XGMI": "#8e44ad",
    "XL": "#1f77b4", "PIX": "#8fa9c4", "PXB": "#a9bdd2", "PHB": "#c3d1e0", "NODE": "#d9e1ea",
    "SYS": "#eceff3",
}
PERF_WORD = {
    pb.PERFORMANCE_SOURCE_HMAT: "HMAT", pb.PERFORMANCE_SOURCE_HWLOC_MEMATTR: "hwloc",
    pb.PERFORMANCE_SOURCE_VENDOR_API: "vendor", pb.PERFORMANCE_SOURCE_NOMINAL: "nominal",
}
PCI_CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")
OTHER_LINK = "#b0b0b0"
CXL_EDGE = DOMAIN_COLORS["cxl"][1]
NEAR_RGB = (27, 79, 150)
FAR_RGB = (226, 234, 244)

ROOT_CLASS = "memtopo-drawing"
_RULES = "".join([
    f"text{{font-family:'DejaVu Sans',Verdana,Arial,sans-serif;font-size:{FONT}px;fill:#1d2530}}",
    *(f".{c}{{" + ";".join(([f"font-size:{size}px"] if size else []) + (["font-weight:bold"] if bold else []))
      + "}" for c, (size, bold) in TEXT_CLASSES.items()),
    ".s{fill:#4a5563}.w{fill:#fff}",
    ".pk{fill:#f5f7f9;stroke:#8a96a3}.sec{fill:none;stroke:#c9d1da}",
    ".nc{stroke-dasharray:5 3;stroke-width:1.6}",
    ".card{fill:#fff;stroke:#6b7684}.gm{fill:#f4fbf5;stroke:#36904a;stroke-dasharray:3 2}",
    ".bar{fill:#fff;stroke:#9aa5b1;stroke-width:.6}.used{fill:#93aac2}",
    ".hok{fill:#2f9a3c}.hwarn{fill:#e0a020}.hbad{fill:#d0342c}.hunk{fill:#fff;stroke:#8a96a3}",
    ".e{fill:none;stroke:#5a6b7d}.ecxl{fill:none;stroke:#8547b8;stroke-dasharray:6 3}",
    ".grid{fill:none;stroke:#c9d1da;stroke-width:.5}.sw{stroke:#6b7684;stroke-width:.5}",
    *(f".{k}{{fill:{f};stroke:{s}}}" for k, (f, s) in DOMAIN_COLORS.items()),
])
# Every rule is scoped to the drawing's root: an SVG inlined into an HTML page shares the page's
# stylesheet, and short class names like .card or .b must neither leak out nor be hit by the page's.
STYLE = "".join(f".{ROOT_CLASS} {rule}" for rule in re.findall(r"[^{}]+\{[^}]*\}", _RULES))

_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(s: str) -> str:
    """Characters XML 1.0 cannot carry (control bytes in a hostile model name) become U+FFFD."""
    return _XML_BAD.sub("\ufffd", s)


def _esc(s: str) -> str:
    return escape(_clean(s))


def font_of(cls: str) -> tuple[int, bool]:
    """(size px, bold) of a text with these classes, as the stylesheet sets them."""
    size, bold = FONT, False
    for c in cls.split():
        s, b = TEXT_CLASSES.get(c, (None, None))
        size = s if s is not None else size
        bold = b if b is not None else bold
    return size, bold


def text_width(s: str, cls: str = "") -> float:
    """How wide ``s`` is drawn with these classes, in pixels (the font's advances, no kerning)."""
    size, bold = font_of(cls)
    table = BOLD if bold else REGULAR
    return sum(table.get(c, UNKNOWN_ADVANCE) for c in s) * size / UNITS_PER_EM


def _text_w(s: str, cls: str = "") -> int:
    return math.ceil(text_width(s, cls))


def _fit(s: str, width: float, cls: str = "") -> str:
    """Cut text to what fits in ``width`` pixels (an ellipsis ends what was cut)."""
    if text_width(s, cls) <= width:
        return s
    size, bold = font_of(cls)
    table = BOLD if bold else REGULAR
    room = width * UNITS_PER_EM / size - table["…"]
    used = 0
    for k, c in enumerate(s):
        used += table.get(c, UNKNOWN_ADVANCE)
        if used > room:
            return s[:k] + "…"
    return s


def compact_ids(ids: Sequence[str]) -> str:
    """Accelerator ids as ranges per prefix: NPU0 NPU1 NPU2 NPU5 → NPU0-2,5."""
    by_prefix: dict[str, list[int]] = {}
    loose: list[str] = []
    for i in ids:
        m = re.fullmatch(r"([^0-9]*)([0-9]+)", i)
        if m:
            by_prefix.setdefault(m.group(1), []).append(int(m.group(2)))
        else:
            loose.append(i)
    parts = [p + format_cpulist(sorted(set(n))) for p, n in sorted(by_prefix.items())]
    return " ".join(parts + sorted(loose))


def compact_cpus(cpus: Sequence[int], room: int = 30) -> str:
    """A cpulist short enough for a box: interleaved sets (SNC, POWER) as a stride, long ones cut."""
    ids = sorted(set(cpus))
    if not ids:
        return "none"
    text = format_cpulist(ids)
    if len(text) <= room:
        return text
    step = ids[1] - ids[0] if len(ids) > 2 else 0
    if step > 1 and all(b - a == step for a, b in itertools.pairwise(ids)):
        return f"{ids[0]},{ids[1]},…,{ids[-1]}"
    # Cut between whole elements ("0-3,8-11,…"), never inside a number or a range.
    cut = text.rfind(",", 0, room)
    if cut > 0:
        return text[:cut] + ",…"
    first = text.split(",", 1)[0]
    return first if first == text else first + ",…"  # one element longer than the room stays whole


# --- SVG fragments -------------------------------------------------------------------------------

@dataclass
class Block:
    """A laid-out piece: its size and its SVG fragments in its own coordinates."""

    w: int
    h: int
    parts: list[str] = field(default_factory=list)

    def put(self, other: Block, x: int, y: int) -> None:
        if other.parts:
            self.parts.append(f'<g transform="translate({x},{y})">')
            self.parts.extend(other.parts)
            self.parts.append("</g>")


def _rect(x: float, y: float, w: float, h: float, cls: str, rx: int = 0, title: str = "",
          fill: str = "") -> str:
    attrs = (f'x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" class="{cls}"'
             + (f' rx="{rx}"' if rx else "") + (f' fill="{fill}"' if fill else ""))
    return f"<rect {attrs}><title>{_esc(title)}</title></rect>" if title else f"<rect {attrs}/>"


def _text(x: float, y: float, s: str, cls: str = "", anchor: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    a = f' text-anchor="{anchor}"' if anchor else ""
    return f'<text x="{x:g}" y="{y:g}"{c}{a}>{_esc(s)}</text>'


def _line(x1: float, y1: float, x2: float, y2: float, cls: str, width: float = 0, color: str = "") -> str:
    extra = (f' stroke-width="{width:g}"' if width else "") + (f' stroke="{color}"' if color else "")
    return f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" class="{cls}"{extra}/>'


def _stack(blocks: Iterable[Block], gap: int = GAP) -> Block:
    out = Block(0, 0)
    y = 0
    for b in blocks:
        if not b.h:
            continue
        out.put(b, 0, y)
        y += b.h + gap
        out.w = max(out.w, b.w)
    out.h = max(0, y - gap)
    return out


def _flow(blocks: Iterable[Block], max_w: int, gap: int = GAP) -> Block:
    """Left to right, wrapping at ``max_w``; each row as tall as its tallest block."""
    out = Block(0, 0)
    x = y = row_h = 0
    for b in blocks:
        if not b.h:
            continue
        if x and x + b.w > max_w:
            x, y, row_h = 0, y + row_h + gap, 0
        out.put(b, x, y)
        x += b.w + gap
        row_h = max(row_h, b.h)
        out.w = max(out.w, x - gap)
    out.h = y + row_h
    return out


def _text_block(rows: Sequence[tuple[str, str]], max_w: int = 560, max_rows: int = TEXT_ROWS) -> Block:
    """Lines of text (text, class), each cut to ``max_w``; past ``max_rows`` the rest are counted."""
    if len(rows) > max_rows:
        rows = [*rows[:max_rows - 1], (f"… {len(rows) - max_rows + 1} more lines (--format json has them)", "s")]
    b = Block(0, LINE * len(rows))
    for k, (text, c) in enumerate(rows):
        text = _fit(text, max_w, c)
        b.parts.append(_text(0, LINE * k + 11, text, c))
        b.w = max(b.w, _text_w(text, c))
    return b


def _section(title: str, body: Block, note: str = "") -> Block:
    """A titled frame around a body. The note follows the title where the body is wide enough for
    both, else it is wrapped under the title: a note never makes the frame wider than its content."""
    title_w = _text_w(title, "t")
    inner = max(body.w, title_w)
    notes: list[str] = []
    if note and title_w + 12 + _text_w(note, "s") > inner:
        notes = _wrap(note, inner, "s")
    head = 20 + LINE * len(notes)
    out = Block(max([inner, *(_text_w(n, "s") for n in notes)]) + 2 * PAD, body.h + 2 * PAD + head)
    out.parts.append(_rect(0.5, 0.5, out.w - 1, out.h - 1, "sec", rx=6))
    out.parts.append(_text(PAD, 17, title, "t"))
    if note and not notes:
        out.parts.append(_text(PAD + title_w + 12, 17, note, "s"))
    for k, line in enumerate(notes):
        out.parts.append(_text(PAD, 17 + LINE * (k + 1), line, "s"))
    out.put(body, PAD, head + PAD)
    return out


def _wrap(text: str, width: float, cls: str) -> list[str]:
    """Words on lines no wider than ``width`` (a word wider than that is cut)."""
    lines: list[str] = []
    for word in text.split():
        if lines and text_width(f"{lines[-1]} {word}", cls) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(_fit(word, width, cls))
    return lines


# --- reading the message -------------------------------------------------------------------------

def _perf_text(p: pb.LinkPerformance) -> str:
    if p.source in (pb.PERFORMANCE_SOURCE_UNSPECIFIED, pb.PERFORMANCE_SOURCE_SLIT):
        return ""
    bw = p.read_bandwidth_mbps or p.write_bandwidth_mbps
    lat = p.read_latency_ns or p.write_latency_ns
    parts = ([_bandwidth(bw)] if bw else []) + ([f"{lat} ns"] if lat else [])
    return ", ".join(parts)


def _bandwidth(mbps: int) -> str:
    return f"{mbps / 1000:.3g} GB/s" if mbps >= 10000 else f"{mbps} MB/s"


def _health_class(health: str) -> str:
    h = health.strip().lower()
    if h in ("", "unknown", "n/a", "na", "-", "?"):
        return "hunk"
    if h in ("ok", "healthy", "normal", "good", "pass", "passed"):
        return "hok"
    if h in ("warning", "warn", "degraded", "minor", "general warning"):
        return "hwarn"
    return "hbad"


@dataclass
class _Model:
    """The message, indexed the way the layout asks for it."""

    topo: pb.MemoryTopology
    domains: list[pb.MemoryDomain]
    by_id: dict[int, pb.MemoryDomain]
    node_domain: dict[int, int]
    node_packages: dict[int, list[int]]
    accels: list[pb.Accelerator]
    home: dict[str, int]  # accelerator id → the domain it is local to
    local: dict[int, list[pb.Accelerator]]  # domain id → its local accelerators, in id order
    memory_of: dict[int, list[str]]  # NUMA node → accelerators whose own memory it holds
    free_known: bool
    compact: bool = False  # many domains: smaller boxes
    flat_packages: bool = False  # every package holds one domain and there are many: no package frames
    card_w: int = CARD_W
    memory_known: bool = True  # the input gives some accelerator's memory size

    @property
    def small_cards(self) -> bool:
        return len(self.accels) >= SMALL_CARDS_FROM

    @property
    def domain_w(self) -> int:
        return DOMAIN_W_COMPACT if self.compact else DOMAIN_W

    @classmethod
    def of(cls, topo: pb.MemoryTopology) -> _Model:
        domains = sorted(topo.domains, key=lambda d: d.id)
        by_id = {d.id: d for d in domains}
        node_domain = {n.id: n.domain for n in topo.numa_nodes if n.domain >= 0}
        for d in domains:
            for n in d.numa_nodes:
                node_domain.setdefault(n, d.id)
        node_packages = {n.id: sorted(n.packages) for n in topo.numa_nodes}
        accels = sorted(topo.accelerators, key=lambda a: natural_key(a.id))
        home: dict[str, int] = {}
        for a in accels:
            if a.domain >= 0 and a.domain in by_id:
                home[a.id] = a.domain
            elif a.numa_node >= 0 and node_domain.get(a.numa_node, -1) in by_id:
                home[a.id] = node_domain[a.numa_node]
        local: dict[int, list[pb.Accelerator]] = {}
        memory_of: dict[int, list[str]] = {}
        for a in accels:
            if a.id in home:
                local.setdefault(home[a.id], []).append(a)
            for n in sorted(set(a.memory_numa_nodes)):
                memory_of.setdefault(n, []).append(a.id)
        # Free memory is 0 everywhere in an hwloc XML export: unknown, not full.
        free_known = any(d.free_bytes for d in domains)
        m = cls(topo, domains, by_id, node_domain, node_packages, accels, home, local, memory_of, free_known)
        m.compact = len(domains) > GRAPH_MAX_DOMAINS
        groups = _package_groups(m)
        m.flat_packages = m.compact and all(len(doms) == 1 for _, doms in groups)
        m.card_w = card_width(accels, m.small_cards)
        m.memory_known = not accels or any(a.memory_bytes for a in accels)
        return m

    def packages_of(self, d: pb.MemoryDomain) -> list[int]:
        return sorted({p for n in d.numa_nodes for p in self.node_packages.get(n, [])})

    def fabric(self, d: pb.MemoryDomain) -> list[pb.MemoryInterconnect]:
        return [i for i in self.topo.interconnects
                if i.link_type == pb.MEMORY_LINK_TYPE_COHERENT_FABRIC and i.domain_a == i.domain_b == d.id]


# --- boxes ---------------------------------------------------------------------------------------

def _card_lines(a: pb.Accelerator, memory_known: bool) -> tuple[str, str, str]:
    """What a card says: its id, its model, and its memory; where the input gives no accelerator's
    memory (an hwloc export without CUDA devices), its PCI address instead of a "memory ?" on each."""
    # The card has room for the model only; the vendor and the rest are in the tooltip.
    model = a.model.removeprefix(a.vendor).strip() or a.model or "model ?"
    memory = (human_bytes(a.memory_bytes).replace(".0 ", " ") if a.memory_bytes
              else "memory ?" if memory_known or not a.bdf else a.bdf)
    health = _health_class(a.health)
    sick = f" · {a.health}" if health in ("hwarn", "hbad") else ""
    return a.id, model, memory + sick


def card_width(accels: Sequence[pb.Accelerator], small: bool) -> int:
    """One width for every card of the drawing: as wide as its longest line needs, within limits."""
    memory_known = any(a.memory_bytes for a in accels)
    low, high = (CARD_W_SMALL, CARD_W_SMALL_MAX) if small else (CARD_W, CARD_W_MAX)
    need = 0
    for a in accels:
        ident, model, third = _card_lines(a, memory_known)
        lines = [f"{model} · {third}"] if small else [model, third]
        need = max(need, _text_w(ident, "b") + 24, *(_text_w(line, "s") + 12 for line in lines))
    return max(low, min(high, need))


def _accel_card(a: pb.Accelerator, w: int, small: bool, memory_known: bool) -> Block:
    """An accelerator: id and health dot, model, memory. ``small`` (many accelerators) folds model and
    memory into one line."""
    h = CARD_H_SMALL if small else CARD_H
    b = Block(w, h)
    vendor_model = a.model if a.model.lower().startswith(a.vendor.lower()) else f"{a.vendor} {a.model}".strip()
    ident, model, third = _card_lines(a, memory_known)
    memory = human_bytes(a.memory_bytes).replace(".0 ", " ") if a.memory_bytes else "memory ?"
    title = "  ".join(x for x in (a.id, vendor_model, a.uuid, a.bdf, memory, f"health {a.health or '?'}") if x)
    b.parts.append(_rect(0.5, 0.5, w - 1, h - 1, "card", rx=4, title=title))
    b.parts.append(f'<circle cx="{w - 10}" cy="10" r="5" class="{_health_class(a.health)}"/>')
    b.parts.append(_text(6, 14, _fit(ident, w - 24, "b"), "b"))
    if small:
        b.parts.append(_text(6, 27, _fit(f"{model} · {third}", w - 12, "s"), "s"))
    else:
        b.parts.append(_text(6, 27, _fit(model, w - 12, "s"), "s"))
        b.parts.append(_text(6, 40, _fit(third, w - 12, "s"), "s"))
    return b


def _cards(m: _Model, accels: Sequence[pb.Accelerator], min_w: int = 0, max_w: int = 0) -> Block:
    """A near-square grid of cards, filling ``min_w`` and, given ``max_w``, no wider than that allows."""
    w = m.card_w

    def fit(width: int) -> int:
        return (width + CARD_GAP) // (w + CARD_GAP)

    per_row = max(fit(min_w), math.ceil(math.sqrt(len(accels))))
    if max_w:
        per_row = min(per_row, max(fit(max_w), fit(min_w)))
    per_row = max(1, min(len(accels), per_row, fit(MAX_W - 6 * PAD)))
    return _flow((_accel_card(a, w, m.small_cards, m.memory_known) for a in accels),
                 per_row * (w + CARD_GAP) - CARD_GAP, CARD_GAP)


def _domain_lines(m: _Model, d: pb.MemoryDomain, width: int) -> list[tuple[str, str, bool]]:
    """(text, class, bar below) for each line of a domain box."""
    nodes = f"node{'s' if len(d.numa_nodes) > 1 else ''} {format_cpulist(d.numa_nodes) or '-'}"
    lines: list[tuple[str, str, bool]] = []
    cpus = f"CPUs {compact_cpus(d.attached_cpus)} ({len(d.attached_cpus)})"
    if m.flat_packages and d.attached_cpus:
        # No package frame around the box: the package goes on the node line, the CPUs on their own.
        packages = m.packages_of(d)
        lines.append((f"{nodes} · package{'s' if len(packages) > 1 else ''} {format_cpulist(packages) or '?'}",
                      "s", False))
        lines.append((cpus, "", False))
    elif d.attached_cpus:
        lines.append((f"{nodes} · {cpus}", "", False))
    else:
        near = _near(m, d)
        where = f" (domain {format_cpulist(near)})" if near else ""
        lines.append((f"{nodes} · no CPUs", "", False))
        lines.append((f"near CPUs {compact_cpus(d.local_cpus, 16)}{where}" if d.local_cpus
                      else "no initiator known", "s", False))
    free = f", {human_bytes(d.free_bytes)} free" if m.free_known else ""
    lines.append((f"{human_bytes(d.capacity_bytes)}{free}", "", m.free_known and d.capacity_bytes > 0))
    tier = [f"{who} tier {t}" for who, t in (("kernel", d.kernel_tier), ("hwloc", d.hwloc_tier)) if t >= 0]
    if tier:
        lines.append((" · ".join(tier), "s", False))
    perf = _perf_text(d.local_performance)
    if perf:
        lines.append((f"{PERF_WORD.get(d.local_performance.source, '')} local {perf}".strip(), "s", False))
    if 0 <= d.cxl_region < len(m.topo.cxl_regions):
        r = m.topo.cxl_regions[d.cxl_region]
        hosts = sorted({dv.numa_node for dv in m.topo.cxl_devices if dv.name in r.memdevs and dv.numa_node >= 0})
        via = f" via node {format_cpulist(hosts)}" if hosts else ""
        lines.append((f"CXL {r.name} ({r.mode or '?'}, {r.interleave_ways} way){via}", "s", False))
    owners = sorted({a for n in d.numa_nodes for a in m.memory_of.get(n, [])}, key=natural_key)
    if owners and d.type != pb.MEMORY_DOMAIN_TYPE_UNIFIED:
        lines.append((f"memory of {compact_ids(owners)}", "s", False))
    if d.memory_side_caches:
        lines.append((f"memory-side cache {human_bytes(d.memory_side_caches[0].size_bytes)}", "s", False))
    if d.note:
        lines.append((d.note, "s", False))
    return [(_fit(t, width - 2 * PAD, c), c, bar) for t, c, bar in lines]


def _domain_box(m: _Model, d: pb.MemoryDomain, inside: Sequence[pb.Accelerator], min_w: int) -> Block:
    """One memory domain; a Unified domain holds its accelerators (their memory is this memory)."""
    gpu = _cards(m, inside, min_w - 4 * PAD) if inside else Block(0, 0)
    width = max(min_w, gpu.w + 4 * PAD if inside else 0)
    lines = _domain_lines(m, d, width)
    kind = TYPE_WORD.get(d.type, "memory")
    if d.subtype and d.subtype.lower().replace(" ", "") != kind.lower().replace(" ", ""):
        kind += f" · {d.subtype}"
    name = f"domain {d.id}"
    parts: list[str] = [_text(PAD, 20, name, "b")]
    y = 20
    if _text_w(name, "b") + 12 + _text_w(kind, "b") <= width - 2 * PAD:
        parts.append(_text(width - PAD, 20, kind, "b", "end"))
    else:  # a long type (Unified · DRAM+GPUMemory) gets a line of its own rather than a cut
        y += LINE
        parts.append(_text(PAD, y, _fit(kind, width - 2 * PAD, "b"), "b"))
    for text, cls, bar in lines:
        y += LINE
        parts.append(_text(PAD, y, text, cls))
        if bar:
            used = max(0.0, min(1.0, 1 - d.free_bytes / d.capacity_bytes))
            parts.append(_rect(PAD, y + 4, width - 2 * PAD, 5, "bar"))
            if used:
                parts.append(_rect(PAD, y + 4, round((width - 2 * PAD) * used), 5, "used"))
            y += 7
    y += PAD
    if inside:
        bws = sorted({_perf_text(f.a_to_b) for f in m.fabric(d)} - {""})
        nodes = format_cpulist(sorted({n for a in inside for n in a.memory_numa_nodes}))
        plural = "s" if "," in nodes or "-" in nodes else ""
        label = "GPU memory" + (f" (node{plural} {nodes})" if nodes else "")
        label += f" ⇄ CPU {', '.join(bws)}" if bws else ""
        frame = Block(width - 2 * PAD, gpu.h + 2 * PAD + 16)
        frame.parts.append(_rect(0.5, 0.5, frame.w - 1, frame.h - 1, "gm", rx=4))
        frame.parts.append(_text(PAD, 13, _fit(label, frame.w - 2 * PAD, "s"), "s"))
        frame.put(gpu, PAD, 16 + PAD // 2)
        box = Block(width, y + frame.h + PAD)
        box.put(frame, PAD, y)
    else:
        box = Block(width, y)
    nc = "" if d.attached_cpus else " nc"
    box.parts[:0] = [_rect(0.5, 0.5, width - 1, box.h - 1, TYPE_CLASS.get(d.type, "unk") + nc, rx=5), *parts]
    return box


def _domain_column(m: _Model, d: pb.MemoryDomain, max_w: int = 0) -> Block:
    """A domain box with the accelerators local to it underneath, as wide as their cards (at most
    ``max_w`` when the grid can be narrower)."""
    mine = m.local.get(d.id, [])
    unified = d.type == pb.MEMORY_DOMAIN_TYPE_UNIFIED
    inside = [a for a in mine if unified and a.unified_memory]
    below = [a for a in mine if not (unified and a.unified_memory)]
    cards = _cards(m, below, m.domain_w, max_w) if below else Block(0, 0)
    box = _domain_box(m, d, inside, max(m.domain_w, cards.w))
    if not below:
        return box
    col = Block(max(box.w, cards.w), box.h + 12 + cards.h)
    col.put(box, 0, 0)
    # A short stem says "local to the domain above".
    col.parts.append(_line(20, box.h, 20, box.h + 12, "e", 1.5))
    col.put(cards, 0, box.h + 12)
    return col


def _package_block(m: _Model, packages: list[int], domains: list[pb.MemoryDomain]) -> Block:
    # Narrower card grids (taller columns) where that keeps a package's domains on one row.
    room = MAX_W - 4 * PAD
    share = (room - GAP * (len(domains) - 1)) // max(1, len(domains))
    cols = _flow((_domain_column(m, d, share) for d in domains), room)
    cpus = sorted({c for d in domains for c in d.attached_cpus})
    word = "package" if len(packages) == 1 else "packages"
    title = _fit(f"{word} {format_cpulist(packages)}" if packages else "package ?", 400, "t")
    sub = f"CPUs {compact_cpus(cpus, 40)}"
    w = max(cols.w + 2 * PAD, _text_w(title, "t") + _text_w(sub, "s") + 3 * PAD)
    b = Block(w, cols.h + 2 * PAD + 22)
    b.parts.append(_rect(0.5, 0.5, w - 1, b.h - 1, "pk", rx=7))
    b.parts.append(_text(PAD, 18, title, "t"))
    b.parts.append(_text(PAD + _text_w(title, "t") + PAD, 18, sub, "s"))
    b.put(cols, PAD, 22 + PAD)
    return b


def _package_groups(m: _Model) -> list[tuple[list[int], list[pb.MemoryDomain]]]:
    """Domains with CPUs grouped by the packages they share (a union over shared package ids)."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    with_cpus = [d for d in m.domains if d.attached_cpus]
    for d in with_cpus:
        pk = m.packages_of(d)
        for p in pk[1:]:
            parent[find(p)] = find(pk[0])
    groups: dict[int, list[pb.MemoryDomain]] = {}
    for d in with_cpus:
        pk = m.packages_of(d)
        groups.setdefault(find(pk[0]) if pk else -1, []).append(d)
    out = [(sorted({p for d in doms for p in m.packages_of(d)}), doms) for doms in groups.values()]
    return sorted(out, key=lambda g: (not g[0], g[0][:1], g[1][0].id))


def _packages(m: _Model) -> Block:
    groups = _package_groups(m)
    if m.flat_packages:
        # Many one-domain packages: the frames would double the area; the box names its package.
        return _flow((_domain_column(m, d) for _, doms in groups for d in doms), MAX_W)
    return _flow((_package_block(m, pk, doms) for pk, doms in groups), MAX_W)


# --- panels --------------------------------------------------------------------------------------

def _ramp(i: int, n: int) -> str:
    t = i / (n - 1) if n > 1 else 0.0
    rgb = [round(a + (b - a) * t) for a, b in zip(NEAR_RGB, FAR_RGB, strict=True)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def _slit_matrix(m: _Model) -> tuple[list[int], list[list[int]]]:
    ids = [d.id for d in m.domains]
    # A domain's distances follow the message's domain order, which need not be id order.
    sent = {d.id: k for k, d in enumerate(m.topo.domains)}
    if len(sent) == len(ids) and all(len(d.distances) == len(ids) for d in m.domains):
        return ids, [[d.distances[sent[i]] for i in ids] for d in m.domains]
    pos = {d: i for i, d in enumerate(ids)}
    rows = [[10 if i == j else 0 for j in range(len(ids))] for i in range(len(ids))]
    for ic in m.topo.interconnects:
        if ic.domain_a in pos and ic.domain_b in pos and ic.domain_a != ic.domain_b:
            rows[pos[ic.domain_a]][pos[ic.domain_b]] = ic.distance_a_to_b
            rows[pos[ic.domain_b]][pos[ic.domain_a]] = ic.distance_b_to_a
    return ids, rows


def _pairs(m: _Model) -> list[pb.MemoryInterconnect]:
    """One link per pair of known domains, in pair order (a repeated pair keeps its first in that order)."""
    def key(i: pb.MemoryInterconnect) -> tuple[int, int, int, int, int, str, str]:
        return (i.domain_a, i.domain_b, i.distance_a_to_b, i.distance_b_to_a, i.link_type, _perf_text(i.a_to_b),
                _perf_text(i.b_to_a))
    out: dict[tuple[int, int], pb.MemoryInterconnect] = {}
    for i in sorted((i for i in m.topo.interconnects if i.domain_a != i.domain_b and
                     i.domain_a in m.by_id and i.domain_b in m.by_id), key=key):
        out.setdefault((i.domain_a, i.domain_b), i)
    return list(out.values())


def _perf_rows(m: _Model) -> list[str]:
    rows = []
    for i in _pairs(m):
        for a, b, p in ((i.domain_a, i.domain_b, i.a_to_b), (i.domain_b, i.domain_a, i.b_to_a)):
            t = _perf_text(p)
            if t:
                rows.append(f"domain {a} CPUs → domain {b} memory: {t}")
    return rows


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def _near(m: _Model, d: pb.MemoryDomain) -> list[int]:
    """The domains whose CPUs are local to a CPU-less domain's memory (its initiators)."""
    local = set(d.local_cpus)
    return [o.id for o in m.domains if o.id != d.id and local.intersection(o.attached_cpus)]


def _ring_order(m: _Model) -> list[pb.MemoryDomain]:
    """Domains with CPUs package by package, each followed by the CPU-less ones near it, so that the
    short edges of the ring join neighbours."""
    placed: set[int] = set()
    order: list[pb.MemoryDomain] = []
    cpuless = [d for d in m.domains if not d.attached_cpus]
    for d in (d for _, doms in _package_groups(m) for d in doms):
        order.append(d)
        for c in cpuless:
            if c.id not in placed and _near(m, c)[:1] == [d.id]:
                order.append(c)
                placed.add(c.id)
    return order + [c for c in cpuless if c.id not in placed]


def crosses(segment: tuple[float, float, float, float], rect: tuple[float, float, float, float]) -> bool:
    """Whether the line from (x1, y1) to (x2, y2) passes through the rectangle (x, y, w, h)."""
    x1, y1, x2, y2 = segment
    rx, ry, rw, rh = rect
    dx, dy = x2 - x1, y2 - y1
    low, high = 0.0, 1.0
    # Liang-Barsky: the part of the line inside each of the four half-planes.
    for p, q in ((-dx, x1 - rx), (dx, rx + rw - x1), (-dy, y1 - ry), (dy, ry + rh - y1)):
        if p == 0:
            if q < 0:
                return False
            continue
        t = q / p
        if p < 0:
            low = max(low, t)
        else:
            high = min(high, t)
        if low > high:
            return False
    return True


def _interconnect_graph(m: _Model) -> Block:
    n = len(m.domains)
    size = 260 if n == 2 else 280 if n <= 4 else 360 if n <= 8 else 440
    r = size // 2 - 36
    cx = cy = size // 2
    if n == 2:
        cy = 20
    pos = {}
    for k, d in enumerate(_ring_order(m)):
        # Two domains side by side; more on a ring from the top, clockwise.
        ang = math.pi * (1 + k) if n == 2 else -math.pi / 2 + 2 * math.pi * k / n
        pos[d.id] = (cx + round(r * math.cos(ang)), cy + round(r * math.sin(ang)))
    pairs = _pairs(m)
    hidden: list[pb.MemoryInterconnect] = []
    shown = pairs
    background = 0
    if len(pairs) > GRAPH_ALL_PAIRS:
        counts = Counter(i.distance_a_to_b for i in pairs)
        background = max(counts, key=lambda v: (counts[v], v))
        hidden, shown = [], []
        for i in pairs:
            plain = i.distance_a_to_b == i.distance_b_to_a == background
            (hidden if plain and not _perf_text(i.a_to_b) and not _perf_text(i.b_to_a) else shown).append(i)
    if len(shown) > GRAPH_MAX_EDGES:
        shown.sort(key=lambda i: (min(i.distance_a_to_b, i.distance_b_to_a), i.domain_a, i.domain_b))
        hidden += shown[GRAPH_MAX_EDGES:]
        shown = shown[:GRAPH_MAX_EDGES]
    values = sorted({min(i.distance_a_to_b, i.distance_b_to_a) for i in shown})
    b = Block(size, 2 * cy)
    edges = sorted(shown, key=lambda i: (-min(i.distance_a_to_b, i.distance_b_to_a), i.domain_a, i.domain_b))
    segments = [(*pos[i.domain_a], *pos[i.domain_b]) for i in edges]
    # What a label may cover: no domain box, no other label, no other edge (a label beside a
    # crossing would be read as the other edge's).
    taken: list[tuple[float, float, float, float]] = [(x - 28, y - 12, 56, 24) for x, y in pos.values()]
    labels = []
    for k, i in enumerate(edges):
        x1, y1, x2, y2 = segments[k]
        dist = min(i.distance_a_to_b, i.distance_b_to_a)
        rank = values.index(dist)
        width = 3.0 - 2.0 * rank / max(1, len(values) - 1)
        cxl = i.link_type == pb.MEMORY_LINK_TYPE_CXL_SWITCH
        color = CXL_EDGE if cxl else _ramp(rank, len(values) + 1)
        pair = f"{i.domain_a}-{i.domain_b}"
        b.parts.append(_line(x1, y1, x2, y2, "ecxl" if cxl else "e", round(width, 1), "" if cxl else color)
                       .replace("<line ", f'<line data-pair="{pair}" ', 1))
        slit = ("" if not i.distance_a_to_b else str(i.distance_a_to_b)
                if i.distance_a_to_b == i.distance_b_to_a else f"{i.distance_a_to_b}/{i.distance_b_to_a}")
        perf = _perf_text(i.a_to_b) or _perf_text(i.b_to_a)
        # The measured figures too where they fit; they are listed beside the graph either way.
        texts = list(dict.fromkeys(t for t in (" · ".join(x for x in (slit, perf) if x), slit or perf) if t))
        if not texts:
            continue
        others = [seg for j, seg in enumerate(segments) if j != k]
        best: tuple[tuple[int, int, int], str, tuple[float, float, float, float]] | None = None
        for ti, label in enumerate(texts):
            lw = _text_w(label, "s") + 6
            for si, t in enumerate(LABEL_SPOTS):
                lx, ly = round(x1 + (x2 - x1) * t), round(y1 + (y2 - y1) * t)
                box = (lx - lw / 2, ly - 7.0, float(lw), 14.0)
                # A margin around it: a label just beside another edge would still read as its.
                near = (box[0] - LABEL_MARGIN, box[1] - LABEL_MARGIN, box[2] + 2 * LABEL_MARGIN,
                        box[3] + 2 * LABEL_MARGIN)
                clash = (10 * sum(_overlap(box, o) for o in taken) + sum(crosses(seg, near) for seg in others),
                         ti, si)
                if best is None or clash < best[0]:
                    best = (clash, label, box)
            if best is not None and best[0][0] == 0:
                break
        assert best is not None
        _, label, box = best
        taken.append(box)
        bx, by, bw, bh = box
        labels.append(f'<g data-pair="{pair}"><rect x="{bx:g}" y="{by:g}" width="{bw:g}" height="{bh:g}" class="w"'
                      f' rx="3" stroke="{color}" stroke-width=".8"/>'
                      + _text(bx + bw / 2, by + 10, label, "s", "middle") + "</g>")
    b.parts.extend(labels)
    for d in m.domains:
        x, y = pos[d.id]
        cls = TYPE_CLASS.get(d.type, "unk") + ("" if d.attached_cpus else " nc")
        b.parts.append(_rect(x - 27, y - 11, 54, 22, cls, rx=4,
                             title=f"domain {d.id}: nodes {format_cpulist(d.numa_nodes)}"))
        b.parts.append(_text(x, y + 4, f"d{d.id}", "b", "middle"))
    if hidden:
        same = all(i.distance_a_to_b == i.distance_b_to_a == background for i in hidden)
        at = f"at SLIT {background}" if background else "with no SLIT distance"
        note = (f"{len(hidden)} more pairs {at}, not drawn" if same
                else f"{len(hidden)} more pairs not drawn (the farthest)")
        b.h += 16
        b.parts.append(_text(4, b.h - 4, note, "s"))
    return b


def _matrix_cells(n: int, cell: int, color_of: Callable[[int, int], str], words: Callable[[int, int], str] | None,
                  labels: Sequence[str]) -> Block:
    """An n×n grid with row/column labels; runs of one colour in a row are one rect."""
    labels = [_fit(lab, 90, "m") for lab in labels]
    margin = max(_text_w(lab, "m") for lab in labels) + 6 if labels else 0
    step = max(1, math.ceil(12 / cell))
    b = Block(margin + n * cell + 2, margin + n * cell + 2)
    for i in range(n):
        j = 0
        while j < n:
            c = color_of(i, j)
            k = j
            while k + 1 < n and color_of(i, k + 1) == c:
                k += 1
            if c:
                b.parts.append(f'<rect x="{margin + j * cell}" y="{margin + i * cell}" width="{(k - j + 1) * cell}"'
                               f' height="{cell}" fill="{c}"/>')
            j = k + 1
    if words is not None:
        for i in range(n):
            for j in range(n):
                w = words(i, j)
                if w:
                    b.parts.append(_text(margin + j * cell + cell / 2, margin + i * cell + cell / 2 + 3, w,
                                         "m", "middle"))
    b.parts.append(_rect(margin, margin, n * cell, n * cell, "grid"))
    for k in range(0, n, step):
        lab = labels[k]
        b.parts.append(_text(margin - 3, margin + k * cell + cell / 2 + 3, lab, "m", "end"))
        x = margin + k * cell + cell / 2 + 3
        b.parts.append(f'<text x="{x:g}" y="{margin - 3}" class="m" transform="rotate(-90 {x:g} {margin - 3})">'
                       f"{_esc(lab)}</text>")
    return b


def _interconnect_matrix(m: _Model) -> Block:
    if len(m.domains) > MATRIX_MAX:
        # From the domains' SLIT rows: above 64 domains most pairs are no interconnect message.
        _, rows = _slit_matrix(m)
        counts = Counter(itertools.chain.from_iterable(row[k + 1:] for k, row in enumerate(rows)))
        lines = [f"{len(m.domains)} domains: no matrix above {MATRIX_MAX} (--format json has every distance)",
                 *(f"SLIT {v}: {counts[v]} pairs" for v in sorted(counts))]
        return _text_block([(t, "s") for t in lines])
    ids, rows = _slit_matrix(m)
    n = len(ids)
    values = sorted({v for row in rows for v in row if v})
    color = {v: _ramp(k, len(values)) for k, v in enumerate(values)}
    cell = max(4, min(14, 460 // n))
    grid = _matrix_cells(n, cell, lambda i, j: color.get(rows[i][j], ""), None, [f"d{i}" for i in ids])
    pair_count = Counter(rows[i][j] for i in range(n) for j in range(i + 1, n))
    key = Block(0, 0)
    y = 0
    for v in values:
        key.parts.append(_rect(0, y, 12, 12, "sw", fill=color[v]))
        what = "self" if all(rows[i][i] == v for i in range(n)) and not pair_count[v] else f"{pair_count[v]} pairs"
        key.parts.append(_text(18, y + 10, f"SLIT {v}: {what}", "s"))
        y += 16
        key.w = max(key.w, 18 + _text_w(f"SLIT {v}: {what}", "s"))
    key.h = y
    return _flow([grid, key], MAX_W)


def _interconnect(m: _Model) -> Block:
    pairs = _pairs(m)
    if not pairs and not m.topo.HasField("slit_only_pairs_omitted"):
        return Block(0, 0)
    body = _interconnect_graph(m) if len(m.domains) <= GRAPH_MAX_DOMAINS else _interconnect_matrix(m)
    rows = _perf_rows(m)
    if rows:
        extra = [*rows[:PERF_ROWS], *([f"… {len(rows) - PERF_ROWS} more"] if len(rows) > PERF_ROWS else [])]
        body = _stack([body, _text_block([(t, "s") for t in extra])])
    cxl = any(i.link_type == pb.MEMORY_LINK_TYPE_CXL_SWITCH for i in pairs)
    note = "dN = domain N; SLIT distance (10 = local)" + (", dashed: through CXL" if cxl else "")
    return _section("Interconnect between domains", body, note)


def _link_rank(lk: pb.AcceleratorLink) -> tuple[int, int, str]:
    """Which of a pair's links its matrix cell shows, whatever their order in the message: a fast link
    before a PCIe path class, more links before fewer, the nearer PCIe class before the farther."""
    pci = PCI_CLASSES.index(lk.kind) + 1 if lk.kind in PCI_CLASSES else 0
    return (pci, -lk.count, lk.kind)


def _link_color(word: str, kind: str) -> str:
    return LINK_COLORS.get(kind, LINK_COLORS.get(word, OTHER_LINK))


def _accel_links(m: _Model) -> Block:
    accels = m.accels
    if not accels or not (m.topo.accelerator_links or m.topo.accelerator_groups):
        return Block(0, 0)
    lines: list[tuple[str, str, str]] = []  # text, class, swatch colour
    for g in sorted(m.topo.accelerator_groups, key=lambda g: (g.kind, sorted(g.members, key=natural_key),
                                                               g.link_kind, g.link_count, g.bandwidth_mbps)):
        members = sorted(g.members, key=natural_key)
        every = ""
        if g.link_kind:
            word = link_word(pb.AcceleratorLink(kind=g.link_kind, count=g.link_count))
            every = f", every pair {word}" + (f" {_bandwidth(g.bandwidth_mbps)}" if g.bandwidth_mbps else "")
        lines.append((f"{g.kind}: {compact_ids(members)} ({len(members)}{every})", "",
                      _link_color(g.link_kind, g.link_kind) if g.link_kind else ""))
    counts: Counter[tuple[str, str]] = Counter((link_word(lk), lk.kind) for lk in m.topo.accelerator_links)
    fast = sorted((k for k in counts if k[1] not in PCI_CLASSES), key=lambda k: (k[1], natural_key(k[0])))
    pci = sorted((k for k in counts if k[1] in PCI_CLASSES), key=lambda k: PCI_CLASSES.index(k[1]))
    for word, kind in fast + pci:
        lines.append((f"{word}: {counts[(word, kind)]} pair{'s' if counts[(word, kind)] != 1 else ''}"
                      + ("  (PCIe path)" if kind in PCI_CLASSES else ""), "s", _link_color(word, kind)))
    if len(lines) > TEXT_ROWS:
        lines = [*lines[:TEXT_ROWS - 1], (f"… {len(lines) - TEXT_ROWS + 1} more lines", "s", "")]
    text = Block(0, LINE * len(lines))
    for k, (t, c, sw) in enumerate(lines):
        x = 0
        if sw:
            text.parts.append(_rect(0, LINE * k + 1, 11, 11, "sw", fill=sw))
            x = 16
        t = _fit(t, 560 - x, c)
        text.parts.append(_text(x, LINE * k + 11, t, c))
        text.w = max(text.w, x + _text_w(t, c))
    blocks = [text]
    biggest = max((len(g.members) for g in m.topo.accelerator_groups), default=0)
    if len(accels) > MATRIX_MAX or biggest > MATRIX_MAX:
        blocks.append(_text_block([(f"{len(accels)} accelerators: no matrix above {MATRIX_MAX}", "s")]))
    elif len(accels) >= 2:
        idx = {a.id: k for k, a in enumerate(accels)}
        n = len(accels)
        cell = max(5, min(30, 420 // n))
        cells: dict[tuple[int, int], pb.AcceleratorLink] = {}
        for a, b, lk in pair_links(m.topo):
            if a in idx and b in idx:
                for key in ((idx[a], idx[b]), (idx[b], idx[a])):
                    old = cells.get(key)
                    if old is None or _link_rank(lk) < _link_rank(old):
                        cells[key] = lk
        def words(i: int, j: int) -> str:
            lk = cells.get((i, j))
            w = link_word(lk) if lk is not None else ""
            return w if _text_w(w, "m") <= cell - 6 else ""
        grid = _matrix_cells(
            n, cell, lambda i, j: _link_color(link_word(cells[(i, j)]), cells[(i, j)].kind) if (i, j) in cells
            else ("#39424e" if i == j else ""), words, [a.id for a in accels])
        blocks.append(grid)
    return _section("Accelerator links", _stack(blocks), "by kind; a switched fabric is one group")


def _cxl(m: _Model) -> Block:
    t = m.topo
    if not (t.cxl_devices or t.cxl_regions):
        return Block(0, 0)
    rows: list[tuple[str, str]] = []
    for r in sorted(t.cxl_regions, key=lambda r: natural_key(r.name)):
        dom = m.node_domain.get(r.numa_node, -1) if r.numa_node >= 0 else -1
        where = (f"node {r.numa_node}" + (f" = domain {dom}" if dom >= 0 else "")) if r.numa_node >= 0 \
            else "not onlined"
        rows.append((f"{r.name}: {human_bytes(r.size_bytes)} {r.mode or '?'}, {r.interleave_ways} way"
                     f" → {where}", "b"))
        rows.append((f"memdevs {', '.join(r.memdevs) or '-'}; dax {', '.join(r.dax_devices) or '-'}"
                     f" {r.dax_mode}".rstrip(), "s"))
    for dv in sorted(t.cxl_devices, key=lambda d: natural_key(d.name)):
        rows.append((f"{dv.name}: ram {human_bytes(dv.ram_size_bytes)}, pmem {human_bytes(dv.pmem_size_bytes)},"
                     f" at {dv.host or '?'} under {dv.host_bridge or '?'} (node {dv.numa_node})", "s"))
    return _section("CXL", _text_block(rows, max_rows=CXL_ROWS))


def _loose_nodes(m: _Model) -> Block:
    """NUMA nodes in no domain (MIG placeholders, offline CXL windows), grouped by what they are."""
    groups: dict[str, list[int]] = {}
    for n in m.topo.numa_nodes:
        if n.domain < 0 and n.id not in m.node_domain:
            what = n.note or ("possible, offline" if n.state == pb.NUMA_NODE_STATE_POSSIBLE_OFFLINE
                              else f"CPUs {compact_cpus(n.cpus)}, no memory" if n.cpus and not n.memory_bytes
                              else "no memory" if not n.memory_bytes else "in no domain")
            groups.setdefault(what, []).append(n.id)
    if not groups:
        return Block(0, 0)
    rows = [(f"node{'s' if len(ids) > 1 else ''} {format_cpulist(ids)}: {what}", "s")
            for what, ids in sorted(groups.items(), key=lambda g: (min(g[1]), g[0]))]
    return _section("NUMA nodes outside the domains", _text_block(rows))


def _sources(m: _Model) -> Block:
    bad = [s for s in sorted(m.topo.sources, key=lambda s: s.source) if s.state == pb.SOURCE_STATE_DEGRADED]
    if not bad:
        return Block(0, 0)
    rows = []
    for s in bad:
        rows.append((s.source, "b"))
        rows += [(f"  {r}", "s") for r in list(s.reasons)[:3]]
    return _section("Degraded sources", _text_block(rows))


def _legend(m: _Model, width: int) -> Block:
    """Only what the drawing uses."""
    types = {TYPE_CLASS.get(d.type, "unk") for d in m.domains}
    items: list[tuple[str, str]] = []  # swatch markup, label
    for cls, word in (("dram", "DRAM"), ("hbm", "HBM"), ("uni", "Unified (CPU+GPU)"), ("gpum", "GPU memory"),
                      ("cxl", "CXL"), ("nvm", "NVM"), ("unk", "other memory")):
        if cls in types:
            items.append((_rect(0, 0, 16, 12, cls, rx=2), word))
    if m.free_known:
        items.append((_rect(0, 3, 16, 6, "bar") + _rect(0, 3, 10, 6, "used"), "memory in use"))
    if any(not d.attached_cpus for d in m.domains):
        items.append((_rect(0, 0, 16, 12, "unk nc", rx=2), "no CPUs (dashed)"))
    if any(a.unified_memory and m.home.get(a.id, -1) >= 0 for a in m.accels):
        items.append((_rect(0, 0, 16, 12, "gm", rx=2), "GPU memory in a Unified domain"))
    if m.accels:
        for cls, word in (("hok", "healthy"), ("hwarn", "warning"), ("hbad", "unhealthy"),
                          ("hunk", "health unknown")):
            items.append((f'<circle cx="8" cy="6" r="5" class="{cls}"/>', word))
    kinds = sorted({lk.kind for lk in m.topo.accelerator_links} | {g.link_kind for g in m.topo.accelerator_groups}
                   - {""}, key=lambda k: (k in PCI_CLASSES, PCI_CLASSES.index(k) if k in PCI_CLASSES else 0, k))
    for k in (k for k in kinds if k in LINK_COLORS):
        items.append((_rect(0, 0, 16, 12, "sw", fill=LINK_COLORS[k]), f"{k} (PCIe path)" if k in PCI_CLASSES
                      else f"{k} link"))
    others = [k for k in kinds if k not in LINK_COLORS]
    if others:
        # Words this drawing has no colour for share one grey: one legend entry, however many there are.
        what = _fit(", ".join(others[:3]) + (f" … ({len(others)})" if len(others) > 3 else ""), 260, "s")
        items.append((_rect(0, 0, 16, 12, "sw", fill=OTHER_LINK), f"other links: {what}"))
    if any(i.link_type == pb.MEMORY_LINK_TYPE_CXL_SWITCH for i in m.topo.interconnects):
        items.append((_line(0, 6, 16, 6, "ecxl", 2), "through CXL"))
    blocks = []
    for sw, word in items:
        b = Block(22 + _text_w(word, "s"), 14)
        b.parts.append(sw)
        b.parts.append(_text(22, 10, word, "s"))
        blocks.append(b)
    return _section("Legend", _flow(blocks, width - 2 * PAD, 16))


def _header(m: _Model) -> Block:
    t = m.topo
    title = _fit(t.node_name or "node ?", MAX_W, "h")
    c = t.cpus
    summary = (f"{len(c.online)} CPUs online in {c.packages} package(s), {c.cores} core(s) · "
               f"{human_bytes(t.total_capacity_bytes)} in {len(m.domains)} memory domain(s), "
               f"{len(t.numa_nodes)} NUMA node(s) · {len(m.accels)} accelerator(s)"
               + ("" if m.memory_known else " (memory size not in the input)"))
    sub = _fit(f"generation {t.generation} · fingerprint {t.fingerprint[:16] or '?'} · source {t.source_root or '?'}",
               MAX_W, "s")
    b = Block(max(_text_w(title, "h"), _text_w(summary), _text_w(sub, "s")), 52)
    b.parts.append(_text(0, 16, title, "h"))
    b.parts.append(_text(0, 33, summary))
    b.parts.append(_text(0, 48, sub, "s"))
    return b


def _pack(blocks: Sequence[Block | Callable[[int], Block]], max_w: int, gap: int) -> Block:
    """Blocks in order, each at the highest place it fits (then the leftmost): beside the blocks
    above it where there is room, else under the column it fits, so a short panel next to a tall
    one leaves no hole under it. A callable is a block that takes the width it is given (the legend):
    it is tried at its own width and at each placed block's."""
    out = Block(0, 0)
    placed: list[tuple[int, int, int, int]] = []
    for item in blocks:
        widths = [max_w] if isinstance(item, Block) else sorted({LEGEND_W, *(pw for _, _, pw, _ in placed)})
        best: tuple[int, int, int, Block] | None = None
        for want in widths:
            b = item if isinstance(item, Block) else item(want)
            if not b.h:
                continue
            for x in sorted({0, *(px + pw + gap for px, _, pw, _ in placed)}):
                if x and x + b.w > max_w:
                    continue
                y = max((py + ph + gap for px, py, pw, ph in placed if px < x + b.w and x < px + pw), default=0)
                if best is None or (y, x, -b.w) < best[:3]:
                    best = (y, x, -b.w, b)
        if best is None:
            continue
        y, x, _, b = best
        out.put(b, x, y)
        placed.append((x, y, b.w, b.h))
        out.w, out.h = max(out.w, x + b.w), max(out.h, y + b.h)
    return out


def topology_svg(topo: pb.MemoryTopology) -> str:
    """The node drawn as a standalone SVG document (UTF-8 text, no external references). Its width
    and height are its size in CSS pixels (the viewBox's): shown at that size, its text is the size
    its stylesheet says."""
    m = _Model.of(topo)
    cpuless = [d for d in m.domains if not d.attached_cpus]
    parts: list[Block | Callable[[int], Block]] = [_packages(m)]
    if cpuless:
        parts.append(_section("Memory without CPUs", _flow((_domain_column(m, d) for d in cpuless), MAX_W - 2 * PAD),
                              "CXL, far and device memory: reached through another domain's CPUs"))
    homeless = [a for a in m.accels if a.id not in m.home]
    if homeless:
        parts.append(_section("Accelerators without NUMA affinity", _cards(m, homeless, MAX_W // 2)))
    parts += [_interconnect(m), _accel_links(m), _cxl(m), _loose_nodes(m), _sources(m)]
    parts.append(lambda width: _legend(m, width))
    width = min(MAX_W, max([PACK_MIN_W, *(b.w for b in parts if isinstance(b, Block))]))
    body = _stack([_header(m), _pack(parts, width, 14)], 14)
    w, h = body.w + 2 * 16, body.h + 2 * 16
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>\n',
        f'<svg xmlns="http://www.w3.org/2000/svg" class="{ROOT_CLASS}" width="{w}" height="{h}"'
        f' viewBox="0 0 {w} {h}">',
        f"<title>{_esc('memory topology of ' + (topo.node_name or 'node ?'))}</title>",
        f"<style>{STYLE}</style>",
        _rect(0, 0, w, h, "w"),
    ]
    wrapper = Block(w, h)
    wrapper.put(body, 16, 16)
    out += wrapper.parts
    out.append("</svg>\n")
    return "".join(out)
