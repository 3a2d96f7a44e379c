"""TLS material from PEM files, for every listener and client memtopo has: the agent's TCP front,
its controller link and ``memtopo query``, the controller's gRPC and HTTP listeners and its clients.
Every failure is a :class:`TlsError` naming the file and the reason, for the caller to word."""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memtopo.text import reason

if TYPE_CHECKING:
    import grpc


class TlsError(ValueError):
    """A certificate, key or CA that cannot be used."""


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsError(f"TLS {what} {path}: {reason(exc)}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"TLS {what} {path}: not a PEM file")
    return data


def server_context(cert: str, key: str, *, client_ca: str | None = None, tls13_only: bool = False,
                   alpn: Sequence[str] = ()) -> ssl.SSLContext:
    """A server context; with ``client_ca`` a client certificate is requested and verified (a bad one
    fails the handshake) but not required: the caller decides what an unidentified peer may do."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if tls13_only:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"TLS certificate {cert} / key {key}: {reason(exc)}") from None
    if client_ca:
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"TLS client CA {client_ca}: {reason(exc)}") from None
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """grpc's own server TLS; a client CA makes client certificates mandatory (mTLS)."""
    import grpc

    chain = read_pem(cert, "certificate")
    pair = (read_pem(key, "key"), chain)
    ca = read_pem(client_ca, "client CA") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    """TLS for dialing: ``ca`` None = the system roots; ``cert`` and ``key`` together present a client
    certificate (mTLS)."""
    import grpc

    if bool(cert) != bool(key):
        raise TlsError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "CA") if ca else None,
        private_key=read_pem(key, "key") if key else None,
        certificate_chain=read_pem(cert, "certificate") if cert else None)


def client_context(ca: str | None = None) -> ssl.SSLContext:
    """A client context verifying the server against ``ca`` alone (a PEM bundle: a cluster's own CA, not
    the system's roots besides), or the system roots when None."""
    if not ca:
        return ssl.create_default_context()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # hostname checked, certificate required
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"TLS CA {ca}: {reason(exc)}") from None
    return ctx
