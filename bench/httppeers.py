"""The processes of ``bench/hostile_clients.py http``: one HTTP server with the controller listener's
shape, and one hostile load, each a child process of the bench (so neither shares a GIL with the
probes that time /healthz).

Servers (``python bench/httppeers.py serve IMPL``; prints ``READY PORT``), all with the same two
handlers: ``GET /healthz`` (a small JSON answer) and ``POST /scheduler/filter`` (decode the JSON body,
answer every named node with a failure reason: an 850 KB request answers 10.4 MB, as the extender
does for tens of thousands of nodes it cannot place), and the same limits where each has them:

- ``memtopo``: memtopo.httpserve with its defaults (the controller listener's limits).
- ``aiohttp``: an aiohttp ``web.Application``: body ≤ 1 MiB (client_max_size), head lines ≤ 64 KiB
  and 100 headers, keep-alive 30 s (aiohttp 3.14 also closes a connection whose request is not
  complete by then); aiohttp has no connection cap and no deadline for an answer the client does not
  take.
- ``aiohttp+slots``: the same plus what a middleware can add: large bodies (> 64 KiB) wait for a
  slot and their JSON is decoded and encoded in a worker thread, as memtopo's server does.
- ``before``: the controller's listener before this server (``controller/http.py`` at a git
  revision, loaded from a file): asyncio streams, 256 connections refused beyond, 30 s deadlines
  with a graceful close, JSON on the loop.

Loads (``python bench/httppeers.py load SCENARIO PORT``; prints ``LOADED`` once in place, then
holds until stdin closes and prints one JSON line of what it saw):

- ``slow``: 3,000 connections: half sent one request and stay idle on keep-alive, half send a head a
  byte a second.
- ``idle``: 300 connections that send nothing (over a 256 cap).
- ``bodies``: 16 clients posting 950 KB filter bodies (11.6 MB answers) in a loop, reading every answer.
- ``never-read``: 40 clients posting an 850 KB filter and never reading the 10.4 MB answer (receive
  buffers 4 KiB).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MiB = 1 << 20
INLINE_BYTES = 64 << 10
# Each refused node's reason: 850 KB of names (40,000) answer 10.4 MB.
REASON = "memtopo: cannot place the pod here: " + "no HCCS ring has the NPUs this pod asks for; " * 4
IMPLS = ("memtopo", "aiohttp", "aiohttp+slots", "before")
SCENARIOS = ("slow", "idle", "bodies", "never-read")


def filter_answer(doc: Any) -> dict[str, Any]:
    names = doc.get("NodeNames") or [] if isinstance(doc, dict) else []
    return {"FailedNodes": {str(n): REASON + str(n) for n in names}, "FailedAndUnresolvableNodes": {},
            "Error": "", "NodeNames": []}


def filter_body(target_bytes: int) -> bytes:
    pod = {"spec": {"containers": [{"resources": {"limits": {"huawei.com/Ascend910": "4"}}}]}}
    count = target_bytes // 23
    return json.dumps({"Pod": pod, "NodeNames": [f"gpu-node-{i:08d}" for i in range(count)]}).encode()


HEALTH = {"status": "ok", "nodes": 0, "connected": 0, "topologies": 0}


# ---- servers ------------------------------------------------------------------------------------------
async def serve_memtopo() -> Callable[[], Awaitable[None]]:
    from memtopo.httpserve import HttpServer, Limits, Request, Response, Routes, bind

    routes = Routes()

    async def healthz(request: Request) -> Response:
        return Response.json(HEALTH)

    async def filter_verb(request: Request) -> Response:
        return Response.json(filter_answer(await request.json()))

    routes.add("GET", "/healthz", healthz)
    routes.add("POST", "/scheduler/filter", filter_verb)
    server = HttpServer(routes, Limits(), name="bench")
    await server.start(bind("127.0.0.1:0"))
    print(f"READY {server.port}", flush=True)
    return server.stop


async def serve_aiohttp(slots: bool) -> Callable[[], Awaitable[None]]:
    from aiohttp import web

    work = asyncio.Semaphore(1)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response(HEALTH)

    async def filter_verb(request: web.Request) -> web.Response:
        if not slots:
            return web.json_response(filter_answer(await request.json()))
        body = await request.read()
        if len(body) <= INLINE_BYTES:
            return web.json_response(filter_answer(json.loads(body)))
        doc = await asyncio.to_thread(json.loads, body)
        answer = filter_answer(doc)  # the handler's own work, on the loop as with the other servers
        text = await asyncio.to_thread(json.dumps, answer)
        return web.Response(text=text, content_type="application/json")

    @web.middleware
    async def bounded(request: web.Request, handler: Any) -> web.StreamResponse:
        if slots and (request.content_length or 0) > INLINE_BYTES:
            async with work:
                return await handler(request)  # type: ignore[no-any-return]
        return await handler(request)  # type: ignore[no-any-return]

    app = web.Application(client_max_size=MiB, middlewares=[bounded])
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/scheduler/filter", filter_verb)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=30.0,
                           max_line_size=64 << 10, max_field_size=64 << 10, max_headers=100)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0), backlog=socket.SOMAXCONN)
    await web.SockSite(runner, sock).start()
    print(f"READY {sock.getsockname()[1]}", flush=True)
    return runner.cleanup


async def serve_before(source: str) -> Callable[[], Awaitable[None]]:
    spec = importlib.util.spec_from_file_location("memtopo_http_before", source)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old  # its dataclasses look their module up
    spec.loader.exec_module(old)
    routes = old.Routes()

    async def healthz(request: Any) -> Any:
        return old.Response.json(HEALTH)

    async def filter_verb(request: Any) -> Any:
        return old.Response.json(filter_answer(request.json()))

    routes.add("GET", "/healthz", healthz)
    routes.add("POST", "/scheduler/filter", filter_verb)
    server = old.HttpServer(routes)
    await server.start("127.0.0.1", 0)
    print(f"READY {server.port}", flush=True)
    stop: Callable[[], Awaitable[None]] = server.stop
    return stop


async def serve(impl: str, source: str) -> None:
    if impl == "memtopo":
        stop = await serve_memtopo()
    elif impl == "before":
        stop = await serve_before(source)
    else:
        stop = await serve_aiohttp(impl == "aiohttp+slots")
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), done.set)  # the bench closes stdin to stop the server
    await done.wait()
    await stop()


# ---- loads ----------------------------------------------------------------------------------------------
HOST = b"Host: 127.0.0.1\r\n"


def post_head(length: int) -> bytes:
    return (b"POST /scheduler/filter HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


class Load:
    def __init__(self, port: int) -> None:
        self.port = port
        self.stats: dict[str, Any] = {"connected": 0, "closed_by_server": 0, "answers": {}, "errors": 0}
        self.tasks: list[asyncio.Task[None]] = []

    def answered(self, status: str) -> None:
        self.stats["answers"][status] = self.stats["answers"].get(status, 0) + 1

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection, or None when the server does not take it within 3 s (its accept queue full)."""
        try:
            return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), 3.0)
        except (OSError, TimeoutError):
            self.stats["errors"] += 1
            return None

    async def slow(self, count: int = 3000) -> None:
        """Half send a request head a byte a second, half one request; each then stays until closed."""
        await self._held(count, lambda i: "slowly" if i % 2 else "once")

    async def idle(self, count: int = 300) -> None:
        """Connections that send nothing and stay until closed."""
        await self._held(count, lambda i: "nothing")

    async def _held(self, count: int, send: Callable[[int], str]) -> None:
        for i in range(count):
            pair = await self.connect()
            if pair is None:
                continue
            self.stats["connected"] += 1
            self.tasks.append(asyncio.create_task(self._hold(*pair, send(i))))

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, send: str) -> None:
        try:
            if send == "slowly":
                for byte in b"GET /healthz HTTP/1.1\r\n" + HOST + b"X-Slow: " + b"a" * 10_000:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(1.0)
            elif send == "once":
                writer.write(b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n")
                await writer.drain()
                await reader.read(4096)
            await reader.read()
            self.stats["closed_by_server"] += 1
        except OSError:
            self.stats["closed_by_server"] += 1
        finally:
            writer.transport.abort()

    async def bodies(self, clients: int = 16) -> None:
        body = filter_body(MiB - 4096)
        for _ in range(clients):
            self.tasks.append(asyncio.create_task(self._poster(body)))
        self.stats["connected"] = clients

    async def _poster(self, body: bytes) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                try:
                    while True:
                        writer.write(post_head(len(body)) + body)
                        await writer.drain()
                        head = await reader.readuntil(b"\r\n\r\n")
                        status = head.split(b" ", 2)[1].decode()
                        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                      if line.lower().startswith(b"content-length:"))
                        await reader.readexactly(length)
                        self.answered(status)
                        if b"connection: close" in head.lower():
                            break
                finally:
                    writer.transport.abort()
            except (OSError, asyncio.IncompleteReadError, StopIteration, ValueError):
                self.stats["errors"] += 1
                await asyncio.sleep(0.05)

    async def never_read(self, clients: int = 40) -> None:
        body = filter_body(930_000)
        self.stats["request_bytes"] = len(body)
        loop = asyncio.get_running_loop()
        socks = []
        for _ in range(clients):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            try:
                await loop.sock_connect(s, ("127.0.0.1", self.port))
                await loop.sock_sendall(s, post_head(len(body)) + body)
            except OSError:
                self.stats["errors"] += 1
                s.close()
                continue
            self.stats["connected"] += 1
            socks.append(s)
        self.stats["_socks"] = socks

    def count_closed(self) -> None:
        """Read what each never-reading client was sent: the connection is closed when that ends in
        EOF or a reset, open when it ends in a would-block."""
        closed = 0
        for s in self.stats.pop("_socks", []):
            try:
                while s.recv(1 << 20, socket.MSG_DONTWAIT):
                    pass
                closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
            s.close()
        self.stats["closed_by_server"] += closed


async def load(scenario: str, port: int) -> None:
    work = Load(port)
    await {"slow": work.slow, "idle": work.idle, "bodies": work.bodies, "never-read": work.never_read}[scenario]()
    print("LOADED", flush=True)
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_reader(sys.stdin.fileno(), done.set)
    started = time.monotonic()
    await done.wait()
    work.stats["held_s"] = round(time.monotonic() - started, 1)
    work.count_closed()
    for t in work.tasks:
        t.cancel()
    with contextlib.suppress(Exception):
        await asyncio.gather(*work.tasks, return_exceptions=True)
    print(json.dumps(work.stats), flush=True)


def main() -> int:
    what = sys.argv[1]
    if what == "serve":
        asyncio.run(serve(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
    elif what == "load":
        asyncio.run(load(sys.argv[2], int(sys.argv[3])))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve IMPL [SOURCE] | load SCENARIO PORT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
