"""The shared fixtures (``../shared`` beside the checkout, or $MEMTOPO_SHARED) and the synthesized
hosts (tests/fixtures/<host>/root.tar.gz), extracted once (cached across runs under /tmp), and the
changes the benchmarks make to a private copy of one. The test suite reads its fixtures through
here too (tests/fixtures.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

from memtopo.discovery.capture import extract, find_root

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEMTOPO_SHARED", REPO.parent / "shared"))
HWLOC_LINUX = SHARED / "fixtures" / "hwloc" / "linux"
HWLOC_XML = SHARED / "fixtures" / "hwloc" / "xml"
LAB_CAPTURES = SHARED / "lab" / "captures"
SYNTHESIZED = REPO / "tests" / "fixtures"
_CACHE = Path(os.environ.get("MEMTOPO_FIXTURE_CACHE", "/tmp/memtopo-fixture-cache"))


@cache
def extracted(tarball: Path) -> Path:
    """Extract a fixture tarball once (cached across runs under /tmp) and return its root."""
    # Synthesized hosts are all called root.tar.gz and get rebuilt: key by folder, size and mtime.
    st = tarball.stat()
    dest = _CACHE / f"{tarball.parent.name}.{tarball.name}.{st.st_size}.{st.st_mtime_ns}"
    if not dest.exists():
        # Extract beside and rename: parallel processes must never see a half-written tree.
        _CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=_CACHE, prefix=f".{tarball.name}."))
        extract(tarball, tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race; its tree is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    return find_root(dest)


def hwloc_root(name: str) -> Path:
    """Root of hwloc's ``linux/<name>.tar.bz2``."""
    return extracted(HWLOC_LINUX / f"{name}.tar.bz2")


def lab_root(profile: str) -> Path:
    """Root of the numa-vm lab's capture ``<profile>.tar.gz``."""
    return extracted(LAB_CAPTURES / f"{profile}.tar.gz")


def synthesized_root(host: str) -> Path:
    """Root of a synthesized host (tests/fixtures/<host>/root.tar.gz)."""
    return extracted(SYNTHESIZED / host / "root.tar.gz")


def fixture_root(spec: str) -> Path:
    """``lab:NAME``, ``hwloc:NAME`` or ``synth:HOST``, extracted."""
    kind, _, name = spec.partition(":")
    if kind == "lab" and name:
        return lab_root(name)
    if kind == "hwloc" and name:
        return hwloc_root(name)
    if kind == "synth" and name:
        return synthesized_root(name)
    raise ValueError(f"a root is lab:NAME, hwloc:NAME or synth:HOST, not {spec!r}")


def copy_root(src: Path, dst: Path) -> Path:
    """A private copy of a captured root that a benchmark or test may change under a running agent."""
    root = dst / "root"
    shutil.copytree(src, root, symlinks=True)
    return root


def set_node_memory(root: Path, node: int, kib: int) -> None:
    """What onlining memory blocks shows: the node's MemTotal becomes ``kib``."""
    meminfo = root / f"sys/devices/system/node/node{node}/meminfo"
    lines = meminfo.read_text().splitlines()
    out = [f"Node {node} MemTotal:       {kib} kB" if " MemTotal:" in ln else ln for ln in lines]
    meminfo.write_text("\n".join(out) + "\n")
