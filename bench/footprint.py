"""The agent's memory and idle CPU, as a real process with its production defaults.

``memtopo serve`` on hwloc's 64-NUMA-node capture (the largest topology among the fixtures, so the
largest cached answer and parsed message), linked to the reference controller in its own process
(``--no-controller`` for an agent alone), with the built-in defaults otherwise: heartbeat 10 s,
periodic rescan 300 s, debounce 1 s, health endpoint on, info-level JSON logs. Figures come from
/proc of the agent's process (every thread):

* RSS (VmRSS) once it is ready and has given the controller its snapshot; after 1,000 GetTopology
  calls on one channel; after 1,000 more, each on a new connection (as a series of ``memtopo
  query`` runs makes: every one is a connection through the front). VmHWM is the peak over the
  run. Targets: <= 55 MiB after start, <= 60 MiB after the RPCs.
* Idle CPU: utime+stime over ``--idle-seconds`` (default 60) with nothing asking, after a settle
  pause, as a percentage of one core. Target: <= 0.5 %. Voluntary context switches per second over
  the same window show how often the agent wakes at all (busy polling would show as thousands).
  /proc counts CPU in clock ticks (1/CLK_TCK s): the resolution is printed with the figure.

    .venv/bin/python bench/footprint.py [--idle-seconds S] [--root hwloc:NAME|lab:NAME] [--no-controller]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.agentproc import (  # noqa: E402
    CLOCK_TICKS,
    AgentProcess,
    AgentSpec,
    ControllerProcess,
    context_switches,
    cpu_seconds,
    fixture_root,
    memory_kib,
)
from memtopo.v1 import agent_pb2 as apb  # noqa: E402
from memtopo.v1 import agent_pb2_grpc  # noqa: E402

TARGET_RSS_MIB = 60.0
# Before any RPC the agent holds its topology and little else (discovery runs in child processes).
TARGET_START_RSS_MIB = 55.0
TARGET_IDLE_PERCENT = 0.5
RPCS = 1000
SETTLE_S = 3.0  # after start or load: let grpc's and the link's follow-ups finish before measuring
NODE_NAME = "bench-node"


def _wait_held(address: str, timeout: float = 60.0) -> None:
    """Until the controller holds the agent's first snapshot: the link's start-up work is done."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        admin = agent_pb2_grpc.ControllerAdminStub(ch)
        while time.monotonic() < deadline:
            nodes = admin.ListNodes(apb.ListNodesRequest(), timeout=5).nodes
            if any(n.node_name == NODE_NAME and n.generation >= 1 for n in nodes):
                return
            time.sleep(0.05)
    raise SystemExit("the controller never held the agent's snapshot")


def _topology_calls(target: str, count: int, *, fresh_connections: bool) -> int:
    """``count`` GetTopology calls; returns the answer size (checked the same every time)."""
    size = 0

    def one(stub: agent_pb2_grpc.NodeAgentStub) -> None:
        nonlocal size
        answer = stub.GetTopology(apb.GetTopologyRequest(), timeout=30)
        n = answer.ByteSize()
        if size and n != size:
            raise SystemExit(f"GetTopology answered {n} bytes, earlier {size}")
        size = n

    if fresh_connections:
        for _ in range(count):
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                one(agent_pb2_grpc.NodeAgentStub(ch))
    else:
        with grpc.insecure_channel(target) as ch:
            stub = agent_pb2_grpc.NodeAgentStub(ch)
            for _ in range(count):
                one(stub)
    return size


@contextlib.contextmanager
def _maybe_controller(enabled: bool) -> Iterator[ControllerProcess | None]:
    if not enabled:
        yield None
        return
    with ControllerProcess() as controller:
        yield controller


def run(args: argparse.Namespace) -> int:
    root = fixture_root(args.root)
    rss: list[tuple[str, int]] = []
    with tempfile.TemporaryDirectory(prefix="memtopo-footprint-") as tmp, \
            _maybe_controller(not args.no_controller) as controller:
        spec = AgentSpec(root=root, node_name=NODE_NAME, controller_port=controller.port if controller else None)
        with AgentProcess(spec, Path(tmp)) as agent:
            if controller is not None:
                _wait_held(controller.address)
            time.sleep(SETTLE_S)
            rss.append(("after start", memory_kib(agent.pid)["VmRSS"]))
            size = _topology_calls(agent.target, RPCS, fresh_connections=False)
            time.sleep(SETTLE_S)
            rss.append((f"after {RPCS:,} GetTopology (one channel)", memory_kib(agent.pid)["VmRSS"]))
            _topology_calls(agent.target, RPCS, fresh_connections=True)
            time.sleep(SETTLE_S)
            mem = memory_kib(agent.pid)
            rss.append((f"after {RPCS:,} more, one connection each", mem["VmRSS"]))

            cpu0, switches0, t0 = cpu_seconds(agent.pid), context_switches(agent.pid), time.monotonic()
            time.sleep(args.idle_seconds)
            cpu1, switches1, t1 = cpu_seconds(agent.pid), context_switches(agent.pid), time.monotonic()
            peak = memory_kib(agent.pid)["VmHWM"]
            status = agent.stop()
    idle = t1 - t0
    idle_pct = (cpu1 - cpu0) / idle * 100
    resolution_pct = 1 / CLOCK_TICKS / idle * 100

    print(f"footprint: agent on {args.root}, GetTopology answer {size / 1024:.1f} KiB, "
          f"{'linked to a controller process' if not args.no_controller else 'no controller'}, defaults otherwise")
    print(f"{'metric':<46} {'value':>10} {'target':>10}")
    ok = True
    for n, (name, kib) in enumerate(rss):
        mib = kib / 1024
        target = TARGET_START_RSS_MIB if n == 0 else TARGET_RSS_MIB
        ok = ok and mib <= target
        print(f"{'RSS ' + name + ' (MiB)':<46} {mib:>10.1f} {f'<= {target:.0f}':>10} "
              f"{'PASS' if mib <= target else 'FAIL'}")
    print(f"{'  of which anonymous (MiB)':<46} {mem['RssAnon'] / 1024:>10.1f}")
    print(f"{'  of which file-backed: code, shared (MiB)':<46} {mem['RssFile'] / 1024:>10.1f}")
    print(f"{'peak RSS over the run, VmHWM (MiB)':<46} {peak / 1024:>10.1f}")
    ok = ok and idle_pct <= TARGET_IDLE_PERCENT
    print(f"{f'idle CPU over {idle:.0f} s (% of one core)':<46} {idle_pct:>10.3f} "
          f"{f'<= {TARGET_IDLE_PERCENT}':>10} {'PASS' if idle_pct <= TARGET_IDLE_PERCENT else 'FAIL'}")
    print(f"{'  CPU seconds (utime+stime, resolution)':<46} {cpu1 - cpu0:>10.2f} {f'±{1 / CLOCK_TICKS:.2f}':>10}")
    print(f"{'  wake-ups per second (voluntary switches)':<46} {(switches1 - switches0) / idle:>10.1f}")
    if status != 0:
        ok = False
        print(f"agent exited with status {status} on SIGTERM")
    print(f"(idle CPU resolution: {resolution_pct:.3f} % over this window)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--root", default="hwloc:256ia64-64n2s2c", help="hwloc:NAME or lab:NAME")
    parser.add_argument("--no-controller", action="store_true", help="no controller link")
    args = parser.parse_args()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
