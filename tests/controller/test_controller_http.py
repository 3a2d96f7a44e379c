"""The controller's HTTP listener: what the entry point composes on it (/healthz and /metrics, the
scheduler extender, the fleet page), its address and TLS rules, and hostile clients against the real
listener: idle connections at the cap (plaintext and TLS) and clients that never read the extender's
answers. The server itself is tested in test_httpserve.py; these helpers speak raw HTTP to it."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from memtopo.cli.controller import listener_routes
from memtopo.cli.extender import ExtenderOptions
from memtopo.cli.output import EXIT_USAGE
from memtopo.controller.server import ControllerConfigError, RunningController, start_controller, start_http
from memtopo.controller.state import Changes
from memtopo.httpserve import HttpServer, Limits
from tests.agents import certificates
from tests.http_client import exchange, get, post, read_response

MiB = 1 << 20


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
def with_controller(body: Callable[[RunningController], Awaitable[None]], **kwargs: object) -> None:
    async def main() -> None:
        running = await start_controller("127.0.0.1:0", http="127.0.0.1:0", **kwargs)  # type: ignore[arg-type]
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


def test_the_listener_serves_what_the_entry_point_composes() -> None:
    """The controller alone serves its own two routes; the CLI's composition adds the extender's
    verbs and the fleet page."""
    async def alone(running: RunningController) -> None:
        assert running.http is not None
        assert (await exchange(running.http.port, get("/")))[0] == 404
        assert (await exchange(running.http.port, post("/scheduler/filter", b"{}")))[0] == 404
    with_controller(alone)

    async def composed(running: RunningController) -> None:
        assert running.http is not None
        port = running.http.port
        status, headers, _ = await exchange(port, get("/"))
        assert status == 200 and headers["content-type"].startswith("text/html")
        status, _, raw = await exchange(port, post("/scheduler/filter", b'{"Pod": {}, "NodeNames": ["a"]}'))
        assert status == 200 and json.loads(raw)["NodeNames"] == ["a"]
    with_controller(composed, http_routes=listener_routes(ExtenderOptions()))


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


def test_the_listen_name_and_configured_names_are_accepted_hosts() -> None:
    async def body(running: RunningController) -> None:
        assert running.http is not None
        port = running.http.port
        for host, status in (("localhost", 200), ("memtopo-controller.memtopo.svc", 200),
                             ("controller.example", 421)):
            raw = f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
            assert (await exchange(port, raw))[0] == status, host
    with_controller(body, http_hosts=("memtopo-controller.memtopo.svc",))


@pytest.mark.parametrize(("argv", "fragment"), [
    (["serve", "--listen", "127.0.0.1:0", "--http", "0.0.0.0:0"], "plaintext HTTP is only served on loopback"),
    (["serve", "--listen", "127.0.0.1:0", "--http-tls-cert", "x.pem"], "--http-tls-cert and --http-tls-key"),
    (["serve", "--listen", "127.0.0.1:0", "--http-tls-client-ca", "ca.pem"], "--http-tls-client-ca needs"),
    (["serve", "--listen", "127.0.0.1:0", "--http-tls-cert", "/nonexistent/c.pem", "--http-tls-key", "/nonexistent/k"],
     "HTTP TLS certificate /nonexistent/c.pem / key /nonexistent/k: No such file"),
    (["serve", "--listen", "127.0.0.1:0", "--http-host", "not a name"], "--http-host"),
    (["serve", "--listen", "127.0.0.1:0", "--kube-api", "ftp://api"], "--kube-api"),
    (["serve", "--listen", "127.0.0.1:0", "--kube-refresh", "0"], "--kube-refresh"),
])
def test_cli_http_options_are_checked(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    from memtopo.cli.main import main

    assert main(["controller", *argv]) == EXIT_USAGE
    assert fragment in capsys.readouterr().err


def test_the_cli_imports_none_of_the_http_side() -> None:
    """`memtopo --help` imports the controller's CLI: the listener, the extender, the fleet page,
    prometheus_client and urllib.request load when a controller starts, not before."""
    import subprocess
    import sys

    code = ("import sys, memtopo.cli.main; memtopo.cli.main.build_parser(); "
            "print(sorted(m for m in ('prometheus_client', 'urllib.request', 'memtopo.extender.service', "
            "'memtopo.cli.extender', 'memtopo.httpserve', 'memtopo.fleetpage.page', 'memtopo.controller.metrics') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "[]"


# ---- hostile clients against the real listener ---------------------------------------------------
def idle_connections(port: int, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        held.append(s)
    return held


async def settle(server: HttpServer, count: int) -> None:
    async with asyncio.timeout(60):
        while server.connections < count:
            await asyncio.sleep(0.02)


def test_a_full_cap_of_idle_connections_does_not_deny_healthz() -> None:
    """256 connections that send nothing, and 70 probes: every probe is answered 200 (each closes
    the connection idle longest), none 503."""
    async def body(running: RunningController) -> None:
        assert running.http is not None
        server = running.http
        held = await asyncio.to_thread(idle_connections, server.port, Limits.max_connections)
        await settle(server, Limits.max_connections)
        statuses = [(await exchange(server.port, get("/healthz")))[0] for _ in range(70)]
        assert statuses == [200] * 70
        assert server.events["refused"] == 0 and server.events["evicted"] >= 1
        for s in held:
            s.close()
    with_controller(body)


def test_a_full_cap_of_idle_tls_connections_does_not_deny_healthz(tmp_path: Path) -> None:
    from memtopo.controller.server import http_ssl_context

    certs = certificates(tmp_path)
    client = ssl.create_default_context(cafile=str(certs["ca"]))
    client.check_hostname = False

    async def body(running: RunningController) -> None:
        assert running.http is not None
        server = running.http
        held = await asyncio.to_thread(idle_connections, server.port, Limits.max_connections)
        await settle(server, Limits.max_connections)
        for _ in range(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=client)
            writer.write(get("/healthz"))
            assert (await read_response(reader))[0] == 200
            writer.close()
        assert server.events["refused"] == 0
        for s in held:
            s.close()
    with_controller(body, http_ssl=http_ssl_context(str(certs["server_crt"]), str(certs["server_key"])))


def unknown_nodes_filter(count: int) -> bytes:
    """An extender filter naming ``count`` nodes the controller does not know: each gets a reason, so
    the answer is several times the request."""
    pod = {"spec": {"containers": [{"resources": {"limits": {"huawei.com/Ascend910": "1"}}}]}}
    return json.dumps({"Pod": pod, "NodeNames": [f"unknown-node-{i:06d}" for i in range(count)]}).encode()


def test_clients_that_never_read_the_extenders_answers_cannot_grow_the_controller() -> None:
    """Clients post a 920 KB filter whose answer is 3.3 MB and never read it: what waits for them
    stays under the listener's bound (the rest are answered busy), each is aborted at the write
    deadline, and the cap is free again."""
    request = unknown_nodes_filter(40_000)
    assert 900_000 < len(request) < MiB

    async def main() -> None:
        running = await start_controller("127.0.0.1:0")
        limits = Limits(write_timeout_s=2.0, max_unsent_bytes=8 * MiB)
        server = await start_http(running.state, "127.0.0.1:0", install=listener_routes(ExtenderOptions()),
                                  limits=limits)
        held = []
        try:
            status, _, answer = await exchange(server.port, post("/scheduler/filter", request), timeout=60)
            assert status == 200 and len(answer) > 3 * len(request)
            for _ in range(8):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", server.port))
                s.sendall(post("/scheduler/filter", request))
                held.append(s)
            async with asyncio.timeout(120):
                while server.events["write_timeout"] + server.events["busy"] < len(held) or server.connections:
                    await asyncio.sleep(0.05)
            assert server.peak_unsent_bytes <= limits.max_unsent_bytes
            assert server.events["write_timeout"] >= 1 and server.events["busy"] >= 1
            assert (await exchange(server.port, get("/healthz")))[0] == 200
            metrics = (await exchange(server.port, get("/metrics")))[2].decode()
            assert 'memtopo_controller_http_connection_events_total{event="write_timeout"}' in metrics
        finally:
            for s in held:
                s.close()
            await server.stop()
            await running.stop(0)
    asyncio.run(main())
