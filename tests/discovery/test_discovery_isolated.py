"""Discovery in a child process (the agent's way): the same topology as in-process, and nothing of it
outlives the call — not its libraries in the parent, not the child itself when it hangs or garbles."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memtopo.discovery import isolated
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
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
