"""Transport security of the agent's gRPC server: who is calling, and may they change the host.

grpc does not show servicers the SO_PEERCRED of a Unix-socket peer (grpc/grpc#15511, #28755), and
Python's ``ssl_server_credentials`` can either *require* client certificates or not request them at
all (``require_client_auth=False`` is GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE). Neither gives what
the agent needs, so its public listeners belong to a :class:`Front` and the grpc.aio server listens
only on a private Unix socket in a 0700 directory. For every accepted connection the front records
who the peer is — SO_PEERCRED and SO_PEERGROUPS for the Unix socket, the verified client certificate
(if any) for TLS — binds its upstream socket to a fresh abstract name and connects to the private
socket. grpc reports that name as ``context.peer()`` (``unix-abstract:memtopo.…``); the name is only
a key into the front's table, never parsed, so nothing a client sends can claim an identity.

Unix-socket bytes are moved by one thread with epoll and splice(2) through a pipe per direction: the
kernel moves the pages, the GIL is held only between system calls, and the pipe is the bounded
buffer (a side that stops reading stops the other side being read). TLS is terminated with the ssl
module, one thread per TLS connection (OpenSSL and the sockets run without the GIL), client
certificates requested and verified when a client CA is configured but not required, so read-only
RPCs work with server-only TLS. docs/transport.md has the design and the measurements.

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
import contextlib
import ctypes
import errno
import fcntl
import functools
import grp
import ipaddress
import os
import secrets
import select
import shutil
import socket
import ssl
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

import grpc

from memtopo import tls
from memtopo.addresses import AddressError, parse_host_port
from memtopo.text import reason

from .logs import Throttle, get_logger

log = get_logger(component="transport")

# Linux ≥ 4.13; Python's socket module does not name it.
SO_PEERGROUPS: Final = getattr(socket, "SO_PEERGROUPS", 59)
# Python's getsockopt allows at most 1024 bytes (256 groups); NGROUPS_MAX is 65536.
_GROUPS_FIRST_BYTES: Final = 1024
_GROUPS_MAX_BYTES: Final = 65536 * 4
# Pipes for splice: 1 MiB (the default pipe-max-size) holds a whole topology answer, so a response
# crosses in one splice each way.
PIPE_BYTES: Final = 1 << 20
# HUP and ERR go to both directions: reading finds EOF, writing finds the error.
_READ_EVENTS: Final = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_WRITE_EVENTS: Final = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
# A local connection costs two descriptors (plus a pipe while its reader lags); a TLS one a thread.
DEFAULT_MAX_CONNECTIONS: Final = 128
UPSTREAM_CONNECT_TIMEOUT: Final = 2.0
TLS_HANDSHAKE_TIMEOUT: Final = 10.0
_TLS_CHUNK: Final = 256 * 1024
_UPSTREAM_CHUNK: Final = 1 << 20
_SPLICE_FLAGS: Final = os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE
# (gid_t) -1 means "no change" to chown(2); larger does not fit gid_t.
_NO_ID: Final = 2**32 - 1



class TransportError(Exception):
    """A listener or credential that cannot be set up (bad path, group, address, certificate)."""


class SocketInUseError(TransportError):
    """Another live agent (or another program) owns the Unix socket path."""


@dataclass(frozen=True)
class PeerCred:
    """The credentials of a Unix-socket peer when it connected (SO_PEERCRED, SO_PEERGROUPS)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class TlsPeer:
    """A TCP peer of the TLS front. ``client_cert`` is True only for a certificate that verified
    against the client CA; ``common_name`` and ``names`` (``DNS:…``, ``IP Address:…``, ``URI:…``)
    come from it."""

    address: str
    client_cert: bool
    common_name: str = ""
    names: tuple[str, ...] = ()


class PeerContext(Protocol):
    """What authorization needs from a servicer context (grpc.aio's and grpc's both fit)."""

    def peer(self) -> str: ...

    def auth_context(self) -> Mapping[str, Iterable[bytes]]: ...

    def peer_identities(self) -> Iterable[bytes] | None: ...


@dataclass(frozen=True)
class ConnectionLimits:
    """Caps of the relayed listeners. Root (uid 0) is never refused by them: it is the operator,
    and no other user's connections may lock it out. Everyone else: at most ``max_connections``
    in all and ``per_user`` per uid; peers that may not apply (not root, not in the socket group;
    TLS peers too) share all but ``reserved`` of them, so the socket group always finds a slot. A
    connection that moves no byte for ``idle_seconds`` (None = never) is closed."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    per_user: int | None = None
    reserved: int = 0
    idle_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_connections < 1 or (self.per_user is not None and self.per_user < 1):
            raise TransportError("connection limits must be positive")
        if not 0 <= self.reserved < self.max_connections:
            raise TransportError(f"reserved connections must be 0-{self.max_connections - 1}")


# Called from the relay thread with what happened: ("refused", limit) or ("idle_closed", "").
ConnectionObserver = Callable[[str, str], None]

# context.peer() → who is behind it. Written by the fronts (pump thread, event loop), read by
# servicers; single dict operations are atomic under the GIL.
_PEERS: dict[str, PeerCred | TlsPeer] = {}


def _new_peer_name(tag: str) -> tuple[str, str]:
    """(abstract socket name without the leading NUL, the peer string grpc will report for it).

    Random per connection: abstract names are visible to every local user (/proc/net/unix), and a
    predictable next name could be bound first to make the front drop that connection. Only
    ``[a-z0-9.]``, which grpc does not percent-escape in a peer string."""
    name = f"memtopo.{secrets.token_hex(8)}.{tag}"
    return name, f"unix-abstract:{name}"


# ---- identity and authorization ------------------------------------------------------------------


def socket_peer_cred(sock: socket.socket) -> PeerCred:
    """The connecting process's credentials, as the kernel captured them at connect(2)."""
    fmt = "iII"  # struct ucred: pid_t, uid_t, gid_t
    pid, uid, gid = struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       struct.calcsize(fmt)))
    return PeerCred(pid=pid, uid=uid, gid=gid, groups=_peer_groups(sock))


def _peer_groups(sock: socket.socket) -> tuple[int, ...]:
    # SO_PEERGROUPS, not /proc/<pid>/status or getgrouplist(uid): these are the groups the kernel
    # checked against the socket file's mode at connect time, with no pid-reuse race and no
    # difference between the user database and what the process really holds.
    try:
        return parse_groups(sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_FIRST_BYTES))
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:
            return ()  # kernel < 4.13: only the primary gid counts (fails closed)
        if exc.errno != errno.ERANGE:
            raise
    # More groups than Python's getsockopt accepts room for (1024 bytes): ask libc directly.
    buf = ctypes.create_string_buffer(_GROUPS_MAX_BYTES)
    size = ctypes.c_uint32(_GROUPS_MAX_BYTES)
    if _libc().getsockopt(sock.fileno(), socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(size)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return parse_groups(buf.raw[:size.value])


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def parse_groups(raw: bytes) -> tuple[int, ...]:
    """The gid_t array SO_PEERGROUPS returns (native order); a trailing partial entry is ignored."""
    count = len(raw) // 4
    return struct.unpack(f"={count}I", raw[:count * 4])


def resolve_gid(group: str) -> int:
    """A group name or numeric id → gid."""
    if group.isascii() and group.isdigit():
        gid = int(group)
        if gid >= _NO_ID:
            raise TransportError(f"group {group!r} is not a valid gid (0-{_NO_ID - 1})")
        return gid
    try:
        return grp.getgrnam(group).gr_gid
    except (KeyError, ValueError):  # ValueError: an embedded NUL
        raise TransportError(f"group {group!r} does not exist") from None


def peer_cred(context: PeerContext) -> PeerCred | None:
    """The Unix-socket credentials behind ``context``; None for TCP and for unidentified peers."""
    ident = _PEERS.get(context.peer())
    return ident if isinstance(ident, PeerCred) else None


def tls_peer(context: PeerContext) -> TlsPeer | None:
    """The TLS front's view of a TCP peer (address, client certificate); None otherwise."""
    ident = _PEERS.get(context.peer())
    return ident if isinstance(ident, TlsPeer) else None


def peer_label(context: PeerContext) -> str:
    """Who is calling, for logs: ``uid:N`` on the Unix socket, ``tcp:HOST`` through the TLS front,
    else grpc's peer string without its port (per connection on the read socket: ``unix:``)."""
    ident = _PEERS.get(context.peer())
    if isinstance(ident, PeerCred):
        return f"uid:{ident.uid}"
    if isinstance(ident, TlsPeer):
        return f"tcp:{ident.address.rpartition(':')[0]}"
    peer = context.peer()
    return peer.rpartition(":")[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


def authorize_apply(context: PeerContext, allowed_group: str | None) -> str | None:
    """None when the caller may change the host (ApplyPlan), else the reason it may not.

    Unix socket: uid 0, or ``allowed_group`` is the peer's primary or a supplementary group.
    TCP: a client certificate that verified against the client CA. Anything else is refused,
    including a peer this module did not identify (fails closed)."""
    peer = context.peer()
    ident = _PEERS.get(peer)
    if isinstance(ident, PeerCred):
        return _authorize_local(ident, allowed_group)
    if isinstance(ident, TlsPeer):
        if ident.client_cert:
            return None
        return f"TCP peer {ident.address} presented no client certificate: ApplyPlan over TCP needs mutual TLS"
    if peer.startswith(("ipv4:", "ipv6:")):
        return _authorize_native_tcp(peer, context)
    return f"unidentified peer {peer!r}: ApplyPlan needs the agent's Unix socket or mutual TLS"


def _authorize_local(cred: PeerCred, allowed_group: str | None) -> str | None:
    if cred.uid == 0:
        return None
    who = f"local peer uid {cred.uid} (pid {cred.pid})"
    if not allowed_group:
        return f"{who} is not root, and no socket group is configured to allow others"
    try:
        gid = resolve_gid(allowed_group)
    except TransportError as exc:
        return f"{who} is not root, and the socket group cannot be resolved: {exc}"
    if gid == cred.gid or gid in cred.groups:
        return None
    return f"{who} is neither root nor in group {allowed_group!r} (gid {gid})"


def _authorize_native_tcp(peer: str, context: PeerContext) -> str | None:
    # A port grpc serves itself (not through the TLS front): grpc fills the x509 properties and
    # the peer identity only from a certificate it verified, which Python's API can only require.
    security = [bytes(v) for v in context.auth_context().get("transport_security_type", ())]
    if b"ssl" not in security:
        return f"plaintext TCP peer {peer}: ApplyPlan over TCP needs mutual TLS"
    if not list(context.peer_identities() or ()):
        return f"TCP peer {peer} presented no client certificate: ApplyPlan over TCP needs mutual TLS"
    return None


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
    """TLS credentials for dialing (the controller link, ``memtopo query`` over TCP): ``ca`` None =
    the system roots; ``cert`` and ``key`` together present a client certificate (mTLS)."""
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
        self._unix_listener: socket.socket | None = None
        self._unix_inode: tuple[int, int] | None = None
        self._lock_fd: int | None = None
        self._tcp_listeners: list[tuple[socket.socket, ssl.SSLContext]] = []
        self._pump: _Pump | None = None
        self._direct: _Direct | None = None
        self._started = False
        self._stopped = False
        base = runtime_dir or tempfile.gettempdir()
        try:
            _make_dirs(base)
            # mkdtemp: a fresh 0700 directory nobody else can have prepared or can enter.
            self._private_dir = tempfile.mkdtemp(prefix=".memtopo-grpc-", dir=base)
        except OSError as exc:
            raise TransportError(f"{base}: cannot create the private socket directory: {reason(exc)}") from None
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
        if self._unix_listener is not None:
            raise TransportError("this front already has a Unix socket")
        gid, self._lock_fd = _claim_socket_path(path, mode, group)
        self._apply_group = group
        _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Before listen(): nobody can connect while the umask's mode is on the file.
            os.chown(path, -1, gid)
            os.chmod(path, mode)
            sock.listen(socket.SOMAXCONN)
            st = os.stat(path)
        except OSError as exc:
            sock.close()
            raise TransportError(f"{path}: {reason(exc)}") from None
        sock.setblocking(False)
        self._unix_listener = sock
        self._unix_inode = (st.st_dev, st.st_ino)
        self.unix_path = path

    def listen_direct(self, server: grpc.aio.Server, path: str, mode: int, group: str | None) -> None:
        """A Unix socket that grpc serves itself, without the relay: for clients that only read
        (GetTopology, WatchTopology, health), at grpc's own speed. grpc reports its peers as plain
        ``unix:``, which is not in the front's table, so :func:`authorize_apply` refuses ApplyPlan
        there (fails closed). Call before ``server.start()``: grpc binds it in the private directory
        and :meth:`start` gives it ``mode`` and ``group``, then renames it to ``path``, so the public
        name never exists with the umask's mode (and grpc, which unlinks whatever is at a Unix path
        before binding, never touches ``path``: the lock and the staleness check guard it)."""
        if self._started:
            raise TransportError("listeners are added before start()")
        if self._direct is not None:
            raise TransportError("this front already has a direct socket")
        gid, lock_fd = _claim_socket_path(path, mode, group)
        private = os.path.join(self._private_dir, "direct.sock")
        try:
            _remove_stale_socket(path)
            try:
                server.add_insecure_port(f"unix:{private}")
            except RuntimeError as exc:
                raise TransportError(f"{private}: grpc cannot listen: {exc}") from None
        except BaseException:
            os.close(lock_fd)
            raise
        self._direct = _Direct(private, path, mode, gid, lock_fd)

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
            self._direct.publish()
        if self._unix_listener is not None or self._tcp_listeners:
            self._pump = _Pump(self._unix_listener, self._tcp_listeners, self.upstream_path, self._limits,
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
        if self.unix_path is not None and self._unix_inode is not None:
            # Only our own socket file: a successor may already have replaced it.
            with contextlib.suppress(OSError):
                st = os.lstat(self.unix_path)
                if (st.st_dev, st.st_ino) == self._unix_inode:
                    os.unlink(self.unix_path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._direct is not None:
            self._direct.discard()
        shutil.rmtree(self._private_dir, ignore_errors=True)


def _claim_socket_path(path: str, mode: int, group: str | None) -> tuple[int, int]:
    """Checks shared by every public socket: the mode, the group (its gid; -1 = the agent's), the
    directory (created), and the lock that keeps a second agent off a live one's path (its fd)."""
    if not 0 <= mode <= 0o777:
        raise TransportError(f"socket mode {mode:#o} is not a permission mode (0-0777)")
    gid = resolve_gid(group) if group else -1
    directory = os.path.dirname(os.path.abspath(path))
    try:
        _make_dirs(directory)
    except OSError as exc:
        raise TransportError(f"{directory}: {reason(exc)}") from None
    return gid, _lock(path + ".lock")


class _Direct:
    """The direct socket: grpc's own listener, bound privately and published by rename(2)."""

    def __init__(self, private: str, public: str, mode: int, gid: int, lock_fd: int) -> None:
        self.private = private
        self.public = public
        self.mode = mode
        self.gid = gid
        self.lock_fd: int | None = lock_fd
        self.inode: tuple[int, int] | None = None

    def publish(self) -> None:
        try:
            os.chown(self.private, -1, self.gid)
            os.chmod(self.private, self.mode)
            os.rename(self.private, self.public)  # atomic: the name appears with its final mode
            st = os.stat(self.public)
        except OSError as exc:
            raise TransportError(f"{self.public}: {reason(exc)}") from None
        self.inode = (st.st_dev, st.st_ino)

    def discard(self) -> None:
        if self.inode is not None:
            with contextlib.suppress(OSError):  # only our own: a successor may have replaced it
                st = os.lstat(self.public)
                if (st.st_dev, st.st_ino) == self.inode:
                    os.unlink(self.public)
            self.inode = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def _address_host(addr: object) -> str:
    return str(addr[0]) if isinstance(addr, tuple) and addr else "?"


def _tls_identity(cert: Mapping[str, object] | None, addr: object) -> TlsPeer:
    host, port = (addr[0], addr[1]) if isinstance(addr, tuple) and len(addr) >= 2 else ("?", 0)
    address = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    # getpeercert() is empty or None unless a certificate was presented *and* verified.
    if not cert:
        return TlsPeer(address=address, client_cert=False)
    subject = cert.get("subject", ())
    sans = cert.get("subjectAltName", ())
    cn = next((str(value) for rdn in subject for attr, value in rdn if attr == "commonName"), "") \
        if isinstance(subject, tuple) else ""
    names = tuple(f"{kind}:{value}" for kind, value in sans) if isinstance(sans, tuple) else ()
    return TlsPeer(address=address, client_cert=True, common_name=cn, names=names)


def _make_dirs(path: str) -> None:
    # 0755 whatever the umask: clients of other users must reach the socket inside.
    if os.path.isdir(path):
        return
    _make_dirs(os.path.dirname(path))
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
        os.chmod(path, 0o755)  # noqa: S103


def _lock(path: str) -> int:
    # Held for the front's life: two agents started together cannot both decide the socket is stale.
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise TransportError(f"{path}: {reason(exc)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise SocketInUseError(f"{path}: another memtopo agent holds this socket's lock") from None
    return fd


def ensure_socket_free(path: str) -> None:
    """Raise :class:`SocketInUseError` when a live agent holds the lock of the socket at ``path``.
    A check before start-up, for a clear message; the lock taken when listening is what guards."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return  # no lock file (or unreadable): listening will tell
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise SocketInUseError(f"{path}: another memtopo agent is running on this socket "
                               f"(it holds {path}.lock); stop it first") from None
    finally:
        os.close(fd)


def _remove_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TransportError(f"{path}: {reason(exc)}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise TransportError(f"{path}: exists and is not a socket; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listens: left behind by an agent that died
    except OSError as exc:
        raise TransportError(f"{path}: cannot tell whether it is in use: {reason(exc)}") from None
    else:
        raise SocketInUseError(f"{path}: another process is listening on it")
    finally:
        probe.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise TransportError(f"{path}: cannot remove the stale socket: {reason(exc)}") from None


# ---- the Unix pump --------------------------------------------------------------------------------


class _PipePool:
    """Pipes for splice, shared by all connections of the pump thread. A flow holds a pipe only
    while bytes wait in it (its destination is not reading); every other time the pipe goes back
    here. So a connection costs two descriptors, and the 1 MiB pipes count against the per-user
    pipe quota (pipe-user-pages-soft, 64 MiB) only for the few flows that are blocked."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._free: list[tuple[int, int]] = []

    def get(self) -> tuple[int, int]:
        if self._free:
            return self._free.pop()
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Over the quota the default size still works, only with more round trips.
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        return r, w

    def put(self, pipe: tuple[int, int]) -> None:
        """Take back an *empty* pipe."""
        if len(self._free) < self._keep:
            self._free.append(pipe)
        else:
            _close_pipe(pipe)

    def close(self) -> None:
        for pipe in self._free:
            _close_pipe(pipe)
        self._free.clear()


def _close_pipe(pipe: tuple[int, int]) -> None:
    os.close(pipe[0])
    os.close(pipe[1])


class _Flow:
    """One direction of a connection: src → pipe → dst. ``pending`` bytes sit in ``pipe``.

    One read and one write per readiness event, no read-until-EAGAIN: the 1 MiB pipe takes all
    that is queued at once, and level-triggered epoll reports whatever arrives after."""

    __slots__ = ("dst", "dst_fd", "eof", "pending", "pipe", "pool", "src_fd")

    def __init__(self, src: socket.socket, dst: socket.socket, pool: _PipePool) -> None:
        self.src_fd = src.fileno()
        self.dst = dst
        self.dst_fd = dst.fileno()
        self.pool = pool
        self.pipe: tuple[int, int] | None = None
        self.pending = 0
        self.eof = False

    def fill(self) -> None:
        """src → pipe (only when nothing is pending: the pipe is the buffer), then on to dst."""
        if self.pending or self.eof:
            return
        self.pipe = self.pool.get()
        try:
            n = os.splice(self.src_fd, self.pipe[1], PIPE_BYTES, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            n = -1
        if n <= 0:
            self.pool.put(self.pipe)
            self.pipe = None
            if n == 0:
                self.eof = True
                with contextlib.suppress(OSError):
                    self.dst.shutdown(socket.SHUT_WR)
            return
        self.pending = n
        self.drain()

    def drain(self) -> None:
        """pipe → dst. OSError (reset, broken pipe) ends the connection."""
        if not self.pending or self.pipe is None:
            return
        try:
            n = os.splice(self.pipe[0], self.dst_fd, self.pending, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            return
        if n == 0:
            raise OSError(errno.EPIPE, "splice wrote nothing")
        self.pending -= n
        if not self.pending:
            self.pool.put(self.pipe)
            self.pipe = None

    def close(self) -> None:
        if self.pipe is not None:  # may hold bytes: not for reuse
            _close_pipe(self.pipe)
            self.pipe = None


class _Pair:
    __slots__ = ("client", "client_fd", "key", "last", "masks", "privileged", "to_client", "to_upstream", "uid",
                 "upstream", "upstream_fd")

    def __init__(self, key: str, client: socket.socket, upstream: socket.socket, pool: _PipePool,
                 uid: int, privileged: bool) -> None:
        self.key = key
        self.uid = uid
        self.privileged = privileged
        self.last = time.monotonic()  # of the last byte moved
        self.client = client
        self.client_fd = client.fileno()
        self.upstream = upstream
        self.upstream_fd = upstream.fileno()
        self.to_upstream = _Flow(client, upstream, pool)
        self.to_client = _Flow(upstream, client, pool)
        # fd → the epoll mask it is registered with (absent = not registered).
        self.masks: dict[int, int] = {}

    @property
    def finished(self) -> bool:
        up, down = self.to_upstream, self.to_client
        return up.eof and down.eof and not up.pending and not down.pending


class _Pump:
    """One thread accepts on every listener. Unix connections: their peer is recorded and the
    bytes relayed by this thread with splice. TLS connections: each gets a thread (_TlsConnection)."""

    def __init__(self, unix: socket.socket | None, tcp: list[tuple[socket.socket, ssl.SSLContext]],
                 upstream_path: str, limits: ConnectionLimits, apply_group: str | None = None,
                 observer: ConnectionObserver | None = None) -> None:
        self._unix = unix
        self._tcp = {sock.fileno(): (sock, ctx) for sock, ctx in tcp}
        self._upstream_path = upstream_path
        self._limits = limits
        self._apply_group = apply_group
        self._observer = observer
        self._by_uid: dict[int, int] = {}  # open Unix connections per uid
        self._unprivileged = 0  # open connections of peers that may not apply (TLS included)
        self._refusals = Throttle()
        self._last_sweep = time.monotonic()
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._pairs: dict[int, _Pair] = {}  # both fds of a pair → the pair
        self._pipes = _PipePool()
        self._tls: set[_TlsConnection] = set()
        self._tls_lock = threading.Lock()
        self._accepting = True
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="memtopo-front", daemon=True)

    @property
    def connections(self) -> int:
        return len(self._pairs) // 2 + len(self._tls)

    def _listeners(self) -> list[socket.socket]:
        return ([self._unix] if self._unix is not None else []) + [sock for sock, _ in self._tcp.values()]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        for sock in self._listeners():
            sock.setblocking(False)
            self._epoll.register(sock.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self.wake()
        self._thread.join()
        with self._tls_lock:
            tls = list(self._tls)
        for conn in tls:
            conn.abort()
        for conn in tls:
            conn.join(5.0)

    def wake(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(OSError):  # the thread may be closing the eventfd right now
                os.eventfd_write(self._wake, 1)

    def tls_done(self, conn: _TlsConnection) -> None:
        with self._tls_lock:
            if conn in self._tls:
                self._unprivileged -= 1
            self._tls.discard(conn)
        if not self._accepting:
            self.wake()  # a descriptor is free again

    def _run(self) -> None:
        unix_fd = self._unix.fileno() if self._unix is not None else -1
        try:
            idle = self._limits.idle_seconds
            # Idle connections are looked for a few times per idle period (at least once a second).
            sweep = None if idle is None else min(1.0, idle / 4)
            while not self._stopping:
                timeout = -1.0 if sweep is None or not self._pairs else sweep
                for fd, events in self._epoll.poll(timeout):
                    if fd == unix_fd:
                        self._accept(self._unix, None)
                    elif fd in self._tcp:
                        self._accept(*self._tcp[fd])
                    elif fd == self._wake:
                        os.eventfd_read(self._wake)
                        self._set_accepting(True)
                    else:
                        self._service(fd, events)
                if idle is not None and self._pairs:
                    self._close_idle(idle)
        except Exception:
            # A bug here would silently stop every client: say so before the thread ends.
            log.exception("front_failed")
        finally:
            for pair in {id(p): p for p in self._pairs.values()}.values():
                self._close(pair)
            for sock in self._listeners():
                sock.close()
            self._pipes.close()
            self._epoll.close()
            os.close(self._wake)

    def _accept(self, listener: socket.socket | None, tls: ssl.SSLContext | None) -> None:
        assert listener is not None
        while True:
            try:
                conn, addr = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: stop listening until a connection closes, rather than
                    # spin on a listener that stays readable.
                    log.warning("accept_paused", error=reason(exc))
                    self._set_accepting(False)
                    return
                continue  # ECONNABORTED and the like: that client is gone
            if tls is not None:
                refused = self._admit(None, False)
                if refused:
                    self._refuse(conn, refused, f"tcp:{_address_host(addr)}")
                    continue
                thread = _TlsConnection(self, conn, addr, tls, self._upstream_path)
                with self._tls_lock:
                    self._tls.add(thread)
                    self._unprivileged += 1
                thread.start()
                continue
            try:
                cred = socket_peer_cred(conn)
            except OSError as exc:
                log.warning("connection_setup_failed", error=reason(exc))
                conn.close()
                continue
            privileged = _authorize_local(cred, self._apply_group) is None
            refused = self._admit(cred.uid, privileged)
            if refused:
                self._refuse(conn, refused, f"uid:{cred.uid}")
                continue
            try:
                self._open(conn, cred, privileged)
            except OSError as exc:
                log.warning("connection_setup_failed", error=reason(exc))
                conn.close()

    def _admit(self, uid: int | None, privileged: bool) -> str:
        """"" when a connection of ``uid`` (None: a TCP peer) may open, else the limit it hits."""
        if uid == 0:
            return ""
        lim = self._limits
        if self.connections >= lim.max_connections:
            return "max_connections"
        if uid is not None and lim.per_user is not None and self._by_uid.get(uid, 0) >= lim.per_user:
            return "per_user"
        if not privileged and self._unprivileged >= lim.max_connections - lim.reserved:
            return "reserved"
        return ""

    def _refuse(self, conn: socket.socket, limit: str, who: str) -> None:
        conn.close()
        if self._observer is not None:
            self._observer("refused", limit)
        held_back = self._refusals.allow(f"{who}:{limit}")
        if held_back is not None:  # one event per peer and limit per minute: the metric counts all
            lim = self._limits
            log.warning("connection_refused", reason=limit, peer=who, refused_since_last=held_back,
                        max_connections=lim.max_connections, per_user=lim.per_user, reserved=lim.reserved)

    def _close_idle(self, idle: float) -> None:
        now = time.monotonic()
        if now - self._last_sweep < min(1.0, idle / 4):
            return
        self._last_sweep = now
        stale = [p for fd, p in self._pairs.items() if fd == p.client_fd and now - p.last > idle]
        for pair in stale:
            self._close(pair)
            if self._observer is not None:
                self._observer("idle_closed", "")
        if stale:
            log.debug("idle_connections_closed", count=len(stale), idle_seconds=idle)

    def _open(self, conn: socket.socket, cred: PeerCred, privileged: bool) -> None:
        name, key = _new_peer_name(f"u{cred.uid}.p{cred.pid}")
        # Recorded before connecting: grpc may run the first RPC as soon as the connection exists.
        _PEERS[key] = cred
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.bind("\0" + name)
            up.settimeout(UPSTREAM_CONNECT_TIMEOUT)
            up.connect(self._upstream_path)
            up.setblocking(False)
            conn.setblocking(False)
            pair = _Pair(key, conn, up, self._pipes, cred.uid, privileged)
        except BaseException:
            _PEERS.pop(key, None)
            up.close()
            raise
        self._pairs[conn.fileno()] = pair
        self._pairs[up.fileno()] = pair
        self._by_uid[cred.uid] = self._by_uid.get(cred.uid, 0) + 1
        if not privileged:
            self._unprivileged += 1
        self._rearm(pair)

    def _service(self, fd: int, events: int) -> None:
        pair = self._pairs.get(fd)
        if pair is None:
            return  # closed earlier in this batch of events
        if fd == pair.client_fd:
            inbound, outbound = pair.to_upstream, pair.to_client
        else:
            inbound, outbound = pair.to_client, pair.to_upstream
        pair.last = time.monotonic()
        try:
            if events & _READ_EVENTS:
                inbound.fill()
            if events & _WRITE_EVENTS:
                outbound.drain()
        except OSError:
            self._close(pair)
            return
        if pair.finished:
            self._close(pair)
        else:
            self._rearm(pair)

    def _rearm(self, pair: _Pair) -> None:
        # Read a side only while its pipe is empty; wait for writability only with bytes to
        # write. An fd wanting nothing leaves epoll: its EPOLLHUP would otherwise be reported on
        # every wait.
        up, down = pair.to_upstream, pair.to_client
        self._set_mask(pair, pair.client_fd, (0 if up.eof or up.pending else select.EPOLLIN)
                       | (select.EPOLLOUT if down.pending else 0))
        self._set_mask(pair, pair.upstream_fd, (0 if down.eof or down.pending else select.EPOLLIN)
                       | (select.EPOLLOUT if up.pending else 0))

    def _set_mask(self, pair: _Pair, fd: int, mask: int) -> None:
        old = pair.masks.get(fd, 0)
        if mask == old:
            return
        if not mask:
            self._epoll.unregister(fd)
            del pair.masks[fd]
        elif not old:
            self._epoll.register(fd, mask)
            pair.masks[fd] = mask
        else:
            self._epoll.modify(fd, mask)
            pair.masks[fd] = mask

    def _close(self, pair: _Pair) -> None:
        if self._pairs.get(pair.client_fd) is not pair:
            return  # already closed
        _PEERS.pop(pair.key, None)
        left = self._by_uid.get(pair.uid, 0) - 1
        if left > 0:
            self._by_uid[pair.uid] = left
        else:
            self._by_uid.pop(pair.uid, None)
        if not pair.privileged:
            self._unprivileged -= 1
        for fd in list(pair.masks):
            self._epoll.unregister(fd)
        pair.masks.clear()
        for sock in (pair.client, pair.upstream):
            self._pairs.pop(sock.fileno(), None)
            sock.close()
        pair.to_upstream.close()
        pair.to_client.close()
        if not self._accepting:
            self._set_accepting(True)

    def _set_accepting(self, on: bool) -> None:
        if on == self._accepting:
            return
        self._accepting = on
        for sock in self._listeners():
            if on:
                self._epoll.register(sock.fileno(), select.EPOLLIN)
            else:
                self._epoll.unregister(sock.fileno())


class _TlsConnection(threading.Thread):
    """One TLS client: handshake, then relay with blocking calls in C (ssl and socket release the
    GIL), both directions in this one thread because an SSL object must not be read and written
    from two threads at once."""

    def __init__(self, pump: _Pump, conn: socket.socket, addr: object, ctx: ssl.SSLContext,
                 upstream_path: str) -> None:
        super().__init__(name="memtopo-tls", daemon=True)
        self._pump = pump
        self._conn = conn
        self._addr = addr
        self._ctx = ctx
        self._upstream_path = upstream_path
        self._tls: ssl.SSLSocket | None = None
        self._upstream: socket.socket | None = None

    def abort(self) -> None:
        """Wake the thread out of any blocking call (stop)."""
        for sock in (self._tls or self._conn, self._upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    # The plain socket's shutdown: SSLSocket.shutdown would drop the SSL object
                    # under the relay's feet.
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def run(self) -> None:
        key = ""
        try:
            # grpc writes small frames (headers, window updates) and waits for answers: Nagle
            # would hold them for the peer's delayed ACK (40 ms a call).
            self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn.settimeout(TLS_HANDSHAKE_TIMEOUT)
            tls = self._tls = self._ctx.wrap_socket(self._conn, server_side=True, do_handshake_on_connect=False)
            tls.do_handshake()
            tls.settimeout(None)
            ident = _tls_identity(tls.getpeercert(), self._addr)
            name, key = _new_peer_name("tls")
            _PEERS[key] = ident
            up = self._upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            up.bind("\0" + name)
            up.settimeout(UPSTREAM_CONNECT_TIMEOUT)
            try:
                up.connect(self._upstream_path)
            except OSError as exc:
                log.warning("connection_setup_failed", peer=ident.address, error=reason(exc))
                return
            up.settimeout(None)
            _relay_tls(tls, up)
        except (OSError, ValueError):
            pass  # handshake refused or connection broken (ssl.SSLError is an OSError)
        finally:
            _PEERS.pop(key, None)
            for sock in (self._tls, self._conn, self._upstream):
                if sock is not None:
                    sock.close()
            self._pump.tls_done(self)


def _relay_tls(tls: ssl.SSLSocket, up: socket.socket) -> None:
    poll = select.poll()
    poll.register(tls, select.POLLIN)
    poll.register(up, select.POLLIN)
    client_open = True
    while True:
        # Decrypted bytes may already sit in the SSL object, invisible to poll.
        ready = {tls.fileno()} if client_open and tls.pending() else {fd for fd, _ in poll.poll()}
        if client_open and tls.fileno() in ready:
            data = tls.recv(_TLS_CHUNK)
            if data:
                up.sendall(data)
            else:
                client_open = False
                poll.unregister(tls)
                up.shutdown(socket.SHUT_WR)
        if up.fileno() in ready:
            data = up.recv(_UPSTREAM_CHUNK)
            if not data:
                return  # grpc closed the connection
            tls.sendall(data)
