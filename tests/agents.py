"""memtopo's agent and reference controller as real processes, for the tests of every room that
needs one (agent, controller, cli; bench too): ``memtopo serve`` on a copy of a real two-socket
capture, ``memtopo controller serve`` on loopback, and the agent daemon in this process.

Every listener binds port 0 and the test reads the port the kernel gave from the process's own
listening event (``agent_ready``, ``controller_listening``): a port picked free beforehand can be
taken by a parallel test process before the server binds it."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import agent_pb2_grpc
from memtopo.v1 import plan_pb2 as planpb
from tests.fixtures import REPO, lab_root

if TYPE_CHECKING:
    from memtopo.agent.daemon import Agent as DaemonAgent


def wait_for(predicate: Callable[[], Any], timeout: float = 120.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError, OSError):
            last = predicate()
            if last:
                return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def memtopo(*args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "memtopo.cli", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def copy_root(dst: Path) -> Path:
    root = dst / "root"
    shutil.copytree(lab_root("dual-socket-cxl"), root, symlinks=True)
    return root


def pin_plan(plan_id: str, pid: int, cpus: list[int]) -> planpb.BindingPlan:
    plan = planpb.BindingPlan(plan_id=plan_id, policy="manual")
    a = plan.actions.add(id="pin", required=True)
    a.thread_affinity.pid = pid
    a.thread_affinity.threads.all = True
    a.thread_affinity.cpus.extend(cpus)
    return plan


class Output:
    """A process's stdout, read line by line on a thread so the pipe never fills."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()

    def _drain(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def events(self, name: str) -> list[dict[str, Any]]:
        """The JSON log events called ``name`` (the agent logs JSON when its output is not a terminal)."""
        out = []
        for line in list(self.lines):
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if isinstance(ev, dict) and ev.get("event") == name:
                    out.append(ev)
        return out

    def field(self, event: str, key: str) -> str | None:
        """``key`` of the first event called ``event``: a JSON event (the default), or ``key=value`` of a
        console-rendered one (``--log-format console``)."""
        for ev in self.events(event):
            if key in ev:
                return str(ev[key])
        for line in list(self.lines):
            if m := re.search(rf"\b{event}\b.*\b{key}=(\S+)", line):
                return m.group(1)
        return None


class Agent:
    """A ``memtopo serve`` process. ``extra`` are more [listen] lines, ``discovery`` the [discovery]
    ones after ``udev``; ``script`` runs instead of ``-m memtopo.cli`` (a patched agent)."""

    def __init__(self, tmp: Path, root: Path, controller_port: int | None, extra: str = "",
                 env: dict[str, str] | None = None, udev: bool = False, log_level: str = "info", *,
                 node_name: str = "e2e-node", discovery: str = "debounce_seconds = 0.0",
                 script: str | None = None) -> None:
        self.tmp = tmp
        self.sock = tmp / "agent.sock"
        self.health_port = 0  # the port the agent bound, once started
        self.tcp_port: int | None = None
        self.script = script
        ctl = (f'[controller]\naddress = "127.0.0.1:{controller_port}"\ninsecure = true\nheartbeat_seconds = 0.5\n'
               'backoff_initial_seconds = 0.05\nbackoff_max_seconds = 0.3\n') if controller_port else ""
        self.config = tmp / "agent.toml"
        self.config.write_text(
            f'node_name = {json.dumps(node_name)}\nroot = "{root}"\nstate_dir = "{tmp / "state"}"\n'
            f'[listen]\nsocket = "{self.sock}"\n{extra}\n{ctl}'
            f'[discovery]\nudev = {"true" if udev else "false"}\n{discovery}\n'
            f'[health]\nlisten = "127.0.0.1:0"\n[log]\nlevel = "{log_level}"\n')
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self._out: Output | None = None

    @property
    def output(self) -> list[str]:
        return self._out.lines if self._out is not None else []

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting: several agents then start side by side."""
        argv = ["-c", self.script] if self.script else ["-m", "memtopo.cli"]
        self.proc = subprocess.Popen([sys.executable, *argv, "serve", "--config", str(self.config)], cwd=REPO,
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env)
        self._out = Output(self.proc)

    def wait_ready(self) -> None:
        """Until the agent serves: its ports come from its agent_ready event."""
        proc = self.proc
        assert proc is not None

        def ready() -> dict[str, Any] | None:
            assert proc.poll() is None, f"the agent exited {proc.returncode}:\n{''.join(self.output)[-3000:]}"
            return next(iter(self._out.events("agent_ready") if self._out else []), None)

        ev = wait_for(ready, timeout=120, what="agent ready")
        self.health_port = int(str(ev["health"]).rpartition(":")[2])
        self.tcp_port = ev.get("tcp_port")
        wait_for(lambda: self.http("/readyz")[0] == 200, what="agent /readyz")

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}{path}", timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str) -> float:
        for line in self.http("/metrics")[1].splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {name}")

    def threads(self) -> int:
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"unix://{self.sock}")

    def stub(self, ch: grpc.Channel) -> Any:
        return agent_pb2_grpc.NodeAgentStub(ch)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def events(self, name: str) -> list[dict[str, Any]]:
        return self._out.events(name) if self._out is not None else []


class Controller:
    """A ``memtopo controller serve`` process on loopback; ``http`` serves its HTTP listener too.
    ``port`` 0 binds an ephemeral port; a restart binds the port it had, as a restarted controller
    behind a fixed address does."""

    def __init__(self, port: int = 0, *, http: bool = False) -> None:
        self.port = port
        self.http_port: int | None = None
        self.with_http = http
        self.proc: subprocess.Popen[str] | None = None
        self._out: Output | None = None

    def start(self) -> None:
        http = ["--http", "127.0.0.1:0" if self.http_port is None else f"127.0.0.1:{self.http_port}"] \
            if self.with_http else ["--http", ""]
        self.proc = memtopo("controller", "serve", "--listen", f"127.0.0.1:{self.port}", *http)
        out = self._out = Output(self.proc)
        proc = self.proc

        def bound() -> str | None:
            assert proc.poll() is None, f"the controller exited {proc.returncode}:\n{''.join(out.lines)[-3000:]}"
            return out.field("controller_listening", "address")

        self.port = int(wait_for(bound, what="controller listening").rpartition(":")[2])
        if self.with_http:
            self.http_port = int(str(out.field("controller_http_listening", "address")).rpartition(":")[2])

    @property
    def output(self) -> list[str]:
        return self._out.lines if self._out is not None else []

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def node(self, name: str = "e2e-node") -> apb.NodeSummary | None:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            nodes = agent_pb2_grpc.ControllerAdminStub(ch).ListNodes(apb.ListNodesRequest(), timeout=30).nodes
        return next((n for n in nodes if n.node_name == name), None)

    def submit(self, plan: planpb.BindingPlan, node: str = "e2e-node") -> planpb.PlanResult:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            res: planpb.PlanResult = agent_pb2_grpc.ControllerAdminStub(ch).SubmitPlan(
                apb.SubmitPlanRequest(node_name=node, plan=plan, timeout_seconds=20), timeout=30)
            return res


def certificates(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for ``localhost`` and a client one, as PEM files under ``tmp``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
        kp, cp = tmp / f"{stem}.key", tmp / f"{stem}.crt"
        kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return kp, cp

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("memtopo-test-ca")).issuer_name(name("memtopo-test-ca"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - dt.timedelta(hours=1))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _, ca_path = write("ca", ca_key, ca)
    out = {"ca": ca_path}
    for stem, san in (("server", x509.SubjectAlternativeName([x509.DNSName("localhost")])),
                      ("client", x509.SubjectAlternativeName([x509.DNSName("operator")]))):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(2 if stem == "server" else 3)
                .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
                .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))
        out[f"{stem}_key"], out[f"{stem}_crt"] = write(stem, key, cert)
    return out


# ---- the daemon in this process --------------------------------------------------------------------
def inproc_agent(tmp_path: Path, extra: str = "", **seams: Any) -> DaemonAgent:
    """The agent daemon (not a process) on the dual-socket capture, state under ``tmp_path/state``;
    ``extra``: more TOML tables for its config; ``seams``: the Agent's keyword seams (pod_source …)."""
    from memtopo.agent.config import load_config
    from memtopo.agent.daemon import Agent as DaemonAgent
    from memtopo.agent.sdnotify import Notifier

    config = tmp_path / "agent.toml"
    config.write_text(
        f'node_name = "inproc"\nroot = "{lab_root("dual-socket-cxl")}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[listen]\nsocket = "{tmp_path / "agent.sock"}"\n'
        '[discovery]\ndebounce_seconds = 0.0\nudev = false\n[health]\nlisten = ""\n' + extra)
    return DaemonAgent(load_config(config), notifier=Notifier(None), **seams)


def run_agent(agent: DaemonAgent, after_ready: Callable[[], object]) -> int:
    """Run ``agent`` until it exits; ``after_ready`` is called once it serves its first topology."""
    async def main() -> int:
        run = asyncio.create_task(agent.run())
        while agent.server is None or agent.state.current is None:
            assert not run.done(), run.result()
            await asyncio.sleep(0.01)
        after_ready()
        return await asyncio.wait_for(run, 30)
    return asyncio.run(main())


def free_port() -> int:
    """A port free now, for tests that must name one in advance (a process told to take it, or one
    held busy on purpose); everything else binds port 0 and reads what it got."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
