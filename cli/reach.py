"""What a client command says when its server does not answer: which address it tried, why it could
not connect (no socket there, nothing listening, no permission, TLS), and how to start that server;
gRPC's own text ("failed to connect to all addresses; last error: …") names none of that."""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from memtopo.text import shorten

if TYPE_CHECKING:
    import grpc

AGENT = "agent"
CONTROLLER = "controller"
# How each server is started; the address option is every client command's --addr.
START = {
    AGENT: "start it with `memtopo serve` (as root; `bash tools/run.sh` in a checkout), or give --addr",
    CONTROLLER: "start it with `memtopo controller serve` (or `bash tools/run.sh`, which embeds one), "
                "or give --addr",
}
DETAIL_CHARS = 160
ADDRESS_CHARS = 120  # a Unix socket's path is at most 107 bytes


def rpc_failure(server: str, addr: str, exc: grpc.RpcError) -> str:
    """One line for a failed call to ``server`` (AGENT or CONTROLLER) at ``addr``."""
    import grpc

    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or ""
    where = f"the {server} at {shorten(addr, ADDRESS_CHARS)}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach {where} (UNAVAILABLE): {_why(addr, details)}; {START[server]}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{where} did not answer in time (DEADLINE_EXCEEDED)"
    return f"{where} answered {code.name if code is not None else 'an error'}: {shorten(details, DETAIL_CHARS)}"


def _why(addr: str, details: str) -> str:
    """What gRPC's "failed to connect to all addresses; last error: …" comes down to."""
    last = details.rpartition("last error: ")[2] or details
    if addr.startswith("unix:"):
        path = addr.removeprefix("unix:").removeprefix("//")
        shown = shorten(path, ADDRESS_CHARS)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return f"no socket {shown} (nothing runs there)"
        except OSError as exc:
            return f"{shown}: {exc.strerror or exc}"
        if not stat.S_ISSOCK(st.st_mode):
            return f"{shown} is not a socket"
        if "Permission denied" in last:
            return f"permission denied on {shown} (it is for root and the agent's listen.socket_group)"
        if "Connection refused" in last:
            return f"nothing listens on {shown} (a socket left by a server that stopped)"
    elif "Connection refused" in last:
        return "nothing listens there (connection refused)"
    elif any(word in last.lower() for word in ("handshake", "ssl", "certificate")):
        return f"the TLS handshake failed ({shorten(last.rpartition(': ')[2] or last, DETAIL_CHARS)}; check --tls-ca)"
    return shorten(last.rpartition(": ")[2] or last, DETAIL_CHARS)
