"""A command's discovery in a child of its own (``isolated.discover_in_child``, what ``topo --root``,
``k8s nrt`` and ``plan`` use for input from elsewhere): the same topology as in-process, nothing of it
outlives the call, and a child that dies of a signal costs the sources it died in, never the topology."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from memtopo.discovery import crash, isolated
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import REPO, lab_root


def test_the_child_finds_what_discovery_in_process_finds() -> None:
    root = lab_root("dual-socket-cxl-tiered")
    here = discover(ProbeContext.at_root(root))
    there = asyncio.run(isolated.discover_in_child(str(root), timeout=300))
    assert there.fingerprint == here.fingerprint
    assert [n.id for n in there.numa_nodes] == [n.id for n in here.numa_nodes]


def test_the_parent_never_loads_hwloc() -> None:
    script = textwrap.dedent(f"""
        import asyncio, sys
        from memtopo.discovery.isolated import discover_in_child
        topo = asyncio.run(discover_in_child({str(lab_root("single"))!r}, timeout=300))
        assert topo.numa_nodes, "no topology"
        maps = open("/proc/self/maps").read()
        print(sorted(m for m in sys.modules if m.startswith(("pyhwloc", "pynvml", "memtopo.discovery.hwloc"))),
              "libhwloc" in maps)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    assert res.stdout.split() == ["[]", "False"], res.stdout + res.stderr


def _with_child(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    monkeypatch.setattr(isolated, "child_argv", lambda root: [sys.executable, "-c", code])


def test_a_hung_child_is_killed_at_its_deadline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    _with_child(monkeypatch, f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(3600)")
    with pytest.raises(isolated.IsolatedDiscoveryError, match="killed"):
        asyncio.run(isolated.discover_in_child(None, timeout=5))
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped: no zombie left either


def test_a_cancelled_call_kills_its_child(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    _with_child(monkeypatch, f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(3600)")

    async def cancel_once_started() -> None:
        task = asyncio.create_task(isolated.discover_in_child(None, timeout=3600))
        while not pidfile.exists() or not pidfile.read_text():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_once_started())
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)


@pytest.mark.parametrize(("code", "message"), [
    ("import sys; sys.stdout.write('\\x1b[31mnot a topology' * 3)", "no topology"),
    ("import sys; sys.stderr.write('boom\\x1b[2J\\n'); sys.exit(3)", "status 3: 'boom"),
])
def test_a_failing_or_garbling_child_is_a_typed_error(monkeypatch: pytest.MonkeyPatch, code: str,
                                                      message: str) -> None:
    _with_child(monkeypatch, code)
    with pytest.raises(isolated.IsolatedDiscoveryError, match=message) as caught:
        asyncio.run(isolated.discover_in_child(None, timeout=60))
    assert "\x1b" not in str(caught.value)  # what the child printed is quoted escaped


# ---- a child that dies ------------------------------------------------------------------------------
# A discovery child whose hwloc is not guarded by the input check: hwloc's own assertion on a node
# list of weight 0 (node/online = -1) then aborts the process, as a crashing C library does.
UNGUARDED_HWLOC = r"""
import sys
from memtopo.discovery import hwloc_input
hwloc_input.problems = lambda fs: []
from memtopo.discovery.isolated import main
sys.exit(main(sys.argv[1:]))
"""


def _crashing_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(lab_root("single"), root, symlinks=True)
    (root / "sys/devices/system/node/online").write_text("-1\n")
    return root


def _unguarded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolated, "child_argv", lambda root: [sys.executable, "-c", UNGUARDED_HWLOC,
                                                              *(["--root", root] if root else [])])


def _source(topo: pb.MemoryTopology, name: str) -> pb.SourceStatus:
    return next(s for s in topo.sources if s.source == name)


def test_a_child_killed_by_a_c_library_costs_that_source_only(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """The child aborts inside hwloc; the retry runs without hwloc, whose source names the signal."""
    _unguarded(monkeypatch)
    topo = asyncio.run(isolated.discover_in_child(str(_crashing_root(tmp_path)), timeout=300))
    hw = _source(topo, "hwloc")
    assert hw.state == pb.SOURCE_STATE_DEGRADED
    # hwloc's assertion aborts, unless the corrupted heap faults first: which one is the allocator's.
    assert re.match(r"left out: the discovery process died of SIG(ABRT|SEGV) while this probe ran", hw.reasons[0])
    assert _source(topo, "sysfs.numa").state != pb.SOURCE_STATE_UNAVAILABLE
    assert [n.id for n in topo.numa_nodes] == [0]


# The signal sent to the probe's own thread, as a fault in a C library is delivered to the thread
# that faulted (a signal to the process may land on any thread, a moment later).
DIES_IN = r"""
import signal, sys, threading
from memtopo.discovery import {module}
def probe(*args, **kw):
    signal.pthread_kill(threading.get_ident(), signal.{signal})
{module}.probe = probe
from memtopo.discovery.isolated import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("module", "source", "sig"), [("sysfs_tiers", "sysfs.memory_tiers", "SIGSEGV"),
                                                         ("sysfs_pci", "sysfs.pci", "SIGKILL")])
def test_any_signal_in_any_probe_is_that_sources_degraded_status(monkeypatch: pytest.MonkeyPatch, module: str,
                                                                 source: str, sig: str) -> None:
    code = DIES_IN.format(module=module, signal=sig)
    monkeypatch.setattr(isolated, "child_argv", lambda root: [sys.executable, "-c", code, "--root", str(root)])
    topo = asyncio.run(isolated.discover_in_child(str(lab_root("dual-socket-tiered")), timeout=300))
    status = _source(topo, source)
    assert status.state == pb.SOURCE_STATE_DEGRADED
    assert f"died of {sig} while this probe ran" in status.reasons[0]
    assert len(topo.domains) == 3 and _source(topo, "sysfs.numa").state == pb.SOURCE_STATE_OK


def test_a_child_that_dies_outside_any_probe_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_child(monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(isolated.IsolatedDiscoveryError, match="died of SIGSEGV outside any probe"):
        asyncio.run(isolated.discover_in_child(None, timeout=60))


# `memtopo topo` with its discovery child unguarded, as above.
UNGUARDED_COMMAND = rf"""
import sys
from memtopo.discovery import crash, isolated
isolated.child_argv = lambda root: [sys.executable, "-c", {UNGUARDED_HWLOC!r}, *(["--root", root] if root else [])]
from memtopo.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", [("topo", "--format", "json"), ("k8s", "nrt", "--node-name", "lab-1")])
def test_a_command_whose_child_dies_reports_and_leaves_no_extraction(tmp_path: Path, command: tuple[str, ...]) -> None:
    """A captured archive is extracted by the command and read by its child: the child's death
    costs hwloc's source, and the extraction is removed all the same."""
    root = _crashing_root(tmp_path)
    tarball = tmp_path / "root.tar.gz"
    with tarfile.open(tarball, "w:gz") as tf:
        tf.add(root, arcname="capture")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    res = subprocess.run([sys.executable, "-c", UNGUARDED_COMMAND, *command, "--root", str(tarball)], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(scratch)},
                         check=False)
    assert res.returncode == 0, res.stderr[-600:]
    # topo shows hwloc's status; the NodeResourceTopology has no sources, but its zone all the same.
    assert re.search(r"died of SIG(ABRT|SEGV)", res.stdout) if command[0] == "topo" else ("name: node-0" in res.stdout)
    assert not list(scratch.iterdir())


def test_the_probe_blamed_is_the_one_on_the_thread_the_signal_hit() -> None:
    """Probes run side by side (hwloc beside the sysfs lane): faulthandler's "Current thread" names
    the one that crashed; without it (SIGKILL has no handler) every probe still running is."""
    err = (b"memtopo-probe start hwloc 0x7f00000000a0\n"
           b"memtopo-probe start sysfs.numa 0x7f00000000b0\n"
           b"memtopo-probe start sysfs.pci 0x7f00000000b0\nmemtopo-probe end sysfs.pci 0x7f00000000b0\n")
    faulted = b"Fatal Python error: Aborted\n\nCurrent thread 0x00007f00000000a0 (most recent call first):\n"
    assert crash.running_at_death(err + faulted) == ["hwloc"]
    assert crash.running_at_death(err) == ["hwloc", "sysfs.numa"]
    assert crash.running_at_death(err + faulted.replace(b"a0 (", b"c0 (")) == ["hwloc", "sysfs.numa"]
