"""The numa-vm lab (a real multi-NUMA kernel under QEMU, in the shared checkout): where it is, and
the marks its tests carry. They run when MEMTOPO_LAB=1 (tools/test.sh sets it after `numa-vm setup`
succeeded) and share one xdist group: each boot takes the machine's cores for minutes, so under
`pytest -n` they run one after another on one worker while the others take the rest of the suite
(xdist starts the groups with the most tests first, this one among them)."""

from __future__ import annotations

import os

import pytest

from tests.fixtures import SHARED

NUMA_VM = SHARED / "lab" / "numa-vm"
LAB_GROUP = "numa-vm"

lab_marks = [
    pytest.mark.lab,
    pytest.mark.xdist_group(LAB_GROUP),
    pytest.mark.skipif(os.environ.get("MEMTOPO_LAB") != "1", reason="MEMTOPO_LAB=1 not set (lab not set up)"),
]
