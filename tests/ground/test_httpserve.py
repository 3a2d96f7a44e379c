"""memtopo's one HTTP/1.1 server (memtopo/httpserve.py): routing, limits, errors, streams, and what
hostile clients can and cannot do: clients that never read their answers, idle connections at the cap
(plaintext and TLS), large bodies beside probes, refusals logged once per peer, requests from other
origins and rebinding names (also from a real Chromium), and the guards a route can carry. Raw
sockets, so malformed requests reach the server exactly as sent."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo import httpserve, tls
from memtopo.httpserve import (
    BearerToken,
    ClientCertificate,
    Exchange,
    HttpError,
    HttpServer,
    Limits,
    Request,
    Response,
    Routes,
    ServerThread,
    StreamResponse,
    any_guard,
    bind,
    sse_event,
)
from tests.agents import certificates
from tests.chromium import chromium
from tests.http_client import exchange, get, post, read_response, read_response_head_only

MiB = 1 << 20


def with_server(body: Callable[[HttpServer], Awaitable[None]], routes: Routes | None = None,
                limits: Limits | None = None, ssl_context: ssl.SSLContext | None = None, **kwargs: Any) -> None:
    async def main() -> None:
        server = HttpServer(routes or sample_routes(), limits or Limits(), **kwargs)
        await server.start(bind("127.0.0.1:0"), ssl_context)
        try:
            await body(server)
        finally:
            await server.stop()
    asyncio.run(main())


def sample_routes() -> Routes:
    routes = Routes()

    async def echo(request: Request) -> Response:
        return Response.json({"path": request.path, "query": dict(request.query), "body": await request.json(),
                              "route": request.route})

    async def boom(request: Request) -> Response:
        raise RuntimeError("secret internal detail")

    async def teapot(request: Request) -> Response:
        raise HttpError(418, "short and stout")

    async def node(request: Request) -> Response:
        return Response.text(request.path.removeprefix("/nodes/"))

    async def healthz(request: Request) -> Response:
        return Response.json({"status": "ok"})

    routes.add("POST", "/echo", echo)
    routes.add("GET", "/boom", boom)
    routes.add("GET", "/teapot", teapot)
    routes.add("GET", "/nodes/", node, prefix=True)
    routes.add("GET", "/healthz", healthz)
    return routes


def held_route(routes: Routes, method: str, path: str) -> asyncio.Event:
    """A route whose requests stay in their handler until the returned event is set, then answer {}."""
    release = asyncio.Event()

    async def held(request: Request) -> Response:
        await release.wait()
        return Response.json({})

    routes.add(method, path, held)
    return release


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``predicate`` on the loop; the generous deadline only ends a hang."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


# ---- routing, answers, errors --------------------------------------------------------------------
def test_routes_answer_json_and_prefixes_and_errors_are_json_never_tracebacks() -> None:
    async def body(server: HttpServer) -> None:
        status, headers, raw = await exchange(server.port, post("/echo?a=1&a=2", b'{"x": [1]}'))
        assert status == 200 and headers["content-type"] == httpserve.JSON_TYPE
        assert json.loads(raw) == {"path": "/echo", "query": {"a": ["1", "2"]}, "body": {"x": [1]}, "route": "/echo"}
        status, _, raw = await exchange(server.port, get("/nodes/gpu%2Dnode-1"))
        assert (status, raw) == (200, b"gpu-node-1")
        status, _, raw = await exchange(server.port, get("/boom"))
        assert status == 500 and b"secret" not in raw and b"Traceback" not in raw
        status, _, raw = await exchange(server.port, get("/teapot"))
        assert (status, json.loads(raw)) == (418, {"error": "short and stout"})
        status, _, _ = await exchange(server.port, get("/nowhere"))
        assert status == 404
        status, headers, _ = await exchange(server.port, get("/echo"))
        assert status == 405 and headers["allow"] == "POST"
        status, _, raw = await exchange(server.port, post("/echo", b"{not json"))
        assert status == 400 and b"not JSON" in raw
        status, _, raw = await exchange(server.port, get("/nodes/x?" + "&".join(f"k{i}=v" for i in range(200))))
        assert status == 400 and b"Traceback" not in raw
    with_server(body)


def test_head_follows_get_without_a_body() -> None:
    async def body(server: HttpServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"HEAD /nodes/a HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + get("/nodes/b"))
        await writer.drain()
        status, headers, _ = await read_response_head_only(reader)
        assert status == 200 and headers["content-length"] == "1"
        # The next response starts right after the HEAD answer's headers: no body was sent.
        status, _, raw = await read_response(reader)
        assert (status, raw) == (200, b"b")
        writer.close()
    with_server(body)


def test_keep_alive_serves_several_requests_and_connection_close_ends_it() -> None:
    async def body(server: HttpServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for i in range(3):
            writer.write(post("/echo", json.dumps(i).encode()))
            status, headers, raw = await read_response(reader)
            assert status == 200 and json.loads(raw)["body"] == i and headers["connection"] == "keep-alive"
        writer.write(post("/echo", b"1", "Connection: close\r\n"))
        status, headers, _ = await read_response(reader)
        assert headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    with_server(body)


@pytest.mark.parametrize(("raw", "status"), [
    (b"GARBAGE\r\n\r\n", 400),
    (b"BREW /pot HTTP/1.1\r\n\r\n", 501),
    (b"GET http://elsewhere/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * (Limits.max_headers + 1) + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * Limits.max_head_bytes + b"\r\n\r\n", 431),
    (b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
     % (Limits.max_body_bytes + 1), 413),
])
def test_malformed_or_oversized_requests_get_a_status_and_the_connection_closes(raw: bytes, status: int) -> None:
    async def body(server: HttpServer) -> None:
        got, headers, text = await exchange(server.port, raw)
        assert got == status and headers["connection"] == "close"
        assert "error" in json.loads(text)
    with_server(body)


def test_a_body_of_exactly_the_limit_is_read() -> None:
    async def body(server: HttpServer) -> None:
        payload = b'"' + b"a" * (Limits.max_body_bytes - 2) + b'"'
        status, _, raw = await exchange(server.port, post("/echo", payload))
        assert status == 200 and len(json.loads(raw)["body"]) == Limits.max_body_bytes - 2
    with_server(body)


def test_stream_responses_are_chunked_and_end_when_the_server_stops() -> None:
    routes = Routes()
    closed = asyncio.Event()

    async def events(request: Request) -> StreamResponse:
        async def gen() -> AsyncIterator[bytes]:
            try:
                yield sse_event("one\ntwo", event="hello", event_id="1")
                await asyncio.Event().wait()  # until the server stops
                yield b"never"
            finally:
                closed.set()
        return StreamResponse(gen())

    routes.add("GET", "/events", events)

    async def body(server: HttpServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(get("/events"))
        status, headers, _ = await read_response_head_only(reader)
        assert status == 200 and headers["content-type"] == httpserve.SSE_TYPE
        assert headers["transfer-encoding"] == "chunked"
        size = int((await asyncio.wait_for(reader.readline(), 10)).strip(), 16)
        chunk = await reader.readexactly(size)
        assert chunk == b"id: 1\nevent: hello\ndata: one\ndata: two\n\n"
        await server.stop()
        assert closed.is_set()
        writer.close()
    with_server(body, routes)


def test_answers_do_not_wait_for_the_clients_delayed_ack() -> None:
    """TCP_NODELAY on every accepted connection: asyncio sets it only on sockets whose protocol
    number says TCP, which bind's sockets (socket.create_server) do not, and then an answer's body
    waited behind its head for the client's delayed ACK (40 ms on each keep-alive request)."""
    async def body(server: HttpServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(post("/echo", b"[1]"))
        assert (await read_response(reader))[0] == 200
        (conn,) = server._conns
        sock = conn.writer.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        writer.close()
    with_server(body)


def test_registering_a_taken_route_or_a_bad_one_is_refused() -> None:
    routes = sample_routes()
    with pytest.raises(ValueError, match="already registered"):
        routes.add("POST", "/echo", lambda r: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="HEAD"):
        routes.add("HEAD", "/x", lambda r: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="start with /"):
        routes.add("GET", "x", lambda r: None)  # type: ignore[arg-type, return-value]


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        Limits(max_connections=0)
    with pytest.raises(ValueError, match="write_timeout_s"):
        Limits(write_timeout_s=float("nan"))


_HEAD_LINES = [b"GET / HTTP/1.1", b"POST /x HTTP/1.0", b"Host: a", b"Content-Length: 5",
               b"Content-Length: 99999999999999", b"Transfer-Encoding: chunked", b"Connection: close",
               b": empty name", b"X: \xff\xfe", b"", b"GET  HTTP/1.1", b"get / HTTP/2", b"Origin: null"]


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=300)
       | st.builds(lambda parts: b"\r\n".join(parts), st.lists(st.sampled_from(_HEAD_LINES), max_size=8)))
def test_any_request_head_parses_or_is_an_http_error(raw: bytes) -> None:
    try:
        head = httpserve.parse_head(raw)
        httpserve.content_length(head.headers, Limits.max_body_bytes)
    except HttpError as exc:
        assert 400 <= exc.status < 600 and exc.message


@settings(max_examples=300)
@given(st.text(max_size=60))
def test_any_host_header_is_split_or_refused(value: str) -> None:
    parsed = httpserve.split_host(value)
    if parsed is not None:
        host, port = parsed
        assert host and host == host.lower() and (port is None or 0 <= port <= 99999)
    # A Host never crashes the check, whatever it holds.
    assert httpserve.same_origin("http://" + value, value, False) in (True, False)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=4), inner, max_size=8)
    | st.dictionaries(st.integers(0, 9), inner, max_size=3),
    max_leaves=60)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_an_answer_encoded_in_pieces_is_the_same_bytes(doc: Any) -> None:
    """A large request's answer is encoded with many short json.dumps calls (the worker thread then
    lets the loop have the GIL between them); the bytes are those one call makes."""
    original = httpserve.PIECE_MEMBERS
    httpserve.PIECE_MEMBERS = 2  # split even small documents, at every level
    try:
        assert httpserve.encode_json_in_pieces(doc) == httpserve._encode_json(doc)
    finally:
        httpserve.PIECE_MEMBERS = original


# ---- clients that never read -----------------------------------------------------------------------
def big_answer_routes(size: int) -> Routes:
    routes = sample_routes()
    payload = b"x" * size

    async def big(request: Request) -> Response:
        await request.json()
        return Response(200, payload, "application/octet-stream")

    routes.add("POST", "/big", big)
    return routes


def test_clients_that_never_read_are_aborted_and_what_waits_for_them_is_bounded() -> None:
    """Each client posts, never reads an 8 MiB answer, and its receive buffer is small: answers beyond
    ``max_unsent_bytes`` are refused (503), each accepted one is aborted at the write deadline, and the
    connections leave the cap (a graceful close would have waited on the peer for ever)."""
    limits = Limits(write_timeout_s=1.0, max_unsent_bytes=20 * MiB, max_connections=16)
    clients = 6

    async def body(server: HttpServer) -> None:
        held = []
        for _ in range(clients):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", server.port))
            s.sendall(post("/big", b"{}"))
            held.append(s)
        await wait_until(lambda: server.events["write_timeout"] + server.events["busy"] >= clients,
                         "every answer timed out or was refused")
        await wait_until(lambda: server.connections == 0, "the stalled connections to leave")
        assert server.peak_unsent_bytes <= limits.max_unsent_bytes
        assert server.events["write_timeout"] >= 1 and server.events["busy"] >= 1
        assert server.unsent_bytes == 0
        # The server still answers, and at once: nothing is left holding the cap.
        assert (await exchange(server.port, get("/healthz")))[0] == 200
        for s in held:
            s.close()
    with_server(body, big_answer_routes(8 * MiB), limits)


def test_a_large_request_is_refused_unread_while_answers_fill_the_unsent_bound() -> None:
    """One client that never reads holds most of the bound for unsent answers: a large request for
    which not even an answer the size of its body would fit is answered busy before its body is read
    or its handler runs."""
    routes = big_answer_routes(9 * MiB + MiB // 2)
    calls: list[int] = []

    async def count(request: Request) -> Response:
        calls.append(len(request.body))
        return Response.json({})

    routes.add("POST", "/count", count)
    large = b'"' + b"a" * 800_000 + b'"'

    async def body(server: HttpServer) -> None:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.setblocking(False)
        await asyncio.get_running_loop().sock_connect(stalled, ("127.0.0.1", server.port))
        stalled.sendall(post("/big", b"{}"))
        await wait_until(lambda: server.unsent_bytes >= 9 * MiB, "the stalled answer to hold the bound")
        status, headers, _ = await exchange(server.port, post("/count", large))
        assert (status, headers["connection"]) == (503, "close") and calls == []
        assert (await exchange(server.port, post("/count", b"{}")))[0] == 200  # small ones still go
        stalled.close()
    with_server(body, routes, Limits(max_unsent_bytes=10 * MiB, write_timeout_s=30.0))


def test_a_large_request_that_waited_for_its_slot_is_refused_if_answers_piled_up_meanwhile() -> None:
    """Its body was read while there was room; by the time it gets the work slot a never-reading
    client's answer fills the bound: answered busy, its handler never runs."""
    routes = sample_routes()
    release = asyncio.Event()
    counted: list[int] = []
    payload = b"x" * (10 * MiB - 100_000)  # fits the bound alone, not with the next body's size beside it

    async def hold(request: Request) -> Response:
        await release.wait()
        return Response(200, payload, "application/octet-stream")

    async def count(request: Request) -> Response:
        counted.append(len(request.body))
        return Response.json({})

    routes.add("POST", "/hold", hold)
    routes.add("POST", "/count", count)
    large = b'"' + b"a" * 300_000 + b'"'

    async def body(server: HttpServer) -> None:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.setblocking(False)
        await asyncio.get_running_loop().sock_connect(stalled, ("127.0.0.1", server.port))
        stalled.sendall(post("/hold", large))
        await wait_until(lambda: server.working == 1, "the first large request in its slot")
        waiting = asyncio.create_task(exchange(server.port, post("/count", large), timeout=60))
        await wait_until(lambda: server.body_bytes == 2 * len(large), "the second body read, waiting for the slot")
        release.set()
        status, headers, _ = await waiting
        assert (status, headers["retry-after"]) == (503, "1") and counted == []
        stalled.close()
    with_server(body, routes, Limits(max_unsent_bytes=10 * MiB, write_timeout_s=30.0))


# ---- idle connections at the cap ---------------------------------------------------------------
def test_at_the_cap_a_new_connection_closes_the_one_idle_longest() -> None:
    seen: list[str] = []

    async def body(server: HttpServer) -> None:
        conns = []
        for partial in (b"", b"GET /hea", b"", b"GET / HTTP/1.1\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(partial)
            await writer.drain()
            conns.append((reader, writer))
            await wait_until(functools.partial(lambda n: server.connections == n, len(conns)),
                             "the connection to be accepted")
        probes = []
        for _ in range(3):  # probes kept open at a full cap: each is answered, each closes the oldest idle one
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(get("/healthz"))
            assert (await read_response(reader))[0] == 200
            probes.append(writer)
        for reader, _ in conns[:3]:
            assert await asyncio.wait_for(reader.read(), 10) == b""
        assert server.connections == 4  # the fourth (a head half sent) and the three probes
        assert server.events["evicted"] == 3 and server.events["refused"] == 0
        assert seen.count("evicted") == 3
        for _, writer in conns:
            writer.close()
        for writer in probes:
            writer.close()
    with_server(body, limits=Limits(max_connections=4), on_event=seen.append)


def test_an_idle_connection_is_closed_at_the_head_deadline_without_an_answer() -> None:
    async def body(server: HttpServer) -> None:
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", server.port)
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", server.port)
        slow_w.write(b"GET /no")
        assert await asyncio.wait_for(idle_r.read(), 20) == b""
        assert await asyncio.wait_for(slow_r.read(), 20) == b""
        assert server.events["idle_closed"] == 1 and server.events["head_timeout"] == 1
        idle_w.close()
        slow_w.close()
    with_server(body, limits=Limits(head_timeout_s=0.3))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return certificates(tmp_path_factory.mktemp("certs"))


def client_tls(certs: dict[str, Path], with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs["ca"]))
    ctx.check_hostname = False
    if with_cert:
        ctx.load_cert_chain(str(certs["client_crt"]), str(certs["client_key"]))
    return ctx


async def tls_exchange(port: int, raw: bytes, ctx: ssl.SSLContext) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    try:
        writer.write(raw)
        await writer.drain()
        return await read_response(reader)
    finally:
        writer.close()


def test_tls_connections_that_never_handshake_do_not_keep_a_probe_out(certs: dict[str, Path]) -> None:
    server_ctx = tls.server_context(str(certs["server_crt"]), str(certs["server_key"]))

    async def body(server: HttpServer) -> None:
        held = []
        for _ in range(4):  # TCP only: no ClientHello, ever
            held.append(await asyncio.open_connection("127.0.0.1", server.port))
        await wait_until(lambda: server.connections == 4, "the silent connections to be accepted")
        for _ in range(3):
            status, _, raw = await tls_exchange(server.port, get("/healthz"), client_tls(certs))
            assert (status, json.loads(raw)) == (200, {"status": "ok"})
        assert server.events["evicted"] >= 1 and server.events["refused"] == 0
        assert await asyncio.wait_for(held[0][0].read(), 10) == b""  # the longest waiting made room
        for _, writer in held:
            writer.close()
    with_server(body, limits=Limits(max_connections=4), ssl_context=server_ctx)


def test_when_every_connection_is_busy_newcomers_are_refused_and_logged_once_per_peer() -> None:
    routes = sample_routes()
    release = held_route(routes, "GET", "/slow")

    async def body(server: HttpServer) -> None:
        busy = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(get("/slow"))
            busy.append((reader, writer))
        await wait_until(lambda: server.connections == 2 and not server._waiting, "both inside a request")
        with structlog.testing.capture_logs() as logs:
            for _ in range(20):
                status, _, raw = await exchange(server.port, get("/healthz"))
                assert (status, json.loads(raw)) == (503, {"error": "too many connections"})
        assert server.events["refused"] == 20
        refusals = [e for e in logs if e["event"] == "http_refused"]
        assert len(refusals) == 1 and refusals[0]["peer"] == "127.0.0.1" and refusals[0]["held_back"] == 0
        release.set()
        for reader, writer in busy:
            assert (await read_response(reader))[0] == 200
            writer.close()
    with_server(body, routes, Limits(max_connections=2))


# ---- large bodies beside probes -------------------------------------------------------------------
def test_large_bodies_take_a_work_slot_and_probes_never_wait_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    routes = sample_routes()
    release = asyncio.Event()
    running: list[int] = []
    peak = [0]
    decoded_on: list[str] = []
    real_decode = httpserve._decode_json

    def decode(body: bytes) -> Any:
        decoded_on.append(threading.current_thread().name)
        return real_decode(body)

    monkeypatch.setattr(httpserve, "_decode_json", decode)

    async def work(request: Request) -> Response:
        doc = await request.json()
        running.append(1)
        peak[0] = max(peak[0], len(running))
        await release.wait()
        running.pop()
        return Response.json({"items": len(doc)})

    routes.add("POST", "/work", work)
    big = json.dumps(["x" * 100] * 2000).encode()  # ~200 KB: over inline_body_bytes

    async def body(server: HttpServer) -> None:
        posters = [asyncio.create_task(exchange(server.port, post("/work", big), timeout=60)) for _ in range(6)]
        await wait_until(lambda: len(running) == 2, "two large requests in their handlers")
        # Every slot is taken and four large requests wait; a probe is answered regardless.
        status, _, raw = await exchange(server.port, get("/healthz"))
        assert (status, json.loads(raw)) == (200, {"status": "ok"})
        assert len(running) == 2 and server.working == 2
        release.set()
        answers = await asyncio.gather(*posters)
        assert [(s, json.loads(r)) for s, _, r in answers] == [(200, {"items": 2000})] * 6
        assert peak[0] == 2
        assert decoded_on and all(name != threading.main_thread().name for name in decoded_on)
        # A small body is decoded on the loop: no thread hop for what costs nothing.
        decoded_on.clear()
        assert (await exchange(server.port, post("/echo", b"[1]")))[0] == 200
        assert decoded_on == [threading.main_thread().name]
    with_server(body, routes, Limits(max_body_work=2))


def test_a_large_request_that_waits_too_long_for_a_slot_is_answered_busy() -> None:
    routes = sample_routes()
    release = held_route(routes, "POST", "/work")
    big = b'"' + b"a" * 100_000 + b'"'

    async def body(server: HttpServer) -> None:
        first = asyncio.create_task(exchange(server.port, post("/work", big), timeout=60))
        await wait_until(lambda: server.working == 1, "the first large request in its handler")
        status, headers, _ = await exchange(server.port, post("/work", big))
        assert status == 503 and headers["retry-after"] == "1" and server.events["busy"] == 1
        release.set()
        assert (await first)[0] == 200
    with_server(body, routes, Limits(max_body_work=1, head_timeout_s=0.3))


def test_bodies_beyond_the_total_are_refused_before_they_are_read() -> None:
    routes = sample_routes()
    release = held_route(routes, "POST", "/work")
    body_bytes = b'"' + b"a" * 400_000 + b'"'

    async def body(server: HttpServer) -> None:
        first = asyncio.create_task(exchange(server.port, post("/work", body_bytes), timeout=60))
        await wait_until(lambda: server.body_bytes > 0 and server.working == 1, "the first body held")
        status, headers, _ = await exchange(server.port, post("/work", body_bytes))
        assert (status, headers["connection"]) == (503, "close")
        release.set()
        assert (await first)[0] == 200
        assert server.body_bytes == 0
    with_server(body, routes, Limits(max_body_bytes_total=500_000))


# ---- browsers, other origins, rebinding names ----------------------------------------------------------
def write_routes(calls: list[Request]) -> Routes:
    routes = sample_routes()

    async def write(request: Request) -> Response:
        calls.append(request)
        return Response.json({"written": True})

    routes.add("POST", "/write", write)
    return routes


def raw_request(method: str, host: str | None, extra: str = "", body: bytes = b"") -> bytes:
    lines = [f"{method} /write HTTP/1.1" if method == "POST" else f"{method} /healthz HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode() + body


JSON_CT = "Content-Type: application/json\r\n"


@pytest.mark.parametrize(("method", "host", "extra", "status"), [
    ("GET", "127.0.0.1", "", 200),
    ("GET", "127.0.0.1:{port}", "", 200),
    ("GET", "localhost:{port}", "", 200),
    ("GET", "LOCALHOST.", "", 200),
    ("GET", "[::1]:{port}", "", 200),
    ("GET", "10.96.0.12:9471", "", 200),  # a Service's ClusterIP
    ("GET", "memtopo-controller.memtopo.svc:9471", "", 200),  # configured
    ("GET", "rebind.attacker.example:{port}", "", 421),
    ("GET", "127.0.0.1.nip.io:{port}", "", 421),
    ("GET", "[not-v6]:1", "", 421),
    ("GET", None, "", 400),
    ("GET", "127.0.0.1:{port}", "Origin: http://127.0.0.1:{port}\r\n", 200),
    ("GET", "localhost:{port}", "Origin: http://LOCALHOST:{port}\r\n", 200),
    ("GET", "127.0.0.1:{port}", "Origin: http://127.0.0.1:1\r\n", 403),
    ("GET", "127.0.0.1:{port}", "Origin: https://127.0.0.1:{port}\r\n", 403),
    ("GET", "127.0.0.1:{port}", "Origin: null\r\n", 403),
    ("GET", "127.0.0.1:{port}", "Origin: http://evil.example\r\n", 403),
    ("POST", "127.0.0.1:{port}", JSON_CT, 200),
    ("POST", "127.0.0.1:{port}", "Content-Type: Application/JSON; charset=utf-8\r\n", 200),
    ("POST", "127.0.0.1:{port}", "Content-Type: text/plain;charset=UTF-8\r\n", 415),
    ("POST", "127.0.0.1:{port}", "Content-Type: application/x-www-form-urlencoded\r\n", 415),
    ("POST", "127.0.0.1:{port}", "", 415),
    ("POST", "127.0.0.1:{port}", JSON_CT + "Origin: http://127.0.0.1:1\r\n", 403),
])
def test_host_origin_and_media_type_are_checked_before_any_handler(method: str, host: str | None, extra: str,
                                                                  status: int) -> None:
    calls: list[Request] = []

    async def body(server: HttpServer) -> None:
        port = str(server.port)
        raw = raw_request(method, host.replace("{port}", port) if host else None, extra.replace("{port}", port),
                          b'{"a": 1}' if method == "POST" else b"")
        got, _, text = await exchange(server.port, raw)
        assert got == status, text
        assert len(calls) == (1 if method == "POST" and status == 200 else 0)
    with_server(body, write_routes(calls), hosts=["memtopo-controller.memtopo.svc"])


# ---- guards -------------------------------------------------------------------------------------
def test_a_bearer_token_route_compares_the_token_and_follows_its_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    calls: list[Request] = []
    routes = write_routes(calls)

    async def bind_verb(request: Request) -> Response:
        calls.append(request)
        return Response.json({"bound": True})

    routes.add("POST", "/bind", bind_verb, guard=BearerToken(str(token_file)))

    def bind_request(token: str | None, body: bytes = b"{}") -> bytes:
        auth = f"Authorization: Bearer {token}\r\n" if token is not None else ""
        return (f"POST /bind HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON_CT}{auth}Content-Length: {len(body)}\r\n\r\n"
                .encode() + body)

    async def body(server: HttpServer) -> None:
        status, headers, _ = await exchange(server.port, bind_request(None))
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert (await exchange(server.port, bind_request("wrong")))[0] == 401
        assert (await exchange(server.port, bind_request("s3cret-token")))[0] == 200
        # Refused before its body is read: an announced body that never comes does not hold it up.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(bind_request("wrong").replace(b"Content-Length: 2\r\n\r\n{}", b"Content-Length: 100000\r\n\r\n"))
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (401, "close")
        writer.close()
        # A rotated token: the new one works at once, the old one no more.
        token_file.write_text("rotated-token-2")
        assert (await exchange(server.port, bind_request("rotated-token-2")))[0] == 200
        assert (await exchange(server.port, bind_request("s3cret-token")))[0] == 401
        # A broken file keeps the last good token.
        token_file.write_text("  \n")
        assert (await exchange(server.port, bind_request("rotated-token-2")))[0] == 200
        assert len(calls) == 3
    with_server(body, routes)


def test_a_token_file_that_cannot_be_used_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No such file"):
        BearerToken(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="printable"):
        BearerToken(str(tmp_path / "empty"))


def test_a_client_certificate_route_sees_the_verified_subject(certs: dict[str, Path]) -> None:
    server_ctx = tls.server_context(str(certs["server_crt"]), str(certs["server_key"]), client_ca=str(certs["ca"]))
    routes = sample_routes()
    subjects: list[str | None] = []

    async def whoami(request: Request) -> Response:
        subjects.append(request.client_subject)
        return Response.json({"subject": request.client_subject})

    token_file_guard = ClientCertificate({"CN=client"})
    routes.add("POST", "/bind", whoami, guard=token_file_guard)
    routes.add("GET", "/whoami", whoami)
    routes.add("POST", "/operators-only", whoami, guard=ClientCertificate({"CN=someone-else"}))
    routes.add("POST", "/either", whoami, guard=any_guard(ClientCertificate({"CN=nobody"}), ClientCertificate()))
    bind_post = post("/bind", b"{}")

    async def body(server: HttpServer) -> None:
        status, _, raw = await tls_exchange(server.port, bind_post, client_tls(certs, with_cert=True))
        assert (status, json.loads(raw)) == (200, {"subject": "CN=client"})
        status, _, raw = await tls_exchange(server.port, bind_post, client_tls(certs))
        assert status == 403 and b"client certificate" in raw
        # Without a certificate the listener still serves what needs none.
        status, _, raw = await tls_exchange(server.port, get("/whoami"), client_tls(certs))
        assert (status, json.loads(raw)) == (200, {"subject": None})
        assert (await tls_exchange(server.port, post("/operators-only", b"{}"), client_tls(certs, True)))[0] == 403
        assert (await tls_exchange(server.port, post("/either", b"{}"), client_tls(certs, True)))[0] == 200
        assert subjects == ["CN=client", None, "CN=client"]
    with_server(body, routes, ssl_context=server_ctx)


def test_certificate_subjects_are_escaped() -> None:
    cert = {"subject": ((("commonName", "a,b=c"),), (("organizationName", "memtopo"),))}
    assert httpserve.certificate_subject(cert) == "CN=a\\,b\\=c,O=memtopo"
    assert httpserve.certificate_subject(None) is None and httpserve.certificate_subject({}) is None


# ---- a server on its own thread --------------------------------------------------------------------------
def test_a_server_thread_answers_while_the_callers_loop_is_blocked_and_stops_once() -> None:
    thread = ServerThread(lambda: HttpServer(sample_routes()), bind("127.0.0.1:0"))
    port = thread.port

    async def blocked() -> bytes:
        # Synchronous on purpose: this loop cannot run while the request is made.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(get("/healthz", "Connection: close\r\n"))
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        return data

    try:
        assert asyncio.run(blocked()).startswith(b"HTTP/1.1 200")
    finally:
        thread.stop()
        thread.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_bind_names_the_address_and_the_reason() -> None:
    sock = bind("127.0.0.1:0")
    try:
        port = sock.getsockname()[1]
        with pytest.raises(httpserve.ListenError, match=rf"127\.0\.0\.1:{port}: cannot listen: .*in use"):
            bind(f"127.0.0.1:{port}")
    finally:
        sock.close()
    with pytest.raises(httpserve.ListenError, match="expected HOST:PORT"):
        bind("9464")


# ---- in a real browser -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rebinding_browser() -> Iterator[Any]:
    """Chromium resolving rebind.test to 127.0.0.1, as a DNS-rebinding attacker's name would."""
    with chromium("--host-resolver-rules=MAP rebind.test 127.0.0.1") as b:
        yield b


ATTACKER_PAGE = """<!doctype html><html><body><script>
window.done = (async () => {
  const target = "http://127.0.0.1:%d/write";
  const out = [];
  for (const init of [
      {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: '{"a": 1}'},
      {method: "POST", mode: "no-cors", body: '{"a": 1}'},
      {method: "POST", headers: {"Content-Type": "application/json"}, body: '{"a": 1}'}]) {
    try { const r = await fetch(target, init); out.push(r.type + ":" + r.status); }
    catch (e) { out.push("error"); }
  }
  return out;
})();
</script></body></html>"""


def test_a_cross_site_page_and_a_rebinding_name_reach_no_handler_in_chromium(rebinding_browser: Any) -> None:
    calls: list[Request] = []
    seen: list[Exchange] = []
    target = ServerThread(lambda: HttpServer(write_routes(calls), observer=seen.append), bind("127.0.0.1:0"))
    attacker_routes = Routes()
    html = (ATTACKER_PAGE % target.port).encode()

    async def page(request: Request) -> Response:
        return Response(200, html, httpserve.HTML_TYPE)

    attacker_routes.add("GET", "/", page)
    attacker = ServerThread(lambda: HttpServer(attacker_routes), bind("127.0.0.1:0"))
    try:
        tab = rebinding_browser.new_page()
        tab.goto(f"http://localhost:{attacker.port}/")
        outcomes = tab.evaluate("() => window.done")
        # no-cors answers are opaque to the page; the CORS one fails without CORS headers.
        assert outcomes == ["opaque:0", "opaque:0", "error"]
        # A page served under a rebinding name reads nothing from the listener.
        answer = tab.goto(f"http://rebind.test:{target.port}/healthz")
        assert answer is not None and answer.status == 421
        assert calls == []
        # Every request carried its page's Origin; the JSON one got no further than its preflight.
        writes = sorted((e.method, e.status) for e in seen if e.target == "/write")
        assert writes == [("OPTIONS", 403), ("POST", 403), ("POST", 403)]
        # (Chromium retries a 421 once on a new connection: it gets the same answer.)
        rebound = [(e.route, e.status) for e in seen if e.target == "/healthz"]
        assert rebound and set(rebound) == {("", 421)}
    finally:
        attacker.stop()
        target.stop()
