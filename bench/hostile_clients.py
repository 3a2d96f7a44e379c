"""A real agent under hostile clients: /healthz latency under slow HTTP clients, memory under
stalled watchers; and memtopo's HTTP server against aiohttp's under the same hostile clients.

``http``: the same hostile scenarios against memtopo's one HTTP server (memtopo/httpserve.py) and
against an aiohttp ``web.Application`` with the same handlers and the same limits where aiohttp has
them (bench/httppeers.py says which), optionally also against the controller's listener as it was at
a git revision (``--before REV``). For each scenario and server, a fresh server process: the hostile
load in a second process, /healthz probed from this one (a fresh connection each, ``Connection:
close``, timed from connect to the end of the answer). Reported: p50/p99 of the probes that were
answered, how many were answered 200, the server's peak RSS (VmHWM) and threads, and what the load
saw (connections the server closed). Scenarios: ``baseline`` (nothing else), ``slow`` (3,000 slow
clients), ``idle`` (300 idle connections), ``bodies`` (16 clients posting 1 MiB bodies), ``never-read``
(40 clients posting 850 KB and never reading their 10.4 MB answers, held past the 30 s write deadline).
Targets, memtopo's server against aiohttp as it comes (the library with the limits it has) in the same
run: every probe answered 200 in every scenario; p99 at most 1.5× aiohttp's, or at most 1.5× memtopo's
own unloaded p99 (the load did not hurt it: on a shared machine a few-ms p99 is noise); peak RSS under
never-reading clients at most aiohttp's. The aiohttp variant with work slots is shown beside (INFO).

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
    .venv/bin/python bench/hostile_clients.py http [--impls memtopo aiohttp aiohttp+slots] [--before REV]
                                                   [--scenarios slow idle bodies never-read] [--probes 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench.agentproc import AgentProcess, AgentSpec, process_tree, pss_kib  # noqa: E402
from bench.httppeers import IMPLS, SCENARIOS  # noqa: E402
from bench.procstat import memory_kib  # noqa: E402
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
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
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
                for byte in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(1.0)
            else:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
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


# ---- memtopo's server against aiohttp's ------------------------------------------------------------------
PEERS = Path(__file__).resolve().parent / "httppeers.py"
P99_RATIO = 1.5
RSS_RATIO = 1.0


@dataclass
class Run:
    impl: str
    scenario: str
    latencies: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    peak_kib: int = 0
    start_kib: int = 0
    threads: int = 0
    log_lines: int = 0
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def answered(self) -> int:
        return len(self.latencies)


def _probe_once(port: int, timeout: float) -> tuple[float | None, str]:
    start = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError as exc:
        return None, type(exc).__name__
    status = data[9:12].decode("latin-1", "replace") or "closed"
    return (time.perf_counter() - start if status == "200" else None), status


class Drained:
    """Every line a child writes, read on a thread as it comes (a child whose pipe fills blocks on its
    own logging), counted, and the first that starts with an awaited word handed over."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._arrived = threading.Condition()
        threading.Thread(target=self._drain, args=(stream,), daemon=True).start()

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            with self._arrived:
                self.lines.append(line.rstrip("\n"))
                self._arrived.notify_all()

    def wait_for(self, word: str, deadline: float) -> str:
        end = time.monotonic() + deadline
        with self._arrived:
            while True:
                found = next((line for line in self.lines if line.startswith(word)), None)
                if found is not None:
                    return found
                left = end - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"no {word!r} line within {deadline:g} s; got {self.lines[-5:]}")
                self._arrived.wait(left)


def run_http(impl: str, scenario: str, args: argparse.Namespace, source: str) -> Run:
    run = Run(impl, scenario)
    server = subprocess.Popen([sys.executable, str(PEERS), "serve", impl, source], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    assert server.stdout is not None and server.stdin is not None
    said = Drained(server.stdout)
    load: subprocess.Popen[str] | None = None
    loaded_said: Drained | None = None
    try:
        port = int(said.wait_for("READY", 60).split()[1])
        run.start_kib = memory_kib(server.pid).get("VmRSS", 0)
        if scenario != "baseline":
            load = subprocess.Popen([sys.executable, str(PEERS), "load", scenario, str(port)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, cwd=REPO)
            assert load.stdout is not None
            loaded_said = Drained(load.stdout)
            loaded_said.wait_for("LOADED", 600)
            time.sleep(args.settle)
        loaded = time.monotonic()
        run.threads = len(list(Path(f"/proc/{server.pid}/task").iterdir()))
        for _ in range(args.probes):
            seconds, status = _probe_once(port, args.probe_timeout)
            if seconds is None:
                run.failures[status] += 1
            else:
                run.latencies.append(seconds)
            time.sleep(0.01)
        if scenario == "never-read":  # past the write deadline: were the stalled answers let go?
            time.sleep(max(0.0, args.hold - (time.monotonic() - loaded)))
            for _ in range(10):
                seconds, status = _probe_once(port, args.probe_timeout)
                if seconds is None:
                    run.failures[status] += 1
                else:
                    run.latencies.append(seconds)
        run.peak_kib = memory_kib(server.pid).get("VmHWM", 0)
        if load is not None and loaded_said is not None:
            assert load.stdin is not None
            load.stdin.close()
            run.seen = json.loads(loaded_said.wait_for("{", 120))
            load.wait(120)
        run.log_lines = len(said.lines) - 1  # all but READY
    finally:
        for proc in (load, server):
            if proc is None:
                continue
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    return run


def _before_source(rev: str, tmp: Path) -> str:
    text = subprocess.run(["git", "show", f"{rev}:controller/http.py"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout
    path = tmp / "controller_http_before.py"
    path.write_text(text)
    return str(path)


def _seen(run: Run) -> str:
    s = run.seen
    if not s:
        return ""
    parts = [f"{s.get('connected', 0)} connected", f"{s.get('closed_by_server', 0)} closed by the server"]
    if s.get("answers"):
        parts.append("answers " + ", ".join(f"{k}×{v}" for k, v in sorted(s["answers"].items())))
    if s.get("errors"):
        parts.append(f"{s['errors']} errors")
    return "; ".join(parts)


def bench_http(args: argparse.Namespace, report: Report) -> None:
    _raise_fd_limit()
    impls = list(args.impls) + (["before"] if args.before else [])
    runs: dict[tuple[str, str], Run] = {}
    with tempfile.TemporaryDirectory(prefix="memtopo-bench-http-") as tmp:
        source = _before_source(args.before, Path(tmp)) if args.before else ""
        for scenario in ["baseline", *args.scenarios]:
            for impl in impls:
                run = runs[(scenario, impl)] = run_http(impl, scenario, args, source)
                p50 = f"{_pct(run.latencies, 0.5):8.2f}" if run.latencies else "       -"
                p99 = f"{_pct(run.latencies, 0.99):8.2f}" if run.latencies else "       -"
                failed = ", ".join(f"{k}×{v}" for k, v in run.failures.most_common())
                print(f"{scenario:<11} {impl:<14} /healthz p50 {p50} ms  p99 {p99} ms  "
                      f"200: {run.answered}/{run.answered + sum(run.failures.values())}"
                      f"{' (' + failed + ')' if failed else ''}  peak RSS {run.peak_kib / 1024:6.1f} MiB "
                      f"(start {run.start_kib / 1024:5.1f})  threads {run.threads}  log lines {run.log_lines}  "
                      f"| {_seen(run)}", flush=True)
    for scenario in ["baseline", *args.scenarios]:
        ours = runs.get((scenario, "memtopo"))
        if ours is None:
            continue
        report.check(f"{scenario}: every /healthz probe answered 200 by memtopo", not ours.failures,
                     f"{ours.answered} of {ours.answered + sum(ours.failures.values())}", "all")
        base = runs.get(("baseline", "memtopo"))
        own = (_pct(ours.latencies, 0.99) / _pct(base.latencies, 0.99)
               if base is not None and base.latencies and ours.latencies else None)
        for rival in (i for i in impls if i.startswith("aiohttp")):
            theirs = runs[(scenario, rival)]
            # Judged against aiohttp as it comes (the library with the limits it has); the variant with
            # work slots added by a middleware is shown beside, for what it would take. A p99 within
            # P99_RATIO of memtopo's own unloaded p99 (same run) is the machine's noise, not the load's.
            judged = rival == "aiohttp"
            if scenario != "baseline" and ours.latencies and theirs.latencies:
                ratio = _pct(ours.latencies, 0.99) / _pct(theirs.latencies, 0.99)
                if judged:
                    good = ratio <= P99_RATIO or (own is not None and own <= P99_RATIO)
                    figure = f"{ratio:.2f} x {rival}'s" + (f", {own:.2f} x its own unloaded" if own is not None else "")
                    report.check(f"{scenario}: memtopo /healthz p99 against {rival}'s or its own unloaded", good,
                                 figure, f"either <= {P99_RATIO:g}")
                else:
                    print(f"INFO  {scenario}: memtopo p99 / {rival} p99 = {ratio:.2f}")
            if scenario == "never-read":
                ratio = ours.peak_kib / theirs.peak_kib
                if judged:
                    report.judge(f"never-read: memtopo peak RSS / {rival}'s", ratio, "<=", RSS_RATIO)
                else:
                    print(f"INFO  never-read: memtopo peak RSS / {rival} peak RSS = {ratio:.2f}")


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
    x = sub.add_parser("http")
    x.add_argument("--impls", nargs="+", choices=[i for i in IMPLS if i != "before"],
                   default=["memtopo", "aiohttp", "aiohttp+slots"])
    x.add_argument("--before", metavar="REV",
                   help="also the controller listener at this git revision (one that still has controller/http.py)")
    x.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    x.add_argument("--probes", type=int, default=300)
    x.add_argument("--probe-timeout", type=float, default=10.0)
    x.add_argument("--settle", type=float, default=2.0, help="seconds between the load in place and the probes")
    x.add_argument("--hold", type=float, default=40.0, help="never-read: seconds the clients are held")
    args = p.parse_args()
    body = {"health": bench_health, "watchers": bench_watchers, "http": bench_http}[args.what]
    return Report.run(f"hostile_clients {args.what}", lambda report: body(args, report))


if __name__ == "__main__":
    sys.exit(main())
