"""A real agent under hostile clients: /healthz latency under slow HTTP clients, memory under
stalled watchers.

``health``: ``memtopo serve`` on a captured root; /healthz is probed ``--probes`` times (a fresh
connection each, ``Connection: close``, timed from connect to the end of the answer), first with
nothing else connected (the baseline, same run), then while ``--clients`` slow clients hold
connections to the health port: half sent one request and keep the connection alive without a
second, half send a request head one byte a second and never finish it. The clients connect once
and do not reconnect when closed (the issue's 3,000 held connections). Reported: p50/p99 of both,
their ratio, and the agent's thread count with the clients connected. Target: p99 < 50 ms under
3,000 slow clients.

``watchers``: ``--watchers`` WatchTopology streams (spread over 8 connections) that never read,
then ``--changes`` topology changes (a NUMA node's MemTotal raised in the root's copy, then SIGHUP),
each of which every stream is sent. Reported: the agent's RSS before the watchers, with them after
the changes, and ``--settle`` seconds later (when stalled streams have been ended, if the agent
does that), and how many streams the agent refused. Targets: bounded whatever the clients do: the
streams still open are at most ``listen.max_watchers`` (256 by default; the rest are refused), and
the agent's memory (its process tree as PSS, as bench/footprint.py counts it) with them after the
changes <= 100 MiB (each stalled stream holds what it was sent and has not read, until
``listen.watch_stall_seconds`` ends it).

    .venv/bin/python bench/hostile_clients.py health [--clients 3000] [--probes 200]
    .venv/bin/python bench/hostile_clients.py watchers [--watchers 2000] [--changes 3] [--settle 75]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.agentproc import AgentProcess, AgentSpec, process_tree, pss_kib  # noqa: E402
from bench.report import Report  # noqa: E402
from bench.roots import copy_root, fixture_root, set_node_memory  # noqa: E402
from memtopo.v1 import agent_pb2 as apb  # noqa: E402
from memtopo.v1 import agent_pb2_grpc  # noqa: E402

TARGET_P99_MS = 50.0
TARGET_WATCHERS_PSS_MIB = 100.0
MAX_WATCHERS = 256  # listen.max_watchers's default (agent/config.py), which the benchmark's agent keeps


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def _probe(port: int) -> float:
    """Seconds from connect to the end of a /healthz answer."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    elapsed = time.perf_counter() - start
    if not data.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):  # 1.0: the threaded server before
        raise RuntimeError(f"/healthz answered {data[:40]!r}")
    return elapsed


def _probes(port: int, count: int) -> list[float]:
    out = []
    for _ in range(count):
        out.append(_probe(port))
        time.sleep(0.01)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


class SlowClients:
    """``count`` connections on an asyncio loop in a thread: idle keep-alive ones and slow heads."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.count = count
        self.connected = 0
        self.closed_by_server = 0
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    def __enter__(self) -> SlowClients:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        tasks = []
        for i in range(self.count):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                break
            self.connected += 1
            tasks.append(asyncio.create_task(self._client(reader, writer, slow=bool(i % 2))))
        self._ready.set()
        await self._stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slow: bool) -> None:
        try:
            if slow:
                for byte in b"GET /healthz HTTP/1.1\r\nHost: bench\r\nX-Slow: " + b"a" * 10_000:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(1.0)
            else:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n")
                await writer.drain()
                await reader.read(4096)
            await reader.read()  # hold it until the server closes it
            self.closed_by_server += 1
        except (ConnectionError, OSError):
            self.closed_by_server += 1
        finally:
            writer.transport.abort()


def bench_health(args: argparse.Namespace, report: Report) -> None:
    _raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="memtopo-bench-hostile-") as tmp:
        spec = AgentSpec(root=fixture_root(args.root))
        with AgentProcess(spec, Path(tmp)) as agent:
            port = agent.health_port
            baseline = _probes(port, args.probes)
            threads_before = _threads(agent.pid)
            with SlowClients(port, args.clients) as clients:
                time.sleep(2.0)
                threads_loaded = _threads(agent.pid)
                loaded = _probes(port, args.probes)
                held = clients.connected - clients.closed_by_server
    b50, b99, l50, l99 = (_pct(baseline, 0.5), _pct(baseline, 0.99), _pct(loaded, 0.5), _pct(loaded, 0.99))
    print(f"/healthz, {args.probes} probes each, root {args.root}")
    print(f"  baseline                  p50 {b50:7.2f} ms  p99 {b99:7.2f} ms  "
          f"mean {statistics.mean(baseline) * 1000:.2f} ms")
    print(f"  {clients.connected:>5} slow clients        p50 {l50:7.2f} ms  p99 {l99:7.2f} ms  "
          f"mean {statistics.mean(loaded) * 1000:.2f} ms")
    print(f"  ratio loaded/baseline      p50 {l50 / b50:7.2f}     p99 {l99 / b99:7.2f}")
    print(f"  agent threads: {threads_before} before, {threads_loaded} with the clients; "
          f"connections still held at the end: {held}")
    report.judge(f"/healthz p99 under {clients.connected:,} slow clients", l99, "<", TARGET_P99_MS, "ms")


def _tree_pss_kib(pid: int) -> int:
    return pss_kib(process_tree(pid))["Pss"]


def bench_watchers(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="memtopo-bench-hostile-") as tmp:
        root = copy_root(fixture_root(args.root), Path(tmp))
        spec = AgentSpec(root=root, debounce_seconds=0.0)
        with AgentProcess(spec, Path(tmp) / "agent") as agent:
            time.sleep(1.0)
            before = _tree_pss_kib(agent.pid)
            channels = [grpc.insecure_channel(agent.target, options=[("grpc.use_local_subchannel_pool", 1)])
                        for _ in range(8)]
            stubs = [agent_pb2_grpc.NodeAgentStub(ch) for ch in channels]
            calls = [stubs[i % len(stubs)].WatchTopology(apb.WatchTopologyRequest()) for i in range(args.watchers)]
            time.sleep(3.0)
            for change in range(args.changes):
                set_node_memory(root, 0, 8_000_000 + 4096 * (change + 1))
                agent.sighup()
                time.sleep(2.0)
            time.sleep(2.0)
            loaded = _tree_pss_kib(agent.pid)
            time.sleep(args.settle)
            settled = _tree_pss_kib(agent.pid)
            futures = [cast("grpc.Future[object]", c) for c in calls]  # the sync stream call is also a Future
            codes = Counter(cast(grpc.Call, c).code().name for c, f in zip(calls, futures, strict=True) if f.done())
            for c in calls:
                c.cancel()
            for ch in channels:
                ch.close()
    per = (loaded - before) / max(1, args.watchers)
    print(f"{args.watchers} stalled watchers, {args.changes} topology changes, root {args.root}")
    print(f"  agent PSS (process tree): {before / 1024:.1f} MiB before, {loaded / 1024:.1f} MiB with them "
          f"(+{(loaded - before) / 1024:.1f} MiB, {per:.1f} KiB per watcher), "
          f"{settled / 1024:.1f} MiB {args.settle:g} s later")
    ended = ", ".join(f"{n} {code}" for code, n in codes.most_common()) or "none"
    print(f"  streams ended: {sum(codes.values())} ({ended}); still open: {args.watchers - sum(codes.values())}")
    report.judge("stalled streams left open", args.watchers - sum(codes.values()), "<=", MAX_WATCHERS, digits=0)
    report.judge(f"agent PSS with {args.watchers:,} stalled watchers", loaded / 1024, "<=", TARGET_WATCHERS_PSS_MIB,
                 "MiB", 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    h = sub.add_parser("health")
    h.add_argument("--clients", type=int, default=3000)
    h.add_argument("--probes", type=int, default=200)
    h.add_argument("--root", default="lab:single")
    w = sub.add_parser("watchers")
    w.add_argument("--watchers", type=int, default=2000)
    w.add_argument("--changes", type=int, default=3)
    w.add_argument("--settle", type=float, default=75.0)
    w.add_argument("--root", default="lab:dual-socket-cxl")
    args = p.parse_args()
    body = bench_health if args.what == "health" else bench_watchers
    return Report.run(f"hostile_clients {args.what}", lambda report: body(args, report))


if __name__ == "__main__":
    sys.exit(main())
