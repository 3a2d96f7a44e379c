"""The scheduler extender over the API server's fleet (``--fleet nrt``), through its HTTP verbs.

A controller with the extender's routes (put together as ``memtopo controller serve --kube-api URL
--fleet nrt`` does) reads NodeResourceTopology objects and pods from a **stand-in** API server
(bench/k8s_standin.py: real HTTP, list and watch, bindings; not a Kubernetes API server — none can run
here). kube-scheduler's part is played by the tests: ExtenderArgs as it sends them, with NodeNames.

- scheduler-plugins' own tables (``filter_test.go``, ``score_test.go``; ported at unit level in
  tests/test_k8s_admission.py and tests/test_k8s_scoring.py) driven again through filter and prioritize,
  every case counted and agreeing;
- memtopo's policies choosing among the placements the kubelet accepts;
- pods in flight: what a bind claimed is held until the node's object counts it (by its pods
  fingerprint), pods bound by others are held in every zone, a stale object is refused;
- objects other publishers write, and broken ones: a reason for that node, nothing else touched.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.k8s_standin import StandInApiServer
from memtopo.extender.auth import Authenticator
from memtopo.k8s import podfingerprint
from memtopo.k8s.admission import TOPOLOGY_AFFINITY_ERROR, UNEXPECTED_ADMISSION_ERROR
from memtopo.k8s.kubeapi import KubeApi
from memtopo.k8s.scoring import Strategy, extender_score
from tests.extender.nrt_cluster import (
    AUTH,
    TOKEN,
    api,
    binding,
    call,
    extender,
    failure,
    filter_ok,
    gu_pod,
    names_args,
    placement_of,
    readyz,
    run,
    token_auth,
    two_zones,
    until,
    wait_ready,
)
from tests.http_client import exchange, post
from tests.nrt_upstream import CPU, MEMORY, nrt, pod_by_resource_list, pod_by_resource_lists, res_info, zone
from tests.nrt_upstream_cases import (
    CNT_T,
    FILTER_NODES,
    FILTER_ROWS,
    NRT_T,
    PARTIAL_DATA,
    POD1,
    POD_T,
    SCORE_PLUGIN,
    SCORE_PLUGIN_LEAST_NUMA,
    UNIT_PREFIX,
    default_numa_nodes,
    four_numa_nodes,
)
from tests.strategies import json_like

__all__ = ["api"]  # the stand-in API server fixture

# ---- filter_test.go through the verbs ------------------------------------------------------------------
# The two multi-container tests share a node named host0 with another scope: served under two names.
HTTP_NAMES = {key: ("host0-pod" if key == "host0 (pod scope)" else "host0-container" if
                    key == "host0 (container scope)" else key) for key in FILTER_NODES}


def _renamed(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return {**json.loads(json.dumps(obj)), "metadata": {"name": name}}


def test_filter_cases_of_scheduler_plugins_through_the_verbs(api: StandInApiServer, tmp_path: Path) -> None:
    """Every filter_test.go case as kube-scheduler would ask it: the node's object in the API server, the
    pod in ExtenderArgs; filter passes exactly the nodes upstream passes, and fails the others with the
    kubelet's reason naming the unit upstream names."""
    for key, obj in FILTER_NODES.items():
        api.put_nrt(_renamed(obj, HTTP_NAMES[key]))
    agreeing: dict[str, int] = {}

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            for row in FILTER_ROWS:
                name = HTTP_NAMES[row.node]
                answer = await call(port, "filter", names_args(row.pod, [name]))
                assert answer["Error"] == "", (row.name, answer)
                expected = row.upstream if row.kubelet is None else row.kubelet
                if expected == "":
                    assert answer["NodeNames"] == [name], (row.name, answer)
                else:
                    reason = {**answer["FailedNodes"], **answer["FailedAndUnresolvableNodes"]}[name]
                    assert reason.startswith((TOPOLOGY_AFFINITY_ERROR, UNEXPECTED_ADMISSION_ERROR)), reason
                    assert reason.split(": ", 1)[1].startswith(UNIT_PREFIX[expected]), (row.name, reason)
                agreeing[row.test] = agreeing.get(row.test, 0) + 1
    run(body())
    assert agreeing == {NRT_T: 49, POD_T: 5, CNT_T: 17}


# ---- score_test.go through the verbs -------------------------------------------------------------------
async def _priorities(port: int, pod: dict[str, Any], names: list[str]) -> dict[str, int]:
    return {h["Host"]: h["Score"] for h in await call(port, "prioritize", names_args(pod, names))}


def _serve_scores(api: StandInApiServer, tmp: Path, objects: Mapping[str, dict[str, Any] | None], strategy: Strategy,
                  pod: dict[str, Any]) -> dict[str, int]:
    for name in list(api.objects):
        api.delete_nrt(name)
    for obj in objects.values():
        if obj is not None:
            api.put_nrt(json.loads(json.dumps(obj)))
    out: dict[str, int] = {}

    async def body() -> None:
        async with extender(api, tmp, score=strategy.value) as port:
            out.update(await _priorities(port, pod, list(objects)))
    run(body())
    return out


SCORE_ROWS = len(SCORE_PLUGIN) + len(SCORE_PLUGIN_LEAST_NUMA) + len(PARTIAL_DATA)


@pytest.mark.parametrize(("name", "strategy", "wanted"), SCORE_PLUGIN)
def test_score_plugin_cases_through_prioritize(api: StandInApiServer, tmp_path: Path, name: str, strategy: Strategy,
                                               wanted: tuple[str, int]) -> None:
    """Upstream's best node gets the highest score, its 0–100 score on the extender's 0–10 scale (which
    can tie nodes upstream sets less than 10 points apart: Node3 scores 70 here, 7 like Node1's 73)."""
    scores = _serve_scores(api, tmp_path, default_numa_nodes("SingleNUMANodeContainerLevel"), strategy, POD1)
    assert scores[wanted[0]] == max(scores.values()) == extender_score(wanted[1])


@pytest.mark.parametrize(("name", "requests", "wanted", "nodes"), SCORE_PLUGIN_LEAST_NUMA)
def test_least_numa_cases_through_prioritize(api: StandInApiServer, tmp_path: Path, name: str,
                                             requests: list[dict[str, str]], wanted: dict[str, int],
                                             nodes: str) -> None:
    objects = four_numa_nodes() if nodes == "four" else default_numa_nodes(nodes)
    scores = _serve_scores(api, tmp_path, dict(objects), Strategy.LEAST_NUMA_NODES, pod_by_resource_lists(*requests))
    assert scores == {n: extender_score(s) for n, s in wanted.items()}


@pytest.mark.parametrize(("name", "strategy", "keep", "wanted"), PARTIAL_DATA)
def test_partial_data_cases_through_prioritize(api: StandInApiServer, tmp_path: Path, name: str, strategy: Strategy,
                                               keep: Callable[[str, dict[str, Any]], dict[str, Any] | None],
                                               wanted: tuple[str, int] | None) -> None:
    objects = {n: keep(n, obj) for n, obj in default_numa_nodes("SingleNUMANodeContainerLevel").items()}
    scores = _serve_scores(api, tmp_path, objects, strategy, POD1)
    if wanted is None:
        assert set(scores.values()) == {0}
    else:
        assert scores == {n: extender_score(wanted[1]) if n == wanted[0] else 0 for n in objects}


def test_the_http_port_counts_every_upstream_case() -> None:
    assert len(FILTER_ROWS) == 71 and SCORE_ROWS == 23










# ---- what the kubelet will admit, then memtopo's choice among it -----------------------------------------
def test_a_cpu_and_memory_pod_is_judged_by_what_the_kubelet_will_admit(api: StandInApiServer, tmp_path: Path) -> None:
    """No annotation, no device: filter still says where the kubelet would refuse the pod, with its reason;
    a node whose object is missing fails as unresolvable, naming it."""
    api.put_nrt(two_zones("roomy", (4, 4)))
    api.put_nrt(two_zones("split", (2, 2)))
    api.put_nrt(two_zones("best-effort", (2, 2), policy="best-effort"))
    api.put_nrt(two_zones("best-effort-short", (2, 1), policy="best-effort"))

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            names = ["roomy", "split", "best-effort", "best-effort-short", "ghost"]
            answer = await call(port, "filter", names_args(gu_pod("p"), names))
            # best-effort admits what it cannot align (its CPUs from both zones).
            assert answer["NodeNames"] == ["roomy", "best-effort"]
            assert answer["FailedNodes"]["split"].startswith("TopologyAffinityError: pod: Resources cannot be "
                                                             "allocated with Topology locality")
            # ... but not 4 CPUs where 3 are free: the kubelet's allocation fails (and could succeed once
            # pods leave: resolvable).
            assert answer["FailedNodes"]["best-effort-short"].startswith("UnexpectedAdmissionError")
            assert answer["FailedAndUnresolvableNodes"] == {
                "ghost": "memtopo: no NodeResourceTopology named ghost (no publisher has written one)"}
            # 8 CPUs never fit one zone of 4: unresolvable, preemption cannot help.
            big = await call(port, "filter", names_args(gu_pod("q", cpus=8), ["roomy"]))
            assert "roomy" in big["FailedAndUnresolvableNodes"]
    run(body())


def test_a_shape_judged_over_the_fleet_is_kept_out_of_the_collectors_scans(api: StandInApiServer,
                                                                          tmp_path: Path) -> None:
    """Judgements live until their node changes: once a pod shape has been judged over more nodes than
    the loop judges itself, none is left in the collector's generations for a full collection to scan
    (each such scan cost a verb 17–45 ms at 5,000 nodes), and they still answer the next request."""
    from memtopo.extender.nrt import THREAD_THRESHOLD, NodeJudgement

    names = [f"node-{i:03d}" for i in range(THREAD_THRESHOLD + 36)]
    for name in names:
        api.put_nrt(two_zones(name, (4, 2)))

    def judgements_scanned() -> int:
        return sum(isinstance(o, NodeJudgement) for o in gc.get_objects())

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            answer = await call(port, "filter", names_args(gu_pod("p", cpus=3), names))
            assert answer["NodeNames"] == names
            assert judgements_scanned() == 0
            again = await call(port, "filter", names_args(gu_pod("q", cpus=3), names))  # the same shape
            assert again["NodeNames"] == names
            # A handful judged afresh stays with the young objects: only a fleet's worth is frozen.
            few = await call(port, "filter", names_args(gu_pod("r", cpus=1), names[:3]))
            assert few["NodeNames"] == names[:3]
            assert judgements_scanned() == 3
    run(body())


ZoneAttrs = tuple[list[dict[str, str]], list[dict[str, str]]]


def _memory_zones(kinds: tuple[str, str], bandwidth: tuple[int, int] = (0, 0)) -> ZoneAttrs:
    def attrs(kind: str, bw: int) -> list[dict[str, str]]:
        out = [{"name": "memtopo.io/memory-type", "value": kind}]
        if bw:
            out.append({"name": "memtopo.io/read-bandwidth-mbps", "value": str(bw)})
        return out
    return attrs(kinds[0], bandwidth[0]), attrs(kinds[1], bandwidth[1])


def test_place_chooses_among_the_placements_the_kubelet_accepts(api: StandInApiServer, tmp_path: Path) -> None:
    """A place pod (memtopo.io/ annotation) on nodes whose memtopo publisher says what each zone's memory
    is. Where the kubelet's CPU and memory managers are off (memtopo's node enforcement places CPUs and
    memory) the kubelet accepts any placement and place takes the best memory; bind writes that zone,
    which the node's enforcement reads. Where the kubelet's static managers place the pod themselves
    (its choice: the lowest zone), place judges that choice — CXL only, refused without allow-cxl."""
    dram, cxl = _memory_zones(("DRAM", "CXL"))
    off = ("none", "None")
    api.put_nrt(two_zones("mixed", (4, 4), policy="best-effort", zone_attrs=(cxl, dram), managers=off))
    api.put_nrt(two_zones("cxl-only", (4, 4), policy="best-effort", zone_attrs=(cxl, cxl), managers=off))
    api.put_nrt(two_zones("fast", (4, 4), policy="best-effort", managers=off,
                          zone_attrs=_memory_zones(("DRAM", "DRAM"), (50_000, 100_000))))
    api.put_nrt(two_zones("kubelet-picks-cxl", (4, 4), zone_attrs=(cxl, dram), managers=("static", "Static")))
    pod = gu_pod("p", cpus=2, memory="1Gi")
    pod["metadata"]["annotations"] = {"memtopo.io/workload": "cpu-heavy"}
    api.put_pod(pod)
    api.add_node("fast")

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            answer = await call(port, "filter", names_args(pod, ["mixed", "cxl-only", "fast", "kubelet-picks-cxl"]))
            assert answer["NodeNames"] == ["mixed", "fast"]
            for name in ("cxl-only", "kubelet-picks-cxl"):
                assert answer["FailedAndUnresolvableNodes"][name].startswith("memtopo place: allow_cxl_memory")
            scores = await _priorities(port, pod, ["mixed", "fast"])
            assert scores["fast"] == 10 and 1 <= scores["mixed"] < 10
            assert await call(port, "bind", binding("p", "fast")) == {"Error": ""}
            placed = placement_of(api, "p")
            # Zone 1 has the higher bandwidth; the claim is the pod's exclusive CPUs and memory there.
            assert placed["zones"] == [1] and placed["policy"] == "place" and placed["node"] == "fast"
            assert placed["claims"] == {"1": {"cpu": 2, "memory": 1 << 30}} and placed["memory"] == {"nodes": "1"}
            from memtopo.k8s.enforcement import parse_placement

            read = parse_placement(api.pods[("default", "p")]["metadata"]["annotations"]["memtopo.io/placement"])
            assert read.zones == (1,) and read.mems == (1,) and not read.cpus
            assert api.pods[("default", "p")]["spec"]["nodeName"] == "fast"
    run(body())


def test_hccs_judges_the_ring_the_kubelet_takes_the_npus_from(api: StandInApiServer, tmp_path: Path) -> None:
    """An Ascend 910 node as memtopo's publisher writes it: each zone one HCCS ring of 4 NPUs. The
    kubelet takes the NPUs from the lowest zone with enough free; hccs ranks the nodes by the priority
    group of that ring (A: the pod empties it …), not of the ring it would have liked better."""
    ring0 = [{"name": "memtopo.io/hccs-ring", "value": "NPU0,NPU1,NPU2,NPU3"}]
    ring1 = [{"name": "memtopo.io/hccs-ring", "value": "NPU4,NPU5,NPU6,NPU7"}]

    def ascend(name: str, free: tuple[int, int]) -> dict[str, Any]:
        obj = two_zones(name, policy="single-numa-node", scope="container", zone_attrs=(ring0, ring1))
        for z, n in zip(obj["zones"], free, strict=True):
            z["resources"].append(res_info("huawei.com/Ascend910", "4", str(n)))
        return obj

    api.put_nrt(ascend("whole-free", (4, 4)))  # ring 0 has 4 free: group D for one NPU
    api.put_nrt(ascend("one-left", (1, 4)))  # ring 0 has exactly 1: group A
    api.put_nrt(ascend("full", (0, 0)))
    one = pod_by_resource_list({"huawei.com/Ascend910": "1"})
    two = pod_by_resource_list({"huawei.com/Ascend910": "2"})
    api.put_nrt(ascend("three-and-one", (3, 1)))  # ring 0 has 3: group B
    api.put_nrt(ascend("two-free", (2, 0)))

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            names = ["whole-free", "one-left", "full", "three-and-one"]
            answer = await call(port, "filter", names_args(one, names))
            assert answer["NodeNames"] == ["whole-free", "one-left", "three-and-one"]
            assert answer["FailedNodes"]["full"].startswith("TopologyAffinityError")
            scores = await _priorities(port, one, names)
            assert scores["one-left"] == 10 > scores["three-and-one"] > scores["whole-free"] >= 1
            assert scores["full"] == 0
            # Two NPUs: a ring with exactly two free (group A) before a whole one (group B).
            scores = await _priorities(port, two, ["whole-free", "two-free"])
            assert scores["two-free"] == 10 > scores["whole-free"] >= 1
            # Bind writes the ring's zone and what the pod holds there.
            api.put_pod({**two, "metadata": {"name": "npu-pod", "namespace": "default", "uid": "uid-npu-pod"}})
            assert await call(port, "bind", binding("npu-pod", "two-free")) == {"Error": ""}
            placed = placement_of(api, "npu-pod")
            assert placed["zones"] == [0] and placed["policy"] == "hccs" and "ring NPU0–NPU3" in placed["detail"]
            assert placed["claims"] == {"0": {"huawei.com/Ascend910": 2}}
    run(body())


def test_an_ascend_node_whose_zone_mixes_two_rings_is_unresolvable(api: StandInApiServer, tmp_path: Path) -> None:
    mixed = [{"name": "memtopo.io/hccs-ring", "value": "NPU0,NPU1,NPU2,NPU3;NPU4,NPU5,NPU6,NPU7"}]
    obj = two_zones("mixed", policy="none", zone_attrs=(mixed, mixed))
    for z in obj["zones"]:
        z["resources"].append(res_info("huawei.com/Ascend910", "4", "4"))
    api.put_nrt(obj)

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            answer = await call(port, "filter", names_args(pod_by_resource_list({"huawei.com/Ascend910": "1"}),
                                                           ["mixed"]))
            reason = answer["FailedAndUnresolvableNodes"]["mixed"]
            assert reason.startswith("memtopo hccs: zone node-0 holds devices of 2 HCCS rings")
    run(body())


# ---- pods in flight ------------------------------------------------------------------------------------
def test_a_bind_holds_its_zone_until_the_nodes_object_counts_the_pod(api: StandInApiServer, tmp_path: Path) -> None:
    """Two zones of 4 free CPUs; pods of 4 CPUs each. Bind a claims zone 0, bind b zone 1; c then fits
    nowhere although the object still shows both zones free. When the node's object counts a and b (its
    pods fingerprint signs them), nothing is in flight any more and its own counts decide."""
    api.put_nrt(two_zones("n1", (4, 4)))
    for name in "abc":
        api.put_pod(gu_pod(name))

    async def filtered(port: int, name: str) -> dict[str, Any]:
        answer: dict[str, Any] = await call(port, "filter", names_args(gu_pod(name), ["n1"]))
        return answer

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            assert (await filtered(port, "a"))["NodeNames"] == ["n1"]
            assert await call(port, "bind", binding("a", "n1")) == {"Error": ""}
            assert placement_of(api, "a")["zones"] == [0]

            async def b_sees_a() -> bool:
                return await filter_ok(port, gu_pod("b"), ["n1"]) == ["n1"]
            await until(b_sees_a)
            assert await call(port, "bind", binding("b", "n1")) == {"Error": ""}
            assert placement_of(api, "b")["zones"] == [1]

            async def c_refused() -> bool:
                return bool((await filtered(port, "c"))["FailedNodes"])
            await until(c_refused)
            reason = (await filtered(port, "c"))["FailedNodes"]["n1"]
            assert reason.startswith("TopologyAffinityError")
            # A bind of c now (kube-scheduler's cache does not know zones) is refused, nothing written.
            refused = await call(port, "bind", binding("c", "n1"))
            assert "no longer fits" in refused["Error"] and "nodeName" not in api.pods[("default", "c")].get("spec", {})
            # The publisher catches up: zones now show 0 free, and its fingerprint counts a and b.
            sign = podfingerprint.sign([("default", "a"), ("default", "b")])
            api.put_nrt(two_zones("n1", (0, 0), fingerprint=sign))

            async def still_refused_by_counts() -> bool:
                return (await failure(port, gu_pod("c"), "n1")).startswith("TopologyAffinityError")
            await until(still_refused_by_counts)
            # a finishes and leaves; the publisher counts only b, with zone 0 free again: c fits.
            api.delete_pod("default", "a")
            api.put_nrt(two_zones("n1", (4, 0), fingerprint=podfingerprint.sign([("default", "b")])))

            async def c_fits() -> bool:
                return await filter_ok(port, gu_pod("c"), ["n1"]) == ["n1"]
            await until(c_fits)
    run(body())


def test_a_pod_bound_by_someone_else_is_held_in_every_zone(api: StandInApiServer, tmp_path: Path) -> None:
    """A Guaranteed pod of 2 CPUs bound to n1 without memtopo's bind (no placement): which zone the kubelet
    gives it cannot be known, so both zones count it, as scheduler-plugins' overreserve does."""
    api.put_nrt(two_zones("n1", (4, 4)))
    foreign = gu_pod("foreign", cpus=2)
    foreign["spec"]["nodeName"] = "n1"
    api.put_pod(foreign)

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            answer = await call(port, "filter", names_args(gu_pod("four"), ["n1"]))
            assert answer["FailedNodes"]["n1"].startswith("TopologyAffinityError")
            assert (await call(port, "filter", names_args(gu_pod("two", cpus=2), ["n1"])))["NodeNames"] == ["n1"]
            # The publisher counts it (fingerprint) and shows where: zone 1. Zone 0 is whole again.
            api.put_nrt(two_zones("n1", (4, 2), fingerprint=podfingerprint.sign([("default", "foreign")])))

            async def four_fits() -> bool:
                return bool((await call(port, "filter", names_args(gu_pod("four"), ["n1"])))["NodeNames"])
            await until(four_fits)
    run(body())


def test_an_object_that_never_catches_up_is_refused_as_stale(api: StandInApiServer, tmp_path: Path) -> None:
    """The object's fingerprint signs a pod set that is not the node's, and nothing changes for longer
    than --nrt-max-age: the node is refused with a reason naming its object; other nodes are untouched."""
    api.put_nrt(two_zones("behind", (4, 4), fingerprint=podfingerprint.sign([("default", "gone-long-ago")])))
    api.put_nrt(two_zones("fine", (4, 4), fingerprint=podfingerprint.sign([])))

    async def body() -> None:
        async with extender(api, tmp_path, max_age=1.0) as port:
            await asyncio.sleep(1.2)
            answer = await call(port, "filter", names_args(gu_pod("p"), ["behind", "fine"]))
            assert answer["NodeNames"] == ["fine"]
            reason = answer["FailedAndUnresolvableNodes"]["behind"]
            assert reason.startswith("memtopo: NodeResourceTopology behind: its nodeTopologyPodsFingerprint counts "
                                     "none of the sets") and "--nrt-max-age 1 s" in reason
    run(body())


# ---- objects other publishers write, and broken ones --------------------------------------------------
def _with_zones(name: str, zones: list[dict[str, Any]], policy: str = "SingleNUMANodePodLevel") -> dict[str, Any]:
    return nrt(name, zones, policy)


BAD_OBJECTS: dict[str, tuple[dict[str, Any], str]] = {
    "socket-zone": (_with_zones("socket-zone", [zone("socket-0", res_info(CPU, "4", "4"))]),
                    "zones[0].name: 'socket-0' is not a NUMA zone name"),
    "fractional": (_with_zones("fractional", [zone("node-0", res_info(CPU, "4", "1.5"))]), "is not a whole number"),
    "lots": (_with_zones("lots", [zone("node-0", res_info(CPU, "4", "lots"))]), "lots"),
    "negative": (_with_zones("negative", [zone("node-0", res_info(CPU, "4", "-1"))]), "-1"),
    "huge": (_with_zones("huge", [zone("node-0", res_info(CPU, "1e30", "4"))]), "1e30"),
    "no-available": (_with_zones("no-available", [zone("node-0", {"name": CPU, "capacity": "4", "allocatable": "4"})]),
                     "available: missing"),
    "no-zones": ({"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
                  "metadata": {"name": "no-zones"}}, "zones: missing"),
    "ten-thousand-zones": (_with_zones("ten-thousand-zones",
                                       [zone(f"node-{i}", res_info(CPU, "4", "4")) for i in range(10_000)]),
                           "10000 entries, more than the 256 memtopo reads"),
    "bad-policy": ({**_with_zones("bad-policy", [zone("node-0", res_info(CPU, "4", "4"))]),
                    "attributes": [{"name": "topologyManagerPolicy", "value": "strict\u202e"}]},
                   "is not one of none, best-effort"),
}


def test_objects_memtopo_cannot_read_fail_their_node_only(api: StandInApiServer, tmp_path: Path) -> None:
    """Other publishers' quirks and broken objects (zone names that are not NUMA ids, quantities that are
    not whole counts, missing fields, 10,000 zones, unknown policies): each fails its own node with a
    reason naming the object and the field; a node with an odd but readable object (a zone node-75,
    beyond the kubelet's 64-bit mask) and every other node are judged as usual."""
    for obj, _ in BAD_OBJECTS.values():
        api.put_nrt(obj)
    odd = nrt("node-75-zone", [zone("node-0", res_info(CPU, "4", "4"), res_info(MEMORY, "8Gi", "8Gi")),
                               zone("node-75", res_info(CPU, "4", "4"), res_info(MEMORY, "8Gi", "8Gi"))],
              "SingleNUMANodePodLevel")
    api.put_nrt(odd)
    api.put_nrt(two_zones("good", (4, 4)))

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            names = [*BAD_OBJECTS, "node-75-zone", "good"]
            answer = await call(port, "filter", names_args(gu_pod("p", cpus=2), names))
            assert answer["Error"] == "" and answer["NodeNames"] == ["node-75-zone", "good"]
            for name, (_, fragment) in BAD_OBJECTS.items():
                reason = answer["FailedAndUnresolvableNodes"][name]
                assert reason.startswith(f"memtopo: NodeResourceTopology '{name}': "), reason
                assert fragment in reason and len(reason) < 500 and "\u202e" not in reason, reason
            # The unreadable objects are counted, and /readyz says so.
            _, doc = await readyz(port)
            assert doc["noderesourcetopologies"]["errors"] == len(BAD_OBJECTS)
    run(body())


# ---- API server trouble ---------------------------------------------------------------------------------
def test_api_server_trouble_is_a_stale_view_in_readyz_and_a_metric(api: StandInApiServer, tmp_path: Path) -> None:
    """500s, garbage and a hang while the watches are broken: /readyz turns 503 once the view has been
    stale for longer than --nrt-max-age, saying why, and the metrics say since when; the verbs keep
    answering from the last view meanwhile. A 410 relists. When the server answers again, all recovers."""
    api.put_nrt(two_zones("n1", (4, 4)))

    async def body() -> None:
        async with extender(api, tmp_path, max_age=1.0) as port:
            api.fail_with = 500
            api.drop_watches()
            doc = await wait_ready(port, want=503)
            assert doc["status"] == "stale"
            assert "500" in doc["noderesourcetopologies"]["last_error"]
            _, _, raw = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            stale = [line for line in raw.decode().splitlines()
                     if line.startswith('memtopo_extender_view_stale_seconds{resource="noderesourcetopologies"}')]
            assert stale and float(stale[0].split()[-1]) > 1.0
            # The verbs still answer, from the last view.
            assert (await call(port, "filter", names_args(gu_pod("p"), ["n1"])))["NodeNames"] == ["n1"]
            # Garbage instead of JSON, then a hang: still no traceback, still stale.
            api.fail_with = 0
            api.inject("garbage", body=b"\xff\xfe not json", times=6)
            api.inject("hang", path="/apis/", times=2)
            api.drop_watches()
            await asyncio.sleep(0.5)
            assert (await readyz(port))[0] in (200, 503)
            # While the watches are down a node appears and the server compacts its history: the watch
            # from before is 410 Gone, and the informer lists again.
            api.faults.clear()
            api.fail_with = 503
            api.drop_watches()
            await asyncio.sleep(0.3)
            api.put_nrt(two_zones("n2", (4, 4)))
            api.compact()
            api.fail_with = 0
            doc = await wait_ready(port, want=200)
            assert doc["status"] == "ok"

            async def n2_known() -> bool:
                return await filter_ok(port, gu_pod("p"), ["n2"]) == ["n2"]
            await until(n2_known)
            _, doc = await readyz(port)
            assert doc["noderesourcetopologies"]["relists"] >= 1
    run(body())


def test_a_watch_line_that_is_not_an_event_breaks_that_watch_only(api: StandInApiServer, tmp_path: Path) -> None:
    api.put_nrt(two_zones("n1", (4, 4)))

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            api.inject("watch_line", body=b'{"type": "MODIFIED", "object": [1, 2]}')
            api.inject("watch_line", body=b"\x00\x01 garbage")
            api.put_nrt(two_zones("n1", (0, 0)))

            async def seen() -> bool:
                answer = await call(port, "filter", names_args(gu_pod("p"), ["n1"]))
                return bool(answer["FailedNodes"])
            await until(seen)
            assert (await readyz(port))[0] == 200
    run(body())


# ---- wrong-typed requests -------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "fragment"), [
    (b"{not json", "not JSON"),
    (b'{"NodeNames": ["n1"]}', "Pod is missing"),
    (b'{"Pod": [], "NodeNames": ["n1"]}', "Pod is missing"),
    (b'{"Pod": {}, "NodeNames": [1]}', "NodeNames is not a list of strings"),
    (b'{"Pod": {"spec": {"containers": {"a": 1}}}, "NodeNames": ["n1"]}', "spec.containers: not a list"),
    (b'{"Pod": {"spec": {"containers": [{"resources": {"requests": {"cpu": "lots"}}}]}}, "NodeNames": ["n1"]}',
     "lots"),
    (b'{"Pod": {"status": {"qosClass": "Platinum"}}, "NodeNames": ["n1"]}', "is not a QoS class"),
])
def test_wrong_typed_requests_are_error_answers(api: StandInApiServer, tmp_path: Path, raw: bytes,
                                                fragment: str) -> None:
    api.put_nrt(two_zones("n1"))

    async def body() -> None:
        async with extender(api, tmp_path) as port:
            for verb in ("filter", "prioritize"):
                status, _, text = await exchange(port, post(f"/scheduler/{verb}", raw, AUTH))
                answer = json.loads(text)
                assert status == 200 and fragment in answer["Error"] and "Traceback" not in answer["Error"], answer
    run(body())


_json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
_arg_keys = st.sampled_from(["Pod", "pod", "NodeNames", "Nodes", "items", "metadata", "name", "spec", "containers",
                             "initContainers", "resources", "requests", "limits", "cpu", "memory",
                             "huawei.com/Ascend910", "status", "qosClass", "annotations", "memtopo.io/policy",
                             "PodName", "PodNamespace", "Node"])


@settings(deadline=None, max_examples=200)
@given(json_like(_json_scalars, _arg_keys, max_leaves=30), st.sampled_from(["filter", "prioritize", "bind"]))
def test_any_json_to_any_verb_over_the_nrt_fleet_is_an_answer_or_an_error(args: Any, verb: str) -> None:
    """Nodes as the informer would hold them (fed through its callback, no API server): whatever the
    caller sends, an answer or an Error, never an internal error or a traceback."""
    from memtopo.extender.auth import Caller
    from memtopo.extender.nrt import NrtFleet, read_object
    from memtopo.extender.service import Extender

    async def main() -> tuple[int, Any]:
        fleet = NrtFleet(KubeApi("http://127.0.0.1:9"))
        for name in ("n1", "n2"):
            fleet.nrt_changed(name, read_object(two_zones(name)))
        fleet.nrt_changed("bad", read_object({"metadata": {"name": "bad"}}))
        extender = Extender(fleet, auth=token_auth_static())
        return await extender.answer(verb, json.dumps(args).encode(), Caller(token=TOKEN))

    status, answer = asyncio.run(main())
    assert status == 200
    if isinstance(answer, dict) and answer.get("Error"):
        assert "internal" not in answer["Error"] and "Traceback" not in answer["Error"], answer
    elif verb == "prioritize":
        assert isinstance(answer, list) and all(0 <= h["Score"] <= 10 for h in answer)
    else:
        assert verb == "filter" and answer["Error"] == ""


_TOKEN_DIR: list[Path] = []


def token_auth_static() -> Authenticator:
    """An authenticator accepting TOKEN, from a file made once for the module."""
    import tempfile

    if not _TOKEN_DIR:
        _TOKEN_DIR.append(Path(tempfile.mkdtemp(prefix="memtopo-token-")))
    return token_auth(_TOKEN_DIR[0])
