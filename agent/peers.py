"""Who is calling the agent, and whether they may change the host or open one more connection.

The front's relay (agent/relay.py) records each relayed connection's peer under the abstract socket
name it binds upstream; grpc reports that name as ``context.peer()``, so servicers look the caller
up here. The name is only a key into the table, never parsed: nothing a client sends can claim an
identity, and a peer missing from the table is refused wherever an identity is needed.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import grp
import os
import secrets
import socket
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from memtopo.text import shorten

# Linux ≥ 4.13; Python's socket module does not name it.
SO_PEERGROUPS: Final = getattr(socket, "SO_PEERGROUPS", 59)
# Python's getsockopt allows at most 1024 bytes (256 groups); NGROUPS_MAX is 65536.
_GROUPS_FIRST_BYTES: Final = 1024
_GROUPS_MAX_BYTES: Final = 65536 * 4
# A local connection costs two descriptors (plus a pipe while its reader lags); a TLS one a thread.
DEFAULT_MAX_CONNECTIONS: Final = 128
# (gid_t) -1 means "no change" to chown(2); larger does not fit gid_t.
_NO_ID: Final = 2**32 - 1


class TransportError(Exception):
    """A listener or credential that cannot be set up (bad path, group, address, certificate)."""


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


# context.peer() → who is behind it. Written by the relay (its thread, TLS threads), read by
# servicers; single dict operations are atomic under the GIL.
_PEERS: dict[str, PeerCred | TlsPeer] = {}


def new_peer_name(tag: str) -> tuple[str, str]:
    """(abstract socket name without the leading NUL, the peer string grpc will report for it).

    Random per connection: abstract names are visible to every local user (/proc/net/unix), and a
    predictable next name could be bound first to make the front drop that connection. Only
    ``[a-z0-9.]``, which grpc does not percent-escape in a peer string."""
    name = f"memtopo.{secrets.token_hex(8)}.{tag}"
    return name, f"unix-abstract:{name}"


def record(key: str, ident: PeerCred | TlsPeer) -> None:
    """Before the upstream connection exists: grpc may run the first RPC as soon as it does."""
    _PEERS[key] = ident


def forget(key: str) -> None:
    _PEERS.pop(key, None)


# ---- identity ------------------------------------------------------------------------------------


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
            raise TransportError(f"group {shorten(group)!r} is not a valid gid (0-{_NO_ID - 1})")
        return gid
    try:
        return grp.getgrnam(group).gr_gid
    except (KeyError, ValueError):  # ValueError: an embedded NUL
        raise TransportError(f"group {group!r} does not exist on this host") from None


def tls_identity(cert: Mapping[str, object] | None, addr: object) -> TlsPeer:
    """A TLS peer from ``ssl.SSLSocket.getpeercert()`` and its address."""
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


# ---- authorization -------------------------------------------------------------------------------


def authorize_apply(context: PeerContext, allowed_group: str | None) -> str | None:
    """None when the caller may change the host (ApplyPlan), else the reason it may not.

    Unix socket: uid 0, or ``allowed_group`` is the peer's primary or a supplementary group.
    TCP: a client certificate that verified against the client CA. Anything else is refused,
    including a peer this module did not identify (fails closed)."""
    peer = context.peer()
    ident = _PEERS.get(peer)
    if isinstance(ident, PeerCred):
        return authorize_local(ident, allowed_group)
    if isinstance(ident, TlsPeer):
        if ident.client_cert:
            return None
        return f"TCP peer {ident.address} presented no client certificate: ApplyPlan over TCP needs mutual TLS"
    if peer.startswith(("ipv4:", "ipv6:")):
        return _authorize_native_tcp(peer, context)
    return f"unidentified peer {peer!r}: ApplyPlan needs the agent's Unix socket or mutual TLS"


def authorize_local(cred: PeerCred, allowed_group: str | None) -> str | None:
    """:func:`authorize_apply` for a Unix-socket peer's credentials."""
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


# ---- connection caps -----------------------------------------------------------------------------


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


class Admission:
    """The open connections counted against :class:`ConnectionLimits`. ``uid`` None is a TCP peer
    (no per-user count). Locked: the relay thread opens and closes, TLS threads close their own."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open = 0
        self._by_uid: dict[int, int] = {}
        self._unprivileged = 0  # open connections of peers that may not apply (TLS included)

    def admit(self, uid: int | None, privileged: bool) -> str:
        """"" when the connection is counted as open, else the limit it hits (nothing counted)."""
        lim = self.limits
        with self._lock:
            if uid != 0:
                if self._open >= lim.max_connections:
                    return "max_connections"
                if uid is not None and lim.per_user is not None and self._by_uid.get(uid, 0) >= lim.per_user:
                    return "per_user"
                if not privileged and self._unprivileged >= lim.max_connections - lim.reserved:
                    return "reserved"
            self._count(uid, privileged, 1)
            return ""

    def release(self, uid: int | None, privileged: bool) -> None:
        with self._lock:
            self._count(uid, privileged, -1)

    def _count(self, uid: int | None, privileged: bool, step: int) -> None:
        self._open += step
        if not privileged:
            self._unprivileged += step
        if uid is not None:
            left = self._by_uid.get(uid, 0) + step
            if left > 0:
                self._by_uid[uid] = left
            else:
                self._by_uid.pop(uid, None)
