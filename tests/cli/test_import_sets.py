"""Each command loads only its own machinery: the modules a fresh process holds after one command,
checked against what that command must never need (grpc for anything but the agent's and the
controller's clients and servers, discovery for a planner decision on a complete request, …)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import HWLOC_XML, REPO

PROBE = r"""
import contextlib, io, json, sys
from memtopo.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(json.dumps(sorted(sys.modules)))
"""

# What the discovery child of a command that reads input from elsewhere (a capture, an export) loads.
CHILD_PROBE = r"""
import contextlib, io, json, os, sys
from memtopo.discovery.isolated import main
with open(os.devnull, "wb") as sink, contextlib.redirect_stdout(io.TextIOWrapper(sink)):
    main(sys.argv[1:])
print(json.dumps(sorted(sys.modules)))
"""

HEAVY = ("grpc", "google.protobuf", "pyhwloc", "memtopo.discovery", "memtopo.agent", "memtopo.controller.server",
         "memtopo.apply.engine", "memtopo.planner.place", "memtopo.v1")


def loaded_by(*argv: str) -> set[str]:
    res = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=REPO, check=True)
    return set(json.loads(res.stdout.splitlines()[-1]))


def loaded_by_child(*argv: str) -> set[str]:
    res = subprocess.run([sys.executable, "-c", CHILD_PROBE, *argv], capture_output=True, text=True, cwd=REPO,
                         check=True)
    return set(json.loads(res.stdout.splitlines()[-1]))


def loaded(modules: set[str], prefix: str) -> list[str]:
    return sorted(m for m in modules if m == prefix or m.startswith(prefix + "."))


@pytest.mark.parametrize("argv", [("--help",), ("--version",), ("plan", "--help"), ("query", "--help"),
                                  ("controller", "nodes", "--help"), ("apply", "--help")])
def test_help_and_version_load_nothing_heavy(argv: tuple[str, ...]) -> None:
    modules = loaded_by(*argv)
    assert "argparse" in modules  # the probe did run the command
    assert not [m for p in HEAVY for m in loaded(modules, p)]


def test_plan_mtf_is_the_xpu_policy_alone() -> None:
    modules = loaded_by("plan", "mtf", "00000011")
    assert "memtopo.planner.xpu" in modules
    for prefix in ("grpc", "google.protobuf", "pyhwloc", "memtopo.discovery", "memtopo.apply.engine",
                   "memtopo.agent", "memtopo.planner.place", "memtopo.planner.hccs"):
        assert not loaded(modules, prefix), prefix


def test_topo_discovers_without_grpc_apply_or_the_planner() -> None:
    """An export (like a captured root) is read by a child process: the command itself never loads hwloc."""
    modules = loaded_by("topo", "--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"), "--format", "json")
    assert "memtopo.discovery.isolated" in modules and "google.protobuf" in modules
    for prefix in ("grpc", "pyhwloc", "memtopo.discovery.hwloc", "memtopo.agent", "memtopo.controller.server",
                   "memtopo.apply.engine", "memtopo.planner.hccs", "memtopo.planner.place"):
        assert not loaded(modules, prefix), prefix


def test_plan_with_a_complete_request_does_not_discover(tmp_path: Path) -> None:
    request = tmp_path / "hccs.json"
    request.write_text(json.dumps({"request": 1, "nodes": [{"name": "n1", "available": [0, 1, 2, 3]}]}))
    modules = loaded_by("plan", "hccs", "--request", str(request))
    assert "memtopo.planner.hccs" in modules
    for prefix in ("grpc", "pyhwloc", "memtopo.discovery", "memtopo.agent"):
        assert not loaded(modules, prefix), prefix


def test_apply_loads_no_grpc() -> None:
    modules = loaded_by("apply", "/nonexistent/plan.json")
    assert "memtopo.cli.apply" in modules
    assert not loaded(modules, "grpc") and not loaded(modules, "memtopo.agent")


def test_query_over_tls_is_a_client_without_the_agent(tmp_path: Path) -> None:
    # A CA file that does not exist: the command stops while making its TLS credentials, the
    # point where it would reach for the agent's transport if it still dialed through it.
    modules = loaded_by("query", "topology", "--addr", "127.0.0.1:1", "--tls-ca", str(tmp_path / "none.pem"))
    assert "memtopo.tls" in modules and "grpc" in modules
    for prefix in ("memtopo.agent", "memtopo.controller.server"):
        assert not loaded(modules, prefix), prefix


def _pin_plan(tmp_path: Path, fingerprint: str = "") -> Path:
    """A plan pinning every thread of this test's own process (the probe is another process, so it
    validates as any target would); applied as a dry run, which validates but changes nothing."""
    import os

    plan = {"plan_id": "imports", "actions": [{"id": "pin", "thread_affinity": {
        "pid": os.getpid(), "threads": {"all": True}, "cpus": sorted(os.sched_getaffinity(0))[:1]}}]}
    if fingerprint:
        plan["topology_fingerprint"] = fingerprint
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_apply_of_a_plan_without_a_fingerprint_does_not_discover(tmp_path: Path) -> None:
    modules = loaded_by("apply", "--dry-run", "--state-dir", str(tmp_path / "state"), str(_pin_plan(tmp_path)))
    # It did validate, from the host facts alone.
    assert "memtopo.apply.hostfacts" in modules and "memtopo.apply.validate" in modules
    for prefix in ("grpc", "pyhwloc", "memtopo.discovery", "memtopo.agent", "memtopo.controller.server",
                   "memtopo.planner.place"):
        assert not loaded(modules, prefix), prefix


def test_apply_of_a_plan_with_a_fingerprint_discovers_to_compare_it(tmp_path: Path) -> None:
    modules = loaded_by("apply", "--dry-run", "--state-dir", str(tmp_path / "state"),
                        str(_pin_plan(tmp_path, fingerprint="0" * 64)))
    assert "memtopo.discovery.discover" in modules
    assert not loaded(modules, "grpc")


VENDOR_PROBES = ("memtopo.discovery.amd", "memtopo.discovery.ascend", "memtopo.discovery.kunlunxin",
                 "memtopo.discovery.nvidia", "memtopo.discovery.nvml_live", "memtopo.discovery.nvml_replay", "pynvml")


@pytest.mark.parametrize("source", ["capture", "xml"])
def test_topo_without_vendor_devices_imports_no_vendor_probe(source: str) -> None:
    """A lab capture (no accelerators, no tool recordings, no NVML recording) and an XML export: every
    vendor's presence check answers "absent" (discovery/presence.py), so its module is never loaded."""
    from tests.fixtures import lab_root

    where = ("--root", str(lab_root("single"))) if source == "capture" else (
        "--hwloc-xml", str(HWLOC_XML / "nvidiaDGX2.xml"))
    modules = loaded_by_child(*where)  # `topo` discovers input from elsewhere in this child
    assert "memtopo.discovery.probes" in modules and "memtopo.discovery.sysfs_pci" in modules
    assert not [m for m in VENDOR_PROBES if m in modules]


@pytest.mark.parametrize("source", ["live", "xml"])
def test_topo_loads_no_archive_code(source: str) -> None:
    """A topology read from the host or an XML file loads no tar code (only a captured archive
    needs it): not in the command, nor in the child that reads the export."""
    if source == "live":
        modules = loaded_by("topo", "--format", "json")
    else:
        xml = str(HWLOC_XML / "nvidiaDGX2.xml")
        assert "tarfile" not in loaded_by("topo", "--hwloc-xml", xml, "--format", "json")
        modules = loaded_by_child("--hwloc-xml", xml)
    assert "pyhwloc.hwloc.core" in modules  # the hwloc probe did run
    assert "tarfile" not in modules
