"""The enforcement's API side (agent/k8s_pods.py) against the STAND-IN API server (bench/k8s_standin.py:
real HTTP list/watch with field selectors, merge patches, Events; not a Kubernetes API server, none can
run here), through the real client and informer."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from bench.k8s_standin import StandInApiServer
from memtopo.agent.k8s_pods import ApiReporter, InformerPods, compact_pod
from memtopo.backoff import Backoff
from memtopo.k8s import enforcement as ef
from memtopo.k8s.kubeapi import KubeApi, KubeApiError

NODE = "enforce-node"
WAIT = 30.0  # generous: event waits, never a speed assertion


def pod(name: str, node: str = NODE, cpu: str = "2", **extra: Any) -> dict[str, Any]:
    res = {"limits": {"cpu": cpu, "memory": "1Gi"}, "requests": {"cpu": cpu, "memory": "1Gi"}}
    obj: dict[str, Any] = {"metadata": {"name": name, "namespace": "ml", "creationTimestamp": "2026-01-01T00:00:00Z",
                                        "generation": 1},
                           "spec": {"nodeName": node, "containers": [{"name": "app", "resources": res,
                                                                      "image": "busybox", "env": [{"name": "X"}]}]},
                           "status": {"phase": "Running"}}
    obj.update(extra)
    return obj


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 120))


async def eventually(cond: Callable[[], bool]) -> None:
    async def loop() -> None:
        while not cond():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(loop(), WAIT)


def test_only_this_nodes_pods_and_not_synced_before_the_first_list() -> None:
    """Before the first complete list the source is not synced (an empty store is not "no pods"), then
    it holds the pods bound to this node only, and every change of one wakes its reader."""
    async def main() -> None:
        server = StandInApiServer()
        await server.start()
        server.put_pod(pod("mine"))
        server.put_pod(pod("theirs", node="other-node"))
        gate = server.held[("GET", "/api/v1/pods")] = threading.Event()
        source = InformerPods(KubeApi(server.url), NODE, backoff=Backoff(0.01, 0.05))
        task = asyncio.create_task(source.run())
        await eventually(lambda: bool(server.requests))
        assert not source.synced() and source.bound_pods() == []
        assert source.status() == f"listing pods of node {NODE}"
        gate.set()
        await eventually(source.synced)
        assert [p["metadata"]["name"] for p in source.bound_pods()] == ["mine"]
        assert server.requests[0].query["fieldSelector"] == f"spec.nodeName={NODE}"
        assert source.status() == f"1 pods on node {NODE}"
        # A status update (the kubelet's: a container started) reaches the reader at once.
        waiting = asyncio.create_task(source.wait_changed())
        updated = server.pods[("ml", "mine")]
        updated["status"]["containerStatuses"] = [{"name": "app", "started": True}]
        server.put_pod(updated)
        await asyncio.wait_for(waiting, WAIT)
        # A pod bound here later arrives; a deleted one goes.
        server.put_pod(pod("late"))
        server.delete_pod("ml", "mine")
        await eventually(lambda: [p["metadata"]["name"] for p in source.bound_pods()] == ["late"])
        source.stop()
        await asyncio.wait_for(task, WAIT)
        await server.stop()
    run(main)


def test_a_broken_watch_keeps_the_pods_it_had() -> None:
    """Silence is not deletion: while the API server answers 503 the store keeps its pods (their CPUs
    stay held), and the status says the watch is broken."""
    async def main() -> None:
        server = StandInApiServer()
        await server.start()
        server.put_pod(pod("mine"))
        source = InformerPods(KubeApi(server.url, timeout_s=2.0), NODE, backoff=Backoff(0.01, 0.05))
        task = asyncio.create_task(source.run())
        await eventually(source.synced)
        server.fail_with = 503
        server.drop_watches()
        await eventually(lambda: "watch broken" in source.status() and "HTTP 503" in source.status())
        assert source.synced() and [p["metadata"]["name"] for p in source.bound_pods()] == ["mine"]
        server.fail_with = 0
        await eventually(lambda: "watch broken" not in source.status())
        source.stop()
        await asyncio.wait_for(task, WAIT)
        await server.stop()
    run(main)


def test_the_reporter_annotates_the_pod_it_means_and_records_events() -> None:
    async def main() -> None:
        server = StandInApiServer()
        await server.start()
        stored = server.put_pod(pod("train"))
        uid = stored["metadata"]["uid"]
        api = KubeApi(server.url)
        reporter = ApiReporter(api, NODE)
        await reporter.annotate("ml", "train", uid, ef.STATUS_ANNOTATION, '{"state":"applied"}')
        assert server.pods[("ml", "train")]["metadata"]["annotations"] == {ef.STATUS_ANNOTATION: '{"state":"applied"}'}
        (patch,) = [r for r in server.requests if r.method == "PATCH"]
        assert patch.content_type == "application/merge-patch+json"
        assert patch.body == {"metadata": {"uid": uid, "annotations": {ef.STATUS_ANNOTATION: '{"state":"applied"}'}}}
        # The pod was deleted and created again under its name: the old pod's report does not land.
        server.delete_pod("ml", "train")
        server.put_pod(pod("train"))
        with pytest.raises(KubeApiError) as caught:
            await reporter.annotate("ml", "train", uid, ef.STATUS_ANNOTATION, '{"state":"failed"}')
        assert caught.value.status == 422 and "immutable" in caught.value.reason
        assert "annotations" not in server.pods[("ml", "train")]["metadata"]
        await reporter.event("ml", "train", uid, "Normal", "CPUsPinned", "exclusive CPUs 4-5")
        await reporter.event("ml", "train", uid, "Warning", "CPUPinningFailed", "x" * 5000)
        first, second = server.events
        assert first["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "train", "namespace": "ml",
                                           "uid": uid}
        assert (first["type"], first["reason"], first["message"]) == ("Normal", "CPUsPinned", "exclusive CPUs 4-5")
        assert first["source"] == {"component": "memtopo-agent", "host": NODE}
        assert second["type"] == "Warning" and len(second["message"]) == 1024
        await api.close()
        await server.stop()
    run(main)


def test_compact_pods_keep_only_what_the_enforcement_reads() -> None:
    placement = json.dumps({"node": NODE, "cpus": "4-5"})
    big = pod("p", metadata={"name": "p", "namespace": "ml", "uid": "u1", "generation": 3,
                             "creationTimestamp": "2026-01-01T00:00:00Z", "labels": {"a": "b"},
                             "annotations": {ef.PLACEMENT_ANNOTATION: placement, "other": "x" * 10_000},
                             "managedFields": [{"manager": "kubectl"}] * 50})
    small = compact_pod(big)
    assert small == {
        "metadata": {"uid": "u1", "name": "p", "namespace": "ml", "generation": 3,
                     "creationTimestamp": "2026-01-01T00:00:00Z", "annotations": {ef.PLACEMENT_ANNOTATION: placement}},
        "spec": {"nodeName": NODE, "containers": [{"name": "app", "resources": {
            "limits": {"cpu": "2", "memory": "1Gi"}, "requests": {"cpu": "2", "memory": "1Gi"}}}]},
        "status": {"phase": "Running"}}
    # An oversized placement is kept only as far as it shows it is too large.
    huge = compact_pod(pod("h", metadata={"name": "h", "uid": "u2", "annotations": {
        ef.PLACEMENT_ANNOTATION: "[" * (1 << 20)}}))
    assert len(huge["metadata"]["annotations"][ef.PLACEMENT_ANNOTATION]) == ef.MAX_PLACEMENT_BYTES + 1


_QUANTITY = st.sampled_from(["1", "2", "500m", "1500m", "0", "1Gi", "64Mi", "2.5", "-1", "lots", 3, None])
_AMOUNTS = st.dictionaries(st.sampled_from(["cpu", "memory", "nvidia.com/gpu"]), _QUANTITY, max_size=3)
_RESOURCES = st.fixed_dictionaries({}, optional={"limits": _AMOUNTS | st.just("junk"),
                                                 "requests": _AMOUNTS | st.none()})
_CONTAINER = st.fixed_dictionaries({"name": st.sampled_from(["app", "side", "init", "", None]),
                                    "resources": _RESOURCES | st.none() | st.just("junk")})
_POD = st.fixed_dictionaries({
    "metadata": st.fixed_dictionaries({"uid": st.sampled_from(["u1", "", None]), "name": st.just("p"),
                                       "namespace": st.sampled_from(["ml", None])},
                                      optional={"annotations": st.dictionaries(
                                          st.sampled_from([ef.PLACEMENT_ANNOTATION, "x"]),
                                          st.sampled_from(['{"cpus": "2-3"}', "junk", '{"cpus": "99"}']), max_size=2),
                                          "generation": st.integers(0, 5) | st.just("2")}),
    "spec": st.fixed_dictionaries({"containers": st.lists(_CONTAINER, max_size=3) | st.just("junk")},
                                  optional={"initContainers": st.lists(_CONTAINER, max_size=2) | st.none()}),
    "status": st.fixed_dictionaries({}, optional={"phase": st.sampled_from(["Running", "Succeeded", "Pending"])}),
})


def _one_container(resources: object) -> dict[str, Any]:
    return {"metadata": {"uid": "u1", "name": "p", "namespace": "ml"},
            "spec": {"containers": [{"name": "app", "resources": resources}]}, "status": {}}


@given(_POD)
@example(_one_container("junk"))
@example(_one_container({"limits": "junk", "requests": {"cpu": "1"}}))
def test_the_enforcement_reads_a_compact_pod_as_it_reads_the_whole_pod(obj: dict[str, Any]) -> None:
    assert ef.pod_view(compact_pod(obj)) == ef.pod_view(obj)
