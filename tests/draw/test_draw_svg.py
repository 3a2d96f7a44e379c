"""The node drawing (``memtopo topo --format svg``): well-formed for every captured and synthesized
machine, complete (every domain, accelerator and CXL region is named), deterministic, escaped, and
collapsed where a 64-node or 64-accelerator machine would otherwise drown it."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memtopo.cli.main import main
from memtopo.cpulist import parse_cpulist
from memtopo.draw.svg import compact_cpus, compact_ids, crosses, font_of, text_width, topology_svg
from memtopo.text import natural_key
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_LINUX, HWLOC_XML, LAB_CAPTURES, REPO, discovered

SVG = "{http://www.w3.org/2000/svg}"
SYNTH = Path(__file__).parents[1] / "fixtures"
SIXTY_FOUR = HWLOC_LINUX / "256ia64-64n2s2c.tar.bz2"

INPUTS = sorted(HWLOC_XML.glob("*.xml")) + sorted(HWLOC_LINUX.glob("*.tar.bz2")) \
    + sorted(LAB_CAPTURES.glob("*.tar.gz")) + sorted(SYNTH.glob("*/root.tar.gz"))


def _id(p: Path) -> str:
    return p.parent.name if p.name == "root.tar.gz" else p.name


def texts(root: ET.Element) -> list[str]:
    return [e.text or "" for e in root.iter(f"{SVG}text")]


def test_every_shared_capture_and_synthesized_host_is_an_input() -> None:
    names = {_id(p) for p in INPUTS}
    # The issue names these; a renamed or vanished fixture must not shrink the coverage silently.
    assert {"nvidiaDGX2.xml", "256ia64-64n2s2c.tar.bz2", "dual-socket-cxl-tiered.tar.gz", "gh200",
            "ascend-a3-16npu", "mi300x-8gpu-cpx-nps4"} <= names
    assert len(INPUTS) >= 35


@pytest.mark.parametrize("path", INPUTS, ids=_id)
def test_drawing_is_well_formed_and_names_every_domain_accelerator_and_cxl_region(path: Path) -> None:
    t = discovered(path)
    svg = topology_svg(t)
    root = ET.fromstring(svg.encode())
    assert root.tag == f"{SVG}svg" and root.get("class") == "memtopo-drawing"
    # Styles are scoped to the drawing: inlined into a page they touch nothing else.
    (style,) = root.iter(f"{SVG}style")
    assert all(rule.startswith(".memtopo-drawing ") for rule in (style.text or "").split("}") if rule)
    assert int(root.get("width", "0")) > 0 and int(root.get("height", "0")) > 0
    words = texts(root)
    shown = set(words)
    for d in t.domains:
        assert f"domain {d.id}" in shown, f"domain {d.id} missing"
    for a in t.accelerators:
        assert a.id in shown, f"{a.id} missing"
    for r in t.cxl_regions:
        assert any(w.startswith(f"{r.name}: ") for w in words), f"{r.name} missing"
    # Self-contained: nothing to fetch when it is opened offline.
    assert "href" not in svg and "url(" not in svg and "@import" not in svg and "<script" not in svg


def test_cxl_lab_capture_draws_its_region_and_the_cpu_less_cxl_domain_apart() -> None:
    t = discovered(LAB_CAPTURES / "dual-socket-cxl-tiered.tar.gz")
    (region,) = t.cxl_regions
    root = ET.fromstring(topology_svg(t))
    (cxl,) = [d for d in t.domains if d.type == pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED]
    # The CPU-less domains sit in their own dashed-border section, not inside a package.
    sections = [g for g in root.iter(f"{SVG}g") if "Memory without CPUs" in texts(g)]
    assert sections
    inner = texts(sections[-1])
    assert f"domain {cxl.id}" in inner and all(f"domain {d.id}" not in inner for d in t.domains if d.attached_cpus)
    boxes = [r.get("class", "") for r in sections[-1].iter(f"{SVG}rect")]
    assert "cxl nc" in boxes
    (memdev,) = t.cxl_devices
    assert f"CXL {region.name} ({region.mode}, {region.interleave_ways} way) via node {memdev.numa_node}" in inner


def test_unified_superchip_domain_holds_its_gpu_inside_one_box() -> None:
    t = discovered(SYNTH / "gh200" / "root.tar.gz")
    root = ET.fromstring(topology_svg(t))
    # The innermost group naming the domain also holds the GPU card and its C2C figure.
    holders = [g for g in root.iter(f"{SVG}g") if "domain 0" in texts(g)]
    innermost = holders[-1]
    words = texts(innermost)
    assert "GPU0" in words
    assert any(w.startswith("GPU memory (node 1) ⇄ CPU 450 GB/s") for w in words)
    # The driver's empty MIG placeholder nodes are named, outside every domain.
    assert "nodes 2-8: MIG placeholder of GPU0" in texts(root)
    assert innermost.find(f"{SVG}rect").get("class") == "uni"  # type: ignore[union-attr]


def test_accelerators_sit_under_the_domain_they_are_local_to() -> None:
    t = discovered(SYNTH / "ascend-a3-16npu" / "root.tar.gz")
    root = ET.fromstring(topology_svg(t))
    for a in t.accelerators:
        # The innermost group holding both the card and a domain box is that domain's column.
        column = [g for g in root.iter(f"{SVG}g") if a.id in texts(g)
                  and any(w.startswith("domain ") for w in texts(g))][-1]
        assert [w for w in texts(column) if w.startswith("domain ")] == [f"domain {a.domain}"], a.id


def test_sixty_four_nodes_are_collapsed_to_a_matrix_and_stay_small() -> None:
    t = discovered(SIXTY_FOUR)
    assert len(t.domains) == 64 and len(t.interconnects) == 2016
    svg = topology_svg(t)
    assert len(svg.encode()) < 2 * 1024 * 1024
    root = ET.fromstring(svg)
    # No edge per pair: the SLIT matrix and its key stand for the 2016 pairs.
    assert len(list(root.iter(f"{SVG}line"))) < 64
    words = texts(root)
    assert {"SLIT 10: self", "SLIT 22: 96 pairs", "SLIT 26: 256 pairs", "SLIT 30: 896 pairs",
            "SLIT 34: 768 pairs"} <= set(words)


def test_sixty_four_accelerators_one_hive_reads_as_one_group() -> None:
    t = discovered(SYNTH / "mi300x-8gpu-cpx-nps4" / "root.tar.gz")
    assert len(t.accelerators) == 64
    words = texts(ET.fromstring(topology_svg(t)))
    assert any(w.startswith("xgmi-hive: GPU0-63 (64") for w in words)


def test_small_interconnect_is_a_graph_with_slit_and_hmat_labels() -> None:
    t = discovered(LAB_CAPTURES / "dual-socket-cxl-tiered.tar.gz")
    root = ET.fromstring(topology_svg(t))
    panel = [g for g in root.iter(f"{SVG}g") if "Interconnect between domains" in texts(g)][-1]
    words = texts(panel)
    # Pairs become edges labelled with SLIT; the HMAT-measured one carries its bandwidth and latency.
    assert len(list(panel.iter(f"{SVG}line"))) == len(t.interconnects)
    assert "24 · 10.2 GB/s, 250 ns" in words and "21" in words
    dashed = [ln for ln in panel.iter(f"{SVG}line") if ln.get("class") == "ecxl"]
    assert len(dashed) == sum(1 for i in t.interconnects if i.link_type == pb.MEMORY_LINK_TYPE_CXL_SWITCH) > 0


@pytest.mark.parametrize("name", ["dual-socket-cxl-tiered.tar.gz", "nvidiaDGX2.xml", "ascend-a3-16npu",
                                  "256ia64-64n2s2c.tar.bz2"])
def test_same_topology_same_bytes_whatever_the_order_of_the_lists(name: str) -> None:
    path = next(p for p in INPUTS if _id(p) == name)
    first = topology_svg(discovered(path))
    # A second discovery of the same capture: nothing volatile (time, durations) reaches the picture.
    again = discovered(path)
    assert topology_svg(again) == first
    shuffled = discovered(path)
    rng = random.Random(7)
    before = [d.id for d in shuffled.domains]
    for name in ("domains", "numa_nodes", "interconnects", "accelerator_links", "accelerator_groups", "sources",
                 "cxl_devices"):
        field: Any = getattr(shuffled, name)
        items = [type(x)() for x in field]
        for c, x in zip(items, field, strict=True):
            c.CopyFrom(x)
        rng.shuffle(items)
        del field[:]
        field.extend(items)
    # Each domain's SLIT row follows the domain order of the message: it moves with the domains.
    after = [d.id for d in shuffled.domains]
    for d in shuffled.domains:
        if d.distances:
            row = dict(zip(before, d.distances, strict=True))
            d.distances[:] = [row[i] for i in after]
    for g in shuffled.accelerator_groups:
        members = list(g.members)
        rng.shuffle(members)
        g.members[:] = members
    assert topology_svg(shuffled) == first


HOSTILE = "<script>alert('x')</script> & \"q\" ]]> \x01\x1b[31m"


def test_hostile_names_are_text_not_markup() -> None:
    t = discovered(SYNTH / "gh200" / "root.tar.gz")
    t.node_name = HOSTILE
    t.accelerators[0].model = HOSTILE
    t.accelerators[0].health = HOSTILE
    t.domains[0].note = HOSTILE
    t.sources.add(source=HOSTILE, state=pb.SOURCE_STATE_DEGRADED, reasons=[HOSTILE])
    svg = topology_svg(t)
    assert "<script" not in svg and "\x01" not in svg and "\x1b" not in svg
    root = ET.fromstring(svg)
    # Control characters become U+FFFD; everything else reads back as the same text.
    readable = HOSTILE.replace("\x01", "\ufffd").replace("\x1b", "\ufffd")
    assert root.find(f"{SVG}title").text == f"memory topology of {readable}"  # type: ignore[union-attr]
    words = texts(root)
    assert readable in words
    assert [e.tag for e in root.iter() if e.tag.endswith("script")] == []
    tooltips = [e.text or "" for e in root.iter(f"{SVG}title")]
    assert any(readable in tip for tip in tooltips)
    # A name far longer than the page is cut in the drawing (the document title keeps it whole).
    t.node_name = "n" * 100_000
    root = ET.fromstring(topology_svg(t))
    assert int(root.get("width", "0")) < 2000 and max(len(w) for w in texts(root)) < 400


def test_cli_writes_the_svg(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["topo", "--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"), "--format", "svg"]) == 0
    out = capsys.readouterr().out
    root = ET.fromstring(out)
    words = texts(root)
    assert "nvswitch-fabric: GPU0-15 (16, every pair NV6 150 GB/s)" in words
    assert {f"GPU{i}" for i in range(16)} <= set(words)


def test_natural_order_and_compact_id_ranges() -> None:
    assert sorted(["GPU10", "GPU2", "GPU1", "NPU0"], key=natural_key) == ["GPU1", "GPU2", "GPU10", "NPU0"]
    assert compact_ids(["NPU0", "NPU1", "NPU2", "NPU5", "GPU3", "odd"]) == "GPU3 NPU0-2,5 odd"
    assert compact_cpus([0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44], room=12) == "0,4,…,44"
    assert compact_cpus([0, 1, 2, 3]) == "0-3"
    assert compact_cpus([]) == "none"


@given(st.lists(st.integers(min_value=0, max_value=4096), max_size=200), st.integers(min_value=4, max_value=60))
@example(ids=[3597, 3596], room=4)  # one range longer than the room: whole, no "…" claiming more
def test_compact_cpus_is_the_list_or_an_honest_shortening_of_it(ids: list[int], room: int) -> None:
    text = compact_cpus(ids, room)
    want = sorted(set(ids))
    if not want:
        assert text == "none"
    elif "…" not in text:
        assert list(parse_cpulist(text)) == want
    elif text.count(",") == 3 and text.split(",")[2] == "…":
        first, second, _, last = text.split(",")
        step = int(second) - int(first)
        assert list(range(int(first), int(last) + 1, step)) == want
    else:
        kept = parse_cpulist(text.removesuffix(",…"))
        # A prefix of the list, cut between elements, within the room unless one element is longer.
        assert list(kept) == want[:len(kept)] and len(kept) < len(want)
        assert len(text) <= room + 2 or "," not in text.removesuffix(",…")


def big_topology(domains: int, accelerators: int) -> pb.MemoryTopology:
    """A made-up node far past any real one (what a hostile or broken agent could send a controller)."""
    t = pb.MemoryTopology(node_name="big")
    for i in range(domains):
        t.numa_nodes.add(id=i, cpus=[2 * i, 2 * i + 1], packages=[i], domain=i, has_cpu=True, has_memory=True)
        t.domains.add(id=i, type=pb.MEMORY_DOMAIN_TYPE_DRAM, numa_nodes=[i], attached_cpus=[2 * i, 2 * i + 1],
                      capacity_bytes=1 << 34, free_bytes=1 << 33, kernel_tier=-1, hwloc_tier=-1, cxl_region=-1)
        for j in range(i + 1, domains):
            t.interconnects.add(domain_a=i, domain_b=j, link_type=pb.MEMORY_LINK_TYPE_NUMA_LINK,
                                distance_a_to_b=20 + (j - i) % 3, distance_b_to_a=20 + (j - i) % 3)
    for k in range(accelerators):
        t.accelerators.add(id=f"GPU{k}", index=k, vendor="V", model="M", numa_node=k % domains if domains else -1,
                           domain=-1, memory_bytes=1 << 30)
    t.accelerator_groups.add(kind="nvswitch-fabric", members=[f"GPU{k}" for k in range(accelerators)],
                             link_kind="NV", link_count=18)
    return t


def test_a_node_past_the_matrix_limits_is_summarised_not_squared() -> None:
    t = big_topology(300, 200)
    svg = topology_svg(t)
    assert len(svg.encode()) < 2 * 1024 * 1024
    root = ET.fromstring(svg)
    words = set(texts(root))
    assert {f"domain {i}" for i in range(300)} <= words and {f"GPU{k}" for k in range(200)} <= words
    assert "300 domains: no matrix above 128 (--format json has every distance)" in words
    assert "200 accelerators: no matrix above 128" in words
    assert "nvswitch-fabric: GPU0-199 (200, every pair NV18)" in words
    # Pair counts from the 44,850 interconnects, not a drawn pair each.
    assert sum(int(w.split(": ")[1].split()[0]) for w in words if w.startswith("SLIT ") and w.endswith(" pairs")) \
        == 300 * 299 // 2
    # A thousand accelerators in one domain, or with no affinity, wrap into rows instead of widening the page.
    for crowd in (big_topology(1, 1000), big_topology(0, 1000)):
        root = ET.fromstring(topology_svg(crowd))
        assert int(root.get("width", "0")) <= 1400 + 2 * 16
        assert {f"GPU{k}" for k in range(1000)} <= set(texts(root))


def test_empty_and_affinity_less_topologies_still_draw() -> None:
    assert ET.fromstring(topology_svg(pb.MemoryTopology())).tag == f"{SVG}svg"
    t = big_topology(0, 3)
    words = texts(ET.fromstring(topology_svg(t)))
    assert "Accelerators without NUMA affinity" in words and {"GPU0", "GPU1", "GPU2"} <= set(words)


def test_a_pair_with_several_links_shows_the_same_one_whatever_their_order() -> None:
    t = big_topology(2, 2)
    del t.accelerator_groups[:]
    links = [pb.AcceleratorLink(a="GPU0", b="GPU1", kind=kind, count=count)
             for kind, count in (("PIX", 0), ("NV", 2), ("NV", 4))]
    drawings = set()
    for order in (links, links[::-1], links[1:] + links[:1]):
        del t.accelerator_links[:]
        t.accelerator_links.extend(order)
        drawings.add(topology_svg(t))
    (svg,) = drawings
    # The cell shows the strongest link: NV4 over NV2 over the PCIe path class.
    assert "NV4" in texts(ET.fromstring(svg))


_ANY_TEXT = st.text(max_size=40)  # control characters, markup, surrogates' neighbours: whatever a peer sends
_U64 = st.integers(min_value=0, max_value=2**64 - 1)


@st.composite
def messages(draw: st.DrawFn) -> pb.MemoryTopology:
    """Arbitrary, often inconsistent messages: the drawing must not trust any cross-reference."""
    t = pb.MemoryTopology(node_name=draw(_ANY_TEXT))
    ids = draw(st.lists(st.integers(0, 300), unique=True, max_size=20))
    for i in ids:
        t.domains.add(id=i, type=draw(st.integers(0, 6)), capacity_bytes=draw(_U64), free_bytes=draw(_U64),
                      numa_nodes=draw(st.lists(st.integers(0, 300), max_size=3)),
                      attached_cpus=draw(st.lists(st.integers(0, 1000), max_size=8)),
                      local_cpus=draw(st.lists(st.integers(0, 1000), max_size=4)),
                      kernel_tier=draw(st.integers(-1, 30)), hwloc_tier=draw(st.integers(-1, 3)),
                      cxl_region=draw(st.integers(-1, 3)), subtype=draw(_ANY_TEXT), note=draw(_ANY_TEXT),
                      distances=draw(st.lists(st.integers(0, 255), max_size=len(ids) + 1)))
    sources = st.sampled_from(list(pb.PerformanceSource.values()))
    for _ in range(draw(st.integers(0, 30))):
        perf = pb.LinkPerformance(source=draw(sources), read_bandwidth_mbps=draw(_U64), read_latency_ns=draw(_U64))
        t.interconnects.add(domain_a=draw(st.integers(0, 300)), domain_b=draw(st.integers(0, 300)),
                            link_type=draw(st.integers(0, 3)), distance_a_to_b=draw(st.integers(0, 255)),
                            distance_b_to_a=draw(st.integers(0, 255)), a_to_b=perf)
    for n in draw(st.lists(st.integers(0, 300), unique=True, max_size=10)):
        t.numa_nodes.add(id=n, domain=draw(st.integers(-1, 300)),
                         packages=draw(st.lists(st.integers(0, 9), max_size=2)),
                         cpus=draw(st.lists(st.integers(0, 1000), max_size=4)), note=draw(_ANY_TEXT),
                         memory_bytes=draw(_U64), state=draw(st.integers(0, 2)))
    accel_ids = draw(st.lists(st.text(min_size=1, max_size=10), unique=True, max_size=12))
    for k, a in enumerate(accel_ids):
        t.accelerators.add(id=a, index=k, model=draw(_ANY_TEXT), vendor=draw(_ANY_TEXT), health=draw(_ANY_TEXT),
                           memory_bytes=draw(_U64), numa_node=draw(st.integers(-1, 300)),
                           domain=draw(st.integers(-1, 300)), unified_memory=draw(st.booleans()),
                           memory_numa_nodes=draw(st.lists(st.integers(0, 300), max_size=2)))
    some_id = st.sampled_from(accel_ids) if accel_ids else st.just("GPU0")
    for _ in range(draw(st.integers(0, 10))):
        t.accelerator_links.add(a=draw(some_id), b=draw(some_id | _ANY_TEXT), kind=draw(_ANY_TEXT),
                                count=draw(st.integers(0, 2**32 - 1)))
    for _ in range(draw(st.integers(0, 3))):
        t.accelerator_groups.add(kind=draw(_ANY_TEXT), members=draw(st.lists(some_id | _ANY_TEXT, max_size=6)),
                                 link_kind=draw(st.sampled_from(["", "NV", "HCCS"]) | _ANY_TEXT))
    for _ in range(draw(st.integers(0, 3))):
        t.cxl_regions.add(name=draw(_ANY_TEXT), numa_node=draw(st.integers(-1, 300)), size_bytes=draw(_U64),
                          memdevs=draw(st.lists(_ANY_TEXT, max_size=2)))
    return t


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_any_message_draws_well_formed_and_complete(t: pb.MemoryTopology) -> None:
    svg = topology_svg(t)
    root = ET.fromstring(svg)
    # However long the names, the page keeps its width (1,400 px of layout and its margins).
    assert int(root.get("width", "0")) <= 1400 + 2 * 16
    words = set(texts(root))
    assert {f"domain {d.id}" for d in t.domains} <= words
    cleaned = {a.id: "".join("\ufffd" if (ord(c) < 0x20 and c not in "\t\n\r") or 0xD800 <= ord(c) <= 0xDFFF
                             or c in "\ufffe\uffff" else c for c in a.id) for a in t.accelerators}
    # An id reads back as itself (XML-forbidden characters as U+FFFD); ET folds a lone \r like XML does.
    assert all(c.replace("\r", "\n") in {w.replace("\r", "\n") for w in words} or c.strip() != c
               for c in cleaned.values())


# ---- geometry: what a person sees -------------------------------------------------------------------
# Measured with the drawing's own metrics (draw/metrics.py: DejaVu Sans, the first font its stylesheet
# names; tools/font_metrics.py reads them from the font). A text's ink: from about three quarters of
# its size above the baseline to a fifth below.
ASCENT, DESCENT = 0.75, 0.2
Box = tuple[float, float, float, float]  # x0, y0, x1, y1


class Drawn:
    """The drawing's elements at their absolute places: texts with their boxes, rects, edge lines and
    edge labels (by data-pair), and each section's frame, title lines and body."""

    def __init__(self, svg: str) -> None:
        self.root = ET.fromstring(svg)
        self.texts: list[tuple[str, str, Box]] = []  # text, class, box
        self.rects: list[tuple[str, Box]] = []
        self.lines: list[tuple[str, tuple[float, float, float, float]]] = []  # pair, segment
        self.labels: list[tuple[str, Box]] = []  # pair, label frame
        self.sections: list[tuple[Box, list[Box], list[Box]]] = []  # frame, its own texts, its body's boxes
        self._walk(self.root, 0.0, 0.0)

    def _walk(self, el: ET.Element, dx: float, dy: float) -> list[Box]:
        found: list[Box] = []
        for child in el:
            tag = child.tag.removeprefix(SVG)
            if tag == "g":
                m = re.fullmatch(r"translate\(([-\d.]+),([-\d.]+)\)", child.get("transform", "translate(0,0)"))
                assert m, child.get("transform")
                ox, oy = dx + float(m.group(1)), dy + float(m.group(2))
                inner = self._walk(child, ox, oy)
                found += inner
                first = next(iter(child), None)
                if first is not None and first.tag == f"{SVG}rect" and first.get("class") == "sec":
                    own = [self._text_box(t, ox, oy) for t in child if t.tag == f"{SVG}text" and t.text]
                    self.sections.append((inner[0], own, [b for b in inner[1:] if b not in own]))
                if child.get("data-pair"):
                    (rect,) = [r for r in child if r.tag == f"{SVG}rect"]
                    self.labels.append((child.get("data-pair", ""), self._rect_box(rect, dx, dy)))
            elif tag == "text":
                if child.get("transform"):
                    continue  # a matrix's rotated column label
                box = self._text_box(child, dx, dy)
                self.texts.append((child.text or "", child.get("class", ""), box))
                found.append(box)
            elif tag == "rect":
                box = self._rect_box(child, dx, dy)
                self.rects.append((child.get("class", ""), box))
                found.append(box)
            elif tag == "line":
                seg = tuple(float(child.get(k, "0")) + (dx if k[0] == "x" else dy) for k in ("x1", "y1", "x2", "y2"))
                self.lines.append((child.get("data-pair", ""), seg))  # type: ignore[arg-type]
        return found

    @staticmethod
    def _rect_box(el: ET.Element, dx: float, dy: float) -> Box:
        x, y = float(el.get("x", "0")) + dx, float(el.get("y", "0")) + dy
        return (x, y, x + float(el.get("width", "0")), y + float(el.get("height", "0")))

    @staticmethod
    def _text_box(el: ET.Element, dx: float, dy: float) -> Box:
        cls = el.get("class", "")
        size, _ = font_of(cls)
        w = text_width(el.text or "", cls)
        x, y = float(el.get("x", "0")) + dx, float(el.get("y", "0")) + dy
        x0 = {"middle": x - w / 2, "end": x - w}.get(el.get("text-anchor", ""), x)
        return (x0, y - ASCENT * size, x0 + w, y + DESCENT * size)


def _inside(inner: Box, outer: Box, slack: float = 0.5) -> bool:
    return (outer[0] - slack <= inner[0] and inner[2] <= outer[2] + slack and outer[1] - slack <= inner[1]
            and inner[3] <= outer[3] + slack)


def _meet(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _area(b: Box) -> float:
    return (b[2] - b[0]) * (b[3] - b[1])


DRAWN = ["nvidiaDGX2.xml", "dual-socket-cxl-tiered.tar.gz", "dual-socket-cxl.tar.gz", "gh200", "gh200-quad",
         "gb200-tray", "mi300a-4apu", "mi300x-8gpu-cpx-nps4", "ascend-a3-16npu", "ascend-a2-8x910b",
         "kunlunxin-p800-8xpu", "256ia64-64n2s2c.tar.bz2", "16amd64-4distances.xml", "single.tar.gz"]


def drawn(name: str) -> Drawn:
    return Drawn(topology_svg(discovered(next(p for p in INPUTS if _id(p) == name))))


@pytest.mark.parametrize("name", DRAWN)
def test_every_text_stays_inside_its_box(name: str) -> None:
    """Each text lies within the innermost rectangle its anchor is in (a domain box, a card, a label,
    a section): nothing runs past the edge of what holds it."""
    d = drawn(name)
    out = []
    for text, cls, box in d.texts:
        if cls == "m":
            continue  # a matrix word sits on coloured cells that are one rect per run
        anchor = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
        holders = [r for c, r in d.rects if c not in ("bar", "used", "sw")
                   and r[0] <= anchor[0] <= r[2] and r[1] <= anchor[1] <= r[3]]
        holder = min(holders, key=_area)
        if not _inside(box, holder):
            out.append(f"{text!r} {tuple(round(v) for v in box)} outside {tuple(round(v) for v in holder)}")
    assert out == []


@pytest.mark.parametrize("name", DRAWN)
def test_no_two_texts_overlap(name: str) -> None:
    d = drawn(name)
    boxes = sorted(((box, text) for text, _, box in d.texts), key=lambda b: b[0][0])
    clashes = []
    for k, (a, ta) in enumerate(boxes):
        for b, tb in boxes[k + 1:]:
            if b[0] >= a[2]:
                break
            if _meet(a, b):
                clashes.append(f"{ta!r} / {tb!r}")
    assert clashes == []


@pytest.mark.parametrize("name", ["dual-socket-cxl-tiered.tar.gz", "dual-socket-cxl.tar.gz", "gh200-quad",
                                  "mi300x-8gpu-cpx-nps4", "ascend-a3-16npu", "mi300a-4apu"])
def test_each_edge_label_sits_on_its_own_edge_alone(name: str) -> None:
    """Where two edges of the ring cross, each label stays on its own edge: it covers no other edge,
    no other label and no domain box, so the two can be told apart."""
    d = drawn(name)
    assert d.labels
    boxes = [r for c, r in d.rects if c.split()[:1] in (["dram"], ["hbm"], ["cxl"], ["uni"], ["nvm"], ["gpum"],
                                                       ["unk"]) and r[3] - r[1] == 22]
    for pair, label in d.labels:
        own = [seg for p, seg in d.lines if p == pair]
        assert len(own) == 1 and crosses(own[0], _box_rect(label))
        crossed = [p for p, seg in d.lines if p != pair and p and crosses(seg, _box_rect(label))]
        assert crossed == [], f"label of {pair} lies across {crossed}"
        assert not [p for p, other in d.labels if p != pair and _meet(label, other)]
        assert not [b for b in boxes if _meet(label, b)]


def _box_rect(b: Box) -> tuple[float, float, float, float]:
    return (b[0], b[1], b[2] - b[0], b[3] - b[1])


@pytest.mark.parametrize("name", DRAWN)
def test_no_section_is_wider_than_what_it_holds(name: str) -> None:
    """A section's frame fits its body and title: a long note is wrapped under the title instead of
    widening the frame beside a small graph."""
    d = drawn(name)
    assert d.sections
    for frame, own, body in d.sections:
        title = own[0]
        content = max([title[2], *(b[2] for b in body)])
        assert frame[2] - content <= 24, (name, [t for t, _, b in d.texts if b == title])


@pytest.mark.parametrize("name", DRAWN)
def test_no_hole_under_a_panel(name: str) -> None:
    """Under each panel the next one follows at the layout's gap, or nothing does: no short panel
    beside a tall one leaves an empty band above the panels that follow."""
    d = drawn(name)
    frames = [r for c, r in d.rects if c in ("sec", "pk")]
    top_level = [f for f in frames if not any(o != f and _inside(f, o) for o in frames)]
    panels = [f for c, f in d.rects if c == "sec" and f in top_level]
    holes = []
    for f in panels:
        below = [o[1] - f[3] for o in top_level if o[1] >= f[3] and o[0] < f[2] and f[0] < o[2]]
        if below and min(below) > 2 * 14:
            holes.append(f"{tuple(round(v) for v in f)}: {min(below):.0f} px")
    assert holes == []


def test_gh200_domain_header_names_its_type_whole() -> None:
    d = drawn("gh200")
    words = [t for t, _, _ in d.texts]
    assert "domain 0" in words and "Unified · DRAM+GPUMemory" in words
    assert not any(w.startswith("domain 0") and w != "domain 0" for w in words)


def test_dgx2_cards_show_the_whole_model_and_the_pci_address_where_the_export_has_no_memory() -> None:
    """The DGX-2 export gives each GPU's model (GPUModel) but no memory size (no CUDA device in it):
    each card shows the model whole and the GPU's PCI address, and the header says memory is not in
    the input instead of a "memory ?" on every card."""
    t = discovered(HWLOC_XML / "nvidiaDGX2.xml")
    assert all(a.model == "Tesla V100-SXM3-32GB-H" and not a.memory_bytes for a in t.accelerators)
    words = texts(ET.fromstring(topology_svg(t)))
    assert words.count("Tesla V100-SXM3-32GB-H") == 16
    assert not [w for w in words if "memory ?" in w or (w.startswith("Tesla") and w.endswith("…"))]
    assert {a.bdf for a in t.accelerators} <= set(words)
    assert any("(memory size not in the input)" in w for w in words)


@pytest.mark.parametrize("name", DRAWN)
def test_the_drawing_has_its_own_size_in_css_pixels(name: str) -> None:
    """width and height are the viewBox's, unitless (CSS pixels): a page that shows the image at its
    own size shows its text at the sizes the stylesheet sets, 1:1."""
    root = drawn(name).root
    w, h = root.get("width", ""), root.get("height", "")
    assert w.isdigit() and h.isdigit() and root.get("viewBox") == f"0 0 {w} {h}"


def test_the_metrics_are_the_fonts_own() -> None:
    """draw/metrics.py is what tools/font_metrics.py reads from DejaVu Sans (Debian's fonts-dejavu-core,
    which tools/setup.sh installs with Chromium), and it covers every character the drawing writes
    itself (the rest count a full em)."""
    fonts = Path("/usr/share/fonts/truetype/dejavu")
    if not (fonts / "DejaVuSans.ttf").exists():
        pytest.skip("DejaVu Sans is not installed here (fonts-dejavu-core)")
    made = subprocess.run([sys.executable, "tools/font_metrics.py", str(fonts)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True)
    assert made.stdout == (REPO / "draw" / "metrics.py").read_text()
    from memtopo.draw.metrics import BOLD, REGULAR

    assert set("…·→⇄×–0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") <= set(REGULAR) & set(BOLD)
    # Bold is wider, and a digit is as wide as the font says (0.636 em), not an average guess.
    assert text_width("domain 0", "b") > text_width("domain 0") and round(text_width("0", "s"), 2) == 6.36
