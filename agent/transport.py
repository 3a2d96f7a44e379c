"""Transport security of the agent's gRPC server: who is calling, and may they change the host.

grpc does not show servicers the SO_PEERCRED of a Unix-socket peer (grpc/grpc#15511, #28755), and
Python's ``ssl_server_credentials`` can either *require* client certificates or not request them at
all (``require_client_auth=False`` is GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE). Neither gives what
the agent needs, so its public listeners belong to a :class:`Front` and the grpc.aio server listens
only on a private Unix socket in a 0700 directory. For every accepted connection the front's relay
(agent/relay.py) records who the peer is — SO_PEERCRED and SO_PEERGROUPS for the Unix socket, the
verified client certificate (if any) for TLS — binds its upstream socket to a fresh abstract name
and connects to the private socket. grpc reports that name as ``context.peer()``, which
agent/peers.py turns back into the identity that authorizes ApplyPlan. The socket files themselves
(mode, group, lock, stale files) are agent/sockets.py's. TLS is terminated with the ssl module,
client certificates requested and verified when a client CA is configured but not required, so
read-only RPCs work with server-only TLS. docs/transport.md has the design and the measurements.

Order of use::

    front = prepare_local(server, "/run/memtopo/agent.sock", 0o660, "memtopo")  # before server.start()
    port = front.listen_tcp("0.0.0.0:7443", server_tls_context(cert, key, client_ca))  # optional
    await server.start()
    await front.start()
    ...
    await server.stop(grace)   # in-flight answers still flow through the front
    await front.stop()
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import ssl
import tempfile

import grpc

from memtopo import tls
from memtopo.addresses import AddressError, parse_host_port
from memtopo.text import reason

from .peers import DEFAULT_MAX_CONNECTIONS, ConnectionLimits, TransportError
from .relay import ConnectionObserver, Pump
from .sockets import SocketFile, make_private_dir

# ---- credentials ----------------------------------------------------------------------------------


def server_tls_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """TLS for :meth:`Front.listen_tcp`: TLS 1.3, ALPN h2 (grpc clients require it). With
    ``client_ca`` a client certificate is requested and verified — a bad one fails the handshake —
    but not required."""
    try:
        return tls.server_context(cert, key, client_ca=client_ca, tls13_only=True, alpn=("h2",))
    except tls.TlsError as exc:
        raise TransportError(str(exc)) from None


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    """TLS credentials for the agent's controller link: ``ca`` None = the system roots; ``cert`` and
    ``key`` together present a client certificate (mTLS)."""
    try:
        return tls.channel_credentials(ca, cert, key)
    except tls.TlsError as exc:
        raise TransportError(str(exc)) from None


# ---- the front ------------------------------------------------------------------------------------


def prepare_local(server: grpc.aio.Server, socket_path: str, mode: int, group: str | None,
                  *, max_connections: int = DEFAULT_MAX_CONNECTIONS, limits: ConnectionLimits | None = None,
                  observer: ConnectionObserver | None = None) -> Front:
    """A front for ``server`` with its Unix listener bound: call before ``server.start()``, then
    ``await front.start()`` after it. The private upstream directory sits beside the socket."""
    front = Front(server, os.path.dirname(os.path.abspath(socket_path)), max_connections=max_connections,
                  limits=limits, observer=observer)
    try:
        front.listen_unix(socket_path, mode, group)
    except BaseException:
        front.discard()
        raise
    return front


class Front:
    """The public listeners of one grpc.aio server. Construct before ``server.start()`` (it adds
    the private port), add listeners, ``await start()`` after ``server.start()``, and ``await
    stop()`` after ``server.stop()`` so answers in flight still reach their clients."""

    def __init__(self, server: grpc.aio.Server, runtime_dir: str | None = None,
                 *, max_connections: int = DEFAULT_MAX_CONNECTIONS, limits: ConnectionLimits | None = None,
                 observer: ConnectionObserver | None = None) -> None:
        if max_connections < 1:
            raise TransportError(f"max_connections must be positive, not {max_connections}")
        self._limits = limits or ConnectionLimits(max_connections=max_connections)
        self._observer = observer
        self._apply_group: str | None = None
        self.unix_path: str | None = None
        self.tcp_ports: list[int] = []
        self._unix_file: SocketFile | None = None
        self._unix_listener: socket.socket | None = None
        self._tcp_listeners: list[tuple[socket.socket, ssl.SSLContext]] = []
        self._pump: Pump | None = None
        # grpc's own listener, bound in the private directory and published by rename(2).
        self._direct: tuple[str, SocketFile] | None = None
        self._started = False
        self._stopped = False
        self._private_dir = make_private_dir(runtime_dir or tempfile.gettempdir())
        self.upstream_path = os.path.join(self._private_dir, "grpc.sock")
        try:
            server.add_insecure_port(f"unix:{self.upstream_path}")
        except RuntimeError as exc:
            self.discard()
            raise TransportError(f"{self.upstream_path}: grpc cannot listen: {exc}") from None

    @property
    def connections(self) -> int:
        """Open client connections (Unix and TLS)."""
        return self._pump.connections if self._pump else 0

    @property
    def alive(self) -> bool:
        """False once the relay thread has died (a bug, logged as ``front_failed``): clients are no
        longer served, which readiness should report."""
        return self._pump is None or self._stopped or self._pump.alive

    # -- listeners (before start) --

    def listen_unix(self, path: str, mode: int, group: str | None) -> None:
        """Bind the public Unix socket with ``mode`` and group ``group`` (name or gid; None = the
        agent's). A stale socket file is replaced; a live one raises :class:`SocketInUseError`."""
        if self._started:
            raise TransportError("listeners are added before start()")
        if self._unix_file is not None:
            raise TransportError("this front already has a Unix socket")
        self._unix_file = SocketFile(path, mode, group)
        self._apply_group = group
        self._unix_listener = self._unix_file.bind()
        self.unix_path = path

    def listen_direct(self, server: grpc.aio.Server, path: str, mode: int, group: str | None) -> None:
        """A Unix socket that grpc serves itself, without the relay: for clients that only read
        (GetTopology, WatchTopology, health), at grpc's own speed. grpc reports its peers as plain
        ``unix:``, which is not in the front's table, so :func:`peers.authorize_apply` refuses ApplyPlan
        there (fails closed). Call before ``server.start()``: grpc binds it in the private directory
        and :meth:`start` gives it ``mode`` and ``group``, then renames it to ``path``, so the public
        name never exists with the umask's mode (and grpc, which unlinks whatever is at a Unix path
        before binding, never touches ``path``: the lock and the staleness check guard it)."""
        if self._started:
            raise TransportError("listeners are added before start()")
        if self._direct is not None:
            raise TransportError("this front already has a direct socket")
        public = SocketFile(path, mode, group)
        private = os.path.join(self._private_dir, "direct.sock")
        try:
            server.add_insecure_port(f"unix:{private}")
        except RuntimeError as exc:
            public.release()
            raise TransportError(f"{private}: grpc cannot listen: {exc}") from None
        self._direct = (private, public)

    def listen_tcp(self, address: str, tls: ssl.SSLContext) -> int:
        """Bind a TLS listener on ``host:port`` (port 0 = any); returns the port."""
        if self._started:
            raise TransportError("listeners are added before start()")
        try:
            host, port = parse_host_port(address)
        except AddressError as exc:
            raise TransportError(str(exc)) from None
        try:
            family = socket.AF_INET6 if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) \
                else socket.AF_INET
        except ValueError:
            family = socket.AF_INET  # a host name: resolved by bind
        try:
            sock = socket.create_server((host, port), family=family, backlog=socket.SOMAXCONN,
                                        dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        except OSError as exc:
            raise TransportError(f"{address}: {reason(exc)}") from None
        # A client that vanishes without a FIN is noticed without waiting on grpc's own pings.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        bound = int(sock.getsockname()[1])
        self._tcp_listeners.append((sock, tls))
        self.tcp_ports.append(bound)
        return bound

    # -- lifecycle --

    async def start(self) -> None:
        """Start accepting (after ``server.start()``: the private socket must be listening)."""
        if self._started:
            raise TransportError("front already started")
        if self._unix_listener is None and not self._tcp_listeners and self._direct is None:
            raise TransportError("front has no listener")
        self._started = True
        if self._direct is not None:
            private, public = self._direct
            public.publish(private)
        if self._unix_listener is not None or self._tcp_listeners:
            self._pump = Pump(self._unix_listener, self._tcp_listeners, self.upstream_path, self._limits,
                               self._apply_group, self._observer)
            self._pump.start()

    async def stop(self) -> None:
        """Close the listeners and every connection; remove the socket file and private directory."""
        if self._stopped:
            return
        self._stopped = True
        if self._pump is not None:
            await asyncio.to_thread(self._pump.stop)
        self.discard()

    def discard(self) -> None:
        """Release everything without the pump (a front that never started, or after stop)."""
        self._stopped = True
        if self._pump is None:  # else the pump closed them
            if self._unix_listener is not None:
                self._unix_listener.close()
            for sock, _ in self._tcp_listeners:
                sock.close()
        if self._unix_file is not None:
            self._unix_file.release()
        if self._direct is not None:
            self._direct[1].release()
        shutil.rmtree(self._private_dir, ignore_errors=True)
