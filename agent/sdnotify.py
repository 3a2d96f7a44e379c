"""A minimal sd_notify(3) client: one datagram per message, no dependency.

systemd passes ``NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract socket) to a ``Type=notify``
service, and ``WATCHDOG_USEC`` (+ ``WATCHDOG_PID``) when ``WatchdogSec=`` is set. The agent sends
READY=1 once its first discovery is published and its servers listen, WATCHDOG=1 from its main loop,
STATUS= lines, and STOPPING=1 on shutdown.

Nothing here raises on a send failure: systemd being restarted (daemon-reexec) or gone must not take
the agent down. Outside systemd (no NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Mapping
from typing import Final

import structlog

log = structlog.get_logger(__name__)

# Variable names sd_notify(3) and systemd use: upper-case letters, digits and underscores.
_FIELD: Final = re.compile(r"[A-Z_][A-Z0-9_]*")
# A blocked send means systemd is not reading; waiting longer would stall the agent's loop.
SEND_TIMEOUT_S: Final = 1.0


def _address(value: str) -> str | None:
    """NOTIFY_SOCKET as a socket address, or None when this client cannot use it."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


def _watchdog_usec(environ: Mapping[str, str]) -> int | None:
    """The watchdog timeout meant for this process (sd_watchdog_enabled(3)), or None."""
    text = environ.get("WATCHDOG_USEC", "")
    if not (text.isascii() and text.isdigit()) or int(text) == 0:
        return None
    pid_text = environ.get("WATCHDOG_PID")
    # A WATCHDOG_PID naming another process means the variables were inherited, not meant for us.
    if pid_text is not None and (not (pid_text.isascii() and pid_text.isdigit()) or int(pid_text) != os.getpid()):
        return None
    return int(text)


class Notifier:
    """Messages to the service manager. Thread-safe: a datagram send is atomic, and the socket is
    made once under a lock."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        # ``address`` is a filesystem path or "\0name" (abstract); None disables the notifier.
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, *, unset: bool = False) -> Notifier:
        """Built from ``environ`` (default os.environ). ``unset`` removes the variables from
        os.environ, so the tools the agent runs (systemctl, npu-smi) do not inherit them."""
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        address = _address(raw) if raw else None
        if raw and address is None:
            log.warning("sd_notify socket not supported; notifications disabled", notify_socket=raw[:108])
        notifier = cls(address, _watchdog_usec(env))
        if unset:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half the timeout, as sd_watchdog_enabled(3) advises;
        None when systemd runs no watchdog for this process."""
        if self.address is None or self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2_000_000

    def notify(self, **fields: str | int | bool) -> bool:
        """Send ``NAME=value`` lines in one datagram; True when it was sent. Names must be sd_notify
        variable names (``READY``, ``STATUS``, ``EXTEND_TIMEOUT_USEC`` …): a bad one is a caller bug
        and raises ValueError even when the notifier is disabled. Newlines in values become spaces
        (each variable is one line)."""
        lines = []
        for name, value in fields.items():
            if not _FIELD.fullmatch(name):
                raise ValueError(f"not an sd_notify variable name: {name!r}")
            text = ("1" if value else "0") if isinstance(value, bool) else str(value)
            lines.append(f"{name}={text.replace('\r', ' ').replace('\n', ' ')}")
        if self.address is None or not lines:
            return False
        return self._send("\n".join(lines).encode("utf-8", "replace"))

    def ready(self, status: str | None = None) -> bool:
        return self.notify(READY=1, **({"STATUS": status} if status is not None else {}))

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def stopping(self, status: str | None = None) -> bool:
        return self.notify(STOPPING=1, **({"STATUS": status} if status is not None else {}))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _send(self, message: bytes) -> bool:
        assert self.address is not None
        try:
            with self._lock:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    sock.settimeout(SEND_TIMEOUT_S)
                    self._sock = sock
                sock = self._sock
            # sendto (not connect): the address is resolved on every send, so a socket systemd
            # re-created after a re-exec is found again.
            sock.sendto(message, self.address)
        except OSError as exc:
            if not self._failing:
                log.warning("sd_notify send failed", error=str(exc), message=message[:64].decode("utf-8", "replace"))
            self._failing = True
            return False
        if self._failing:
            log.info("sd_notify send works again")
            self._failing = False
        return True
