"""The HTTP health endpoint over real sockets: /healthz, /readyz, /metrics, methods, errors, shutdown,
and the health port's own limits (memtopo.httpserve.HEALTH_LIMITS)."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from memtopo.agent.health import HealthServer, LoopLiveness, start_health_server
from memtopo.agent.metrics import AgentMetrics
from memtopo.httpserve import HEALTH_LIMITS, ListenError
from memtopo.logs import configure_logging


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Source:
    """What the daemon would expose: loop liveness, readiness facts, metrics."""

    clock: FakeClock = field(default_factory=FakeClock)
    metrics: AgentMetrics = field(default_factory=AgentMetrics)
    discovered: bool = False
    listening: bool = False
    link: str = "connecting"

    def __post_init__(self) -> None:
        self.liveness = LoopLiveness(max_silence=10.0, clock=self.clock)

    def alive(self) -> tuple[bool, str]:
        return self.liveness.alive()

    def ready(self) -> tuple[bool, dict[str, str]]:
        checks = {
            "discovery": "done" if self.discovered else "first discovery running",
            "servers": "listening" if self.listening else "starting",
            "controller": self.link,
        }
        return self.discovered and self.listening, checks


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide state; later tests must not inherit it."""
    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


@pytest.fixture
def source() -> Source:
    return Source()


@pytest.fixture
def server(source: Source) -> Iterator[HealthServer]:
    srv = start_health_server("127.0.0.1:0", source)
    yield srv
    srv.stop()


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


def request(srv: HealthServer, path: str, method: str = "GET") -> Reply:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=5)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def test_ephemeral_port_is_exposed(server: HealthServer) -> None:
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"


def test_healthz_follows_the_loop_ticks(server: HealthServer, source: Source) -> None:
    r = request(server, "/healthz")
    assert r.status == 503
    assert r.json() == {"status": "unhealthy", "checks": {"loop": "main loop has not ticked yet"}}
    source.liveness.tick()
    source.clock.now += 4
    r = request(server, "/healthz")
    assert (r.status, r.headers["content-type"]) == (200, "application/json")
    assert r.json() == {"status": "ok", "checks": {"loop": "main loop ticked 4.0s ago"}}
    source.clock.now += 7  # 11 s since the tick: the loop is stuck
    r = request(server, "/healthz")
    assert r.status == 503
    assert r.json() == {"status": "unhealthy", "checks": {"loop": "main loop last ticked 11.0s ago (limit 10s)"}}


def test_readyz_flips_from_503_to_200_and_reports_the_controller_link(server: HealthServer, source: Source) -> None:
    r = request(server, "/readyz")
    assert r.status == 503
    assert r.json() == {"status": "unready", "checks": {
        "discovery": "first discovery running", "servers": "starting", "controller": "connecting"}}
    source.discovered = True
    assert request(server, "/readyz").status == 503  # servers not up yet
    source.listening = True
    r = request(server, "/readyz")
    assert r.status == 200
    assert r.json() == {"status": "ok", "checks": {
        "discovery": "done", "servers": "listening", "controller": "connecting"}}


def test_metrics_endpoint_serves_the_agents_registry(server: HealthServer, source: Source) -> None:
    source.metrics.observe_discovery(0.02, "ok")
    source.metrics.set_link_state("connected")
    r = request(server, "/metrics")
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(r.body.decode()) for s in f.samples}
    assert values[("memtopo_discoveries_total", (("outcome", "ok"),))] == 1
    assert values[("memtopo_discovery_duration_seconds_count", ())] == 1
    assert values[("memtopo_controller_link_state", (("state", "connected"),))] == 1


def test_head_answers_headers_only(server: HealthServer, source: Source) -> None:
    source.liveness.tick()
    get = request(server, "/healthz")
    head = request(server, "/healthz", method="HEAD")
    assert (head.status, head.body) == (200, b"")
    assert head.headers["content-length"] == str(len(get.body))
    assert request(server, "/readyz", method="HEAD").status == 503


def test_query_strings_are_ignored(server: HealthServer, source: Source) -> None:
    source.liveness.tick()
    assert request(server, "/healthz?verbose=1").status == 200


def test_unknown_paths_are_404_and_other_methods_405(server: HealthServer) -> None:
    r = request(server, "/")
    assert r.status == 404
    assert r.json() == {"status": "error", "error": "no such path", "paths": ["/healthz", "/readyz", "/metrics"]}
    assert request(server, "/healthz/").status == 404
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        r = request(server, "/healthz", method=method)
        assert (r.status, r.headers["allow"]) == (405, "GET, HEAD"), method


class Broken:
    metrics = property(lambda self: _broken_metrics())

    def alive(self) -> tuple[bool, str]:
        raise RuntimeError("state lock poisoned")

    def ready(self) -> tuple[bool, dict[str, str]]:
        raise KeyError("servers")


def _broken_metrics() -> AgentMetrics:
    raise RuntimeError("registry gone")


def test_a_failing_check_answers_503_or_500_and_the_server_keeps_serving() -> None:
    srv = start_health_server("127.0.0.1:0", Broken())
    try:
        r = request(srv, "/healthz")
        assert r.status == 503
        assert r.json() == {"status": "unhealthy",
                            "checks": {"loop": "liveness check raised RuntimeError: state lock poisoned"}}
        r = request(srv, "/readyz")
        assert r.status == 503
        assert r.json() == {"status": "unready", "checks": {"error": "readiness check raised KeyError: 'servers'"}}
        r = request(srv, "/metrics")
        assert r.status == 500
        assert r.json() == {"status": "error", "error": "RuntimeError: registry gone"}
        assert request(srv, "/healthz").status == 503  # still answering
    finally:
        srv.stop()


def test_answers_while_the_asyncio_loop_is_blocked(source: Source) -> None:
    """The endpoint lives on its own thread: a request made from inside a blocked event loop (the
    request itself blocks it) is still answered."""
    source.liveness.tick()

    async def main() -> int:
        srv = start_health_server("127.0.0.1:0", source)
        try:
            return request(srv, "/healthz").status  # synchronous: the loop cannot run meanwhile
        finally:
            srv.stop()

    assert asyncio.run(main()) == 200


def test_no_access_log_lines(server: HealthServer, source: Source, capfd: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    configure_logging("info", stream=out)
    source.liveness.tick()
    for path in ("/healthz", "/readyz", "/metrics", "/nope"):
        request(server, path)
    request(server, "/healthz", method="POST")
    captured = capfd.readouterr()
    assert (captured.out, captured.err, out.getvalue()) == ("", "", "")


def test_access_lines_are_debug_events(server: HealthServer) -> None:
    out = io.StringIO()
    configure_logging("debug", stream=out)
    request(server, "/healthz")
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["event"], e["level"], e["peer"]) for e in events] == [("health_http_request", "debug", "127.0.0.1")]
    assert '"GET /healthz HTTP/1.1" 503' in events[0]["line"]


def test_concurrent_probes(server: HealthServer, source: Source) -> None:
    source.liveness.tick()
    results: list[int] = []
    lock = threading.Lock()

    def probe() -> None:
        for _ in range(10):
            status = request(server, "/healthz").status
            with lock:
                results.append(status)

    threads = [threading.Thread(target=probe) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 80


def test_stop_is_idempotent_and_frees_the_port(source: Source) -> None:
    srv = start_health_server("127.0.0.1:0", source)
    port = srv.port
    def stop_twice() -> None:
        srv.stop()
        srv.stop()

    stopper = threading.Thread(target=stop_twice)
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive(), "stop() hung"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    again = start_health_server(f"127.0.0.1:{port}", source)  # the port can be reused at once
    again.stop()


def test_a_port_in_use_is_a_clear_error(server: HealthServer, source: Source) -> None:
    with pytest.raises(ListenError, match=rf"127\.0\.0\.1:{server.port}: cannot listen: .*in use"):
        start_health_server(f"127.0.0.1:{server.port}", source)


def test_ipv6_loopback(source: Source) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    try:
        srv = start_health_server("[::1]:0", source)
    except ListenError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        assert srv.host == "::1"
        assert srv.url == f"http://[::1]:{srv.port}"
        assert request(srv, "/readyz").status == 503
    finally:
        srv.stop()


@pytest.mark.parametrize(("listen", "reason"), [
    ("", "expected HOST:PORT"),
    ("9464", "expected HOST:PORT"),
    (":9464", "no host"),
    ("127.0.0.1:", "port  is not a number"),
    ("127.0.0.1:http", "port http is not a number"),
    ("127.0.0.1:65536", "is not a number 0-65535"),
    ("::1:9464", "needs brackets"),
    ("[]:9464", "is not an IPv6 address"),
    ("127.0.0.1:٣", "is not a number"),  # a non-ASCII digit: isdigit() alone would accept it
])
def test_a_malformed_listen_address_is_refused_naming_it(listen: str, reason: str, source: Source) -> None:
    with pytest.raises(ListenError, match=reason):
        start_health_server(listen, source)


def test_only_names_the_endpoint_was_given_may_address_it(source: Source) -> None:
    """A page under a DNS-rebinding name (its own name, resolving here) reads nothing: 421."""
    source.liveness.tick()
    srv = start_health_server("127.0.0.1:0", source, hosts=("node-1.example",))
    try:
        for host, status in (("rebind.attacker.example", 421), ("node-1.example", 200), ("127.0.0.1", 200),
                             ("localhost", 200)):
            with socket.create_connection((srv.host, srv.port), timeout=10) as s:
                s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}:{srv.port}\r\nConnection: close\r\n\r\n".encode())
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
            assert data.startswith(f"HTTP/1.1 {status} ".encode()), (host, data[:60])
    finally:
        srv.stop()


def test_liveness_needs_a_positive_limit() -> None:
    with pytest.raises(ValueError, match="positive"):
        LoopLiveness(0)
    with pytest.raises(ValueError, match="positive"):
        LoopLiveness(float("nan"))


def _hold(srv: HealthServer, count: int, partial: bytes = b"") -> list[socket.socket]:
    held = []
    for _ in range(count):
        s = socket.create_connection((srv.host, srv.port), timeout=5)
        if partial:
            s.sendall(partial)
        held.append(s)
    return held


def test_idle_and_slow_connections_cost_no_thread(server: HealthServer, source: Source) -> None:
    """Slow clients (a request head never finished) and idle keep-alive clients: one thread serves
    them all, and a probe is still answered. The old server spent a thread on each."""
    source.liveness.tick()
    threads_before = threading.active_count()
    held = _hold(server, 100, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n") + _hold(server, 100)
    try:
        deadline = time.monotonic() + 30
        while server.connections < 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connections == 200
        assert threading.active_count() <= threads_before + 1
        assert request(server, "/healthz").status == 200
    finally:
        for s in held:
            s.close()


def test_a_full_server_closes_the_oldest_connection_for_a_new_one(source: Source) -> None:
    source.liveness.tick()
    srv = start_health_server("127.0.0.1:0", source, limits=replace(HEALTH_LIMITS, max_connections=4))
    try:
        held = _hold(srv, 4, b"GET /")
        deadline = time.monotonic() + 30
        while srv.connections < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert request(srv, "/healthz").status == 200  # the cap is full, the probe still gets in
        held[0].settimeout(10)
        assert held[0].recv(100) == b""  # the oldest one was closed to make room
        evicted = source.metrics.registry.get_sample_value("memtopo_health_connection_events_total",
                                                           {"event": "evicted"})
        assert evicted is not None and evicted >= 1
        for s in held:
            s.close()
    finally:
        srv.stop()


def test_a_connection_that_never_finishes_its_request_is_closed(source: Source) -> None:
    srv = start_health_server("127.0.0.1:0", source, limits=replace(HEALTH_LIMITS, head_timeout_s=0.2))
    try:
        s = socket.create_connection((srv.host, srv.port), timeout=30)
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        assert s.recv(100) == b""  # closed, without an answer
        s.close()
    finally:
        srv.stop()


def test_keep_alive_serves_several_requests_on_one_connection(server: HealthServer, source: Source) -> None:
    source.liveness.tick()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        for path in ("/healthz", "/readyz", "/metrics", "/healthz"):
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            assert resp.status in (200, 503)
        assert server.connections == 1
    finally:
        conn.close()


@pytest.mark.parametrize("head", [b"GARBAGE\r\n\r\n", b"GET / HTTP/9\r\n\r\n", b"GET /healthz HTTP/1.1\r\n"
                                  + b"X: " + b"a" * 20000 + b"\r\n\r\n"])
def test_malformed_requests_get_an_error_and_a_close(server: HealthServer, head: bytes) -> None:
    s = socket.create_connection((server.host, server.port), timeout=10)
    try:
        s.sendall(head)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        assert data.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431"))
    finally:
        s.close()
    assert request(server, "/healthz").status in (200, 503)
