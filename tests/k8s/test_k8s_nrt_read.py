"""k8s/nrt_read.py: a NodeResourceTopology object, from memtopo's publisher or another, as a compact read
model, or one typed error naming the object and the field.

Ported tables: noderesourcetopology-api's ``numanode_test.go`` (``TestNameToID``: which zone names are NUMA
zones) and scheduler-plugins' ``nodeconfig/topologymanager_test.go`` (``TestConfigFromNRT``: the deprecated
``topologyPolicies`` field and the attributes that win over it). The other objects are memtopo's own
(built from synthesized hosts by ``k8s/nrt.py``) and one written as NFD's topology-updater writes them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.k8s import nrt_read
from memtopo.k8s.facts import KubeletFacts
from memtopo.k8s.nrt import build_nrt
from memtopo.k8s.nrt_read import MAX_ZONES, NodeTopology, NrtReadError, ZoneResource, read_nrt, zone_id
from memtopo.k8s.quantity import parse
from tests.fixtures import extracted
from tests.nrt_upstream import nrt, res_info, zone
from tests.strategies import json_like

SYNTH = Path(__file__).parents[1] / "fixtures"


# ---- numanode_test.go: TestNameToID ------------------------------------------------------------------

@pytest.mark.parametrize(("name", "cell", "expected"), [
    ("zero", "node-0", 0),
    ("positive", "node-7", 7),
    ("excessive", "node-65535", 65535),
    ("negative", "node--1", None),
    ("wrong node id", "cell-1", None),
    ("case node id (1)", "Node-1", None),
    ("case node id (2)", "NODE-2", None),
    ("case node id (3)", "node_3", None),
    ("case node id (4)", "node 4", None),
    ("case node id (5)", "node-5-1", None),
    ("case node id (6)", "node6", None),
    ("case node id (7)", "--node-7", None),
])
def test_name_to_id(name: str, cell: str, expected: int | None) -> None:
    assert zone_id(cell) == expected


def test_zone_names_follow_go_atoi() -> None:
    assert (zone_id("node-07"), zone_id("node-+3"), zone_id("node-"), zone_id("node-9" * 30)) == (7, 3, None, None)
    assert zone_id("node-٣") is None  # strconv.Atoi reads ASCII digits only


# ---- nodeconfig/topologymanager_test.go: TestConfigFromNRT ------------------------------------------

def _attrs(**kv: str) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in kv.items()]


@pytest.mark.parametrize(("name", "policies", "attributes", "expected"), [
    ("nil", None, None, ("none", "container", 8)),
    ("policies-single", ["BestEffortPodLevel"], None, ("best-effort", "pod", 8)),
    ("policies-ignore-after-first", ["RestrictedContainerLevel", "BestEffortPodLevel"], None,
     ("restricted", "container", 8)),
    ("attributes-partial-policy-only", None, _attrs(topologyManagerPolicy="restricted"),
     ("restricted", "container", 8)),
    ("attributes-overrides-policy-partial", ["BestEffortPodLevel"], _attrs(topologyManagerScope="container"),
     ("best-effort", "container", 8)),
    ("attributes-overrides-policy-full", ["BestEffortPodLevel"],
     _attrs(topologyManagerScope="container", topologyManagerPolicy="restricted"), ("restricted", "container", 8)),
])
def test_config_from_nrt(name: str, policies: list[str] | None, attributes: list[dict[str, str]] | None,
                         expected: tuple[str, str, int]) -> None:
    obj = nrt("n", [])
    if policies is not None:
        obj["topologyPolicies"] = policies
    if attributes is not None:
        obj["attributes"] = attributes
    node = read_nrt(obj)
    assert (node.policy, node.scope, node.max_numa_nodes) == expected


@pytest.mark.parametrize(("value", "expected"), [("16", 16), ("65535", 1024), ("A", 8), ("0", 8), ("-2", 8)])
def test_max_numa_nodes_as_upstream_reads_it(value: str, expected: int) -> None:
    obj = nrt("n", [])
    obj["attributes"] = _attrs(topologyManagerMaxNUMANodes=value)
    assert read_nrt(obj).max_numa_nodes == expected


# ---- memtopo's objects, and another publisher's --------------------------------------------------------

def _memtopo_object(host: str, kubelet: KubeletFacts) -> dict[str, Any]:
    topo = discover(ProbeContext.at_root(extracted(SYNTH / host / "root.tar.gz")))
    return build_nrt(topo, f"{host}-1", kubelet=kubelet)


KUBELET = KubeletFacts(config_path="/var/lib/kubelet/config.yaml", topology_manager_policy="restricted",
                       topology_manager_scope="pod", cpu_manager_policy="static", memory_manager_policy="Static")


@pytest.mark.parametrize("host", ["gh200", "mi300x-8gpu-cpx-nps4"])
def test_memtopo_objects_read_back_whole(host: str) -> None:
    obj = _memtopo_object(host, KUBELET)
    node = read_nrt(json.loads(json.dumps(obj)))
    assert (node.name, node.policy, node.scope) == (f"{host}-1", "restricted", "pod")
    assert (node.cpu_manager_policy, node.memory_manager_policy) == ("static", "Static")
    assert [z.name for z in node.zones] == [z["name"] for z in obj["zones"]]
    for model, raw in zip(node.zones, obj["zones"], strict=True):
        assert model.numa_id == int(raw["name"].removeprefix("node-"))
        assert model.resources == tuple(
            ZoneResource(r["name"], *(int(parse(r[k])) for k in ("capacity", "allocatable", "available")))
            for r in raw["resources"])
        assert {(f"node-{i}", v) for i, v in zip(model.cost_ids, model.cost_values, strict=True)} == {
            (c["name"], c["value"]) for c in raw.get("costs", [])}
        attrs = {a["name"]: a["value"] for a in raw["attributes"]}
        assert model.memory is not None and model.memory.memory_type == attrs.get("memtopo.io/memory-type")
        assert model.memory.cpuless == (attrs["memtopo.io/cpuless"] == "true")


def test_gh200_gpu_memory_zone_is_read_as_cpuless_unified() -> None:
    node = read_nrt(_memtopo_object("gh200", KUBELET))
    gpu_zone = next(z for z in node.zones if z.memory is not None and z.memory.cpuless)
    assert gpu_zone.memory is not None and gpu_zone.memory.memory_type == "UNIFIED"
    assert gpu_zone.resource("cpu") is None and gpu_zone.resource("memory") is not None


def test_without_kubelet_config_memtopo_says_nothing_and_the_defaults_apply() -> None:
    node = read_nrt(_memtopo_object("gh200", KubeletFacts()))
    assert (node.policy, node.scope, node.cpu_manager_policy, node.memory_manager_policy) == (
        "none", "container", "none", "None")


# As NFD's topology-updater (pkg/nrt-api, pkg/resourcemonitor) writes one: its attributes, no memtopo ones.
NFD: dict[str, Any] = {
    "apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
    "metadata": {"name": "worker-3", "ownerReferences": [{"kind": "Node", "name": "worker-3"}]},
    "topologyPolicies": ["SingleNUMANodeContainerLevel"],
    "attributes": [{"name": "topologyManagerPolicy", "value": "single-numa-node"},
                   {"name": "topologyManagerScope", "value": "pod"},
                   {"name": "nodeTopologyPodsFingerprint", "value": "pfp0v0019d3fd0d7c3a7a1b2"}],
    "zones": [
        {"name": "node-0", "type": "Node", "costs": [{"name": "node-0", "value": 10}, {"name": "node-1", "value": 21}],
         "resources": [{"name": "cpu", "capacity": "32", "allocatable": "30", "available": "22"},
                       {"name": "memory", "capacity": "134850809856", "allocatable": "133777068032",
                        "available": "129482100736"},
                       {"name": "hugepages-1Gi", "capacity": "8Gi", "allocatable": "8Gi", "available": "6Gi"},
                       {"name": "example.com/netdevice", "capacity": "4", "allocatable": "4", "available": "3"}]},
        {"name": "node-1", "type": "Node", "costs": [{"name": "node-0", "value": 21}, {"name": "node-1", "value": 10}],
         "resources": [{"name": "cpu", "capacity": 32, "allocatable": 32, "available": 32},
                       {"name": "memory", "capacity": "125Gi", "allocatable": "125Gi", "available": "125Gi"}]},
        {"name": "socket-0", "type": "Socket"},
    ],
}


def test_another_publisher_is_read_with_the_managers_assumed_static() -> None:
    node = read_nrt(NFD)
    assert (node.policy, node.scope) == ("single-numa-node", "pod")  # the attributes win over the old field
    assert (node.cpu_manager_policy, node.memory_manager_policy) == ("static", "Static")
    assert node.pods_fingerprint == "pfp0v0019d3fd0d7c3a7a1b2"
    assert [z.numa_id for z in node.zones] == [0, 1]  # the Socket zone is not a NUMA zone
    assert node.zones[0].resource("example.com/netdevice") == ZoneResource("example.com/netdevice", 4, 4, 3)
    assert node.zones[1].resource("cpu") == ZoneResource("cpu", 32, 32, 32)
    assert node.zones[0].cost(1) == 21 and node.zones[0].cost(5) is None and node.zones[0].memory is None


def test_zones_beyond_the_kubelets_mask_are_kept_but_not_aligned() -> None:
    node = read_nrt(nrt("n", [zone("node-75", res_info("cpu", "2", "2")), zone("node-1", res_info("cpu", "2", "2"))]))
    assert [z.numa_id for z in node.zones] == [75, 1] and [z.numa_id for z in node.alignable_zones()] == [1]


def test_alike_objects_share_their_parts() -> None:
    a, b = read_nrt(NFD), read_nrt(copy.deepcopy(NFD))
    assert a.zones[0] is b.zones[0] and a.zones[1].cost_values is b.zones[1].cost_values


def test_the_table_of_shared_parts_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nrt_read, "_SHARED_MAX", 50)
    monkeypatch.setattr(nrt_read, "_SHARED", {})
    for i in range(200):
        read_nrt(nrt("n", [zone("node-0", res_info("cpu", "300", str(i)))]))
        assert len(nrt_read._SHARED) <= 50


# ---- what cannot be read -------------------------------------------------------------------------------

def _edit(path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(NFD)
    *parents, last = path.split("/")
    target: Any = obj
    for p in parents:
        target = target[int(p)] if isinstance(target, list) else target[p]
    if value is _DROP:
        del target[int(last) if isinstance(target, list) else last]
    elif isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return obj


_DROP = object()
ZONE0 = "zones/0"
CPU0 = "zones/0/resources/0"


@pytest.mark.parametrize(("path", "value", "says"), [
    ("metadata", _DROP, "NodeResourceTopology (unnamed): metadata.name: missing"),
    ("metadata/name", "", "metadata.name: empty"),
    ("zones", _DROP, "zones: missing"),
    ("zones", {}, "zones: not a list"),
    (f"{ZONE0}/type", _DROP, "zones[0].type: missing"),
    (f"{ZONE0}/name", "socket-0", "zones[0].name: 'socket-0' is not a NUMA zone name"),
    (f"{ZONE0}/name", "Node-1", "is not a NUMA zone name"),
    (f"{ZONE0}/name", "node-1024", "NUMA id 1024 is beyond 1023"),
    (f"{ZONE0}/name", "node-01", "zones[1].name: NUMA id 1 is also zones[0]"),
    (f"{CPU0}/capacity", _DROP, "zones[0].resources[0].capacity: missing"),
    (f"{CPU0}/allocatable", "1.5", "zones[0].resources[0].allocatable: '1.5' is not a whole number"),
    (f"{CPU0}/available", "lots", "zones[0].resources[0].available: 'lots' is not a quantity"),
    (f"{CPU0}/available", "-1", "'-1' is negative"),
    (f"{CPU0}/available", "1e30", "'1e30' is out of range"),
    (f"{CPU0}/available", 2.0, "is not a quantity"),
    (f"{CPU0}/name", "memory", "zones[0].resources[1].name: 'memory' is listed twice"),
    (f"{CPU0}/name", 7, "zones[0].resources[0].name: not a string"),
    (f"{ZONE0}/costs/1/value", "21", "zones[0].costs[1].value: \"'21'\" is not a distance"),
    (f"{ZONE0}/costs/1/value", True, "is not a distance"),
    ("attributes/0/value", "SingleNUMA", "attributes: topologyManagerPolicy: 'SingleNUMA' is not one of"),
    ("attributes/1/value", "Pod", "topologyManagerScope: 'Pod' is not one of container, pod"),
    ("attributes/1", {"name": "memtopo.io/cpu-manager-policy", "value": "Static"}, "'Static' is not one of none"),
    ("attributes/1", {"name": "memtopo.io/memory-manager-policy", "value": "static"}, "is not one of None, Static"),
    ("attributes/0/value", None, "attributes[0].value: missing"),
    ("topologyPolicies", ["foobar"], "topologyPolicies[0]: 'foobar' is not a topology manager policy"),
    ("topologyPolicies", "SingleNUMANodePodLevel", "topologyPolicies: not a list"),
    (f"{ZONE0}/attributes", [{"name": "memtopo.io/memory-tier", "value": "-1"}], "is not a non-negative integer"),
    (f"{ZONE0}/attributes", [{"name": "memtopo.io/cpuless", "value": "yes"}], "'yes' is not true or false"),
    ("metadata/name", "n\x1b[31m" + "x" * 5000, "NodeResourceTopology 'n\\x1b[31mxxx"),
])
def test_what_cannot_be_read_is_one_typed_error_naming_object_and_field(path: str, value: Any, says: str) -> None:
    obj = _edit(path, value)
    if path == "metadata/name" and isinstance(value, str) and value:
        obj["zones"] = {}  # a long, hostile name, then a broken field: the message quotes the name safely
    with pytest.raises(NrtReadError) as info:
        read_nrt(obj)
    message = str(info.value)
    assert says in message and "\x1b" not in message and len(message) < 300, message
    if not path.startswith("metadata"):
        assert message.startswith("NodeResourceTopology 'worker-3': ")


def test_ten_thousand_zones_are_refused_without_reading_them() -> None:
    # Past the bound the entries are not even objects: the refusal comes before any of them is read.
    obj = {"metadata": {"name": "big"}, "zones": [zone("node-0")] + [None] * 9_999}
    with pytest.raises(NrtReadError, match=f"zones: 10000 entries, more than the {MAX_ZONES} memtopo reads"):
        read_nrt(obj)
    wide = {"metadata": {"name": "wide"}, "zones": [
        zone("node-0", *[res_info(f"example.com/r{i}", "1", "1") for i in range(300)])]}
    with pytest.raises(NrtReadError, match="resources: 300 entries"):
        read_nrt(wide)


def test_other_attributes_are_not_looked_at() -> None:
    obj = copy.deepcopy(NFD)
    obj["attributes"] += [{"name": "vendor.example/notes", "value": "x" * 100_000}, "garbage", {"value": 1}]
    assert read_nrt(obj).policy == "single-numa-node"


# ---- any JSON ---------------------------------------------------------------------------------------------

NRT_KEYS = st.sampled_from(["metadata", "name", "zones", "type", "resources", "capacity", "allocatable",
                            "available", "costs", "value", "attributes", "topologyPolicies", "Node"])
SCALARS = st.sampled_from(["Node", "node-0", "node-1", "node-75", "socket-0", "cpu", "memory", "4", "1.5", "lots",
                           "-1", "1e30", "8Gi", "single-numa-node", "pod", "topologyManagerPolicy",
                           "SingleNUMANodePodLevel", "memtopo.io/memory-tier"]) | st.integers(-2, 300) | st.none()


@settings(max_examples=300)
@given(json_like(SCALARS, NRT_KEYS, max_leaves=40))
def test_any_json_is_a_model_or_a_typed_error(doc: object) -> None:
    try:
        node = read_nrt(doc)
    except NrtReadError:
        return
    assert isinstance(node, NodeTopology) and all(z.numa_id <= nrt_read.MAX_NUMA_ID for z in node.zones)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


NFD_PATHS = _paths(NFD)[1:]


@settings(max_examples=300)
@given(path=st.sampled_from(NFD_PATHS), value=SCALARS | st.lists(SCALARS, max_size=2) | st.just({}))
def test_one_broken_field_of_a_good_object_is_a_model_or_a_typed_error(path: tuple[Any, ...], value: Any) -> None:
    obj = copy.deepcopy(NFD)
    target: Any = obj
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    try:
        read_nrt(obj)
    except NrtReadError as exc:
        assert str(exc).startswith("NodeResourceTopology ")
