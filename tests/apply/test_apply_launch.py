"""``memtopo exec``: policy parsing, checks against the host, set-and-verify before exec, and the
real thing in a child process."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from memtopo.apply import launch
from memtopo.apply.errors import LaunchError
from memtopo.apply.host import MPOL_BIND, MPOL_INTERLEAVE, MPOL_LOCAL, MPOL_PREFERRED, HostFiles, Ids, LinuxKernel
from memtopo.hostfs import HostFS
from tests.apply_fakes import FakeKernel, write_root

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("text", "mode", "nodes", "all_nodes"), [
    ("local", MPOL_LOCAL, (), False),
    ("interleave=0-1", MPOL_INTERLEAVE, (0, 1), False),
    ("interleave=all", MPOL_INTERLEAVE, (), True),
    ("preferred=1", MPOL_PREFERRED, (1,), False),
    ("bind=0,2", MPOL_BIND, (0, 2), False),
])
def test_policy_specs(text: str, mode: int, nodes: Ids, all_nodes: bool) -> None:
    spec = launch.parse_policy(text)
    assert (spec.mode, spec.nodes, spec.all_nodes) == (mode, nodes, all_nodes)
    assert spec.describe() == text


@pytest.mark.parametrize(("text", "why"), [
    ("firsttouch", "expected local"), ("local=1", "takes no nodes"), ("bind=", "needs nodes"),
    ("preferred=0-1", "exactly one node"), ("bind=x", "not a number"), ("interleave=5-1", "descending"),
])
def test_bad_policy_specs(text: str, why: str) -> None:
    with pytest.raises(LaunchError, match=why):
        launch.parse_policy(text)


@pytest.fixture
def files(tmp_path: Path) -> HostFiles:
    write_root(tmp_path, [], [])
    return HostFiles(HostFS.at(tmp_path))


def test_resolve_checks_the_host(files: HostFiles) -> None:
    with pytest.raises(LaunchError, match="CPU 9 not online"):
        launch.resolve(None, (1, 9), files)
    with pytest.raises(LaunchError, match="node 2 has no memory"):
        launch.resolve(launch.parse_policy("bind=2"), None, files)
    every = launch.resolve(launch.parse_policy("interleave=all"), None, files)
    assert every is not None and every.nodes == (0, 1, 4)


class _Kernel(FakeKernel):
    def __init__(self, report: tuple[int, Ids] | None = None) -> None:
        super().__init__()
        self.masks[0] = {0, 1, 2, 3}
        self.report = report

    def get_mempolicy(self) -> tuple[int, Ids]:
        return self.report if self.report is not None else super().get_mempolicy()


def test_launch_sets_verifies_and_execs(files: HostFiles) -> None:
    kernel = _Kernel()
    ran: list[tuple[str, list[str]]] = []
    with pytest.raises(LaunchError, match="exec returned"):  # the fake exec returns
        launch.launch(["python3", "-c", "pass"], launch.parse_policy("bind=1"), (2, 3), kernel, files,
                      execvp=lambda f, a: ran.append((f, a)))
    assert ran == [("python3", ["python3", "-c", "pass"])]
    assert ("set_mempolicy", (MPOL_BIND, (1,))) in kernel.calls
    assert kernel.masks[0] == {2, 3}


def test_launch_refuses_when_the_policy_does_not_hold(files: HostFiles) -> None:
    with pytest.raises(LaunchError, match="did not hold"):
        launch.launch(["true"], launch.parse_policy("bind=1"), None, _Kernel(report=(0, ())), files,
                      execvp=lambda f, a: None)


def test_launch_reports_kernel_and_exec_errors(files: HostFiles) -> None:
    kernel = _Kernel()
    kernel.fail_on("set_mempolicy", 1, errno.EINVAL)
    with pytest.raises(LaunchError, match="EINVAL"):
        launch.launch(["true"], launch.parse_policy("bind=1"), None, kernel, files, execvp=lambda f, a: None)

    def missing(f: str, a: Iterable[str]) -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    with pytest.raises(LaunchError, match="no-such-tool: No such file"):
        launch.launch(["no-such-tool"], None, None, _Kernel(), files, execvp=missing)
    with pytest.raises(LaunchError, match="no command"):
        launch.launch([], None, None, _Kernel(), files)


# ---- the real exec ---------------------------------------------------------------------------------
_PROBE = ("import json, os; from apply.host import LinuxKernel; "
          "print(json.dumps([sorted(os.sched_getaffinity(0)), list(LinuxKernel().get_mempolicy())]))")


def _exec(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memtopo.cli", "exec", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=False)


def test_exec_runs_the_command_with_cpus_and_membind() -> None:
    cpu = max(LinuxKernel().get_affinities([0]).masks[0] or {0})
    res = _exec("--cpus", str(cpu), "--membind", "0", "--", sys.executable, "-c", _PROBE)
    assert res.returncode == 0, res.stderr
    cpus, (mode, nodes) = json.loads(res.stdout)
    assert cpus == [cpu]
    assert (mode, nodes) == (MPOL_BIND, [0])


@pytest.mark.parametrize(("flags", "mode"), [
    (["--localalloc"], MPOL_LOCAL), (["--interleave", "all"], MPOL_INTERLEAVE),
    (["--preferred", "0"], MPOL_PREFERRED), (["--policy", "bind=0"], MPOL_BIND)])
def test_exec_policies(flags: list[str], mode: int) -> None:
    res = _exec(*flags, "--", sys.executable, "-c", _PROBE)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[1][0] == mode


def test_exec_errors_say_why_and_exit_2_or_as_a_shell_would() -> None:
    """A policy or CPU list that cannot be set: 2 (usage); a command that cannot be started: 127,
    the shell's status for no such command."""
    res = _exec("--cpus", "999", "--", "true")
    assert res.returncode == 2 and "CPU 999 not online" in res.stderr
    res = _exec("--membind", "7", "--", "true")
    assert res.returncode == 2 and "node 7" in res.stderr
    res = _exec("--", "/nonexistent/tool")
    assert res.returncode == 127 and "/nonexistent/tool" in res.stderr
