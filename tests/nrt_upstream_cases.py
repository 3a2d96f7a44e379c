"""scheduler-plugins' own tables as data: every case of ``filter_test.go`` (``TestNodeResourceTopology``
and the multi-container pod and container scope tests) and of ``score_test.go`` (the score plugin, its
LeastNUMA variant and partial data), shared by the tests of ``k8s.admission``/``k8s.scoring`` and those
of the extender's verbs, which run the same cases through kube-scheduler's JSON."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memtopo.k8s.scoring import (
    Strategy,
)
from tests.nrt_upstream import (
    CPU,
    EXTENDED,
    GPU,
    HUGEPAGES_2MI,
    MEMORY,
    NIC,
    NIC_NO_NUMA,
    NOT_EXISTING_NIC,
    nrt,
    pod_by_resource_list,
    pod_multi,
    pod_with_many_containers,
    pod_with_requests,
    pod_with_requests_and_limits,
    res_info,
    zone,
)

# ---- filter_test.go ----

ALIGN_POD, ALIGN_CNT, ALIGN_INIT = "cannot align pod", "cannot align container", "cannot align init container"

FILTER_NODES: dict[str, dict[str, Any]] = {
    "node1": nrt("node1", [
        zone("node-0", res_info(CPU, "20", "4"), res_info(MEMORY, "8Gi", "8Gi"), res_info(NIC, "30", "10")),
        zone("node-1", res_info(CPU, "30", "8"), res_info(MEMORY, "8Gi", "8Gi"), res_info(NIC, "30", "10")),
    ], "SingleNUMANodeContainerLevel"),
    "node2": nrt("node2", [
        zone("node-0", res_info(CPU, "20", "2"), res_info(MEMORY, "8Gi", "4Gi"),
             res_info(HUGEPAGES_2MI, "128Mi", "128Mi"), res_info(NIC, "30", "5")),
        zone("node-1", res_info(CPU, "30", "4"), res_info(MEMORY, "8Gi", "4Gi"),
             res_info(HUGEPAGES_2MI, "128Mi", "128Mi"), res_info(NIC, "30", "2")),
    ], "SingleNUMANodeContainerLevel"),
    "node3": nrt("node3", [
        zone("node-0", res_info(CPU, "20", "2"), res_info(MEMORY, "8Gi", "4Gi"), res_info(NIC, "30", "5")),
        zone("node-1", res_info(CPU, "30", "4"), res_info(MEMORY, "8Gi", "4Gi"), res_info(NIC, "30", "2")),
    ], "SingleNUMANodePodLevel"),
    "badly_formed_node": nrt("badly_formed_node", [
        zone("node-0", res_info(CPU, "20", "2"), res_info(MEMORY, "8Gi", "4Gi"), res_info(NIC, "30", "5")),
        zone("node-75", res_info(CPU, "30", "4"), res_info(MEMORY, "8Gi", "4Gi"), res_info(NIC, "30", "2")),
    ], "SingleNUMANodePodLevel"),
    "extended": nrt("extended", [
        zone("node-0", res_info(CPU, "20", "4"), res_info(MEMORY, "8Gi", "8Gi"), res_info(NIC, "30", "10")),
        zone("node-1", res_info(CPU, "30", "8"), res_info(MEMORY, "8Gi", "8Gi"), res_info(NIC, "30", "10")),
    ], "SingleNUMANodeContainerLevel"),
}


# The multi-container tests' node, single-numa-node with the scope each test sets.
HOST0_ZONES = [
    zone("node-0", res_info(CPU, "32", "30"), res_info(MEMORY, "64Gi", "60Gi"),
         res_info(HUGEPAGES_2MI, "384Mi", "384Mi"), res_info(NIC, "16", "16")),
    zone("node-1", res_info(CPU, "32", "32"), res_info(MEMORY, "64Gi", "64Gi"),
         res_info(HUGEPAGES_2MI, "512Mi", "512Mi"), res_info(NIC, "32", "32")),
]


FILTER_NODES["host0 (pod scope)"] = nrt("host0", HOST0_ZONES, "SingleNUMANodePodLevel")


FILTER_NODES["host0 (container scope)"] = nrt("host0", HOST0_ZONES, "SingleNUMANodeContainerLevel")


@dataclass(frozen=True)
class Row:
    """One upstream case. ``upstream``: "" when its filter passes the pod, else its status message
    (``cannot align pod``/``container``/``init container``). ``kubelet``: set only where the kubelet
    decides otherwise, with ``why``."""

    test: str
    name: str
    pod: dict[str, Any]
    node: str
    upstream: str = ""
    kubelet: str | None = None
    why: str = ""


def _q(cpu: str, memory: str, **more: str) -> dict[str, str]:
    return {CPU: cpu, MEMORY: memory, **{k.replace("_", "/"): v for k, v in more.items()}}


NRT_T = "TestNodeResourceTopology"


POD_T = "TestNodeResourceTopologyMultiContainerPodScope"


CNT_T = "TestNodeResourceTopologyMultiContainerContainerScope"


FILTER_ROWS: list[Row] = [
    Row(NRT_T, "Guaranteed QoS, pod with extended resource fit",
        pod_by_resource_list({CPU: "2", MEMORY: "2Gi", EXTENDED: "1", NIC: "3"}), "extended"),
    Row(NRT_T, "Guaranteed QoS, pod with extended resource no devices; pod fit",
        pod_by_resource_list({CPU: "2", MEMORY: "2Gi", EXTENDED: "1"}), "extended"),
    Row(NRT_T, "Best effort QoS, pod fit", {}, "node1"),
    Row(NRT_T, "Best effort QoS requesting devices, Pod Scope Topology policy; pod fit",
        pod_by_resource_list({NIC: "5"}), "node3"),
    Row(NRT_T, "Best effort QoS requesting devices, Pod Scope Topology policy; pod doesn't fit",
        pod_by_resource_list({NIC: "20"}), "node3", ALIGN_POD),
    Row(NRT_T, "Best effort QoS requesting devices, Container Scope Topology policy; pod fit",
        pod_by_resource_list({NIC: "5"}), "node2"),
    Row(NRT_T, "Best effort QoS requesting devices, Container Scope Topology policy; pod doesn't fit",
        pod_by_resource_list({NIC: "20"}), "node1", ALIGN_CNT),
    Row(NRT_T, "Best effort QoS requesting devices and extended resources, Container Scope Topology policy; "
        "pod doesn't fit", pod_by_resource_list({EXTENDED: "1", NIC: "10"}), "extended"),
    Row(NRT_T, "Best effort QoS, requesting CPU, memory (enough on NUMA) and devices (not enough), Container Scope "
        "Topology policy; pod doesn't fit",
        pod_with_requests_and_limits({CPU: "3", MEMORY: "3Gi", NIC: "11"}, {CPU: "4", MEMORY: "4Gi", NIC: "11"}),
        "node2", ALIGN_CNT),
    Row(NRT_T, "Best effort QoS, requesting CPU, memory (enough on NUMA) and devices (not enough), Pod Scope "
        "Topology policy; pod doesn't fit",
        pod_with_requests_and_limits({CPU: "1", MEMORY: "1Gi", NIC: "6"}, {CPU: "2", MEMORY: "2Gi", NIC: "6"}),
        "node3", ALIGN_POD),
    Row(NRT_T, "Best effort QoS requesting CPU, memory (enough on NUMA) and devices, Pod Scope Topology policy; "
        "pod fit",
        pod_with_requests_and_limits({CPU: "1", MEMORY: "1Gi", NIC: "5"}, {CPU: "2", MEMORY: "2Gi", NIC: "5"}),
        "node3"),
    Row(NRT_T, "Best effort QoS requesting CPU, memory (not enough on NUMA) and devices, Pod Scope Topology "
        "policy; pod fit",
        pod_with_requests_and_limits({CPU: "19", MEMORY: "5Gi", NIC: "5"}, {CPU: "20", MEMORY: "6Gi", NIC: "5"}),
        "node3"),
    Row(NRT_T, "Best effort QoS requesting CPU, memory (enough on NUMA) and devices, Container Scope Topology "
        "policy; pod fit",
        pod_with_requests_and_limits({CPU: "3", MEMORY: "3Gi", NIC: "5"}, {CPU: "4", MEMORY: "4Gi", NIC: "5"}),
        "node2"),
    Row(NRT_T, "Best effort QoS requesting CPU, memory (not enough on NUMA) and devices, Container Scope Topology "
        "policy; pod fit",
        pod_with_requests_and_limits({CPU: "5", MEMORY: "5Gi", NIC: "5"}, {CPU: "6", MEMORY: "6Gi", NIC: "5"}),
        "node2"),
    Row(NRT_T, "Guaranteed QoS, minimal, pod fit", pod_by_resource_list({CPU: "2", MEMORY: "2Gi"}), "node1"),
    # findAvailableResourceByName(node1's node-1): cpu 8, memory 8Gi.
    Row(NRT_T, "Guaranteed QoS, minimal, saturating zone, pod fit",
        pod_by_resource_list({CPU: "8", MEMORY: "8Gi"}), "node1"),
    Row(NRT_T, "Guaranteed QoS, zero quantity of unavailable resource, pod fit",
        pod_by_resource_list({CPU: "2", MEMORY: "2Gi", HUGEPAGES_2MI: "0", NIC: "3"}), "node1"),
    Row(NRT_T, "Guaranteed QoS, pod fit", pod_by_resource_list({CPU: "2", MEMORY: "2Gi", NIC: "3"}), "node2"),
    Row(NRT_T, "Guaranteed QoS, hugepages, pod fit",
        pod_by_resource_list({CPU: "2", MEMORY: "2Gi", HUGEPAGES_2MI: "64Mi", NIC: "3"}), "node2"),
    Row(NRT_T, "Burstable QoS, pod fit", pod_by_resource_list({CPU: "4", NIC: "3"}), "node2"),
    Row(NRT_T, "Burstable QoS, requesting CPU and devices (not enough), Container Scope Topology policy; "
        "pod doesn't fit", pod_by_resource_list({CPU: "4", NIC: "11"}), "node2", ALIGN_CNT),
    Row(NRT_T, "Burstable QoS, requesting CPU and devices (not enough), Pod Scope Topology policy; pod doesn't fit",
        pod_by_resource_list({CPU: "2", NIC: "6"}), "node3", ALIGN_POD),
    Row(NRT_T, "Burstable QoS requesting CPU (enough on NUMA) and devices, Pod Scope Topology policy; pod fit",
        pod_by_resource_list({CPU: "2", NIC: "5"}), "node3"),
    Row(NRT_T, "BurstableQoS requesting CPU (not enough on NUMA) and devices, Pod Scope Topology policy; pod fit",
        pod_by_resource_list({CPU: "20", NIC: "5"}), "node3"),
    Row(NRT_T, "Burstable QoS requesting CPU (enough on NUMA) and devices, Container Scope Topology policy; "
        "pod fit", pod_by_resource_list({CPU: "2", NIC: "5"}), "node2"),
    Row(NRT_T, "Burstable QoS requesting CPU (not enough on NUMA) and devices, Container Scope Topology policy; "
        "pod fit", pod_by_resource_list({CPU: "4", NIC: "5"}), "node2"),
    Row(NRT_T, "Burstable QoS, requesting memory (enough on NUMA) and devices (not enough), Container Scope "
        "Topology policy; pod doesn't fit", pod_by_resource_list({MEMORY: "2Gi", NIC: "11"}), "node2", ALIGN_CNT),
    Row(NRT_T, "Burstable QoS, requesting memory (enough on NUMA) and devices (not enough), Pod Scope Topology "
        "policy; pod doesn't fit", pod_by_resource_list({MEMORY: "2Gi", NIC: "6"}), "node3", ALIGN_POD),
    Row(NRT_T, "Burstable QoS requesting memory (enough on NUMA) and devices, Pod Scope Topology policy; pod fit",
        pod_by_resource_list({MEMORY: "2Gi", NIC: "5"}), "node3"),
    Row(NRT_T, "Burstable QoS requesting memory (not enough on NUMA) and devices, Pod Scope Topology policy; "
        "pod fit", pod_by_resource_list({MEMORY: "5Gi", NIC: "5"}), "node3"),
    Row(NRT_T, "Burstable QoS requesting memory (enough on NUMA) and devices, Container Scope Topology policy; "
        "pod fit", pod_by_resource_list({MEMORY: "4Gi", NIC: "5"}), "node2"),
    Row(NRT_T, "Burstable QoS requesting memory (not enough on NUMA) and devices, Container Scope Topology policy; "
        "pod fit", pod_by_resource_list({MEMORY: "5Gi", NIC: "5"}), "node2"),
    Row(NRT_T, "Burstable QoS, requesting CPU, memory (enough on NUMA) and devices (not enough), Container Scope "
        "Topology policy; pod doesn't fit", pod_with_requests({CPU: "4", MEMORY: "4Gi", NIC: "11"}), "node2",
        ALIGN_CNT),
    Row(NRT_T, "Burstable QoS, requesting CPU, memory (enough on NUMA) and devices (not enough), Pod Scope "
        "Topology policy; pod doesn't fit", pod_with_requests({CPU: "2", MEMORY: "2Gi", NIC: "6"}), "node3",
        ALIGN_POD),
    Row(NRT_T, "Burstable QoS requesting CPU, memory (enough on NUMA) and devices, Pod Scope Topology policy; "
        "pod fit", pod_with_requests({CPU: "2", MEMORY: "2Gi", NIC: "5"}), "node3"),
    Row(NRT_T, "Burstable QoS requesting CPU, memory (not enough on NUMA) and devices, Pod Scope Topology policy; "
        "pod fit", pod_with_requests({CPU: "20", MEMORY: "5Gi", NIC: "5"}), "node3"),
    Row(NRT_T, "Burstable QoS requesting CPU, memory (enough on NUMA) and devices, Container Scope Topology "
        "policy; pod fit", pod_with_requests({CPU: "4", MEMORY: "4Gi", NIC: "5"}), "node2"),
    Row(NRT_T, "Burstable QoS requesting CPU, memory (not enough on NUMA) and devices, Container Scope Topology "
        "policy; pod fit", pod_with_requests({CPU: "5", MEMORY: "5Gi", NIC: "5"}), "node2"),
    Row(NRT_T, "Burstable QoS with extended resources, pod fit",
        pod_by_resource_list({EXTENDED: "1", CPU: "4", NIC: "3"}), "extended"),
    Row(NRT_T, "Guaranteed QoS, hugepages, pod doesn't fit",
        pod_by_resource_list({CPU: "2", MEMORY: "2Gi", HUGEPAGES_2MI: "256Mi", NIC: "3"}), "node2", ALIGN_CNT),
    Row(NRT_T, "Guaranteed QoS, pod doesn't fit", pod_by_resource_list({CPU: "9", MEMORY: "1Gi", NIC: "3"}),
        "node1", ALIGN_CNT),
    # Upstream names this case like an earlier one; the suffix keeps the test ids apart.
    Row(NRT_T, "Guaranteed QoS, pod fit (2)", pod_by_resource_list({CPU: "2", MEMORY: "1Gi", NOT_EXISTING_NIC: "0"}),
        "node1"),
    Row(NRT_T, "Guaranteed QoS Topology Scope, pod doesn't fit",
        pod_with_many_containers({CPU: "3", MEMORY: "1Gi", NOT_EXISTING_NIC: "0"}, 3), "node3", ALIGN_POD),
    Row(NRT_T, "Guaranteed QoS Topology Scope, minimal, pod fit", pod_by_resource_list({CPU: "1", MEMORY: "1Gi"}),
        "node3"),
    # findAvailableResourceByName(badly_formed_node's node-0): cpu 2, memory 4Gi.
    Row(NRT_T, "Guaranteed QoS TopologyScope, minimal, saturating zone, pod fit",
        pod_by_resource_list({CPU: "2", MEMORY: "4Gi"}), "badly_formed_node"),
    Row(NRT_T, "Guaranteed QoS Topology Scope, pod fit",
        pod_with_many_containers({CPU: "1", MEMORY: "1Gi", NOT_EXISTING_NIC: "0"}, 3), "node3"),
    Row(NRT_T, "Guaranteed QoS Topology Scope, invalid node",
        pod_with_many_containers({CPU: "1", MEMORY: "1Gi", NOT_EXISTING_NIC: "0"}, 3), "badly_formed_node",
        ALIGN_POD),
    Row(NRT_T, "Guaranteed QoS, hugepages, non-NUMA affine NIC, pod fit",
        pod_by_resource_list({CPU: "2", MEMORY: "2Gi", HUGEPAGES_2MI: "64Mi", NIC_NO_NUMA: "3"}), "node2"),
    Row(NRT_T, "Guaranteed QoS, ephemeral-storage (non-NUMA), pod fit",
        pod_by_resource_list({CPU: "2", MEMORY: "2Gi", "ephemeral-storage": "100Mi"}), "node2"),
    # ---- TestNodeResourceTopologyMultiContainerPodScope
    Row(POD_T, "gu pod fits only on a numa node", pod_multi([
        _q("2", "2Gi"), _q("4", "8Gi"), {CPU: "26", MEMORY: "32Gi", HUGEPAGES_2MI: "512Mi", NIC: "26"}]),
        "host0 (pod scope)"),
    Row(POD_T, "gu pod does not fit - not enough CPUs available on any NUMA node", pod_multi([
        _q("2", "2Gi"), _q("8", "8Gi"), {CPU: "26", MEMORY: "26Gi", HUGEPAGES_2MI: "52Mi", NIC: "26"}]),
        "host0 (pod scope)", ALIGN_POD),
    Row(POD_T, "gu pod does not fit - not enough memory available on any NUMA node", pod_multi([
        _q("2", "4Gi"), _q("4", "16Gi"), {CPU: "26", MEMORY: "52Gi", HUGEPAGES_2MI: "52Mi", NIC: "26"}]),
        "host0 (pod scope)", ALIGN_POD),
    Row(POD_T, "gu pod does not fit - not enough Hugepages available on any NUMA node", pod_multi([
        _q("2", "2Gi"), _q("4", "8Gi"), {CPU: "26", MEMORY: "32Gi", HUGEPAGES_2MI: "3328Mi", NIC: "26"}]),
        "host0 (pod scope)", ALIGN_POD),
    Row(POD_T, "gu pod does not fit - not enough devices available on any NUMA node", pod_multi([
        _q("2", "2Gi"), _q("4", "8Gi"), {CPU: "26", MEMORY: "26Gi", HUGEPAGES_2MI: "52Mi", NIC: "52"}]),
        "host0 (pod scope)", ALIGN_POD),
]


def _cnt(name: str, app: list[dict[str, str]], init: list[dict[str, str]] | None = None, status: str = "") -> Row:
    return Row(CNT_T, name, pod_multi(app, init or []), "host0 (container scope)", status)


FILTER_ROWS += [
    _cnt("[1][tier3] single container with good allocation - fit", [_q("2", "4G")]),
    _cnt("[2][tier3] single container with cpu over allocation - fit", [_q("40", "4G")], status=ALIGN_CNT),
    _cnt("[2][tier3] single container with memory over allocation - fit", [_q("2", "100G")], status=ALIGN_CNT),
    _cnt("[2][tier3] single container with cpu and memory over allocation - fit", [_q("40", "100G")],
         status=ALIGN_CNT),
    _cnt("[4][tier2] multi-containers with good allocation, spread across NUMAs - fit",
         [_q("20", "40G"), _q("20", "40G")]),
    _cnt("[4][tier1] multi containers with good devices and hugepages allocation, spread across NUMAs - fit",
         [{CPU: "2", MEMORY: "6G", HUGEPAGES_2MI: "500Mi", NIC: "16"},
          {CPU: "2", MEMORY: "6G", HUGEPAGES_2MI: "50Mi", NIC: "8"}]),
    _cnt("[7][tier1] init container with cpu over allocation, multi-containers with good allocation - not fit",
         [_q("1", "4G"), _q("1", "4G")], [_q("40", "40G")], ALIGN_INIT),
    _cnt("[7][tier1] init container with memory over allocation, multi-containers with good allocation - not fit",
         [_q("1", "4G"), _q("1", "4G")], [_q("4", "70G")], ALIGN_INIT),
    _cnt("[11][tier1] init container with good allocation, multi-containers spread across NUMAs - fit",
         [_q("20", "40G"), _q("20", "40G")], [_q("4", "10G")]),
    _cnt("[17][tier1] multi init containers with good allocation, multi-containers spread across NUMAs - fit",
         [_q("20", "40G"), _q("20", "40G"), _q("6", "10G")], [_q("4", "10G")] * 3),
    _cnt("[24][tier1] multi init containers with good allocation, multi-containers with over cpu allocation - "
         "not fit", [_q("20", "40G"), _q("20", "40G"), _q("20", "6G")], [_q("30", "10G")] * 2, ALIGN_CNT),
    _cnt("[27][tier1] multi init containers with good allocation, container with cpu over allocation - not fit",
         [_q("35", "40G")], [_q("30", "10G")] * 2, ALIGN_CNT),
    _cnt("[28][tier1] multi init containers with good allocation, multi-containers with good allocation - fit",
         [_q("20", "40G"), _q("20", "40G")], [_q("30", "10G")] * 2),
    _cnt("[29][tier1] multi init containers when sum of their cpus requests (together) is over allocatable, "
         "multi-containers with good allocation - fit",
         [_q("20", "40G"), _q("20", "40G"), _q("2", "6G")], [_q("30", "10G")] * 3),
    _cnt("[29][tier1] multi init containers when sum of their memory requests (together) is over allocatable, "
         "multi-containers with good allocation - fit",
         [_q("20", "40G"), _q("20", "40G"), _q("2", "6G")], [_q("3", "50G")] * 3),
    _cnt("[32][tier1] multi init containers with over cpu allocation - not fit",
         [_q("20", "40G"), _q("2", "6G")], [_q("40", "50G"), _q("3", "50G"), _q("3", "50G")], ALIGN_INIT),
    _cnt("[32][tier1] multi init containers with over memory allocation - not fit",
         [_q("20", "40G"), _q("2", "6G")], [_q("20", "50G"), _q("40", "50G"), _q("3", "50G")], ALIGN_INIT),
]


# Which of the verdict's messages names the unit upstream's status names.
UNIT_PREFIX = {ALIGN_POD: "pod:", ALIGN_CNT: "container ", ALIGN_INIT: "init container "}


# ---- score_test.go ----

def default_numa_nodes(policy: str) -> dict[str, dict[str, Any]]:
    """``defaultNUMANodes(withPolicy(policy))``."""
    def node(name: str, cpu: str, memory: str) -> dict[str, Any]:
        return nrt(name, [zone("node-0", res_info(CPU, cpu, cpu), res_info(MEMORY, memory, memory)),
                          zone("node-1", res_info(CPU, cpu, cpu), res_info(MEMORY, memory, memory))], policy)
    return {"Node1": node("Node1", "4", "500Mi"), "Node2": node("Node2", "2", "50Mi"),
            "Node3": node("Node3", "6", "60Mi")}


def four_numa_nodes() -> dict[str, dict[str, Any]]:
    """``fourNUMANodes()``: two nodes of four zones, GPUs on zones 0,1 (Node1) or 0,2 (Node2)."""
    costs = [{"node-0": 10, "node-1": 12, "node-2": 20, "node-3": 20}, {"node-0": 12, "node-1": 10, "node-2": 20,
                                                                         "node-3": 20},
             {"node-0": 20, "node-1": 20, "node-2": 10, "node-3": 12}, {"node-0": 20, "node-1": 20, "node-2": 12,
                                                                         "node-3": 10}]

    def node(name: str, gpus: Sequence[str]) -> dict[str, Any]:
        return nrt(name, [zone(f"node-{i}", res_info(CPU, "2", "2"), res_info(MEMORY, "50Mi", "50Mi"),
                               res_info(GPU, gpus[i], gpus[i]), costs=costs[i]) for i in range(4)],
                   "BestEffortContainerLevel")
    return {"Node1": node("Node1", "1100"), "Node2": node("Node2", "1010")}


# 20*1024*1024 as resource.NewQuantity(…, DecimalSI) writes it.
POD1 = pod_by_resource_list({CPU: "2", MEMORY: str(20 * 1024 * 1024)})


SCORE_PLUGIN = [
    ("MostAllocated strategy", Strategy.MOST_ALLOCATED, ("Node2", 70)),
    ("BalancedAllocation strategy", Strategy.BALANCED_ALLOCATION, ("Node3", 100)),
    ("LeastAllocated strategy", Strategy.LEAST_ALLOCATED, ("Node1", 73)),
]


def _lists(*pairs: tuple[str, str] | tuple[str, str, str]) -> list[dict[str, str]]:
    return [{CPU: p[0], MEMORY: p[1], **({GPU: p[2]} if len(p) == 3 else {})} for p in pairs]


NON_NUMA = "non-numa-resource"


SCORE_PLUGIN_LEAST_NUMA = [
    ("container scope, one container case 1", _lists(("2", "50Mi")), {"Node1": 94, "Node2": 94, "Node3": 94},
     "BestEffortContainerLevel"),
    ("container scope, one container case 2", _lists(("4", "50Mi")), {"Node1": 94, "Node2": 82, "Node3": 94},
     "BestEffortContainerLevel"),
    ("container scope, one container case 3", _lists(("6", "50Mi")), {"Node1": 82, "Node2": 0, "Node3": 94},
     "BestEffortContainerLevel"),
    ("container scope, two containers case 1", _lists(("2", "50Mi"), ("2", "50Mi")),
     {"Node1": 94, "Node2": 94, "Node3": 94}, "BestEffortContainerLevel"),
    ("container scope, two containers case 2", _lists(("1", "50Mi"), ("3", "50Mi")),
     {"Node1": 94, "Node2": 82, "Node3": 94}, "BestEffortContainerLevel"),
    ("container scope, two containers case 3", _lists(("5", "50Mi"), ("3", "50Mi")),
     {"Node1": 82, "Node2": 0, "Node3": 94}, "BestEffortContainerLevel"),
    ("container scope, two containers non NUMA resource", [{NON_NUMA: "1"}, {NON_NUMA: "2"}],
     {"Node1": 100, "Node2": 100, "Node3": 100}, "BestEffortContainerLevel"),
    ("pod scope, two containers case 1", _lists(("2", "50Mi"), ("2", "50Mi")),
     {"Node1": 94, "Node2": 82, "Node3": 82}, "BestEffortPodLevel"),
    ("pod scope, two containers case 2", _lists(("1", "50Mi"), ("3", "50Mi")),
     {"Node1": 94, "Node2": 82, "Node3": 82}, "BestEffortPodLevel"),
    ("pod scope, two containers case 3", _lists(("5", "50Mi"), ("3", "50Mi")),
     {"Node1": 82, "Node2": 0, "Node3": 82}, "BestEffortPodLevel"),
    ("pod scope, one containers non NUMA resource", [{NON_NUMA: "1"}], {"Node1": 100, "Node2": 100, "Node3": 100},
     "BestEffortPodLevel"),
    ("container scope, one container, 4 NUMA nodes, 1 gpu ", _lists(("2", "50Mi", "1")), {"Node1": 94, "Node2": 94},
     "four"),
    ("container scope, one container, 4 NUMA nodes, 2 gpu ", _lists(("2", "50Mi", "2")), {"Node1": 82, "Node2": 76},
     "four"),
    ("container scope, 2 containers, 4 NUMA nodes, 2 gpu in one container ",
     _lists(("2", "50Mi", "2"), ("2", "50Mi")), {"Node1": 82, "Node2": 76}, "four"),
]


def _only(name: str) -> Callable[[str, dict[str, Any]], dict[str, Any] | None]:
    return lambda node, obj: obj if node == name else None


PARTIAL_DATA = [
    # Upstream asserts only that scoring succeeds here; every node then scores 0, as asserted.
    ("No data at all, MostAllocated strategy", Strategy.MOST_ALLOCATED, _only(""), None),
    ("No data at all, LeastAllocated strategy", Strategy.LEAST_ALLOCATED, _only(""), None),
    ("No data at all, BalancedAllocation strategy", Strategy.BALANCED_ALLOCATION, _only(""), None),
    ("One node with NRT data, MostAllocated strategy", Strategy.MOST_ALLOCATED, _only("Node1"), ("Node1", 27)),
    ("One node with NRT data, LeastAllocated strategy", Strategy.LEAST_ALLOCATED, _only("Node1"), ("Node1", 73)),
    ("One node with NRT data, BalancedAllocation strategy", Strategy.BALANCED_ALLOCATION, _only("Node1"),
     ("Node1", 89)),
]


