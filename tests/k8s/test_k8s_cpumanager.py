"""The kubelet's static CPU manager policy (k8s/cpumanager.py) against the kubelet's own tables:
``cpu_assignment_test.go`` (free sockets/NUMA nodes/cores, the packed CPU order, takeByTopology
NUMA-packed) on the same four topologies, and ``policy_static``'s rules on who gets exclusive CPUs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memtopo.cpulist import parse_cpulist
from memtopo.hostfs import HostFS
from memtopo.k8s import cpumanager as cm
from memtopo.k8s.cputopo import CpuPlace, CpuTopology, read_cpu_places
from memtopo.v1 import topology_pb2 as pb


def _topo(n: int, place: Callable[[int], tuple[int, int, int]]) -> CpuTopology:
    return CpuTopology.of({c: CpuPlace(*place(c)) for c in range(n)})


# The kubelet's test topologies (core named by its lowest CPU, as the kubelet's discovery names it).
SINGLE_SOCKET_HT = _topo(8, lambda c: (c % 4, 0, 0))
DUAL_SOCKET_HT = _topo(12, lambda c: (c % 6, c % 2, c % 2))
DUAL_SOCKET_MULTI_NUMA_PER_SOCKET_HT = _topo(80, lambda c: (c % 40, (c % 40) // 20, (c % 40) // 10))
MULTI_SOCKET_DUAL_SOCKET_PER_NUMA_HT = _topo(80, lambda c: (c % 40, (c % 40) // 10, (c % 40) // 20))
TOPOS = {"single": SINGLE_SOCKET_HT, "dual": DUAL_SOCKET_HT, "dual-multi-numa": DUAL_SOCKET_MULTI_NUMA_PER_SOCKET_HT,
         "multi-socket-per-numa": MULTI_SOCKET_DUAL_SOCKET_PER_NUMA_HT}


def cpus(text: str) -> set[int]:
    return set(parse_cpulist(text))


@pytest.mark.parametrize(("topo", "available", "sockets"), [
    ("single", "0-7", [0]), ("single", "1-7", []),
    ("dual", "0-11", [0, 1]), ("dual", "0-9,11", [1]), ("dual", "0,2-9,11", []),
    ("dual-multi-numa", "0-79", [0, 1]), ("dual-multi-numa", "1-79", [1]), ("dual-multi-numa", "1-78", []),
    ("multi-socket-per-numa", "0-79", [0, 1, 2, 3]), ("multi-socket-per-numa", "0-19,21-79", [0, 1, 3]),
    ("multi-socket-per-numa", "0-59,61-78", [0, 1]), ("multi-socket-per-numa", "1-19,21-38,41-60,61-78", [1]),
    ("multi-socket-per-numa", "0-40,42-49,51-68,71-79", []),
])
def test_free_sockets(topo: str, available: str, sockets: list[int]) -> None:
    assert sorted(cm._Accumulator(TOPOS[topo], cpus(available), 0).free("socket")) == sockets


@pytest.mark.parametrize(("topo", "available", "nodes"), [
    ("single", "0-7", [0]), ("single", "1-7", []),
    ("dual", "0-11", [0, 1]), ("dual", "0-9,11", [1]), ("dual", "0,2-9,11", []),
    ("dual-multi-numa", "0-79", [0, 1, 2, 3]), ("dual-multi-numa", "1-79", [1, 2, 3]),
    ("dual-multi-numa", "1-9,11-79", [2, 3]), ("dual-multi-numa", "1-9,11-59,61-79", [3]),
    ("dual-multi-numa", "1-9,11-59,61-78", []),
    ("multi-socket-per-numa", "0-79", [0, 1]), ("multi-socket-per-numa", "0-9,11-79", [1]),
    ("multi-socket-per-numa", "0-9,11-59,61-79", []),
])
def test_free_numa_nodes(topo: str, available: str, nodes: list[int]) -> None:
    assert cm._Accumulator(TOPOS[topo], cpus(available), 0).free("numa") == nodes


@pytest.mark.parametrize(("available", "sockets", "nodes"), [
    ("0-79", [0, 1], [0, 1, 2, 3]), ("1-79", [1], [1, 2, 3]), ("1-9,11-79", [1], [2, 3]), ("1-59,61-79", [], [1, 3]),
])
def test_free_sockets_and_numa_nodes(available: str, sockets: list[int], nodes: list[int]) -> None:
    acc = cm._Accumulator(DUAL_SOCKET_MULTI_NUMA_PER_SOCKET_HT, cpus(available), 0)
    assert (acc.free("numa"), acc.free("socket")) == (nodes, sockets)


@pytest.mark.parametrize(("topo", "available", "cores"), [
    ("single", "0-7", [0, 1, 2, 3]), ("single", "0-2,4-6", [0, 1, 2]), ("single", "0-6", [0, 1, 2]),
    ("single", "", []), ("single", "0-3", []),
    ("dual", "0-11", [0, 2, 4, 1, 3, 5]), ("dual", "1-5,7-11", [2, 4, 1, 3, 5]), ("dual", "2-5,8-11", [2, 4, 3, 5]),
])
def test_free_cores_in_packing_order(topo: str, available: str, cores: list[int]) -> None:
    assert cm._Accumulator(TOPOS[topo], cpus(available), 0).free("core") == cores


@pytest.mark.parametrize(("topo", "available", "order"), [
    ("single", "0-7", [0, 4, 1, 5, 2, 6, 3, 7]), ("single", "3-7", [4, 5, 6, 3, 7]),
    ("dual", "0-11", [0, 6, 2, 8, 4, 10, 1, 7, 3, 9, 5, 11]), ("dual", "1-11", [6, 2, 8, 4, 10, 1, 7, 3, 9, 5, 11]),
    ("dual", "1-5,7-11", [2, 8, 4, 10, 1, 7, 3, 9, 5, 11]),
])
def test_single_threads_fill_the_emptiest_cores_first(topo: str, available: str, order: list[int]) -> None:
    assert cm._Accumulator(TOPOS[topo], cpus(available), 0).sorted_cpus() == order


TAKE_CASES = [
    ("take zero cpus from single socket with HT", "single", "0-7", 0, ""),
    ("take one cpu from single socket with HT", "single", "0-7", 1, "0"),
    ("take one cpu from single socket with HT, some cpus are taken", "single", "1,3,5-7", 1, "6"),
    ("take two cpus from single socket with HT", "single", "0-7", 2, "0,4"),
    ("take all cpus from single socket with HT", "single", "0-7", 8, "0-7"),
    ("take two cpus from single socket with HT, only one core totally free", "single", "0-3,6", 2, "2,6"),
    ("take one cpu from dual socket with HT - core from Socket 0", "dual", "1-5,7-11", 1, "2"),
    ("take a socket of cpus from dual socket with HT", "dual", "0-11", 6, "0,2,4,6,8,10"),
    ("take a socket of cpus from dual socket with multi-numa-per-socket with HT", "dual-multi-numa", "0-79", 40,
     "0-19,40-59"),
    ("take a NUMA node of cpus from dual socket with multi-numa-per-socket with HT", "dual-multi-numa", "0-79", 20,
     "0-9,40-49"),
    ("take a NUMA node of cpus ..., with 1 NUMA node already taken", "dual-multi-numa", "10-39,50-79", 20,
     "10-19,50-59"),
    ("take a socket and a NUMA node of cpus from dual socket with multi-numa-per-socket with HT", "dual-multi-numa",
     "0-79", 60, "0-29,40-69"),
    ("take a socket and a NUMA node of cpus ..., a core taken", "dual-multi-numa", "1-39,41-79", 60, "10-39,50-79"),
    ("allocate 4 full cores with 3 coming from the first NUMA node (filling it up) and 1 coming from the second",
     "dual", "0-11", 8, "0,6,2,8,4,10,1,7"),
    ("allocate 32 full cores with 30 coming from the first 3 NUMA nodes (filling them up) and 2 from the fourth",
     "dual-multi-numa", "0-79", 64, "0-29,40-69,30,31,70,71"),
]


@pytest.mark.parametrize(("topo", "available", "n", "expect"), [c[1:] for c in TAKE_CASES],
                         ids=[c[0] for c in TAKE_CASES])
def test_take_by_topology_numa_packed(topo: str, available: str, n: int, expect: str) -> None:
    assert cm.take_by_topology(TOPOS[topo], cpus(available), n) == cpus(expect)


def test_take_more_cpus_than_are_available() -> None:
    with pytest.raises(cm.NotEnoughCpusError, match="not enough cpus available to satisfy request"):
        cm.take_by_topology(SINGLE_SOCKET_HT, {0, 2, 4, 6}, 5)


@given(st.sampled_from(sorted(TOPOS)), st.data())
def test_take_gives_exactly_n_available_cpus(name: str, data: st.DataObject) -> None:
    topo = TOPOS[name]
    available = data.draw(st.sets(st.sampled_from(sorted(topo.cpus))))
    n = data.draw(st.integers(0, len(available)))
    got = cm.take_by_topology(topo, available, n)
    assert len(got) == n and got <= available


def test_allocate_takes_the_affine_numa_node_first_then_spills() -> None:
    topo = DUAL_SOCKET_MULTI_NUMA_PER_SOCKET_HT
    assert cm.allocate(topo, range(80), 4, numa_affinity=[2]) == cpus("20,21,60,61")
    # NUMA node 3 has 4 CPUs left: those first, the other 2 by the packing rule from the rest.
    got = cm.allocate(topo, cpus("0-9,40-49,38,39,78,79"), 6, numa_affinity=[3])
    assert cpus("38,39,78,79") <= got and len(got) == 6
    with pytest.raises(cm.NotEnoughCpusError):
        cm.allocate(topo, {1, 2}, 3)


def test_pools_keep_reserved_cpus_shared_but_never_exclusive() -> None:
    allocatable, reserved = range(8), {0, 4}
    exclusive = [{1, 5}]
    assert cm.shared_pool(allocatable, exclusive) == {0, 2, 3, 4, 6, 7}
    assert cm.assignable(allocatable, reserved, exclusive) == {2, 3, 6, 7}


def test_split_gives_each_container_whole_cores() -> None:
    shares = cm.split(SINGLE_SOCKET_HT, range(8), {"a": 2, "b": 4, "c": 2})
    assert shares == {"a": cpus("0,4"), "b": cpus("1,2,5,6"), "c": cpus("3,7")}


# ---- who gets exclusive CPUs -----------------------------------------------------------------------
def pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": f"c{i}", "resources": r} for i, r in enumerate(containers)]}
    if init:
        spec["initContainers"] = [{"name": f"i{i}", "resources": r} for i, r in enumerate(init)]
    return {"spec": spec}


def res(cpu: str | None = None, mem: str | None = "1Gi", req_cpu: str | None = None,
        req_mem: str | None = None) -> dict[str, Any]:
    limits = {k: v for k, v in (("cpu", cpu), ("memory", mem)) if v is not None}
    requests = {k: v for k, v in (("cpu", req_cpu), ("memory", req_mem)) if v is not None}
    out: dict[str, Any] = {"limits": limits}
    if requests:
        out["requests"] = requests
    return out


@pytest.mark.parametrize(("the_pod", "qos", "exclusive"), [
    (pod(res("2")), cm.GUARANTEED, {"c0": 2}),
    (pod(res("2", req_cpu="2", req_mem="1Gi")), cm.GUARANTEED, {"c0": 2}),
    (pod(res("1500m")), cm.GUARANTEED, {}),  # not a whole number of CPUs: shared pool
    (pod(res("2"), res("500m")), cm.GUARANTEED, {"c0": 2}),
    (pod(res("2", req_cpu="1")), cm.BURSTABLE, {}),
    (pod(res("2", mem=None)), cm.BURSTABLE, {}),  # no memory limit
    (pod(res("2"), res(None, None)), cm.BURSTABLE, {}),  # one container without limits
    (pod(res(None, None)), cm.BEST_EFFORT, {}),
    (pod(res("2"), init=(res("1"),)), cm.GUARANTEED, {"c0": 2}),
    (pod(res("2"), init=(res(None, None, req_cpu="1"),)), cm.BURSTABLE, {}),
    (pod(res("4000m")), cm.GUARANTEED, {"c0": 4}),
])
def test_static_policy_pins_integer_cpus_of_guaranteed_pods(the_pod: dict[str, Any], qos: str,
                                                             exclusive: dict[str, int]) -> None:
    assert cm.qos_class(the_pod) == qos
    assert cm.exclusive_cpus(the_pod) == exclusive


@pytest.mark.parametrize("bad", [
    {"spec": []}, {"spec": {"containers": {}}}, {"spec": {"containers": [3]}},
    {"spec": {"containers": [{"name": "a", "resources": {"limits": {"cpu": "lots", "memory": "1Gi"}}}]}},
    {"spec": {"containers": [{"resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}]}},
    {"spec": {"containers": [{"name": "a", "resources": {"limits": {"cpu": "-1", "memory": "1Gi"}}}]}},
])
def test_a_pod_of_the_wrong_shape_is_a_typed_error(bad: dict[str, Any]) -> None:
    with pytest.raises(cm.PodSpecError):
        cm.exclusive_cpus(bad)


# ---- the node model --------------------------------------------------------------------------------
def _memtopo(nodes: dict[int, tuple[str, list[int]]], allowed: str = "") -> pb.MemoryTopology:
    topo = pb.MemoryTopology(allowed_cpus=sorted(cpus(allowed)))
    for nid, (cpu_text, pkgs) in nodes.items():
        topo.numa_nodes.add(id=nid, cpus=sorted(cpus(cpu_text)), packages=pkgs, has_cpu=bool(cpu_text))
    return topo


def test_model_from_topology_and_sysfs(tmp_path: Any) -> None:
    for cpu in range(8):
        d = tmp_path / f"sys/devices/system/cpu/cpu{cpu}/topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{cpu // 4}\n")
        first = cpu // 2 * 2  # two threads a core: 0-1, 2-3, 4-5, 6-7
        (d / "thread_siblings_list").write_text(f"{first}-{first + 1}\n")
    (tmp_path / "sys/devices/system/cpu/cpu7/topology/thread_siblings_list").write_text("garbage")
    topo = _memtopo({0: ("0-3", [0]), 1: ("4-7", [1]), 2: ("", [])})
    places = read_cpu_places(HostFS.at(tmp_path), range(8))
    assert places.core == {0: 0, 1: 0, 2: 2, 3: 2, 4: 4, 5: 4, 6: 6} and 7 not in places.core
    assert places.problems and "cpu7" in places.problems[0]
    model = CpuTopology.from_topology(topo, places)
    assert model.places[5] == CpuPlace(4, 1, 1) and model.places[7] == CpuPlace(7, 1, 1)
    assert model.assumed.startswith("1 CPUs taken as cores of their own")
    assert model.ids("numa") == (0, 1) and model.cpus_in("core", 2) == {2, 3}


def test_model_without_sysfs_is_a_core_per_cpu_within_allowed_cpus() -> None:
    model = CpuTopology.from_topology(_memtopo({0: ("0-3", [0]), 1: ("4-7", [0, 1])}, allowed="1-6"))
    assert sorted(model.cpus) == [1, 2, 3, 4, 5, 6]
    assert model.places[2] == CpuPlace(2, 0, 0)
    assert model.places[5].socket not in (0, 1)  # a node spanning packages gets one made up for it
    assert "no sysfs CPU topology" in model.assumed
