"""Another local user holding connections to the agent's sockets: a child interpreter that drops to
its uid before it connects (the suite runs as root), so SO_PEERCRED carries a real uid."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

NOBODY = 65534

HOLD = r"""
import json, os, socket, sys
a = json.loads(sys.argv[1])
os.setgroups(a["groups"]); os.setgid(a["gid"]); os.setuid(a["uid"])
socks = []
for _ in range(a["count"]):
    s = socket.socket(socket.AF_UNIX)
    s.connect(a["path"])
    socks.append(s)

def is_open(s):
    # grpc speaks first (its SETTINGS frame): read what is there; the end of the stream = closed.
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False

def still_open():
    return sum(1 for s in socks if is_open(s))

print("connected", flush=True)
for line in sys.stdin:  # each line asks how many are still open; the end of input lets them go
    print(json.dumps(still_open()), flush=True)
"""


class Holder:
    """A process of another user holding ``count`` raw connections to a Unix socket (a local user
    trying to lock others out). ``open()`` asks it how many the server has left open."""

    def __init__(self, path: str, count: int, *, uid: int = NOBODY, gid: int = NOBODY,
                 groups: Iterable[int] = ()) -> None:
        args = {"path": path, "count": count, "uid": uid, "gid": gid, "groups": list(groups)}
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self._line() == "connected"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else ""
        return line.strip()

    def open(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        return int(self._line())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def settles_at(observe: Callable[[], Any], want: Any, timeout: float = 30.0) -> None:
    """``observe()`` reaches ``want`` and still shows it a moment later. Refusals and closes happen
    as the server gets to them: a busy machine is slower, never different."""
    deadline = time.monotonic() + timeout
    got = observe()
    while time.monotonic() < deadline:
        if got == want:
            time.sleep(0.3)
            got = observe()
            if got == want:
                return
        time.sleep(0.1)
        got = observe()
    raise AssertionError(f"settled at {got!r}, not {want!r}")


