"""1,000 simulated agents join one reference controller on loopback; time until it holds them all.

The controller runs as its own process (``python -m controller.cli serve``), so the RSS column is
the controller's alone. The agents are asyncio tasks in this process: each opens its own channel
with a private subchannel pool, i.e. its own TCP connection and HTTP/2 session, as 1,000 hosts
would (grpc would otherwise put every channel to the same target on one shared connection, which
hides the controller's per-connection cost). Each agent says hello, answers the controller's
snapshot request with a full snapshot (a real discovered topology: hwloc's 2-node
32em64t-2n8c+dax+nvme+mic+dimms capture, node_name varied) and waits for the ack; the ack comes
after the controller stored it. Targets: all held within 10 s; controller RSS reported. The
controller's CPU time is printed too: on a 2-core machine the 1,000 simulated agents compete with
it, so the wall time is an upper bound of what the controller alone needs.

    .venv/bin/python bench/fleet.py [--agents 1000] [--shared-channels N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import psutil  # type: ignore[import-untyped, unused-ignore]  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped, unused-ignore]  # noqa: E402

from bench.report import Report  # noqa: E402
from bench.roots import hwloc_root  # noqa: E402
from memtopo.discovery.discover import discover  # noqa: E402
from memtopo.discovery.source import ProbeContext  # noqa: E402
from memtopo.v1 import agent_pb2 as apb  # noqa: E402
from memtopo.v1 import agent_pb2_grpc  # noqa: E402
from memtopo.v1 import topology_pb2 as pb  # noqa: E402

FIXTURE = "32em64t-2n8c+dax+nvme+mic+dimms"
TARGET_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _raise_fd_limit(need: int) -> None:
    """Each agent is one socket here and one in the controller (which inherits this limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def _wait_serving(addr: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"controller exited with {proc.returncode}")
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("controller did not become SERVING")
            await asyncio.sleep(0.1)


class Agent:
    def __init__(self, channel: grpc.aio.Channel, name: str, topology: pb.MemoryTopology) -> None:
        self.channel = channel
        self.name = name
        self.topology = topology
        self.call = agent_pb2_grpc.ControllerStub(channel).Connect()

    async def join(self, t0: float) -> float:
        """hello → snapshot_request → snapshot → ack; seconds from t0 to the ack."""
        t = self.topology
        await self.call.write(apb.AgentMessage(hello=apb.AgentHello(
            node_name=self.name, agent_instance_id=f"bench-{self.name}", boot_id="bench",
            generation=t.generation, fingerprint=t.fingerprint)))
        while True:
            msg = await self.call.read()
            if not isinstance(msg, apb.ControllerMessage):
                raise RuntimeError(f"{self.name}: stream ended before the ack")
            kind = msg.WhichOneof("message")
            if kind == "snapshot_request":
                await self.call.write(apb.AgentMessage(snapshot=t))
            elif kind == "ack" and msg.ack.generation == t.generation:
                return time.perf_counter() - t0


async def run(args: argparse.Namespace, topo: pb.MemoryTopology) -> dict[str, float]:
    port = _free_port()
    addr = f"127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "memtopo.cli", "controller", "serve", "--listen", addr,
                             "--http", ""], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    channels: list[grpc.aio.Channel] = []
    try:
        await _wait_serving(addr, proc)
        ctl = psutil.Process(proc.pid)
        rss_idle = ctl.memory_info().rss
        n = args.agents
        shared = args.shared_channels
        options = [] if shared else [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(addr, options=options) for _ in range(shared or n)]
        snapshots = []
        for i in range(n):
            t = pb.MemoryTopology()
            t.CopyFrom(topo)
            t.node_name = f"node-{i:04d}"
            snapshots.append(t)
        agents = [Agent(channels[i % len(channels)], f"node-{i:04d}", snapshots[i]) for i in range(n)]
        cpu0 = sum(ctl.cpu_times()[:2])
        t0 = time.perf_counter()
        latencies = await asyncio.gather(*(a.join(t0) for a in agents))
        all_held = time.perf_counter() - t0
        ctl_cpu = sum(ctl.cpu_times()[:2]) - cpu0
        async with grpc.aio.insecure_channel(addr) as admin:
            nodes = (await agent_pb2_grpc.ControllerAdminStub(admin).ListNodes(apb.ListNodesRequest())).nodes
        held = sum(1 for x in nodes if x.connected and x.fingerprint == topo.fingerprint)
        rss_held = ctl.memory_info().rss
        conns = sum(1 for c in ctl.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED)
        for a in agents:
            a.call.cancel()
        lat = sorted(latencies)
        return {"agents": n, "held": held, "all_held_s": all_held, "p50_ms": statistics.median(lat) * 1e3,
                "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, "rss_idle_mib": rss_idle / 2**20,
                "rss_held_mib": rss_held / 2**20, "connections": conns, "controller_cpu_s": ctl_cpu,
                "snapshot_kib": len(topo.SerializeToString()) / 1024}
    finally:
        for ch in channels:
            await ch.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--shared-channels", type=int, default=0, metavar="N",
                        help="spread the agents over N channels with grpc's global subchannel pool, which "
                             "multiplexes them all over one connection, instead of one connection per agent")
    args = parser.parse_args()
    return Report.run("fleet", lambda report: measure(args, report))


def measure(args: argparse.Namespace, report: Report) -> None:
    _raise_fd_limit(4 * args.agents + 256)
    topo = discover(ProbeContext.at_root(hwloc_root(FIXTURE)))
    r = asyncio.run(run(args, topo))
    mode = f"{args.shared_channels} shared channels" if args.shared_channels else "one connection per agent"
    print(f"fleet: {r['agents']:.0f} agents ({mode}), snapshot {r['snapshot_kib']:.1f} KiB ({FIXTURE})")
    rows = [
        ("per-agent join p50 (ms)", f"{r['p50_ms']:.0f}"),
        ("per-agent join p99 (ms)", f"{r['p99_ms']:.0f}"),
        ("controller CPU while they joined (s)", f"{r['controller_cpu_s']:.2f}"),
        ("controller TCP connections", f"{r['connections']:.0f}"),
        ("controller RSS idle (MiB)", f"{r['rss_idle_mib']:.1f}"),
        ("controller RSS holding the fleet (MiB)", f"{r['rss_held_mib']:.1f}"),
    ]
    for name, value in rows:
        print(f"{name:<40} {value:>12}")
    report.check("nodes held by the controller", r["held"] == r["agents"], f"{r['held']:.0f}", f"{r['agents']:.0f}")
    report.judge(f"time until all {r['agents']:.0f} are held", r["all_held_s"], "<=", TARGET_S, "s")


if __name__ == "__main__":
    sys.exit(main())
