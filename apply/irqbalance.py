"""Living with irqbalance instead of fighting it silently.

A running irqbalance rewrites ``smp_affinity`` of every IRQ it balances each interval, so an IRQ
pinned by a plan would drift back. The engine detects it and, per configuration:

* ``leave``: pins anyway and says in the result that irqbalance may move the IRQs again;
* ``ban``: the runtime form of ``--banirq``: irqbalance's root-only control socket
  (``/run/irqbalance/irqbalance<PID>.sock``) takes ``settings ban irqs <irq> …``. That command
  *replaces* the whole banned list (command-line bans included), so the engine reads the current
  list with ``setup`` first, sends the union, and sends the previous list back on rollback.
  ``IRQBALANCE_BANNED_CPUS``/``_CPULIST`` is not used: it bans CPUs, not IRQs, and needs a restart;
* ``stop``: ``systemctl stop`` of the unit irqbalance runs in (from its cgroup), started again on
  rollback. vLLM-Ascend's CPU binding stops it for good; here it is restored.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from memtopo.apply.errors import ApplyError
from memtopo.apply.host import HostFiles, Procs
from memtopo.hostfs import HostReadError

NAME = "irqbalance"
SOCKET_DIRS = ("run/irqbalance", "var/run/irqbalance")
# Where systemd keeps the unit's processes (v1 name=systemd hierarchy, v2 unified, hybrid).
UNIT_PROCS = tuple(f"{d}/system.slice/irqbalance.service/cgroup.procs"
                   for d in ("sys/fs/cgroup/systemd", "sys/fs/cgroup", "sys/fs/cgroup/unified"))
# irqbalance receives commands into a 500-byte buffer; a longer command is cut.
MAX_COMMAND = 499
TIMEOUT_S = 2.0

_SETUP_IRQ = re.compile(r"\bIRQ (\d+) LOAD\b")


class IrqbalanceError(ApplyError):
    """The control socket could not be reached or did not answer."""


@dataclass(frozen=True)
class Irqbalance:
    pid: int
    starttime: int
    # Root-relative path of its file socket; None when it has only the abstract one.
    socket: str | None
    # The systemd unit whose cgroup it runs in ("irqbalance.service"); None when not under systemd.
    unit: str | None

    def describe(self) -> str:
        return f"irqbalance running (pid {self.pid}{', unit ' + self.unit if self.unit else ''})"


def detect(procs: Procs, files: HostFiles | None = None) -> Irqbalance | None:
    """The running irqbalance. Cheap evidence first (its socket names its pid, systemd's unit
    cgroup lists it), then every process's name: it may run outside systemd (containers)."""
    files = files or procs.files
    candidates: list[int] = []
    for d in SOCKET_DIRS:
        for name in files.listdir(d):
            m = re.fullmatch(r"irqbalance(\d{1,9})\.sock", name)
            if m:
                candidates.append(int(m.group(1)))
    for rel in UNIT_PROCS:
        try:
            candidates.extend(int(p) for p in files.read_text(rel).split() if p.isdigit() and len(p) < 10)
        except HostReadError:
            continue
    for pid in candidates:
        found = _confirm(procs, files, pid)
        if found is not None:
            return found
    for pid in procs.pids():
        # comm, not stat: the kernel formats it cheaply, and this reads every process.
        try:
            if procs.files.read_text(f"proc/{pid}/comm").strip() != NAME:
                continue
        except HostReadError:
            continue
        found = _confirm(procs, files, pid)
        if found is not None:
            return found
    return None


def _confirm(procs: Procs, files: HostFiles, pid: int) -> Irqbalance | None:
    st = procs.stat(pid)
    if st is None or st.comm != NAME:
        return None
    sock = next((f"{d}/irqbalance{pid}.sock" for d in SOCKET_DIRS if files.exists(f"{d}/irqbalance{pid}.sock")), None)
    return Irqbalance(pid, st.starttime, sock, _unit(procs, pid))


def _unit(procs: Procs, pid: int) -> str | None:
    try:
        text = procs.files.read_text(f"proc/{pid}/cgroup")
    except HostReadError:
        return None
    for line in text.split("\n"):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if (hier == "0" and controllers == "") or controllers == "name=systemd":
            leaf = path.rstrip("/").rsplit("/", 1)[-1]
            if leaf.endswith(".service"):
                return leaf
    return None


def parse_setup(reply: str) -> tuple[int, ...]:
    """IRQs banned now, from the ``setup`` reply: ``SLEEP 10 IRQ 43 LOAD 0 DIFF 0 CLASS 0 … BANNED <mask>``."""
    return tuple(sorted({int(n) for n in _SETUP_IRQ.findall(reply) if len(n) < 10}))


def ban_command(irqs: Iterable[int]) -> str:
    ids = sorted(set(irqs))
    # irqbalance's parser stops at a 0, so IRQ 0 can only come first (sorted puts it there).
    cmd = "settings ban irqs " + (" ".join(map(str, ids)) if ids else "NONE")
    if len(cmd) > MAX_COMMAND:
        raise IrqbalanceError(f"ban list of {len(ids)} IRQs is longer than irqbalance's {MAX_COMMAND}-byte command")
    return cmd


class Client:
    """One request per connection, as irqbalance's own UI does. ``address`` is an absolute socket
    path, or an abstract name starting with NUL."""

    def __init__(self, address: str, timeout: float | None = None) -> None:
        self.address = address
        self.timeout = TIMEOUT_S if timeout is None else timeout

    def request(self, command: str, reply: bool) -> str:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout)
                s.connect(self.address)
                s.sendall(command.encode())
                if not reply:
                    return ""
                s.shutdown(socket.SHUT_WR)
                chunks = []
                while chunk := s.recv(65536):
                    chunks.append(chunk)
                return b"".join(chunks).decode("utf-8", "replace")
        except OSError as exc:
            raise IrqbalanceError(f"irqbalance socket {self.address.lstrip(chr(0))}: {exc.strerror or exc}") from exc

    def banned(self) -> tuple[int, ...]:
        return parse_setup(self.request("setup", reply=True))

    def set_banned(self, irqs: Iterable[int]) -> None:
        self.request(ban_command(irqs), reply=False)


def client_for(ib: Irqbalance, files: HostFiles) -> Client:
    if ib.socket is not None:
        return Client(str(files.fs.path(ib.socket)))
    # Abstract sockets are not under any root: only meaningful on the live host.
    return Client(f"\0irqbalance{ib.pid}.sock")
