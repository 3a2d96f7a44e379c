"""The agent and the reference controller as real processes on loopback, against a captured root.

The root is a copy of a real two-socket capture (the numa-vm lab's dual-socket-cxl profile), so a
test can change it under the running agent — hot-add a PCI function — and send the SIGHUP that
stands in for the udev event (a fixture root receives no udev events).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.roots import set_node_memory
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests.agents import Agent, Controller, certificates, copy_root, memtopo, pin_plan, wait_for

NEW_BDF = "0000:22:00.1"


def hot_add_pci(root: Path) -> None:
    """What the kernel shows after a hot-add: a second function beside an existing device."""
    parent = root / "sys/devices/pci0000:20/0000:20:01.0"
    shutil.copytree(parent / "0000:22:00.0", parent / NEW_BDF, symlinks=True)
    (root / "sys/bus/pci/devices" / NEW_BDF).symlink_to(f"../../../devices/pci0000:20/0000:20:01.0/{NEW_BDF}")


@contextlib.contextmanager
def notify_socket(tmp: Path) -> Iterator[tuple[str, list[str]]]:
    path = str(tmp / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    got: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                got.append(sock.recv(4096).decode())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        yield path, got
    finally:
        stop.set()
        t.join(2)
        sock.close()


class Watcher:
    """A WatchTopology client on its own thread, recording every event."""

    def __init__(self, agent: Agent) -> None:
        self.events: list[apb.TopologyEvent] = []
        self.ended: str = ""
        self._ch = agent.channel()
        self._call = agent.stub(self._ch).WatchTopology(apb.WatchTopologyRequest())
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for ev in self._call:
                self.events.append(ev)
            self.ended = "ok"
        except grpc.RpcError as exc:
            self.ended = exc.code().name

    def generations(self) -> list[int]:
        return [e.generation for e in self.events if e.WhichOneof("event") == "snapshot"]

    def close(self) -> None:
        self._call.cancel()
        self._ch.close()


def test_agent_and_controller_end_to_end(tmp_path: Path) -> None:
    root = copy_root(tmp_path)
    controller = Controller()
    controller.start()
    child = subprocess.Popen(["sleep", "600"])
    with notify_socket(tmp_path) as (notify_path, notes):
        agent = Agent(tmp_path, root, controller.port, env={"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "400000"})
        try:
            agent.start()
            # systemd: READY=1 after the first discovery, then watchdog pings from the loop.
            wait_for(lambda: any("READY=1" in n for n in notes), what="READY=1")
            wait_for(lambda: sum("WATCHDOG=1" in n for n in notes) >= 2, what="WATCHDOG=1 pings")
            assert any(n.startswith("STATUS=") or "\nSTATUS=" in n for n in notes)

            with agent.channel() as ch:
                health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                topo = agent.stub(ch).GetTopology(apb.GetTopologyRequest(), timeout=30)
            assert topo.generation == 1 and topo.node_name == "e2e-node"
            assert NEW_BDF not in {d.bdf for d in topo.pci_devices}
            # The readers' socket (beside agent.sock by default) answers the same; it never applies,
            # not even for root.
            with grpc.insecure_channel(f"unix://{tmp_path / 'agent-read.sock'}") as ch:
                assert agent.stub(ch).GetTopology(apb.GetTopologyRequest(), timeout=30) == topo
                with pytest.raises(grpc.RpcError) as refused:
                    agent.stub(ch).ApplyPlan(apb.ApplyPlanRequest(plan=pin_plan("ro", child.pid, [0]), dry_run=True),
                                             timeout=30)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            held = wait_for(lambda: (n := controller.node()) and n.generation == 1 and n, what="controller snapshot")
            assert held.fingerprint == topo.fingerprint and held.connected

            # A hot-added PCI function: the watcher and the controller both see generation 2.
            watcher = Watcher(agent)
            wait_for(lambda: watcher.generations() == [1], what="watch snapshot")
            hot_add_pci(root)
            os.kill(agent.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
            wait_for(lambda: watcher.generations() == [1, 2], what="watcher generation 2")
            new = watcher.events[-1].snapshot
            assert NEW_BDF in {d.bdf for d in new.pci_devices}
            wait_for(lambda: (n := controller.node()) and n.generation == 2, what="controller generation 2")

            # The controller dies 20 times while the topology keeps changing: the agent reconnects
            # every time and the controller ends with the newest generation.
            for i in range(20):
                controller.kill()
                set_node_memory(root, 2, 1_000_000 + i * 4096)
                os.kill(agent.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
                controller.start()

            # The newest generation is the one that saw the last change: a rescan asked for earlier
            # may still be running when the loop ends, and publish after it.
            def newest() -> pb.MemoryTopology | None:
                with agent.channel() as ch:
                    t = agent.stub(ch).GetTopology(apb.GetTopologyRequest(), timeout=30)
                node2 = next(n for n in t.numa_nodes if n.id == 2)
                return t if node2.memory_bytes == (1_000_000 + 19 * 4096) * 1024 else None

            latest = wait_for(newest, what="the agent's topology after the last change")
            assert latest.generation >= 3
            final = wait_for(lambda: (n := controller.node()) and n.generation == latest.generation and n,
                             what="controller at the latest generation")
            assert final.fingerprint == latest.fingerprint and final.connected
            status, metrics = agent.http("/metrics")
            reconnects = [ln for ln in metrics.splitlines() if ln.startswith("memtopo_controller_reconnects_total")]
            assert status == 200 and reconnects and float(reconnects[0].split()[-1]) >= 20

            # A plan sent twice through the controller is applied once.
            os.sched_setaffinity(child.pid, {0, 1})
            first = controller.submit(pin_plan("pin-sleep", child.pid, [0]))
            assert first.state == planpb.PlanResult.STATE_APPLIED, first
            assert os.sched_getaffinity(child.pid) == {0}
            os.sched_setaffinity(child.pid, {0, 1})
            second = controller.submit(pin_plan("pin-sleep", child.pid, [0]))
            assert second.state == planpb.PlanResult.STATE_APPLIED and "seen before" in second.message
            assert os.sched_getaffinity(child.pid) == {0, 1}

            # SIGTERM: the watcher is told, systemd hears STOPPING=1, the exit status is 0.
            assert agent.stop() == 0
            wait_for(lambda: watcher.ended, what="watch stream end")
            assert watcher.events[-1].WhichOneof("event") == "closing"
            assert any("STOPPING=1" in n for n in notes)
            assert agent.events("generation_published") and agent.events("agent_stopped")

            # A new agent process remembers the plan: still not applied twice.
            restarted = Agent(tmp_path, root, controller.port)
            restarted.start()
            # Ready does not wait for the controller link (by design): wait for the new instance's link.
            wait_for(lambda: (n := controller.node()) and n.connected and n.agent_instance_id != held.agent_instance_id,
                     what="restarted agent linked")
            third = controller.submit(pin_plan("pin-sleep", child.pid, [0]))
            assert "seen before" in third.message and os.sched_getaffinity(child.pid) == {0, 1}
            assert restarted.stop() == 0
        finally:
            for proc in (agent.proc, controller.proc, child):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(10)


def test_a_kernel_uevent_makes_the_live_agent_rescan(tmp_path: Path) -> None:
    """The udev path itself, on this host: a "change" written to a PCI device's uevent file makes the
    kernel send a real uevent (what udevadm trigger does); the agent's netlink monitor must turn it
    into a rescan naming it, of what a PCI event reaches only. The topology does not change, so the
    rescan ends unchanged."""
    devices = sorted(os.listdir("/sys/bus/pci/devices"))
    if not devices or not os.access(f"/sys/bus/pci/devices/{devices[0]}/uevent", os.W_OK):
        pytest.skip("no PCI device whose uevent this user may trigger")
    agent = Agent(tmp_path, Path("/"), None, udev=True, log_level="debug")
    try:
        agent.start()
        assert not agent.events("udev_unavailable")

        def rescanned() -> list[dict[str, Any]]:
            return [ev for ev in agent.events("discovery_unchanged") + agent.events("generation_published")
                    if "udev:pci:change" in ev.get("trigger", "")]

        # The monitor starts before readiness, so the event cannot fall before it.
        Path(f"/sys/bus/pci/devices/{devices[0]}/uevent").write_text("change")
        (event, *_) = wait_for(rescanned, timeout=15, what="a rescan triggered by the uevent")
        # A PCI event reruns the probes that follow PCI devices, not the NUMA or identity ones.
        rerun = event["rerun"].split(",")
        assert "sysfs.pci" in rerun and "sysfs.numa" not in rerun and "host.identity" not in rerun, event
    finally:
        if agent.proc is not None:
            assert agent.stop() == 0


def test_tcp_apply_plan_needs_a_client_certificate(tmp_path: Path) -> None:
    root = copy_root(tmp_path)
    c = certificates(tmp_path)
    agent = Agent(tmp_path, root, None, extra=(
        f'tcp = "127.0.0.1:0"\ntls_cert = "{c["server_crt"]}"\ntls_key = "{c["server_key"]}"\n'
        f'tls_client_ca = "{c["ca"]}"\n'))
    opts = (("grpc.ssl_target_name_override", "localhost"),)
    plan = apb.ApplyPlanRequest(plan=pin_plan("tcp-plan", os.getpid(), [0]), dry_run=True)
    try:
        agent.start()
        port = agent.tcp_port
        anonymous = grpc.ssl_channel_credentials(root_certificates=c["ca"].read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", anonymous, options=opts) as ch:
            stub = agent.stub(ch)
            assert stub.GetTopology(apb.GetTopologyRequest(), timeout=10).node_name == "e2e-node"
            with pytest.raises(grpc.RpcError) as err:
                stub.ApplyPlan(plan, timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError):
            agent.stub(ch).ApplyPlan(plan, timeout=5)  # plaintext never reaches the service
        mutual = grpc.ssl_channel_credentials(root_certificates=c["ca"].read_bytes(),
                                              private_key=c["client_key"].read_bytes(),
                                              certificate_chain=c["client_crt"].read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", mutual, options=opts) as ch:
            res = agent.stub(ch).ApplyPlan(plan, timeout=10)
            assert res.state in (planpb.PlanResult.STATE_DRY_RUN, planpb.PlanResult.STATE_REJECTED)
    finally:
        if agent.proc is not None:
            assert agent.stop() == 0


def test_invalid_config_exits_78_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[controller]\nbackoff_max_seconds = -1\n')
    proc = memtopo("serve", "--config", str(bad))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 78
    assert "controller.backoff_max_seconds" in out
