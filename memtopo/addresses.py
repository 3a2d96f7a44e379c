"""Network addresses as memtopo's configs and command lines take them: ``host:port``, ``[v6]:port``,
``unix:PATH``; whether traffic to one stays on this host; and whether a server could listen on them."""

from __future__ import annotations

import ipaddress
import re

from memtopo.text import shorten


class AddressError(ValueError):
    """A network address that is not ``host:port``."""


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def is_host_name(host: str) -> bool:
    """Whether ``host`` is a DNS name (labels of letters, digits and inner hyphens, at most 253 chars)."""
    return len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in host.removesuffix(".").split("."))


def parse_host_port(s: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host without brackets, port 0-65535). A host is an IPv4 or
    IPv6 address or a DNS name; unbracketed IPv6 is refused because its last group reads as a port."""
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise AddressError(f"{shorten(s)}: expected [IPv6]:PORT")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"{shorten(s)}: {shorten(host)} is not an IPv6 address") from None
    else:
        host, sep, port_text = s.rpartition(":")
        if not sep:
            raise AddressError(f"{shorten(s)}: expected HOST:PORT")
        if ":" in host:
            raise AddressError(f"{shorten(s)}: an IPv6 address needs brackets: [{host}]:{port_text}")
        if not host:
            raise AddressError(f"{shorten(s)}: no host (0.0.0.0:PORT or [::]:PORT for every interface)")
        if not is_host_name(host):
            raise AddressError(f"{shorten(s)}: {shorten(host)} is not a host name or address")
    # isdecimal() also takes other scripts' digits, which int() would accept.
    if not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5) or int(port_text) > 65535:
        raise AddressError(f"{shorten(s)}: port {shorten(port_text)} is not a number 0-65535")
    return host, int(port_text)


def is_loopback(address: str) -> bool:
    """Whether traffic to ``address`` stays on this host: ``unix:`` targets, ``localhost``,
    127.0.0.0/8 and ::1 (also IPv4-mapped), with or without a port. Other names are not resolved:
    a name can point anywhere, so it is not loopback."""
    if address.startswith("unix:"):
        return True
    try:
        host, _ = parse_host_port(address)
    except AddressError:
        host = address[1:-1] if address.startswith("[") and address.endswith("]") else address
    if host.lower().removesuffix(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback
