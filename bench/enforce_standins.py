"""Stand-ins for the API side of the CPU enforcement (agent/enforce.py's PodSource and PodReporter),
named as stand-ins: no API server runs here. ``StandinPods`` holds Pod objects as the API server
would list them for one node; ``StandinReporter`` records the annotations and Events it is asked to
write, and can be told to fail. Plus the node facts of this host and a helper that runs a pod on the
real containerd and returns its Pod object."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.containerd import Kubelet, Pod
from memtopo.agent.enforce import node_facts
from memtopo.hostfs import HostFS
from memtopo.k8s import enforcement as ef
from memtopo.k8s.facts import KubeletFacts
from memtopo.v1 import topology_pb2 as pb

NODE = "standin-node"


class StandinPods:
    """A stand-in for the informer's view of the pods bound to this node."""

    def __init__(self, synced: bool = True) -> None:
        self._synced = synced
        self.pods: dict[str, dict[str, Any]] = {}
        self._changed = asyncio.Event()

    def synced(self) -> bool:
        return self._synced

    def bound_pods(self) -> Sequence[Mapping[str, Any]]:
        return list(self.pods.values())

    async def wait_changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    def put(self, pod: dict[str, Any]) -> None:
        self.pods[pod["metadata"]["uid"]] = pod
        self._synced = True
        self._changed.set()

    def delete(self, uid: str) -> None:
        self.pods.pop(uid, None)
        self._changed.set()


class StandinReporter:
    """A stand-in for the API writer: records (namespace, name, uid, key, value) and Events."""

    def __init__(self) -> None:
        self.annotations: dict[str, dict[str, str]] = {}
        self.events: list[tuple[str, str, str, str]] = []  # (uid, type, reason, message)
        self.fail: Exception | None = None

    async def annotate(self, namespace: str, name: str, uid: str, key: str, value: str) -> None:
        if self.fail is not None:
            raise self.fail
        self.annotations.setdefault(uid, {})[key] = value

    async def event(self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        if self.fail is not None:
            raise self.fail
        self.events.append((uid, type_, reason, message))

    def status(self, uid: str) -> dict[str, Any]:
        import json

        value = self.annotations.get(uid, {}).get(ef.STATUS_ANNOTATION)
        return json.loads(value) if value else {}


def host_topology() -> pb.MemoryTopology:
    """This host's NUMA nodes and their CPUs, as discovery reports them (the part enforcement reads)."""
    topo = pb.MemoryTopology(node_name=NODE)
    base = Path("/sys/devices/system/node")
    from memtopo.cpulist import parse_cpulist

    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        nid = int(d.name[4:])
        cpus = parse_cpulist((d / "cpulist").read_text())
        mem_kb = next((int(line.split()[3]) for line in (d / "meminfo").read_text().splitlines()
                       if "MemTotal" in line), 0)
        topo.numa_nodes.add(id=nid, cpus=cpus, has_cpu=bool(cpus), has_memory=mem_kb > 0, memory_bytes=mem_kb * 1024)
    return topo


def host_node(reserved: Sequence[int] = ()) -> ef.NodeFacts:
    return node_facts(NODE, host_topology(), HostFS.at("/"), reserved)


def kubelet_facts(policy: str | None = "none", problem: str = "") -> KubeletFacts:
    return KubeletFacts(config_path="/var/lib/kubelet/config.yaml", problem=problem, cpu_manager_policy=policy)


def resources(cpu: str | None, memory: str | None = "64Mi") -> dict[str, Any]:
    limits = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    return {"limits": limits, "requests": dict(limits)} if limits else {}


def pod_object(pod: Pod, specs: Mapping[str, dict[str, Any]], annotations: Mapping[str, str] | None = None,
               created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    return {
        "metadata": {"uid": pod.uid, "name": pod.name, "namespace": pod.namespace, "generation": 1,
                     "creationTimestamp": created, "annotations": dict(annotations or {})},
        "spec": {"nodeName": NODE, "containers": [{"name": n, "resources": r} for n, r in specs.items()]},
        "status": {"phase": "Running"},
    }


def run_pod(kubelet: Kubelet, name: str, specs: Mapping[str, dict[str, Any]],
            annotations: Mapping[str, str] | None = None,
            created: str = "2026-01-01T00:00:00Z") -> tuple[Pod, dict[str, Any]]:
    pod = kubelet.run_pod(name, list(specs))
    return pod, pod_object(pod, specs, annotations, created)
