"""The scheduler extender's contract over the agents' fleet (``--fleet agents``): request and answer JSON
shaped as kube-scheduler sends and reads them (k8s.io/kube-scheduler/extender/v1: Go field names,
capitalised; NodeNames with nodeCacheCapable, a NodeList without), over a real controller's HTTP
listener with the extender's routes put together as ``memtopo controller serve`` does. Topologies are
the fixture hosts of tests/fleet_nodes.py stored in the controller's fleet directly; the API
server for bind is a stand-in (bench/k8s_standin.py: pods, bindings and their list, not a Kubernetes API
server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.k8s_standin import StandInApiServer
from memtopo.cli.controller import listener_routes
from memtopo.cli.extender import ExtenderOptions
from memtopo.controller.fleet import Hello
from memtopo.controller.server import RunningController, start_controller
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.extender import agents, ask, ledger
from memtopo.extender.agents import AgentsFleet
from memtopo.extender.auth import Authenticator, Caller
from memtopo.extender.service import Extender
from memtopo.extender.wire import ExtenderError
from memtopo.httpserve import Limits
from memtopo.k8s import kubeapi
from memtopo.k8s.kubeapi import KubeApi
from memtopo.planner import fleet
from memtopo.planner.errors import PlanError
from memtopo.v1 import topology_pb2 as pb
from tests.extender.pods import npu_pod, pod
from tests.fixtures import SYNTH as FIXTURES
from tests.fixtures import extracted
from tests.fleet_nodes import node, npu
from tests.http_client import exchange, post
from tests.pki import make_certificate, pki

__all__ = ["pki"]  # the PKI fixture (a CA, server and client certificates), used by the client-certificate test


def gh200(name: str) -> fleet.FleetNode:
    topo = discover(ProbeContext.at_root(extracted(FIXTURES / "gh200" / "root.tar.gz")))
    topo.node_name = name
    return fleet.FleetNode(name, topo)




def names_args(p: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """ExtenderArgs with nodeCacheCapable: true."""
    return {"Pod": p, "Nodes": None, "NodeNames": names}


def node_item(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {"podCIDR": "10.0.0.0/24"}, "status": {"allocatable": {"cpu": "64"}}}


def list_args(p: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """ExtenderArgs with nodeCacheCapable: false: a v1.NodeList."""
    return {"Pod": p, "Nodes": {"metadata": {"resourceVersion": "7"}, "items": [node_item(n) for n in names]},
            "NodeNames": None}


def hold(running: RunningController, nodes: list[fleet.FleetNode]) -> None:
    """Put each node into the controller's fleet as an agent link would (hello, snapshot)."""
    f = running.fleet
    for n in nodes:
        assert n.topology is not None
        c = f.connect(Hello(n.name, f"inst-{n.name}"), "stand-in-peer")
        f.snapshot(c.session, n.topology)
        if not n.connected:
            f.disconnect(c.session)


Body = Callable[[RunningController, int], Awaitable[None]]


TOKEN = "test-token-0123456789"
AUTH = f"Authorization: Bearer {TOKEN}\r\n"


def token_auth(tmp: Path) -> Authenticator:
    path = tmp / "token"
    path.write_text(TOKEN + "\n")
    return Authenticator(token_file=str(path))


def with_fleet(nodes: list[fleet.FleetNode], body: Body, kube: KubeApi | None = None, refresh_s: float = 3600,
               auth: Authenticator | None = None) -> None:
    async def main() -> None:
        options = ExtenderOptions(kube=kube, refresh_s=refresh_s, auth=auth)
        running = await start_controller("127.0.0.1:0", http="127.0.0.1:0", kube=kube,
                                         http_routes=listener_routes(options))
        try:
            hold(running, nodes)
            assert running.http is not None
            await body(running, running.http.port)
        finally:
            await running.stop(0)
    asyncio.run(main())


async def call(port: int, verb: str, doc: Any, extra: str = AUTH) -> Any:
    status, headers, raw = await exchange(port, post(f"/scheduler/{verb}", json.dumps(doc).encode(), extra))
    assert status == 200 and headers["content-type"] == "application/json"
    return json.loads(raw)


def fleet_of(running: RunningController) -> AgentsFleet:
    found = running.state.extender
    assert isinstance(found, AgentsFleet)
    return found


def busy(*ids: int) -> Callable[[pb.MemoryTopology], None]:
    def edit(topo: pb.MemoryTopology) -> None:
        for i in ids:
            npu(i, running="true")(topo)
    return edit


def sick(*ids: int) -> Callable[[pb.MemoryTopology], None]:
    def edit(topo: pb.MemoryTopology) -> None:
        for i in ids:
            npu(i, health="Critical")(topo)
    return edit


def ascend_fleet() -> list[fleet.FleetNode]:
    return [node("910", "free"), node("910", "half", busy(0, 1, 2, 4)), node("910", "sick7", sick(7)),
            node("910", "tight", busy(0, 1, 4, 5, 6)), node("p800", "kunlun"),
            node("910", "gone", connected=False)]


# ---- filter --------------------------------------------------------------------------------------------
def test_filter_with_node_names_passes_fitting_nodes_and_fails_the_rest_with_reasons() -> None:
    nodes = ascend_fleet()

    async def body(running: RunningController, port: int) -> None:
        names = ["free", "half", "sick7", "tight", "kunlun", "gone", "ghost"]
        answer = await call(port, "filter", names_args(npu_pod(4), names))
        assert set(answer) == {"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
        assert answer["Error"] == ""
        # The same decision through planner.fleet: the nodes it says fit are the ones filter keeps.
        doc = fleet.decide("hccs", {"request": 4}, nodes)
        fits = {n["name"] for n in doc["nodes"] if n["fits"]}
        assert answer["NodeNames"] == [n for n in names if n in fits] == ["free", "sick7"]
        # half: ring 4–7 has 3 free, ring 0–3 has 1 — busy NPUs, which preemption may free.
        assert set(answer["FailedNodes"]) == {"half", "tight"}
        assert "no HCCS ring is entirely free" in answer["FailedNodes"]["half"]
        unres = answer["FailedAndUnresolvableNodes"]
        assert set(unres) == {"kunlun", "gone", "ghost"}
        assert "not an 8-NPU node" in unres["kunlun"] and "not connected" in unres["gone"]
        assert unres["ghost"] == agents.UNKNOWN_NODE
    with_fleet(nodes, body)


def test_fewer_healthy_npus_than_asked_is_unresolvable() -> None:
    async def body(running: RunningController, port: int) -> None:
        answer = await call(port, "filter", names_args(npu_pod(8), ["free", "sick7", "half"]))
        assert answer["NodeNames"] == ["free"]
        assert "sick7" in answer["FailedAndUnresolvableNodes"] and "half" in answer["FailedNodes"]
    with_fleet(ascend_fleet(), body)


def test_filter_with_a_node_list_answers_the_same_node_objects() -> None:
    async def body(running: RunningController, port: int) -> None:
        args = list_args(npu_pod(4), ["free", "tight", "kunlun"])
        answer = await call(port, "filter", args)
        assert answer["Error"] == "" and "NodeNames" not in answer
        assert answer["Nodes"]["items"] == [node_item("free")]
        assert set(answer["FailedNodes"]) == {"tight"} and set(answer["FailedAndUnresolvableNodes"]) == {"kunlun"}
    with_fleet(ascend_fleet(), body)


def test_field_names_are_matched_case_insensitively() -> None:
    async def body(running: RunningController, port: int) -> None:
        answer = await call(port, "filter", {"pod": npu_pod(8), "nodenames": ["free", "half"]})
        assert answer["NodeNames"] == ["free"] and answer["Error"] == ""
    with_fleet(ascend_fleet(), body)


def test_an_empty_node_list_is_an_empty_answer_not_an_error() -> None:
    async def body(running: RunningController, port: int) -> None:
        assert await call(port, "filter", names_args(npu_pod(1), [])) == {
            "NodeNames": [], "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""}
        answer = await call(port, "filter", {"Pod": npu_pod(1), "Nodes": {"items": None}})
        assert answer["Nodes"]["items"] == [] and answer["Error"] == ""
        assert await call(port, "prioritize", names_args(npu_pod(1), [])) == []
    with_fleet(ascend_fleet(), body)


def test_a_pod_asking_nothing_memtopo_places_passes_through() -> None:
    async def body(running: RunningController, port: int) -> None:
        for p in (pod(requests={"cpu": "2", "memory": "4Gi"}),
                  npu_pod(4, annotations={"memtopo.io/policy": "none"})):
            answer = await call(port, "filter", names_args(p, ["half", "kunlun", "ghost"]))
            assert answer == {"NodeNames": ["half", "kunlun", "ghost"], "FailedNodes": {},
                              "FailedAndUnresolvableNodes": {}, "Error": ""}
            scores = await call(port, "prioritize", names_args(p, ["half", "kunlun", "ghost"]))
            assert scores == [{"Host": "half", "Score": 0}, {"Host": "kunlun", "Score": 0},
                              {"Host": "ghost", "Score": 0}]
    with_fleet(ascend_fleet(), body)


@pytest.mark.parametrize(("raw", "fragment"), [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"NodeNames": ["a"]}', "Pod is missing"),
    (b'{"Pod": {}, "NodeNames": "a"}', "NodeNames is not a list"),
    (b'{"Pod": {}}', "neither NodeNames nor Nodes"),
    (b'{"Pod": {}, "NodeNames": ["ok", ""]}', "is not a node name"),
    (b'{"Pod": {}, "NodeNames": ["' + b"n" * 300 + b'"]}', "is not a node name"),
    (b'{"Pod": {}, "Nodes": {"items": [{"metadata": {}}]}}', "has no metadata.name"),
    (b'{"Pod": {"spec": {"containers": [{"resources": {"limits": {"huawei.com/Ascend910": "3"}}}]}}, '
     b'"NodeNames": ["free"]}', "not 3"),
    (b'{"Pod": {"spec": {"containers": [{"resources": {"requests": {"cpu": "lots"}}}]}}, '
     b'"NodeNames": ["free"]}', "is not a quantity"),
    (b'{"Pod": {"metadata": {"annotations": {"memtopo.io/policy": "best"}}}, "NodeNames": ["free"]}',
     "memtopo.io/policy"),
    (b'{"Pod": {"metadata": {"annotations": {"memtopo.io/workload": "fast"}}}, "NodeNames": ["free"]}', "workload"),
    (b"[" * 100_000, "not JSON"),
])
def test_malformed_requests_are_answered_with_error_and_200(raw: bytes, fragment: str) -> None:
    async def body(running: RunningController, port: int) -> None:
        for verb in ("filter", "prioritize"):
            status, _, text = await exchange(port, post(f"/scheduler/{verb}", raw))
            answer = json.loads(text)
            assert status == 200 and fragment in answer["Error"], answer
            assert "Traceback" not in answer["Error"]
    with_fleet(ascend_fleet(), body)


def test_the_body_limit_is_one_mebibyte() -> None:
    async def body(running: RunningController, port: int) -> None:
        names = [f"n{i:07d}" for i in range(200_000)]
        big = json.dumps(names_args(pod(), names)).encode()
        assert len(big) > Limits.max_body_bytes
        status, _, text = await exchange(port, post("/scheduler/filter", big))
        # Refused before it is read; Go's case-insensitive decoder reads "error" as Error.
        assert status == 413 and "limit" in json.loads(text)["error"]
        fits = json.dumps(names_args(pod(), names[:60_000])).encode()
        assert len(fits) <= Limits.max_body_bytes
        answer = await call(port, "filter", json.loads(fits))
        assert len(answer["NodeNames"]) == 60_000
    with_fleet([], body)


# ---- prioritize ----------------------------------------------------------------------------------------
def test_prioritize_is_a_monotone_mapping_of_the_hccs_score() -> None:
    nodes = [node("910", "free"), node("910", "one-busy", busy(0)), node("910", "ring-busy", busy(0, 1)),
             node("910", "three", busy(0, 1, 2)), node("910", "sick7", sick(7)), node("910", "sick7b", sick(7)),
             node("910", "full", busy(*range(8)))]
    names = [n.name for n in nodes] + ["ghost"]

    async def body(running: RunningController, port: int) -> None:
        scores = {h["Host"]: h["Score"] for h in await call(port, "prioritize", names_args(npu_pod(1), names))}
        assert set(scores) == set(names)
        doc = fleet.decide("hccs", {"request": 1}, nodes)
        ranked = [n for n in doc["nodes"] if n["fits"]]
        assert scores[doc["chosen"][0]] == 10
        for a in ranked:
            for b in ranked:
                if a["score"] > b["score"]:
                    assert scores[a["name"]] > scores[b["name"]]
                elif a["score"] == b["score"]:
                    assert scores[a["name"]] == scores[b["name"]]
        assert scores["full"] == 0 and scores["ghost"] == 0
        assert all(1 <= scores[n["name"]] <= 10 for n in ranked)
    with_fleet(nodes, body)


# ---- xpu, place ----------------------------------------------------------------------------------------
def test_xpu_filter_and_prioritize_follow_the_ledger_of_handed_out_devices() -> None:
    nodes = [node("p800", "x1"), node("p800", "x2"), node("910", "npu")]

    async def body(running: RunningController, port: int) -> None:
        p = pod(limits={"kunlunxin.com/xpu": "4"})
        fleet_of(running).ledger.record("earlier-pod", ledger.Allocation("x1", ask.XPU_RESOURCE, (0, 4)))
        answer = await call(port, "filter", names_args(p, ["x1", "x2", "npu"]))
        doc = fleet.decide("xpu", {"request": 4, "allocated": {"x1": [0, 4]}}, nodes)
        assert answer["NodeNames"] == [n["name"] for n in doc["nodes"] if n["fits"]] == ["x2"]
        assert "NumaNotFit" in answer["FailedNodes"]["x1"] and "npu" in answer["FailedAndUnresolvableNodes"]
        # Two cards: x1 (half-used halves) is the better MTF fit than the empty x2.
        small = pod(limits={"kunlunxin.com/xpu": "2"})
        scores = {h["Host"]: h["Score"] for h in await call(port, "prioritize", names_args(small, ["x1", "x2"]))}
        chosen = fleet.decide("xpu", {"request": 2, "allocated": {"x1": [0, 4]}}, nodes)["chosen"]
        assert scores[chosen] == 10 and scores["x1"] != scores["x2"]
    with_fleet(nodes, body)


def test_a_gpu_pod_is_placed_by_the_place_policy_with_its_requests_and_annotations() -> None:
    nodes = [gh200("gh-a"), node("p800", "x1")]

    async def body(running: RunningController, port: int) -> None:
        p = pod(requests={"cpu": "8", "memory": "16Gi"}, limits={"nvidia.com/gpu": "1"},
                annotations={"memtopo.io/workload": "gpu-heavy"})
        answer = await call(port, "filter", names_args(p, ["gh-a", "x1"]))
        doc = fleet.decide("place", {"cpus": 8, "gpus": 1, "memory_gb": 16, "workload": "gpu-heavy"}, nodes)
        assert answer["NodeNames"] == [n["node"] for n in doc["nodes"] if n["fits"]] == ["gh-a"]
        assert "x1" in answer["FailedAndUnresolvableNodes"]
        scores = await call(port, "prioritize", names_args(p, ["gh-a", "x1"]))
        assert scores == [{"Host": "gh-a", "Score": 10}, {"Host": "x1", "Score": 0}]
        # allow-cxl and memory-policy annotations reach the request; a bad one is an Error.
        bad = pod(limits={"nvidia.com/gpu": "1"}, annotations={"memtopo.io/allow-cxl": "yes"})
        assert "allow-cxl" in (await call(port, "filter", names_args(bad, ["gh-a"])))["Error"]
    with_fleet(nodes, body)


# ---- bind ----------------------------------------------------------------------------------------------
@pytest.fixture
def api() -> Iterator[StandInApiServer]:
    """The shared stand-in API server (bench/k8s_standin.py), in a thread of its own: the controller
    under test runs its own event loop."""
    server = StandInApiServer()
    server.start_in_thread()
    yield server
    server.close()


def binding_args(name: str, uid: str, node_name: str) -> dict[str, Any]:
    return {"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node_name}


def test_bind_writes_the_device_annotation_then_the_binding_and_the_ledger_holds_the_devices(
        api: StandInApiServer, tmp_path: Path) -> None:
    nodes = [node("910", "n1"), node("910", "n2")]
    api.pods[("default", "a")] = npu_pod(4, name="a", uid="ua")
    api.pods[("default", "b")] = npu_pod(4, name="b", uid="ub")
    api.pods[("default", "c")] = npu_pod(8, name="c", uid="uc")

    async def body(running: RunningController, port: int) -> None:
        assert await call(port, "bind", binding_args("a", "ua", "n1")) == {"Error": ""}
        annotations = api.pods[("default", "a")]["metadata"]["annotations"]
        assert annotations["huawei.com/Ascend910"] == "Ascend910-0,Ascend910-1,Ascend910-2,Ascend910-3"
        assert json.loads(annotations["memtopo.io/allocation"]) == {"node": "n1", "resource": "huawei.com/Ascend910",
                                                                     "ids": [0, 1, 2, 3]}
        assert api.bindings[-1]["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
        assert api.bindings[-1]["metadata"]["uid"] == "ua"
        # n1's first ring is taken now: an 8-NPU pod fails there (preemption could free it).
        answer = await call(port, "filter", names_args(npu_pod(8), ["n1", "n2"]))
        assert answer["NodeNames"] == ["n2"] and "n1" in answer["FailedNodes"]
        # The second 4-NPU pod gets the other ring of n1.
        assert await call(port, "bind", binding_args("b", "ub", "n1")) == {"Error": ""}
        assert api.pods[("default", "b")]["metadata"]["annotations"]["huawei.com/Ascend910"] == \
            "Ascend910-4,Ascend910-5,Ascend910-6,Ascend910-7"
        # n1 is full: binding an 8-NPU pod there is refused with the reason, and nothing is written.
        refused = await call(port, "bind", binding_args("c", "uc", "n1"))
        assert "no longer fits" in refused["Error"] and "nodeName" not in api.pods[("default", "c")]["spec"]
        # A refresh from the API server's bound pods gives the same ledger.
        extender = fleet_of(running)
        fresh = ledger.DeviceLedger()
        reader = KubeApi(api.url)
        fresh.replace((await reader.list(kubeapi.core("pods"), {"fieldSelector": ledger.BOUND_PODS})).items, 0.0)
        await reader.close()
        assert fresh.allocated(ask.NPU_RESOURCE) == extender.ledger.allocated(ask.NPU_RESOURCE) == {
            "n1": frozenset(range(8))}
        # Pod a ends: after the next refresh its ring is free again.
        del api.pods[("default", "a")]
        await extender.refresh_once()
        assert extender.ledger.allocated(ask.NPU_RESOURCE) == {"n1": frozenset(range(4, 8))}
    with_fleet(nodes, body, kube=KubeApi(api.url), auth=token_auth(tmp_path))


def test_bind_errors_are_answered_with_error(api: StandInApiServer, tmp_path: Path) -> None:
    api.pods[("default", "a")] = npu_pod(1, name="a", uid="ua")

    async def body(running: RunningController, port: int) -> None:
        assert "uid" in (await call(port, "bind", binding_args("a", "other", "n1")))["Error"]
        assert "not found" in (await call(port, "bind", binding_args("zz", "u", "n1")))["Error"]
        assert "Node is missing" in (await call(port, "bind", {"PodName": "a", "PodNamespace": "default"}))["Error"]
        hostile = (await call(port, "bind", binding_args("a", "ua", "../nodes\x1b[2J")))["Error"]
        assert hostile == "bind: '../nodes\\x1b[2J' is not a Kubernetes node name (a lowercase DNS-1123 subdomain " \
                          "of at most 253 characters)"
        assert "../" not in "".join(r.path for r in api.requests)
        api.fail_binding = True
        answer = await call(port, "bind", binding_args("a", "ua", "n1"))
        assert "already assigned" in answer["Error"]
        assert fleet_of(running).ledger.allocated(ask.NPU_RESOURCE) == {}  # a failed bind hands nothing out
    with_fleet([node("910", "n1")], body, kube=KubeApi(api.url), auth=token_auth(tmp_path))


def test_a_slow_api_server_fails_its_own_bind_and_never_holds_up_the_next(api: StandInApiServer,
                                                                          tmp_path: Path) -> None:
    """The bind lock covers the choice of devices, not the API calls: while the API server sits on pod a's
    annotation (until the client's deadline), pod b is bound at once, to the other ring; a's devices
    go back to the ledger when its bind fails."""
    api.pods[("default", "a")] = npu_pod(4, name="a", uid="ua")
    api.pods[("default", "b")] = npu_pod(4, name="b", uid="ub")
    api.held[("PATCH", "/api/v1/namespaces/default/pods/a")] = threading.Event()  # never released

    async def body(running: RunningController, port: int) -> None:
        extender = fleet_of(running)
        slow = asyncio.create_task(call(port, "bind", binding_args("a", "ua", "n1")))
        while not [r for r in api.requests if r.method == "PATCH" and r.path.endswith("/pods/a")]:
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(call(port, "bind", binding_args("b", "ub", "n1")), 30) == {"Error": ""}
        assert not slow.done()  # b did not wait for a
        assert api.pods[("default", "b")]["metadata"]["annotations"]["huawei.com/Ascend910"] == \
            "Ascend910-4,Ascend910-5,Ascend910-6,Ascend910-7"
        answer = await asyncio.wait_for(slow, 60)
        assert answer["Error"] == ("bind: default/a → n1: annotate pod default/a: no answer within 2 s")
        assert extender.ledger.allocated(ask.NPU_RESOURCE) == {"n1": frozenset(range(4, 8))}
        assert "nodeName" not in api.pods[("default", "a")]["spec"]
    with_fleet([node("910", "n1")], body, kube=KubeApi(api.url, timeout_s=2.0), auth=token_auth(tmp_path))


def test_bind_without_an_api_server_is_an_error_and_metrics_count_each_verb(tmp_path: Path) -> None:
    async def body(running: RunningController, port: int) -> None:
        assert "--kube-api" in (await call(port, "bind", binding_args("a", "u", "n1")))["Error"]
        await call(port, "filter", names_args(npu_pod(1), ["n1"]))
        await call(port, "filter", {"Pod": None})
        _, _, raw = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        text = raw.decode()
        assert 'memtopo_extender_requests_total{verb="filter"} 2.0' in text
        assert 'memtopo_extender_requests_total{verb="bind"} 1.0' in text
        assert 'memtopo_extender_failures_total{reason="no_api",verb="bind"} 1.0' in text
        assert 'memtopo_extender_failures_total{reason="invalid_request",verb="filter"} 1.0' in text
        assert 'memtopo_extender_request_duration_seconds_count{verb="filter"} 2.0' in text
    with_fleet([node("910", "n1")], body, auth=token_auth(tmp_path))


# ---- the pod's requests --------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "value"), [
    ("500m", Fraction(1, 2)), ("2", Fraction(2)), ("1Gi", Fraction(1 << 30)), ("1.5G", Fraction(1_500_000_000)),
    ("1e3", Fraction(1000)), ("128974848", Fraction(128974848)), (".5", Fraction(1, 2)), ("+3", Fraction(3)),
])
def test_quantities(text: str, value: Fraction) -> None:
    assert ask.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["-1", "1.2.3", "5 Gi", "1e999", "1e19", "9Ei", "Gi", "", "0x10", "1" * 100])
def test_bad_quantities_are_typed_errors(text: str) -> None:
    with pytest.raises(ExtenderError):
        ask.parse_quantity(text)


def test_effective_requests_take_limits_sum_containers_and_the_largest_init_container() -> None:
    p = {"spec": {"containers": [{"resources": {"requests": {"cpu": "1500m"}, "limits": {"kunlunxin.com/xpu": "1"}}},
                                 {"resources": {"requests": {"cpu": "1", "kunlunxin.com/xpu": "1"}}}],
                  "initContainers": [{"resources": {"requests": {"cpu": "4"}}}]}}
    assert ask.pod_requests(p) == {"cpu": Fraction(4), "kunlunxin.com/xpu": Fraction(2)}
    asked = ask.pod_ask(p)
    assert asked.policy == "xpu" and asked.request == {"request": 2}
    gpu = ask.pod_ask(pod(requests={"cpu": "2500m", "memory": "512Mi"}, limits={"amd.com/gpu": "2"},
                          annotations={"memtopo.io/memory-policy": "interleave", "memtopo.io/allow-cxl": "true"}))
    assert gpu.policy == "place"
    assert gpu.request == {"cpus": 3, "gpus": 2, "memory_gb": 0.5,
                           "constraints": {"memory_policy": "interleave", "allow_cxl_memory": True}}
    with pytest.raises(ExtenderError, match="both"):
        ask.pod_ask(pod(limits={"huawei.com/Ascend910": "1", "kunlunxin.com/xpu": "1"}))
    named = ask.pod_ask(pod(limits={"huawei.com/Ascend910": "1", "kunlunxin.com/xpu": "2"},
                            annotations={"memtopo.io/policy": "xpu"}))
    assert named.policy == "xpu" and named.request == {"request": 2}


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                  max_size=4), max_leaves=20)
_keys = st.sampled_from(["metadata", "spec", "annotations", "containers", "initContainers", "resources",
                         "requests", "limits", "cpu", "memory", "huawei.com/Ascend910", "kunlunxin.com/xpu",
                         "nvidia.com/gpu", "memtopo.io/policy", "memtopo.io/allow-cxl"])
_pods = st.recursive(_json, lambda inner: st.dictionaries(_keys, inner, max_size=4), max_leaves=30)


@settings(deadline=None, max_examples=300)
@given(_pods)
def test_any_pod_json_is_asked_or_refused_with_a_typed_error(p: Any) -> None:
    if not isinstance(p, dict):
        return
    try:
        asked = ask.pod_ask(p)
    except ExtenderError:
        return
    if asked.policy is not None:
        # Whatever the pod said, the request it became is one the policy accepts or refuses as such.
        try:
            fleet.evaluate(asked.policy, dict(asked.request), [])
        except PlanError as exc:
            assert exc.code == "invalid_request"


def test_ledger_keeps_recent_binds_until_a_listing_shows_them_and_ignores_broken_annotations() -> None:
    now = [100.0]
    book = ledger.DeviceLedger(clock=lambda: now[0])
    book.record("u1", ledger.Allocation("n1", ask.XPU_RESOURCE, (0, 1)))
    # A listing that started before the bind does not show it: the bind stays.
    book.replace([], listed_at=99.0)
    assert book.allocated(ask.XPU_RESOURCE) == {"n1": frozenset({0, 1})}
    broken = {"metadata": {"uid": "u2", "annotations": {ledger.ALLOCATION_ANNOTATION: "{nope"}},
              "spec": {"nodeName": "n2"}}
    out_of_range = {"metadata": {"uid": "u3", "annotations": {
        ledger.ALLOCATION_ANNOTATION: json.dumps({"resource": ask.XPU_RESOURCE, "ids": [9]})}},
        "spec": {"nodeName": "n3"}}
    # A listing that started after it and lacks the pod: the pod is gone.
    book.replace([broken, out_of_range], listed_at=101.0)
    assert book.allocated(ask.XPU_RESOURCE) == {}


def test_prioritize_ranks_among_the_nodes_it_is_given_and_follows_fleet_changes() -> None:
    nodes = [node("910", "free"), node("910", "one-busy", busy(0)), node("910", "three", busy(0, 1, 2))]

    async def body(running: RunningController, port: int) -> None:
        names = ["free", "one-busy", "three"]
        first = await call(port, "filter", names_args(npu_pod(1), names))
        assert first["NodeNames"] == names
        scores = {h["Host"]: h["Score"] for h in await call(port, "prioritize", names_args(npu_pod(1), names))}
        best = max(scores, key=lambda n: scores[n])
        # Another filter removed the best node: the best of the rest gets 10 (the filter's judgement
        # is reused, the rank is taken among the nodes given).
        rest = [n for n in names if n != best]
        again = {h["Host"]: h["Score"] for h in await call(port, "prioritize", names_args(npu_pod(1), rest))}
        assert max(again.values()) == 10 and set(again) == set(rest)
        # The fleet changes (a new snapshot of that node, every NPU busy): the reused judgement is stale.
        topo = nodes[names.index(best)].topology
        assert topo is not None
        full = pb.MemoryTopology()
        full.CopyFrom(topo)
        busy(*range(8))(full)
        full.generation = 2
        c = running.fleet.connect(Hello(best, f"inst-{best}", generation=2), "stand-in-peer")
        running.fleet.snapshot(c.session, full)
        running.state.changes.bump(best)
        now = {h["Host"]: h["Score"] for h in await call(port, "prioritize", names_args(npu_pod(1), names))}
        assert now[best] == 0 and max(now.values()) == 10
    with_fleet(nodes, body)


_args = st.dictionaries(st.sampled_from(["Pod", "pod", "Nodes", "NodeNames", "nodenames", "PodName", "Node",
                                          "PodNamespace", "Other"]), _pods, max_size=4)


@settings(deadline=None, max_examples=200)
@given(_args, st.sampled_from(["filter", "prioritize", "bind"]))
def test_any_json_to_any_verb_is_an_answer_or_an_error_never_a_failure(args: dict[str, Any], verb: str) -> None:
    from memtopo.controller.fleet import Fleet as ControllerFleet
    from memtopo.controller.metrics import ControllerMetrics
    from memtopo.controller.state import ControllerState

    async def main() -> Any:
        f = ControllerFleet()
        c = f.connect(Hello("free", "inst-free"), "stand-in-peer")
        f.snapshot(c.session, _free910())
        extender = Extender(AgentsFleet(ControllerState(f, ControllerMetrics())))
        status, answer = await extender.answer(verb, json.dumps(args).encode(), Caller())
        assert status == (403 if verb == "bind" else 200)
        return answer

    answer = asyncio.run(main())
    if isinstance(answer, dict) and answer.get("Error"):
        assert "internal" not in answer["Error"], answer
        if verb == "bind":  # no caller is authenticated here: bind writes to the cluster
            assert "authenticates no caller" in answer["Error"]
    elif verb == "prioritize":
        assert isinstance(answer, list) and all(set(h) == {"Host", "Score"} for h in answer)
    else:
        assert verb == "filter" and answer["Error"] == ""


@cache
def _free910() -> pb.MemoryTopology:
    t = node("910", "free").topology
    assert t is not None
    return t



def test_device_views_are_derived_as_snapshots_arrive_not_at_the_first_filter() -> None:
    """The controller's snapshot road (planner.fleet.SnapshotNodes, shared with the Place RPC) derives
    each device view as the snapshot arrives; the extender's filter then finds them."""
    async def body(running: RunningController, port: int) -> None:
        road = running.state.nodes
        assert road.views("n1") == {}
        hold(running, [node("910", "n1"), node("p800", "x1")])
        running.state.changes.bump("n1")
        running.state.changes.bump("x1")
        for _ in range(200):
            if len(road.views("n1")) == 2 and len(road.views("x1")) == 2:
                break
            await asyncio.sleep(0.05)
        views = {name: road.views(name) for name in ("n1", "x1")}
        assert isinstance(views["n1"]["hccs"], fleet.DeviceView) and "not an 8-XPU node" in str(views["n1"]["xpu"])
        assert isinstance(views["x1"]["xpu"], fleet.DeviceView) and "not an 8-NPU node" in str(views["x1"]["hccs"])
        # The filter then uses them as they are (the same objects).
        before = road.views("n1")["hccs"]
        assert (await call(port, "filter", names_args(npu_pod(8), ["n1", "x1"])))["NodeNames"] == ["n1"]
        assert road.views("n1")["hccs"] is before
    with_fleet([], body)


def test_bind_refuses_callers_it_cannot_authenticate(api: StandInApiServer, tmp_path: Path) -> None:
    """bind writes to the cluster: with no way to authenticate configured it refuses everyone; with a
    token, a caller without it or with another gets 403 and nothing is written."""
    api.pods[("default", "a")] = npu_pod(1, name="a", uid="ua")

    async def open_body(running: RunningController, port: int) -> None:
        doc = json.dumps(binding_args("a", "ua", "n1")).encode()
        status, _, raw = await exchange(port, post("/scheduler/bind", doc))
        assert status == 403 and "authenticates no caller" in json.loads(raw)["Error"]
        # Filter, which changes nothing, still answers.
        assert (await call(port, "filter", names_args(npu_pod(1), ["n1"]), extra=""))["NodeNames"] == ["n1"]
    with_fleet([node("910", "n1")], open_body, kube=KubeApi(api.url))

    async def token_body(running: RunningController, port: int) -> None:
        for extra in ("", "Authorization: Bearer wrong\r\n", "Authorization: Basic dXNlcjpwdw==\r\n"):
            for verb in ("filter", "bind"):
                doc = binding_args("a", "ua", "n1") if verb == "bind" else names_args(npu_pod(1), ["n1"])
                status, _, raw = await exchange(port, post(f"/scheduler/{verb}", json.dumps(doc).encode(), extra))
                assert status == 403 and json.loads(raw)["Error"], (extra, verb)
        assert not api.bindings and "huawei.com/Ascend910" not in api.pods[("default", "a")]["metadata"]["annotations"]
        assert await call(port, "bind", binding_args("a", "ua", "n1")) == {"Error": ""}
        _, _, metrics = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert 'memtopo_extender_unauthenticated_total{verb="bind"} 3.0' in metrics.decode()
    with_fleet([node("910", "n1")], token_body, kube=KubeApi(api.url), auth=token_auth(tmp_path))


# ---- kube-scheduler's client certificate ----------------------------------------------------------------
async def tls_call(port: int, path: str, body: bytes, context: Any, method: str = "POST") -> tuple[int, bytes]:
    import ssl

    from tests.http_client import read_response

    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="localhost")
    try:
        media = "Content-Type: application/json\r\n" if method == "POST" else ""
        head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n{media}Content-Length: {len(body)}\r\n\r\n".encode()
        writer.write(head + body)
        await writer.drain()
        status, _, raw = await read_response(reader)
        return status, raw
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


def test_with_a_client_ca_every_verb_needs_a_certificate_it_signed(pki: dict[str, str], api: StandInApiServer,
                                                                  tmp_path: Path) -> None:
    """The shipped setting: HTTPS with --extender-client-ca. kube-scheduler's certificate (signed by the
    client CA) may bind; a client without one gets 403 on every verb but still reads /healthz and /readyz
    (the kubelet's probes have none); a certificate of another CA is refused at the handshake; with
    --extender-allow-subject, only that common name."""
    import ssl

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from memtopo.controller.server import http_ssl_context

    api.pods[("default", "a")] = npu_pod(1, name="a", uid="ua")
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    rogue_ca = make_certificate("rogue CA", rogue_key, None, None, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "rogue.pem").write_bytes(make_certificate("client", key, rogue_ca, rogue_key, ca=False).public_bytes(
        serialization.Encoding.PEM))
    (tmp_path / "rogue.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))

    def client(cert: str | None = None, key_file: str | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=pki["ca"])
        if cert is not None:
            context.load_cert_chain(cert, key_file)
        return context

    async def run(subjects: tuple[str, ...]) -> None:
        kube = KubeApi(api.url)
        options = ExtenderOptions(kube=kube, auth=Authenticator(client_ca=True, subjects=subjects))
        running = await start_controller("127.0.0.1:0", http="127.0.0.1:0", kube=kube,
                                         http_ssl=http_ssl_context(pki["server"], pki["server_key"], pki["ca"]),
                                         http_routes=listener_routes(options))
        try:
            hold(running, [node("910", "n1")])
            assert running.http is not None
            port = running.http.port
            bind = json.dumps(binding_args("a", "ua", "n1")).encode()
            filt = json.dumps(names_args(npu_pod(1), ["n1"])).encode()
            anonymous = client()
            for path, body in (("/scheduler/filter", filt), ("/scheduler/bind", bind)):
                status, raw = await tls_call(port, path, body, anonymous)
                assert status == 403 and "needs a client certificate" in json.loads(raw)["Error"]
            assert (await tls_call(port, "/healthz", b"", anonymous, "GET"))[0] == 200
            assert (await tls_call(port, "/readyz", b"", anonymous, "GET"))[0] == 200
            with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
                await tls_call(port, "/scheduler/filter", filt, client(str(tmp_path / "rogue.pem"),
                                                                       str(tmp_path / "rogue.key")))
            scheduler = client(pki["client"], pki["client_key"])
            status, raw = await tls_call(port, "/scheduler/bind", bind, scheduler)
            if subjects and "client" not in subjects:
                assert status == 403 and "is not one --extender-allow-subject names" in json.loads(raw)["Error"]
                assert not api.bindings
            else:
                assert (status, json.loads(raw)) == (200, {"Error": ""}) and api.bindings[-1]["target"]["name"] == "n1"
        finally:
            await running.stop(0)

    asyncio.run(run(("kube-scheduler",)))
    asyncio.run(run(()))
