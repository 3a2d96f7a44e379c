"""Two replicas of the extender (``--fleet nrt``) behind one Service, one killed mid-way: scheduling goes on
and no NUMA zone is promised twice.

Both replicas read one **stand-in** API server (bench/k8s_standin.py; not a Kubernetes API server). The
test plays kube-scheduler as it drives an extender: one pod at a time through filter and prioritize,
the best node taken, and the bind sent without waiting for it (kube-scheduler binds asynchronously and
starts the next pod's cycle at once), a bind answered with an Error putting the pod back in the queue.
Its calls go to either replica, as a Service spreads them; one that cannot be reached is tried on the
other, as the Service's endpoints drop a dead pod; a call the dead replica was answering fails, as it
would for kube-scheduler, and a bind that fails puts its pod back in the queue. Pods that bind
concurrently race for the same zones: the claim each bind writes and reads back before its Binding
decides the race (the second test makes one race certain)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

from bench.k8s_standin import StandInApiServer
from memtopo.cli.controller import listener_routes
from memtopo.cli.extender import ExtenderOptions
from memtopo.controller.server import RunningController, start_controller
from memtopo.k8s.kubeapi import KubeApi
from tests.extender.nrt_cluster import AUTH, FAST, api, gu_pod, placement_of, token_auth, two_zones, wait_ready
from tests.http_client import exchange, post

__all__ = ["api"]  # the stand-in fixture

NODES = ("n1", "n2", "n3")  # two zones of 4 CPUs each: six pods of 4 CPUs fit, one per zone
PODS = [f"p{i}" for i in range(8)]


class Replicas:
    """The Service in front of the replicas: each call to the next live one, a dead one skipped."""

    def __init__(self, running: list[RunningController]) -> None:
        self.running = running
        self.alive = [True] * len(running)
        self.turn = itertools.count()
        self.calls = [0] * len(running)

    async def call(self, verb: str, doc: Any) -> Any:
        for _ in range(len(self.running)):
            i = next(self.turn) % len(self.running)
            if not self.alive[i]:
                continue
            http = self.running[i].http
            assert http is not None
            try:
                status, _, raw = await exchange(http.port, post(f"/scheduler/{verb}", json.dumps(doc).encode(), AUTH))
            except ConnectionRefusedError:
                continue  # the Service no longer sends here
            assert status == 200, raw
            self.calls[i] += 1
            return json.loads(raw)
        raise AssertionError("no replica answered")

    async def kill(self, i: int) -> None:
        self.alive[i] = False
        await self.running[i].stop(0)


async def schedule(replicas: Replicas, api: StandInApiServer, kill_after: int,
                   claim_ttl: float) -> tuple[dict[str, str], set[str]]:
    """kube-scheduler's loop; (pod → node bound, pods found unschedulable). A pod is unschedulable once it
    fits nowhere, no bind is in flight, and nothing was bound for longer than a claim lives (a claim the
    killed replica left on a zone lapses by then)."""
    queue = list(PODS)
    attempts = dict.fromkeys(PODS, 0)
    bound: dict[str, str] = {}
    unschedulable: set[str] = set()
    binds: set[asyncio.Task[None]] = set()
    killed = False
    progress = [time.monotonic()]

    async def bind(name: str, node: str) -> None:
        try:
            answer = await replicas.call("bind", {"PodName": name, "PodNamespace": "default",
                                                  "PodUID": f"uid-{name}", "Node": node})
        except (OSError, EOFError):  # the replica died under this call: a failed bind, as for kube-scheduler
            answer = {"Error": "connection lost"}
        if answer["Error"]:
            queue.append(name)  # back in the queue: kube-scheduler tries the pod again
        else:
            bound[name] = node
            progress[0] = time.monotonic()

    deadline = time.monotonic() + 120
    while (queue or binds) and time.monotonic() < deadline:
        if not queue:
            await asyncio.sleep(0.02)
            binds = {t for t in binds if not t.done()}
            continue
        if not killed and len(bound) >= kill_after:
            await replicas.kill(0)
            killed = True
        name = queue.pop(0)
        assigned = api.pods[("default", name)].get("spec", {}).get("nodeName")
        if assigned:  # its informer shows the pod bound (a bind whose answer was lost did bind it)
            bound[name] = assigned
            continue
        attempts[name] += 1
        pod = gu_pod(name)
        answer = await replicas.call("filter", {"Pod": pod, "NodeNames": list(NODES)})
        assert answer["Error"] == ""
        fits = answer["NodeNames"]
        if not fits:
            failed = {**answer["FailedNodes"], **answer["FailedAndUnresolvableNodes"]}
            assert all(r.startswith("TopologyAffinityError") for r in failed.values()), failed
            quiet = time.monotonic() - progress[0] > claim_ttl + 1
            if attempts[name] >= 3 and quiet and not [t for t in binds if not t.done()]:
                unschedulable.add(name)
            else:
                queue.append(name)
                await asyncio.sleep(0.1)
            continue
        scores = await replicas.call("prioritize", {"Pod": pod, "NodeNames": fits})
        best = max(scores, key=lambda h: h["Score"])["Host"]
        task = asyncio.create_task(bind(name, best))
        binds.add(task)
        # The next pod's cycle starts while this bind runs (no await): the binds race.
        await asyncio.sleep(0)
    await asyncio.gather(*binds)
    return bound, unschedulable


def test_two_replicas_one_killed_midway_schedule_every_zone_once(api: StandInApiServer, tmp_path: Path) -> None:
    for node in NODES:
        api.put_nrt(two_zones(node, (4, 4)))
    for name in PODS:
        api.put_pod(gu_pod(name))

    async def body() -> None:
        running: list[RunningController] = []
        for _ in range(2):
            kube = KubeApi(api.url, timeout_s=5.0)
            options = ExtenderOptions(fleet="nrt", kube=kube, auth=token_auth(tmp_path), informer=FAST,
                                      claim_ttl=5.0)
            running.append(await start_controller("127.0.0.1:0", http="127.0.0.1:0", kube=kube,
                                                  http_routes=listener_routes(options)))
        try:
            for r in running:
                assert r.http is not None
                await wait_ready(r.http.port)
            replicas = Replicas(running)
            bound, unschedulable = await schedule(replicas, api, kill_after=3, claim_ttl=5.0)
        finally:
            for r in running:
                await r.stop(0)
        # Scheduling went on after replica 0 died: all six zones hold a pod, the last two fit nowhere.
        assert len(bound) == 6 and unschedulable == set(PODS) - set(bound)
        assert replicas.calls[0] > 0 and replicas.calls[1] > 0 and not replicas.alive[0]
        # No zone promised twice: each bound pod's placement names one zone of its node, all different,
        # and what the pods claim in a zone never exceeds what it has.
        zones = [(node, tuple(placement_of(api, name)["zones"])) for name, node in bound.items()]
        assert len(set(zones)) == 6 and all(len(z) == 1 for _, z in zones)
        for name, node in bound.items():
            placed = placement_of(api, name)
            assert placed["node"] == node == api.pods[("default", name)]["spec"]["nodeName"]
            assert placed["claims"] == {str(placed["zones"][0]): {"cpu": 4, "memory": 1 << 30}}
        # Every Binding the API server took was for a pod bound once.
        assert sorted(b["metadata"]["name"] for b in api.bindings) == sorted(bound)
    asyncio.run(body())


def test_two_binds_racing_for_one_zone_on_two_replicas_one_wins(api: StandInApiServer, tmp_path: Path) -> None:
    """The race made certain: replica 0's bind of pod a chose zone 0 and its claim is held up on the way
    to the API server; meanwhile replica 1 binds pod b, which sees no claim and takes zone 0 too. When
    a's claim lands, a reads b's back, gives its claim up and answers an Error; tried again, a gets zone 1."""
    import threading

    api.put_nrt(two_zones("n1", (4, 4)))
    for name in ("a", "b"):
        api.put_pod(gu_pod(name))
    release = threading.Event()
    api.held[("PATCH", "/api/v1/namespaces/default/pods/a")] = release

    async def body() -> None:
        running: list[RunningController] = []
        for _ in range(2):
            kube = KubeApi(api.url, timeout_s=10.0)
            options = ExtenderOptions(fleet="nrt", kube=kube, auth=token_auth(tmp_path), informer=FAST)
            running.append(await start_controller("127.0.0.1:0", http="127.0.0.1:0", kube=kube,
                                                  http_routes=listener_routes(options)))
        try:
            ports = []
            for r in running:
                assert r.http is not None
                await wait_ready(r.http.port)
                ports.append(r.http.port)

            async def bind(port: int, name: str) -> Any:
                doc = {"PodName": name, "PodNamespace": "default", "PodUID": f"uid-{name}", "Node": "n1"}
                _, _, raw = await exchange(port, post("/scheduler/bind", json.dumps(doc).encode(), AUTH), 30)
                return json.loads(raw)

            slow = asyncio.create_task(bind(ports[0], "a"))
            while not [r for r in api.requests if r.method == "PATCH" and r.path.endswith("/pods/a")]:
                await asyncio.sleep(0.01)
            assert await bind(ports[1], "b") == {"Error": ""}
            assert placement_of(api, "b")["zones"] == [0]
            release.set()
            lost = await slow
            assert "zone node-0 has 0 cpu left for the 4 this pod claimed" in lost["Error"], lost
            assert "another bind claimed it meanwhile" in lost["Error"]
            meta = api.pods[("default", "a")]["metadata"]
            assert "memtopo.io/placement" not in meta.get("annotations", {}) and "nodeName" not in api.pods[
                ("default", "a")]["spec"]
            # kube-scheduler tries a again: zone 1.
            api.held.clear()
            assert await bind(ports[0], "a") == {"Error": ""}
            assert placement_of(api, "a")["zones"] == [1]
            _, _, metrics = await exchange(ports[0], b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert 'memtopo_extender_failures_total{reason="conflict",verb="bind"} 1.0' in metrics.decode()
        finally:
            for r in running:
                await r.stop(0)
    asyncio.run(body())
