"""The scripts a newcomer runs first (tools/*.sh), run for real against stand-in paths."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from memtopo import __version__
from tests.fixtures import REPO


def lab_gate(env: dict[str, str]) -> str:
    """Source tools/lab_gate.sh as tools/test.sh does and report what it exported."""
    res = subprocess.run(["bash", "-c", '. tools/lab_gate.sh; echo "MEMTOPO_LAB=${MEMTOPO_LAB-unset}"'],
                         cwd=REPO, env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return res.stdout.strip().splitlines()[-1]


def test_the_lab_gate_follows_memtopo_shared(tmp_path: Path) -> None:
    """A stand-in numa-vm under MEMTOPO_SHARED is the one set up, not ../shared's."""
    fake = tmp_path / "lab" / "numa-vm"
    fake.parent.mkdir(parents=True)
    marker = tmp_path / "setup-ran"
    fake.write_text(f'#!/bin/sh\n[ "$1" = setup ] && echo yes > "{marker}"\n')
    fake.chmod(0o755)
    assert lab_gate({"MEMTOPO_SHARED": str(tmp_path)}) == "MEMTOPO_LAB=1"
    assert marker.read_text() == "yes\n"
    marker.unlink()
    assert lab_gate({"MEMTOPO_SHARED": str(tmp_path), "MEMTOPO_LAB": "0"}) == "MEMTOPO_LAB=0"
    assert not marker.exists()


def test_no_lab_under_memtopo_shared_means_no_lab_tests(tmp_path: Path) -> None:
    assert lab_gate({"MEMTOPO_SHARED": str(tmp_path)}) == "MEMTOPO_LAB=unset"


def setup(bin_dir: Path) -> subprocess.CompletedProcess[str]:
    """tools/setup.sh for real, against this checkout's .venv. Set up already (tools/test.sh runs
    setup first), it only links; with a stale .venv it would reinstall the package under the tests
    running beside it, so that is refused here instead."""
    stamp = REPO / ".venv" / ".memtopo-setup"
    want = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    if not stamp.is_file() or stamp.read_text().strip() != want:
        pytest.fail("pyproject.toml changed since .venv was set up: run `bash tools/setup.sh` first")
    return subprocess.run(["bash", "tools/setup.sh"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MEMTOPO_BIN_DIR": str(bin_dir), "MEMTOPO_LINK": "1"}, check=False)


# Each runs setup.sh against the one .venv: one at a time, on one xdist worker.
@pytest.mark.xdist_group("tools-setup")
def test_setup_puts_memtopo_on_path_and_it_answers_version(tmp_path: Path) -> None:
    """The README's `memtopo …` works after its setup command: setup links this checkout's entry point
    into the bin directory (a stand-in for /usr/local/bin here, so the test leaves the host alone)."""
    res = setup(tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "memtopo").resolve() == (REPO / ".venv/bin/memtopo").resolve()
    version = __version__  # the one place the version is written (pyproject.toml reads it)
    ran = subprocess.run(["memtopo", "--version"], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert (ran.returncode, ran.stdout) == (0, f"memtopo {version}\n"), ran.stderr


@pytest.mark.xdist_group("tools-setup")
def test_setup_relinks_another_checkout_but_leaves_a_foreign_memtopo_alone(tmp_path: Path) -> None:
    link = tmp_path / "memtopo"
    link.symlink_to("/gone/clone/.venv/bin/memtopo")  # an older checkout's link: the last setup wins
    assert setup(tmp_path).returncode == 0
    assert link.resolve() == (REPO / ".venv/bin/memtopo").resolve()
    link.unlink()
    link.write_text("#!/bin/sh\necho system-wide\n")  # not ours: never overwritten
    res = setup(tmp_path)
    assert res.returncode == 0 and link.read_text() == "#!/bin/sh\necho system-wide\n"
    assert "left alone" in res.stderr


@pytest.mark.xdist_group("tools-setup")
def test_setup_says_how_when_it_cannot_write_the_bin_directory(tmp_path: Path) -> None:
    res = setup(tmp_path / "missing")
    assert res.returncode == 0
    assert f'export PATH="{REPO}/.venv/bin:$PATH"' in res.stderr


def test_setup_installs_without_build_notices_and_then_does_nothing_until_pyproject_changes() -> None:
    """A changed pyproject.toml (here: a stale stamp) reinstalls memtopo; setuptools' notice about
    the flat layout's editable finder is not printed (the README says why it says nothing here).
    Run again, setup installs nothing: the stamp is left as it was."""
    stamp = REPO / ".venv" / ".memtopo-setup"
    want = stamp.read_text()
    stamp.write_text("stale\n")
    try:
        res = setup_quietly()
        assert res.returncode == 0, res.stderr
        out = res.stdout + res.stderr
        assert "Editable installation" not in out and "BuildBackendWarning" not in out, out
        assert "Traceback" not in out
    finally:
        if stamp.read_text() != want:
            stamp.write_text(want)
    before = stamp.stat().st_mtime_ns
    again = setup_quietly()
    assert again.returncode == 0 and (again.stdout, again.stderr) == ("", "")
    assert stamp.stat().st_mtime_ns == before


def setup_quietly() -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "tools/setup.sh"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MEMTOPO_LINK": "0"}, check=False)


def test_the_generated_code_check_says_one_line() -> None:
    """mypy-protobuf's "Writing mypy to …" per stub is not printed: the check says only its verdict."""
    res = subprocess.run(["bash", "tools/gen_proto.sh", "--check"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    assert (res.stdout, res.stderr) == ("generated protobuf code is up to date\n", "")
