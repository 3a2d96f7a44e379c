"""agent.transport and what it puts together (agent.peers, agent.relay, agent.sockets): the
credential-checking front in front of a real grpc.aio server.

The suite runs as root, so "another user" is a real process: a child interpreter that imports grpc
as root, then calls setgroups/setgid/setuid(65534) before it connects, so SO_PEERCRED and
SO_PEERGROUPS carry its real credentials. TLS uses certificates made here with `cryptography`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import grp
import ipaddress
import json
import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtopo.agent import peers, relay, sockets, transport
from tests.agent.holders import NOBODY, Holder, settles_at

SERVICE = "memtopo.test.Probe"
PAYLOAD = os.urandom(300_000)  # the size of a large topology answer
# Channels of one process share connections unless each has its own subchannel pool.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _other_group() -> tuple[str, int]:
    """An existing group that is neither root's nor nobody's."""
    for g in sorted(grp.getgrall(), key=lambda g: g.gr_gid):
        if g.gr_gid not in (0, NOBODY):
            return g.gr_name, g.gr_gid
    pytest.skip("no group other than root and nogroup on this machine")


# ---- the server under test -----------------------------------------------------------------------


class Probe:
    """A trivial service: Read is GetTopology-like, Apply is authorized like ApplyPlan."""

    def __init__(self, allowed_group: str | None) -> None:
        self.allowed_group = allowed_group

    async def read(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return PAYLOAD

    async def apply(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        reason = peers.authorize_apply(context, self.allowed_group)
        if reason is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        return b"applied"

    async def whoami(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        cred, tls = peers.peer_cred(context), peers.tls_peer(context)
        return json.dumps({
            "peer": context.peer(),
            "cred": None if cred is None else {"pid": cred.pid, "uid": cred.uid, "gid": cred.gid,
                                               "groups": list(cred.groups)},
            "tls": None if tls is None else {"address": tls.address, "client_cert": tls.client_cert,
                                             "cn": tls.common_name, "names": list(tls.names)},
        }).encode()

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
        for i in range(40):
            yield bytes([i]) * 100_000

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Read": grpc.unary_unary_rpc_method_handler(self.read),
            "Apply": grpc.unary_unary_rpc_method_handler(self.apply),
            "Whoami": grpc.unary_unary_rpc_method_handler(self.whoami),
            "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
        })


@dataclass
class Running:
    server: grpc.aio.Server
    front: transport.Front
    probe: Probe
    native_ports: dict[str, int]


@contextlib.asynccontextmanager
async def serving(sock_path: str | None, *, mode: int = 0o660, group: str | None = None,
                  allowed_group: str | None = None, tcp: Any = None, native: Mapping[str, Any] | None = None,
                  max_connections: int = peers.DEFAULT_MAX_CONNECTIONS,
                  limits: peers.ConnectionLimits | None = None,
                  observer: relay.ConnectionObserver | None = None) -> AsyncIterator[Running]:
    probe = Probe(allowed_group)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((probe.handler(),))
    if sock_path is not None:
        front = transport.prepare_local(server, sock_path, mode, group, max_connections=max_connections,
                                        limits=limits, observer=observer)
    else:
        front = transport.Front(server, max_connections=max_connections, limits=limits, observer=observer)
    if tcp is not None:
        front.listen_tcp("127.0.0.1:0", tcp)
    ports = {}
    for name, creds in (native or {}).items():
        ports[name] = (server.add_secure_port("127.0.0.1:0", creds) if creds is not None
                       else server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await front.start()
    try:
        yield Running(server, front, probe, ports)
    finally:
        await server.stop(None)
        await front.stop()


def rpc(channel: grpc.aio.Channel, method: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    return channel.unary_unary(f"/{SERVICE}/{method}")


async def ok(channel: grpc.aio.Channel, method: str) -> bytes:
    return await rpc(channel, method)(b"", timeout=10)


async def refused(channel: grpc.aio.Channel, method: str) -> tuple[str, str]:
    """(status code name, details) of an RPC that must fail."""
    try:
        await rpc(channel, method)(b"", timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    raise AssertionError(f"{method} succeeded")


CHILD = r"""
import json, os, socket, sys
import grpc
args = json.loads(sys.argv[1])
# Created as root (the interpreter's files are under /root, 0700); it connects on the first call.
ch = grpc.insecure_channel("unix:" + args["path"])
calls = {m: ch.unary_unary("/memtopo.test.Probe/" + m) for m in args["methods"]}
os.setgroups(args["groups"]); os.setgid(args["gid"]); os.setuid(args["uid"])
out = {"pid": os.getpid()}
if args.get("connect_only"):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(args["path"]); out["connect"] = "ok"
    except OSError as e:
        out["connect"] = e.errno
else:
    for m, rpc in calls.items():
        try:
            r = rpc(b"", timeout=10)
            out[m] = r.decode() if m != "Read" else len(r)
        except grpc.RpcError as e:
            out[m] = [e.code().name, e.details()]
print(json.dumps(out))
"""


async def as_user(path: str, *, uid: int = NOBODY, gid: int = NOBODY, groups: Iterable[int] = (),
                  methods: Iterable[str] = ("Read", "Apply", "Whoami"), connect_only: bool = False) -> dict[str, Any]:
    """Run the calls from another process with these credentials (while this loop keeps serving)."""
    args = {"path": path, "uid": uid, "gid": gid, "groups": list(groups), "methods": list(methods),
            "connect_only": connect_only}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, json.dumps(args),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out)
    return result


def on_loop(prepare: Callable[..., transport.Front], *args: Any) -> transport.Front:
    """``prepare(grpc.aio.server(), *args)`` where grpc.aio can make its server (inside a loop)."""

    async def main() -> transport.Front:
        return prepare(grpc.aio.server(), *args)

    return asyncio.run(main())


@pytest.fixture
def sockdir() -> Iterator[str]:
    """A directory other users can traverse (pytest's tmp_path is 0700)."""
    d = tempfile.mkdtemp(prefix="memtopo-transport-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- Unix socket: who may apply --------------------------------------------------------------------


def test_root_peer_is_identified_and_allowed(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")

    async def main() -> None:
        async with serving(path), grpc.aio.insecure_channel(f"unix:{path}") as ch:
            assert await ok(ch, "Read") == PAYLOAD
            assert await ok(ch, "Apply") == b"applied"
            who = json.loads(await ok(ch, "Whoami"))
            # This process is the client: its own pid and credentials, not the front's guess.
            assert who["cred"]["pid"] == os.getpid()
            assert who["cred"]["uid"] == 0 and who["cred"]["gid"] == os.getgid()
            assert who["peer"].startswith("unix-abstract:memtopo.")
            assert who["tls"] is None

    asyncio.run(main())


def test_other_uid_reads_but_cannot_apply(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    name, _ = _other_group()

    async def main() -> None:
        # 0666 lets nobody connect at all: then only the uid check stands between it and ApplyPlan.
        async with serving(path, mode=0o666, allowed_group=name):
            out = await as_user(path)
        assert out["Read"] == len(PAYLOAD)
        code, details = out["Apply"]
        assert code == "PERMISSION_DENIED"
        assert f"uid {NOBODY}" in details and f"pid {out['pid']}" in details and name in details
        who = json.loads(out["Whoami"])
        assert who["cred"] == {"pid": out["pid"], "uid": NOBODY, "gid": NOBODY, "groups": []}

    asyncio.run(main())


def test_other_uid_refused_when_no_group_is_configured(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    _, gid = _other_group()

    async def main() -> None:
        async with serving(path, mode=0o666, allowed_group=None):
            out = await as_user(path, groups=[gid], methods=["Apply"])
        code, details = out["Apply"]
        assert code == "PERMISSION_DENIED" and "no socket group is configured" in details

    asyncio.run(main())


def test_supplementary_group_member_may_apply(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    name, gid = _other_group()

    async def main() -> None:
        async with serving(path, mode=0o660, group=name, allowed_group=name):
            member = await as_user(path, groups=[4242, gid])
        assert member["Read"] == len(PAYLOAD)
        assert member["Apply"] == "applied"
        assert sorted(json.loads(member["Whoami"])["cred"]["groups"]) == sorted([4242, gid])

    asyncio.run(main())


def test_primary_group_counts_and_numeric_group_is_accepted(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    _, gid = _other_group()

    async def main() -> None:
        async with serving(path, mode=0o660, group=str(gid), allowed_group=str(gid)):
            out = await as_user(path, gid=gid, groups=[], methods=["Apply"])
        assert out["Apply"] == "applied"

    asyncio.run(main())


def test_member_of_another_group_is_refused(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    name, gid = _other_group()

    async def main() -> None:
        async with serving(path, mode=0o666, allowed_group=name):
            out = await as_user(path, groups=[gid + 1000], methods=["Apply"])
        code, details = out["Apply"]
        assert code == "PERMISSION_DENIED" and f"gid {gid}" in details

    asyncio.run(main())


def test_many_supplementary_groups_are_all_read(sockdir: str) -> None:
    # More groups than the first SO_PEERGROUPS buffer holds: the ERANGE retry path.
    path = os.path.join(sockdir, "agent.sock")
    name, gid = _other_group()
    groups = [*range(20_000, 20_400), gid]

    async def main() -> None:
        async with serving(path, mode=0o666, allowed_group=name):
            out = await as_user(path, groups=groups, methods=["Apply", "Whoami"])
        assert out["Apply"] == "applied"
        assert sorted(json.loads(out["Whoami"])["cred"]["groups"]) == sorted(groups)

    asyncio.run(main())


# ---- Unix socket: the file ---------------------------------------------------------------------------


def test_socket_mode_and_group_are_applied_and_enforced(sockdir: str) -> None:
    path = os.path.join(sockdir, "run", "agent.sock")  # the directory is created
    name, gid = _other_group()

    async def main() -> None:
        ctx = serving(path, mode=0o660, group=name, allowed_group=name)
        running = await enter_under_umask(ctx)
        try:
            st = os.stat(path)
            assert stat.S_ISSOCK(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid and st.st_uid == 0
            # The kernel enforces the file's mode: outsiders cannot even connect...
            outsider = await as_user(path, connect_only=True)
            assert outsider["connect"] == 13  # EACCES
            insider = await as_user(path, groups=[gid], connect_only=True)
            assert insider["connect"] == "ok"
            # ...and the private socket grpc listens on is in a directory only root may enter.
            private = os.path.dirname(running.front.upstream_path)
            assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
            assert (await as_user(running.front.upstream_path, groups=[gid], connect_only=True))["connect"] == 13
        finally:
            await ctx.__aexit__(None, None, None)

    asyncio.run(main())


def test_stale_socket_is_replaced(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)  # a socket file nobody listens on: an agent that died
    dead.close()
    assert os.path.exists(path)

    async def main() -> None:
        async with serving(path), grpc.aio.insecure_channel(f"unix:{path}") as ch:
            assert await ok(ch, "Apply") == b"applied"

    asyncio.run(main())


def test_live_agent_on_the_socket_is_refused(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")

    async def main() -> None:
        async with serving(path), grpc.aio.insecure_channel(f"unix:{path}") as ch:
            server = grpc.aio.server()
            with pytest.raises(sockets.SocketInUseError, match="lock"):
                transport.prepare_local(server, path, 0o660, None)
            # The refused attempt left the live agent's socket alone.
            assert await ok(ch, "Read") == PAYLOAD

    asyncio.run(main())


def test_foreign_listener_is_refused_and_kept(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    other = socket.socket(socket.AF_UNIX)
    other.bind(path)
    other.listen()
    try:
        with pytest.raises(sockets.SocketInUseError, match="listening"):
            on_loop(transport.prepare_local, path, 0o660, None)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        other.close()
    assert not [p for p in os.listdir(sockdir) if p.startswith(".memtopo-grpc-")]  # nothing left behind


def test_non_socket_file_is_not_removed(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    Path(path).write_text("precious")
    with pytest.raises(peers.TransportError, match="not a socket"):
        on_loop(transport.prepare_local, path, 0o660, None)
    assert Path(path).read_text() == "precious"


def test_unknown_group_and_bad_mode_are_typed_errors(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    with pytest.raises(peers.TransportError, match="does not exist"):
        on_loop(transport.prepare_local, path, 0o660, "no-such-group-memtopo")
    with pytest.raises(peers.TransportError, match="permission mode"):
        on_loop(transport.prepare_local, path, 0o4755, None)
    assert not os.path.exists(path)


def test_stop_removes_the_socket_and_closes_connections(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    before = len(peers._PEERS)

    async def main() -> str:
        async with serving(path) as running, grpc.aio.insecure_channel(f"unix:{path}") as ch:
            assert await ok(ch, "Read") == PAYLOAD
            assert running.front.connections == 1
            assert len(peers._PEERS) == before + 1
            private = os.path.dirname(running.front.upstream_path)
        return private

    private = asyncio.run(main())
    assert not os.path.exists(path) and not os.path.exists(private)
    assert len(peers._PEERS) == before
    # The lock is released: a successor starts on the same path.
    on_loop(transport.prepare_local, path, 0o660, None).discard()


def test_a_released_socket_file_leaves_a_successors_socket_in_place(sockdir: str) -> None:
    """Both public sockets (relayed and direct) are released this way: only the file this agent made
    goes, and the lock is given up so the successor can claim the path."""
    path = os.path.join(sockdir, "agent.sock")
    ours = sockets.SocketFile(path, 0o600, None)
    listener = ours.bind()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    listener.close()
    # Moved aside, not unlinked: a freed inode number may be reused by the successor's file.
    os.rename(path, path + ".old")
    successor = socket.socket(socket.AF_UNIX)
    try:
        successor.bind(path)
        theirs = os.stat(path).st_ino
        ours.release()
        assert os.stat(path).st_ino == theirs
        os.close(sockets.take_lock(path + ".lock"))  # free again
    finally:
        successor.close()


def test_unidentified_local_peer_cannot_apply(sockdir: str) -> None:
    # Root connecting to the private socket directly bypasses the front: it reads, never applies.
    path = os.path.join(sockdir, "agent.sock")

    async def main() -> None:
        async with serving(path) as running, grpc.aio.insecure_channel(f"unix:{running.front.upstream_path}") as ch:
            assert await ok(ch, "Read") == PAYLOAD
            code, details = await refused(ch, "Apply")
            assert code == "PERMISSION_DENIED" and "unidentified peer" in details

    asyncio.run(main())


# ---- the direct (read-only) socket --------------------------------------------------------------------


async def enter_under_umask(ctx: contextlib.AbstractAsyncContextManager[Running]) -> Running:
    """Enter ``ctx`` under a umask of 077: the socket's mode must not depend on the agent's umask."""
    old = os.umask(0o077)
    try:
        return await ctx.__aenter__()
    finally:
        os.umask(old)


@contextlib.asynccontextmanager
async def serving_direct(sock_path: str, direct_path: str, *, mode: int = 0o660,
                         group: str | None = None) -> AsyncIterator[Running]:
    probe = Probe(group)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((probe.handler(),))
    front = transport.prepare_local(server, sock_path, mode, group)
    try:
        front.listen_direct(server, direct_path, mode, group)
    except BaseException:
        front.discard()
        raise
    await server.start()
    await front.start()
    try:
        yield Running(server, front, probe, {})
    finally:
        await server.stop(None)
        await front.stop()


def test_direct_socket_reads_without_the_relay_and_never_applies(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    direct = os.path.join(sockdir, "ro", "agent-read.sock")  # the directory is created
    name, gid = _other_group()

    async def main() -> None:
        ctx = serving_direct(path, direct, group=name)
        running = await enter_under_umask(ctx)
        try:
            st = os.stat(direct)
            assert stat.S_ISSOCK(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid and st.st_uid == 0
            assert os.listdir(os.path.dirname(running.front.upstream_path)) == ["grpc.sock"]  # moved out
            async with grpc.aio.insecure_channel(f"unix:{direct}") as ch:
                assert await ok(ch, "Read") == PAYLOAD
                assert running.front.connections == 0  # grpc's own listener: nothing relayed
                # Even root: a peer the front did not identify may read, never apply.
                code, details = await refused(ch, "Apply")
                assert code == "PERMISSION_DENIED" and "unidentified peer" in details
            assert (await as_user(direct, connect_only=True))["connect"] == 13  # EACCES: the mode holds
            member = await as_user(direct, groups=[gid], methods=("Read", "Apply"))
            assert member["Read"] == len(PAYLOAD) and member["Apply"][0] == "PERMISSION_DENIED"
            # The relayed socket still lets the same group member apply.
            assert (await as_user(path, groups=[gid], methods=("Apply",)))["Apply"] == "applied"
        finally:
            await ctx.__aexit__(None, None, None)
        assert not os.path.exists(direct) and not os.path.exists(path)

    asyncio.run(main())


def test_direct_socket_of_a_live_agent_is_kept_and_a_stale_one_replaced(sockdir: str) -> None:
    path, direct = os.path.join(sockdir, "agent.sock"), os.path.join(sockdir, "agent-read.sock")
    other_path = os.path.join(sockdir, "other.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(direct)  # left behind by an agent that died
    dead.close()

    async def main() -> None:
        async with serving_direct(path, direct), grpc.aio.insecure_channel(f"unix:{direct}") as ch:
            assert await ok(ch, "Read") == PAYLOAD
            server = grpc.aio.server()
            front = transport.prepare_local(server, other_path, 0o660, None)
            try:
                with pytest.raises(sockets.SocketInUseError, match="lock"):
                    front.listen_direct(server, direct, 0o660, None)
            finally:
                front.discard()
            assert await ok(ch, "Read") == PAYLOAD  # the refused attempt left it alone

    asyncio.run(main())


def test_direct_socket_bad_mode_and_group_are_typed_errors(sockdir: str) -> None:
    path, direct = os.path.join(sockdir, "agent.sock"), os.path.join(sockdir, "agent-read.sock")

    async def main() -> None:
        server = grpc.aio.server()
        front = transport.prepare_local(server, path, 0o660, None)
        try:
            with pytest.raises(peers.TransportError, match="permission mode"):
                front.listen_direct(server, direct, 0o4755, None)
            with pytest.raises(peers.TransportError, match="does not exist"):
                front.listen_direct(server, direct, 0o660, "no-such-group-memtopo")
        finally:
            front.discard()
        assert not os.path.exists(direct)

    asyncio.run(main())


# ---- the relay --------------------------------------------------------------------------------------


def test_concurrent_clients_and_streams_get_every_byte(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")

    async def main() -> None:
        async with serving(path) as running:
            all_connected = asyncio.Barrier(6)

            async def one_client() -> None:
                async with grpc.aio.insecure_channel(f"unix:{path}", options=OWN_CONNECTION) as ch:
                    assert await ok(ch, "Read") == PAYLOAD
                    await all_connected.wait()
                    assert running.front.connections == 6  # six connections at once, not one shared
                    for _ in range(4):
                        assert await ok(ch, "Read") == PAYLOAD
                    stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = ch.unary_stream(f"/{SERVICE}/Stream")
                    got = [m async for m in stream(b"", timeout=20)]
                    assert got == [bytes([i]) * 100_000 for i in range(40)]

            await asyncio.gather(*(one_client() for _ in range(6)))
            await _settle(lambda: running.front.connections == 0)

    asyncio.run(main())


class StubServer:
    """Stands in for grpc: the front only needs the private address, so any byte stream can be
    relayed and checked exactly."""

    address = ""

    def add_insecure_port(self, address: str) -> int:
        self.address = address
        return 1


def test_relay_is_byte_exact_under_backpressure_both_ways(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    produced = os.urandom(8 << 20)  # far more than socket buffers and one pipe hold
    uploaded = os.urandom(4 << 20)

    async def main() -> None:
        stub = StubServer()
        front = transport.prepare_local(cast(grpc.aio.Server, stub), path, 0o660, None)
        received = bytearray()
        upstream_peer: list[str] = []

        async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            name = writer.get_extra_info("peername")
            upstream_peer.append(name.decode() if isinstance(name, bytes) else name)

            async def send() -> None:
                writer.write(produced)
                await writer.drain()
                writer.write_eof()

            async def slow_receive() -> None:
                while chunk := await reader.read(65536):
                    received.extend(chunk)
                    await asyncio.sleep(0.001)

            await asyncio.gather(send(), slow_receive())
            writer.close()

        server = await asyncio.start_unix_server(upstream, stub.address.removeprefix("unix:"))
        await front.start()
        try:
            reader, writer = await asyncio.open_unix_connection(path)
            await asyncio.sleep(0.3)  # not reading: the front must hold what it has and wait
            await _settle(lambda: front.connections == 1 and bool(upstream_peer))
            # The upstream saw the front's abstract name, which maps to this process's credentials.
            assert upstream_peer and upstream_peer[0].startswith("\0memtopo.")
            cred = peers._PEERS["unix-abstract:" + upstream_peer[0][1:]]
            assert isinstance(cred, peers.PeerCred) and cred.pid == os.getpid()

            async def upload() -> None:
                writer.write(uploaded)
                await writer.drain()
                writer.write_eof()  # a half-close crosses the front

            _, downloaded = await asyncio.wait_for(asyncio.gather(upload(), reader.read()), 60)
            writer.close()
            assert downloaded == produced
            await _settle(lambda: bytes(received) == uploaded)
            await _settle(lambda: front.connections == 0)
        finally:
            await front.stop()
            server.close()

    asyncio.run(main())


def test_connection_limit(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    limits = peers.ConnectionLimits(max_connections=1)

    async def main() -> None:
        async with serving(path, mode=0o666, limits=limits) as running:
            other = await asyncio.to_thread(Holder, path, 3)
            try:
                await asyncio.to_thread(settles_at, other.open, 1)  # the cap, for everyone but root
                async with grpc.aio.insecure_channel(f"unix:{path}", options=OWN_CONNECTION) as root:
                    assert await ok(root, "Read") == PAYLOAD  # root is never refused by it
            finally:
                other.close()
            await _settle(lambda: running.front.connections == 0)
            again = await asyncio.to_thread(Holder, path, 1)
            try:
                await asyncio.to_thread(settles_at, again.open, 1)  # a freed slot is reused
            finally:
                again.close()

    asyncio.run(main())


def test_no_user_can_lock_root_or_the_socket_group_out(sockdir: str) -> None:
    """Per-user caps and a reserve: nobody holding every connection it can get, and a second
    unprivileged user, leave the socket group its reserved slots and root its calls."""
    path = os.path.join(sockdir, "agent.sock")
    group, gid = _other_group()
    limits = peers.ConnectionLimits(max_connections=12, per_user=4, reserved=6)

    async def main() -> None:
        async with serving(path, mode=0o666, group=group, allowed_group=group, limits=limits) as running:
            hogs = [await asyncio.to_thread(Holder, path, 10),
                    await asyncio.to_thread(Holder, path, 10, uid=NOBODY - 1, gid=NOBODY - 1)]
            try:
                # 4 per user, 12 - 6 = 6 for both together
                await asyncio.to_thread(settles_at, lambda: sorted(h.open() for h in hogs), [2, 4])
                member = await asyncio.to_thread(Holder, path, 10, uid=NOBODY - 2, gid=NOBODY - 2, groups=[gid])
                try:
                    # the group gets in: its own per-user cap
                    await asyncio.to_thread(settles_at, member.open, 4)
                    async with grpc.aio.insecure_channel(f"unix:{path}", options=OWN_CONNECTION) as root:
                        assert await ok(root, "Read") == PAYLOAD
                        assert await ok(root, "Apply") == b"applied"
                    member_apply = await as_user(path, uid=NOBODY - 3, gid=NOBODY - 3, groups=[gid],
                                                 methods=("Apply",))
                    assert member_apply["Apply"] == "applied"  # a second member: reserved slots left
                finally:
                    member.close()
            finally:
                for h in hogs:
                    h.close()
            await _settle(lambda: running.front.connections == 0)

    asyncio.run(main())


def test_idle_connections_are_closed(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    seen: list[tuple[str, str]] = []
    limits = peers.ConnectionLimits(idle_seconds=1.0)

    async def main() -> None:
        async with serving(path, mode=0o666, limits=limits, observer=lambda e, r: seen.append((e, r))) as running:
            holder = await asyncio.to_thread(Holder, path, 5)
            try:
                await _settle(lambda: running.front.connections == 5)
                await asyncio.to_thread(settles_at, holder.open, 0)
            finally:
                holder.close()
            await _settle(lambda: running.front.connections == 0)
            async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
                assert await ok(ch, "Read") == PAYLOAD  # a live client is served (and not cut mid-call)
        assert seen.count(("idle_closed", "")) == 5

    asyncio.run(main())


def test_garbage_client_is_dropped_without_leaks(sockdir: str) -> None:
    path = os.path.join(sockdir, "agent.sock")
    before = len(peers._PEERS)

    async def main() -> None:
        async with serving(path) as running:
            loop = asyncio.get_running_loop()
            for junk in (b"", b"GET / HTTP/1.1\r\n\r\n", os.urandom(100_000)):
                s = socket.socket(socket.AF_UNIX)
                s.setblocking(False)
                await loop.sock_connect(s, path)
                if junk:
                    await loop.sock_sendall(s, junk)
                s.shutdown(socket.SHUT_WR)
                # grpc answers garbage with a GOAWAY and closes; the front passes the close on.
                with contextlib.suppress(ConnectionError):
                    while await asyncio.wait_for(loop.sock_recv(s, 65536), 10):
                        pass
                s.close()
            await _settle(lambda: running.front.connections == 0)
            assert len(peers._PEERS) == before
            async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
                assert await ok(ch, "Read") == PAYLOAD

    asyncio.run(main())


def test_stopping_the_front_first_does_not_hang(sockdir: str) -> None:
    # The graceful order is server.stop() then front.stop(); the other order must still end.
    path = os.path.join(sockdir, "agent.sock")

    async def main() -> None:
        probe = Probe(None)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((probe.handler(),))
        front = transport.prepare_local(server, path, 0o660, None)
        await server.start()
        await front.start()
        async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
            assert await ok(ch, "Read") == PAYLOAD
            await asyncio.wait_for(front.stop(), 5)
            code, _ = await refused(ch, "Read")
            assert code == "UNAVAILABLE"
        await asyncio.wait_for(server.stop(1.0), 5)

    asyncio.run(main())


def test_a_dead_relay_thread_is_reported(sockdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.join(sockdir, "agent.sock")

    def broken(self: object, fd: int, events: int) -> None:
        raise RuntimeError("bug")

    async def main() -> None:
        async with serving(path) as running:
            assert running.front.alive
            monkeypatch.setattr(relay.Pump, "_service", broken)
            async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await rpc(ch, "Read")(b"", timeout=2)
            await _settle(lambda: not running.front.alive)

    asyncio.run(main())


async def _settle(done: Any, timeout: float = 60.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if done():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def test_socket_peer_cred_of_a_socketpair() -> None:
    a, b = socket.socketpair()
    with a, b:
        cred = peers.socket_peer_cred(a)
    assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert set(cred.groups) == set(os.getgroups())


# ---- TCP --------------------------------------------------------------------------------------------


@dataclass
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    stranger_cert: str  # signed by a CA the server does not trust
    stranger_key: str


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
          *, ca: bool = False, server: bool = False) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer if issuer else (name, key)
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
    elif server:
        b = b.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")

    def write(name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
        return str(d / f"{name}.pem"), str(d / f"{name}.key")

    ca_key, other_key = _key(), _key()
    ca = _cert("memtopo test CA", ca_key, None, ca=True)
    other = _cert("someone else's CA", other_key, None, ca=True)
    ca_pem, _ = write("ca", ca, ca_key)
    sk, ck, xk = _key(), _key(), _key()
    server = write("server", _cert("node-1", sk, (ca.subject, ca_key), server=True), sk)
    client = write("client", _cert("controller-1", ck, (ca.subject, ca_key)), ck)
    stranger = write("stranger", _cert("controller-1", xk, (other.subject, other_key)), xk)
    return Pki(ca_pem, *server, *client, *stranger)


def _tls_channel(port: int, pki: Pki, cert: str | None = None, key: str | None = None) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", transport.channel_credentials(pki.ca, cert, key))


def test_tls_without_client_ca_reads_but_never_applies(pki: Pki) -> None:
    async def main() -> None:
        tls = transport.server_tls_context(pki.server_cert, pki.server_key, None)
        async with serving(None, tcp=tls) as running:
            port = running.front.tcp_ports[0]
            async with _tls_channel(port, pki) as ch:
                assert await ok(ch, "Read") == PAYLOAD
                code, details = await refused(ch, "Apply")
                assert code == "PERMISSION_DENIED" and "no client certificate" in details
            # A client certificate is not even requested without a client CA.
            async with _tls_channel(port, pki, pki.client_cert, pki.client_key) as ch:
                code, _ = await refused(ch, "Apply")
                assert code == "PERMISSION_DENIED"

    asyncio.run(main())


def test_mtls_client_may_apply_and_others_only_read(pki: Pki) -> None:
    async def main() -> None:
        tls = transport.server_tls_context(pki.server_cert, pki.server_key, pki.ca)
        async with serving(None, tcp=tls) as running:
            port = running.front.tcp_ports[0]
            async with _tls_channel(port, pki) as anonymous:
                assert await ok(anonymous, "Read") == PAYLOAD
                code, details = await refused(anonymous, "Apply")
                assert code == "PERMISSION_DENIED" and "127.0.0.1:" in details
            async with _tls_channel(port, pki, pki.client_cert, pki.client_key) as client:
                assert await ok(client, "Apply") == b"applied"
                who = json.loads(await ok(client, "Whoami"))
                assert who["cred"] is None
                assert who["tls"]["client_cert"] is True and who["tls"]["cn"] == "controller-1"
                assert who["tls"]["names"] == ["DNS:controller-1"]
            # A certificate the client CA did not sign fails the handshake: no RPC at all.
            async with _tls_channel(port, pki, pki.stranger_cert, pki.stranger_key) as stranger:
                code, _ = await refused(stranger, "Read")
                assert code == "UNAVAILABLE"
            await _settle(lambda: running.front.connections == 0)

    asyncio.run(main())


def test_plaintext_and_native_tls_ports_are_judged_by_grpc_auth_context(pki: Pki) -> None:
    # Ports grpc serves itself (not through the front): plaintext never applies; grpc's own mTLS
    # (client certificate required) does. Its TLS with the client CA but require_client_auth=False
    # never even asks for the certificate — the reason the agent's TCP listener is the front's.
    def native(require: bool) -> grpc.ServerCredentials:
        pair = (Path(pki.server_key).read_bytes(), Path(pki.server_cert).read_bytes())
        return grpc.ssl_server_credentials([pair], Path(pki.ca).read_bytes(), require)

    async def main() -> None:
        async with serving(None, native={"plain": None, "mtls": native(True), "optional": native(False)},
                           tcp=transport.server_tls_context(pki.server_cert, pki.server_key, None)) as running:
            ports = running.native_ports
            async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['plain']}") as ch:
                assert await ok(ch, "Read") == PAYLOAD
                code, details = await refused(ch, "Apply")
                assert code == "PERMISSION_DENIED" and "plaintext" in details
            async with _tls_channel(ports["mtls"], pki, pki.client_cert, pki.client_key) as ch:
                assert await ok(ch, "Apply") == b"applied"
            async with _tls_channel(ports["optional"], pki, pki.client_cert, pki.client_key) as ch:
                assert await ok(ch, "Read") == PAYLOAD
                code, details = await refused(ch, "Apply")
                assert code == "PERMISSION_DENIED" and "no client certificate" in details

    asyncio.run(main())


def test_tls_front_refuses_plaintext_clients(pki: Pki) -> None:
    async def main() -> None:
        tls = transport.server_tls_context(pki.server_cert, pki.server_key, pki.ca)
        async with serving(None, tcp=tls) as running, \
                grpc.aio.insecure_channel(f"127.0.0.1:{running.front.tcp_ports[0]}") as ch:
            code, _ = await refused(ch, "Read")
            assert code == "UNAVAILABLE"

    asyncio.run(main())


def test_credential_files_errors_are_typed(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(peers.TransportError, match=r"missing\.pem"):
        transport.server_tls_context(missing, pki.server_key, None)
    with pytest.raises(peers.TransportError, match="client CA"):
        transport.server_tls_context(pki.server_cert, pki.server_key, missing)
    with pytest.raises(peers.TransportError):
        transport.server_tls_context(pki.server_cert, pki.client_key, None)  # key of another certificate
    with pytest.raises(peers.TransportError, match="go together"):
        transport.channel_credentials(pki.ca, pki.client_cert, None)
    with pytest.raises(peers.TransportError, match=r"missing\.pem"):
        transport.channel_credentials(missing, None, None)
    assert isinstance(transport.channel_credentials(None, pki.client_cert, pki.client_key), grpc.ChannelCredentials)


# ---- property tests on what the module parses --------------------------------------------------------


class FakeContext:
    def __init__(self, peer: str, auth: Mapping[str, list[bytes]], identities: list[bytes] | None) -> None:
        self._peer, self._auth, self._identities = peer, auth, identities

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> Mapping[str, Iterable[bytes]]:
        return self._auth

    def peer_identities(self) -> Iterable[bytes] | None:
        return self._identities


_auth = st.dictionaries(st.sampled_from(["transport_security_type", "x509_common_name", "security_level"]),
                        st.lists(st.binary(max_size=8), max_size=2), max_size=3)


@settings(max_examples=300, deadline=None)
@given(peer=st.one_of(st.text(max_size=60), st.sampled_from(["", "unix:", "ipv4:1.2.3.4:5", "ipv6:[::1]:5"]),
                      st.text(max_size=20).map(lambda s: f"unix-abstract:memtopo.{s}")),
       auth=_auth, identities=st.one_of(st.none(), st.lists(st.binary(max_size=8), max_size=2)),
       group=st.one_of(st.none(), st.text(max_size=12)))
def test_unknown_peers_are_always_refused_with_a_reason(peer: str, auth: Mapping[str, list[bytes]],
                                                         identities: list[bytes] | None, group: str | None) -> None:
    ctx = FakeContext(peer, auth, identities)
    reason = peers.authorize_apply(ctx, group)
    tcp_mtls = (peer.startswith(("ipv4:", "ipv6:")) and b"ssl" in auth.get("transport_security_type", [])
                and bool(identities))
    assert (reason is None) == tcp_mtls  # only grpc's own verified mTLS passes without the front
    assert reason is None or reason.strip()
    assert peers.peer_cred(ctx) is None and peers.tls_peer(ctx) is None


_UIDS = st.sampled_from([None, 0, 1000, 1001, 1002])  # None: a TLS peer


@settings(max_examples=300, deadline=None)
@given(max_connections=st.integers(1, 6), per_user=st.one_of(st.none(), st.integers(1, 4)),
       reserved=st.integers(0, 5),
       ops=st.lists(st.one_of(st.tuples(st.just("admit"), _UIDS, st.booleans()),
                              st.tuples(st.just("release"), st.integers(0, 20), st.just(False))), max_size=40))
def test_admission_keeps_every_cap_and_never_refuses_root(max_connections: int, per_user: int | None,
                                                          reserved: int, ops: list[tuple[str, Any, bool]]) -> None:
    limits = peers.ConnectionLimits(max_connections=max_connections, per_user=per_user,
                                    reserved=min(reserved, max_connections - 1))
    admission = peers.Admission(limits)
    open_: list[tuple[int | None, bool]] = []
    for op, arg, privileged in ops:
        if op == "release":
            if open_:
                uid, priv = open_.pop(arg % len(open_))
                admission.release(uid, priv)
            continue
        uid, privileged = arg, privileged or arg == 0
        before = len(open_)
        refused = admission.admit(uid, privileged)
        if uid == 0:
            assert refused == ""
        elif refused == "":
            # Room in all, for this user, and (unprivileged) outside the reserved share.
            assert before < limits.max_connections
            assert per_user is None or uid is None or sum(c[0] == uid for c in open_) < per_user
            assert privileged or sum(not c[1] for c in open_) < limits.max_connections - limits.reserved
        else:
            assert refused in ("max_connections", "per_user", "reserved")
            if privileged and before < limits.max_connections and (
                    per_user is None or uid is None or sum(c[0] == uid for c in open_) < per_user):
                raise AssertionError(f"a privileged peer was refused ({refused}) with a slot free")
        if refused == "":
            open_.append((uid, privileged))
        assert sum(c[0] != 0 for c in open_) <= limits.max_connections
    for uid, priv in open_:
        admission.release(uid, priv)
    # Everything released: a fresh unprivileged peer fits again unless nothing is left outside the reserve.
    assert admission.admit(1000, False) == ("" if limits.max_connections - limits.reserved > 0 else "reserved")


@settings(max_examples=300)
@given(raw=st.binary(max_size=64))
def test_parse_groups_takes_any_bytes(raw: bytes) -> None:
    groups = peers.parse_groups(raw)
    assert len(groups) == len(raw) // 4
    assert groups == struct.unpack(f"={len(raw) // 4}I", raw[:len(raw) // 4 * 4])


@settings(max_examples=300)
@given(name=st.one_of(st.text(max_size=16), st.integers(min_value=0, max_value=2**40).map(str)))
def test_resolve_gid_answers_or_raises_typed(name: str) -> None:
    try:
        gid = peers.resolve_gid(name)
    except peers.TransportError as exc:
        assert repr(name) in str(exc)
    else:
        assert 0 <= gid < 2**32 - 1  # fits gid_t and is not chown's "no change"
        assert name.isdigit() or grp.getgrgid(gid).gr_name == name


def test_listen_tcp_garbage_addresses_are_typed_errors(pki: Pki) -> None:
    front = on_loop(transport.Front)
    tls = transport.server_tls_context(pki.server_cert, pki.server_key, None)
    try:
        @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(address=st.one_of(st.text(max_size=30), st.from_regex(r"\A[a-z0-9.:\[\]]{0,20}:[0-9]{1,6}\Z")))
        def check(address: str) -> None:
            try:
                port = front.listen_tcp(address, tls)
            except peers.TransportError as exc:
                assert str(exc)
            else:
                assert 0 < port < 65536

        check()
    finally:
        front.discard()
