"""The agent's HTTP health endpoint: /healthz (liveness), /readyz (readiness), /metrics (Prometheus).

A small HTTP/1.1 server on its own asyncio loop in one daemon thread: probes and scrapes must keep
answering while the agent's main loop is busy (that is exactly when /healthz has something to say),
and they must never block it. One thread serves every connection, so slow or idle clients cost a
descriptor each (capped, the oldest closed first) and never a thread. The server only reads what a
HealthSource reports; the daemon decides what alive and ready mean.

Responses are small JSON objects, ``{"status": ..., "checks": {...}}``, with 200 or 503:
/healthz says "ok" or "unhealthy", /readyz "ok" or "unready". Only GET and HEAD are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Final, Protocol
from urllib.parse import urlsplit

from memtopo.logs import get_logger

from .metrics import AgentMetrics

log = get_logger(component="health")

PATHS: Final = ("/healthz", "/readyz", "/metrics")
_JSON: Final = "application/json"
SERVER_NAME: Final = "memtopo-health"
# A connection that has not sent a complete request within this many seconds (of connecting, or of
# its previous answer) is closed; so is one that does not take its answer in this time.
IDLE_SECONDS: Final = 5.0
# Open connections at most; a new one closes the one waiting longest. Probes and scrapes need a
# handful; each open connection costs one descriptor and a coroutine, never a thread.
MAX_CONNECTIONS: Final = 256
MAX_HEAD_BYTES: Final = 16 * 1024
MAX_HEADER_LINES: Final = 100


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


class _Exchange:
    """One request as parsed from its head."""

    __slots__ = ("keep_alive", "method", "path", "request_line")

    def __init__(self, request_line: str, method: str, path: str, keep_alive: bool) -> None:
        self.request_line = request_line
        self.method = method
        self.path = path
        self.keep_alive = keep_alive


class _BadRequestError(Exception):
    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status


async def _read_head(reader: asyncio.StreamReader) -> _Exchange | None:
    """The request line and headers (None at a clean end of stream). A body is never read: only
    GET and HEAD are served, so a request announcing one is answered and the connection closed."""
    size = 0
    lines: list[bytes] = []
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # a line past the reader's limit
            raise _BadRequestError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large") from None
        if not line:
            if lines or size:
                raise _BadRequestError(HTTPStatus.BAD_REQUEST, "connection closed inside the request head")
            return None
        size += len(line)
        if size > MAX_HEAD_BYTES or len(lines) > MAX_HEADER_LINES:
            raise _BadRequestError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large")
        if line in (b"\r\n", b"\n"):
            if not lines:
                continue  # RFC 9112 2.2: ignore empty lines before the request line
            break
        lines.append(line)
    request_line = lines[0].decode("latin-1").strip()
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequestError(HTTPStatus.BAD_REQUEST, "not an HTTP/1.x request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        name, sep, value = raw.decode("latin-1").partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip().lower()
    connection = headers.get("connection", "")
    keep = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        keep = False
    return _Exchange(request_line, method, urlsplit(target).path, keep)


class HealthServer:
    """A running health endpoint: one daemon thread with its own asyncio loop serves every
    connection (no thread per connection). At most MAX_CONNECTIONS are open; a new one closes the
    connection that has waited longest since it connected or was last answered, so slow or idle
    clients cannot keep a probe out. A connection that sends no complete request within
    IDLE_SECONDS (of connecting, or of its last answer) is closed. stop() is idempotent."""

    def __init__(self, sock: socket.socket, source: HealthSource, max_connections: int = MAX_CONNECTIONS,
                 idle_seconds: float = IDLE_SECONDS) -> None:
        self._sock = sock
        self._address = sock.getsockname()
        self._source = source
        self._max = max_connections
        self._idle = idle_seconds
        # Open connections, oldest (accepted or last answered) first.
        self._conns: dict[asyncio.StreamWriter, None] = {}
        self._loop = asyncio.new_event_loop()
        self._stop_event: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="memtopo-health", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    @property
    def host(self) -> str:
        return str(self._address[0])

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to the starter, or logged
            if not self._started.is_set():
                self._error = exc
                self._started.set()
            else:
                log.error("health_server_failed", error=repr(exc))
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        server = await asyncio.start_server(self._client, sock=self._sock, limit=MAX_HEAD_BYTES)
        self._started.set()
        try:
            await self._stop_event.wait()
        finally:
            server.close()
            for writer in list(self._conns):
                writer.transport.abort()
            self._conns.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._conns) >= self._max:
            oldest = next(iter(self._conns))
            del self._conns[oldest]
            oldest.transport.abort()
            with contextlib.suppress(Exception):
                self._source.metrics.health_connections_evicted.inc()
        self._conns[writer] = None
        peer = writer.get_extra_info("peername")
        peer_host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle):
                        exchange = await _read_head(reader)
                except _BadRequestError as exc:
                    writer.write(_response(exc.status, _json({"status": "error", "error": str(exc)}), _JSON,
                                           head=False, keep_alive=False))
                    async with asyncio.timeout(self._idle):
                        await writer.drain()
                    return
                if exchange is None:
                    return
                status, payload = self._answer(exchange)
                log.debug("health_http_request", peer=peer_host, line=f'"{exchange.request_line}" {int(status)} -')
                writer.write(payload)
                async with asyncio.timeout(self._idle):
                    await writer.drain()
                if not exchange.keep_alive or writer not in self._conns:
                    return
                # Answered: now the newest, last in line to be closed for a newcomer.
                del self._conns[writer]
                self._conns[writer] = None
        except (TimeoutError, ConnectionError, ValueError, OSError):
            pass  # idle, too slow, gone, or a line over the reader's limit
        finally:
            self._conns.pop(writer, None)
            writer.transport.abort()

    def _answer(self, ex: _Exchange) -> tuple[HTTPStatus, bytes]:
        head = ex.method == "HEAD"
        keep = ex.keep_alive
        if ex.method not in ("GET", "HEAD"):
            status = HTTPStatus.METHOD_NOT_ALLOWED
            body = _json({"status": "error", "error": "only GET and HEAD"})
            return status, _response(status, body, _JSON, head=False, keep_alive=False,
                                     extra={"Allow": "GET, HEAD"})
        source = self._source
        if ex.path == "/healthz":
            try:
                ok, detail = source.alive()
            except Exception as exc:  # a broken check must answer "not healthy", not drop the probe
                log.warning("health_check_failed", check="alive", exc_info=True)
                ok, detail = False, f"liveness check raised {type(exc).__name__}: {exc}"
            status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
            body = _json({"status": "ok" if ok else "unhealthy", "checks": {"loop": detail}})
            content_type = _JSON
        elif ex.path == "/readyz":
            try:
                ok, checks = source.ready()
            except Exception as exc:
                log.warning("health_check_failed", check="ready", exc_info=True)
                ok, checks = False, {"error": f"readiness check raised {type(exc).__name__}: {exc}"}
            status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
            body = _json({"status": "ok" if ok else "unready", "checks": dict(checks)})
            content_type = _JSON
        elif ex.path == "/metrics":
            try:
                body, content_type = source.metrics.render()
                status = HTTPStatus.OK
            except Exception as exc:
                log.warning("metrics_render_failed", exc_info=True)
                status, content_type = HTTPStatus.INTERNAL_SERVER_ERROR, _JSON
                body = _json({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        else:
            status, content_type = HTTPStatus.NOT_FOUND, _JSON
            body = _json({"status": "error", "error": "not found", "paths": list(PATHS)})
        return status, _response(status, body, content_type, head=head, keep_alive=keep)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        stop_event = self._stop_event
        if stop_event is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(stop_event.set)
        self._thread.join()
        self._sock.close()


def _response(status: HTTPStatus, body: bytes, content_type: str, *, head: bool, keep_alive: bool,
              extra: dict[str, str] | None = None) -> bytes:
    lines = [f"HTTP/1.1 {int(status)} {status.phrase}", f"Server: {SERVER_NAME}",
             f"Content-Type: {content_type}", f"Content-Length: {len(body)}", "Cache-Control: no-store"]
    lines += [f"{name}: {value}" for name, value in (extra or {}).items()]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)


def _json(body: object) -> bytes:
    return json.dumps(body, sort_keys=True).encode() + b"\n"


def start_health_server(listen: str, source: HealthSource) -> HealthServer:
    """Serve /healthz, /readyz and /metrics on `listen` (host:port; port 0 = ephemeral).

    The caller skips this when the configured address is "" (disabled). Raises HealthListenError for
    a malformed address or one that cannot be bound (in use, not local, no permission).
    """
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        # SO_REUSEADDR (create_server's default): a restarted agent rebinds at once over TIME_WAIT.
        sock = socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)
    except OSError as exc:
        raise HealthListenError(f"health listen address {listen!r}: cannot listen: {exc.strerror or exc}") from None
    sock.setblocking(False)
    try:
        server = HealthServer(sock, source)
    except BaseException:
        sock.close()
        raise
    log.info("health_listening", address=server.url)
    return server
