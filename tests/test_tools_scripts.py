"""The scripts a newcomer runs first (tools/*.sh), run for real against stand-in paths."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
