"""Captured roots: open a directory or tarball as a host root, and gather this host into one.

A capture is a plain tree of /sys and /proc files (the layout hwloc-gather-topology and the numa-vm
lab write), usable both as a memtopo ``--root`` and as ``HWLOC_FSROOT``.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from memtopo.discovery.source import ProbeContext
from memtopo.hostfs import MAX_TREE_FILE_BYTES
from memtopo.text import excerpt

if TYPE_CHECKING:
    import tarfile

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


# A capture is a few MB in a few thousand members; these bound what a hostile archive can cost.
MAX_MEMBERS = 200_000
MAX_MEMBER_BYTES = MAX_TREE_FILE_BYTES
MAX_EXTRACTED_BYTES = 1 << 30
MAX_MEMBER_DEPTH = 64
MAX_MEMBER_NAME = 1024


def extract(tarball: Path, dest: Path) -> Path:
    """Extract safely, member by member: tarfile's "data" filter (no absolute paths, no escapes,
    no devices), and a bound on the member count, each member's and the total size, and the depth
    and length of names. A truncated or corrupt archive is a CaptureError like any other."""
    # Here, not at the top: `topo` on the live host imports this module and never opens an archive.
    import lzma
    import tarfile
    import zlib

    def checked(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
        total = 0
        for members, member in enumerate(tf, 1):
            if members > MAX_MEMBERS:
                raise CaptureError(f"{tarball}: more than {MAX_MEMBERS} members")
            name = member.name
            if len(name) > MAX_MEMBER_NAME or name.count("/") >= MAX_MEMBER_DEPTH:
                raise CaptureError(f"{tarball}: member {excerpt(name, 80)} is nested too deep "
                                   f"(at most {MAX_MEMBER_DEPTH} levels, {MAX_MEMBER_NAME} characters)")
            if member.size > MAX_MEMBER_BYTES:
                raise CaptureError(f"{tarball}: member {excerpt(name, 80)} is {member.size} bytes "
                                   f"(at most {MAX_MEMBER_BYTES})")
            total += member.size
            if total > MAX_EXTRACTED_BYTES:
                raise CaptureError(f"{tarball}: more than {MAX_EXTRACTED_BYTES} bytes once extracted")
            yield member

    try:
        with tarfile.open(tarball) as tf:
            # extractall, not extract one by one: it sets directory modes last, so a read-only
            # directory in the archive does not refuse the files that follow it.
            tf.extractall(dest, members=checked(tf), filter="data")
    except CaptureError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError, ValueError, RecursionError) as exc:
        # EOFError and the codecs' errors are how a truncated .tar.gz/.tar.xz ends.
        why = str(exc) or type(exc).__name__
        raise CaptureError(f"{tarball}: not a readable tar archive: {excerpt(why, 200)}") from exc
    return find_root(dest)


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While a temporary extraction exists, SIGTERM raises in the main thread (where no one else has
    claimed it) so that the ``with`` blocks holding it unwind and remove it, instead of the process
    dying with it left in $TMPDIR."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def open_root(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a directory to use as the root: the path itself, or a temporary extraction of it,
    removed on any exit (an error, SIGTERM)."""
    p = Path(path)
    if p.is_dir():
        yield find_root(p) if not (p / "sys").exists() and not (p / "proc").exists() else p
        return
    if not p.exists():
        raise CaptureError(f"{p}: no such file or directory")
    if not is_tarball(p):
        raise CaptureError(f"{p}: neither a directory nor a tar archive ({', '.join(TAR_SUFFIXES)})")
    import tempfile

    with _sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="memtopo-root-") as tmp:
        yield extract(p, Path(tmp))


@contextlib.contextmanager
def context_for(root: str | os.PathLike[str] | None = None,
                hwloc_xml: str | os.PathLike[str] | None = None) -> Iterator[ProbeContext]:
    """The discovery context of what a command or the agent is pointed at: an hwloc XML export, a
    captured root (a directory, or an archive extracted privately and removed on any exit), or this
    host (no root, "" or "/"). CaptureError for input that cannot be opened."""
    if hwloc_xml is not None:
        xml = Path(hwloc_xml)
        if not xml.exists():
            raise CaptureError(f"{xml}: no such file")
        yield ProbeContext.at_root("/", hwloc_xml=xml.absolute())
        return
    if root is None or str(root) in ("", "/"):
        yield ProbeContext.live()
        return
    with open_root(root) as path:
        yield ProbeContext.at_root(path)


# ---- gather ----------------------------------------------------------------------------------------
# Subtrees copied whole (symlinks kept as symlinks, never followed). Together they are what every
# probe and hwloc's Linux backend read, plus what hwloc-gather-topology leaves out (tiers, CXL, KFD).
GATHER_TREES = (
    "sys/devices/system/node",
    "sys/devices/system/cpu",
    "sys/bus/cpu/devices",
    "sys/bus/node/devices",
    "sys/bus/pci/devices",
    "sys/bus/pci/slots",
    "sys/bus/cxl/devices",
    "sys/bus/dax/devices",
    "sys/bus/dax/drivers",
    "sys/bus/mdev/devices",
    "sys/devices/virtual/memory_tiering",
    "sys/devices/virtual/dmi",
    "sys/kernel/mm/numa",
    "sys/kernel/mm/hugepages",
    "sys/class/kfd",
    # /sys/class/kfd/kfd is a link into here, and the walk does not follow links.
    "sys/devices/virtual/kfd",
    # numa_status per GPU: which NUMA node holds a GPU's memory (GH200, POWER9).
    "proc/driver/nvidia/gpus",
    "sys/class/net",
    "sys/class/infiniband",
    "sys/class/nvme",
    "sys/class/block",
    "sys/class/drm",
    "sys/class/dax",
    "sys/class/accel",
    "proc/irq",
    "proc/driver/nvidia",
)
# Device trees that the /sys/bus links above point into.
GATHER_GLOBS = ("sys/devices/pci*", "sys/devices/platform/ACPI0017:*", "sys/devices/platform/hmem*")
GATHER_FILES = (
    "proc/cpuinfo", "proc/meminfo", "proc/interrupts", "proc/mounts", "proc/stat", "proc/version",
    "proc/cmdline", "proc/self/status", "proc/self/cgroup", "proc/self/mountinfo", "proc/self/cpuset",
    "proc/sys/kernel/hostname", "proc/sys/kernel/random/boot_id", "proc/sys/kernel/numa_balancing",
    "etc/machine-id", "sys/devices/system/memory/block_size_bytes",
    "sys/devices/system/memory/auto_online_blocks",
)
# Attributes that act when read or written, read device registers, or are large and useless here.
GATHER_SKIP_NAMES = frozenset({
    "remove", "rescan", "reset", "bind", "unbind", "new_id", "remove_id", "rom", "vpd",
    "label_storage_area", "trigger_poison_list", "compact", "reclaim", "driver_override",
})
GATHER_SKIP_PREFIXES = ("resource",)
GATHER_SKIP_DIRS = frozenset({"power", "statistics", "queues", "trace", "mq", "holders", "slaves"})
MAX_GATHER_FILE = 64 * 1024


def gather(out: Path, root: Path = Path("/"), recorded: Mapping[str, str] | None = None) -> int:
    """Write a capture of ``root`` to ``out`` (a .tar.gz/.tar.xz/.tar); returns the entry count.

    ``recorded`` adds in-memory files (tool outputs, NVML answers: see discovery.record).

    Unreadable attributes are skipped: a capture is for reading back, and an attribute the host
    refuses to give (EIO, EACCES, write-only) is absent in the capture as it is to any reader.
    """
    import tarfile

    count = 0
    seen: set[str] = set()
    with _open_for_writing(out) as tf:
        def add(rel: str) -> None:
            nonlocal count
            if rel in seen:
                return
            seen.add(rel)
            if _add_entry(tf, root, rel):
                count += 1

        for rel in _gather_paths(root):
            add(rel)
        for rel, text in sorted((recorded or {}).items()):
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tf.addfile(info, io.BytesIO(data))
            count += 1
    return count


def _open_for_writing(out: Path) -> tarfile.TarFile:
    import tarfile

    if out.name.endswith((".gz", ".tgz")):
        return tarfile.open(out, "w:gz")
    if out.name.endswith((".xz", ".txz")):
        return tarfile.open(out, "w:xz")
    return tarfile.open(out, "w")


def _gather_paths(root: Path) -> list[str]:
    paths: list[str] = []
    trees = list(GATHER_TREES)
    for pattern in GATHER_GLOBS:
        parent, _, glob = pattern.rpartition("/")
        trees += [f"{parent}/{p.name}" for p in sorted((root / parent).glob(glob))]
    trees += _cgroup_dirs(root)
    for tree in trees:
        paths += _walk(root, tree)
    paths += [f for f in GATHER_FILES if (root / f).exists()]
    return paths


def _walk(root: Path, tree: str) -> list[str]:
    start = root / tree
    if not start.exists() and not start.is_symlink():
        return []
    if start.is_symlink() or not start.is_dir():
        return [tree]
    out = [tree]
    for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        keep = []
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if os.path.islink(full):
                out.append(f"{rel_dir}/{d}")
            elif d not in GATHER_SKIP_DIRS:
                keep.append(d)
                out.append(f"{rel_dir}/{d}")
        dirnames[:] = keep
        out += [f"{rel_dir}/{f}" for f in filenames
                if f not in GATHER_SKIP_NAMES and not f.startswith(GATHER_SKIP_PREFIXES)]
    return out


def _cgroup_dirs(root: Path) -> list[str]:
    """The cpuset cgroup directories of this process (and their parents), for the allowed probe."""
    out: list[str] = []
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            bases = ["sys/fs/cgroup", "sys/fs/cgroup/unified"]
        elif "cpuset" in controllers.split(","):
            bases = ["sys/fs/cgroup/cpuset"]
        else:
            continue
        for base in bases:
            parts = [p for p in path.split("/") if p and p != ".."]
            for depth in range(len(parts) + 1):
                d = "/".join([base, *parts[:depth]])
                if (root / d).is_dir():
                    out += [f"{d}/{f.name}" for f in (root / d).iterdir()
                            if f.name.startswith(("cpuset.", "cgroup.controllers", "cgroup.subtree_control"))]
    return out


def _add_entry(tf: tarfile.TarFile, root: Path, rel: str) -> bool:
    import tarfile

    full = root / rel
    info = tarfile.TarInfo(rel)
    info.mtime = 0
    try:
        st = full.lstat()
        if full.is_symlink():
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(full)
            tf.addfile(info)
            return True
        if full.is_dir():
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(info)
            return True
        if not (st.st_mode & 0o444):
            return False
        with full.open("rb") as fh:
            data = fh.read(MAX_GATHER_FILE + 1)
    except OSError:
        return False
    if len(data) > MAX_GATHER_FILE:
        return False
    info.size, info.mode = len(data), 0o644
    tf.addfile(info, io.BytesIO(data))
    return True
