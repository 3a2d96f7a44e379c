"""The front's relay: one thread accepts on every public listener and moves each connection's bytes
to the grpc server's private socket, after recording who the peer is (agent/peers.py).

Unix-socket bytes are moved by that thread with epoll and splice(2) through a pipe per direction:
the kernel moves the pages, the GIL is held only between system calls, and the pipe is the bounded
buffer (a side that stops reading stops the other side being read). TLS is terminated with the ssl
module, one thread per TLS connection (OpenSSL and the sockets run without the GIL)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Final

from memtopo.text import reason
from memtopo.throttle import Throttle

from . import peers
from .logs import get_logger
from .peers import Admission, ConnectionLimits, PeerCred

log = get_logger(component="transport")

# Pipes for splice: 1 MiB (the default pipe-max-size) holds a whole topology answer, so a response
# crosses in one splice each way.
PIPE_BYTES: Final = 1 << 20
# HUP and ERR go to both directions: reading finds EOF, writing finds the error.
_READ_EVENTS: Final = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_WRITE_EVENTS: Final = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR
UPSTREAM_CONNECT_TIMEOUT: Final = 2.0
TLS_HANDSHAKE_TIMEOUT: Final = 10.0
_TLS_CHUNK: Final = 256 * 1024
_UPSTREAM_CHUNK: Final = 1 << 20
_SPLICE_FLAGS: Final = os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE

# Called from the relay thread with what happened: ("refused", limit) or ("idle_closed", "").
ConnectionObserver = Callable[[str, str], None]



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


class Pump:
    """One thread accepts on every listener. Unix connections: their peer is recorded and the
    bytes relayed by this thread with splice. TLS connections: each gets a thread (_TlsConnection).
    ``apply_group`` decides which local peers count as privileged for the reserved connections."""

    def __init__(self, unix: socket.socket | None, tcp: list[tuple[socket.socket, ssl.SSLContext]],
                 upstream_path: str, limits: ConnectionLimits, apply_group: str | None = None,
                 observer: ConnectionObserver | None = None) -> None:
        self._unix = unix
        self._tcp = {sock.fileno(): (sock, ctx) for sock, ctx in tcp}
        self._upstream_path = upstream_path
        self._limits = limits
        self._admission = Admission(limits)
        self._apply_group = apply_group
        self._observer = observer
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
                self._admission.release(None, False)
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
                refused = self._admission.admit(None, False)
                if refused:
                    self._refuse(conn, refused, f"tcp:{_address_host(addr)}")
                    continue
                thread = _TlsConnection(self, conn, addr, tls, self._upstream_path)
                with self._tls_lock:
                    self._tls.add(thread)
                thread.start()
                continue
            try:
                cred = peers.socket_peer_cred(conn)
            except OSError as exc:
                log.warning("connection_setup_failed", error=reason(exc))
                conn.close()
                continue
            privileged = peers.authorize_local(cred, self._apply_group) is None
            refused = self._admission.admit(cred.uid, privileged)
            if refused:
                self._refuse(conn, refused, f"uid:{cred.uid}")
                continue
            try:
                self._open(conn, cred, privileged)
            except OSError as exc:
                self._admission.release(cred.uid, privileged)
                log.warning("connection_setup_failed", error=reason(exc))
                conn.close()

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
        name, key = peers.new_peer_name(f"u{cred.uid}.p{cred.pid}")
        peers.record(key, cred)
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.bind("\0" + name)
            up.settimeout(UPSTREAM_CONNECT_TIMEOUT)
            up.connect(self._upstream_path)
            up.setblocking(False)
            conn.setblocking(False)
            pair = _Pair(key, conn, up, self._pipes, cred.uid, privileged)
        except BaseException:
            peers.forget(key)
            up.close()
            raise
        self._pairs[conn.fileno()] = pair
        self._pairs[up.fileno()] = pair
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
        peers.forget(pair.key)
        self._admission.release(pair.uid, pair.privileged)
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

    def __init__(self, pump: Pump, conn: socket.socket, addr: object, ctx: ssl.SSLContext,
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
            ident = peers.tls_identity(tls.getpeercert(), self._addr)
            name, key = peers.new_peer_name("tls")
            peers.record(key, ident)
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
            peers.forget(key)
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


def _address_host(addr: object) -> str:
    return str(addr[0]) if isinstance(addr, tuple) and addr else "?"
