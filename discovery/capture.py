"""Captured roots: open a directory or tarball as a host root, and gather this host into one.

A capture is a plain tree of /sys and /proc files (the layout hwloc-gather-topology and the numa-vm
lab write), usable both as a memtopo ``--root`` and as ``HWLOC_FSROOT``.
"""

from __future__ import annotations

import contextlib
import os
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")


class CaptureError(Exception):
    """A root that cannot be opened: not a directory, a bad archive, or an unsafe archive."""


def is_tarball(path: Path) -> bool:
    return path.is_file() and path.name.endswith(TAR_SUFFIXES)


def find_root(extracted: Path) -> Path:
    """The directory holding ``sys``/``proc``: the extraction dir itself, or its one top-level dir.

    hwloc's tarballs wrap the tree in a single directory whose name can differ from the tarball's.
    """
    if (extracted / "sys").is_dir() or (extracted / "proc").is_dir():
        return extracted
    dirs = [p for p in extracted.iterdir() if p.is_dir()]
    if len(dirs) == 1:
        return dirs[0]
    raise CaptureError(f"{extracted}: no sys/ or proc/ and not exactly one top-level directory")


def extract(tarball: Path, dest: Path) -> Path:
    """Extract safely (tarfile's "data" filter: no absolute paths, no escapes, no devices)."""
    try:
        with tarfile.open(tarball) as tf:
            tf.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise CaptureError(f"{tarball}: {exc}") from exc
    return find_root(dest)


@contextlib.contextmanager
def open_root(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a directory to use as the root: the path itself, or a temporary extraction of it."""
    p = Path(path)
    if p.is_dir():
        yield find_root(p) if not (p / "sys").exists() and not (p / "proc").exists() else p
        return
    if not is_tarball(p):
        raise CaptureError(f"{p}: neither a directory nor a tar archive ({', '.join(TAR_SUFFIXES)})")
    with tempfile.TemporaryDirectory(prefix="memtopo-root-") as tmp:
        yield extract(p, Path(tmp))
