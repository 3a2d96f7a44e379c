"""The CPU enforcement (agent/enforce.py) on a real containerd: pods come from a stand-in pod source
and reports go to a stand-in reporter (bench/enforce_standins.py; no API server runs here); the
containers, their cgroups and every cpuset change are real. This host has 2 CPUs and one NUMA node:
one exclusive CPU for a pod leaves one in the shared pool."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.containerd import Containerd, Kubelet, cgroup_cpuset, proc_allowed
from bench.enforce_standins import (
    NODE,
    StandinPods,
    StandinReporter,
    host_node,
    kubelet_facts,
    resources,
    run_pod,
)
from memtopo.agent.enforce import (
    IN_PLACE,
    CgroupCpusets,
    Enforcer,
    EngineMigrator,
    MemoryMove,
    MemoryMoveError,
    Migrator,
)
from memtopo.agent.metrics import EnforceMetrics
from memtopo.apply.engine import Engine
from memtopo.apply.host import Host
from memtopo.apply.hostfacts import light_facts
from memtopo.hostfs import HostFS
from memtopo.k8s import cri
from memtopo.k8s import enforcement as ef
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

HOST_CPUS = sorted(host_node().allocatable)
pytestmark = pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs at least 2 CPUs to share one and pin one")
ALL = ",".join(map(str, HOST_CPUS)) if len(HOST_CPUS) != 2 else f"{HOST_CPUS[0]}-{HOST_CPUS[1]}"


def make(ctrd: Containerd, pods: StandinPods, reporter: StandinReporter, *, policy: str | None = "none",
         endpoint: str | None = None, metrics: EnforceMetrics | None = None, reserved: tuple[int, ...] = (),
         interval: float = 0.2, migrate: Migrator | None = None) -> Enforcer:
    facts = kubelet_facts(policy)
    cgroups = CgroupCpusets(HostFS.at("/"))
    return Enforcer(node=lambda: host_node(reserved), kubelet=lambda: facts,
                    connect=lambda: cri.CriClient(endpoint or ctrd.endpoint, timeout=5.0), pods=pods,
                    reporter=reporter, cpusets=cgroups.read, metrics=metrics, interval=interval,
                    migrate=migrate, procs=cgroups.procs)


def pid_of(ctrd: Containerd, cid: str) -> int:
    with cri.CriClient(ctrd.endpoint) as c:
        pid = c.container_status(cid).pid
    assert pid is not None
    return pid


def cpus_of(ctrd: Containerd, cid: str) -> tuple[str, str]:
    return cgroup_cpuset(pid_of(ctrd, cid))


@pytest.fixture
def kubelet(containerd: Containerd) -> Iterator[Kubelet]:
    k = containerd.kubelet()
    yield k
    for uid in list(k.pods):
        k.remove_pod(uid)


def test_a_guaranteed_pod_is_pinned_and_the_rest_share(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter, metrics = StandinPods(), StandinReporter(), EnforceMetrics()
    g, g_obj = run_pod(kubelet, "guaranteed", {"app": resources("1"), "side": resources("500m")})
    b, b_obj = run_pod(kubelet, "burstable", {"web": resources(None, None)})
    pods.put(g_obj)
    pods.put(b_obj)
    result = asyncio.run(make(containerd, pods, reporter, metrics=metrics).reconcile())
    assert result.state == "active", result.message
    status = reporter.status(g.uid)
    assert status["state"] == "applied" and status["source"] == "chosen" and status["generation"] == 1
    pinned = status["cpus"]
    shared = str(next(c for c in HOST_CPUS if str(c) != pinned))
    app_pid = pid_of(containerd, g.containers["app"])
    assert cgroup_cpuset(app_pid) == (pinned, "0") and proc_allowed(app_pid) == (pinned, "0")
    # The pod's fractional container and every other pod's containers run on the shared pool.
    assert cpus_of(containerd, g.containers["side"])[0] == shared
    assert cpus_of(containerd, b.containers["web"])[0] == shared
    assert reporter.events == [(g.uid, "Normal", "CPUsPinned", f"exclusive CPUs {pinned}, memory nodes 0, "
                                "from the chosen decision")]
    assert b.uid not in reporter.annotations  # a pod with nothing exclusive is not annotated
    assert metrics.pods.labels("applied")._value.get() == 1 and metrics.state == "active"


def test_the_extenders_placement_is_carried_out(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter = StandinPods(), StandinReporter()
    want = HOST_CPUS[-1]
    placement = f'{{"node": "{NODE}", "cpus": "{want}", "memory": {{"nodes": "0"}}}}'
    p, obj = run_pod(kubelet, "placed", {"app": resources("1")}, {ef.PLACEMENT_ANNOTATION: placement})
    pods.put(obj)
    asyncio.run(make(containerd, pods, reporter).reconcile())
    assert reporter.status(p.uid) | {"generation": 0} == {
        "state": "applied", "cpus": str(want), "mems": "0", "source": "placement", "containers": {"app": str(want)},
        "generation": 0}
    assert cpus_of(containerd, p.containers["app"]) == (str(want), "0")


@pytest.mark.parametrize(("placement", "reason"), [
    ("{not json", "not JSON"),
    ('{"cpus": "0-99999"}', "out of range"),
    (f'{{"node": "{NODE}", "cpus": "63"}}', "CPUs 63 that this node does not have"),
    (f'{{"node": "{NODE}", "cpus": "0", "memory": {{"nodes": "7"}}}}', "memory nodes 7 that this node does not have"),
    ('{"node": "elsewhere", "cpus": "0"}', "is for node elsewhere"),
    ('["cpus", "0"]', "not a JSON object"),
    ("\x1b[2J" * 40_000, "bytes, more than a placement"),
])
def test_a_hostile_placement_pins_nothing_and_says_why(containerd: Containerd, kubelet: Kubelet, placement: str,
                                                       reason: str) -> None:
    pods, reporter = StandinPods(), StandinReporter()
    p, obj = run_pod(kubelet, "hostile", {"app": resources("1")}, {ef.PLACEMENT_ANNOTATION: placement})
    pods.put(obj)
    result = asyncio.run(make(containerd, pods, reporter).reconcile())
    status = reporter.status(p.uid)
    assert status["state"] == "failed" and reason in status["reason"], status
    assert len(status["reason"]) < 400 and "\x1b" not in status["reason"]
    assert reporter.events[-1][1:3] == ("Warning", "CPUPinningFailed")
    # Nothing exclusive: the container keeps every CPU (the shared pool is the whole node).
    assert cpus_of(containerd, p.containers["app"])[0] == ALL and result.state == "active"


def test_a_pod_asking_more_than_the_node_has(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter = StandinPods(), StandinReporter()
    p, obj = run_pod(kubelet, "greedy", {"app": resources(str(len(HOST_CPUS) + 1))})
    pods.put(obj)
    asyncio.run(make(containerd, pods, reporter, reserved=(HOST_CPUS[0],)).reconcile())
    status = reporter.status(p.uid)
    assert status["state"] == "failed"
    assert status["reason"].startswith(f"asks {len(HOST_CPUS) + 1} exclusive CPUs; {len(HOST_CPUS) - 1} can be "
                                       f"handed out ({len(HOST_CPUS)} allocatable, 1 reserved")
    assert cpus_of(containerd, p.containers["app"])[0] == ALL


def test_reserved_cpus_are_never_exclusive(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter = StandinPods(), StandinReporter()
    p, obj = run_pod(kubelet, "res", {"app": resources("1")})
    pods.put(obj)
    asyncio.run(make(containerd, pods, reporter, reserved=(HOST_CPUS[-1],)).reconcile())
    assert reporter.status(p.uid)["cpus"] == str(HOST_CPUS[0])
    # Without reservedSystemCPUs the first CPU is kept for the shared pool, as the kubelet requires one.
    assert host_node().reserved == {HOST_CPUS[0]} and host_node((HOST_CPUS[-1],)).reserved == {HOST_CPUS[-1]}


def test_drift_is_restored_and_counted(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter, metrics = StandinPods(), StandinReporter(), EnforceMetrics()
    g, g_obj = run_pod(kubelet, "drift", {"app": resources("1")})
    b, b_obj = run_pod(kubelet, "other", {"web": resources(None, None)})
    pods.put(g_obj)
    pods.put(b_obj)
    enforcer = make(containerd, pods, reporter, metrics=metrics)
    asyncio.run(enforcer.reconcile())
    pinned = reporter.status(g.uid)["cpus"]
    # Someone else widens the pinned container and moves the shared one onto the exclusive CPU.
    with cri.CriClient(containerd.endpoint) as c:
        c.update_cpuset(g.containers["app"], HOST_CPUS)
        c.update_cpuset(b.containers["web"], [int(pinned)])
    assert cpus_of(containerd, g.containers["app"])[0] == ALL
    result = asyncio.run(enforcer.reconcile())
    assert cpus_of(containerd, g.containers["app"]) == (pinned, "0")
    assert cpus_of(containerd, b.containers["web"])[0] != pinned
    assert metrics.drift._value.get() == 2 and set(result.updated) == {g.containers["app"], b.containers["web"]}
    assert len(reporter.events) == 1  # the outcome did not change: no new Event


def test_released_cpus_go_back_to_the_shared_pool(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter = StandinPods(), StandinReporter()
    g, g_obj = run_pod(kubelet, "leaving", {"app": resources("1")})
    b, b_obj = run_pod(kubelet, "staying", {"web": resources(None, None)})
    pods.put(g_obj)
    pods.put(b_obj)
    enforcer = make(containerd, pods, reporter)
    asyncio.run(enforcer.reconcile())
    assert cpus_of(containerd, b.containers["web"])[0] != ALL
    pods.delete(g.uid)
    kubelet.remove_pod(g.uid)
    asyncio.run(enforcer.reconcile())
    assert cpus_of(containerd, b.containers["web"])[0] == ALL and enforcer.held == {}


def test_a_restart_adopts_without_moving_anything(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter = StandinPods(), StandinReporter()
    g, g_obj = run_pod(kubelet, "kept", {"app": resources("1")})
    b, b_obj = run_pod(kubelet, "shared", {"web": resources(None, None)})
    pods.put(g_obj)
    pods.put(b_obj)
    asyncio.run(make(containerd, pods, reporter).reconcile())
    before = {cid: cpus_of(containerd, cid) for cid in (g.containers["app"], b.containers["web"])}
    # A new agent process: nothing in memory, the pods and the runtime as they were.
    again = make(containerd, pods, StandinReporter())
    result = asyncio.run(again.reconcile())
    assert result.updated == [] and again.held[g.uid].how == "adopted"
    assert {cid: cpus_of(containerd, cid) for cid in before} == before


def test_a_restart_never_gives_one_cpu_to_two_pods(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter = StandinPods(), StandinReporter()
    first, first_obj = run_pod(kubelet, "first", {"app": resources("1")}, created="2026-01-01T00:00:00Z")
    second, second_obj = run_pod(kubelet, "second", {"app": resources("1")}, created="2026-01-02T00:00:00Z")
    pods.put(first_obj)
    pods.put(second_obj)
    # While no agent ran, both pods' containers ended up on the same CPU.
    last = HOST_CPUS[-1]
    with cri.CriClient(containerd.endpoint) as c:
        c.update_cpuset(first.containers["app"], [last])
        c.update_cpuset(second.containers["app"], [last])
    enforcer = make(containerd, pods, reporter)
    result = asyncio.run(enforcer.reconcile())
    assert enforcer.held[first.uid].how == "adopted" and enforcer.held[first.uid].cpus == {last}
    # The younger pod is not given the same CPU: nothing else may be handed out (the first CPU is
    # kept for the shared pool), so it fails, says why, and runs on the shared pool.
    assert second.uid not in enforcer.held and reporter.status(second.uid)["state"] == "failed"
    assert result.updated == [second.containers["app"]]  # the older pod did not move
    assert cpus_of(containerd, second.containers["app"])[0] == ",".join(map(str, HOST_CPUS[:-1]))


def test_the_kubelets_static_policy_owns_cpusets(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter, metrics = StandinPods(), StandinReporter(), EnforceMetrics()
    p, obj = run_pod(kubelet, "kubelet-owned", {"app": resources("1")})
    pods.put(obj)
    enforcer = make(containerd, pods, reporter, policy="static", metrics=metrics)
    result = asyncio.run(enforcer.reconcile())
    assert result.state == "kubelet" and metrics.state == "kubelet"
    assert enforcer.status() == (True, "kubelet: the kubelet's static CPU manager owns container cpusets")
    assert cpus_of(containerd, p.containers["app"])[0] == ALL and reporter.annotations == {}


def test_no_pods_before_the_first_list(containerd: Containerd, kubelet: Kubelet) -> None:
    pods = StandinPods(synced=False)
    result = asyncio.run(make(containerd, pods, StandinReporter()).reconcile())
    assert result.state == "waiting"


class VanishingClient(cri.CriClient):
    """A real client whose update of one container first has the kubelet remove that container: the
    container disappears between the decision and its update."""

    def __init__(self, endpoint: str, kubelet: Kubelet, victim: str) -> None:
        super().__init__(endpoint)
        self.kubelet, self.victim = kubelet, victim

    def update_cpuset(self, container_id: str, cpus: Any, mems: Any = ()) -> None:
        if container_id == self.victim:
            self.kubelet.remove_container(container_id)
        super().update_cpuset(container_id, cpus, mems)


def test_a_container_that_disappears_mid_update_leaves_its_pod_unchanged(containerd: Containerd,
                                                                          kubelet: Kubelet) -> None:
    pods, reporter = StandinPods(), StandinReporter()
    p, obj = run_pod(kubelet, "vanish", {"a": resources("1"), "b": resources("1")})
    pods.put(obj)
    victim = p.containers["b"]
    # Two exclusive CPUs on this 2-CPU host: no CPU kept back for the shared pool here.
    whole = host_node()
    node = ef.NodeFacts(NODE, whole.topo, frozenset(), whole.memory_nodes)
    enforcer = Enforcer(node=lambda: node, kubelet=lambda: kubelet_facts(), pods=pods, reporter=reporter,
                        connect=lambda: VanishingClient(containerd.endpoint, kubelet, victim),
                        cpusets=CgroupCpusets(HostFS.at("/")).read)
    result = asyncio.run(enforcer.reconcile())
    status = reporter.status(p.uid)
    assert status["state"] == "pending" and "went away during the update" in status["reason"], status
    assert reporter.events[-1][1:3] == ("Warning", "CPUPinningRetried")
    # All or none: the first container's update was undone.
    assert cpus_of(containerd, p.containers["a"])[0] == ALL and result.updated == []


@contextlib.contextmanager
def hanging_runtime(path: Path) -> Iterator[None]:
    release = threading.Event()

    def hang(_req: bytes, _ctx: grpc.ServicerContext) -> bytes:
        release.wait(30)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "runtime.v1.RuntimeService", {m: grpc.unary_unary_rpc_method_handler(hang)
                                      for m in ("ListContainers", "ContainerStatus")}),))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        yield
    finally:
        release.set()
        server.stop(0)


def test_a_missing_or_hanging_runtime_is_a_state_not_a_crash(containerd: Containerd, tmp_path: Path) -> None:
    pods, metrics = StandinPods(), EnforceMetrics()
    missing = make(containerd, pods, StandinReporter(), endpoint=f"unix://{tmp_path}/none.sock", metrics=metrics)
    result = asyncio.run(missing.reconcile())
    assert result.state == "runtime_unavailable" and "NO_SOCKET" in result.message and metrics.state == result.state
    with hanging_runtime(tmp_path / "hang.sock"):
        facts = kubelet_facts()
        hung = Enforcer(node=host_node, kubelet=lambda: facts, pods=pods, reporter=StandinReporter(),
                        connect=lambda: cri.CriClient(f"unix://{tmp_path}/hang.sock", timeout=0.5),
                        cpusets=CgroupCpusets(HostFS.at("/")).read)
        result = asyncio.run(hung.reconcile())
    assert result.state == "runtime_unavailable" and "DEADLINE_EXCEEDED" in result.message


def test_a_failing_reporter_is_retried(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter, metrics = StandinPods(), StandinReporter(), EnforceMetrics()
    p, obj = run_pod(kubelet, "report", {"app": resources("1")})
    pods.put(obj)
    reporter.fail = ConnectionError("API server unreachable")
    enforcer = make(containerd, pods, reporter, metrics=metrics)
    asyncio.run(enforcer.reconcile())
    assert reporter.annotations == {} and metrics.reports_failed._value.get() == 1
    reporter.fail = None
    asyncio.run(enforcer.reconcile())
    assert reporter.status(p.uid)["state"] == "applied"


def test_the_loop_pins_new_pods_and_restores_drift(containerd: Containerd, kubelet: Kubelet) -> None:
    pods, reporter = StandinPods(), StandinReporter()

    async def scenario() -> None:
        enforcer = make(containerd, pods, reporter, interval=0.2)
        task = asyncio.create_task(enforcer.run())
        try:
            p, obj = await asyncio.to_thread(run_pod, kubelet, "looped", {"app": resources("1")})
            pods.put(obj)
            cid = p.containers["app"]
            pinned = await _until(lambda: reporter.status(p.uid).get("cpus"))
            assert cpus_of(containerd, cid)[0] == pinned
            with cri.CriClient(containerd.endpoint) as c:
                c.update_cpuset(cid, HOST_CPUS)
            await _until(lambda: cpus_of(containerd, cid)[0] == pinned)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


async def _until(check: Any, limit_s: float = 60.0) -> Any:
    """Poll ``check`` until it is truthy; the limit only ends a hang."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while loop.time() < end:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def test_the_agents_enforcer_reads_its_config(containerd: Containerd, kubelet: Kubelet, tmp_path: Path) -> None:
    """enforcer_for: the kubelet's reservedSystemCPUs from its config file, the runtime endpoint, the
    published topology (none yet = waiting)."""
    from bench.enforce_standins import host_topology
    from memtopo.agent.config import KubernetesConfig
    from memtopo.agent.enforce import enforcer_for

    config = tmp_path / "config.yaml"
    config.write_text(f'kind: KubeletConfiguration\ncpuManagerPolicy: none\nreservedSystemCPUs: "{HOST_CPUS[0]}"\n')
    cfg = KubernetesConfig(enforce=True, runtime_endpoint=containerd.endpoint, kubelet_config=str(config),
                           node_name=NODE)
    pods, reporter = StandinPods(), StandinReporter()
    published: list[Any] = []
    enforcer = enforcer_for(cfg, "agent", HostFS.at("/"), lambda: published[0] if published else None, pods, reporter)
    assert asyncio.run(enforcer.reconcile()).state == "waiting"
    published.append(host_topology())
    p, obj = run_pod(kubelet, "configured", {"app": resources("1")})
    pods.put(obj)
    assert asyncio.run(enforcer.reconcile()).state == "active"
    assert reporter.status(p.uid)["cpus"] == str(HOST_CPUS[1])


def test_runtime_events_start_a_pass_and_stop_with_the_loop(tmp_path: Path) -> None:
    """A runtime with container events (containerd >= 1.7, CRI-O): an event starts a pass at once
    (the interval here is far longer), and stopping the loop ends the thread reading the stream."""
    from memtopo.k8s.api.cri.v1 import cri_pb2 as pb

    release = threading.Event()

    def events(_req: bytes, _ctx: grpc.ServicerContext) -> Iterator[bytes]:
        yield pb.ContainerEventResponse(container_id="c1", container_event_type=pb.CONTAINER_STARTED_EVENT
                                        ).SerializeToString()
        release.wait(30)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("runtime.v1.RuntimeService", {
        "ListContainers": grpc.unary_unary_rpc_method_handler(lambda _r, _c: b""),
        "GetContainerEvents": grpc.unary_stream_rpc_method_handler(events)}),))
    server.add_insecure_port(f"unix://{tmp_path}/events.sock")
    server.start()
    passes: list[str] = []

    class Counting(Enforcer):
        async def reconcile(self) -> Any:
            result = await super().reconcile()
            passes.append(result.state)
            return result

    async def scenario() -> None:
        facts = kubelet_facts()
        enforcer = Counting(node=host_node, kubelet=lambda: facts, pods=StandinPods(), reporter=StandinReporter(),
                            connect=lambda: cri.CriClient(f"unix://{tmp_path}/events.sock"),
                            cpusets=CgroupCpusets(HostFS.at("/")).read, interval=600.0)
        task = asyncio.create_task(enforcer.run())
        await _until(lambda: len(passes) >= 2)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=30)
        assert task in done

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        server.stop(0)
    assert passes[:2] == ["active", "active"]


def test_cgroup_cpusets_are_read_through_the_host_mount_that_hides_the_pods_own(tmp_path: Path) -> None:
    """In a pod given the host's /sys, mountinfo lists the runtime's mount of the pod's own cgroup first
    and the host's whole hierarchy at the same point after it: every container's cgroup, the agent's
    own included, is read through the latter (a fake root in the kernel's formats)."""
    root = tmp_path
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mountinfo").write_text(
        "30 25 0:27 /kubepods/podA/agent /sys/fs/cgroup/cpuset ro,nosuid - cgroup cgroup ro,cpuset\n"
        "31 25 0:28 /kubepods/podA/agent /sys/fs/cgroup/unified ro,nosuid - cgroup2 cgroup2 ro\n"
        "45 40 0:27 / /sys/fs/cgroup/cpuset rw,nosuid - cgroup cgroup rw,cpuset\n")
    for pid, path in ((123, "/kubepods/podB/c1"), (7, "/kubepods/podA/agent")):
        (root / f"proc/{pid}").mkdir(parents=True)
        (root / f"proc/{pid}/cgroup").write_text(f"5:cpuset:{path}\n0::{path}\n")
    for rel, cpus in (("kubepods/podB/c1", "4-5"), ("kubepods/podA/agent", "0-3"), ("", "0-7")):
        d = root / "sys/fs/cgroup/cpuset" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpuset.effective_cpus").write_text(cpus + "\n")
        (d / "cpuset.effective_mems").write_text("0\n")
    read = CgroupCpusets(HostFS.at(root)).read
    assert read(123) == ef.Observed(frozenset({4, 5}), frozenset({0}))
    assert read(7) == ef.Observed(frozenset(range(4)), frozenset({0}))
    assert read(999) == ef.Observed(None, None)  # a process that went away


def test_a_pinned_containers_memory_move_is_a_plan_the_engine_runs(containerd: Containerd, kubelet: Kubelet,
                                                                   tmp_path: Path) -> None:
    """With the agent's engine behind the migration seam. This host has one NUMA node: a pinned container
    cannot have pages on a wrong one, so the pass starts no move; the move it starts on a host with
    several (the lab shows one) is then made by hand for the same container: its processes as its
    cgroup lists them, a plan the real engine validates, journals and runs to a result (page placement
    itself cannot change here)."""

    def no_topology() -> pb.MemoryTopology:
        raise AssertionError("a page migration plan is validated from the host's files")

    engine = Engine(Host.live(), no_topology, tmp_path / "state",
                    facts_provider=lambda plan: light_facts(plan, HostFS.at("/")))
    migrate, calls = EngineMigrator(engine), []

    def record(move: MemoryMove) -> str:
        calls.append(move)
        return migrate(move)

    pods, reporter = StandinPods(), StandinReporter()
    p, obj = run_pod(kubelet, "moving", {"app": resources("1")})
    pods.put(obj)
    enforcer = make(containerd, pods, reporter, migrate=record)

    async def passes() -> None:
        for _ in range(2):
            await enforcer.reconcile()
            await enforcer.moves_done()

    asyncio.run(passes())
    assert reporter.status(p.uid)["state"] == "applied" and reporter.status(p.uid)["mems"] == "0"
    assert calls == [] and "memory" not in reporter.status(p.uid) and engine.list_plans() == []
    cid = p.containers["app"]
    pid = pid_of(containerd, cid)
    pids = CgroupCpusets(HostFS.at("/")).procs(pid)
    assert pids is not None and pid in pids
    assert migrate(MemoryMove(p.uid, cid, pids, (0,), (0,))) == IN_PLACE
    [result] = engine.list_plans()  # as stored in the state directory
    assert result.plan_id.startswith(f"enforce-memory-{cid[:12]}-")
    assert result.state == planpb.PlanResult.STATE_UNCHANGED
    assert [(a.action_id, a.status) for a in result.actions] == [
        (f"pid-{q}", planpb.ActionResult.STATUS_UNCHANGED) for q in pids]
    assert result.actions[0].details["pages_to_move"] == "0" and "N0=" in result.actions[0].details["pages_before"]
    # Nothing to move: nothing changed, so no journal was begun; the result is stored.
    assert engine.result(result.plan_id) == result and not engine.store.journal_path(result.plan_id).exists()
    # A node the host does not have is refused by validation, not attempted.
    with pytest.raises(MemoryMoveError, match=r"refused: pid-.*NUMA node 1 does not exist"):
        migrate(MemoryMove(p.uid, cid, pids, (1,), (0,)))
