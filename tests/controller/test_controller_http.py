"""The controller's HTTP listener (controller/http.py): routing, limits, errors, streams, and the
core routes /healthz and /metrics on a real controller. Raw sockets, so malformed requests reach
the server exactly as sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.controller import http
from memtopo.controller.http import HttpError, HttpServer, Request, Response, Routes, StreamResponse, sse_event
from memtopo.controller.server import ControllerConfigError, RunningController, start_controller, start_http
from memtopo.controller.state import Changes
from tests.controller.http_client import exchange, get, post, read_response


def with_server(body: Callable[[HttpServer], Awaitable[None]], routes: Routes | None = None,
                **kwargs: float) -> None:
    async def main() -> None:
        server = HttpServer(routes or sample_routes(), **kwargs)  # type: ignore[arg-type]
        await server.start("127.0.0.1", 0)
        try:
            await body(server)
        finally:
            await server.stop()
    asyncio.run(main())


def sample_routes() -> Routes:
    routes = Routes()

    async def echo(request: Request) -> Response:
        return Response.json({"path": request.path, "query": dict(request.query), "body": request.json(),
                              "route": request.route})

    async def boom(request: Request) -> Response:
        raise RuntimeError("secret internal detail")

    async def teapot(request: Request) -> Response:
        raise HttpError(418, "short and stout")

    async def node(request: Request) -> Response:
        return Response.text(request.path.removeprefix("/nodes/"))

    routes.add("POST", "/echo", echo)
    routes.add("GET", "/boom", boom)
    routes.add("GET", "/teapot", teapot)
    routes.add("GET", "/nodes/", node, prefix=True)
    return routes


def test_routes_answer_json_and_prefixes_and_errors_are_json_never_tracebacks() -> None:
    async def body(server: HttpServer) -> None:
        status, headers, raw = await exchange(server.port, post("/echo?a=1&a=2", b'{"x": [1]}'))
        assert status == 200 and headers["content-type"] == http.JSON_TYPE
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
    with_server(body)


def test_head_follows_get_without_a_body() -> None:
    async def body(server: HttpServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"HEAD /nodes/a HTTP/1.1\r\nHost: x\r\n\r\n" + get("/nodes/b"))
        await writer.drain()
        status, headers, _ = await read_response_head_only(reader)
        assert status == 200 and headers["content-length"] == "1"
        # The next response starts right after the HEAD answer's headers: no body was sent.
        status, _, raw = await read_response(reader)
        assert (status, raw) == (200, b"b")
        writer.close()
    with_server(body)


async def read_response_head_only(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode().split("\r\n")
    return int(lines[0].split(" ")[1]), {k.lower(): v.strip() for k, _, v in
                                         (line.partition(":") for line in lines[1:] if line)}, b""


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
    (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * (http.MAX_HEADERS + 1) + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * http.MAX_HEAD_BYTES + b"\r\n\r\n", 431),
    (b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (http.MAX_BODY_BYTES + 1), 413),
])
def test_malformed_or_oversized_requests_get_a_status_and_the_connection_closes(raw: bytes, status: int) -> None:
    async def body(server: HttpServer) -> None:
        got, headers, text = await exchange(server.port, raw)
        assert got == status and headers["connection"] == "close"
        assert "error" in json.loads(text)
    with_server(body)


def test_a_body_of_exactly_the_limit_is_read() -> None:
    async def body(server: HttpServer) -> None:
        payload = b'"' + b"a" * (http.MAX_BODY_BYTES - 2) + b'"'
        status, _, raw = await exchange(server.port, post("/echo", payload))
        assert status == 200 and len(json.loads(raw)["body"]) == http.MAX_BODY_BYTES - 2
    with_server(body)


def test_an_idle_connection_is_closed_and_the_cap_refuses_extra_connections() -> None:
    async def body(server: HttpServer) -> None:
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", server.port)
        # Half a request line, then silence: the server closes it after the idle timeout.
        idle_w.write(b"GET /no")
        await idle_w.drain()
        _second_r, second_w = await asyncio.open_connection("127.0.0.1", server.port)
        for _ in range(100):
            if server.connections == 2:
                break
            await asyncio.sleep(0.05)
        third = await exchange(server.port, get("/nodes/x"))
        assert third[0] == 503
        assert await asyncio.wait_for(idle_r.read(), 20) == b""
        second_w.close()
        idle_w.close()
    with_server(body, max_connections=2, idle_timeout=0.5)


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
        assert status == 200 and headers["content-type"] == http.SSE_TYPE
        assert headers["transfer-encoding"] == "chunked"
        size = int((await asyncio.wait_for(reader.readline(), 10)).strip(), 16)
        chunk = await reader.readexactly(size)
        assert chunk == b"id: 1\nevent: hello\ndata: one\ndata: two\n\n"
        await server.stop()
        assert closed.is_set()
        writer.close()
    with_server(body, routes)


def test_registering_a_taken_route_or_a_bad_one_is_refused() -> None:
    routes = sample_routes()
    with pytest.raises(ValueError, match="already registered"):
        routes.add("POST", "/echo", lambda r: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="HEAD"):
        routes.add("HEAD", "/x", lambda r: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="start with /"):
        routes.add("GET", "x", lambda r: None)  # type: ignore[arg-type, return-value]


def test_changes_wake_waiters_and_name_changed_nodes() -> None:
    async def main() -> None:
        changes = Changes()
        waiter = asyncio.create_task(changes.wait(0, timeout=10))
        await asyncio.sleep(0)
        changes.bump("a")
        changes.bump("b")
        assert await waiter == 2
        assert changes.since(0) == {"a", "b"} and changes.since(1) == {"b"} and changes.since(2) == set()
        assert await changes.wait(2, timeout=0.01) == 2
    asyncio.run(main())


# ---- on a real controller ----------------------------------------------------------------------------
def with_controller(body: Callable[[RunningController], Awaitable[None]]) -> None:
    async def main() -> None:
        running = await start_controller("127.0.0.1:0", http="127.0.0.1:0")
        try:
            await body(running)
        finally:
            await running.stop(0)
    asyncio.run(main())


def test_healthz_and_metrics_on_the_controller_listener() -> None:
    async def body(running: RunningController) -> None:
        assert running.http is not None
        port = running.http.port
        status, _, raw = await exchange(port, get("/healthz"))
        assert status == 200 and json.loads(raw) == {"status": "ok", "nodes": 0, "connected": 0, "topologies": 0}
        status, headers, raw = await exchange(port, get("/metrics"))
        assert status == 200 and headers["content-type"].startswith("text/plain")
        text = raw.decode()
        assert 'memtopo_controller_nodes{state="connected"} 0.0' in text
        # The /healthz request above was counted by route and code.
        assert 'memtopo_controller_http_requests_total{code="200",method="GET",route="/healthz"} 1.0' in text
    with_controller(body)


def test_http_listener_addresses_are_checked() -> None:
    async def main() -> None:
        running = await start_controller("127.0.0.1:0", http="127.0.0.1:0")
        try:
            with pytest.raises(ControllerConfigError, match="only served on loopback"):
                await start_http(running.state, "0.0.0.0:0")
            assert running.http is not None
            with pytest.raises(ControllerConfigError, match="cannot listen"):
                await start_http(running.state, f"127.0.0.1:{running.http.port}")
            with pytest.raises(ControllerConfigError, match="--http"):
                await start_http(running.state, "nonsense")
        finally:
            await running.stop(0)
    asyncio.run(main())


@pytest.mark.parametrize(("argv", "fragment"), [
    (["serve", "--listen", "127.0.0.1:0", "--http", "0.0.0.0:0"], "plaintext HTTP is only served on loopback"),
    (["serve", "--listen", "127.0.0.1:0", "--http-tls-cert", "x.pem"], "--http-tls-cert and --http-tls-key"),
    (["serve", "--listen", "127.0.0.1:0", "--http-tls-cert", "/nonexistent/c.pem", "--http-tls-key", "/nonexistent/k"],
     "HTTP TLS certificate /nonexistent/c.pem / key /nonexistent/k: No such file"),
    (["serve", "--listen", "127.0.0.1:0", "--kube-api", "ftp://api"], "--kube-api"),
    (["serve", "--listen", "127.0.0.1:0", "--kube-refresh", "0"], "--kube-refresh"),
])
def test_cli_http_options_are_checked(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    from memtopo.cli import controller as cli
    from memtopo.cli.main import main

    assert main(["controller", *argv]) == cli.EXIT_USAGE
    assert fragment in capsys.readouterr().err


_HEAD_LINES = [b"GET / HTTP/1.1", b"POST /x HTTP/1.0", b"Host: a", b"Content-Length: 5",
               b"Content-Length: 99999999999999", b"Transfer-Encoding: chunked", b"Connection: close",
               b": empty name", b"X: \xff\xfe", b"", b"GET  HTTP/1.1", b"get / HTTP/2"]


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=300)
       | st.builds(lambda parts: b"\r\n".join(parts), st.lists(st.sampled_from(_HEAD_LINES), max_size=8)))
def test_any_request_head_parses_or_is_an_http_error(raw: bytes) -> None:
    try:
        head = http._parse_head(raw)
        http._content_length(head.headers)
    except HttpError as exc:
        assert 400 <= exc.status < 600 and exc.message


def test_the_cli_imports_none_of_the_http_side() -> None:
    """`memtopo --help` imports the controller's CLI: the listener, the extender, prometheus_client
    and urllib.request load when a controller starts, not before."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, memtopo.cli.main; memtopo.cli.main.build_parser(); "
            "print(sorted(m for m in ('prometheus_client', 'urllib.request', 'memtopo.extender.service', "
            "'memtopo.cli.extender', 'memtopo.controller.http', 'memtopo.controller.metrics') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "[]"
