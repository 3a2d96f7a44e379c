"""``memtopo topo``'s text view where it used to mislead: interconnects named by NUMA node, big
machines summarised and folded instead of cut off or 262 columns wide, unknown free memory said so,
accelerator ids in the order people count, absent sources on one line unless asked."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memtopo.cli.main import main
from memtopo.cli.render import MAX_WIDTH, render
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.text import natural_key
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_LINUX, HWLOC_XML, discovered, hwloc_root

FIXTURES = Path(__file__).parents[1] / "fixtures"


def synth(name: str) -> pb.MemoryTopology:
    return discovered(FIXTURES / name / "root.tar.gz")


def section(text: str, title: str) -> list[str]:
    """The lines of one section: from its title to the next blank line followed by a title."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start + 1, len(lines) - 1) if lines[i] == "" and lines[i + 1][:1].isupper()),
               len(lines))
    return lines[start:end]


def topo_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["topo", *args]) == 0
    return capsys.readouterr().out


def test_gh200_names_the_c2c_link_by_its_nodes_and_the_unified_domain_holds_both_memories() -> None:
    t = synth("gh200")
    assert t.domains[0].subtype == "DRAM+GPUMemory"  # not GPUMemory alone: Grace's DRAM is in it
    lines = section(render(t), "Interconnects")
    assert lines[1].split()[:4] == ["NODES", "DOMAINS", "LINK", "DIST"]
    assert lines[2].split()[:4] == ["0↔1", "0", "coherent-fabric", "GPU0"]
    assert not any(line.split()[:1] == ["0-0"] for line in lines)


def test_interconnect_pairs_use_the_slit_matrix_node_ids() -> None:
    """On fakeheteromemtiers domain 5 is node 8: the pair reads 0↔8, as the SLIT matrix labels it."""
    t = discover(ProbeContext.at_root(hwloc_root("fakeheteromemtiers")))
    assert list(t.domains[5].numa_nodes) == [8]
    rows = {line.split()[1]: line.split()[0] for line in section(render(t), "Interconnects")[2:]}
    assert rows["0-5"] == "0↔8"
    slit = section(render(t), "NUMA distances")
    assert "8" in slit[1].split()


def test_sixty_four_nodes_summarise_the_pairs_and_fold_the_slit_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    text = topo_text(capsys, "--root", str(HWLOC_LINUX / "256ia64-64n2s2c.tar.bz2"))
    links = section(text, "Interconnects")
    assert "more pairs" not in text
    assert links[1].split() == ["LINK", "DIST", "PAIRS", "MEASURED", "E.G."]
    assert sum(int(line.split()[2]) for line in links[2:] if line.strip()) == 64 * 63 // 2
    slit = section(text, "NUMA distances")
    assert max(map(len, slit)) <= MAX_WIDTH
    headers = [line.split()[1:] for line in slit if line.split()[:1] == ["node"]]
    assert len(headers) > 1 and [int(c) for h in headers for c in h] == list(range(64))
    # Every block still has a row per node, each with that node's own distance to itself.
    assert sum(1 for line in slit if line.split()[:1] == ["0"]) == len(headers)


def test_a_64_gpu_link_matrix_is_folded_and_ids_count_numerically(capsys: pytest.CaptureFixture[str]) -> None:
    text = topo_text(capsys, "--links", "--root", str(FIXTURES / "mi300x-8gpu-cpx-nps4/root.tar.gz"))
    blocks = [b.splitlines() for b in text.split("\nLegend:")[0].strip("\n").split("\n\n")]
    assert len(blocks) > 1
    columns = [c for b in blocks for c in b[0].split() if c.startswith("GPU")]
    assert columns == [f"GPU{i}" for i in range(64)]
    assert all(len(line) <= MAX_WIDTH for b in blocks[:-1] for line in b)
    assert all(len(b) == 1 + 64 for b in blocks)  # every block has a row per GPU
    # The affinity columns close the last block only.
    assert [("CPU Affinity" in b[0]) for b in blocks] == [False] * (len(blocks) - 1) + [True]


def test_group_members_sort_as_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    text = topo_text(capsys, "--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"))
    (fabric,) = [line for line in text.splitlines() if "nvswitch-fabric:" in line]
    assert fabric.split(":")[1].split("(")[0].split() == [f"GPU{i}" for i in range(16)]
    t = discover(ProbeContext.at_root("/", hwloc_xml=HWLOC_XML / "nvidiaDGX2.xml"))
    (group,) = [g for g in t.accelerator_groups if g.kind == "nvswitch-fabric"]
    assert list(group.members) == [f"GPU{i}" for i in range(16)]  # the JSON view too


def test_an_xml_input_says_free_memory_is_unknown_and_tiers_have_readable_headers(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = topo_text(capsys, "--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"))
    domains = section(text, "Memory domains")
    header = domains[1].split()
    assert "KERNEL-TIER" in header and "HWLOC-TIER" in header and "TIER(k/h)" not in text
    free = domains[1].index("FREE")
    assert [line[free:].split()[0] for line in domains[2:]] == ["unknown", "unknown"]
    captured = topo_text(capsys, "--root", str(HWLOC_LINUX / "fakeheteromemtiers.tar.bz2"))
    assert "unknown" not in section(captured, "Memory domains")[2]  # sysfs meminfo gives it here


def test_absent_sources_share_one_line_unless_asked(capsys: pytest.CaptureFixture[str]) -> None:
    root = str(FIXTURES / "gh200/root.tar.gz")
    short = section(topo_text(capsys, "--root", root), "Sources")
    full = section(topo_text(capsys, "--root", root, "--sources"), "Sources")
    absent = ["amd.kfd", "npu-smi", "sysfs.cxl", "sysfs.memory_tiers", "xpu-smi"]
    assert short[-1] == f"  unavailable: {', '.join(absent)} (topo --sources says why)"
    assert len(short) == 1 + 6 + 1  # title, the six that answered, one line for the rest
    assert all(any(line.split()[:2] == [name, "unavailable"] for line in full) for name in absent)
    assert "no CXL bus" in "\n".join(full) and "no CXL bus" not in "\n".join(short)


@given(prefix=st.sampled_from(["GPU", "NPU", "XPU", "davinci"]),
       numbers=st.lists(st.integers(0, 10**6), min_size=1, max_size=30, unique=True))
def test_natural_key_counts_like_people_do(prefix: str, numbers: list[int]) -> None:
    ids = [f"{prefix}{n}" for n in numbers]
    assert sorted(ids, key=natural_key) == [f"{prefix}{n}" for n in sorted(numbers)]


@given(st.text(max_size=20))
def test_natural_key_takes_any_text(ident: str) -> None:
    assert isinstance(natural_key(ident), tuple)


def test_accelerator_rows_and_groups_count_numerically_whatever_order_they_arrive_in() -> None:
    t = pb.MemoryTopology()
    for ident in ("GPU10", "GPU2", "GPU1"):
        t.accelerators.add(id=ident, vendor="NVIDIA", model="H100", numa_node=-1, domain=-1)
    t.accelerator_groups.add(kind="nvlink-island", members=["GPU10", "GPU2", "GPU1"])
    lines = section(render(t), "Accelerators")
    assert [line.split()[0] for line in lines[2:5]] == ["GPU1", "GPU2", "GPU10"]
    assert "  nvlink-island: GPU1 GPU2 GPU10" in lines
