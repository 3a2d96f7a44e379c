"""One HTTP/1.1 server for every memtopo listener: the agent's health port and the controller's
listener (and, through the routes its entry point installs, the fleet page and the scheduler extender).

memtopo's own rather than aiohttp's: ``bench/hostile_clients.py http`` runs the same handlers under the
same hostile clients on both; aiohttp has no connection cap and no deadline for an answer the client
does not take, and bounds a request head only by its keep-alive timeout (README, "Dependencies and
why", has the figures).

Each connection is one task on an asyncio loop (never a thread). What a hostile or broken client can
cost is bounded by one set of ``Limits``; a listener differs only where it must (``HEALTH_LIMITS``):

- **Connections**: at most ``max_connections``. At the cap a new connection closes the one that has
  waited longest for a request head (an idle keep-alive, a head sent a byte at a time, an unfinished
  TLS handshake), so idle connections never keep a probe out; only when every connection is inside a
  request is the newcomer refused (503 on plaintext, a close on TLS).
- **Time**: the TLS handshake and a request head within ``head_timeout_s`` of connecting or of the last
  answer; a body within ``body_timeout_s``; an answer taken by the client within ``write_timeout_s``,
  else the connection is aborted (no graceful close that waits on a peer that does not read) and
  leaves the cap at once.
- **Memory**: a head ≤ ``max_head_bytes`` and ``max_headers`` lines (431); a body ≤ ``max_body_bytes``
  by ``Content-Length`` (413; chunked bodies 411); bodies held at once ≤ ``max_body_bytes_total`` and
  answers not yet taken by their clients ≤ ``max_unsent_bytes`` (beyond either, 503); per connection
  at most ``write_buffer_bytes`` wait in the transport.
- **The loop**: a body over ``inline_body_bytes`` makes a *large* request. Large requests run their
  handler in one of ``max_body_work`` slots (waiting at most ``head_timeout_s`` for one, else 503);
  their JSON is decoded (``await request.json()``) and their JSON answer encoded in a worker thread,
  the answer in pieces so that the thread gives the GIL back to the loop between them. Small requests
  (probes, scrapes) never wait for a slot.

Browsers (the controller's listener serves a page and a write verb): a request's ``Host`` must name
this listener: an IP literal, ``localhost``, or one of ``hosts`` (else 421: the Host of a DNS-rebinding
page is its own name). A request with an ``Origin`` must be same-origin (else 403), and one with a
method that carries a body (POST, PUT, PATCH, DELETE) must be ``application/json`` (else 415): a
cross-site ``no-cors`` ``text/plain`` POST never reaches a handler.

Identity: on a TLS listener whose context verifies client certificates (``tls.server_context`` with a
client CA), ``Request.client_subject`` is the verified certificate's subject. A route may carry a
``guard`` (``BearerToken``, ``ClientCertificate``, ``any_guard``) that runs before the body is read.

Refused, evicted, timed-out and busy connections are counted (``HttpServer.events``, and the
``on_event`` hook for metrics) and logged at most once per peer and kind a minute.

Code that serves something registers routes (docs/controller-http.md)::

    async def hello(request: Request) -> Response:
        return Response.json({"hello": request.query.get("name", ["world"])[0]})

    routes.add("GET", "/hello", hello)                    # exact path; HEAD is served by GET routes
    routes.add("GET", "/nodes/", node_page, prefix=True)  # every path under /nodes/
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import os
import socket
import ssl
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final, cast
from urllib.parse import parse_qs, unquote, urlsplit

from memtopo.addresses import AddressError, parse_host_port
from memtopo.logs import Throttle, get_logger
from memtopo.text import excerpt, reason, shorten

log = get_logger(component="http")

JSON_TYPE: Final = "application/json"
TEXT_TYPE: Final = "text/plain; charset=utf-8"
HTML_TYPE: Final = "text/html; charset=utf-8"
SSE_TYPE: Final = "text/event-stream"
_METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
# Methods whose request may carry a body: they must say it is JSON (a simple cross-site request cannot).
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Answers are written in slices of this size, each after the transport's buffer drained.
_SLICE: Final = 64 << 10


class ListenError(ValueError):
    """A listen address that is malformed or cannot be bound."""


@dataclass(frozen=True)
class Limits:
    """What one listener allows a client; see the module's docstring for what each bounds."""

    max_connections: int = 256
    max_head_bytes: int = 64 << 10
    max_headers: int = 100
    max_body_bytes: int = 1 << 20
    head_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    # Requests answered on one connection before it is closed (the client then reconnects).
    max_requests_per_connection: int = 10_000
    write_buffer_bytes: int = 64 << 10
    max_body_bytes_total: int = 32 << 20
    # A 930 KB extender filter naming 40,000 unknown nodes answers 8.5 MB: room for a few of those.
    max_unsent_bytes: int = 64 << 20
    inline_body_bytes: int = 64 << 10
    # One: the GIL runs one JSON call at a time anyway, and each worker holding it is a wait for the
    # loop (bench/hostile_clients.py http, bodies: /healthz p99 331 ms with one slot, 1.1 s with two).
    max_body_work: int = 1

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            # Seconds and sizes above 0; a body limit of 0 means no body (NaN fails both).
            least_ok = value >= 0 if name == "max_body_bytes" else value > 0
            if not least_ok or (isinstance(value, float) and value == float("inf")):
                raise ValueError(f"Limits.{name} must be positive and finite, not {value!r}")


# The agent's health port: GET and HEAD only (no body), probes expect an answer within seconds, and
# its answers (a /metrics page) are small.
HEALTH_LIMITS: Final = Limits(max_head_bytes=16 << 10, max_body_bytes=0, head_timeout_s=5.0, body_timeout_s=5.0,
                              write_timeout_s=5.0, max_body_bytes_total=1, max_unsent_bytes=16 << 20)

# Connection events: counted always; logged (at most once per peer and event a minute) at this level.
EVENT_LEVELS: Final[Mapping[str, str | None]] = {
    "refused": "warning",       # at the cap with every connection inside a request
    "evicted": "info",          # closed to make room for a new connection
    "idle_closed": None,        # no request within the head deadline: an idle keep-alive, normal
    "head_timeout": "info",     # a request head (or TLS handshake) begun and not finished in time
    "body_timeout": "info",
    "write_timeout": "warning",  # the client did not take its answer in time: aborted
    "busy": "warning",          # answered 503: body work, bodies or unsent answers at their bound
}


class HttpError(Exception):
    """Raised by a handler, a guard or the request parser to answer ``status`` with an error body."""

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
    # The subject of the TLS client certificate the listener verified ("CN=kube-scheduler,O=memtopo");
    # None without TLS, without a client CA, or when the client presented none.
    client_subject: str | None = None
    tls: bool = False
    # A large request (its body over Limits.inline_body_bytes): JSON work goes to a worker thread.
    large: bool = False

    async def json(self) -> Any:
        """The body as JSON (decoded in a worker thread for a large request); HttpError(400) when it
        is not JSON."""
        if self.large:
            return await asyncio.to_thread(_decode_json, self.body)
        return _decode_json(self.body)


def _decode_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {excerpt(str(exc))}") from None


_SEPARATORS: Final = (",", ":")
# Members per json.dumps call when a large request's answer is encoded in a worker thread. One call
# over a multi-MB answer would hold the GIL for all of it (the C encoder never lets go), and the loop,
# which needs the GIL to answer a probe, would wait as long; between short calls it gets its turn.
PIECE_MEMBERS = 512


def _encode_json(doc: Any) -> bytes:
    return (json.dumps(doc, separators=_SEPARATORS) + "\n").encode()


def _splittable(value: Any) -> bool:
    """A container worth encoding member by member: many members, or a member that has many."""
    if type(value) is dict:
        # json.dumps turns other keys into strings its own way: leave those to it, whole.
        if not all(type(k) is str for k in value):
            return False
        children: Iterable[Any] = value.values()
    elif type(value) is list:
        children = value
    else:
        return False
    return len(value) > PIECE_MEMBERS or any(type(c) in (dict, list) and len(c) > PIECE_MEMBERS for c in children)


def _pieces(value: Any, out: list[bytes]) -> None:
    """Append the JSON of ``value``, known to be _splittable, to ``out`` in pieces, joined once at the
    end (an 8 MB answer copied at every level would cost more than its encoding)."""
    is_dict = type(value) is dict
    children = value.values() if is_dict else value
    # The members that are themselves split; the runs between them go PIECE_MEMBERS to a call.
    nested = [i for i, c in enumerate(children) if type(c) in (dict, list) and _splittable(c)]
    members = iter(value.items() if is_dict else value)
    out.append(b"{" if is_dict else b"[")
    position = 0
    for stop in [*nested, len(value)]:
        while position < stop:
            run = list(itertools.islice(members, min(PIECE_MEMBERS, stop - position)))
            if position:
                out.append(b",")
            position += len(run)
            out.append(json.dumps(dict(run) if is_dict else run, separators=_SEPARATORS)[1:-1].encode())
        if stop < len(value):
            member = next(members)
            if position:
                out.append(b",")
            position += 1
            if is_dict:
                out.append(json.dumps(member[0]).encode() + b":")
            _pieces(member[1] if is_dict else member, out)
    out.append(b"}" if is_dict else b"]")


def encode_json_in_pieces(doc: Any) -> bytes:
    """The bytes ``Response.json`` sends (compact JSON and a newline), made by many short json.dumps
    calls rather than one, for a worker thread that must not hold the GIL for long."""
    if not _splittable(doc):
        return _encode_json(doc)
    out: list[bytes] = []
    _pieces(doc, out)
    out.append(b"\n")
    return b"".join(out)


class Response:
    """A whole answer. ``Response.json(doc)`` is encoded when it is sent (for a large request, in a
    worker thread) or when ``body`` is first read."""

    __slots__ = ("_body", "_doc", "content_type", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", content_type: str = TEXT_TYPE,
                 headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self._body: bytes | None = body
        self._doc: tuple[Any] | None = None
        self.content_type = content_type
        self.headers: Mapping[str, str] = dict(headers or {})

    @classmethod
    def json(cls, obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
        resp = cls(status, b"", JSON_TYPE, headers)
        resp._body, resp._doc = None, (obj,)
        return resp

    @classmethod
    def text(cls, text: str, status: int = 200, content_type: str = TEXT_TYPE) -> Response:
        return cls(status, text.encode(), content_type)

    @property
    def encoded(self) -> bool:
        return self._body is not None

    @property
    def body(self) -> bytes:
        if self._body is None:
            assert self._doc is not None
            self._body, self._doc = _encode_json(self._doc[0]), None
        return self._body


@dataclass(frozen=True)
class StreamResponse:
    """A body produced while it is sent (chunked). The connection closes when the iterator ends, the
    client goes away or stalls a write past the write deadline (the iterator is then closed: its
    ``finally`` runs) or the server stops."""

    chunks: AsyncIterator[bytes]
    content_type: str = SSE_TYPE
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
# Runs before the body is read; raises HttpError (401, 403) to refuse the request.
Guard = Callable[[Request], None]


@dataclass(frozen=True)
class Exchange:
    """One answered request, as observers (metrics, access logs) see it."""

    method: str
    target: str
    version: str
    route: str  # "" when no route was found
    status: int
    seconds: float  # head received → answer ready to write (streams: → the stream starts)
    peer: str


Observer = Callable[[Exchange], None]
# Called with the event name (EVENT_LEVELS) for every occurrence, on the server's loop.
EventHook = Callable[[str], None]
ErrorFormat = Callable[[HttpError], Response]


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


# ---- guards ------------------------------------------------------------------------------------------
class BearerToken:
    """A route guard: the request must carry ``Authorization: Bearer TOKEN`` where TOKEN is the
    contents of ``path`` (surrounding whitespace removed), compared in constant time. The file is read
    again when it changes (a rotated Kubernetes Secret); while it is unreadable or empty the last
    token read stays in force. ValueError at construction when it cannot be read or is empty."""

    MAX_BYTES: Final = 4096

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._bad: tuple[int, int, int] | None = None
        self._token = b""
        self._problem = ""
        if not self._reload():
            raise ValueError(f"bearer token file {shorten(path)}: {self._problem}")

    def _reload(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read(self.MAX_BYTES + 1)
        except OSError as exc:
            self._problem = reason(exc)
            return False
        token = data.strip()
        if len(data) > self.MAX_BYTES or not token or any(b < 0x21 or b > 0x7E for b in token):
            self._problem = f"not one token of at most {self.MAX_BYTES} printable ASCII bytes"
            return False
        self._token, self._stamp = token, (st.st_ino, st.st_mtime_ns, st.st_size)
        return True

    def _current(self) -> bytes:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._token
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp not in (self._stamp, self._bad) and not self._reload():
            self._bad = stamp  # logged once per version of the file, not once per request
            log.warning("http_token_file_unreadable", path=self.path, reason=self._problem)
        return self._token

    def __call__(self, request: Request) -> None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        given = value.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self._current()):
            raise HttpError(HTTPStatus.UNAUTHORIZED, "this route needs its bearer token",
                            {"WWW-Authenticate": 'Bearer realm="memtopo"'})


class ClientCertificate:
    """A route guard: the connection presented a TLS client certificate the listener verified against
    its client CA; with ``subjects``, the certificate's subject must be one of them."""

    def __init__(self, subjects: Iterable[str] = ()) -> None:
        self.subjects = frozenset(subjects)

    def __call__(self, request: Request) -> None:
        if request.client_subject is None:
            raise HttpError(HTTPStatus.FORBIDDEN, "this route needs a verified TLS client certificate")
        if self.subjects and request.client_subject not in self.subjects:
            raise HttpError(HTTPStatus.FORBIDDEN,
                            f"client certificate {excerpt(request.client_subject)} may not use this route")


def any_guard(*guards: Guard) -> Guard:
    """A guard that passes when one of ``guards`` passes; otherwise the first one's refusal."""
    if not guards:
        raise ValueError("any_guard needs at least one guard")

    def check(request: Request) -> None:
        first: HttpError | None = None
        for guard in guards:
            try:
                guard(request)
                return
            except HttpError as exc:
                first = first or exc
        assert first is not None
        raise first
    return check


# ---- routes ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Route:
    route: str
    handler: Handler
    guard: Guard | None


class Routes:
    """Method + path → handler. Exact paths win over prefixes; the longest prefix wins."""

    def __init__(self) -> None:
        self._exact: dict[tuple[str, str], _Route] = {}
        self._prefix: list[tuple[str, str, _Route]] = []

    def add(self, method: str, path: str, handler: Handler, *, prefix: bool = False,
            guard: Guard | None = None) -> None:
        """Register ``handler`` (behind ``guard``, when given); ValueError when the method/path pair is
        taken (two features must not silently shadow each other)."""
        method = method.upper()
        if method not in _METHODS or method == "HEAD":
            raise ValueError(f"method {method!r}: register GET (HEAD follows it), POST, PUT, DELETE, PATCH or OPTIONS")
        if not path.startswith("/"):
            raise ValueError(f"path {path!r} must start with /")
        if prefix:
            if any(m == method and p == path for m, p, _ in self._prefix):
                raise ValueError(f"{method} {path}* is already registered")
            self._prefix.append((method, path, _Route(path + "*", handler, guard)))
            self._prefix.sort(key=lambda r: -len(r[1]))
        else:
            if (method, path) in self._exact:
                raise ValueError(f"{method} {path} is already registered")
            self._exact[(method, path)] = _Route(path, handler, guard)

    def paths(self) -> list[str]:
        return sorted({p for _, p in self._exact} | {p + "*" for _, p, _ in self._prefix})

    def resolve(self, method: str, path: str) -> _Route:
        """The route; HttpError 404 or 405 (with Allow) otherwise."""
        wanted = "GET" if method == "HEAD" else method
        found = self._exact.get((wanted, path))
        if found is not None:
            return found
        for m, p, r in self._prefix:
            if m == wanted and path.startswith(p):
                return r
        allowed = {m for m, p in self._exact if p == path} | {m for m, p, _ in self._prefix if path.startswith(p)}
        if allowed:
            if "GET" in allowed:
                allowed.add("HEAD")
            raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not served at this path",
                            {"Allow": ", ".join(sorted(allowed))})
        raise HttpError(HTTPStatus.NOT_FOUND, "no such path")


# ---- request heads -----------------------------------------------------------------------------------
@dataclass
class _Head:
    method: str
    target: str
    version: str
    headers: dict[str, str]


def parse_head(raw: bytes, max_headers: int = Limits.max_headers) -> _Head:
    """A request line and its header lines (without the final blank line); HttpError otherwise."""
    lines = raw.decode("latin-1").split("\r\n")
    while lines and not lines[0]:
        lines.pop(0)  # RFC 9112 2.2: empty lines before the request line are ignored
    first = lines[0] if lines else ""
    parts = first.split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"bad request line {excerpt(first)}")
    method, target, version = parts
    if method not in _METHODS:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, f"method {excerpt(method)} is not served")
    if not target.startswith("/"):
        raise HttpError(HTTPStatus.BAD_REQUEST, f"request target {excerpt(target)} is not a path")
    header_lines = [line for line in lines[1:] if line]
    if len(header_lines) > max_headers:
        raise HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"more than {max_headers} header lines")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise HttpError(HTTPStatus.BAD_REQUEST, f"bad header line {excerpt(line)}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return _Head(method, target, version, headers)


def content_length(headers: Mapping[str, str], limit: int) -> int:
    """The announced body size; HttpError 411 (chunked), 400 (malformed) or 413 (over ``limit``)."""
    if "transfer-encoding" in headers:
        raise HttpError(HTTPStatus.LENGTH_REQUIRED, "send the body with Content-Length, not Transfer-Encoding")
    text = headers.get("content-length")
    if text is None:
        return 0
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        raise HttpError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {excerpt(text)}")
    n = int(text)
    if n > limit:
        raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {n} bytes; the limit is {limit}")
    return n


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (or an Origin's authority) → (host in lower case, without brackets or a final
    dot; port or None); None when it is malformed."""
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    else:
        host, _, port = value.partition(":")
    if not host or (port and not (port.isascii() and port.isdigit() and len(port) <= 5)):
        return None
    return host.lower().removesuffix("."), int(port) if port else None


def host_allowed(host: str, names: frozenset[str]) -> bool:
    """Whether a Host's host part names this listener: an IP literal (a rebinding page's Host is a
    name, never an address; kube-scheduler, the kubelet and Prometheus come by address), a loopback
    name, or one of ``names``."""
    if host in names or host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def same_origin(origin: str, host: str, tls: bool) -> bool:
    """Whether the ``Origin`` header names the origin the ``Host`` header addresses."""
    scheme = "https" if tls else "http"
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    if parts.scheme != scheme or parts.path or parts.query or parts.fragment or parts.username or not parts.netloc:
        return False
    ours = split_host(host)
    theirs = split_host(parts.netloc)
    if ours is None or theirs is None:
        return False
    default = 443 if tls else 80
    return theirs[0] == ours[0] and (origin_port or default) == (ours[1] or default)


def certificate_subject(cert: Mapping[str, Any] | None) -> str | None:
    """A verified peer certificate's subject as ``CN=…,O=…`` (its order, RFC 4514 escapes)."""
    if not cert or "subject" not in cert:
        return None
    short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
             "localityName": "L", "stateOrProvinceName": "ST", "domainComponent": "DC", "userId": "UID"}
    out = []
    for rdn in cert["subject"]:
        for key, value in rdn:
            text = "".join("\\" + c if c in ',+"\\<>;=' else c for c in str(value))
            out.append(f"{short.get(key, key)}={text}")
    return ",".join(out)


def default_error(exc: HttpError) -> Response:
    return Response(exc.status, _encode_json({"error": exc.message}), JSON_TYPE, exc.headers)


def bind(address: str) -> socket.socket:
    """A listening, non-blocking socket on ``address`` (``host:port``, ``[v6]:port``; port 0 =
    ephemeral). ListenError names the address and why (malformed, in use, not local, no permission)."""
    try:
        host, port = parse_host_port(address)
    except AddressError as exc:
        raise ListenError(str(exc)) from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        # SO_REUSEADDR (create_server's default): a restarted process rebinds at once over TIME_WAIT.
        sock = socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN)
    except OSError as exc:
        raise ListenError(f"{shorten(address)}: cannot listen: {reason(exc)}") from None
    except (UnicodeError, ValueError) as exc:  # a name getaddrinfo cannot even encode
        raise ListenError(f"{shorten(address)}: cannot listen: {exc}") from None
    sock.setblocking(False)
    return sock


# ---- the server --------------------------------------------------------------------------------------
class _Conn:
    __slots__ = ("host", "peer", "writer")

    def __init__(self, peer: str, host: str, writer: asyncio.StreamWriter) -> None:
        self.peer = peer
        self.host = host
        self.writer = writer


class _AbortError(Exception):
    """End this connection now, without a graceful close."""


def _status_line(status: int) -> str:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Status"
    return f"HTTP/1.1 {status} {phrase}"


_REFUSED_BODY: Final = b'{"error":"too many connections"}\n'
_REFUSED: Final = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(_REFUSED_BODY), _REFUSED_BODY))


class HttpServer:
    """A listener. ``routes`` may gain routes while it serves (lookups happen per request).

    ``hosts``: names accepted in ``Host`` besides IP literals and ``localhost``. ``observer`` hears
    every answered request, ``on_event`` every connection event; ``errors`` formats error answers;
    ``name`` is the ``Server`` header and the ``listener`` field of its log events."""

    def __init__(self, routes: Routes, limits: Limits = Limits(), *, name: str = "memtopo",
                 hosts: Iterable[str] = (), observer: Observer | None = None, on_event: EventHook | None = None,
                 errors: ErrorFormat = default_error) -> None:
        self.routes = routes
        self.limits = limits
        self.name = name
        self.hosts = frozenset(h.lower().removesuffix(".") for h in hosts)
        self._observer = observer
        self._on_event = on_event
        self._errors = errors
        self._conns: dict[_Conn, asyncio.Task[None]] = {}
        # Connections waiting for a request head (or their TLS handshake), longest waiting first.
        self._waiting: OrderedDict[_Conn, None] = OrderedDict()
        self._work = asyncio.Semaphore(limits.max_body_work)
        self._ssl: ssl.SSLContext | None = None
        self._server: asyncio.Server | None = None
        self._throttle = Throttle()
        self.events: Counter[str] = Counter()
        self.body_bytes = 0  # bodies being read or worked on
        self.unsent_bytes = 0  # answers built and not yet taken by their clients
        self.peak_unsent_bytes = 0
        self.working = 0  # large requests in their handlers
        self.host = ""
        self.port = 0

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self._ssl else 'http'}://{self.address}"

    @property
    def connections(self) -> int:
        return len(self._conns)

    async def start(self, sock: socket.socket, ssl_context: ssl.SSLContext | None = None) -> None:
        """Serve on a listening socket (``bind``), with TLS when ``ssl_context`` is given."""
        self._ssl = ssl_context
        self._server = await asyncio.start_server(self._connection, sock=sock, limit=self.limits.max_head_bytes)
        sockname = sock.getsockname()
        self.host, self.port = str(sockname[0]), int(sockname[1])

    async def stop(self) -> None:
        """Stop accepting, end every connection (streams included) and wait for them."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._conns.values())
        for conn in list(self._conns):
            conn.writer.transport.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    # ---- events -----------------------------------------------------------------------------------
    def _event(self, event: str, host: str, **fields: object) -> None:
        self.events[event] += 1
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:  # metrics must never break serving
                log.exception("http_event_hook_failed")
        level = EVENT_LEVELS.get(event)
        if level is not None:
            held_back = self._throttle.allow(f"{event}:{host}")
            if held_back is not None:
                getattr(log, level)(f"http_{event}", listener=self.name, peer=host, held_back=held_back,
                                    interval_seconds=self._throttle.interval, **fields)

    def _observe(self, exchange: Exchange) -> None:
        if self._observer is not None:
            try:
                self._observer(exchange)
            except Exception:  # metrics must never break serving
                log.exception("http_observer_failed")

    # ---- one connection ---------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = writer.get_extra_info("peername")
        host = str(info[0]) if isinstance(info, tuple) and info else "?"
        peer = f"{host}:{info[1]}" if isinstance(info, tuple) and len(info) > 1 else host
        conn = _Conn(peer, host, writer)
        if len(self._conns) >= self.limits.max_connections:
            victim = next(iter(self._waiting), None)
            if victim is None:
                self._event("refused", host, connections=len(self._conns))
                if self._ssl is None:
                    writer.write(_REFUSED)
                    writer.close()  # a few bytes the kernel takes: nothing waits on this peer
                else:
                    writer.transport.abort()
                return
            self._drop(victim)
            self._event("evicted", victim.host, connections=len(self._conns))
        task = asyncio.current_task()
        assert task is not None
        self._conns[conn] = task
        clean = False
        try:
            clean = await self._serve(conn, reader)
        except TimeoutError:  # an OSError too: caught first
            self._event("write_timeout", host)
        except (_AbortError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, OSError):
            pass
        except asyncio.CancelledError:
            # stop() ends it. Not re-raised: asyncio's stream callback reads a cancelled task's
            # exception() and logs the CancelledError as an error.
            pass
        except Exception:  # a bug here ends this connection only
            log.exception("http_connection_failed", listener=self.name, peer=peer)
        finally:
            self._drop(conn, clean)

    def _drop(self, conn: _Conn, clean: bool = False) -> None:
        """Forget ``conn`` and close it: a FIN when it ended cleanly with nothing left to send, else
        an abort (nothing waits on a peer that does not read)."""
        self._conns.pop(conn, None)
        self._waiting.pop(conn, None)
        transport = conn.writer.transport
        if clean and not transport.is_closing() and transport.get_write_buffer_size() == 0:
            transport.close()
        else:
            transport.abort()

    async def _serve(self, conn: _Conn, reader: asyncio.StreamReader) -> bool:
        """Requests until the connection is to close; True when it ends cleanly."""
        writer = conn.writer
        writer.transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes)
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets this only on sockets whose protocol number says TCP, and a socket from
            # socket.create_server (bind) says 0: without it an answer's body waits behind its head
            # for the client's delayed ACK, 40 ms on every keep-alive request.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handshake = self._ssl is not None
        for _ in range(self.limits.max_requests_per_connection):
            self._waiting[conn] = None
            raw = await self._read_head(conn, reader, handshake)
            handshake = False
            self._waiting.pop(conn, None)
            if raw is None:
                return True
            if not await self._exchange(conn, reader, raw):
                return True
        return True

    async def _read_head(self, conn: _Conn, reader: asyncio.StreamReader, handshake: bool) -> bytes | None:
        """A complete request head (without its final CRLF CRLF), or None when the connection ends:
        the client closed, or sent nothing within the head deadline (an idle keep-alive)."""
        first = b""
        try:
            async with asyncio.timeout(self.limits.head_timeout_s):
                if handshake:
                    await self._handshake(conn, reader)
                first = await reader.readexactly(1)
                rest = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            self._event("head_timeout" if first or handshake else "idle_closed", conn.host)
            return None
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:
            exc = HttpError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                            f"the request head is over {self.limits.max_head_bytes} bytes")
            self._observe(Exchange("", "", "", "", exc.status, 0.0, conn.peer))
            await self._send(conn, self._errors(exc), head=False, keep_alive=False)
            return None
        return (first + rest)[:-4]

    async def _handshake(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        """TLS on an accepted connection, so that it counts against the cap (and can be evicted) from
        its first byte, not only once the handshake is done."""
        assert self._ssl is not None
        loop = asyncio.get_running_loop()
        raw = conn.writer.transport
        protocol = raw.get_protocol()
        secured = await loop.start_tls(raw, protocol, self._ssl, server_side=True,
                                       ssl_handshake_timeout=self.limits.head_timeout_s,
                                       ssl_shutdown_timeout=min(self.limits.write_timeout_s, 5.0))
        if secured is None:  # the peer left during the handshake (CPython 3.12 then returns no transport)
            raise ConnectionResetError("closed during the TLS handshake")
        secured.set_write_buffer_limits(high=self.limits.write_buffer_bytes)
        writer = asyncio.StreamWriter(secured, protocol, reader, loop)
        # What StreamWriter.start_tls does, which fails on a connection lost during the handshake.
        cast(asyncio.StreamReaderProtocol, protocol)._replace_writer(writer)  # type: ignore[attr-defined]
        conn.writer = writer

    def _room_for_answer(self, conn: _Conn, large: bool, length: int) -> None:
        """A large request with no room left among the unsent answers for even an answer the size
        of its body is refused before its body is read or its handler runs: that work would end in
        a busy answer anyway (and clients that never read would cost it again and again)."""
        if large and self.unsent_bytes + length > self.limits.max_unsent_bytes:
            self._event("busy", conn.host, why="unsent_answers")
            raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "busy: too many answers waiting for their clients; retry",
                            {"Retry-After": "1"})

    def _request_checks(self, head: _Head, tls: bool) -> _Route:
        """Host, Origin, route, media type: what is refused before a body is read."""
        host = head.headers.get("host")
        if host is None:
            if head.version == "HTTP/1.1":
                raise HttpError(HTTPStatus.BAD_REQUEST, "an HTTP/1.1 request needs a Host header")
        else:
            parsed = split_host(host)
            if parsed is None or not host_allowed(parsed[0], self.hosts):
                raise HttpError(HTTPStatus.MISDIRECTED_REQUEST,
                                f"Host {excerpt(host)} does not name this listener (its address, localhost, "
                                "or a name it was configured with)")
        origin = head.headers.get("origin")
        if origin is not None and (host is None or not same_origin(origin, host, tls)):
            raise HttpError(HTTPStatus.FORBIDDEN, f"requests from origin {excerpt(origin)} are not served here")
        route = self.routes.resolve(head.method, unquote(urlsplit(head.target).path) or "/")
        if head.method in _BODY_METHODS:
            media = head.headers.get("content-type", "").partition(";")[0].strip().lower()
            if media != JSON_TYPE:
                given = excerpt(media) if media else "no Content-Type"
                raise HttpError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"{head.method} takes {JSON_TYPE}, not {given}")
        return route

    async def _exchange(self, conn: _Conn, reader: asyncio.StreamReader, raw: bytes) -> bool:
        """Serve one request; False when the connection is to be closed."""
        started = time.perf_counter()
        limits = self.limits
        tls = self._ssl is not None
        try:
            head = parse_head(raw, limits.max_headers)
        except HttpError as exc:
            # The stream position is unknown after a bad head: answer and close.
            self._observe(Exchange("", "", "", "", exc.status, 0.0, conn.peer))
            await self._send(conn, self._errors(exc), head=False, keep_alive=False)
            return False
        keep_alive = _keep_alive(head)
        head_only = head.method == "HEAD"
        route = ""
        length = 0
        read = False
        # A body announced and not read (refused first, or a malformed length) is still on the wire.
        unread = "content-length" in head.headers or "transfer-encoding" in head.headers
        answer: Response | StreamResponse
        large = False
        slot = False
        try:
            found = self._request_checks(head, tls)
            route = found.route
            length = content_length(head.headers, limits.max_body_bytes)
            parts = urlsplit(head.target)
            try:
                query = parse_qs(parts.query, max_num_fields=100)
            except ValueError as exc:
                raise HttpError(HTTPStatus.BAD_REQUEST, shorten(str(exc))) from None
            request = Request(head.method, unquote(parts.path) or "/", query, head.headers, b"", conn.peer, route,
                              certificate_subject(conn.writer.get_extra_info("peercert")) if tls else None, tls)
            if found.guard is not None:
                found.guard(request)
            large = length > limits.inline_body_bytes
            self._room_for_answer(conn, large, length)
            if length:
                if self.body_bytes + length > limits.max_body_bytes_total:
                    self._event("busy", conn.host, why="bodies")
                    raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "busy: too many request bodies at once; retry",
                                    {"Retry-After": "1"})
                self.body_bytes += length
                read = True
                if head.headers.get("expect", "").lower() == "100-continue":
                    conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                try:
                    async with asyncio.timeout(limits.body_timeout_s):
                        body = await reader.readexactly(length)
                except TimeoutError:
                    self._event("body_timeout", conn.host)
                    raise _AbortError from None
                request = _with_body(request, body, large)
            unread = False
            if large:
                try:
                    async with asyncio.timeout(limits.head_timeout_s):
                        await self._work.acquire()
                except TimeoutError:
                    self._event("busy", conn.host, why="body_work")
                    raise HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "busy: too many large requests at once; retry",
                                    {"Retry-After": "1"}) from None
                slot = True
                self.working += 1
                self._room_for_answer(conn, large, length)  # again: answers may have piled up meanwhile
            answer = await found.handler(request)
            if large and isinstance(answer, Response) and not answer.encoded:
                await asyncio.to_thread(_encode, answer)
        except HttpError as exc:
            answer = self._errors(exc)
            if unread:
                keep_alive = False
        except (_AbortError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("http_handler_failed", listener=self.name, method=head.method, route=route, peer=conn.peer)
            answer = self._errors(HttpError(HTTPStatus.INTERNAL_SERVER_ERROR,
                                            f"internal error (see the {self.name} log)"))
        finally:
            if slot:
                self.working -= 1
                self._work.release()
            if read:
                self.body_bytes -= length
        elapsed = time.perf_counter() - started
        if isinstance(answer, StreamResponse):
            self._observe(Exchange(head.method, head.target, head.version, route, answer.status, elapsed, conn.peer))
            await self._stream(conn, answer, head_only, head.version)
            return False
        size = len(answer.body)
        if not head_only and size and self.unsent_bytes + size > limits.max_unsent_bytes:
            self._event("busy", conn.host, why="unsent_answers", bytes=size)
            answer = self._errors(HttpError(HTTPStatus.SERVICE_UNAVAILABLE, "busy: too many answers waiting for their "
                                            "clients; retry", {"Retry-After": "1"}))
            keep_alive = False
        # Observed before it is written: a client that has its answer finds it counted and logged.
        self._observe(Exchange(head.method, head.target, head.version, route, answer.status,
                               time.perf_counter() - started, conn.peer))
        await self._send(conn, answer, head=head_only, keep_alive=keep_alive)
        return keep_alive

    def _head_bytes(self, status: int, content_type: str, headers: Mapping[str, str], extra: Sequence[str]) -> bytes:
        lines = [_status_line(status), f"Server: {self.name}", f"Content-Type: {content_type}",
                 "Cache-Control: no-store", *extra]
        lines.extend(f"{_one_line(k)}: {_one_line(v)}" for k, v in headers.items())
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")

    async def _send(self, conn: _Conn, resp: Response, *, head: bool, keep_alive: bool) -> None:
        """Write one answer within the write deadline (TimeoutError: the connection is aborted)."""
        body = resp.body
        writer = conn.writer
        connection = "keep-alive" if keep_alive else "close"
        data = self._head_bytes(resp.status, resp.content_type, resp.headers,
                                (f"Content-Length: {len(body)}", f"Connection: {connection}"))
        counted = 0 if head else len(body)
        self.unsent_bytes += counted
        self.peak_unsent_bytes = max(self.peak_unsent_bytes, self.unsent_bytes)
        try:
            async with asyncio.timeout(self.limits.write_timeout_s):
                if counted and len(body) <= _SLICE:
                    writer.write(data + body)  # one segment for a small answer
                else:
                    writer.write(data)
                    view = memoryview(body) if counted else memoryview(b"")
                    for offset in range(0, len(view), _SLICE):
                        writer.write(view[offset:offset + _SLICE])
                        await writer.drain()
                await writer.drain()
        finally:
            self.unsent_bytes -= counted

    async def _stream(self, conn: _Conn, resp: StreamResponse, head: bool, version: str) -> None:
        writer = conn.writer
        chunked = version != "HTTP/1.0"
        extra = ["Connection: close", "X-Accel-Buffering: no"] + (["Transfer-Encoding: chunked"] if chunked else [])
        chunks = resp.chunks
        try:
            async with asyncio.timeout(self.limits.write_timeout_s):
                writer.write(self._head_bytes(resp.status, resp.content_type, resp.headers, extra))
                await writer.drain()
            if head:
                return
            async for chunk in chunks:
                if not chunk:
                    continue
                async with asyncio.timeout(self.limits.write_timeout_s):
                    writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                    await writer.drain()
            if chunked:
                async with asyncio.timeout(self.limits.write_timeout_s):
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def _encode(resp: Response) -> None:
    """Encode ``resp`` in the worker thread that calls this, in pieces."""
    if resp._doc is not None:
        resp._body, resp._doc = encode_json_in_pieces(resp._doc[0]), None


def _with_body(request: Request, body: bytes, large: bool) -> Request:
    return Request(request.method, request.path, request.query, request.headers, body, request.peer, request.route,
                   request.client_subject, request.tls, large)


def _keep_alive(head: _Head) -> bool:
    tokens = {t.strip().lower() for t in head.headers.get("connection", "").split(",")}
    if head.version == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


# ---- a listener on its own thread ----------------------------------------------------------------
class ServerThread:
    """An HttpServer on its own asyncio loop in one daemon thread, for an endpoint that must answer
    while its owner's loop is busy (the agent's health port: that is when /healthz has something to
    say). ``make`` builds the server on that loop. stop() is idempotent."""

    def __init__(self, make: Callable[[], HttpServer], sock: socket.socket, ssl_context: ssl.SSLContext | None = None,
                 thread_name: str = "memtopo-http") -> None:
        self._make = make
        self._sock = sock
        self._ssl = ssl_context
        self.server: HttpServer | None = None
        self._loop = asyncio.new_event_loop()
        self._stop_event: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _serving(self) -> HttpServer:
        assert self.server is not None
        return self.server

    @property
    def host(self) -> str:
        return self._serving().host

    @property
    def port(self) -> int:
        return self._serving().port

    @property
    def url(self) -> str:
        return self._serving().url

    @property
    def connections(self) -> int:
        return self._serving().connections

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to the starter, or logged
            if not self._started.is_set():
                self._error = exc
                self._started.set()
            else:
                log.error("http_server_failed", error=repr(exc))
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        server = self.server = self._make()
        await server.start(self._sock, self._ssl)
        self._started.set()
        try:
            await self._stop_event.wait()
        finally:
            await server.stop()

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
