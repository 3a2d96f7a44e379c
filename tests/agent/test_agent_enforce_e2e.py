"""The whole enforcement loop: the agent PROCESS (``memtopo serve``, ``[kubernetes] enforce = true``) reads
the pods bound to its node from a STAND-IN API server (bench/k8s_standin.py: real HTTP list/watch,
merge patches, Events, server-side apply of the NRT; no Kubernetes API server can run here) through its
own informer, pins containers of a REAL containerd (bench/containerd.py, driven through CRI as the
kubelet drives it), and writes back to the stand-in: the pod's status annotation, an Event, and the
NodeResourceTopology whose available CPUs leave the pinned one out. An agent restarted while the API
server refuses to list moves nothing; deleting the pod gives its CPU back to the shared pool.

This host has 2 CPUs and one NUMA node: the lowest CPU stays shared, the other is pinned."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.containerd import Containerd, Kubelet, cgroup_cpuset
from bench.enforce_standins import host_node, resources
from bench.k8s_standin import StandInApiServer
from memtopo.k8s import cri
from memtopo.k8s import enforcement as ef
from tests.agents import Agent, wait_for
from tests.kustomize import ENFORCEMENT_VERBS, ENFORCING, PUBLISHER_VERBS, granted

NODE = "e2e-enforce-node"
HOST_CPUS = sorted(host_node().allocatable)
pytestmark = pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs at least 2 CPUs to share one and pin one")
WAIT = 60.0  # generous: a deadline that only ends a hang, never a speed assertion


def cpulist(cpus: list[int]) -> str:
    return ",".join(map(str, cpus)) if len(cpus) != 2 or cpus[1] != cpus[0] + 1 else f"{cpus[0]}-{cpus[1]}"


class Cluster:
    """The stand-in API server on a thread of its own; every change to it is made on its loop."""

    def __init__(self) -> None:
        self.server = StandInApiServer()
        self.server.add_node(NODE)
        self.url = self.server.start_in_thread()

    def call[R](self, fn: Callable[[], R]) -> R:
        return self.server.call(fn, WAIT)

    def bind(self, name: str, containers: dict[str, dict[str, Any]],
             annotations: dict[str, str] | None = None) -> str:
        """A pod bound to the node (as the scheduler's Binding leaves it), before the kubelet runs it."""
        uid = str(uuid.uuid4())
        pod = {"metadata": {"name": name, "namespace": "default", "uid": uid, "generation": 1,
                            "creationTimestamp": "2026-01-01T00:00:00Z", "annotations": dict(annotations or {})},
               "spec": {"nodeName": NODE, "containers": [{"name": n, "resources": r} for n, r in containers.items()]},
               "status": {"phase": "Pending"}}
        self.call(lambda: self.server.put_pod(pod))
        return uid

    def pod(self, name: str) -> dict[str, Any]:
        return self.call(lambda: json.loads(json.dumps(self.server.pods[("default", name)])))

    def status(self, name: str) -> dict[str, Any]:
        value = self.pod(name)["metadata"].get("annotations", {}).get(ef.STATUS_ANNOTATION)
        return json.loads(value) if value else {}

    def events(self, uid: str) -> list[tuple[str, str, str]]:
        return self.call(lambda: [(e["type"], e["reason"], e["source"].get("host", "")) for e in self.server.events
                                  if e["involvedObject"].get("uid") == uid])

    def nrt(self) -> tuple[dict[str, str], dict[str, str]]:
        """The published object's node-0 cpu resource and its top-level attributes."""
        def read() -> tuple[dict[str, str], dict[str, str]]:
            obj = self.server.objects.get(NODE)
            if obj is None:
                return {}, {}
            zone = next(z for z in obj["zones"] if z["name"] == "node-0")
            cpu = next(r for r in zone["resources"] if r["name"] == "cpu")
            return dict(cpu), {a["name"]: a["value"] for a in obj["attributes"]}
        return self.call(read)

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def kubelet(containerd: Containerd) -> Iterator[Kubelet]:
    k = containerd.kubelet()
    yield k
    for uid in list(k.pods):
        k.remove_pod(uid)


def start_agent(tmp: Path, cluster: Cluster, containerd: Containerd) -> Agent:
    (tmp / "kubelet.yaml").write_text("kind: KubeletConfiguration\ncpuManagerPolicy: none\n")
    extra = ('read_socket = ""\n[kubernetes]\nenabled = true\n'
             f'node_name = "{NODE}"\napi_server = "{cluster.url}"\npod_resources_socket = ""\n'
             f'kubelet_config = "{tmp / "kubelet.yaml"}"\nenforce = true\n'
             f'runtime_endpoint = "{containerd.endpoint}"\nenforce_interval_seconds = 1.0\n'
             'backoff_initial_seconds = 0.05\nbackoff_max_seconds = 0.5\n')
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
    agent = Agent(tmp, Path("/"), None, extra=extra, env=env)
    agent.start()
    return agent


def verb(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str]:
    """The RBAC (API group, resource, verb) a request to the stand-in needs."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if rest[:1] == ["namespaces"]:
        rest = rest[2:]
    resource, named = rest[0], len(rest) > 1
    if method == "GET":
        return group, resource, "get" if named else "watch" if query.get("watch") == "true" else "list"
    return group, resource, {"PATCH": "patch", "POST": "create", "PUT": "update", "DELETE": "delete"}[method]


def readyz(agent: Agent) -> dict[str, str]:
    checks: dict[str, str] = json.loads(agent.http("/readyz")[1])["checks"]
    return checks


def pid_of(containerd: Containerd, cid: str) -> int:
    with cri.CriClient(containerd.endpoint) as c:
        pid = c.container_status(cid).pid
    assert pid is not None
    return pid


def test_a_pod_bound_here_is_pinned_reported_survives_a_restart_and_is_released(
        tmp_path: Path, containerd: Containerd, kubelet: Kubelet) -> None:
    want, shared = HOST_CPUS[-1], [c for c in HOST_CPUS if c != HOST_CPUS[-1]]
    cluster = Cluster()
    agent = start_agent(tmp_path, cluster, containerd)
    try:
        # A pod with nothing exclusive, then one the extender placed on the last CPU.
        web_uid = cluster.bind("web", {"web": resources(None, None)})
        web = kubelet.run_pod("web", ["web"], uid=web_uid)
        web_pid = pid_of(containerd, web.containers["web"])
        placement = json.dumps({"node": NODE, "cpus": str(want), "memory": {"nodes": "0"}})
        uid = cluster.bind("train", {"app": resources("1")}, {ef.PLACEMENT_ANNOTATION: placement})
        train = kubelet.run_pod("train", ["app"], uid=uid)
        app_pid = pid_of(containerd, train.containers["app"])
        wait_for(lambda: cgroup_cpuset(app_pid) == (str(want), "0"), WAIT, "the container pinned")
        wait_for(lambda: cgroup_cpuset(web_pid)[0] == cpulist(shared), WAIT, "the shared pool without it")
        # What the pod is told, in the API server.
        wait_for(lambda: cluster.status("train").get("state") == "applied", WAIT, "the status annotation")
        assert cluster.status("train") | {"generation": 0} == {
            "state": "applied", "cpus": str(want), "mems": "0", "source": "placement",
            "containers": {"app": str(want)}, "generation": 0}
        wait_for(lambda: cluster.events(uid), WAIT, "the Event")
        assert cluster.events(uid)[0] == ("Normal", "CPUsPinned", NODE)
        assert "annotations" not in cluster.pod("web")["metadata"] or ef.STATUS_ANNOTATION not in (
            cluster.pod("web")["metadata"]["annotations"])
        # The NodeResourceTopology no longer offers the pinned CPU (PodResources would not say it).
        wait_for(lambda: cluster.nrt()[1].get("memtopo.io/cpu-enforcement") == "memtopo: 1 pods, 1 exclusive CPUs",
                 WAIT, "the NRT counting the pinned CPU")
        cpu, _ = cluster.nrt()
        assert int(cpu["available"]) == int(cpu["allocatable"]) - 1
        checks = readyz(agent)
        assert checks["enforce"].startswith("active: 1 pods pinned") and checks["enforce_pods"] == (
            f"2 pods on node {NODE}")

        # Restart while the API server refuses every pod list: nothing moves, nothing is offered.
        assert agent.stop() == 0
        cluster.call(lambda: cluster.server.inject("status", status=503, method="GET", path="/api/v1/pods",
                                                   times=10**6))
        agent = start_agent(tmp_path, cluster, containerd)
        wait_for(lambda: readyz(agent).get("enforce") == "waiting: the pod list has not arrived yet", WAIT,
                 "a pass without the pod list")
        assert "HTTP 503" in readyz(agent)["enforce_pods"]
        assert cgroup_cpuset(app_pid) == (str(want), "0") and cgroup_cpuset(web_pid)[0] == cpulist(shared)
        wait_for(lambda: cluster.nrt()[0].get("available") == "0", WAIT, "the NRT offering no CPU while unknown")
        cluster.call(cluster.server.faults.clear)
        wait_for(lambda: cluster.status("train").get("source") == "adopted", WAIT, "the pod adopted")
        assert cgroup_cpuset(app_pid) == (str(want), "0")
        assert not [e for e in agent.events("enforce_update_failed")]

        # Deleting the pod releases its CPU to the shared pool.
        cluster.call(lambda: cluster.server.delete_pod("default", "train"))
        kubelet.remove_pod(uid)
        wait_for(lambda: cgroup_cpuset(web_pid)[0] == cpulist(HOST_CPUS), WAIT, "the CPU back in the pool")
        wait_for(lambda: cluster.nrt()[1].get("memtopo.io/cpu-enforcement") == "memtopo: 0 pods, 0 exclusive CPUs",
                 WAIT, "the NRT offering it again")
        assert [e["pod_uid"] for e in agent.events("enforce_released")] == [uid]
        # Every call the agent made is one the enforce component's RBAC grants, and it needs them all.
        used = cluster.call(lambda: {verb(r.method, r.path, r.query) for r in cluster.server.requests})
        assert used - PUBLISHER_VERBS == ENFORCEMENT_VERBS and used <= granted(ENFORCING)
    finally:
        code = agent.stop() if agent.proc is not None and agent.proc.poll() is None else 0
        cluster.close()
    assert code == 0
