"""agent.sdnotify against real AF_UNIX datagram sockets (a path and an abstract name), read the way
systemd reads them (SO_PASSCRED: the sender's pid is what NotifyAccess=main checks)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.agent.sdnotify import Notifier


class Receiver:
    """A stand-in for systemd's notify socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)
        self.sock.settimeout(5)

    def recv(self) -> tuple[bytes, int]:
        """One datagram and the sender's pid from its SCM_CREDENTIALS."""
        data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        pid = -1
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _uid, _gid = struct.unpack("iII", payload[:12])
        return data, pid

    def pending(self) -> bool:
        self.sock.settimeout(0.05)
        try:
            self.sock.recv(4096)
        except (TimeoutError, BlockingIOError):
            return False
        finally:
            self.sock.settimeout(5)
        return True


@pytest.fixture
def path_receiver(tmp_path: Path) -> Iterator[tuple[Receiver, str]]:
    address = str(tmp_path / "notify")
    r = Receiver(address)
    yield r, address
    r.sock.close()


@pytest.fixture
def abstract_receiver() -> Iterator[tuple[Receiver, str]]:
    name = f"memtopo-test-{uuid.uuid4().hex}"
    r = Receiver("\0" + name)
    yield r, "@" + name
    r.sock.close()


def test_messages_arrive_on_a_path_socket(path_receiver: tuple[Receiver, str]) -> None:
    receiver, address = path_receiver
    n = Notifier.from_environment({"NOTIFY_SOCKET": address})
    assert n.enabled
    assert n.ready("serving generation 1")
    assert receiver.recv() == (b"READY=1\nSTATUS=serving generation 1", os.getpid())
    assert n.status("discovering")
    assert receiver.recv()[0] == b"STATUS=discovering"
    assert n.watchdog()
    assert receiver.recv()[0] == b"WATCHDOG=1"
    assert n.stopping("shutting down")
    assert receiver.recv()[0] == b"STOPPING=1\nSTATUS=shutting down"
    assert n.ready() and receiver.recv()[0] == b"READY=1"
    assert n.notify(EXTEND_TIMEOUT_USEC=5_000_000, RELOADING=True)
    assert receiver.recv()[0] == b"EXTEND_TIMEOUT_USEC=5000000\nRELOADING=1"
    n.close()
    n.close()  # idempotent; the next send opens a new socket
    assert n.watchdog() and receiver.recv()[0] == b"WATCHDOG=1"


def test_messages_arrive_on_an_abstract_socket(abstract_receiver: tuple[Receiver, str]) -> None:
    receiver, address = abstract_receiver
    n = Notifier.from_environment({"NOTIFY_SOCKET": address})
    assert n.address == "\0" + address[1:]
    assert n.ready("up")
    assert receiver.recv() == (b"READY=1\nSTATUS=up", os.getpid())


def test_a_thread_sends_as_the_main_pid(path_receiver: tuple[Receiver, str]) -> None:
    # NotifyAccess=main accepts messages whose sender pid is the main pid; a thread's datagram
    # carries the process id, so watchdog pings from any thread count.
    receiver, address = path_receiver
    n = Notifier.from_environment({"NOTIFY_SOCKET": address})
    t = threading.Thread(target=n.watchdog)
    t.start()
    t.join()
    assert receiver.recv() == (b"WATCHDOG=1", os.getpid())


def test_status_text_stays_on_one_line(path_receiver: tuple[Receiver, str]) -> None:
    receiver, address = path_receiver
    n = Notifier.from_environment({"NOTIFY_SOCKET": address})
    n.ready("line one\nREADY=0\r\nthree")
    data = receiver.recv()[0]
    assert data.split(b"\n") == [b"READY=1", b"STATUS=line one READY=0  three"]


def test_no_socket_means_no_op() -> None:
    n = Notifier.from_environment({})
    assert not n.enabled
    assert n.ready("x") is False and n.watchdog() is False and n.stopping() is False
    assert n.watchdog_interval() is None
    assert n._sock is None  # nothing was opened
    # A bad variable name is a caller bug, reported even when disabled.
    with pytest.raises(ValueError, match="sd_notify variable"):
        n.notify(status="lower-case")


@pytest.mark.parametrize("value", ["vsock:2:1234", "relative/path", "@"])
def test_unsupported_socket_disables_without_raising(value: str) -> None:
    n = Notifier.from_environment({"NOTIFY_SOCKET": value})
    assert not n.enabled and n.ready() is False


def test_send_errors_never_raise(tmp_path: Path) -> None:
    # systemd gone: the socket file is missing, then a file that is not a socket.
    n = Notifier.from_environment({"NOTIFY_SOCKET": str(tmp_path / "gone"), "WATCHDOG_USEC": "1000000"})
    assert n.watchdog() is False
    assert n.watchdog() is False
    (tmp_path / "gone").write_text("not a socket")
    assert n.ready("x") is False
    # It comes back: the address is resolved on every send.
    (tmp_path / "gone").unlink()
    r = Receiver(str(tmp_path / "gone"))
    assert n.watchdog() is True
    assert r.recv()[0] == b"WATCHDOG=1"


def test_full_receiver_does_not_hang(path_receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch) -> None:
    receiver, address = path_receiver
    monkeypatch.setattr("memtopo.agent.sdnotify.SEND_TIMEOUT_S", 0.05)
    n = Notifier.from_environment({"NOTIFY_SOCKET": address})
    # Fill the receiver's queue until a send gives up: it must return False, not block or raise.
    sent = 0
    while n.status("x" * 1000):
        sent += 1
        assert sent < 100_000, "the queue never filled"
    assert sent > 0
    assert receiver.pending()


@pytest.mark.parametrize(("env", "interval"), [
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "abc"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "-5"}, None),
    ({"WATCHDOG_USEC": "30s"}, None),
    ({}, None),
])
def test_watchdog_interval_is_half_the_timeout(env: dict[str, str], interval: float | None) -> None:
    n = Notifier.from_environment({"NOTIFY_SOCKET": "/run/systemd/notify", **env})
    assert n.watchdog_interval() == interval


def test_watchdog_needs_a_notify_socket() -> None:
    assert Notifier.from_environment({"WATCHDOG_USEC": "30000000"}).watchdog_interval() is None


def test_unset_removes_the_variables_from_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier.from_environment(unset=True)
    assert n.enabled and n.watchdog_interval() == 15.0
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(os.environ)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"]),
                       st.text(max_size=30)),
       st.text(max_size=200))
def test_any_environment_and_status_never_raise(env: dict[str, str], status: str) -> None:
    n = Notifier.from_environment(env)
    interval = n.watchdog_interval()
    assert interval is None or interval > 0
    assert n.status(status) in (True, False)
    assert n.watchdog() in (True, False)
    n.close()
