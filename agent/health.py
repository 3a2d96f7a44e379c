"""The agent's HTTP health endpoint: /healthz (liveness), /readyz (readiness), /metrics (Prometheus).

Served by memtopo's one HTTP server (``memtopo.httpserve``) on its own asyncio loop in one daemon
thread: probes and scrapes must keep answering while the agent's main loop is busy (that is exactly
when /healthz has something to say), and they must never block it. The health port's limits are
``HEALTH_LIMITS`` (GET and HEAD only, 5 s deadlines, at most 256 connections: a new one closes the one
that has waited longest for a request). The server only reads what a HealthSource reports; the daemon
decides what alive and ready mean.

Responses are small JSON objects, ``{"status": ..., "checks": {...}}``, with 200 or 503:
/healthz says "ok" or "unhealthy", /readyz "ok" or "unready".
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Final, Protocol

from memtopo.httpserve import (
    HEALTH_LIMITS,
    JSON_TYPE,
    Exchange,
    HttpError,
    HttpServer,
    Limits,
    Request,
    Response,
    Routes,
    ServerThread,
    bind,
)
from memtopo.logs import get_logger

from .metrics import AgentMetrics

log = get_logger(component="health")

PATHS: Final = ("/healthz", "/readyz", "/metrics")
SERVER_NAME: Final = "memtopo-health"

# The running endpoint: host, port, url, connections, stop().
HealthServer = ServerThread


class HealthSource(Protocol):
    """What the endpoint reports. Called from the HTTP thread: implementations must be thread-safe
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


def _json(body: object) -> bytes:
    return json.dumps(body, sort_keys=True).encode() + b"\n"


def _answer(ok: bool, body: object) -> Response:
    return Response(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, _json(body), JSON_TYPE)


def _error(exc: HttpError) -> Response:
    body: dict[str, object] = {"status": "error", "error": exc.message}
    if exc.status == HTTPStatus.NOT_FOUND:
        body["paths"] = list(PATHS)
    return Response(exc.status, _json(body), JSON_TYPE, exc.headers)


def health_routes(source: HealthSource) -> Routes:
    routes = Routes()

    async def healthz(request: Request) -> Response:
        try:
            ok, detail = source.alive()
        except Exception as exc:  # a broken check must answer "not healthy", not drop the probe
            log.warning("health_check_failed", check="alive", exc_info=True)
            ok, detail = False, f"liveness check raised {type(exc).__name__}: {exc}"
        return _answer(ok, {"status": "ok" if ok else "unhealthy", "checks": {"loop": detail}})

    async def readyz(request: Request) -> Response:
        try:
            ok, checks = source.ready()
        except Exception as exc:
            log.warning("health_check_failed", check="ready", exc_info=True)
            ok, checks = False, {"error": f"readiness check raised {type(exc).__name__}: {exc}"}
        return _answer(ok, {"status": "ok" if ok else "unready", "checks": dict(checks)})

    async def metrics(request: Request) -> Response:
        try:
            body, content_type = source.metrics.render()
        except Exception as exc:
            log.warning("metrics_render_failed", exc_info=True)
            return Response(HTTPStatus.INTERNAL_SERVER_ERROR,
                            _json({"status": "error", "error": f"{type(exc).__name__}: {exc}"}), JSON_TYPE)
        return Response(HTTPStatus.OK, body, content_type)

    routes.add("GET", "/healthz", healthz)
    routes.add("GET", "/readyz", readyz)
    routes.add("GET", "/metrics", metrics)
    return routes


def start_health_server(listen: str, source: HealthSource, *, hosts: Sequence[str] = (),
                        limits: Limits = HEALTH_LIMITS) -> HealthServer:
    """Serve /healthz, /readyz and /metrics on `listen` (host:port; port 0 = ephemeral); ``hosts``:
    names accepted in ``Host`` besides IP addresses and localhost (``health.hosts``).

    The caller skips this when the configured address is "" (disabled). Raises ListenError for a
    malformed address or one that cannot be bound (in use, not local, no permission).
    """
    sock = bind(listen)

    def access(exchange: Exchange) -> None:
        log.debug("health_http_request", peer=exchange.peer.rpartition(":")[0] or exchange.peer,
                  line=f'"{exchange.method} {exchange.target} {exchange.version}" {exchange.status} -')

    def counted(event: str) -> None:
        source.metrics.health_connection_events.labels(event).inc()

    def make() -> HttpServer:
        return HttpServer(health_routes(source), limits, name=SERVER_NAME, hosts=hosts, observer=access,
                          on_event=counted, errors=_error)

    try:
        server = ServerThread(make, sock, thread_name="memtopo-health")
    except BaseException:
        sock.close()
        raise
    log.info("health_listening", address=server.url)
    return server
