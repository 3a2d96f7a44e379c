"""Whole-topology expectations for each synthesized host (tests/fixtures/*, built from documented
formats: see each README). Per-probe facts are in the probe tests; here: domains, Unified merges,
coherent-fabric links, accelerators attached to domains, groups, and the PCI fallback when a
vendor source fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.runner import RecordedRunner, ToolResult
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import discovered, extracted

FIXTURES = Path(__file__).parents[1] / "fixtures"
UNIFIED = pb.MEMORY_DOMAIN_TYPE_UNIFIED
FABRIC = pb.MEMORY_LINK_TYPE_COHERENT_FABRIC


def root(name: str) -> Path:
    return extracted(FIXTURES / name / "root.tar.gz")


def topo(name: str, **kw: object) -> pb.MemoryTopology:
    if not kw:
        return discovered(FIXTURES / name / "root.tar.gz")
    return discover(ProbeContext.at_root(root(name), **kw))


def source_state(t: pb.MemoryTopology, source: str) -> int:
    return next(s.state for s in t.sources if s.source == source)


def fabric_links(t: pb.MemoryTopology) -> Iterator[pb.MemoryInterconnect]:
    return (i for i in t.interconnects if i.link_type == FABRIC)


def test_gh200_grace_and_gpu_memory_are_one_unified_domain() -> None:
    t = topo("gh200")
    (d,) = t.domains
    assert d.type == UNIFIED and list(d.numa_nodes) == [0, 1]
    assert list(d.attached_cpus) == list(range(72))
    assert d.capacity_bytes == sum(n.memory_bytes for n in t.numa_nodes if n.id in (0, 1))
    (gpu,) = t.accelerators
    assert gpu.unified_memory and gpu.domain == 0 and list(gpu.memory_numa_nodes) == [1]
    assert list(d.attached_accelerators) == [0]
    (link,) = fabric_links(t)
    assert (link.domain_a, link.domain_b, link.numa_node_a, link.numa_node_b) == (0, 0, 0, 1)
    assert link.a_to_b.read_bandwidth_mbps == 450000  # 10 active C2C links × 45000 MB/s from NVML
    assert link.a_to_b.source == pb.PERFORMANCE_SOURCE_VENDOR_API
    # The 7 MIG placeholder nodes are reported, empty, in no domain.
    notes = {n.id: n.note for n in t.numa_nodes}
    assert [i for i, note in notes.items() if note.startswith("MIG placeholder of GPU0")] == list(range(2, 9))
    assert all(n.domain == -1 and n.memory_bytes == 0 for n in t.numa_nodes if n.id >= 2)
    assert t.total_capacity_bytes == d.capacity_bytes


def test_quad_gh200_four_unified_domains_and_nvlink_between_gpus() -> None:
    t = topo("gh200-quad")
    assert len(t.numa_nodes) == 36
    assert [(d.type, list(d.numa_nodes)) for d in t.domains] == [
        (UNIFIED, [g, 4 + 8 * g]) for g in range(4)]
    assert sorted(a.domain for a in t.accelerators) == [0, 1, 2, 3]
    assert len(list(fabric_links(t))) == 4
    assert {(lk.kind, lk.count) for lk in t.accelerator_links} == {("NV", 6)}
    assert len(t.accelerator_links) == 6
    # Grace-to-Grace pairs are ordinary NUMA links between the Unified domains.
    assert sum(1 for i in t.interconnects if i.link_type == pb.MEMORY_LINK_TYPE_NUMA_LINK) == 6


def test_gb200_tray_two_gpus_per_grace_share_one_unified_domain() -> None:
    t = topo("gb200-tray")
    unified = [d for d in t.domains if d.type == UNIFIED]
    assert len(unified) == 2
    for d in unified:
        gpus = [t.accelerators[i] for i in d.attached_accelerators]
        assert len(gpus) == 2 and all(g.unified_memory for g in gpus)
        # The Grace node and both GPUs' memory nodes.
        memory_nodes = {n for g in gpus for n in g.memory_numa_nodes}
        assert sorted(d.numa_nodes) == sorted({g.numa_node for g in gpus} | memory_nodes)
    assert {(lk.kind, lk.count) for lk in t.accelerator_links} == {("NV", 18)}


def test_mi300a_each_apu_is_a_unified_domain_with_its_xgmi_cpu_link() -> None:
    t = topo("mi300a-4apu")
    assert [(d.type, list(d.numa_nodes)) for d in t.domains] == [(UNIFIED, [n]) for n in range(4)]
    assert [(a.model, a.numa_node, a.domain, a.unified_memory) for a in t.accelerators] == [
        ("MI300A", n, n, True) for n in range(4)]
    assert [link.a_to_b.read_bandwidth_mbps for link in fabric_links(t)] == [819200] * 4
    assert [(g.kind, list(g.members)) for g in t.accelerator_groups] == [
        ("xgmi-hive", ["GPU0", "GPU1", "GPU2", "GPU3"])]


def test_mi300x_cpx_nps4_stays_discrete_dram_domains() -> None:
    t = topo("mi300x-8gpu-cpx-nps4")
    assert len(t.domains) == 8 and all(d.type == pb.MEMORY_DOMAIN_TYPE_DRAM for d in t.domains)
    assert len(t.accelerators) == 64  # 8 GPUs × 8 CPX partitions
    assert not any(a.unified_memory for a in t.accelerators)
    assert sorted({a.bdf for a in t.accelerators}) == sorted(
        p.bdf for p in t.pci_devices if p.kind == pb.PCI_DEVICE_KIND_GPU)
    for d in t.domains:
        assert len(d.attached_accelerators) == 8
    assert not list(fabric_links(t))


def test_ascend_a2_npus_attach_to_the_dram_domain_of_their_pci_node() -> None:
    t = topo("ascend-a2-8x910b")
    npus = {a.id: a for a in t.accelerators}
    assert sorted(npus) == [f"NPU{i}" for i in range(8)]
    for a in npus.values():
        assert a.source == "npu-smi" and a.domain == a.numa_node
        node_cpus = next(n.cpus for n in t.numa_nodes if n.id == a.numa_node)
        assert set(a.local_cpus) <= set(node_cpus)
    assert {lk.kind for lk in t.accelerator_links} == {"HCCS"}


def test_ascend_a3_sixteen_npus_one_hccs_group_across_four_nodes() -> None:
    t = topo("ascend-a3-16npu")
    assert len(t.cpus.online) == 640 and len(t.accelerators) == 16
    assert sorted({a.numa_node for a in t.accelerators}) == [0, 2, 4, 6]
    (g,) = t.accelerator_groups
    assert g.kind == "hccs-ring" and len(g.members) == 16
    assert all(a.attributes["series"] == "A3" for a in t.accelerators)


def test_kunlunxin_p800_halves_follow_numa_nodes() -> None:
    t = topo("kunlunxin-p800-8xpu")
    assert [(g.kind, list(g.members)) for g in t.accelerator_groups] == [
        ("numa-half", [f"XPU{i}" for i in range(4)]), ("numa-half", [f"XPU{i}" for i in range(4, 8)])]
    assert [a.numa_node for a in t.accelerators] == [0] * 4 + [1] * 4


FAULTS = {
    "missing": None,
    "timeout": "timed out after 10s",
    "exit 1": "exit status 1",
    "garbage": "garbage",
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize(("host", "tool", "source", "kind"), [
    ("ascend-a3-16npu", "npu-smi", "npu-smi", pb.ACCELERATOR_KIND_NPU),
    ("kunlunxin-p800-8xpu", "xpu-smi", "xpu-smi", pb.ACCELERATOR_KIND_XPU),
])
def test_failing_vendor_tool_leaves_the_pci_view_complete(host: str, tool: str, source: str, kind: int,
                                                          fault: str) -> None:
    """Every way a tool fails gives a degraded (or unavailable) source and the same devices, from
    the PCI view, on the same NUMA nodes: the rest of the topology is untouched."""
    good = topo(host)
    recorded = RecordedRunner.from_dir(root(host) / ".memtopo" / "tools").recordings
    why = FAULTS[fault]
    broken: dict[tuple[str, ...], ToolResult] = {}
    for argv in recorded:
        if argv[0] != tool or why is None:
            continue
        if why == "garbage":
            broken[argv] = ToolResult(argv, 0, "\x00\x01 not what the tool prints \ufffd\n")
        else:
            broken[argv] = ToolResult(argv, None if "timed" in why else 1, "", failure=f"{tool}: {why}")
    runner = RecordedRunner({a: r for a, r in recorded.items() if a[0] != tool} | broken)
    t = topo(host, runner=runner)
    assert source_state(t, source) in (pb.SOURCE_STATE_DEGRADED, pb.SOURCE_STATE_UNAVAILABLE)
    got = sorted((a.bdf, a.numa_node, a.kind) for a in t.accelerators)
    assert got == sorted((a.bdf, a.numa_node, kind) for a in good.accelerators)
    assert all(a.source == "pci" for a in t.accelerators)
    assert [d.numa_nodes for d in t.domains] == [d.numa_nodes for d in good.domains]
    assert len(t.pci_devices) == len(good.pci_devices)


def test_nvml_missing_on_gh200_still_reports_the_gpu_and_its_memory_node_from_procfs(tmp_path: Path) -> None:
    """No NVML recording (driver library absent): numa_status alone still names the GPU memory node;
    without NVML's C2C answer nothing is called Unified (the fallback: Dram domains only)."""
    absent = tmp_path / "nvml.json"
    absent.write_text('{"nvmlInit": {"error": "LibraryNotFound"}, "devices": []}')
    t = topo("gh200", nvml_replay=absent)
    assert source_state(t, "nvidia") == pb.SOURCE_STATE_DEGRADED
    (gpu,) = t.accelerators
    assert list(gpu.memory_numa_nodes) == [1] and not gpu.unified_memory
    assert UNIFIED not in [d.type for d in t.domains]
    assert not list(fabric_links(t))


def test_gh200_cdmm_is_still_unified_and_says_gpu_memory_is_not_os_visible(tmp_path: Path) -> None:
    """CDMM (no GPU NUMA node, NumaNodeId unsupported): one Unified domain of the Grace node, with the
    coherent-fabric link, and a note that the GPU's memory is not in it."""
    import importlib.util

    from tests.synth import tree
    from tests.sysfs_tree import Link, write_tree

    spec = importlib.util.spec_from_file_location("grace_cdmm", FIXTURES / "gh200" / "grace.py")
    assert spec is not None and spec.loader is not None
    grace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grace)
    files = tree(grace.host("gh200", cdmm=True))
    root_dir = write_tree(tmp_path, {k: Link(v[3:]) if v.startswith("-> ") else v for k, v in files.items()})
    (root_dir / ".memtopo").mkdir()
    (root_dir / ".memtopo" / "nvml.json").write_text(grace.nvml_text("gh200", cdmm=True))
    t = discover(ProbeContext.at_root(root_dir))
    (d,) = [d for d in t.domains if d.type == UNIFIED]
    assert list(d.numa_nodes) == [0]
    assert "not OS-visible" in d.note
    (gpu,) = t.accelerators
    assert gpu.unified_memory and list(gpu.memory_numa_nodes) == []
    assert len(list(fabric_links(t))) == 1
