"""Hostile clients and faults against a real agent process (``memtopo serve`` on a captured root).

The agent runs as a child process with its own config, as under systemd: a hung rescan, garbage
RPCs, a local user holding every connection it can open, hundreds of slow HTTP clients, stalled
watchers, and configurations that cannot work. "Another user" is a child process that drops to
uid 65534 before it connects (the suite runs as root), so SO_PEERCRED carries a real uid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import agent_pb2_grpc
from tests.fixtures import REPO
from tests.test_agent_e2e import _certs, copy_root, free_port, pin_plan, wait_for
from tests.test_agent_transport import Holder, settles_at

# `memtopo serve` with discovery made to hang from its second run on: a probe stuck in the kernel
# (a wedged driver, a hung mount) stands in as a thread that never returns.
HANGING_DISCOVERY = r"""
import sys, threading
import memtopo.agent.daemon, memtopo.discovery.isolated
real, real_argv = memtopo.agent.daemon.discover, memtopo.discovery.isolated.child_argv
runs = []
def discover(ctx):  # discovery on a thread (discovery.isolate = false)
    runs.append(1)
    if len(runs) > 1:
        threading.Event().wait()
    return real(ctx)
def child_argv(root):  # discovery in a child process (the default)
    runs.append(1)
    if len(runs) > 1:
        return [sys.executable, "-c", "import time; time.sleep(3600)  # memtopo-hung-discovery"]
    return real_argv(root)
memtopo.agent.daemon.discover = discover
memtopo.discovery.isolated.child_argv = child_argv
from memtopo.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


class AgentProc:
    """A `memtopo serve` process; ``listen`` and ``discovery`` are extra lines for those tables."""

    def __init__(self, workdir: Path, root: Path, *, listen: str = "", discovery: str = "",
                 script: str | None = None) -> None:
        self.dir = workdir
        self.sock = workdir / "agent.sock"
        self.health_port = free_port()
        self.config = workdir / "agent.toml"
        self.config.write_text(
            f'node_name = "hostile"\nroot = "{root}"\nstate_dir = "{workdir / "state"}"\n'
            f'[listen]\nsocket = "{self.sock}"\n{listen}\n'
            f'[discovery]\nudev = false\n{discovery}\n'
            f'[health]\nlisten = "127.0.0.1:{self.health_port}"\n')
        argv = ["-c", script] if script else ["-m", "memtopo.cli"]
        self.proc = subprocess.Popen([sys.executable, *argv, "serve", "--config", str(self.config)], cwd=REPO,
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.output: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        wait_for(lambda: self.http("/readyz")[0] == 200, what="agent ready")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str) -> float:
        for line in self.http("/metrics")[1].splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {name}")

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in list(self.output):
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if ev.get("event") == name:
                    out.append(ev)
        return out

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def stub(self, ch: grpc.Channel) -> Any:
        return agent_pb2_grpc.NodeAgentStub(ch)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is 0700): they connect to the socket."""
    d = Path(tempfile.mkdtemp(prefix="memtopo-hostile-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return copy_root(tmp_path)


# ---- a rescan that hangs ---------------------------------------------------------------------------


@pytest.mark.parametrize("isolate", ["true", "false"])
def test_a_hung_rescan_is_reported_and_sigterm_still_exits(workdir: Path, root: Path, isolate: str) -> None:
    agent = AgentProc(workdir, root, discovery=f"deadline_seconds = 0.5\ndebounce_seconds = 0\nisolate = {isolate}",
                      script=HANGING_DISCOVERY)
    try:
        assert agent.metric("memtopo_discovery_overdue") == 0
        # A child's start can itself outlast a 0.5 s deadline on a busy machine: count from here.
        overdue_before = agent.metric("memtopo_discoveries_overdue_total")
        agent.proc.send_signal(signal.SIGHUP)  # the rescan that never returns
        _, body = wait_for(lambda: (r := agent.http("/readyz"))[0] == 503 and r, what="readyz 503")
        assert "stale" in json.loads(body)["checks"]["discovery"]
        assert agent.http("/healthz")[0] == 200  # the loop itself is fine
        assert agent.metric("memtopo_discovery_overdue") == 1
        assert agent.metric("memtopo_discoveries_overdue_total") == overdue_before + 1
        wait_for(lambda: agent.events("discovery_overdue"), what="discovery_overdue event")
        with grpc.insecure_channel(f"unix://{agent.sock}") as ch:  # still serving the last topology
            assert agent.stub(ch).GetTopology(apb.GetTopologyRequest(), timeout=10).generation == 1
    finally:
        rc = agent.stop(timeout=60)
    assert rc == 0
    assert agent.events("agent_stopped")
    assert not hung_discovery_children()  # a child process is killed at the stop, not left behind


def hung_discovery_children() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if b"memtopo-hung-discovery" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
    return found


def test_sigterm_exits_while_a_rescan_hangs(workdir: Path, root: Path) -> None:
    # Default deadline: the stop must not wait for the rescan, reported overdue or not.
    agent = AgentProc(workdir, root, discovery="debounce_seconds = 0", script=HANGING_DISCOVERY)
    try:
        agent.proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)  # the rescan thread is inside discover() by now (or soon: either way it hangs)
    finally:
        rc = agent.stop(timeout=60)  # the unit's TimeoutStopSec is 30
    assert rc == 0


# A stop step that never ends (an in-flight plan stuck in a tool), and a short stop deadline.
HANGING_STOP = r"""
import asyncio, sys
import memtopo.agent.daemon, memtopo.agent.node_service
memtopo.agent.daemon.STOP_DEADLINE_SECONDS = 2.0
async def drain(self):
    await asyncio.Event().wait()
memtopo.agent.node_service.PlanRunner.drain = drain
from memtopo.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_stop_that_overruns_its_deadline_ends_the_process(workdir: Path, root: Path) -> None:
    agent = AgentProc(workdir, root, script=HANGING_STOP)
    rc = agent.stop(timeout=60)
    assert rc == 1  # not a clean stop: systemd's Restart=on-failure may start it again
    wait_for(lambda: agent.events("agent_stop_overrun"), what="agent_stop_overrun event")
    assert not agent.events("agent_stopped")


# ---- garbage requests ------------------------------------------------------------------------------


def test_undecodable_requests_are_counted_and_logged_once_per_peer(workdir: Path, root: Path) -> None:
    agent = AgentProc(workdir, root)
    try:
        garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length beyond the message
        with grpc.insecure_channel(f"unix://{agent.sock}") as ch:
            call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary("/memtopo.v1.NodeAgent/GetTopology")
            for _ in range(200):
                with pytest.raises(grpc.RpcError) as info:
                    call(garbage, timeout=10)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # The agent still answers a real request on the same connection.
            assert agent.stub(ch).GetTopology(apb.GetTopologyRequest(), timeout=10).generation == 1
        assert agent.metric('memtopo_grpc_undecodable_requests_total{method="/memtopo.v1.NodeAgent/GetTopology"}') \
            == 200
    finally:
        agent.stop()
    logged = [line for line in agent.output if "undecodable" in line or "deserializ" in line]
    assert len(logged) == 1, logged[:3]
    assert json.loads(logged[0])["peer"] == "uid:0"
    assert not any("Traceback" in line for line in agent.output)


# ---- connection lockout ----------------------------------------------------------------------------


def test_another_user_cannot_lock_root_out(workdir: Path, root: Path) -> None:
    agent = AgentProc(workdir, root, listen='socket_mode = "0666"')
    hog = Holder(str(agent.sock), 130)
    try:
        settles_at(hog.open, 16)  # listen.max_connections_per_user
        with grpc.insecure_channel(f"unix://{agent.sock}") as ch:
            stub = agent.stub(ch)
            assert stub.GetTopology(apb.GetTopologyRequest(), timeout=10).generation == 1
            plan = pin_plan("lockout", os.getpid(), [0])
            res = stub.ApplyPlan(apb.ApplyPlanRequest(plan=plan, dry_run=True), timeout=30)
            assert res.plan_id == "lockout"
        assert agent.metric('memtopo_connections_refused_total{reason="per_user"}') == 130 - 16
        wait_for(lambda: agent.events("connection_refused"), what="connection_refused event")
        assert len(agent.events("connection_refused")) == 1  # one event, the metric counts the rest
    finally:
        hog.close()
        agent.stop()


def test_the_read_socket_is_capped_apart_from_the_relayed_socket(workdir: Path, root: Path) -> None:
    # Peers of the read socket are not identified: a cap of its own, which never takes a slot of
    # the relayed socket (root's calls there still work with the read socket full).
    agent = AgentProc(workdir, root, listen='socket_mode = "0666"\nmax_connections = 8\nreserved_connections = 1')
    hog = Holder(str(workdir / "agent-read.sock"), 20)
    try:
        settles_at(hog.open, 8)
        with grpc.insecure_channel(f"unix://{agent.sock}") as ch:
            assert agent.stub(ch).GetTopology(apb.GetTopologyRequest(), timeout=10).generation == 1
    finally:
        hog.close()
        agent.stop()


def test_idle_connections_are_closed(workdir: Path, root: Path) -> None:
    agent = AgentProc(workdir, root, listen='socket_mode = "0666"\nidle_seconds = 2')
    hog = Holder(str(agent.sock), 10)
    try:
        # Each closed after 2 s without traffic: by the front's sweep (counted in
        # memtopo_connections_idle_closed_total) or by grpc's own idle GOAWAY, whichever comes first.
        settles_at(hog.open, 0, timeout=60)
        with grpc.insecure_channel(f"unix://{agent.sock}") as ch:  # a client that works is served
            assert agent.stub(ch).GetTopology(apb.GetTopologyRequest(), timeout=10).generation == 1
    finally:
        hog.close()
        agent.stop()


# ---- slow HTTP clients -----------------------------------------------------------------------------


def test_slow_health_clients_cost_no_thread_each(workdir: Path, root: Path) -> None:
    agent = AgentProc(workdir, root)
    held: list[socket.socket] = []
    try:
        before = agent.threads()
        for i in range(250):
            s = socket.create_connection(("127.0.0.1", agent.health_port), timeout=10)
            if i % 2:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head never finished
            held.append(s)
        time.sleep(1.0)
        assert agent.http("/healthz")[0] == 200
        assert agent.threads() <= before + 2
    finally:
        for s in held:
            s.close()
        agent.stop()


# ---- watchers --------------------------------------------------------------------------------------


def test_watchers_beyond_the_cap_are_refused(workdir: Path, root: Path) -> None:
    agent = AgentProc(workdir, root, listen="max_watchers = 2")
    try:
        with grpc.insecure_channel(f"unix://{agent.sock}") as ch:
            stub = agent.stub(ch)
            first, second = (stub.WatchTopology(apb.WatchTopologyRequest()) for _ in range(2))
            assert next(first).generation == 1 and next(second).generation == 1
            with pytest.raises(grpc.RpcError) as info:
                next(stub.WatchTopology(apb.WatchTopologyRequest(), timeout=10))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()
            wait_for(lambda: next(stub.WatchTopology(apb.WatchTopologyRequest(), timeout=10)).generation == 1,
                     what="a freed watcher slot")
            second.cancel()
        assert agent.metric("memtopo_watchers_refused_total") >= 1
    finally:
        agent.stop()


# ---- configurations that cannot work -----------------------------------------------------------------


def serve(config: Path, timeout: float = 60) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "memtopo.cli", "serve", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stderr + proc.stdout


def base_config(tmp: Path, root: Path, extra_top: str = "", health: str | None = None, listen: str = "") -> Path:
    cfg = tmp / "agent.toml"
    cfg.write_text(f'root = "{root}"\nstate_dir = "{tmp / "state"}"\n{extra_top}\n'
                   f'[listen]\nsocket = "{tmp / "agent.sock"}"\n{listen}\n'
                   f'[health]\nlisten = "{health if health is not None else f"127.0.0.1:{free_port()}"}"\n')
    return cfg


def test_a_fifo_as_the_config_file_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "agent.toml"
    os.mkfifo(fifo)
    rc, out = serve(fifo)
    assert rc == 78
    assert "not a regular file (a FIFO)" in out and "Traceback" not in out


def test_a_missing_socket_group_names_the_key(tmp_path: Path, root: Path) -> None:
    rc, out = serve(base_config(tmp_path, root, listen='socket_group = "memtopo-no-such-group"'))
    assert rc == 78
    assert out.strip().splitlines() == [f"memtopo: {tmp_path / 'agent.toml'}: listen.socket_group: group "
                                        "'memtopo-no-such-group' does not exist on this host"]


def test_an_unwritable_state_dir_names_the_key(tmp_path: Path, root: Path) -> None:
    (tmp_path / "file").write_text("")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(base_config(tmp_path, root).read_text().replace(
        f'state_dir = "{tmp_path / "state"}"', f'state_dir = "{tmp_path / "file" / "state"}"'))
    rc, out = serve(cfg)
    assert rc == 78
    assert "state_dir:" in out and "not a writable directory" in out and "Traceback" not in out


def test_a_health_port_in_use_names_the_key(tmp_path: Path, root: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        rc, out = serve(base_config(tmp_path, root, health=f"127.0.0.1:{port}"))
    assert rc == 78
    assert "health.listen:" in out and "in use" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) <= 2  # the error (and at most the agent's own start-up event)


def test_a_tcp_port_in_use_and_an_unusable_certificate_name_their_keys(tmp_path: Path, root: Path) -> None:
    certs = _certs(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        tls = f'tcp = "127.0.0.1:{port}"\ntls_cert = "{certs["server_crt"]}"\ntls_key = "{certs["server_key"]}"'
        rc, out = serve(base_config(tmp_path, root, listen=tls))
    assert rc == 78
    assert "listen.tcp:" in out and "in use" in out and "Traceback" not in out
    bad = tmp_path / "bad.pem"
    bad.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    tls = f'tcp = "127.0.0.1:0"\ntls_cert = "{bad}"\ntls_key = "{certs["server_key"]}"'
    rc, out = serve(base_config(tmp_path, root, listen=tls))
    assert rc == 78
    assert "listen.tls_cert:" in out and "Traceback" not in out


def test_a_second_agent_says_one_is_running(workdir: Path, root: Path) -> None:
    agent = AgentProc(workdir, root)
    try:
        rc, out = serve(agent.config)
        assert rc == 1
        assert out.strip().splitlines() == [
            f"memtopo: {agent.sock}: another memtopo agent is running on this socket "
            f"(it holds {agent.sock}.lock); stop it first"]
    finally:
        agent.stop()


@pytest.mark.parametrize(("line", "key"), [
    ("[controller]\nheartbeat_seconds = 1e-300", "controller.heartbeat_seconds"),
    ("[discovery]\ndebounce_seconds = 1e308", "discovery.debounce_seconds"),
])
def test_durations_out_of_bounds_exit_78(tmp_path: Path, line: str, key: str) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(line + "\n")
    rc, out = serve(cfg)
    assert rc == 78
    assert f"{key}: must be" in out
