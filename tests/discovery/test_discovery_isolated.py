"""Discovery in the discovery helper's forked children (the agent's way): the same topology as in-process, and
nothing of it outlives a discovery that failed — not its libraries in the agent, not a child that
hangs, not a helper that garbles. The misbehaving helpers are tests/helper_standin.py (the real
helper with its discovery replaced) or a few lines of Python in its place."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.roots import set_node_memory
from memtopo.discovery import changes, isolated
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import REPO, lab_root


def _standin(monkeypatch: pytest.MonkeyPatch, mode: str, pidfile: Path | None = None) -> None:
    argv = [sys.executable, "-m", "tests.helper_standin", mode, *([str(pidfile)] if pidfile else [])]
    monkeypatch.setattr(isolated, "helper_argv", lambda: argv)


def _with_code(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    monkeypatch.setattr(isolated, "helper_argv", lambda: [sys.executable, "-c", code])


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for whichever process adopted it: nothing of it runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def _pids(pidfile: Path) -> list[int]:
    return [int(x) for x in pidfile.read_text().split()] if pidfile.exists() else []


def test_the_helper_finds_what_discovery_in_process_finds() -> None:
    root = lab_root("dual-socket-cxl-tiered")
    here = discover(ProbeContext.at_root(root), generation=7, node_name="named-node")

    async def twice() -> tuple[isolated.Discovered, isolated.Discovered, int | None, int | None]:
        helper = isolated.DiscoveryHelper()
        try:
            first = await helper.discover(str(root), node_name="named-node", generation=7, timeout=300)
            pid = helper.pid
            second = await helper.discover(str(root), node_name="named-node", generation=8, timeout=300)
            return first, second, pid, helper.pid
        finally:
            await helper.close()

    first, second, pid, pid_again = asyncio.run(twice())
    assert pid is not None and pid == pid_again  # one helper serves every discovery
    for found in (first, second):
        assert found.topology.fingerprint == here.fingerprint
        assert found.topology.node_name == "named-node"  # named before the fingerprint, in the child
        assert [n.id for n in found.topology.numa_nodes] == [n.id for n in here.numa_nodes]
        assert pb.MemoryTopology.FromString(found.payload) == found.topology  # the bytes as sent
    assert (first.topology.generation, second.topology.generation) == (7, 8)
    assert first.ran == second.ran == tuple(sorted(s.source for s in here.sources))  # full rescans


def test_the_agent_never_loads_hwloc_and_the_helper_never_loads_a_topology() -> None:
    script = textwrap.dedent(f"""
        import asyncio, sys
        from memtopo.discovery.isolated import DiscoveryHelper
        async def main():
            helper = DiscoveryHelper()
            found = await helper.discover({str(lab_root("single"))!r}, timeout=300)
            assert found.topology.numa_nodes, "no topology"
            helper_maps = open(f"/proc/{{helper.pid}}/maps").read()
            await helper.close()
            return helper_maps
        helper_maps = asyncio.run(main())
        maps = open("/proc/self/maps").read()
        print(sorted(m for m in sys.modules if m.startswith(("pyhwloc", "pynvml", "memtopo.discovery.hwloc"))),
              "libhwloc" in maps, "hwloc_" in helper_maps, "libnvidia-ml" in helper_maps)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    # The helper maps libhwloc itself (its bindings are imported once) but none of its plugins
    # (hwloc_*.so: loaded with a topology) and no vendor library.
    assert res.stdout.split() == ["[]", "False", "False", "False"], res.stdout + res.stderr


def test_a_hung_child_is_killed_with_its_helper_at_the_deadline(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    _standin(monkeypatch, "hang-from-1", pidfile)

    async def run() -> int | None:
        helper = isolated.DiscoveryHelper()
        with pytest.raises(isolated.IsolatedDiscoveryError, match="killed"):
            await helper.discover(str(lab_root("single")), timeout=5)
        return helper.pid

    assert asyncio.run(run()) is None  # no helper left to ask
    (child,) = _pids(pidfile)
    deadline = time.monotonic() + 10
    while not _dead(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(child)


def test_a_cancelled_discovery_kills_the_helper_and_its_child(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    _standin(monkeypatch, "hang-from-1", pidfile)

    async def cancel_once_started() -> int:
        helper = isolated.DiscoveryHelper()
        task = asyncio.create_task(helper.discover(str(lab_root("single")), timeout=3600))
        while not _pids(pidfile):
            await asyncio.sleep(0.05)
        pid = helper.pid
        assert pid is not None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid

    helper_pid = asyncio.run(cancel_once_started())
    with pytest.raises(ProcessLookupError):
        os.kill(helper_pid, 0)  # killed and reaped: no zombie left either
    (child,) = _pids(pidfile)
    deadline = time.monotonic() + 10
    while not _dead(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(child)


@pytest.mark.parametrize(("mode", "message"), [
    ("raise-first", r"discovery failed: RuntimeError: 'probe bug \\x1b\[2J on cue'"),
    ("crash-first", "the discovery process died of SIGKILL outside any probe"),
])
def test_a_failing_child_is_a_typed_error_and_the_helper_serves_on(monkeypatch: pytest.MonkeyPatch,
                                                                   mode: str, message: str) -> None:
    _standin(monkeypatch, mode)
    root = str(lab_root("single"))

    async def run() -> tuple[int | None, int | None, pb.MemoryTopology]:
        helper = isolated.DiscoveryHelper()
        try:
            with pytest.raises(isolated.IsolatedDiscoveryError, match=message) as caught:
                await helper.discover(root, timeout=300)
            assert "\x1b" not in str(caught.value)
            pid = helper.pid
            topo = (await helper.discover(root, timeout=300)).topology
            return pid, helper.pid, topo
        finally:
            await helper.close()

    pid, pid_after, topo = asyncio.run(run())
    assert pid is not None and pid == pid_after
    assert topo.numa_nodes


# The helper with one probe killed by a signal on its own thread, as a fault in a C library is
# delivered to the thread that faulted.
_DIES_IN = r"""
import signal, sys, threading
from memtopo.discovery import {module}
def probe(*args, **kw):
    signal.pthread_kill(threading.get_ident(), signal.{signal})
{module}.probe = probe
from memtopo.discovery.helper import main
sys.exit(main([]))
"""


@pytest.mark.parametrize(("module", "source", "sig"), [("sysfs_tiers", "sysfs.memory_tiers", "SIGSEGV"),
                                                         ("sysfs_pci", "sysfs.pci", "SIGKILL")])
def test_a_child_killed_in_a_probe_costs_that_source_and_the_helper_serves_on(
        monkeypatch: pytest.MonkeyPatch, module: str, source: str, sig: str) -> None:
    """The node stayed unready when every discovery child died; now the helper runs the discovery
    again without the probe the child died in, whose source names the signal, and keeps serving."""
    _with_code(monkeypatch, _DIES_IN.format(module=module, signal=sig))
    root = str(lab_root("dual-socket-tiered"))

    async def run() -> tuple[pb.MemoryTopology, pb.MemoryTopology, int | None, int | None]:
        helper = isolated.DiscoveryHelper()
        try:
            first = (await helper.discover(root, timeout=300)).topology
            pid = helper.pid
            again = (await helper.discover(root, change=changes.full("again"), timeout=300)).topology
            return first, again, pid, helper.pid
        finally:
            await helper.close()

    first, again, pid, pid_after = asyncio.run(run())
    for topo in (first, again):
        status = next(s for s in topo.sources if s.source == source)
        assert status.state == pb.SOURCE_STATE_DEGRADED
        assert f"died of {sig} while this probe ran" in status.reasons[0]
        assert len(topo.domains) == 3
        assert next(s for s in topo.sources if s.source == "sysfs.numa").state == pb.SOURCE_STATE_OK
    assert pid is not None and pid == pid_after


_ANSWER = "import sys, struct; sys.stdin.buffer.read(4); w = sys.stdout.buffer.write; "
_LINGER = "; sys.stdout.flush(); import time; time.sleep(60)"


@pytest.mark.parametrize(("code", "message"), [
    ("import sys; sys.exit(0)", "helper exited with status 0"),
    ("import sys; sys.stderr.write('boom\\x1b[2J\\n'); sys.exit(3)", r"status 3 .*: 'boom\\x1b\[2J'"),
    (_ANSWER + "w(b'\\x1b[31mnot a topology' * 3)" + _LINGER, "more than a topology"),
    (_ANSWER + "w(struct.pack('>I', 2) + b'no' + struct.pack('>I', 0))" + _LINGER, "wrote no answer"),
    (_ANSWER + "f = b'{\"ok\": true}'; t = b'\\xff' * 9; "
     "w(struct.pack('>I', len(f)) + f + struct.pack('>I', len(t)) + t)" + _LINGER, "wrote no topology"),
])
def test_a_garbling_or_dying_helper_is_a_typed_error(monkeypatch: pytest.MonkeyPatch, code: str,
                                                     message: str) -> None:
    _with_code(monkeypatch, code)

    async def run() -> None:
        helper = isolated.DiscoveryHelper()
        try:
            with pytest.raises(isolated.IsolatedDiscoveryError, match=message) as caught:
                await helper.discover(None, timeout=60)
            assert "\x1b" not in str(caught.value)  # what it printed is quoted escaped
        finally:
            await helper.close()

    asyncio.run(run())


def test_a_helper_that_died_between_discoveries_is_started_again() -> None:
    root = str(lab_root("single"))

    async def run() -> tuple[int, int | None]:
        helper = isolated.DiscoveryHelper()
        try:
            await helper.discover(root, timeout=300)
            pid = helper.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            while helper.pid is not None:  # until its exit is seen
                await asyncio.sleep(0.02)
            assert (await helper.discover(root, timeout=300)).topology.numa_nodes
            return pid, helper.pid
        finally:
            await helper.close()

    old, new = asyncio.run(run())
    assert new is not None and new != old


def test_the_helper_answers_a_bad_request_and_serves_on() -> None:
    frame = struct.Struct(">I")
    proc = subprocess.Popen([sys.executable, "-m", "memtopo.discovery.helper"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None

    def ask(body: bytes) -> tuple[dict[str, object], bytes]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(frame.pack(len(body)) + body)
        proc.stdin.flush()
        out = []
        for _ in range(2):
            (n,) = frame.unpack(proc.stdout.read(4))
            out.append(proc.stdout.read(n))
        return json.loads(out[0]), out[1]

    try:
        for bad in (b"\xff not json", b"[1, 2]", json.dumps({"root": 5}).encode()):
            head, payload = ask(bad)
            assert head["ok"] is False and payload == b"" and "\x1b" not in str(head["error"])
        head, payload = ask(json.dumps({"root": str(lab_root("single")), "change": "garbage",
                                        "generation": "x"}).encode())
        assert head["ok"] is True  # an unreadable change is a full rescan
        assert pb.MemoryTopology.FromString(payload).numa_nodes
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0  # stdin closed: the helper ends


def test_a_partial_rescan_in_the_helper_reruns_what_the_change_reaches(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(lab_root("single"), root, symlinks=True)

    async def run() -> tuple[isolated.Discovered, isolated.Discovered]:
        helper = isolated.DiscoveryHelper()
        try:
            await helper.discover(str(root), timeout=300)
            set_node_memory(root, 0, 8 << 20)
            partial = await helper.discover(str(root), change=changes.of_uevent("memory"), timeout=300)
            again = await helper.discover(str(root), change=changes.of_uevent("pci", "8086:1234"), timeout=300)
            return partial, again
        finally:
            await helper.close()

    partial, again = asyncio.run(run())
    full = discover(ProbeContext.at_root(root))
    assert partial.topology.fingerprint == again.topology.fingerprint == full.fingerprint
    assert partial.ran == ("hwloc", "nvidia", "sysfs.cxl", "sysfs.memory_tiers", "sysfs.numa")
    assert again.ran == ("hwloc", "sysfs.cxl", "sysfs.pci", "xpu-smi")  # an Intel device: no vendor probe
