"""Real agent and controller processes for the agent benchmarks (bench/rpc.py, watch.py, footprint.py).

The same shape as tests/agent/test_agent_e2e.py: ``memtopo serve`` (``python -m agent.cli``) on a captured
root with a TOML config written to a temporary directory, ready when ``/readyz`` says 200; the
reference controller as ``memtopo controller serve`` on a free loopback port, ready when
grpc.health answers SERVING. Both are stopped with SIGTERM (killed if they do not exit within 30 s).

Every line a process writes is drained on a thread as it arrives: a benchmark that runs hundreds of
changes would otherwise fill the pipe and block the process on its own logging, and the watch
benchmark timestamps the controller's ``snapshot_stored`` lines on arrival (``on_line``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

START_TIMEOUT_S = 120.0  # the first discovery of a 64-node root under load takes a few seconds
STOP_TIMEOUT_S = 30.0
_POLL_S = 0.02

# (arrival time on time.perf_counter, the line without its newline)
LineHook = Callable[[float, str], None]


class ProcessFailedError(RuntimeError):
    """A benchmark process exited early or never became ready; the message carries its output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _Drained:
    """A child process whose combined stdout/stderr is read line by line on a daemon thread."""

    def __init__(self, argv: list[str], env: dict[str, str] | None, on_line: LineHook | None) -> None:
        self.output: list[str] = []
        self._on_line = on_line
        self.proc = subprocess.Popen(argv, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.perf_counter()
            self.output.append(line)
            if self._on_line is not None:
                self._on_line(now, line.rstrip("\n"))

    def check_running(self, what: str) -> None:
        if self.proc.poll() is not None:
            self._reader.join(2)
            raise ProcessFailedError(f"{what} exited with {self.proc.returncode}:\n{''.join(self.output[-40:])}")

    def stop(self) -> int:
        """SIGTERM and wait; a process that does not exit in time is killed (and reported as such)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


@dataclass(frozen=True)
class AgentSpec:
    """What differs between the benchmarks' agents; everything else is the built-in default."""

    root: Path
    node_name: str = "bench-node"
    controller_port: int | None = None
    debounce_seconds: float = 1.0
    heartbeat_seconds: float = 10.0
    log_level: str = "info"
    # Write a cProfile of the agent here when it exits (SIGTERM ends it normally). Python 3.12's
    # cProfile sits on sys.monitoring, so the front's relay thread is in it with the event loop;
    # grpc's C-core threads and Cython internals are not (they show as Context.run / epoll time).
    profile_to: Path | None = None
    # Also listen on ``read.sock`` in the work directory: the readers' socket grpc serves without
    # the front (``listen.read_socket``).
    read_socket: bool = False

    def config_text(self, workdir: Path, health_port: int) -> str:
        # Keys as documented in docs/config.md; udev off because a captured root gets no events.
        ctl = (f'[controller]\naddress = "127.0.0.1:{self.controller_port}"\ninsecure = true\n'
               f'heartbeat_seconds = {self.heartbeat_seconds}\n'
               'backoff_initial_seconds = 0.05\nbackoff_max_seconds = 0.5\n') if self.controller_port else ""
        read = f'read_socket = "{workdir / "read.sock"}"\n' if self.read_socket else ""
        return (f'node_name = "{self.node_name}"\nroot = "{self.root}"\nstate_dir = "{workdir / "state"}"\n'
                f'[listen]\nsocket = "{workdir / "agent.sock"}"\n{read}{ctl}'
                f'[discovery]\ndebounce_seconds = {self.debounce_seconds}\nudev = false\n'
                f'[health]\nlisten = "127.0.0.1:{health_port}"\n'
                f'[log]\nlevel = "{self.log_level}"\nformat = "json"\n')


class AgentProcess:
    """``memtopo serve`` on ``spec.root``; use as a context manager (start on enter, stop on exit)."""

    def __init__(self, spec: AgentSpec, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.workdir = workdir
        self.socket = workdir / "agent.sock"
        self.health_port = free_port()
        self.config = workdir / "agent.toml"
        self._env = env
        self._proc: _Drained | None = None

    @property
    def target(self) -> str:
        """The grpc target of the agent's Unix socket."""
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int:
        assert self._proc is not None, "agent not started"
        return self._proc.pid

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.spec.config_text(self.workdir, self.health_port))
        profile = ["-m", "cProfile", "-o", str(self.spec.profile_to)] if self.spec.profile_to else []
        self._proc = _Drained([sys.executable, *profile, "-m", "memtopo.cli", "serve",
                               "--config", str(self.config)],
                              self._env, None)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.http("/readyz")[0] != 200:
            self._proc.check_running("agent")
            if time.monotonic() > deadline:
                self.stop()
                raise ProcessFailedError(f"agent not ready after {START_TIMEOUT_S:.0f} s:\n"
                                         f"{''.join(self._proc.output[-40:])}")
            time.sleep(_POLL_S)

    def http(self, path: str) -> tuple[int, str]:
        """(status, body) of the health endpoint; status 0 while nothing listens yet."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}{path}", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def events(self, name: str) -> list[dict[str, Any]]:
        """The agent's JSON log events called ``name``, in order."""
        out = []
        for line in list(self._proc.output if self._proc else ()):
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if isinstance(ev, dict) and ev.get("event") == name:
                    out.append(ev)
        return out

    def sighup(self) -> None:
        """What ``systemctl reload`` sends, and what stands in for a udev event on a captured root."""
        os.kill(self.pid, signal.SIGHUP)

    def stop(self) -> int:
        return self._proc.stop() if self._proc is not None else 0

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def stored_generation(line: str) -> int | None:
    """The generation of a controller ``snapshot_stored`` event (logged right after the fleet stored the
    snapshot; one JSON object a line, as the controller logs by default); None for any other line."""
    if '"snapshot_stored"' not in line:
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("event") != "snapshot_stored":
        return None
    generation = event.get("generation")
    return generation if isinstance(generation, int) else None


class ControllerProcess:
    """``memtopo controller serve`` on a free loopback port; context manager like AgentProcess."""

    def __init__(self, on_line: LineHook | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._on_line = on_line
        self._proc: _Drained | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "controller not started"
        return self._proc.pid

    def start(self) -> None:
        # --http '': the default HTTP port is one per machine, and benchmarks run beside other controllers.
        self._proc = _Drained([sys.executable, "-m", "memtopo.cli", "controller", "serve",
                               "--listen", self.address, "--http", ""],
                              None, self._on_line)
        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                self._proc.check_running("controller")
                with contextlib.suppress(grpc.RpcError):
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status \
                            == health_pb2.HealthCheckResponse.SERVING:
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise ProcessFailedError("controller did not become SERVING")
                time.sleep(_POLL_S)

    def stop(self) -> int:
        return self._proc.stop() if self._proc is not None else 0

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# ---- /proc figures of a process (Linux) ----------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (every thread), from /proc/PID/stat, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / CLOCK_TICKS


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (the agent and its discovery helper, with a child of the
    helper while one runs), from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, ()))
    return tree


def pss_kib(pids: list[int]) -> dict[str, int]:
    """Pss, Pss_Anon, Pss_File and Rss of the processes together, in KiB, from /proc/PID/smaps_rollup:
    a page the processes share (the interpreter, libraries, what a fork left unwritten) counts once,
    split between its mappers, where summing RSS would count it in each."""
    total = {"Pss": 0, "Pss_Anon": 0, "Pss_File": 0, "Rss": 0}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a child that ended meanwhile
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in total:
                    total[key] += int(value.split()[0])
    return total


def context_switches(pid: int) -> int:
    """Voluntary context switches summed over the process's threads: how often it woke up to wait."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total
