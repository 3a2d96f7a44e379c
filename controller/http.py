"""The controller's one HTTP/1.1 listener: a small server on the controller's asyncio loop.

No thread per connection and no framework: each connection is one task reading requests off an
``asyncio.StreamReader``. What a hostile or broken client can cost is bounded: the request line and
headers together at most ``MAX_HEAD_BYTES`` (and ``MAX_HEADERS`` lines), a body at most
``MAX_BODY_BYTES`` (``Content-Length`` only; a chunked request body is refused with 411), every read
and write within ``IDLE_TIMEOUT_S``, at most ``MAX_CONNECTIONS`` connections at once (the next one gets
503 and is closed). A handler that raises answers 500 with a one-line JSON body; the traceback goes to
the log, never to the client.

Code that serves something registers routes on the ``Routes`` table (see docs/controller-http.md):

    async def hello(request: Request) -> Response:
        return Response.json({"hello": request.query.get("name", ["world"])[0]})

    routes.add("GET", "/hello", hello)              # exact path; HEAD is served by GET routes
    routes.add("GET", "/nodes/", node_page, prefix=True)  # every path under /nodes/

A handler answers a ``Response`` (whole body) or a ``StreamResponse`` (an async iterator of chunks
sent with chunked transfer encoding, e.g. server-sent events made with ``sse_event``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

from memtopo.logs import get_logger

log = get_logger(component="controller.http")

MAX_BODY_BYTES: Final = 1 << 20
MAX_HEAD_BYTES: Final = 64 << 10
MAX_HEADERS: Final = 100
IDLE_TIMEOUT_S: Final = 30.0
MAX_CONNECTIONS: Final = 256
# Requests answered on one connection before it is closed (a client then reconnects).
MAX_REQUESTS_PER_CONNECTION: Final = 10_000

JSON_TYPE: Final = "application/json"
TEXT_TYPE: Final = "text/plain; charset=utf-8"
SSE_TYPE: Final = "text/event-stream"
_METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


class HttpError(Exception):
    """Raised by a handler (or the request parser) to answer ``status`` with a JSON error body."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # percent-decoded, without the query
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]  # names in lower case; a repeated header's values joined by ", "
    body: bytes
    peer: str
    route: str = ""  # the path the route was registered under (the metrics label)
    # The client certificate the TLS handshake verified (``ssl.SSLSocket.getpeercert()``'s dict), on a
    # listener that asks for one; None otherwise.
    peer_cert: Mapping[str, Any] | None = None

    def json(self) -> Any:
        """The body as JSON; HttpError(400) when it is not."""
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError) as exc:
            raise HttpError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {_excerpt(str(exc))}") from None


@dataclass(frozen=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = TEXT_TYPE
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
        return cls(status, json.dumps(obj, separators=(",", ":")).encode() + b"\n", JSON_TYPE, headers or {})

    @classmethod
    def text(cls, text: str, status: int = 200, content_type: str = TEXT_TYPE) -> Response:
        return cls(status, text.encode(), content_type)


@dataclass(frozen=True)
class StreamResponse:
    """A body produced while it is sent (chunked). The connection closes when the iterator ends, the
    client goes away (the iterator is then closed: its ``finally`` runs) or the server stops."""

    chunks: AsyncIterator[bytes]
    content_type: str = SSE_TYPE
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
# (route, method, status, seconds): called once per answered request.
Observer = Callable[[str, str, int, float], None]


def sse_event(data: str, *, event: str | None = None, event_id: str | None = None) -> bytes:
    """One server-sent event; ``data`` may span lines (each becomes its own ``data:`` line)."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {_one_line(event_id)}")
    if event is not None:
        lines.append(f"event: {_one_line(event)}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


def _one_line(text: str) -> str:
    return text.replace("\r", " ").replace("\n", " ")


def _excerpt(text: str, limit: int = 80) -> str:
    shown = text if len(text) <= limit else text[:limit] + "…"
    return shown.encode("unicode_escape").decode("ascii")


class Routes:
    """Method + path → handler. Exact paths win over prefixes; the longest prefix wins."""

    def __init__(self) -> None:
        self._exact: dict[tuple[str, str], Handler] = {}
        self._prefix: list[tuple[str, str, Handler]] = []

    def add(self, method: str, path: str, handler: Handler, *, prefix: bool = False) -> None:
        """Register ``handler``; ValueError when the method/path pair is taken (two features must not
        silently shadow each other)."""
        method = method.upper()
        if method not in _METHODS or method == "HEAD":
            raise ValueError(f"method {method!r}: register GET (HEAD follows it), POST, PUT, DELETE, PATCH or OPTIONS")
        if not path.startswith("/"):
            raise ValueError(f"path {path!r} must start with /")
        if prefix:
            if any(m == method and p == path for m, p, _ in self._prefix):
                raise ValueError(f"{method} {path}* is already registered")
            self._prefix.append((method, path, handler))
            self._prefix.sort(key=lambda r: -len(r[1]))
        else:
            if (method, path) in self._exact:
                raise ValueError(f"{method} {path} is already registered")
            self._exact[(method, path)] = handler

    def paths(self) -> list[str]:
        return sorted({p for _, p in self._exact} | {p + "*" for _, p, _ in self._prefix})

    def resolve(self, method: str, path: str) -> tuple[str, Handler]:
        """(route, handler); HttpError 404 or 405 (with Allow) otherwise."""
        wanted = "GET" if method == "HEAD" else method
        handler = self._exact.get((wanted, path))
        if handler is not None:
            return path, handler
        for m, p, h in self._prefix:
            if m == wanted and path.startswith(p):
                return p + "*", h
        allowed = {m for m, p in self._exact if p == path} | {m for m, p, _ in self._prefix if path.startswith(p)}
        if allowed:
            if "GET" in allowed:
                allowed.add("HEAD")
            raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not served at this path",
                            {"Allow": ", ".join(sorted(allowed))})
        raise HttpError(HTTPStatus.NOT_FOUND, "no such path")


class _ClosedError(Exception):
    """The client closed, timed out or sent something the connection cannot recover from."""


@dataclass
class _Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]


def _parse_head(raw: bytes) -> _Head:
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise HttpError(HTTPStatus.BAD_REQUEST, "undecodable request head") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"bad request line {_excerpt(lines[0])!r}")
    method, target, version = parts
    if method not in _METHODS:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, f"method {_excerpt(method)!r} is not served")
    header_lines = [line for line in lines[1:] if line]
    if len(header_lines) > MAX_HEADERS:
        raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise HttpError(HTTPStatus.BAD_REQUEST, f"bad header line {_excerpt(line)!r}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return _Head(method, target, version, headers)


def _content_length(headers: Mapping[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise HttpError(HTTPStatus.LENGTH_REQUIRED, "send the body with Content-Length, not Transfer-Encoding")
    text = headers.get("content-length")
    if text is None:
        return 0
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {_excerpt(text)!r}")
    n = int(text)
    if n > MAX_BODY_BYTES:
        raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {n} bytes; the limit is {MAX_BODY_BYTES}")
    return n


def _error_response(exc: HttpError) -> Response:
    return Response.json({"error": exc.message}, exc.status, exc.headers)


class HttpServer:
    """A running listener. ``routes`` may gain routes while it serves (lookups happen per request)."""

    def __init__(self, routes: Routes, *, observer: Observer | None = None,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout: float = IDLE_TIMEOUT_S) -> None:
        self.routes = routes
        self._observer = observer
        self._max_connections = max_connections
        self._idle = idle_timeout
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.host = ""
        self.port = 0

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._tasks)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        """Bind and serve; OSError when the address cannot be bound."""
        self._server = await asyncio.start_server(self._connection, host, port, limit=MAX_HEAD_BYTES,
                                                  ssl=ssl_context, reuse_address=True)
        sockname = self._server.sockets[0].getsockname()
        self.host, self.port = str(sockname[0]), int(sockname[1])

    async def stop(self) -> None:
        """Stop accepting, end every connection (streams included) and wait for them."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    # ---- one connection ---------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer_info = writer.get_extra_info("peername")
        peer = f"{peer_info[0]}:{peer_info[1]}" if isinstance(peer_info, tuple) else str(peer_info or "")
        cert = writer.get_extra_info("peercert")
        peer_cert = cert if isinstance(cert, dict) and cert else None
        over = len(self._tasks) >= self._max_connections
        self._tasks.add(task)
        try:
            if over:
                log.warning("http_connection_refused", peer=peer, connections=len(self._tasks) - 1)
                busy = Response.json({"error": "too many connections"}, HTTPStatus.SERVICE_UNAVAILABLE)
                await self._send(writer, busy, head=False, keep_alive=False)
                return
            for _ in range(MAX_REQUESTS_PER_CONNECTION):
                if not await self._one(reader, writer, peer, peer_cert):
                    break
        except (_ClosedError, ConnectionError, TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        except Exception:  # a bug here ends this connection only
            log.exception("http_connection_failed", peer=peer)
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _read_head(self, reader: asyncio.StreamReader) -> bytes | None:
        try:
            async with asyncio.timeout(self._idle):
                return await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise _ClosedError from None
            return None  # the client closed between requests
        except asyncio.LimitOverrunError:
            raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                            f"the request head is over {MAX_HEAD_BYTES} bytes") from None

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str,
                   peer_cert: Mapping[str, Any] | None = None) -> bool:
        """Serve one request; False when the connection is to be closed."""
        try:
            raw = await self._read_head(reader)
            if raw is None:
                return False
            head = _parse_head(raw[:-4])
            length = _content_length(head.headers)
        except HttpError as exc:
            # The stream position is unknown after a bad head: answer and close.
            await self._send(writer, _error_response(exc), head=False, keep_alive=False)
            self._observe("", "", exc.status, 0.0)
            return False
        started = time.perf_counter()
        keep_alive = self._keep_alive(head)
        async with asyncio.timeout(self._idle):
            body = await reader.readexactly(length) if length else b""
        route = ""
        answer: Response | StreamResponse
        try:
            parts = urlsplit(head.target)
            path = unquote(parts.path) or "/"
            route, handler = self.routes.resolve(head.method, path)
            request = Request(head.method, path, parse_qs(parts.query, max_num_fields=100), head.headers, body,
                              peer, route, peer_cert)
            answer = await handler(request)
        except HttpError as exc:
            answer = _error_response(exc)
        except ValueError as exc:  # parse_qs over its field limit
            answer = _error_response(HttpError(HTTPStatus.BAD_REQUEST, _excerpt(str(exc))))
        except Exception:
            log.exception("http_handler_failed", method=head.method, route=route, peer=peer)
            answer = Response.json({"error": "internal error (see the controller's log)"},
                                   HTTPStatus.INTERNAL_SERVER_ERROR)
        head_only = head.method == "HEAD"
        if isinstance(answer, StreamResponse):
            self._observe(route, head.method, answer.status, time.perf_counter() - started)
            await self._stream(writer, answer, head_only, head.version)
            return False
        await self._send(writer, answer, head=head_only, keep_alive=keep_alive)
        self._observe(route, head.method, answer.status, time.perf_counter() - started)
        return keep_alive

    @staticmethod
    def _keep_alive(head: _Head) -> bool:
        tokens = {t.strip().lower() for t in head.headers.get("connection", "").split(",")}
        if head.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens

    def _observe(self, route: str, method: str, status: int, seconds: float) -> None:
        if self._observer is not None:
            try:
                self._observer(route, method, status, seconds)
            except Exception:  # metrics must never break serving
                log.exception("http_observer_failed")

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self._idle):
            await writer.drain()

    async def _send(self, writer: asyncio.StreamWriter, resp: Response, *, head: bool, keep_alive: bool) -> None:
        lines = [f"HTTP/1.1 {resp.status} {_reason(resp.status)}",
                 f"Content-Type: {resp.content_type}",
                 f"Content-Length: {len(resp.body)}",
                 "Cache-Control: no-store",
                 f"Connection: {'keep-alive' if keep_alive else 'close'}"]
        lines.extend(f"{_one_line(k)}: {_one_line(v)}" for k, v in resp.headers.items())
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace"))
        if not head and resp.body:
            writer.write(resp.body)
        await self._drain(writer)

    async def _stream(self, writer: asyncio.StreamWriter, resp: StreamResponse, head: bool, version: str) -> None:
        chunked = version != "HTTP/1.0"
        lines = [f"HTTP/1.1 {resp.status} {_reason(resp.status)}", f"Content-Type: {resp.content_type}",
                 "Cache-Control: no-store", "Connection: close", "X-Accel-Buffering: no"]
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        lines.extend(f"{_one_line(k)}: {_one_line(v)}" for k, v in resp.headers.items())
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace"))
        await self._drain(writer)
        chunks = resp.chunks
        try:
            if head:
                return
            async for chunk in chunks:
                if not chunk:
                    continue
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                await self._drain(writer)
            if chunked:
                writer.write(b"0\r\n\r\n")
                await self._drain(writer)
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Status"
