"""The NodeResourceTopology publisher against a STAND-IN API server (bench/k8s_standin.py: real HTTP,
server-side apply semantics for this one resource; not a Kubernetes API server, none can run here).
The publisher talks to it through its real client (memtopo.k8s.kubeapi)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from prometheus_client import CollectorRegistry

from bench.k8s_standin import StandInApiServer
from memtopo.agent.config import load_config
from memtopo.agent.daemon import EXIT_OK, Agent
from memtopo.agent.k8s_publisher import FIELD_MANAGER, Publisher, PublisherSettings
from memtopo.agent.sdnotify import Notifier
from memtopo.agent.state import TopologyState
from memtopo.k8s import podfingerprint as pfp
from memtopo.k8s.facts import DeviceGrant, EnforcedCpus, KubeletFacts, PodResourcesView
from memtopo.k8s.kubeapi import APPLY_PATCH as APPLY_CONTENT_TYPE
from memtopo.k8s.kubeapi import KubeApi
from memtopo.k8s.nrt import zone_nodes
from memtopo.k8s.podresources import PodResourcesError
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import lab_root

NODE = "gpu-node-1"


WAIT = 30.0  # generous: event waits, never a speed assertion


def topology(fingerprint: str, gpus: int = 2) -> pb.MemoryTopology:
    nodes = [pb.NumaNode(id=i, state=pb.NUMA_NODE_STATE_ONLINE, cpus=range(8 * i, 8 * i + 8),
                         memory_bytes=64 << 30, has_cpu=True, has_memory=True, domain=i,
                         distances=[10 if i == j else 21 for j in range(2)], distance_nodes=[0, 1])
             for i in range(2)]
    accs = [pb.Accelerator(index=i, id=f"GPU{i}", vendor="NVIDIA", model="H100", numa_node=i % 2,
                           uuid=f"GPU-{i:04d}", kind=pb.ACCELERATOR_KIND_GPU) for i in range(gpus)]
    domains = [pb.MemoryDomain(id=i, type=pb.MEMORY_DOMAIN_TYPE_DRAM, numa_nodes=[i], kernel_tier=-1) for i in range(2)]
    return pb.MemoryTopology(node_name=NODE, fingerprint=fingerprint, numa_nodes=nodes, accelerators=accs,
                             domains=domains)


def no_pods() -> PodResourcesView:
    raise PodResourcesError("no socket at /var/lib/kubelet/pod-resources/kubelet.sock")


def attr(obj: dict[str, Any], name: str) -> str | None:
    return next((a["value"] for a in obj.get("attributes", []) if a["name"] == name), None)


def available(obj: dict[str, Any], zone: str, resource: str) -> str:
    z = next(z for z in obj["zones"] if z["name"] == zone)
    return str(next(r for r in z["resources"] if r["name"] == resource)["available"])


class Harness:
    def __init__(self, server: StandInApiServer, *, host: str | None = None,
                 read_pods: Callable[[], PodResourcesView] = no_pods,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, timeout_s: float = 10.0,
                 **settings: Any) -> None:
        self.server = server
        self.state = TopologyState()
        self.registry = CollectorRegistry()
        settings.setdefault("pod_resources_seconds", 3600.0)
        self.publisher = Publisher(PublisherSettings(node_name=NODE, **settings), self.state,
                                   KubeApi(host or server.url, timeout_s=timeout_s), read_kubelet=KubeletFacts,
                                   read_pods=read_pods, registry=self.registry, sleep=sleep)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.publisher.run())

    async def stop(self) -> None:
        self.publisher.stop()
        if self.task is not None:
            await asyncio.wait_for(self.task, WAIT)
        await self.server.stop()

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


async def eventually(cond: Callable[[], bool]) -> None:
    """Wait (generously) until ``cond`` holds: the stand-in stores before the publisher reads its answer."""
    async def loop() -> None:
        while not cond():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(loop(), WAIT)


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 120))


def test_applies_with_field_manager_apply_content_type_and_node_owner() -> None:
    async def main() -> None:
        server = StandInApiServer()
        uid = server.add_node(NODE)
        await server.start()
        h = Harness(server)
        h.state.publish(topology("f1"))
        h.start()
        obj = await server.wait_stored(lambda o: True, WAIT)
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid}]
        assert obj["metadata"]["managedFields"][0]["manager"] == FIELD_MANAGER
        assert [z["name"] for z in obj["zones"]] == ["node-0", "node-1"]
        assert attr(obj, "memtopo.io/generation") == "1"
        patches = [r for r in server.requests if r.method == "PATCH"]
        assert [(r.content_type, r.query.get("fieldManager"), r.query.get("force"), r.status) for r in patches] == [
            (APPLY_CONTENT_TYPE, FIELD_MANAGER, None, 201)]
        await eventually(lambda: h.publisher.status() == (True, "applied generation 1"))
        assert h.metric("memtopo_k8s_nrt_published_generation") == 1
        assert h.metric("memtopo_k8s_nrt_applies_total", outcome="ok") == 1
        await h.stop()
    run(main)


def test_a_new_generation_is_applied_at_once_without_waiting_for_the_poll() -> None:
    async def main() -> None:
        server = StandInApiServer()
        server.add_node(NODE)
        await server.start()
        h = Harness(server)  # PodResources polled hourly: only the new generation can wake it
        h.state.publish(topology("f1", gpus=2))
        h.start()
        await server.wait_stored(lambda o: attr(o, "memtopo.io/generation") == "1", WAIT)
        h.state.publish(topology("f2", gpus=4))  # two more GPUs hot-plugged
        obj = await server.wait_stored(lambda o: attr(o, "memtopo.io/generation") == "2", WAIT)
        assert available(obj, "node-0", "nvidia.com/gpu") == "2"
        statuses = [r.status for r in server.requests if r.method == "PATCH"]
        assert statuses == [201, 200]
        assert obj["metadata"]["generation"] == 2
        await h.stop()
    run(main)


def test_a_pod_resources_change_is_applied_and_an_unchanged_poll_is_not() -> None:
    async def main() -> None:
        server = StandInApiServer()
        server.add_node(NODE)
        await server.start()
        view = {"now": PodResourcesView(pods=0)}
        polls: list[int] = []

        def read() -> PodResourcesView:
            polls.append(1)
            return view["now"]

        h = Harness(server, read_pods=read, pod_resources_seconds=0.05)
        h.state.publish(topology("f1"))
        h.start()
        await server.wait_stored(lambda o: available(o, "node-0", "nvidia.com/gpu") == "1", WAIT)
        while len(polls) < 5:  # several polls with nothing new
            await asyncio.sleep(0.05)
        assert len([r for r in server.requests if r.method == "PATCH"]) == 1
        view["now"] = PodResourcesView(assigned_devices=(DeviceGrant("nvidia.com/gpu", ("GPU-0000",), (0,)),), pods=1)
        obj = await server.wait_stored(lambda o: available(o, "node-0", "nvidia.com/gpu") == "0", WAIT)
        assert attr(obj, "memtopo.io/pod-resources") == "kubelet: 1 pods"
        assert attr(obj, "memtopo.io/generation") == "1"
        await h.stop()
    run(main)


def test_what_the_enforcement_pins_is_applied_at_once_with_the_pods_fingerprint() -> None:
    """With memtopo as the CPU manager, the CPUs its enforcement holds leave ``available`` as soon as it
    says they changed (PodResources polled hourly here: only the poke can wake the publisher), and the
    object carries NFD's pods fingerprint of the kubelet's pods."""
    async def main() -> None:
        server = StandInApiServer()
        server.add_node(NODE)
        await server.start()
        fingerprint = pfp.sign([("ml", "train-0"), ("default", "web")])
        h = Harness(server, read_pods=lambda: PodResourcesView(pods=2, pods_fingerprint=fingerprint))
        enforced = {"now": EnforcedCpus(False, note="waiting: the pod list has not arrived yet")}
        h.publisher.follow_enforcement(lambda: enforced["now"])
        h.state.publish(topology("f1"))
        h.start()
        obj = await server.wait_stored(lambda o: True, WAIT)
        assert available(obj, "node-0", "cpu") == "0" and available(obj, "node-1", "cpu") == "0"
        assert attr(obj, "nodeTopologyPodsFingerprint") == fingerprint
        assert attr(obj, "nodeTopologyPodsFingerprintMethod") == "all"
        enforced["now"] = EnforcedCpus(True, frozenset({2, 3, 9}), 2)
        h.publisher.poke()
        obj = await server.wait_stored(lambda o: available(o, "node-0", "cpu") == "6", WAIT)
        assert available(obj, "node-1", "cpu") == "7"
        assert attr(obj, "memtopo.io/cpu-enforcement") == "memtopo: 2 pods, 3 exclusive CPUs"
        assert attr(obj, "memtopo.io/generation") == "1"
        await h.stop()
    run(main)


def test_a_periodic_resync_restores_a_deleted_object_with_the_nodes_current_uid() -> None:
    async def main() -> None:
        server = StandInApiServer()
        server.add_node(NODE)
        await server.start()
        h = Harness(server, read_pods=PodResourcesView, pod_resources_seconds=0.05, resync_seconds=0.2)
        h.state.publish(topology("f1"))
        h.start()
        await server.wait_stored(lambda o: True, WAIT)
        del server.objects[NODE]  # deleted behind the agent's back; the Node registered again
        new_uid = server.add_node(NODE)
        obj = await server.wait_stored(lambda o: o["metadata"]["ownerReferences"][0]["uid"] == new_uid, WAIT)
        assert attr(obj, "memtopo.io/generation") == "1"
        assert [r.method for r in server.requests][:2] == ["GET", "PATCH"]
        await h.stop()
    run(main)


def test_unreachable_server_backs_off_reports_behind_then_catches_up() -> None:
    async def main() -> None:
        server = StandInApiServer()
        server.add_node(NODE)
        url = await server.start()
        port = int(url.rsplit(":", 1)[1])
        await server.stop()  # nothing listens there now
        delays: list[float] = []
        seen: list[tuple[bool, str, float | None]] = []
        h: Harness

        async def sleep(seconds: float) -> None:
            delays.append(seconds)
            seen.append((*h.publisher.status(), h.metric("memtopo_k8s_nrt_behind")))
            if len(delays) == 4:
                await server.start(port)  # the API server comes back
            await asyncio.sleep(0)

        h = Harness(server, host=url, sleep=sleep, backoff_initial_seconds=1.0, backoff_max_seconds=4.0)
        h.state.publish(topology("f1"))
        h.start()
        obj = await server.wait_stored(lambda o: True, WAIT)
        assert attr(obj, "memtopo.io/generation") == "1"
        assert len(delays) == 4
        # Exponential, capped, jittered over the upper half: 1, 2, 4, 4.
        for delay, cap in zip(delays, (1.0, 2.0, 4.0, 4.0), strict=True):
            assert cap / 2 <= delay <= cap
        assert all(not ready and msg.startswith("behind: generation 1 not applied") and behind == 1
                   for ready, msg, behind in seen)
        await eventually(lambda: h.publisher.status()[0] and h.metric("memtopo_k8s_nrt_behind") == 0)
        assert h.metric("memtopo_k8s_nrt_applies_total", outcome="unreachable") == 4
        await h.stop()
    run(main)


def test_server_errors_and_a_missing_node_are_retried() -> None:
    async def main() -> None:
        server = StandInApiServer()
        await server.start()
        delays: list[float] = []
        h: Harness

        async def sleep(seconds: float) -> None:
            delays.append(seconds)
            if len(delays) == 1:
                assert "404" in h.publisher.status()[1]
                server.add_node(NODE)
                server.fail_with = 503
            elif len(delays) == 2:
                assert "503" in h.publisher.status()[1]
                server.fail_with = 0
            await asyncio.sleep(0)

        h = Harness(server, sleep=sleep)
        h.state.publish(topology("f1"))
        h.start()
        await server.wait_stored(lambda o: True, WAIT)
        assert len(delays) == 2
        assert h.metric("memtopo_k8s_nrt_applies_total", outcome="rejected") == 1
        assert h.metric("memtopo_k8s_nrt_applies_total", outcome="unreachable") == 1
        await h.stop()
    run(main)


def test_a_field_owned_by_another_manager_is_a_conflict_unless_forced() -> None:
    async def main() -> None:
        server = StandInApiServer()
        server.add_node(NODE)
        await server.start()
        other = {"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
                 "metadata": {"name": NODE}, "zones": [{"name": "node-0", "type": "Node"}]}
        assert server.apply_as("nfd-topology-updater", copy.deepcopy(other))[0] == 201
        delays: list[float] = []
        messages: list[str] = []
        h: Harness

        async def sleep(seconds: float) -> None:
            delays.append(seconds)
            messages.append(h.publisher.status()[1])
            if len(delays) == 2:
                h.publisher.stop()
            await asyncio.sleep(0)

        h = Harness(server, sleep=sleep)
        h.state.publish(topology("f1"))
        h.start()
        await asyncio.wait_for(h.task, WAIT)  # type: ignore[arg-type]
        assert 'conflict with "nfd-topology-updater": .zones' in messages[0] and "409" in messages[0]
        assert server.objects[NODE]["zones"] == other["zones"]  # untouched
        assert h.metric("memtopo_k8s_nrt_applies_total", outcome="conflict") == 2
        await server.stop()

        forced = StandInApiServer()
        forced.add_node(NODE)
        await forced.start()
        forced.apply_as("nfd-topology-updater", copy.deepcopy(other))
        h2 = Harness(forced, force_conflicts=True)
        h2.state.publish(topology("f1"))
        h2.start()
        obj = await forced.wait_stored(lambda o: len(o["zones"]) == 2, WAIT)
        assert [m["manager"] for m in obj["metadata"]["managedFields"]] == [FIELD_MANAGER]
        assert [r.query.get("force") for r in forced.requests if r.method == "PATCH"] == ["true"]
        await h2.stop()
    run(main)


def test_the_stand_in_refuses_what_an_api_server_refuses() -> None:
    async def main() -> None:
        server = StandInApiServer()
        await server.start()
        url = f"{server.url}/apis/topology.node.k8s.io/v1alpha2/noderesourcetopologies/n1"
        good = ('{"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology", '
                '"metadata": {"name": "n1"}, "zones": [{"name": "node-0", "type": "Node"}]}')
        bad = good.replace('"type": "Node"', '"costs": [{"name": "node-0", "value": "near"}]')
        async with aiohttp.ClientSession() as s:
            async def patch(body: str, ctype: str, query: str) -> tuple[int, str]:
                async with s.patch(f"{url}?{query}", data=body, headers={"Content-Type": ctype}) as r:
                    return r.status, (await r.json())["kind"]
            assert await patch(good, "application/merge-patch+json", "fieldManager=x") == (415, "Status")
            assert await patch(good, APPLY_CONTENT_TYPE, "") == (400, "Status")
            assert await patch(bad, APPLY_CONTENT_TYPE, "fieldManager=x") == (422, "Status")
            assert "n1" not in server.objects
            assert await patch(good, APPLY_CONTENT_TYPE, "fieldManager=x") == (201, "NodeResourceTopology")
            assert await patch(good, APPLY_CONTENT_TYPE, "fieldManager=x") == (200, "NodeResourceTopology")
        assert server.objects["n1"]["metadata"]["generation"] == 1  # an identical apply changes nothing
        await server.stop()
    run(main)


def test_the_agent_publishes_when_kubernetes_is_enabled(tmp_path: Path) -> None:
    """The daemon's [kubernetes] section: the publisher runs as one of its tasks, /readyz carries its
    check and /metrics its series; a stop is still a clean exit."""
    async def main() -> None:
        server = StandInApiServer()
        server.add_node("lab-node")
        await server.start()
        config = tmp_path / "agent.toml"
        config.write_text(
            f'node_name = "lab-node"\nroot = "{lab_root("dual-socket-cxl")}"\nstate_dir = "{tmp_path / "state"}"\n'
            f'[listen]\nsocket = "{tmp_path / "agent.sock"}"\n'
            '[discovery]\ndebounce_seconds = 0.0\nudev = false\n[health]\nlisten = ""\n'
            f'[kubernetes]\nenabled = true\napi_server = "{server.url}"\npod_resources_socket = ""\n')
        agent = Agent(load_config(config), notifier=Notifier(None))
        run_task = asyncio.create_task(agent.run())
        obj = await server.wait_stored(lambda o: True, WAIT)
        topo = agent.state.current.topology  # type: ignore[union-attr]
        assert [z["name"] for z in obj["zones"]] == [f"node-{n.id}" for n in zone_nodes(topo)]
        assert attr(obj, "memtopo.io/pod-resources") == (
            "unavailable (kubernetes.pod_resources_socket is empty): available = allocatable")
        await eventually(lambda: agent.ready()[1]["kubernetes"] == "applied generation 1")
        assert agent.ready()[0]
        assert b"memtopo_k8s_nrt_behind 0.0" in agent.metrics.render()[0]
        agent.request_stop()
        assert await asyncio.wait_for(run_task, WAIT) == EXIT_OK
        await server.stop()
    run(main)


def test_an_api_server_answering_garbage_or_nothing_is_reported_and_retried_never_fatal() -> None:
    """200 with 2,000 bytes that are not UTF-8 once ended the publisher with UnicodeDecodeError (and the
    agent with it) and put the whole body in the log; a silent server was 'behind … (TimeoutError)'."""
    async def main() -> None:
        server = StandInApiServer()
        server.add_node(NODE)
        await server.start()
        server.inject("garbage", body=b"\xff\xfe" + bytes(range(256)) * 8, path="/api/v1/nodes/")
        server.inject("hang", path="/apis/topology.node.k8s.io/")
        messages: list[str] = []
        h: Harness

        async def sleep(seconds: float) -> None:
            messages.append(h.publisher.status()[1])
            await asyncio.sleep(0)

        with structlog.testing.capture_logs() as logs:
            h = Harness(server, sleep=sleep, timeout_s=1.0)
            h.state.publish(topology("f1"))
            h.start()
            await server.wait_stored(lambda o: True, WAIT)
        assert f"read Node {NODE}: the answer is not UTF-8 (at byte 0: b'\\xff\\xfe" in messages[0]
        assert messages[1] == f"behind: generation 1 not applied (apply NRT {NODE}: no answer within 1 s)"
        failed = [e for e in logs if e["event"] == "nrt_apply_failed"]
        assert [e["outcome"] for e in failed] == ["rejected", "unreachable"]
        assert all(len(e["error"]) < 200 for e in failed)
        await eventually(lambda: h.metric("memtopo_k8s_nrt_applies_total", outcome="ok") == 1)
        await h.stop()
    run(main)


def test_the_agent_keeps_serving_while_its_api_server_answers_garbage(tmp_path: Path) -> None:
    async def main() -> None:
        server = StandInApiServer()
        server.add_node("lab-node")
        await server.start()
        server.inject("garbage", body=b"\x81" * 2000, path="/api/v1/nodes/", times=10**6)
        config = tmp_path / "agent.toml"
        config.write_text(
            f'node_name = "lab-node"\nroot = "{lab_root("dual-socket-cxl")}"\nstate_dir = "{tmp_path / "state"}"\n'
            f'[listen]\nsocket = "{tmp_path / "agent.sock"}"\n'
            '[discovery]\ndebounce_seconds = 0.0\nudev = false\n[health]\nlisten = ""\n'
            f'[kubernetes]\nenabled = true\napi_server = "{server.url}"\npod_resources_socket = ""\n'
            'backoff_initial_seconds = 0.05\nbackoff_max_seconds = 0.1\n')
        agent = Agent(load_config(config), notifier=Notifier(None))
        run_task = asyncio.create_task(agent.run())
        await eventually(lambda: len([r for r in server.requests if r.path.startswith("/api/v1/nodes/")]) >= 3)
        ready, checks = agent.ready()
        assert not ready and "the answer is not UTF-8" in checks["kubernetes"] and len(checks["kubernetes"]) < 300
        assert not run_task.done() and agent.state.current is not None  # still serving
        assert not [k for k in checks if k.startswith("task_")]  # the publisher never failed: it retries
        server.faults.clear()  # the API server is fixed
        await eventually(lambda: agent.ready()[1]["kubernetes"] == "applied generation 1")
        agent.request_stop()
        assert await asyncio.wait_for(run_task, WAIT) == EXIT_OK
        await server.stop()
    run(main)


def test_a_kubelet_answering_garbage_is_one_warning_per_distinct_cause() -> None:
    async def main() -> None:
        server = StandInApiServer()
        server.add_node(NODE)
        await server.start()
        answers = ["List: not a PodResources answer (7 B)"] * 5 + ["List: too large: the answer is over 16.0 MiB"] * 5
        polls: list[str] = []

        def read() -> PodResourcesView:
            polls.append("poll")
            if len(polls) <= len(answers):
                raise PodResourcesError(answers[len(polls) - 1])
            return PodResourcesView(pods=0)

        with structlog.testing.capture_logs() as logs:
            h = Harness(server, read_pods=read, pod_resources_seconds=0.01)
            h.state.publish(topology("f1"))
            h.start()
            await eventually(lambda: len(polls) > len(answers) + 1)
            await h.stop()
        states = [(e["log_level"], e.get("reason")) for e in logs if e["event"] == "pod_resources_state"]
        assert states == [("warning", answers[0]), ("warning", answers[5]), ("info", None)]
    run(main)
