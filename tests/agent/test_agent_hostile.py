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
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from memtopo.v1 import agent_pb2 as apb
from tests.agent.holders import Holder, settles_at
from tests.agents import Agent, certificates, copy_root, pin_plan, wait_for
from tests.fixtures import REPO

# `memtopo serve` with discovery made to hang from its second run on: a probe stuck in the kernel
# (a wedged driver, a hung mount) stands in as a thread that never returns. On a thread of the agent
# (discovery.isolate = false) the Rescanner is replaced in the agent; in the helper's children (the
# default) the helper is tests/helper_standin.py, the real one with the same replacement.
HANGING_DISCOVERY = r"""
import os, sys, threading
import memtopo.discovery.discover, memtopo.discovery.isolated
real = memtopo.discovery.discover.Rescanner.discover
runs = []
def discover(self, *args, **kwargs):  # discovery on a thread (discovery.isolate = false)
    runs.append(1)
    if len(runs) > 1:
        threading.Event().wait()
    return real(self, *args, **kwargs)
memtopo.discovery.discover.Rescanner.discover = discover
memtopo.discovery.isolated.helper_argv = lambda: [sys.executable, "-m", "tests.helper_standin", "hang-from-2",
                                                   # the agent's pid marks its helper and children
                                                   f"/tmp/memtopo-hung-discovery-{os.getpid()}.pids"]
from memtopo.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


class AgentProc(Agent):
    """A started `memtopo serve` process; ``listen`` and ``discovery`` are extra lines for those tables."""

    def __init__(self, workdir: Path, root: Path, *, listen: str = "", discovery: str = "",
                 script: str | None = None) -> None:
        super().__init__(workdir, root, None, extra=listen, discovery=discovery, script=script, node_name="hostile")
        self.start()
        assert self.proc is not None
        self.process: subprocess.Popen[str] = self.proc


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is 0700): they connect to the socket."""
    d = Path(tempfile.mkdtemp(prefix="memtopo-hostile-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy for the module: no test here changes the root, the agents only read it."""
    return copy_root(tmp_path_factory.mktemp("hostile-root"))


# ---- a rescan that hangs ---------------------------------------------------------------------------


@pytest.mark.parametrize("isolate", ["true", "false"])
def test_a_hung_rescan_is_reported_and_sigterm_still_exits(workdir: Path, root: Path, isolate: str) -> None:
    agent = AgentProc(workdir, root, discovery=f"deadline_seconds = 0.5\ndebounce_seconds = 0\nisolate = {isolate}",
                      script=HANGING_DISCOVERY)
    try:
        assert agent.metric("memtopo_discovery_overdue") == 0
        # A child's start can itself outlast a 0.5 s deadline on a busy machine: count from here.
        overdue_before = agent.metric("memtopo_discoveries_overdue_total")
        agent.process.send_signal(signal.SIGHUP)  # the rescan that never returns
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
    # The helper and its hung child are killed at the stop, not left behind (a zombie, which has no
    # command line, is dead: the child's is reaped by whoever adopted it once its helper died).
    wait_for(lambda: not hung_discovery_children(agent.process.pid), what="discovery processes gone")
    Path(f"/tmp/memtopo-hung-discovery-{agent.process.pid}.pids").unlink(missing_ok=True)


def hung_discovery_children(agent_pid: int) -> list[int]:
    """The hung discovery children that the agent ``agent_pid`` started, wherever they were reparented."""
    mark = f"memtopo-hung-discovery-{agent_pid}.pids".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if mark in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
    return found


def test_sigterm_exits_while_a_rescan_hangs(workdir: Path, root: Path) -> None:
    # Default deadline: the stop must not wait for the rescan, reported overdue or not.
    agent = AgentProc(workdir, root, discovery="debounce_seconds = 0", script=HANGING_DISCOVERY)
    try:
        agent.process.send_signal(signal.SIGHUP)
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


# ---- a discovery child that dies -------------------------------------------------------------------
# The agent's discovery helper with hwloc unguarded by the input check: on node/online = -1, hwloc's
# own assertion aborts each child it forks, as a C library crashing on what it reads does.
DYING_HELPER = r"""
import sys
from memtopo.discovery import hwloc_input
hwloc_input.problems = lambda fs: []
from memtopo.discovery.helper import main
sys.exit(main([]))
"""
DYING_DISCOVERY = rf"""
import sys
from memtopo.discovery import isolated
isolated.helper_argv = lambda: [sys.executable, "-c", {DYING_HELPER!r}]
from memtopo.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_discovery_child_that_dies_costs_its_source_not_readiness(workdir: Path, root: Path) -> None:
    """It died on every rescan and the node stayed unready; now the rescan goes on without the probe
    the child died in, whose source names the signal."""
    (root / "sys/devices/system/node/online").write_text("-1\n")
    agent = AgentProc(workdir, root, discovery="debounce_seconds = 0", script=DYING_DISCOVERY)  # waits for ready
    try:
        with grpc.insecure_channel(f"unix://{agent.sock}") as ch:
            topo = agent.stub(ch).GetTopology(apb.GetTopologyRequest(), timeout=10)
        hw = next(s for s in topo.sources if s.source == "hwloc")
        # hwloc's assertion aborts, unless the corrupted heap faults first.
        assert re.search(r"died of SIG(ABRT|SEGV) while this probe ran", hw.reasons[0])
        assert topo.domains
        assert "hwloc" in agent.events("generation_published")[0]["degraded_sources"]
        agent.process.send_signal(signal.SIGHUP)  # and so does every rescan
        wait_for(lambda: 'memtopo_discoveries_total{outcome="ok"} 2.0' in agent.http("/metrics")[1],
                 what="the rescan")
        assert agent.http("/readyz")[0] == 200 and not agent.events("discovery_failed")
    finally:
        assert agent.stop(timeout=60) == 0


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
                   f'[health]\nlisten = "{health if health is not None else "127.0.0.1:0"}"\n')
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
    certs = certificates(tmp_path)
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
