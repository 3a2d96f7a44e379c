"""GetTopology requests/s from a real agent against a bare grpc.aio server, measured in the same run.

The subject is ``memtopo serve`` on hwloc's 64-NUMA-node capture (256ia64-64n2s2c: 256 IA64 CPUs in 128
packages, the largest node count among the shared fixtures), asked over its readers' Unix socket
(``listen.read_socket``: grpc's own listener, so each call crosses the metrics interceptor and the
service, and nothing else). The baseline is a bare grpc.aio server in its own process
(``--bare-server``) on a Unix socket, with a generic handler whose response serializer is the
identity, returning the very bytes the agent answered (fetched from it at the start).

Two more targets are context, not judged: the agent's ``listen.socket``, where a front relays every
byte to record the peer's SO_PEERCRED so that ApplyPlan can be authorized (the price of that, on a
read, is the gap between the two agent rows), and (unless ``--no-direct``) the private grpc socket
behind that front.

The client is the same for every target: responses are taken as bytes (no client-side parse, which
would cost the same on both sides and only push the ratio towards 1), and the first answer of each
round is compared with the expected bytes. Two client shapes, each in rounds of ``--seconds`` per
target with the order rotated every round so a load spike on this shared 2-core machine does not
land on one side only:

* sync: one ``grpc.Channel``, one call after the other;
* asyncio: ``--clients`` concurrent tasks, each on its own channel and connection (grpc would
  otherwise multiplex them over one), as separate local clients would.

Server CPU per call (utime+stime of the server process from /proc, every thread) is printed too: on
a machine this small it is the steadier figure. Target: agent req/s / bare req/s >= 0.8 for both
client shapes, judged on the median over rounds of the ratio within a round (a round's turns are seconds apart,
so a drift in the machine's load mostly cancels out; the ratio of the two medians is printed
beside it). ``--profile FILE`` runs the sync client against an agent under cProfile instead and
prints where its Python time goes.

    .venv/bin/python bench/rpc.py [--repeat N] [--seconds S] [--clients N] [--root hwloc:NAME|lab:NAME]
                                  [--no-direct] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import itertools
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.agentproc import AgentProcess, AgentSpec, ProcessFailedError, cpu_seconds  # noqa: E402
from bench.report import Report  # noqa: E402
from bench.roots import fixture_root  # noqa: E402
from memtopo.v1 import agent_pb2 as apb  # noqa: E402
from memtopo.v1 import topology_pb2 as pb  # noqa: E402

METHOD = "/memtopo.v1.NodeAgent/GetTopology"
SERVICE, RPC = METHOD.strip("/").split("/")
REQUEST = apb.GetTopologyRequest().SerializeToString()
DEFAULT_ROOT = "hwloc:256ia64-64n2s2c"
TARGET_RATIO = 0.8
WARMUP_ROUNDS = 2
# Same limit as the agent's server: a bigger topology must not fail on the baseline only.
SERVER_OPTIONS = [("grpc.max_send_message_length", 64 << 20)]
CLIENT_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


# ---- the baseline server (its own process) -------------------------------------------------------------
async def serve_bare(socket_path: str, payload_path: str) -> None:
    payload = Path(payload_path).read_bytes()

    async def get_topology(request: apb.GetTopologyRequest, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return payload

    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        RPC: grpc.unary_unary_rpc_method_handler(get_topology, request_deserializer=apb.GetTopologyRequest.FromString,
                                                 response_serializer=None)}),))
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(1.0)


# ---- targets -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """One server under test and what was measured against it (the dicts fill round by round)."""

    name: str
    address: str
    pid: int
    # Per client shape: one req/s figure per round, and the server CPU seconds and calls summed.
    rates: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def record(self, shape: str, calls: int, seconds: float, cpu: float) -> None:
        self.rates.setdefault(shape, []).append(calls / seconds)
        self.cpu[shape] = self.cpu.get(shape, 0.0) + cpu
        self.calls[shape] = self.calls.get(shape, 0) + calls

    def paired(self, baseline: Target, shape: str) -> list[float]:
        """This target's req/s over the baseline's, round by round (both ran in each round)."""
        return [a / b for a, b in zip(self.rates[shape], baseline.rates[shape], strict=True)]

    def median(self, shape: str) -> float:
        return statistics.median(self.rates[shape])

    def cpu_us_per_call(self, shape: str) -> float:
        return self.cpu[shape] / self.calls[shape] * 1e6


def _check(answer: bytes, expected: bytes, target: Target) -> None:
    if answer != expected:
        raise SystemExit(f"{target.name} answered {len(answer)} bytes that differ from the expected {len(expected)}")


def _rounds(targets: list[Target], repeat: int) -> Iterator[tuple[bool, list[Target]]]:
    """(warm-up?, targets in this round's order): the order rotates every round."""
    for i in range(WARMUP_ROUNDS + repeat):
        k = i % len(targets)
        yield i < WARMUP_ROUNDS, targets[k:] + targets[:k]


def _raw_call(channel: grpc.Channel) -> Callable[..., bytes]:
    # No serializers: bytes in, bytes out, so the client never parses what it measures.
    return cast(Callable[..., bytes], channel.unary_unary(METHOD))


def _raw_aio_call(channel: grpc.aio.Channel) -> Callable[..., Awaitable[bytes]]:
    return cast(Callable[..., Awaitable[bytes]], channel.unary_unary(METHOD))


async def _client(call: Callable[..., Awaitable[bytes]], end: float) -> int:
    """One asyncio client: calls back to back until the loop's clock passes ``end``."""
    loop = asyncio.get_running_loop()
    n = 0
    while loop.time() < end:
        await call(REQUEST, timeout=10)
        n += 1
    return n


def run_sync(targets: list[Target], payload: bytes, repeat: int, seconds: float) -> None:
    channels = {t.name: grpc.insecure_channel(t.address, options=CLIENT_OPTIONS) for t in targets}
    try:
        calls = {t.name: _raw_call(channels[t.name]) for t in targets}
        for warmup, order in _rounds(targets, repeat):
            for t in order:
                call = calls[t.name]
                _check(call(REQUEST, timeout=10), payload, t)
                cpu0, t0, n = cpu_seconds(t.pid), time.perf_counter(), 0
                end = t0 + seconds
                while time.perf_counter() < end:
                    call(REQUEST, timeout=10)
                    n += 1
                elapsed, cpu = time.perf_counter() - t0, cpu_seconds(t.pid) - cpu0
                if not warmup:
                    t.record("sync", n, elapsed, cpu)
    finally:
        for ch in channels.values():
            ch.close()


async def run_async(targets: list[Target], payload: bytes, repeat: int, seconds: float, clients: int) -> None:
    # A private subchannel pool per channel: one connection per client, as separate processes would have.
    options = [*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    channels = {t.name: [grpc.aio.insecure_channel(t.address, options=options) for _ in range(clients)]
                for t in targets}
    shape = f"asyncio x{clients}"
    try:
        for warmup, order in _rounds(targets, repeat):
            for t in order:
                calls = [_raw_aio_call(ch) for ch in channels[t.name]]
                for call in calls:  # connected, and the right bytes, before the clock starts
                    _check(await call(REQUEST, timeout=10), payload, t)
                cpu0, t0 = cpu_seconds(t.pid), time.perf_counter()
                end = asyncio.get_running_loop().time() + seconds
                n = sum(await asyncio.gather(*(_client(c, end) for c in calls)))
                elapsed, cpu = time.perf_counter() - t0, cpu_seconds(t.pid) - cpu0
                if not warmup:
                    t.record(shape, n, elapsed, cpu)
    finally:
        for ch in itertools.chain.from_iterable(channels.values()):
            await ch.close()


# ---- main ----------------------------------------------------------------------------------------------
def _private_socket(agent: AgentProcess) -> str:
    # The front's upstream socket (agent/transport.py): a 0700 directory beside the public socket.
    found = glob.glob(str(agent.workdir / ".memtopo-grpc-*" / "grpc.sock"))
    if len(found) != 1:
        raise SystemExit(f"expected one private grpc socket under {agent.workdir}, found {found}")
    return f"unix://{found[0]}"


def _fetch(address: str) -> bytes:
    with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as ch:
        return _raw_call(ch)(REQUEST, timeout=30)


@contextlib.contextmanager
def bare_server(tmp: Path, payload: bytes) -> Iterator[tuple[str, int]]:
    (tmp / "payload.bin").write_bytes(payload)
    sock = tmp / "bare.sock"
    proc = subprocess.Popen([sys.executable, __file__, "--bare-server", str(sock), str(tmp / "payload.bin")],
                            cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise ProcessFailedError(f"bare server exited with {proc.returncode}")
            with contextlib.suppress(grpc.RpcError):
                if sock.exists() and _fetch(f"unix://{sock}") == payload:
                    break
            if time.monotonic() > deadline:
                raise ProcessFailedError("bare server did not answer")
            time.sleep(0.05)
        yield f"unix://{sock}", proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def profile_agent(root: Path, out: Path, seconds: float) -> None:
    """The sync client against an agent running under cProfile; prints where its loop spends time."""
    with tempfile.TemporaryDirectory(prefix="memtopo-rpc-prof-") as tmp:
        agent = AgentProcess(AgentSpec(root=root, profile_to=out), Path(tmp))
        with agent:
            payload = _fetch(agent.target)
            target = Target("agent", agent.target, agent.pid)
            run_sync([target], payload, 3, seconds)
        print(f"agent under cProfile: {target.median('sync'):.0f} req/s (sync); profile in {out}")
    stats = pstats.Stats(str(out))
    stats.sort_stats("tottime").print_stats(25)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=10, help="measured rounds per client shape (after warm-up)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one target's turn in a round")
    parser.add_argument("--clients", type=int, default=8, help="concurrent asyncio clients")
    parser.add_argument("--root", default=DEFAULT_ROOT, help="hwloc:NAME (hwloc's Linux captures) or lab:NAME")
    parser.add_argument("--no-direct", action="store_true", help="skip the agent's private socket (diagnosis)")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="instead of the comparison, profile the agent's loop under the sync client")
    parser.add_argument("--bare-server", nargs=2, metavar=("SOCKET", "PAYLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_server:
        asyncio.run(serve_bare(*args.bare_server))
        return 0
    if args.profile:
        profile_agent(fixture_root(args.root), args.profile, args.seconds)
        return 0
    return Report.run("rpc", lambda verdict: compare(args, verdict))


def compare(args: argparse.Namespace, verdict: Report) -> None:
    root = fixture_root(args.root)
    with tempfile.TemporaryDirectory(prefix="memtopo-rpc-") as tmp_name:
        tmp = Path(tmp_name)
        with AgentProcess(AgentSpec(root=root, read_socket=True), tmp / "agent") as agent:
            payload = _fetch(agent.target)
            topo = pb.MemoryTopology.FromString(payload)
            with bare_server(tmp, payload) as (bare_addr, bare_pid):
                # The judged subject is second (judge/report); the relayed socket is context.
                targets = [Target("bare grpc.aio", bare_addr, bare_pid),
                           Target("agent read_socket", f"unix://{agent.workdir / 'read.sock'}", agent.pid),
                           Target("agent socket", agent.target, agent.pid)]
                if not args.no_direct:
                    targets.append(Target("agent, no front", _private_socket(agent), agent.pid))
                run_sync(targets, payload, args.repeat, args.seconds)
                asyncio.run(run_async(targets, payload, args.repeat, args.seconds, args.clients))

    report(args, topo, payload, targets)
    bare, subject = targets[0], targets[1]
    for shape in bare.rates:
        verdict.judge(f"{subject.name} req/s / bare grpc.aio req/s, {shape} client",
                      statistics.median(subject.paired(bare, shape)), ">=", TARGET_RATIO, digits=3)


def report(args: argparse.Namespace, topo: pb.MemoryTopology, payload: bytes, targets: list[Target]) -> None:
    bare = targets[0]
    print(f"rpc: GetTopology on {args.root} ({len(topo.numa_nodes)} NUMA nodes, {len(topo.interconnects)} "
          f"interconnects), answer {len(payload) / 1024:.1f} KiB; {args.repeat} rounds of {args.seconds:g} s "
          "per target, order rotated")
    print(f"{'client':<12} {'target':<17} {'req/s':>7} {'min':>6} {'max':>6} {'CPU us/call':>11} "
          f"{'ratio':>6} {'(min-max)':>11} {'of medians':>10}")
    for shape in bare.rates:
        for t in targets:
            rates = t.rates[shape]
            cells = ["", "", ""]
            if t is not bare:
                per_round = t.paired(bare, shape)
                cells = [f"{statistics.median(per_round):.3f}", f"{min(per_round):.2f}-{max(per_round):.2f}",
                         f"{t.median(shape) / bare.median(shape):.2f}"]
            print(f"{shape:<12} {t.name:<17} {t.median(shape):>7.0f} {min(rates):>6.0f} {max(rates):>6.0f} "
                  f"{t.cpu_us_per_call(shape):>11.0f} {cells[0]:>6} {cells[1]:>11} {cells[2]:>10}")
    print("(read_socket is judged: the readers' socket; 'agent socket' relays through the SO_PEERCRED front\n"
          " that ApplyPlan needs. req/s: median of rounds. ratio: median over rounds of target/bare within the\n"
          " same round;"
          " 'of medians' = median req/s / median bare req/s. CPU: utime+stime of the server process, all threads,\n"
          " per call over the measured rounds)")


if __name__ == "__main__":
    sys.exit(main())
