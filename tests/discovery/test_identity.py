"""host.identity on synthetic roots and this host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memtopo.discovery import identity
from memtopo.discovery.source import ProbeContext, State
from tests.fixtures import hwloc_root, lab_root
from tests.sysfs_tree import write_tree

BOOT = "proc/sys/kernel/random/boot_id"


def test_all_three_from_proc_and_etc(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "proc/sys/kernel/hostname": "node-7", "etc/hostname": "stale-name",
        "etc/machine-id": "0123456789abcdef0123456789abcdef", BOOT: "a1a0de25-20ac-41d3-916a-f2d598a42b9b",
    })
    res = identity.probe(ProbeContext.at_root(root))
    assert res.status.state is State.OK
    assert res.data.node_name == "node-7"  # the running kernel's name wins over /etc
    assert res.data.machine_id == "0123456789abcdef0123456789abcdef"
    assert res.data.boot_id == "a1a0de25-20ac-41d3-916a-f2d598a42b9b"


def test_fallbacks(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "etc/hostname": "# set by installer\nbackup-host\n", "var/lib/dbus/machine-id": "feedface" * 4,
        BOOT: "b",
    })
    res = identity.probe(ProbeContext.at_root(root))
    assert res.status.state is State.OK
    assert (res.data.node_name, res.data.machine_id) == ("backup-host", "feedface" * 4)


def test_missing_pieces_degrade(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {"etc/machine-id": "", "proc/sys/kernel/hostname": "h"})
    res = identity.probe(ProbeContext.at_root(root))
    assert res.status.state is State.DEGRADED
    assert (res.data.node_name, res.data.machine_id, res.data.boot_id) == ("h", "", "")
    reasons = " | ".join(res.status.reasons)
    assert "machine id" in reasons and "etc/machine-id: empty" in reasons and BOOT in reasons


def test_hwloc_dump_has_no_identity() -> None:
    res = identity.probe(ProbeContext.at_root(hwloc_root("2arm-2c")))
    assert res.status.state is State.DEGRADED
    assert res.data.machine_id == "" and res.data.boot_id == ""


def test_lab_capture_has_no_identity_files() -> None:
    # The lab captures hold proc/ and sys/ subsets without kernel/hostname: a degraded, not failed, source.
    res = identity.probe(ProbeContext.at_root(lab_root("single")))
    assert res.status.state is State.DEGRADED
    assert len(res.status.reasons) == 3


def test_xml_input_is_unavailable() -> None:
    assert identity.probe(ProbeContext.at_root("/", hwloc_xml=Path("x.xml"))).status.state is State.UNAVAILABLE


@pytest.mark.skipif(not os.path.exists("/proc/sys/kernel/random/boot_id"), reason="no boot_id")
def test_live_host() -> None:
    res = identity.probe(ProbeContext.live())
    assert res.data.node_name == os.uname().nodename
    assert res.data.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    if os.path.exists("/etc/machine-id") and Path("/etc/machine-id").read_text().strip():
        assert res.data.machine_id == Path("/etc/machine-id").read_text().strip()
        assert res.status.state is State.OK
