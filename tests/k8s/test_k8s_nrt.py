"""The NodeResourceTopology object: valid against the CRD's v1alpha2 schema for every shared
hwloc capture, lab capture and synthesized host, and equal to the topology (zones, CPUs, SLIT costs,
accelerators by NUMA node); kubelet reservations and PodResources answers move allocatable/available."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft7Validator

from bench.nrt_crd import assert_valid, nrt_schema, pruned, res, zone
from memtopo.cli.main import main
from memtopo.hostfs import HostFS
from memtopo.k8s import podfingerprint as pfp
from memtopo.k8s.facts import DeviceGrant, EnforcedCpus, KubeletFacts, MemoryGrant, PodResourcesView
from memtopo.k8s.kubelet import KubeletConfigError, parse_quantity, read_kubelet_facts
from memtopo.k8s.nrt import (
    NrtError,
    available_devices,
    available_from_nrt,
    build_nrt,
    devices_in_use,
    node_level_devices,
    zone_nodes,
)
from memtopo.k8s.quantity import format_bytes as quantity
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import HWLOC_LINUX, HWLOC_XML, LAB_CAPTURES, discovered, extracted

REPO = Path(__file__).resolve().parents[2]
SYNTH = REPO / "tests" / "fixtures"
# Written here rather than taken from k8s.nrt: the device plugins' names, checked independently.
# Other vendors' accelerators (NEC's VectorEngine, Intel's MIC in the hwloc captures) have no device plugin
# memtopo knows, so they are in no zone's resources.
PLUGIN_NAMES = {"NVIDIA": "nvidia.com/gpu", "AMD": "amd.com/gpu", "Kunlunxin": "kunlunxin.com/xpu",
                "Huawei": "huawei.com/Ascend910"}


def _captures() -> list[tuple[str, str]]:
    out = [("hwloc", p.name.removesuffix(".tar.bz2")) for p in sorted(HWLOC_LINUX.glob("*.tar.bz2"))]
    out += [("xml", p.name) for p in sorted(HWLOC_XML.glob("*.xml"))]
    out += [("lab", p.name.removesuffix(".tar.gz")) for p in sorted(LAB_CAPTURES.glob("*.tar.gz"))]
    out += [("synth", p.parent.name) for p in sorted(SYNTH.glob("*/root.tar.gz"))]
    return out


CAPTURES = _captures()


def test_every_kind_of_capture_is_covered() -> None:
    kinds = Counter(k for k, _ in CAPTURES)
    assert kinds["hwloc"] >= 19 and kinds["xml"] >= 10 and kinds["lab"] >= 4 and kinds["synth"] >= 8


_DROP = object()


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of the object at a slash-separated path (list indexes as numbers); ``_DROP`` deletes."""
    def edit(obj: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node: Any = obj
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if value is _DROP:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value
    return edit


# Each breaks one rule of the CRD's schema that consumers rely on.
BROKEN = {
    "resource without available": _set("zones/0/resources/0/available", _DROP),
    "resource without name": _set("zones/0/resources/0/name", _DROP),
    "quantity with a space": _set("zones/0/resources/0/capacity", "64 Gi"),
    "quantity with an unknown suffix": _set("zones/0/resources/1/allocatable", "12GB"),
    "quantity that is a float": _set("zones/0/resources/0/available", 1.5),
    "zone without type": _set("zones/0/type", _DROP),
    "zone without name": _set("zones/0/name", _DROP),
    "no zones": _set("zones", _DROP),
    "cost that is not an integer": _set("zones/0/costs/0/value", "near"),
    "zone attribute without value": _set("zones/0/attributes/0/value", _DROP),
    "attribute value that is not a string": _set("attributes/0/value", 3),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_the_crd_schema_refuses_broken_objects(broken: str) -> None:
    topo, kubelet = load("synth", "ascend-a2-8x910b")
    obj = build_nrt(topo, "node-a", kubelet=kubelet)
    assert not list(Draft7Validator(nrt_schema()).iter_errors(obj))  # the unbroken object is valid
    BROKEN[broken](obj)
    assert list(Draft7Validator(nrt_schema()).iter_errors(obj)), broken


def test_a_field_the_crd_does_not_declare_would_be_pruned() -> None:
    topo, kubelet = load("synth", "ascend-a2-8x910b")
    obj = build_nrt(topo, "node-a", kubelet=kubelet)
    obj["zones"][1]["resources"][0]["used"] = "3"
    obj["numa"] = True
    assert pruned(obj, nrt_schema()) == [".zones[1].resources[0].used", ".numa"]


def load(kind: str, name: str) -> tuple[pb.MemoryTopology, KubeletFacts]:
    if kind == "xml":
        return discovered(HWLOC_XML / name), KubeletFacts()
    tarball = {"hwloc": HWLOC_LINUX / f"{name}.tar.bz2", "lab": LAB_CAPTURES / f"{name}.tar.gz",
               "synth": SYNTH / name / "root.tar.gz"}[kind]
    return discovered(tarball), read_kubelet_facts(HostFS.at(extracted(tarball)))


def slit(topo: pb.MemoryTopology) -> dict[tuple[int, int], int]:
    # A capture may lack a node's distance file: that row is empty, and the zone then has no costs.
    return {(n.id, other): d for n in topo.numa_nodes for other, d in zip(n.distance_nodes, n.distances, strict=False)}


@pytest.mark.parametrize(("kind", "name"), CAPTURES, ids=[f"{k}:{n}" for k, n in CAPTURES])
def test_nrt_is_valid_and_equals_the_topology(kind: str, name: str) -> None:
    topo, kubelet = load(kind, name)
    obj = build_nrt(topo, "node-a", kubelet=kubelet)
    assert_valid(obj)
    assert obj["metadata"]["name"] == "node-a"
    nodes = {n.id: n for n in topo.numa_nodes}
    expected = sorted(n.id for n in topo.numa_nodes
                      if n.state == pb.NUMA_NODE_STATE_ONLINE and (n.cpus or n.memory_bytes))
    zones = {int(z["name"].removeprefix("node-")): z for z in obj["zones"]}
    assert sorted(zones) == expected and expected
    distances = slit(topo)
    acc_count = Counter((a.numa_node, PLUGIN_NAMES[a.vendor])
                        for a in topo.accelerators if a.numa_node >= 0 and a.vendor in PLUGIN_NAMES)
    for nid, z in zones.items():
        assert z["type"] == "Node"
        res = {r["name"]: r for r in z["resources"]}
        node = nodes[nid]
        if node.cpus:
            assert res["cpu"]["capacity"] == str(len(node.cpus))
        else:
            assert "cpu" not in res
        huge = sum(kubelet.hugepages.get(nid, {}).values())
        if node.memory_bytes:
            assert parse_quantity(res["memory"]["capacity"]) == node.memory_bytes - huge
        for r in res.values():  # nothing reserved or held: all three agree
            assert r["capacity"] == r["allocatable"] == r["available"]
        assert {(c["name"], c["value"]) for c in z.get("costs", [])} == {
            (f"node-{b}", d) for (a, b), d in distances.items() if a == nid and b in zones}
        devices = {k: int(v["capacity"]) for k, v in res.items() if "/" in k}
        assert devices == {r: c for (n, r), c in acc_count.items() if n == nid}
    assert sum(int(r["capacity"]) for z in obj["zones"] for r in z["resources"] if "/" in r["name"]) == sum(
        acc_count.values())
    attrs = {a["name"]: a["value"] for a in obj["attributes"]}
    assert attrs["memtopo.io/fingerprint"] == topo.fingerprint
    assert attrs["memtopo.io/generation"] == str(topo.generation)
    assert attrs["memtopo.io/pod-resources"].startswith("unavailable")
    assert "nodeTopologyPodsFingerprint" not in attrs  # without PodResources no one knows the pods
    # The same node with a kubelet that has two SR-IOV VFs per zone (one held), a resource without NUMA
    # affinity, a pods fingerprint, and memtopo's enforcement holding each zone's first CPU.
    vfs = tuple(DeviceGrant("intel.com/sriov_vf", (f"{nid:04x}:3b:02.0", f"{nid:04x}:3b:02.1"), (nid,))
                for nid in zones)
    pods = PodResourcesView(allocatable_devices=(*vfs, DeviceGrant("example.com/license", ("l0", "l1"))),
                            assigned_devices=tuple(DeviceGrant(g.resource, g.ids[:1], g.numa_nodes) for g in vfs),
                            pods=1, pods_fingerprint=pfp.sign([("ml", "train-0")]))
    pinned = frozenset(min(nodes[nid].cpus) for nid in zones if nodes[nid].cpus)
    busy = build_nrt(topo, "node-a", kubelet=kubelet, pods=pods, enforced=EnforcedCpus(True, pinned, len(pinned)))
    assert_valid(busy)
    for z in busy["zones"]:
        got = {r["name"]: r for r in z["resources"]}
        assert (got["intel.com/sriov_vf"]["allocatable"], got["intel.com/sriov_vf"]["available"]) == ("2", "1")
        assert "example.com/license" not in got
        if "cpu" in got:
            assert int(got["cpu"]["available"]) == int(got["cpu"]["allocatable"]) - 1
    top = {a["name"]: a["value"] for a in busy["attributes"]}
    assert top["memtopo.io/node-level-resources"] == "example.com/license=2/2"
    assert top["nodeTopologyPodsFingerprint"] == pfp.sign([("ml", "train-0")])
    assert top["memtopo.io/cpu-enforcement"] == f"memtopo: {len(pinned)} pods, {len(pinned)} exclusive CPUs"


def synth(name: str) -> pb.MemoryTopology:
    return discovered(SYNTH / name / "root.tar.gz")


def attrs(z: dict[str, Any]) -> dict[str, str]:
    return {a["name"]: a["value"] for a in z["attributes"]}


def test_gh200_gpu_memory_zone_is_cpuless_unified_and_names_its_gpu() -> None:
    obj = build_nrt(synth("gh200"), "gh200-1")
    a = attrs(zone(obj, "node-1"))
    assert a["memtopo.io/cpuless"] == "true" and a["memtopo.io/memory-type"] == "UNIFIED"
    assert a["memtopo.io/accelerator-memory-of"] == "GPU0"
    assert [z["name"] for z in obj["zones"]] == ["node-0", "node-1"]  # MIG placeholders are not zones
    assert res(obj, "node-0", "nvidia.com/gpu") == ("1", "1", "1")


def test_ascend_and_kunlunxin_groups_appear_on_their_zones() -> None:
    a2 = build_nrt(synth("ascend-a2-8x910b"), "a2")
    ring = "NPU0,NPU1,NPU2,NPU3,NPU4,NPU5,NPU6,NPU7"
    assert {attrs(z).get("memtopo.io/hccs-ring") for z in a2["zones"] if "memtopo.io/accelerators" in attrs(z)} == {
        ring}
    p800 = build_nrt(synth("kunlunxin-p800-8xpu"), "p800")
    assert attrs(zone(p800, "node-0"))["memtopo.io/xpu-numa-half"] == "XPU0,XPU1,XPU2,XPU3"
    assert attrs(zone(p800, "node-1"))["memtopo.io/xpu-numa-half"] == "XPU4,XPU5,XPU6,XPU7"


def test_kubelet_reservations_lower_allocatable() -> None:
    topo = synth("kunlunxin-p800-8xpu")
    n0, n1 = (list(n.cpus) for n in topo.numa_nodes[:2])
    kubelet = KubeletFacts(config_path="/var/lib/kubelet/config.yaml", topology_manager_policy="single-numa-node",
                           topology_manager_scope="pod", reserved_cpus=(n0[0], n0[1], n1[0]),
                           reserved_memory={0: {"memory": 1 << 30}, 1: {"hugepages-1Gi": 1 << 30}},
                           hugepages={1: {"hugepages-1Gi": 4 << 30}})
    obj = build_nrt(topo, "p800", kubelet=kubelet)
    assert_valid(obj)
    assert res(obj, "node-0", "cpu") == ("104", "102", "102")
    assert res(obj, "node-1", "cpu") == ("104", "103", "103")
    assert res(obj, "node-0", "memory") == ("1Ti", "1023Gi", "1023Gi")
    assert res(obj, "node-1", "memory") == ("1020Gi", "1020Gi", "1020Gi")
    assert res(obj, "node-1", "hugepages-1Gi") == ("4Gi", "3Gi", "3Gi")
    top = {a["name"]: a["value"] for a in obj["attributes"]}
    assert top["topologyManagerPolicy"] == "single-numa-node" and top["topologyManagerScope"] == "pod"
    # The kubelet's defaults where its file leaves the managers out.
    assert (top["memtopo.io/cpu-manager-policy"], top["memtopo.io/memory-manager-policy"]) == ("none", "None")


def test_pod_resources_lower_available_and_devices_in_use_are_reported() -> None:
    topo = synth("kunlunxin-p800-8xpu")
    xpu = {a.id: a for a in topo.accelerators}
    n0, n1 = (list(n.cpus) for n in topo.numa_nodes[:2])
    pods = PodResourcesView(
        allocatable_cpus=tuple(sorted(n0[2:] + n1)),
        # The plugin reports XPU7 unhealthy (not allocatable); ids without topology are matched by UUID.
        allocatable_devices=(DeviceGrant("kunlunxin.com/xpu", tuple(xpu[f"XPU{i}"].uuid for i in range(7))),),
        allocatable_memory=(MemoryGrant("memory", 1000 << 30, (0,)), MemoryGrant("memory", 1000 << 30, (1,))),
        assigned_cpus=(*n0[2:6], n1[5]),
        assigned_devices=(DeviceGrant("kunlunxin.com/xpu", (xpu["XPU0"].uuid, xpu["XPU1"].uuid), (0,)),
                          DeviceGrant("kunlunxin.com/xpu", (xpu["XPU4"].uuid,))),
        # A container's memory over both nodes is split evenly.
        assigned_memory=(MemoryGrant("memory", 8 << 30, (0,)), MemoryGrant("memory", 4 << 30, (0, 1))),
        pods=2)
    obj = build_nrt(topo, "p800", pods=pods)
    assert_valid(obj)
    assert res(obj, "node-0", "cpu") == ("104", "102", "98")
    assert res(obj, "node-1", "cpu") == ("104", "104", "103")
    assert res(obj, "node-0", "memory") == ("1Ti", "1000Gi", "990Gi")
    assert res(obj, "node-1", "memory") == ("1Ti", "1000Gi", "998Gi")
    assert res(obj, "node-0", "kunlunxin.com/xpu") == ("4", "4", "2")
    assert res(obj, "node-1", "kunlunxin.com/xpu") == ("4", "3", "2")
    assert available_devices(topo, pods) == {"node-0": {"kunlunxin.com/xpu": 2}, "node-1": {"kunlunxin.com/xpu": 2}}
    assert available_from_nrt(obj) == available_devices(topo, pods)
    assert devices_in_use(topo, pods) == {
        "node-0": {"kunlunxin.com/xpu": tuple(sorted((xpu["XPU0"].uuid, xpu["XPU1"].uuid)))},
        "node-1": {"kunlunxin.com/xpu": (xpu["XPU4"].uuid,)}}
    top = {a["name"]: a["value"] for a in obj["attributes"]}
    assert top["memtopo.io/pod-resources"] == "kubelet: 2 pods"


def test_ascend_plugin_ids_without_topology_map_to_their_npu_node() -> None:
    topo = synth("ascend-a2-8x910b")
    npu0 = next(a for a in topo.accelerators if a.id == "NPU0")
    pods = PodResourcesView(assigned_devices=(DeviceGrant("huawei.com/Ascend910", (f"Ascend910-{npu0.index}",)),))
    free = available_devices(topo, pods)
    zone_of = f"node-{npu0.numa_node}"
    assert free[zone_of]["huawei.com/Ascend910"] == available_devices(topo, None)[zone_of]["huawei.com/Ascend910"] - 1


def test_every_device_plugin_resource_is_counted_in_its_zone_and_the_rest_at_node_level() -> None:
    """NICs, SR-IOV VFs, RDMA devices: whatever a device plugin registers is in the zone of its NUMA node,
    with available less what containers hold; devices with no NUMA node (or one that is no zone) are
    in no zone, as NFD leaves them, and the node-level attribute counts them."""
    topo = synth("kunlunxin-p800-8xpu")
    vf0 = tuple(f"0000:3b:02.{i}" for i in range(4))
    pods = PodResourcesView(
        allocatable_devices=(DeviceGrant("intel.com/sriov_netdevice", vf0, (0,)),
                             DeviceGrant("intel.com/sriov_netdevice", ("0000:af:02.0", "0000:af:02.1"), (1,)),
                             DeviceGrant("nvidia.com/rdma_shared_device_a", ("mlx5_0", "mlx5_1"), (1,)),
                             DeviceGrant("example.com/license", ("l0", "l1", "l2")),
                             DeviceGrant("example.com/far", ("f0",), (7,))),
        # The List may name a device without the topology its allocatable answer gave: held by id.
        assigned_devices=(DeviceGrant("intel.com/sriov_netdevice", (vf0[1],)),
                          DeviceGrant("nvidia.com/rdma_shared_device_a", ("mlx5_1",), (1,)),
                          DeviceGrant("example.com/license", ("l1",))),
        pods=2)
    obj = build_nrt(topo, "p800", pods=pods)
    assert_valid(obj)
    assert res(obj, "node-0", "intel.com/sriov_netdevice") == ("4", "4", "3")
    assert res(obj, "node-1", "intel.com/sriov_netdevice") == ("2", "2", "2")
    assert res(obj, "node-1", "nvidia.com/rdma_shared_device_a") == ("2", "2", "1")
    # The XPUs the kubelet does not report keep memtopo's own count.
    assert res(obj, "node-0", "kunlunxin.com/xpu") == ("4", "4", "4")
    named = {r["name"] for z in obj["zones"] for r in z["resources"]}
    assert not named & {"example.com/license", "example.com/far"}
    top = {a["name"]: a["value"] for a in obj["attributes"]}
    assert top["memtopo.io/node-level-resources"] == "example.com/far=1/1,example.com/license=2/3"
    assert node_level_devices(topo, pods, (0, 1)) == {"example.com/far": (1, 1), "example.com/license": (3, 2)}
    free = available_devices(topo, pods)
    assert free["node-0"]["intel.com/sriov_netdevice"] == 3 and free["node-1"]["nvidia.com/rdma_shared_device_a"] == 1


def test_the_pods_fingerprint_is_nfds_attribute_with_its_method() -> None:
    topo = synth("gh200")
    pairs = [("ml", "train-0"), ("kube-system", "memtopo-agent-x7k2p"), ("default", "web")]
    obj = build_nrt(topo, "gh200-1", pods=PodResourcesView(pods=3, pods_fingerprint=pfp.sign(pairs)))
    assert_valid(obj)
    top = {a["name"]: a["value"] for a in obj["attributes"]}
    assert top[pfp.ATTRIBUTE] == pfp.sign(reversed(pairs)) and pfp.compatible(top[pfp.ATTRIBUTE])
    assert top["nodeTopologyPodsFingerprintMethod"] == "all"
    # No pods at all is a set too: its sign says the object counts none.
    empty = build_nrt(topo, "gh200-1", pods=PodResourcesView(pods_fingerprint=pfp.sign([])))
    assert {a["name"]: a["value"] for a in empty["attributes"]}[pfp.ATTRIBUTE] == pfp.sign([])
    without = build_nrt(topo, "gh200-1", pods=None, pods_problem="no socket")
    assert pfp.ATTRIBUTE not in {a["name"] for a in without["attributes"]}


def test_available_cpus_leave_out_what_memtopos_enforcement_pinned() -> None:
    topo = synth("kunlunxin-p800-8xpu")
    n0, n1 = (list(n.cpus) for n in topo.numa_nodes[:2])
    pods = PodResourcesView(allocatable_cpus=tuple(sorted(n0[1:] + n1)), pods=3)
    pinned = EnforcedCpus(True, frozenset(n0[1:5] + n1[:2]), 2)
    obj = build_nrt(topo, "p800", pods=pods, enforced=pinned)
    assert_valid(obj)
    assert res(obj, "node-0", "cpu") == ("104", "103", "99")
    assert res(obj, "node-1", "cpu") == ("104", "104", "102")
    top = {a["name"]: a["value"] for a in obj["attributes"]}
    assert top["memtopo.io/cpu-enforcement"] == "memtopo: 2 pods, 6 exclusive CPUs"
    # Before the enforcement's first decision nothing is offered as free; the attribute says why.
    unknown = build_nrt(topo, "p800", pods=pods,
                        enforced=EnforcedCpus(False, note="waiting: the pod list has not arrived yet"))
    assert_valid(unknown)
    assert res(unknown, "node-0", "cpu") == ("104", "103", "0") and res(unknown, "node-1", "cpu")[2] == "0"
    assert {a["name"]: a["value"] for a in unknown["attributes"]}["memtopo.io/cpu-enforcement"] == (
        "not known yet (waiting: the pod list has not arrived yet): cpu available = 0")
    # With the kubelet's static policy the kubelet pins (PodResources says what); memtopo adds nothing.
    owned = EnforcedCpus(True, note="kubelet: its static CPU manager owns container cpusets")
    kubelet_owned = build_nrt(topo, "p800", pods=PodResourcesView(assigned_cpus=(n0[3],), pods=1), enforced=owned)
    assert res(kubelet_owned, "node-0", "cpu") == ("104", "104", "103")


def test_available_from_nrt_ignores_malformed_zones() -> None:
    obj = {"zones": [None, {"name": 3}, {"name": "node-0", "resources": [
        {"name": "nvidia.com/gpu", "available": "2"}, {"name": "nvidia.com/mig", "available": "1.5"},
        {"name": "cpu", "available": "4"}, "junk", {"name": "amd.com/gpu", "available": True},
        {"name": "kunlunxin.com/xpu", "available": "9" * 5000}, {"name": "amd.com/gpu", "available": -1}]}]}
    assert available_from_nrt(obj) == {"node-0": {"nvidia.com/gpu": 2}}


_ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["zones", "name", "resources", "available", "x"]), inner, max_size=4),
                    max_leaves=40)


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(st.sampled_from(["zones", "kind"]), _ANY, max_size=2))
def test_available_from_nrt_never_raises_on_any_object(obj: dict[str, Any]) -> None:
    out = available_from_nrt(obj)
    assert all(isinstance(v, int) and v >= 0 for zone in out.values() for v in zone.values())


def test_a_node_name_kubernetes_refuses_is_an_error() -> None:
    topo = pb.MemoryTopology(node_name="Bad_Host")
    with pytest.raises(NrtError, match="not a Kubernetes node name"):
        build_nrt(topo)


def test_zone_nodes_skip_offline_and_empty_nodes() -> None:
    topo = pb.MemoryTopology(numa_nodes=[
        pb.NumaNode(id=0, state=pb.NUMA_NODE_STATE_ONLINE, cpus=[0], memory_bytes=1 << 30),
        pb.NumaNode(id=1, state=pb.NUMA_NODE_STATE_POSSIBLE_OFFLINE),
        pb.NumaNode(id=2, state=pb.NUMA_NODE_STATE_ONLINE),
        pb.NumaNode(id=3, state=pb.NUMA_NODE_STATE_ONLINE, memory_bytes=1 << 30)])
    assert [n.id for n in zone_nodes(topo)] == [0, 3]


def test_quantity_spellings() -> None:
    assert [quantity(n) for n in (0, 1000, 1 << 30, 1536 << 20, (1 << 40) + 1024, -5)] == [
        "0", "1000", "1Gi", "1536Mi", "1073741825Ki", "0"]
    assert parse_quantity("1G") == 10**9 and parse_quantity("1.5Gi") == 3 << 29 and parse_quantity("1e3") == 1000
    assert parse_quantity(4096) == 4096 and parse_quantity("+12Ki") == 12288
    for bad in ("", "1X", "Gi", "1e999999", "-1Gi", "100m", True, None, 1.5, "9" * 100):
        with pytest.raises(KubeletConfigError):
            parse_quantity(bad)


@settings(deadline=None)
@given(st.integers(min_value=0, max_value=1 << 62))
def test_quantity_round_trips(n: int) -> None:
    assert parse_quantity(quantity(n)) == n


def test_cli_prints_the_object_as_json_and_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    root = str(SYNTH / "mi300a-4apu" / "root.tar.gz")
    assert main(["k8s", "nrt", "--root", root, "--node-name", "mi300a-1", "--format", "json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert_valid(obj)
    assert sum(int(r["capacity"]) for z in obj["zones"] for r in z["resources"] if r["name"] == "amd.com/gpu") == 4
    assert main(["k8s", "nrt", "--root", root, "--node-name", "mi300a-1"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == obj


def test_cli_refuses_a_bad_node_name(capsys: pytest.CaptureFixture[str]) -> None:
    root = str(SYNTH / "gh200" / "root.tar.gz")
    assert main(["k8s", "nrt", "--root", root, "--node-name", "Not A Name"]) == 2
    assert "not a Kubernetes node name" in capsys.readouterr().err


def test_an_unprintable_host_name_is_reported_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    shutil.copytree(extracted(SYNTH / "gh200" / "root.tar.gz"), root, symlinks=True)
    (root / "proc/sys/kernel/hostname").write_bytes(b"gh\x1b[2J200\n")
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/hostname").write_text("")
    env_name = os.environ.pop("NODE_NAME", None)
    try:
        assert main(["k8s", "nrt", "--root", str(root)]) == 2
    finally:
        if env_name is not None:
            os.environ["NODE_NAME"] = env_name
    err = capsys.readouterr().err
    assert "no node name (no host name: proc/sys/kernel/hostname: not printable: 'gh\\x1b[2J200'" in err
    assert "\x1b" not in err and "'' is not" not in err


@pytest.mark.parametrize("kind", ["empty directory", "missing path", "garbage tarball"])
def test_cli_handles_a_root_it_cannot_read_as_topo_does(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        kind: str) -> None:
    """These were tracebacks from `k8s nrt --root`; `topo --root` said what was wrong and exited 2."""
    root = tmp_path / ("empty" if kind == "empty directory" else "missing" if kind == "missing path" else "x.tar.gz")
    if kind == "empty directory":
        root.mkdir()
    elif kind == "garbage tarball":
        root.write_bytes(b"\x1f\x8b not a gzip stream, nor a tar")
    answers = []
    for argv in (["topo", "--root", str(root)], ["k8s", "nrt", "--root", str(root), "--node-name", "n1"]):
        rc = main(argv)
        out, err = capsys.readouterr()
        answers.append((rc, out, err))
    (topo_rc, _, topo_err), (nrt_rc, nrt_out, nrt_err) = answers
    assert nrt_rc == topo_rc == 2 and nrt_out == ""
    assert nrt_err == topo_err and nrt_err.startswith(f"memtopo: {root}") and "Traceback" not in nrt_err
