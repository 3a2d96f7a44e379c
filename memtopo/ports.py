"""Whether a server could listen where it is told to, asked before it starts any listener: the one
ground-floor piece that binds sockets to find out (the address grammar itself is ``memtopo.addresses``)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from memtopo.addresses import parse_host_port
from memtopo.text import shorten


class AddressInUseError(OSError):
    """A listen address that cannot be bound now; ``key`` is the option or config key that named it."""

    def __init__(self, key: str, address: str, reason: str) -> None:
        super().__init__(f"{shorten(address)}: {reason}")
        self.key = key
        self.address = address
        self.reason = reason


def check_free(addresses: Mapping[str, str]) -> None:
    """Bind and listen on every TCP ``host:port`` in ``addresses`` (key → address) at once, then let
    them go: a server that starts several listeners learns before it starts any that one is taken
    (by another process, or twice in its own list) or not this host's. Port 0 and ``unix:`` paths
    are skipped. AddressInUseError names the first that cannot be had; AddressError a malformed one."""
    held: list[socket.socket] = []
    seen: dict[tuple[str, int], str] = {}
    try:
        for key, address in addresses.items():
            if not address or address.startswith("unix:"):
                continue
            host, port = parse_host_port(address)
            if port == 0:
                continue
            try:
                found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
                # IPv4 first, as the servers bind a name such as localhost.
                family, kind, proto, _, where = min(found, key=lambda f: f[0] != socket.AF_INET)
            except (OSError, UnicodeError) as exc:
                raise AddressInUseError(key, address, f"cannot resolve {shorten(host)}: {exc}") from None
            first = seen.setdefault((str(where[0]), port), key)
            if first != key:
                raise AddressInUseError(key, address, f"also given as {first}; each listener needs its own")
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            # As the servers bind (SO_REUSEADDR): a port in TIME_WAIT is free to them, and so to this.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(where)
                sock.listen(1)
            except OSError as exc:
                raise AddressInUseError(key, address, (exc.strerror or str(exc)).lower()) from None
    finally:
        for sock in held:
            sock.close()
