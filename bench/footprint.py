"""The agent's memory and idle CPU, as a real process with its production defaults.

``memtopo serve`` on hwloc's 64-NUMA-node capture (the largest topology among the fixtures, so the
largest cached answer and parsed message), linked to the reference controller in its own process
(``--no-controller`` for an agent alone), with the built-in defaults otherwise: heartbeat 10 s,
periodic rescan 300 s, debounce 1 s, health endpoint on, info-level JSON logs. The agent's memory is
its whole process tree: the daemon and the discovery helper it keeps (discovery/helper.py), each
counted from /proc/PID/smaps_rollup as PSS, so a page they share (the interpreter, libraries) counts
once, split between them, where adding their RSS would count it twice:

* PSS once it is ready and has given the controller its snapshot; after 1,000 GetTopology calls on
  one channel; after 1,000 more, each on a new connection (as a series of ``memtopo query`` runs
  makes: every one is a connection through the front). Targets: <= 55 MiB after start, <= 60 MiB
  after the 2,000 RPCs. Each process's share, the tree's RSS and the daemon's VmHWM (its peak RSS
  over the run) are context.
* Idle CPU of the tree: utime+stime over ``--idle-seconds`` (default 60) with nothing asking, after
  a settle pause, as a percentage of one core. Target: <= 0.5 %. Voluntary context switches per
  second over the same window show how often the agent wakes at all (busy polling would show as
  thousands). /proc counts CPU in clock ticks (1/CLK_TCK s): the resolution is printed with the figure.

    .venv/bin/python bench/footprint.py [--idle-seconds S] [--root hwloc:NAME|lab:NAME|synth:HOST] [--no-controller]
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
    process_tree,
    pss_kib,
)
from bench.procstat import memory_kib  # noqa: E402
from bench.report import Report  # noqa: E402
from bench.roots import fixture_root  # noqa: E402
from memtopo.v1 import agent_pb2 as apb  # noqa: E402
from memtopo.v1 import agent_pb2_grpc  # noqa: E402

TARGET_PSS_MIB = 60.0
# Before any RPC the agent holds its topology and little else (discovery runs in the helper's children).
TARGET_START_PSS_MIB = 55.0
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


def _tree(pid: int) -> tuple[list[int], dict[str, int]]:
    pids = process_tree(pid)
    return pids, pss_kib(pids)


def run(args: argparse.Namespace, report: Report) -> None:
    root = fixture_root(args.root)
    rows: list[tuple[str, dict[str, int], list[int]]] = []
    with tempfile.TemporaryDirectory(prefix="memtopo-footprint-") as tmp, \
            _maybe_controller(not args.no_controller) as controller:
        spec = AgentSpec(root=root, node_name=NODE_NAME, controller_port=controller.port if controller else None)
        with AgentProcess(spec, Path(tmp)) as agent:
            if controller is not None:
                _wait_held(controller.address)
            time.sleep(SETTLE_S)
            pids, pss = _tree(agent.pid)
            rows.append(("after start", pss, pids))
            shares = [(pid, pss_kib([pid])["Pss"]) for pid in pids]
            size = _topology_calls(agent.target, RPCS, fresh_connections=False)
            time.sleep(SETTLE_S)
            pids, pss = _tree(agent.pid)
            rows.append((f"after {RPCS:,} GetTopology (one channel)", pss, pids))
            _topology_calls(agent.target, RPCS, fresh_connections=True)
            time.sleep(SETTLE_S)
            pids, pss = _tree(agent.pid)
            rows.append((f"after {RPCS:,} more, one connection each", pss, pids))

            def tree_cpu() -> tuple[float, int]:
                tree = process_tree(agent.pid)
                return sum(cpu_seconds(p) for p in tree), sum(context_switches(p) for p in tree)
            (cpu0, switches0), t0 = tree_cpu(), time.monotonic()
            time.sleep(args.idle_seconds)
            (cpu1, switches1), t1 = tree_cpu(), time.monotonic()
            peak = memory_kib(agent.pid)["VmHWM"]
            status = agent.stop()
    idle = t1 - t0
    idle_pct = (cpu1 - cpu0) / idle * 100
    resolution_pct = 1 / CLOCK_TICKS / idle * 100

    print(f"footprint: agent on {args.root}, GetTopology answer {size / 1024:.1f} KiB, "
          f"{'linked to a controller process' if not args.no_controller else 'no controller'}, defaults otherwise")
    print(f"{'the agent (daemon + discovery helper), MiB':<46} {'PSS':>7} {'anon':>7} {'file':>7} {'RSS sum':>8} "
          f"{'procs':>5}")
    for name, pss, pids in rows:
        print(f"{name:<46} {pss['Pss'] / 1024:>7.1f} {pss['Pss_Anon'] / 1024:>7.1f} {pss['Pss_File'] / 1024:>7.1f} "
              f"{pss['Rss'] / 1024:>8.1f} {len(pids):>5}")
    print("  after start, by process: " + ", ".join(
        f"{'daemon' if n == 0 else 'helper' if n == 1 else 'child'} {pid} {kib / 1024:.1f}"
        for n, (pid, kib) in enumerate(shares)))
    print(f"  the daemon's peak RSS over the run (VmHWM): {peak / 1024:.1f} MiB")
    print(f"idle CPU over {idle:.0f} s: {cpu1 - cpu0:.2f} CPU s (resolution ±{1 / CLOCK_TICKS:.2f} s, "
          f"{resolution_pct:.3f} %), {(switches1 - switches0) / idle:.1f} wake-ups/s (voluntary switches)")
    report.judge("agent PSS (process tree) after start", rows[0][1]["Pss"] / 1024, "<=", TARGET_START_PSS_MIB,
                 "MiB", 1)
    report.judge(f"agent PSS (process tree) after {2 * RPCS:,} RPCs", rows[-1][1]["Pss"] / 1024, "<=",
                 TARGET_PSS_MIB, "MiB", 1)
    report.judge(f"idle CPU over {idle:.0f} s (% of one core)", idle_pct, "<=", TARGET_IDLE_PERCENT, "%", 3)
    report.check("stops cleanly on SIGTERM", status == 0, f"exit status {status}", "exit status 0")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--root", default="hwloc:256ia64-64n2s2c", help="hwloc:NAME or lab:NAME")
    parser.add_argument("--no-controller", action="store_true", help="no controller link")
    args = parser.parse_args()
    return Report.run("footprint", lambda report: run(args, report))


if __name__ == "__main__":
    sys.exit(main())
