"""Access to the shared fixtures (../shared beside the checkout), extracted once per test session."""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from functools import cache
from pathlib import Path

from memtopo.discovery.capture import extract, find_root
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import topology_pb2 as pb

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEMTOPO_SHARED", REPO.parent / "shared"))
HWLOC_LINUX = SHARED / "fixtures" / "hwloc" / "linux"
HWLOC_XML = SHARED / "fixtures" / "hwloc" / "xml"
LAB_CAPTURES = SHARED / "lab" / "captures"
# The synthesized hosts (tests/fixtures/<host>/root.tar.gz, built by tests/synth.py).
SYNTH = REPO / "tests" / "fixtures"
_CACHE = Path(os.environ.get("MEMTOPO_FIXTURE_CACHE", "/tmp/memtopo-fixture-cache"))


@cache
def extracted(tarball: Path) -> Path:
    """Extract a fixture tarball once (cached across runs under /tmp) and return its root."""
    # Synthesized hosts are all called root.tar.gz and get rebuilt: key by folder, size and mtime.
    st = tarball.stat()
    dest = _CACHE / f"{tarball.parent.name}.{tarball.name}.{st.st_size}.{st.st_mtime_ns}"
    if not dest.exists():
        # Extract beside and rename: parallel test processes must never see a half-written tree.
        _CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=_CACHE, prefix=f".{tarball.name}."))
        extract(tarball, tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race; its tree is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    return find_root(dest)


def hwloc_root(name: str) -> Path:
    """Root of ``linux/<name>.tar.bz2``."""
    return extracted(HWLOC_LINUX / f"{name}.tar.bz2")


def lab_root(profile: str) -> Path:
    return extracted(LAB_CAPTURES / f"{profile}.tar.gz")


def hwloc_test_env(test_name: str) -> dict[str, str]:
    """The ``env:`` lines of an hwloc ``.test`` file (``export X`` lines are no-ops)."""
    env: dict[str, str] = {}
    for line in (HWLOC_LINUX / f"{test_name}.test").read_text().splitlines():
        if not line.startswith("env:"):
            continue
        body = line[4:].strip()
        if body.startswith("export "):
            continue
        key, _, value = body.partition("=")
        (val,) = shlex.split(value) or [""]
        env[key.strip()] = val
    return env


@cache
def _discovered(path: Path) -> bytes:
    ctx = ProbeContext.at_root("/", hwloc_xml=path) if path.suffix == ".xml" else ProbeContext.at_root(extracted(path))
    return discover(ctx).SerializeToString()


def discovered(path: Path) -> pb.MemoryTopology:
    """The topology of a fixture (a capture tarball or an hwloc XML export), discovered once per test
    process for every module that reads it; each call returns a copy of its own to change."""
    return pb.MemoryTopology.FromString(_discovered(path))
