"""k8s/admission.py: what the kubelet admits, judged from a node's NodeResourceTopology.

Two kinds of tables. The first ports every case of scheduler-plugins' ``filter_test.go``
(``TestNodeResourceTopology``, ``TestNodeResourceTopologyMultiContainerPodScope``,
``TestNodeResourceTopologyMultiContainerContainerScope``), each row named as upstream names it and asserting
upstream's outcome (and which unit failed: the pod, a container or an init container), unless the row
says why the kubelet decides otherwise. The second holds the kubelet's rules scheduler-plugins' filter
does not follow (fractional CPUs of Guaranteed pods, the CPU and memory manager policies, ``restricted``,
``best-effort``, ``none``, zero device requests, sidecars, allocation failures), each with the kubelet
source of the rule and what upstream's filter would say. No kubelet runs here: the node is its NRT
object, as the scheduler sees it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.k8s.admission import (
    BEST_EFFORT,
    BURSTABLE,
    GUARANTEED,
    TOPOLOGY_AFFINITY_ERROR,
    TOPOLOGY_TOO_WIDE,
    UNEXPECTED_ADMISSION_ERROR,
    PodError,
    Verdict,
    admit,
    parse_pod,
)
from memtopo.k8s.nrt_read import NodeTopology, read_nrt
from tests.nrt_upstream import (
    CPU,
    HUGEPAGES_2MI,
    MEMORY,
    NIC,
    container,
    nrt,
    res_info,
    zone,
)
from tests.nrt_upstream_cases import (
    CNT_T,
    FILTER_NODES,
    FILTER_ROWS,
    NRT_T,
    POD_T,
    UNIT_PREFIX,
    Row,
)
from tests.strategies import json_like

# ---- filter_test.go: TestNodeResourceTopology ------------------------------------------------------















def test_the_port_counts_every_upstream_case() -> None:
    per_test = {t: sum(r.test == t for r in FILTER_ROWS) for t in (NRT_T, POD_T, CNT_T)}
    assert per_test == {NRT_T: 49, POD_T: 5, CNT_T: 17}
    assert len({r.name for r in FILTER_ROWS if r.test != CNT_T}) == 54
    # Every case agrees with the kubelet's rules as mirrored: none had to be judged differently.
    assert [r.name for r in FILTER_ROWS if r.kubelet is not None] == []


@pytest.mark.parametrize("row", FILTER_ROWS, ids=[f"{r.test}: {r.name}" for r in FILTER_ROWS])
def test_filter_cases_of_scheduler_plugins(row: Row) -> None:
    verdict = admit(read_nrt(FILTER_NODES[row.node]), parse_pod(row.pod))
    expected = row.upstream if row.kubelet is None else row.kubelet
    assert verdict.admit == (expected == ""), verdict
    if not verdict.admit:
        assert verdict.reason in (TOPOLOGY_AFFINITY_ERROR, UNEXPECTED_ADMISSION_ERROR)
        assert verdict.message.startswith(UNIT_PREFIX[expected]), verdict.message


def test_an_admitted_single_numa_pod_gets_one_zone_and_claims_only_there() -> None:
    verdict = admit(read_nrt(FILTER_NODES["host0 (pod scope)"]), parse_pod(FILTER_ROWS[49].pod))
    assert verdict.admit and verdict.alignments[0].choice == (1,) and verdict.alignments[0].accepted == ((1,),)
    assert verdict.claimed() == {1: {CPU: 32, MEMORY: 42 << 30, HUGEPAGES_2MI: 512 << 20, NIC: 26}}


def test_the_container_scope_takes_each_app_container_from_its_zone_in_turn() -> None:
    row = next(r for r in FILTER_ROWS if r.name.startswith("[4][tier1]"))
    verdict = admit(read_nrt(FILTER_NODES[row.node]), parse_pod(row.pod))
    # 500Mi of huge pages fit only node-1 (512Mi); the second container's 50Mi then only node-0.
    assert [a.choice for a in verdict.alignments] == [(1,), (0,)]
    assert verdict.claimed()[1][NIC] == 16 and verdict.claimed()[0][NIC] == 8


# ---- the kubelet's rules scheduler-plugins' filter does not follow ----------------------------------

def _node(policy: str, scope: str, zones: list[dict[str, Any]], **attrs: str) -> NodeTopology:
    obj = nrt("n", zones)
    obj["attributes"] = [{"name": "topologyManagerPolicy", "value": policy},
                         {"name": "topologyManagerScope", "value": scope}] + [
        {"name": f"memtopo.io/{k.replace('_', '-')}", "value": v} for k, v in attrs.items()]
    return read_nrt(obj)


def _two(cpu: tuple[str, str, str, str] = ("8", "8", "8", "8"), gpu: tuple[str, str] = ("1", "1"),
         memory: str = "16Gi") -> list[dict[str, Any]]:
    """Two zones: CPU capacity and available per zone, GPUs available per zone (capacity 1 each)."""
    return [zone("node-0", res_info(CPU, cpu[0], cpu[1]), res_info(MEMORY, memory, memory),
                 res_info("nvidia.com/gpu", "1", gpu[0])),
            zone("node-1", res_info(CPU, cpu[2], cpu[3]), res_info(MEMORY, memory, memory),
                 res_info("nvidia.com/gpu", "1", gpu[1]))]


def _gu(*containers: dict[str, str], init: tuple[dict[str, str], ...] = (), sidecar: bool = False) -> dict[str, Any]:
    pod: dict[str, Any] = {"spec": {"containers": [container(f"app-{i}", r, r) for i, r in enumerate(containers)]}}
    if init:
        pod["spec"]["initContainers"] = [
            {**container(f"init-{i}", r, r), **({"restartPolicy": "Always"} if sidecar else {})}
            for i, r in enumerate(init)]
    return pod


@dataclass(frozen=True)
class Rule:
    """A case of a kubelet rule: the expected verdict (``reason`` "" = admitted, ``choice`` the placement
    the kubelet picks), the source of the rule, and what scheduler-plugins' filter says instead."""

    name: str
    node: NodeTopology
    pod: dict[str, Any]
    reason: str
    choice: tuple[int, ...] | None
    source: str
    scheduler_plugins: str


GPU = "nvidia.com/gpu"
RULES = [
    Rule("a Guaranteed pod with a fractional CPU request runs in the shared pool: no CPU hint",
         _node("single-numa-node", "container", _two(cpu=("8", "1", "8", "1"))),
         _gu({CPU: "1500m", MEMORY: "1Gi"}), "", (0,), "cpumanager/policy_static.go guaranteedCPUs",
         "rejects: no zone has 1.5 CPUs available"),
    Rule("an integral CPU request of a Guaranteed pod must fit one zone under single-numa-node",
         _node("single-numa-node", "container", _two(cpu=("8", "1", "8", "1"))),
         _gu({CPU: "2", MEMORY: "1Gi"}), TOPOLOGY_AFFINITY_ERROR, None, "policy_single_numa_node.go",
         "rejects too"),
    Rule("the none CPU manager gives no CPU hint",
         _node("single-numa-node", "container", _two(cpu=("8", "1", "8", "1")), cpu_manager_policy="none"),
         _gu({CPU: "2", MEMORY: "1Gi"}), "", (0,), "cpumanager/cpu_manager.go (policy none has no hints)",
         "rejects: it assumes the static CPU manager"),
    Rule("the None memory manager gives no memory hint",
         _node("single-numa-node", "container", _two(memory="4Gi"), memory_manager_policy="None"),
         _gu({CPU: "2", MEMORY: "6Gi"}), "", (0,), "memorymanager/policy_none.go",
         "rejects: no zone has 6Gi available"),
    Rule("restricted rejects when the resources' preferred placements do not meet",
         _node("restricted", "pod", _two(gpu=("1", "0"))), _gu({CPU: "12", MEMORY: "1Gi", GPU: "1"}),
         TOPOLOGY_AFFINITY_ERROR, None, "topologymanager/policy.go mergePermutation (equal affinities)",
         "passes: the filter judges single-numa-node only"),
    Rule("restricted admits a request that needs two zones when every resource prefers both",
         _node("restricted", "pod", _two()), _gu({CPU: "12", MEMORY: "20Gi"}), "", (0, 1),
         "topologymanager/policy_restricted.go", "passes"),
    Rule("restricted rejects when only a wider placement than the narrowest possible is free",
         _node("restricted", "pod", _two(cpu=("8", "2", "8", "2"))), _gu({CPU: "4", MEMORY: "1Gi"}),
         TOPOLOGY_AFFINITY_ERROR, None, "cpumanager/policy_static.go generateCPUTopologyHints (minAffinitySize)",
         "passes"),
    Rule("best-effort admits the same pod on both zones",
         _node("best-effort", "pod", _two(cpu=("8", "2", "8", "2"))), _gu({CPU: "4", MEMORY: "1Gi"}), "", (0, 1),
         "topologymanager/policy_best_effort.go", "passes"),
    Rule("best-effort still fails when the node lacks the CPUs for the exclusive allocation",
         _node("best-effort", "pod", _two(cpu=("8", "2", "8", "1"))), _gu({CPU: "4", MEMORY: "1Gi"}),
         UNEXPECTED_ADMISSION_ERROR, None, "cpumanager/policy_static.go allocateCPUs", "passes"),
    Rule("none aligns nothing but devices must still be there to allocate",
         _node("none", "container", _two(gpu=("0", "0"))), _gu({CPU: "1", MEMORY: "1Gi", GPU: "1"}),
         UNEXPECTED_ADMISSION_ERROR, None, "devicemanager/manager.go devicesToAllocate", "passes"),
    Rule("none admits what fits the node",
         _node("none", "container", _two(gpu=("0", "1"))), _gu({CPU: "1", MEMORY: "1Gi", GPU: "1"}), "", None,
         "topologymanager/policy_none.go", "passes"),
    Rule("a zero device request prefers every single zone, so it does not meet a two-zone CPU request",
         _node("restricted", "pod", _two()), _gu({CPU: "12", MEMORY: "1Gi", GPU: "0"}),
         TOPOLOGY_AFFINITY_ERROR, None, "devicemanager/topology_hints.go generateDeviceTopologyHints",
         "passes (and ignores zero requests)"),
    Rule("memory no combination of zones holds gives no hint and then fails to allocate",
         _node("single-numa-node", "pod", _two(memory="4Gi")), _gu({CPU: "1", MEMORY: "9Gi"}),
         UNEXPECTED_ADMISSION_ERROR, None, "memorymanager/policy_static.go calculateHints, getDefaultHint",
         "rejects (cannot align pod)"),
    Rule("pod scope: the largest init container counts when it exceeds the app containers",
         _node("single-numa-node", "pod", _two()), _gu({CPU: "2", MEMORY: "1Gi"}, init=({CPU: "10", MEMORY: "1Gi"},)),
         TOPOLOGY_AFFINITY_ERROR, None, "cpumanager/policy_static.go podGuaranteedCPUs", "rejects too"),
    Rule("pod scope: a sidecar's CPUs add to the app containers'",
         _node("single-numa-node", "pod", _two()), _gu({CPU: "6", MEMORY: "1Gi"}, init=({CPU: "3", MEMORY: "1Gi"},),
                                                       sidecar=True),
         TOPOLOGY_AFFINITY_ERROR, None, "cpumanager/policy_static.go podGuaranteedCPUs (restartable init containers)",
         "passes: it takes the larger of 3 and 6"),
    Rule("container scope: a sidecar keeps its CPUs, so the app container after it finds fewer",
         _node("single-numa-node", "container", _two(cpu=("8", "8", "8", "4"))),
         _gu({CPU: "8", MEMORY: "1Gi"}, init=({CPU: "4", MEMORY: "1Gi"},), sidecar=True),
         TOPOLOGY_AFFINITY_ERROR, None, "cpumanager/policy_static.go updateCPUsToReuse (sidecars are not reused)",
         "passes: it judges init containers alone"),
    Rule("a memory request that is not a whole number of bytes fails the memory manager",
         _node("single-numa-node", "container", _two()), _gu({CPU: "1", MEMORY: "1500m"}),
         UNEXPECTED_ADMISSION_ERROR, None, "memorymanager/policy_static.go getRequestedResources (AsInt64)",
         "passes"),
    Rule("a CPU-less zone never carries a CPU hint but can hold memory for restricted",
         _node("restricted", "pod", [zone("node-0", res_info(CPU, "8", "8"), res_info(MEMORY, "4Gi", "4Gi")),
                                     zone("node-1", res_info(MEMORY, "8Gi", "8Gi"))]),
         _gu({CPU: "2", MEMORY: "6Gi"}), TOPOLOGY_AFFINITY_ERROR, None,
         "cpumanager/policy_static.go (masks of CPU NUMA nodes only), memorymanager calculateHints",
         "passes"),
]


def test_the_rules_name_their_source_and_upstream() -> None:
    assert all(r.source and r.scheduler_plugins for r in RULES) and len({r.name for r in RULES}) == len(RULES)


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_kubelet_rules(rule: Rule) -> None:
    verdict = admit(rule.node, parse_pod(rule.pod))
    assert (verdict.admit, verdict.reason) == (rule.reason == "", rule.reason), verdict
    if verdict.admit:
        assert [a.choice for a in verdict.alignments if a.hinted] in ([rule.choice], []), verdict


def test_restricted_message_says_which_placements_do_not_meet() -> None:
    verdict = admit(RULES[4].node, parse_pod(RULES[4].pod))
    assert "cpu 12 aligns on {node-0,node-1}" in verdict.message
    assert "nvidia.com/gpu 1 aligns on {node-0}" in verdict.message


def test_best_effort_reports_its_unaligned_pick() -> None:
    verdict = admit(RULES[7].node, parse_pod(RULES[7].pod))
    (alignment,) = verdict.alignments
    assert alignment.accepted == () and alignment.choice == (0, 1) and not alignment.aligned


def test_reserved_amounts_lower_what_is_available() -> None:
    node = _node("single-numa-node", "pod", _two())
    pod = parse_pod(_gu({CPU: "6", MEMORY: "1Gi"}))
    first = admit(node, pod)
    assert first.admit and first.alignments[0].choice == (0,) and first.claimed() == {0: {CPU: 6, MEMORY: 1 << 30}}
    second = admit(node, pod, first.claimed())
    assert second.admit and second.alignments[0].choice == (1,)
    both = {z: {**first.claimed().get(z, {}), **second.claimed().get(z, {})} for z in (0, 1)}
    third = admit(node, pod, both)
    assert not third.admit and third.reason == TOPOLOGY_AFFINITY_ERROR
    assert "cpu 6 is more than the node's NUMA zones have free (cpu 4)" in third.message


def test_best_effort_on_more_zones_than_it_merges_reports_no_pick() -> None:
    zones = [zone(f"node-{i}", res_info(CPU, "4", "1"), res_info(MEMORY, "4Gi", "4Gi")) for i in range(10)]
    verdict = admit(_node("best-effort", "pod", zones), parse_pod(_gu({CPU: "3", MEMORY: "1Gi"})))
    assert verdict.admit and verdict.alignments[0].choice is None and not verdict.alignments[0].aligned


def test_restricted_on_too_many_zones_says_so_rather_than_guessing() -> None:
    zones = [zone(f"node-{i}", res_info(CPU, "4", "4"), res_info(MEMORY, "1Gi", "1Gi"),
                  res_info(HUGEPAGES_2MI, "2Mi", "2Mi")) for i in range(20)]
    pod = parse_pod(_gu({CPU: "2", MEMORY: "1Gi", HUGEPAGES_2MI: "40Mi"}))
    verdict = admit(_node("restricted", "pod", zones), pod)
    assert (verdict.admit, verdict.reason) == (False, TOPOLOGY_TOO_WIDE)
    assert admit(_node("single-numa-node", "pod", zones), pod).reason == TOPOLOGY_AFFINITY_ERROR


# ---- QoS and the pod reader ----------------------------------------------------------------------------

@pytest.mark.parametrize(("containers", "status", "qos"), [
    ([({}, {})], None, BEST_EFFORT),
    ([({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": "1"})], None, BEST_EFFORT),
    ([({CPU: "1", MEMORY: "1Gi"}, {CPU: "1", MEMORY: "1Gi"})], None, GUARANTEED),
    ([(None, {CPU: "1", MEMORY: "1Gi"})], None, GUARANTEED),  # requests default to limits
    ([({CPU: "1"}, {CPU: "1"})], None, BURSTABLE),
    ([({CPU: "1", MEMORY: "1Gi"}, {CPU: "2", MEMORY: "1Gi"})], None, BURSTABLE),
    ([({CPU: "1", MEMORY: "1Gi"}, {CPU: "1", MEMORY: "1Gi"}), ({}, {})], None, BURSTABLE),
    # ComputePodQOS compares sums: requests 1+2 and limits 2+1 make a Guaranteed pod.
    ([({CPU: "1", MEMORY: "1Gi"}, {CPU: "2", MEMORY: "1Gi"}), ({CPU: "2", MEMORY: "1Gi"}, {CPU: "1", MEMORY: "1Gi"})],
     None, GUARANTEED),
    ([({CPU: "1", MEMORY: "1Gi"}, {CPU: "1", MEMORY: "1Gi"})], BURSTABLE, BURSTABLE),  # status.qosClass wins
])
def test_qos_class(containers: list[tuple[dict[str, str] | None, dict[str, str]]], status: str | None,
                   qos: str) -> None:
    pod: dict[str, Any] = {"spec": {"containers": [container(f"c{i}", r, lim)
                                                   for i, (r, lim) in enumerate(containers)]}}
    if status:
        pod["status"] = {"qosClass": status}
    assert parse_pod(pod).qos == qos


@pytest.mark.parametrize(("pod", "field"), [
    ([], "pod: not an object"),
    ({"spec": []}, "spec: not an object"),
    ({"spec": {"containers": {}}}, "spec.containers: not a list"),
    ({"spec": {"containers": [{"resources": {"requests": {CPU: "lots"}}}]}}, "requests[cpu]: 'lots'"),
    ({"spec": {"containers": [{"resources": {"limits": {CPU: "-1"}}}]}}, "limits[cpu]: '-1' is negative"),
    ({"spec": {"containers": [{"resources": {"limits": {MEMORY: "1e30"}}}]}}, "out of range"),
    ({"spec": {"containers": [{"resources": {"limits": {MEMORY: 1.5}}}]}}, "is not a quantity"),
    ({"spec": {"containers": [{}] * 300}}, "300 containers"),
    ({"spec": {"containers": [{"name": 5}]}}, "not a container name"),
    ({"spec": {"initContainers": [{"restartPolicy": 1}]}}, "restartPolicy: not a string"),
    ({"spec": {}, "status": {"qosClass": "Gold"}}, "'Gold' is not a QoS class"),
    ({"metadata": {"name": "p\x1b[2J", "namespace": "ns"}, "spec": {"containers": 1}}, "pod ns/p\\x1b[2J:"),
])
def test_a_pod_that_cannot_be_read_is_a_typed_error_naming_the_field(pod: object, field: str) -> None:
    with pytest.raises(PodError) as info:
        parse_pod(pod)
    assert field in str(info.value) and "\x1b" not in str(info.value)


# ---- properties ---------------------------------------------------------------------------------------

POD_KEYS = st.sampled_from(["spec", "containers", "initContainers", "resources", "requests", "limits", "name",
                            "restartPolicy", "status", "qosClass", "overhead", CPU, MEMORY, GPU, HUGEPAGES_2MI])
QUANTITIES = st.sampled_from(["0", "1", "2", "3", "7", "500m", "1500m", "1Gi", "3Gi", "64Mi", "1.5", "lots", "-1",
                              "1e30", "Always", "Guaranteed"])


def _assert_single_numa_claims(node: NodeTopology, verdict: Verdict) -> None:
    """Under single-numa-node an admitted unit's exclusive amounts all come from its one chosen zone,
    which had them free."""
    free = {(z.numa_id, r.name): r.available for z in node.zones for r in z.resources}
    taken: dict[tuple[int, str], Fraction] = {}
    chosen = {a.choice for a in verdict.alignments if a.hinted and a.choice is not None}
    assert all(len(choice) == 1 for choice in chosen)
    for zone_id, name, amount in verdict.claims:
        taken[zone_id, name] = taken.get((zone_id, name), Fraction(0)) + amount
        assert (zone_id,) in chosen
    assert all(amount <= free[key] for key, amount in taken.items())


@settings(max_examples=300)
@given(json_like(QUANTITIES | st.integers(-3, 70) | st.none() | st.booleans(), POD_KEYS, max_leaves=30))
def test_any_pod_json_is_a_verdict_or_a_typed_error(doc: object) -> None:
    node = read_nrt(FILTER_NODES["node2"])
    try:
        pod = parse_pod(doc)
    except PodError:
        return
    verdict = admit(node, pod)
    assert verdict.admit or verdict.reason


_AMOUNTS = st.sampled_from(["0", "1", "2", "3", "4", "6", "9", "500m", "2500m"])
_BYTES = st.sampled_from(["0", "1Gi", "2Gi", "5Gi", "64Mi", "200Mi"])
_CONTAINER = st.fixed_dictionaries({}, optional={CPU: _AMOUNTS, MEMORY: _BYTES, HUGEPAGES_2MI: _BYTES,
                                                 NIC: _AMOUNTS, GPU: _AMOUNTS})


@settings(max_examples=400)
@given(node=st.sampled_from(["node1", "node2", "node3", "host0 (pod scope)", "host0 (container scope)"]),
       app=st.lists(_CONTAINER, min_size=1, max_size=3), init=st.lists(_CONTAINER, max_size=2),
       burstable=st.booleans(), sidecar=st.booleans())
def test_a_single_numa_node_admission_means_one_zone_holds_every_aligned_resource(
        node: str, app: list[dict[str, str]], init: list[dict[str, str]], burstable: bool, sidecar: bool) -> None:
    pod = _gu(*app, init=tuple(init), sidecar=sidecar)
    if burstable:
        pod["spec"]["containers"][0]["resources"]["limits"] = {}
    topology = read_nrt(FILTER_NODES[node])
    verdict = admit(topology, parse_pod(pod))
    if verdict.admit:
        _assert_single_numa_claims(topology, verdict)
    else:
        assert verdict.reason in (TOPOLOGY_AFFINITY_ERROR, UNEXPECTED_ADMISSION_ERROR) and verdict.message


def test_admission_is_independent_of_the_order_zones_are_listed_in() -> None:
    for row in FILTER_ROWS:
        obj = FILTER_NODES[row.node]
        flipped = {**obj, "zones": list(reversed(obj["zones"]))}
        a, b = admit(read_nrt(obj), parse_pod(row.pod)), admit(read_nrt(flipped), parse_pod(row.pod))
        assert (a.admit, a.reason, a.alignments) == (b.admit, b.reason, b.alignments)
        assert sorted(a.claims) == sorted(b.claims)


def test_every_two_zone_split_agrees_with_brute_force_single_numa() -> None:
    """Exhaustively over small nodes: a Guaranteed pod is admitted under single-numa-node pod scope
    exactly when one zone has every one of its resources free (all of them are aligned here)."""
    pod = parse_pod(_gu({CPU: "3", MEMORY: "2Gi", GPU: "1"}))
    for cpu0, cpu1, gpu0, gpu1 in itertools.product(range(5), range(5), range(2), range(2)):
        zones = [zone("node-0", res_info(CPU, "4", str(cpu0)), res_info(MEMORY, "4Gi", "4Gi"),
                      res_info(GPU, "1", str(gpu0))),
                 zone("node-1", res_info(CPU, "4", str(cpu1)), res_info(MEMORY, "1Gi", "1Gi"),
                      res_info(GPU, "1", str(gpu1)))]
        verdict = admit(_node("single-numa-node", "pod", zones), pod)
        assert verdict.admit == (cpu0 >= 3 and gpu0 >= 1), (cpu0, cpu1, gpu0, gpu1)


_POLICIES = st.sampled_from(["none", "best-effort", "restricted", "single-numa-node"])


@st.composite
def _small_nodes(draw: st.DrawFn) -> dict[str, Any]:
    """Generated nodes of 1 to 4 zones: CPUs (some zones CPU-less), memory, huge pages, GPUs, with
    capacity, allocatable and available drawn so that available <= allocatable <= capacity."""
    zones = []
    for i in range(draw(st.integers(1, 4))):
        resources = []
        for name, unit, present in ((CPU, "", draw(st.booleans()) or i == 0), (MEMORY, "Gi", True),
                                    (HUGEPAGES_2MI, "Mi", draw(st.booleans())), (GPU, "", draw(st.booleans()))):
            if present:
                cap = draw(st.integers(0, 8))
                alloc = draw(st.integers(0, cap))
                avail = draw(st.integers(0, alloc))
                resources.append({"name": name, "capacity": f"{cap}{unit}", "allocatable": f"{alloc}{unit}",
                                  "available": f"{avail}{unit}"})
        zones.append({"name": f"node-{i}", "type": "Node", "resources": resources})
    obj = nrt("gen", zones)
    obj["attributes"] = [{"name": "topologyManagerPolicy", "value": draw(_POLICIES)},
                         {"name": "topologyManagerScope", "value": draw(st.sampled_from(["pod", "container"]))},
                         {"name": "memtopo.io/cpu-manager-policy", "value": draw(st.sampled_from(["none", "static"]))},
                         {"name": "memtopo.io/memory-manager-policy",
                          "value": draw(st.sampled_from(["None", "Static"]))}]
    return obj


_SMALL = st.fixed_dictionaries({}, optional={CPU: st.sampled_from(["1", "2", "3", "5", "1500m"]),
                                             MEMORY: st.sampled_from(["1Gi", "3Gi", "6Gi"]),
                                             HUGEPAGES_2MI: st.sampled_from(["2Mi", "6Mi"]),
                                             GPU: st.sampled_from(["0", "1", "2"])})


@settings(max_examples=400)
@given(obj=_small_nodes(), app=st.lists(_SMALL, min_size=1, max_size=2), init=st.lists(_SMALL, max_size=1),
       sidecar=st.booleans())
def test_any_generated_node_gives_a_consistent_verdict(obj: dict[str, Any], app: list[dict[str, str]],
                                                       init: list[dict[str, str]], sidecar: bool) -> None:
    node = read_nrt(obj)
    verdict = admit(node, parse_pod(_gu(*app, init=tuple(init), sidecar=sidecar)))
    free = {(z.numa_id, r.name): r.available for z in node.zones for r in z.resources}
    taken: dict[tuple[int, str], int] = {}
    for zone_id, name, amount in verdict.claims:
        taken[zone_id, name] = taken.get((zone_id, name), 0) + amount
    assert all(amount <= free[key] for key, amount in taken.items())
    if not verdict.admit:
        assert verdict.reason in (TOPOLOGY_AFFINITY_ERROR, UNEXPECTED_ADMISSION_ERROR) and verdict.message
        assert node.policy != "none" or verdict.reason == UNEXPECTED_ADMISSION_ERROR
        return
    for a in verdict.alignments:
        if node.policy in ("restricted", "single-numa-node") and a.hinted:
            assert a.aligned and a.choice in a.accepted
        if node.policy == "single-numa-node" and a.choice is not None:
            assert len(a.choice) == 1


@settings(max_examples=300)
@given(obj=_small_nodes(), app=st.lists(_SMALL, min_size=1, max_size=2), data=st.data())
def test_more_available_never_turns_a_pod_scope_admission_into_a_rejection(
        obj: dict[str, Any], app: list[dict[str, str]], data: st.DataObject) -> None:
    obj["attributes"][1]["value"] = "pod"
    pod = parse_pod(_gu(*app))
    before = admit(read_nrt(obj), pod)
    zone_index = data.draw(st.integers(0, len(obj["zones"]) - 1))
    resources = obj["zones"][zone_index]["resources"]
    if not resources:
        return
    res = resources[data.draw(st.integers(0, len(resources) - 1))]
    unit = "Gi" if res["name"] == MEMORY else "Mi" if res["name"] == HUGEPAGES_2MI else ""
    if res["available"] == res["allocatable"]:
        return
    res["available"] = f"{int(res['available'].removesuffix(unit)) + 1}{unit}"
    after = admit(read_nrt(obj), pod)
    assert not (before.admit and not after.admit), (before, after)
