"""The agent's HTTP health endpoint: /healthz (liveness), /readyz (readiness), /metrics (Prometheus).

A stdlib ThreadingHTTPServer on a daemon thread: probes and scrapes must keep answering while the
asyncio loop is busy (that is exactly when /healthz has something to say), and they must never block
it. The server only reads what a HealthSource reports; the daemon decides what alive and ready mean.

Responses are small JSON objects, ``{"status": ..., "checks": {...}}``, with 200 or 503:
/healthz says "ok" or "unhealthy", /readyz "ok" or "unready". Only GET and HEAD are served.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final, Protocol
from urllib.parse import urlsplit

from .logs import get_logger
from .metrics import AgentMetrics

log = get_logger(component="health")

PATHS: Final = ("/healthz", "/readyz", "/metrics")
_JSON: Final = "application/json"
# A probe that has not sent its request line within this many seconds is dropped, so idle or
# malicious connections cannot pin handler threads.
REQUEST_TIMEOUT_SECONDS: Final = 5.0


class HealthListenError(ValueError):
    """The health listen address is malformed or cannot be bound."""


class HealthSource(Protocol):
    """What the endpoint reports. Called from the HTTP threads: implementations must be thread-safe
    and quick (read state the loop maintains; never wait on the loop)."""

    @property
    def metrics(self) -> AgentMetrics: ...

    def alive(self) -> tuple[bool, str]:
        """Whether the main loop ticked recently, and a one-line detail."""
        ...

    def ready(self) -> tuple[bool, dict[str, str]]:
        """Whether the agent serves (first discovery done, servers listening), with one entry per check.
        The controller link belongs in the checks but never makes the agent unready."""
        ...


class LoopLiveness:
    """Liveness from loop ticks: the main loop calls tick() each round (with its WATCHDOG=1), and the
    agent is alive while the last tick is at most `max_silence` seconds old. Thread-safe: a float
    assignment is atomic."""

    def __init__(self, max_silence: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not max_silence > 0:
            raise ValueError(f"max_silence must be positive, not {max_silence!r}")
        self.max_silence = max_silence
        self._clock = clock
        self._last: float | None = None

    def tick(self) -> None:
        self._last = self._clock()

    def alive(self) -> tuple[bool, str]:
        last = self._last
        if last is None:
            return False, "main loop has not ticked yet"
        age = self._clock() - last
        if age > self.max_silence:
            return False, f"main loop last ticked {age:.1f}s ago (limit {self.max_silence:g}s)"
        return True, f"main loop ticked {age:.1f}s ago"


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6addr]:port`` → (host, port). Port 0 asks for an ephemeral port."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host:
        raise HealthListenError(f"health listen address {listen!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise HealthListenError(f"health listen address {listen!r}: an IPv6 address needs brackets ([::1]:9464)")
    if not host or not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise HealthListenError(f"health listen address {listen!r}: port must be 0-65535")
    return host, int(port_text)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Threads are never joined on close: stop() must not wait for a slow client.
    block_on_close = False

    def __init__(self, address: tuple[str, int], source: HealthSource) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.source = source
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, a DNS round trip on every start for a
        # name nobody uses; bind plainly instead.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def handle_error(self, request: object, client_address: object) -> None:
        log.warning("health_http_error", peer=str(client_address), exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_SECONDS
    # Headers and body leave in two writes; with Nagle on, the body waits for the client's delayed
    # ACK (~40 ms per probe).
    disable_nagle_algorithm = True
    server_version = "memtopo-health"
    sys_version = ""

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _method_not_allowed(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, _json({"status": "error", "error": "only GET and HEAD"}),
                   _JSON, head=False, extra={"Allow": "GET, HEAD"})

    # http.server dispatches on do_<METHOD>; without these it answers 501 instead of 405.
    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _method_not_allowed  # noqa: N815

    def _serve(self, head: bool) -> None:
        path = urlsplit(self.path).path
        source = self.server.source
        if path == "/healthz":
            try:
                ok, detail = source.alive()
            except Exception as exc:  # a broken check must answer "not healthy", not drop the probe
                log.warning("health_check_failed", check="alive", exc_info=True)
                ok, detail = False, f"liveness check raised {type(exc).__name__}: {exc}"
            body = {"status": "ok" if ok else "unhealthy", "checks": {"loop": detail}}
            self._send(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, _json(body), _JSON, head)
        elif path == "/readyz":
            try:
                ok, checks = source.ready()
            except Exception as exc:
                log.warning("health_check_failed", check="ready", exc_info=True)
                ok, checks = False, {"error": f"readiness check raised {type(exc).__name__}: {exc}"}
            body = {"status": "ok" if ok else "unready", "checks": dict(checks)}
            self._send(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, _json(body), _JSON, head)
        elif path == "/metrics":
            try:
                payload, content_type = source.metrics.render()
            except Exception as exc:
                log.warning("metrics_render_failed", exc_info=True)
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR,
                           _json({"status": "error", "error": f"{type(exc).__name__}: {exc}"}), _JSON, head)
                return
            self._send(HTTPStatus.OK, payload, content_type, head)
        else:
            self._send(HTTPStatus.NOT_FOUND, _json({"status": "error", "error": "not found", "paths": list(PATHS)}),
                       _JSON, head)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, head: bool,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # Probes hit this every few seconds: per-request lines would drown the journal.
        log.debug("health_http_request", peer=self.client_address[0], line=format % args)


def _json(body: object) -> bytes:
    return json.dumps(body, sort_keys=True).encode() + b"\n"


class HealthServer:
    """A running health endpoint on its own daemon thread. stop() is idempotent."""

    def __init__(self, httpd: _Server) -> None:
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="memtopo-health", daemon=True)
        self._stopped = False
        self._lock = threading.Lock()
        self._thread.start()

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        stopper = threading.Thread(target=self._httpd.shutdown, name="memtopo-health-stop")
        stopper.start()
        # serve_forever notices the shutdown flag only between select() timeouts (0.5 s); a
        # connection wakes it now. Harmless if it arrives first: the loop then sees the flag a round later.
        with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.5):
            pass
        stopper.join()
        self._httpd.server_close()
        self._thread.join()


def start_health_server(listen: str, source: HealthSource) -> HealthServer:
    """Serve /healthz, /readyz and /metrics on `listen` (host:port; port 0 = ephemeral).

    The caller skips this when the configured address is "" (disabled). Raises HealthListenError for
    a malformed address or one that cannot be bound (in use, not local, no permission).
    """
    address = parse_listen(listen)
    try:
        httpd = _Server(address, source)
    except OSError as exc:
        raise HealthListenError(f"health listen address {listen!r}: cannot listen: {exc.strerror or exc}") from exc
    server = HealthServer(httpd)
    log.info("health_listening", address=server.url)
    return server
