"""place: one-node placement and fleet ranking on hand-built MemoryTopology messages.

No GH200, DGX or CXL host is at hand, so the topologies are written here in the schema's own
terms (what discovery would publish for such machines); expected values are worked out from the
rules of the vendor-neutral memory topology design and the formulas in
docs/planner-guest-pci-place.md, not copied from output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.planner.errors import PlanError
from memtopo.planner.place import ConstraintError, PlaceRequest, decide, parse_request, rank_nodes, to_binding_plan
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

GIB = 1 << 30
DRAM = pb.MemoryDomainType.MEMORY_DOMAIN_TYPE_DRAM
CXL = pb.MemoryDomainType.MEMORY_DOMAIN_TYPE_CXL_ATTACHED
UNIFIED = pb.MemoryDomainType.MEMORY_DOMAIN_TYPE_UNIFIED
IB = pb.PciDeviceKind.PCI_DEVICE_KIND_INFINIBAND
NIC = pb.PciDeviceKind.PCI_DEVICE_KIND_NIC


# ---- a small builder -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dom:
    id: int
    type: int
    nodes: Sequence[tuple[int, int]]  # (NUMA node, GiB)
    cpus: Iterable[int] = ()


@dataclass(frozen=True)
class Gpu:
    numa_node: int
    health: str = "OK"
    domain: int = -1
    unified: bool = False


def build(name: str, domains: Sequence[Dom], *, links: Sequence[tuple[int, int, int, int]] = (),
          gpus: Sequence[Gpu] = (), nics: Sequence[tuple[int, str]] = (),
          gpu_links: Sequence[tuple[int, int, str]] = (), allowed_cpus: Iterable[int] = (),
          allowed_mems: Iterable[int] = ()) -> pb.MemoryTopology:
    """links: (domain a, domain b, read MB/s both ways, SLIT distance); nics: (numa node, physfn)."""
    t = pb.MemoryTopology(node_name=name)
    for d in domains:
        cpus = list(d.cpus)
        t.domains.add(id=d.id, type=d.type, capacity_bytes=sum(g for _, g in d.nodes) * GIB,
                      numa_nodes=[n for n, _ in d.nodes], attached_cpus=cpus)
        for i, (n, g) in enumerate(d.nodes):
            t.numa_nodes.add(id=n, memory_bytes=g * GIB, cpus=cpus if i == 0 else [], has_cpu=bool(cpus and i == 0),
                             has_memory=True, domain=d.id)
    for a, b, bw, dist in links:
        perf = pb.LinkPerformance(read_bandwidth_mbps=bw, write_bandwidth_mbps=bw)
        t.interconnects.add(domain_a=a, domain_b=b, distance_a_to_b=dist, distance_b_to_a=dist, a_to_b=perf,
                            b_to_a=perf)
    for i, gpu in enumerate(gpus):
        t.accelerators.add(index=i, kind=pb.AcceleratorKind.ACCELERATOR_KIND_GPU, vendor="NVIDIA", id=f"GPU{i}",
                           numa_node=gpu.numa_node, health=gpu.health, domain=gpu.domain, unified_memory=gpu.unified)
        if gpu.domain >= 0:
            next(d for d in t.domains if d.id == gpu.domain).attached_accelerators.append(i)
    for i, (node, physfn) in enumerate(nics):
        t.pci_devices.add(bdf=f"0000:{0x30 + i:02x}:00.0", kind=IB, numa_node=node, physfn=physfn)
    for a, b, kind in gpu_links:
        t.accelerator_links.add(a=f"GPU{a}", b=f"GPU{b}", kind=kind)
    t.allowed_cpus.extend(allowed_cpus)
    t.allowed_memory_nodes.extend(allowed_mems)
    return t


def dual_socket_cxl(name: str = "ds") -> pb.MemoryTopology:
    """Two sockets of 16 CPUs and 256 GiB DRAM, 2 GPUs each, one NIC on socket 1, a 1 TiB CXL
    expander behind socket 0 (faster from socket 0)."""
    return build(name, [Dom(0, DRAM, [(0, 256)], range(16)), Dom(1, DRAM, [(1, 256)], range(16, 32)),
                        Dom(2, CXL, [(2, 1024)])],
                 links=[(0, 1, 40_000, 21), (0, 2, 64_000, 24), (1, 2, 32_000, 34)],
                 gpus=[Gpu(0), Gpu(0), Gpu(1), Gpu(1)], nics=[(1, "")])


def gh200(name: str = "gh") -> pb.MemoryTopology:
    """One Grace Hopper superchip: 72 CPUs and 480 GiB LPDDR5X (node 0) plus the GPU's 96 GiB HBM
    (node 1) merged into one Unified domain, as the vendor-neutral memory topology design maps it."""
    return build(name, [Dom(0, UNIFIED, [(0, 480), (1, 96)], range(72))],
                 gpus=[Gpu(0, domain=0, unified=True)], nics=[(0, "")])


def dgx(name: str = "dgx", health: Sequence[str] = ("OK",) * 8) -> pb.MemoryTopology:
    """Dual socket, 56 CPUs and 1 TiB each, GPU0-3 on node 0 and GPU4-7 on node 1, all pairs NV18.
    NICs: 3 on node 0, 4 on node 1, plus a VF on node 0 that must not count as a port."""
    nv = [(a, b, "NV") for a in range(8) for b in range(a + 1, 8)]
    paths = [(a, b, "NODE" if (a < 4) == (b < 4) else "SYS") for a in range(8) for b in range(a + 1, 8)]
    return build(name, [Dom(0, DRAM, [(0, 1024)], range(56)), Dom(1, DRAM, [(1, 1024)], range(56, 112))],
                 links=[(0, 1, 60_000, 21)], gpus=[Gpu(i // 4, health=h) for i, h in enumerate(health)],
                 nics=[(0, ""), (0, ""), (0, ""), (1, ""), (1, ""), (1, ""), (1, ""), (0, "0000:30:00.0")],
                 gpu_links=nv + paths)


def req(**kw: Any) -> PlaceRequest:
    constraints = {k: kw.pop(k) for k in list(kw) if k in {"memory_policy", "prefer_same_numa",
                                                          "require_unified_memory", "prefer_local_memory",
                                                          "allow_cxl_memory"}}
    return parse_request({**kw, "constraints": constraints})


# ---- dual socket + CXL -----------------------------------------------------------------------------
def test_colocated_in_the_domain_with_the_nic() -> None:
    d = decide(req(cpus=4, gpus=1, memory_gb=64), dual_socket_cxl())
    assert d.co_located and [u.id for u in d.domains] == [1]
    assert d.cpus == (16, 17, 18, 19) and d.gpus == (2,)
    assert [(m.node, m.bytes) for m in d.memory] == [(1, 64 * GIB)]
    assert d.memory_policy.mode == "local" and not d.memory_policy.explicit
    assert d.memory_policy.numactl == ("--localalloc",)
    assert d.memory_locality_fitness == 1.0 and d.intra_node_fitness == 1.0


def test_memory_spills_to_the_other_socket_before_cxl() -> None:
    d = decide(req(cpus=4, gpus=1, memory_gb=300), dual_socket_cxl())
    assert [(m.node, m.bytes // GIB) for m in d.memory] == [(1, 256), (0, 44)]
    # Spilling under "local" could land on CXL, which the request did not allow: bind instead.
    assert d.memory_policy.mode == "bind" and d.memory_policy.nodes == (0, 1)
    assert d.memory_locality_fitness == 1.0  # no prefer_local_memory: memory is not scored
    p = decide(req(cpus=4, gpus=1, memory_gb=300, prefer_local_memory=True), dual_socket_cxl())
    assert p.memory_locality_fitness == pytest.approx(256 / 300)
    assert p.intra_node_fitness == pytest.approx(0.5 * 1.0 + 0.5 * 256 / 300)


def test_memory_above_local_dram_needs_allow_cxl() -> None:
    with pytest.raises(ConstraintError) as exc:
        decide(req(cpus=4, memory_gb=600), dual_socket_cxl())
    assert exc.value.constraint == "allow_cxl_memory" and "512 GiB" in exc.value.message
    d = decide(req(cpus=4, memory_gb=600, allow_cxl_memory=True), dual_socket_cxl())
    # CPU-only: both sockets fit, no NIC preference, equal memory → the lower id, socket 0.
    assert [u.id for u in d.domains] == [0]
    assert [(m.node, m.type, m.bytes // GIB) for m in d.memory] == [(0, "DRAM", 256), (1, "DRAM", 256),
                                                                   (2, "CXL_ATTACHED", 88)]
    assert d.memory_policy.mode == "bind" and d.memory_policy.numactl == ("--membind=0-2",)


def test_memory_beyond_dram_plus_cxl() -> None:
    with pytest.raises(ConstraintError) as exc:
        decide(req(cpus=4, memory_gb=2000, allow_cxl_memory=True), dual_socket_cxl())
    assert exc.value.constraint == "memory_gb" and "1536 GiB" in exc.value.message


def test_spanning_prefers_gpus_local_cpus() -> None:
    # 24 CPUs exceed one socket's 16: anchor = socket 1 (both have 2 GPUs, socket 1 has the NIC).
    d = decide(req(cpus=24, gpus=2, workload="gpu-heavy"), dual_socket_cxl())
    assert not d.co_located and [u.id for u in d.domains] == [1, 0]
    assert d.gpus == (2, 3)
    assert d.cpus == tuple(range(8)) + tuple(range(16, 32))
    # Locality: socket 1 holds 16 CPUs + 2 GPUs of 26 items. GPU2–3 have no measured link: NODE (0.2).
    assert d.memory_locality_fitness == pytest.approx(18 / 26)
    assert d.gpu_link_fitness == pytest.approx(0.2)
    assert d.intra_node_fitness == pytest.approx(0.7 * 0.2 + 0.3 * 18 / 26)


def test_gpus_spanning_split_cpus_by_gpu_or_keep_them_together() -> None:
    d = decide(req(cpus=8, gpus=3), dual_socket_cxl())
    assert [u.id for u in d.domains] == [1, 0] and d.gpus == (2, 3, 0)
    # 8 CPUs over GPUs 2:1 → 5.33 / 2.67 → 5 and 3 (largest remainder).
    assert {u.id: len(u.cpus) for u in d.domains} == {1: 5, 0: 3}
    assert d.memory_locality_fitness == pytest.approx(7 / 11)
    assert d.gpu_link_fitness == pytest.approx(0.2 / 3)  # (2,3) NODE; (2,0), (3,0) SYS
    s = decide(req(cpus=8, gpus=3, prefer_same_numa=True), dual_socket_cxl())
    assert s.cpus == tuple(range(16, 24))
    assert {u.id: len(u.cpus) for u in s.domains} == {1: 8, 0: 0}
    assert s.memory_locality_fitness == pytest.approx(10 / 11)


def test_same_numa_factor_when_cpus_must_span() -> None:
    d = decide(req(cpus=24, prefer_same_numa=True), dual_socket_cxl())
    # CPU-only: anchor socket 0 (lower id) fills first; 16 of 24 CPUs in one domain.
    assert {u.id: len(u.cpus) for u in d.domains} == {0: 16, 1: 8}
    assert d.memory_locality_fitness == pytest.approx((16 / 24) * (16 / 24))


def test_explicit_policies() -> None:
    t = dual_socket_cxl()
    pref = decide(req(cpus=4, gpus=1, memory_gb=64, memory_policy="preferred"), t)
    assert pref.memory_policy.mode == "preferred" and pref.memory_policy.numactl == ("--preferred=1",)
    bind = decide(req(cpus=4, gpus=1, memory_gb=64, memory_policy="bind"), t)
    assert bind.memory_policy.numactl == ("--membind=1",) and bind.memory_policy.explicit
    inter = decide(req(cpus=4, gpus=1, memory_gb=64, memory_policy="interleave"), t)
    # "all" within what the request may use: both sockets' DRAM, not the CXL node.
    assert inter.memory_policy.nodes == (0, 1)
    assert sorted((m.node, m.bytes) for m in inter.memory) == [(0, 32 * GIB), (1, 32 * GIB)]
    inter_cxl = decide(req(cpus=4, gpus=1, memory_gb=64, memory_policy="interleave", allow_cxl_memory=True), t)
    assert inter_cxl.memory_policy.nodes == (0, 1, 2)


def test_allowed_cpus_and_mems_are_respected() -> None:
    t = dual_socket_cxl()
    t.allowed_cpus.extend([*range(20, 32)])  # only 12 CPUs of socket 1
    t.allowed_memory_nodes.extend([1])
    d = decide(req(cpus=4, gpus=1, memory_gb=10), t)
    assert d.cpus == (20, 21, 22, 23) and d.memory_nodes == (1,)
    with pytest.raises(ConstraintError) as exc:
        decide(req(cpus=13), t)
    assert exc.value.constraint == "cpus" and "12 allowed CPUs" in exc.value.message
    with pytest.raises(ConstraintError) as exc:
        decide(req(cpus=1, memory_gb=300), t)  # socket 0's DRAM is not in the cpuset's mems
    assert exc.value.constraint == "allow_cxl_memory" and "256 GiB" in exc.value.message


def test_highest_bandwidth_link_decides_the_second_domain() -> None:
    t = build("quad", [Dom(i, DRAM, [(i, 64)], range(4 * i, 4 * i + 4)) for i in range(4)],
              links=[(0, 1, 20_000, 21), (0, 2, 50_000, 21), (0, 3, 10_000, 21), (1, 2, 20_000, 21),
                     (1, 3, 20_000, 21), (2, 3, 20_000, 21)],
              gpus=[Gpu(i) for i in range(4)])
    d = decide(req(cpus=2, gpus=2), t)
    assert [u.id for u in d.domains] == [0, 2] and d.gpus == (0, 2)
    assert d.cpus == (0, 8)


def test_slit_distance_ranks_neighbours_without_bandwidth() -> None:
    t = build("slit", [Dom(i, DRAM, [(i, 64)], range(4 * i, 4 * i + 4)) for i in range(3)],
              gpus=[Gpu(i) for i in range(3)])
    for d, row in zip(t.domains, ([10, 32, 21], [32, 10, 21], [21, 21, 10]), strict=True):
        d.distances.extend(row)
    assert [u.id for u in decide(req(cpus=2, gpus=2), t).domains] == [0, 2]


def test_gpu_choice_follows_pcie_links() -> None:
    pairs = [(0, 1, "PIX"), (2, 3, "PIX"), (0, 2, "NODE"), (0, 3, "NODE"), (1, 2, "NODE"), (1, 3, "NODE")]
    t = build("pcie", [Dom(0, DRAM, [(0, 64)], range(8))], gpus=[Gpu(0)] * 4, gpu_links=pairs)
    assert decide(req(cpus=2, gpus=2), t).gpus == (0, 1)
    t.accelerators[0].health = "Critical"
    d = decide(req(cpus=2, gpus=2), t)
    assert d.gpus == (2, 3) and d.gpu_link_fitness == pytest.approx(0.8)


def test_gpu_memory_node_is_neither_home_nor_placement_memory() -> None:
    # GPU0's own memory is a CPU-less GPU_MEMORY node (2); its PCI node is 1. Co-location follows
    # the CPUs that drive it, and no allocation memory goes to the GPU's node.
    gpu_mem = pb.MemoryDomainType.MEMORY_DOMAIN_TYPE_GPU_MEMORY
    t = build("gpumem", [Dom(0, DRAM, [(0, 64)], range(8)), Dom(1, DRAM, [(1, 64)], range(8, 16)),
                         Dom(2, gpu_mem, [(2, 80)])],
              links=[(0, 1, 40_000, 21), (1, 2, 400_000, 11), (0, 2, 30_000, 21)], gpus=[Gpu(1, domain=2)])
    d = decide(req(cpus=2, gpus=1, memory_gb=100), t)
    assert [u.id for u in d.domains] == [1] and d.cpus == (8, 9)
    assert [(m.node, m.bytes // GIB) for m in d.memory] == [(1, 64), (0, 36)]
    with pytest.raises(ConstraintError) as exc:
        decide(req(cpus=2, memory_gb=129), t)
    assert exc.value.constraint == "allow_cxl_memory" and "128 GiB" in exc.value.message


# ---- GH200-like Unified domain ---------------------------------------------------------------------
def test_unified_node_skips_the_numa_policy() -> None:
    d = decide(req(cpus=24, gpus=1, memory_gb=128), gh200())
    assert d.cpus == tuple(range(24)) and d.gpus == (0,) and d.co_located
    assert d.domains[0].type == "UNIFIED"
    assert [(m.node, m.bytes) for m in d.memory] == [(0, 128 * GIB)]
    assert d.memory_policy.mode == "skip" and d.memory_policy.numactl == ()
    assert d.intra_node_fitness == 1.0


def test_unified_node_applies_an_explicit_policy() -> None:
    # The memory topology design's own example request: interleave on a unified node is honoured when asked for.
    d = decide(req(cpus=24, gpus=1, memory_gb=128, memory_policy="interleave", require_unified_memory=True), gh200())
    assert d.memory_policy.mode == "interleave" and d.memory_policy.explicit
    assert d.memory_policy.numactl == ("--interleave=0-1",)
    assert sorted((m.node, m.bytes) for m in d.memory) == [(0, 64 * GIB), (1, 64 * GIB)]


def test_require_unified_rejects_discrete_nodes() -> None:
    with pytest.raises(ConstraintError) as exc:
        decide(req(cpus=4, require_unified_memory=True), dual_socket_cxl())
    assert exc.value.constraint == "require_unified_memory"
    assert exc.value.code == "unsatisfiable"


def test_unified_node_has_no_cxl() -> None:
    with pytest.raises(ConstraintError) as exc:
        decide(req(cpus=4, memory_gb=600, allow_cxl_memory=True), gh200())
    assert exc.value.constraint == "allow_cxl_memory" and "no CXL memory" in exc.value.message


# ---- DGX-like 8-GPU host ---------------------------------------------------------------------------
def test_dgx_four_gpus_go_where_the_nics_are() -> None:
    # Node 0 has 3 ports (+ a VF that is not one), node 1 has 4: a 4-GPU job goes to node 1.
    d = decide(req(cpus=16, gpus=4, workload="gpu-heavy"), dgx())
    assert [u.id for u in d.domains] == [1] and d.gpus == (4, 5, 6, 7)
    assert d.cpus == tuple(range(56, 72)) and d.intra_node_fitness == 1.0


def test_dgx_unhealthy_gpu_moves_the_job() -> None:
    d = decide(req(cpus=16, gpus=4), dgx(health=("OK",) * 5 + ("Critical",) + ("OK",) * 2))
    assert d.gpus == (0, 1, 2, 3)


def test_dgx_eight_gpus_span_both_sockets() -> None:
    d = decide(req(cpus=16, gpus=8, workload="gpu-heavy"), dgx())
    assert [u.id for u in d.domains] == [1, 0] and d.gpus == (4, 5, 6, 7, 0, 1, 2, 3)
    assert d.cpus == tuple(range(8)) + tuple(range(56, 64))
    assert d.gpu_link_fitness == 1.0  # NV18 everywhere beats the SYS path class
    assert d.memory_locality_fitness == pytest.approx(0.5)
    assert d.intra_node_fitness == pytest.approx(0.7 + 0.3 * 0.5)
    with pytest.raises(ConstraintError) as exc:
        decide(req(cpus=16, gpus=9), dgx())
    assert exc.value.constraint == "gpus" and "8 usable GPUs" in exc.value.message


# ---- fleet -----------------------------------------------------------------------------------------
def test_fleet_ranks_by_fitness_and_names_each_rejection() -> None:
    fleet = rank_nodes(req(cpus=24, gpus=2, memory_gb=64, workload="gpu-heavy"), [dual_socket_cxl(), gh200(), dgx()])
    assert [d.node for d in fleet.ranked] == ["dgx", "ds"]
    assert fleet.ranked[0].intra_node_fitness == 1.0
    assert fleet.ranked[1].intra_node_fitness == pytest.approx(0.7 * 0.2 + 0.3 * 18 / 26)
    assert [(r.node, r.constraint) for r in fleet.rejected] == [("gh", "gpus")]
    out = fleet.to_json()
    assert out["chosen"] == "dgx" and [n["fits"] for n in out["nodes"]] == [True, True, False]
    assert out["nodes"][2]["constraint"] == "gpus"


def test_fleet_unified_required() -> None:
    fleet = rank_nodes(req(cpus=8, gpus=1, require_unified_memory=True), [dual_socket_cxl(), gh200(), dgx()])
    assert [d.node for d in fleet.ranked] == ["gh"]
    assert {r.node: r.constraint for r in fleet.rejected} == {"ds": "require_unified_memory",
                                                              "dgx": "require_unified_memory"}


def test_fleet_cxl_rules() -> None:
    nodes = [dual_socket_cxl(), gh200(), dgx()]
    without = rank_nodes(req(cpus=8, memory_gb=600), nodes)
    assert [d.node for d in without.ranked] == ["dgx"]
    assert {r.node: r.constraint for r in without.rejected} == {"ds": "allow_cxl_memory", "gh": "allow_cxl_memory"}
    with_cxl = rank_nodes(req(cpus=8, memory_gb=600, allow_cxl_memory=True), nodes)
    assert sorted(d.node for d in with_cxl.ranked) == ["dgx", "ds"]
    (gh,) = with_cxl.rejected
    assert gh.node == "gh" and "no CXL memory" in gh.reason


def test_fleet_prefer_local_memory_orders_nodes() -> None:
    # 300 GiB: the dual socket must spill off its socket, the DGX does not.
    fleet = rank_nodes(req(cpus=4, memory_gb=300, prefer_local_memory=True), [dual_socket_cxl(), dgx()])
    assert [d.node for d in fleet.ranked] == ["dgx", "ds"]
    assert fleet.ranked[1].memory_locality_fitness == pytest.approx(256 / 300)


def test_fleet_bad_topology_and_unnamed_nodes() -> None:
    bad = dual_socket_cxl("bad")
    bad.domains.add(id=0, type=DRAM)
    unnamed = gh200("")
    fleet = rank_nodes(req(cpus=1), [bad, unnamed])
    assert [d.node for d in fleet.ranked] == ["node[1]"]
    assert [(r.node, r.constraint) for r in fleet.rejected] == [("bad", "topology")]
    assert "duplicate memory domain ids" in fleet.rejected[0].reason
    assert rank_nodes(req(cpus=1), []).to_json() == {"policy": "place", "chosen": None, "nodes": []}


def test_decision_json() -> None:
    out = decide(req(cpus=24, gpus=2, memory_gb=64), dual_socket_cxl()).to_json()
    assert out["cpus"] == "0-7,16-31"
    assert out["gpus"] == [{"index": 2, "id": "GPU2"}, {"index": 3, "id": "GPU3"}]
    assert out["domains"][0] == {"id": 1, "type": "DRAM", "cpus": "16-31", "gpus": [2, 3]}
    assert out["memory"] == {"nodes": "1", "by_node": [{"node": 1, "domain": 1, "type": "DRAM", "gb": 64.0}]}
    assert out["memory_policy"]["mode"] == "local" and out["beta"] == 0.5


# ---- requests --------------------------------------------------------------------------------------
def test_workload_betas() -> None:
    assert [parse_request({"cpus": 1, "workload": w}).beta for w in ("gpu-heavy", "cpu-heavy", "default")] == \
        [0.7, 0.3, 0.5]
    assert parse_request({"cpus": 1}).beta == 0.5


@pytest.mark.parametrize(("obj", "field"), [
    (None, "request"),
    ({}, "cpus"),
    ({"cpus": 0}, "cpus"),
    ({"cpus": "4"}, "cpus"),
    ({"cpus": 4, "gpus": -1}, "gpus"),
    ({"cpus": 4, "memory_gb": -1}, "memory_gb"),
    ({"cpus": 4, "memory_gb": True}, "memory_gb"),
    ({"cpus": 4, "memory_gb": float("nan")}, "memory_gb"),
    ({"cpus": 4, "memory_gb": "128"}, "memory_gb"),
    ({"cpus": 4, "workload": "memory-heavy"}, "workload"),
    ({"cpus": 4, "constraints": []}, "constraints"),
    ({"cpus": 4, "constraints": {"memory_policy": "numa"}}, "constraints.memory_policy"),
    ({"cpus": 4, "constraints": {"require_unified": True}}, "constraints"),
    ({"cpus": 4, "constraints": {"allow_cxl_memory": "yes"}}, "allow_cxl_memory"),
    ({"cpus": 4, "resources": {}}, "request"),
])
def test_invalid_requests(obj: Any, field: str) -> None:
    with pytest.raises(PlanError) as exc:
        parse_request(obj)
    assert exc.value.code == "invalid_request" and exc.value.message.startswith(f"{field}:"), exc.value.message


# ---- properties ------------------------------------------------------------------------------------
@st.composite
def topologies(draw: st.DrawFn) -> pb.MemoryTopology:
    n = draw(st.integers(1, 4))
    doms, gpus, next_cpu = [], [], 0
    for i in range(n):
        kind = draw(st.sampled_from([DRAM, DRAM, UNIFIED, CXL]))
        ncpu = 0 if kind == CXL else draw(st.integers(0, 8))
        doms.append(Dom(i, kind, [(i, draw(st.integers(1, 64)))], range(next_cpu, next_cpu + ncpu)))
        next_cpu += ncpu
        if kind != CXL:
            gpus += [Gpu(i, health=draw(st.sampled_from(["OK", "", "Critical"])))
                     for _ in range(draw(st.integers(0, 3)))]
    links = [(a, b, draw(st.integers(0, 3)) * 10_000, draw(st.integers(10, 40))) for a in range(n)
             for b in range(a + 1, n)]
    allowed = draw(st.sets(st.integers(0, max(0, next_cpu - 1)))) if next_cpu else set()
    nics = [(draw(st.integers(0, n - 1)), "") for _ in range(draw(st.integers(0, 3)))]
    kinds = draw(st.lists(st.sampled_from(["NV", "PIX", "SYS", "NODE"]), min_size=len(gpus) ** 2,
                          max_size=len(gpus) ** 2))
    gpu_links = [(a, b, kinds[a * len(gpus) + b]) for a in range(len(gpus)) for b in range(a + 1, len(gpus))]
    return build("h", doms, links=links, gpus=gpus, nics=nics, gpu_links=gpu_links, allowed_cpus=sorted(allowed))


requests = st.builds(
    lambda c, g, m, w, pol, flags: req(cpus=c, gpus=g, memory_gb=m, workload=w, memory_policy=pol,
                                       prefer_same_numa=flags[0], require_unified_memory=flags[1],
                                       prefer_local_memory=flags[2], allow_cxl_memory=flags[3]),
    st.integers(1, 12), st.integers(0, 3), st.integers(0, 64), st.sampled_from(["gpu-heavy", "cpu-heavy", "default"]),
    st.sampled_from([None, "local", "interleave", "preferred", "bind"]), st.tuples(*[st.booleans()] * 4))


@settings(max_examples=400, deadline=None)
@given(topologies(), requests)
def test_placement_properties(topo: pb.MemoryTopology, r: PlaceRequest) -> None:
    try:
        d = decide(r, topo)
    except ConstraintError as exc:
        assert exc.constraint in {"cpus", "gpus", "memory_gb", "allow_cxl_memory", "require_unified_memory"}
        return
    allowed = set(topo.allowed_cpus) or {c for dom in topo.domains for c in dom.attached_cpus}
    assert set(d.cpus) <= allowed and len(d.cpus) == len(set(d.cpus)) == r.cpus
    usable = {i for i, a in enumerate(topo.accelerators) if a.health != "Critical"}
    assert set(d.gpus) <= usable and len(d.gpus) == len(set(d.gpus)) == r.gpus
    if r.memory_bytes:
        assert sum(m.bytes for m in d.memory) == r.memory_bytes
    if not r.allow_cxl_memory:
        assert all(m.type != "CXL_ATTACHED" for m in d.memory)
    for value in (d.gpu_link_fitness, d.memory_locality_fitness, d.intra_node_fitness):
        assert 0.0 <= value <= 1.0
    assert d.to_json() == decide(r, topo).to_json()
    fleet = rank_nodes(r, [topo, topo])
    assert len(fleet.ranked) == 2 and fleet.ranked[0].to_json() == fleet.ranked[1].to_json() == d.to_json()


# ---- to_binding_plan --------------------------------------------------------------------------------
def _actions(plan: planpb.BindingPlan) -> dict[str, planpb.PlanAction]:
    return {a.id: a for a in plan.actions}


def test_plan_binds_threads_and_moves_pages_home_under_local() -> None:
    t = dual_socket_cxl()
    t.fingerprint = "fp-ds"
    plan = to_binding_plan(decide(req(cpus=4, gpus=1, memory_gb=64), t), t, 4242, plan_id="p1")
    assert (plan.plan_id, plan.policy, plan.topology_fingerprint) == ("p1", "place", "fp-ds")
    acts = _actions(plan)
    assert list(acts) == ["place-cpus", "place-migrate"]
    cpus = acts["place-cpus"].thread_affinity
    assert acts["place-cpus"].required and cpus.pid == 4242 and cpus.threads.all and list(cpus.cpus) == [16, 17, 18, 19]
    move = acts["place-migrate"]
    assert not move.required and (list(move.page_migration.from_nodes), list(move.page_migration.to_nodes)) == \
        ([0, 2], [1])
    assert plan.description.startswith("place: pid 4242 on CPUs 16-19, GPUs GPU2, memory local")


def test_plan_bind_is_required_with_migration_and_follows_explicit_on_unified() -> None:
    spill = to_binding_plan(decide(req(cpus=4, gpus=1, memory_gb=300), dual_socket_cxl()), dual_socket_cxl(), 7,
                            plan_id="p")
    mp = _actions(spill)["place-membind"]
    assert mp.required and mp.memory_policy.mode == planpb.MemoryPolicy.MODE_BIND
    assert list(mp.memory_policy.nodes) == [0, 1] and mp.memory_policy.migrate_existing
    assert not mp.memory_policy.apply_on_unified  # chosen by the planner, not asked for
    asked = to_binding_plan(decide(req(cpus=8, memory_gb=64, memory_policy="bind"), gh200()), gh200(), 7, plan_id="p")
    assert _actions(asked)["place-membind"].memory_policy.apply_on_unified


def test_plan_leaves_memory_alone_where_a_running_process_cannot_be_changed() -> None:
    t = dual_socket_cxl()
    inter = to_binding_plan(decide(req(cpus=4, gpus=1, memory_gb=64, memory_policy="interleave"), t), t, 9,
                            plan_id="p")
    assert list(_actions(inter)) == ["place-cpus"]
    assert "interleave cannot be imposed on a running process: start it with " \
           "`memtopo exec --cpus 16-19 --interleave=0-1 -- COMMAND`" in inter.description
    pref = to_binding_plan(decide(req(cpus=4, gpus=1, memory_gb=64, memory_policy="preferred"), t), t, 9,
                           plan_id="p")
    move = _actions(pref)["place-migrate"].page_migration
    assert (list(move.from_nodes), list(move.to_nodes)) == ([0, 2], [1]) and "--preferred=1" in pref.description
    skip = to_binding_plan(decide(req(cpus=24, gpus=1, memory_gb=128), gh200()), gh200(), 9, plan_id="p")
    assert list(_actions(skip)) == ["place-cpus"] and "no memory policy: Unified memory" in skip.description


@pytest.mark.parametrize(("pid", "plan_id", "field"), [(0, "p", "pid"), (True, "p", "pid"), (5, "", "plan_id")])
def test_plan_refuses_a_bad_pid_or_id(pid: Any, plan_id: str, field: str) -> None:
    with pytest.raises(PlanError) as err:
        to_binding_plan(decide(req(cpus=1), gh200()), gh200(), pid, plan_id=plan_id)
    assert err.value.message.startswith(f"{field}:")
