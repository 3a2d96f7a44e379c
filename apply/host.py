"""Every effect the apply engine has on a host goes through this module.

Three parts, all replaceable in tests:

* :class:`Kernel`: the system calls (thread affinity, memory policy, page migration). The real one
  is :class:`LinuxKernel`; tests use a fake that records calls and fails on demand.
* :class:`HostFiles`: reads and writes under a filesystem root (``/`` live, a fake tree in tests).
  Reads go through :class:`memtopo.hostfs.HostFS`; writes are confined to a few prefixes (the
  cgroup mount, ``proc/irq``) and refuse ``..``, absolute paths and symlinks that leave them.
  Subclasses override only the primitives ``_write``/``_write_read``/``_mkdir``/``_rmdir`` to
  emulate a kernel filesystem; the checks stay here (one overriding ``_write`` alone gets its
  write-then-read as a write through it and a separate read).
* a :class:`memtopo.runner.Runner` for the one tool the engine may run (``systemctl``).
* :class:`StateFiles`: the few primitives the journal and the results are written with (write,
  fdatasync, reserve, release, truncate): where a full disk shows, so tests can answer ENOSPC or a
  short write at any of them without filling a filesystem.

:class:`Procs` reads process state (``/proc/PID/…``) through the same root.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import os
import platform
import re
import stat
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from memtopo.apply.errors import HostWriteError, KernelCallError, PathEscapeError
from memtopo.cpulist import CpuListError, format_cpulist, parse_cpulist
from memtopo.hostfs import RECORD_CHUNK, HostFS, HostReadError, open_without_symlinks
from memtopo.mounts import ProcCgroups, parse_proc_cgroup
from memtopo.runner import Runner, SubprocessRunner

Ids = tuple[int, ...]

# include/uapi/linux/mempolicy.h (MPOL_LOCAL since 3.8).
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_LOCAL = 4

# Syscall numbers from asm/unistd (aarch64 uses asm-generic's); glibc wraps none of these.
_SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {"set_mempolicy": 238, "get_mempolicy": 239, "migrate_pages": 256},
    "aarch64": {"set_mempolicy": 237, "get_mempolicy": 236, "migrate_pages": 238},
}
_SYSCALLS["arm64"] = _SYSCALLS["aarch64"]

# Enough for any kernel's MAX_NUMNODES (NODES_SHIFT ≤ 10) and below the one-page limit the kernel
# puts on maxnode (maxnode − 1 above a page's worth of bits is EINVAL).
NODEMASK_BITS = 4096
_WORD_BITS = 64

# include/linux/sched.h: set for kernel threads; their affinity is not ours to change.
PF_KTHREAD = 0x00200000

# numa_maps and /proc/interrupts grow with the machine (one line per VMA, one column per CPU).
MAX_PROC_BYTES = 64 << 20
# A kernel attribute written and read back through one descriptor; no O_CREAT (a missing attribute
# means the wrong path, never a file to make).
_WRITE_READ_FLAGS = os.O_RDWR | os.O_TRUNC | os.O_CLOEXEC


@dataclass(frozen=True)
class Affinities:
    """Per-TID masks in the order asked; ``None`` where the call failed (its errno in ``errors``)."""

    masks: list[set[int] | None]
    errors: dict[int, int]


class Kernel(Protocol):
    def get_affinities(self, tids: Sequence[int]) -> Affinities: ...

    def set_affinities(self, tids: Sequence[int], cpus: AbstractSet[int]) -> dict[int, int]:
        """Set every TID's mask; returns {tid: errno} for the ones that failed."""
        ...

    def migrate_pages(self, pid: int, old_nodes: Iterable[int], new_nodes: Iterable[int]) -> int:
        """migrate_pages(2): the number of pages that could not be moved."""
        ...

    def set_mempolicy(self, mode: int, nodes: Iterable[int]) -> None: ...

    def get_mempolicy(self) -> tuple[int, Ids]: ...


def nodemask(nodes: Iterable[int], bits: int = NODEMASK_BITS) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    """An ``unsigned long`` bitmap and the ``maxnode`` to pass with it (bits + 1: the kernel reads
    ``maxnode - 1`` bits, a historic off-by-one in get_nodes())."""
    words = (ctypes.c_ulong * (bits // _WORD_BITS))()
    for n in nodes:
        if not 0 <= n < bits:
            raise KernelCallError(f"nodemask (node {n})", 22)  # EINVAL, as the kernel would answer
        words[n // _WORD_BITS] |= 1 << (n % _WORD_BITS)
    return words, bits + 1


def nodes_of(mask: Iterable[int]) -> Ids:
    """Node ids set in an ``unsigned long`` bitmap."""
    out: list[int] = []
    for w, word in enumerate(mask):
        bit = 0
        while word:
            if word & 1:
                out.append(w * _WORD_BITS + bit)
            word >>= 1
            bit += 1
    return tuple(out)


class LinuxKernel:
    """The real system calls: ``os.sched_*`` for affinity, ``syscall(2)`` through ctypes for the
    mempolicy family (numbers per architecture, from the kernel's unistd tables)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._nr = _SYSCALLS.get(platform.machine(), {})

    def _syscall(self, name: str, *args: object) -> int:
        nr = self._nr.get(name)
        if nr is None:
            raise KernelCallError(f"{name} (no syscall number for {platform.machine()})", 38)  # ENOSYS
        ctypes.set_errno(0)
        rc: int = self._libc.syscall(ctypes.c_long(nr), *args)
        if rc < 0:
            raise KernelCallError(name, ctypes.get_errno())
        return rc

    def get_affinities(self, tids: Sequence[int]) -> Affinities:
        get = os.sched_getaffinity
        try:
            # map() instead of a loop: this runs once per thread of a possibly huge process.
            return Affinities(list(map(get, tids)), {})
        except OSError:
            pass
        masks: list[set[int] | None] = []
        errors: dict[int, int] = {}
        for tid in tids:
            try:
                masks.append(get(tid))
            except OSError as exc:
                masks.append(None)
                errors[tid] = exc.errno or 0
        return Affinities(masks, errors)

    def set_affinities(self, tids: Sequence[int], cpus: AbstractSet[int]) -> dict[int, int]:
        setaff = os.sched_setaffinity
        try:
            list(map(setaff, tids, itertools.repeat(cpus)))
            return {}
        except OSError:
            pass
        # Some thread failed (usually one that just exited): redo one by one to learn which, so the
        # rest are still pinned. Setting a mask twice is harmless.
        errors: dict[int, int] = {}
        for tid in tids:
            try:
                setaff(tid, cpus)
            except OSError as exc:
                errors[tid] = exc.errno or 0
        return errors

    def migrate_pages(self, pid: int, old_nodes: Iterable[int], new_nodes: Iterable[int]) -> int:
        old, maxnode = nodemask(old_nodes)
        new, _ = nodemask(new_nodes)
        return self._syscall("migrate_pages", ctypes.c_int(pid), ctypes.c_ulong(maxnode),
                             ctypes.byref(old), ctypes.byref(new))

    def set_mempolicy(self, mode: int, nodes: Iterable[int]) -> None:
        mask, maxnode = nodemask(nodes)
        self._syscall("set_mempolicy", ctypes.c_int(mode), ctypes.byref(mask), ctypes.c_ulong(maxnode))

    def get_mempolicy(self) -> tuple[int, Ids]:
        mode = ctypes.c_int(-1)
        mask, maxnode = nodemask(())
        self._syscall("get_mempolicy", ctypes.byref(mode), ctypes.byref(mask), ctypes.c_ulong(maxnode),
                      ctypes.c_void_p(0), ctypes.c_ulong(0))
        return mode.value, nodes_of(mask)


# ---- files under a root ---------------------------------------------------------------------------
class _ReadBackError(OSError):
    """The read after a successful write failed."""


@functools.lru_cache(maxsize=256)
def cpulist(text: str) -> Ids:
    """:func:`parse_cpulist`, remembered: an apply reads the same few lists (the CPUs of a
    socket, every CPU) from dozens of IRQ and cgroup files. Raises CpuListError (not cached)."""
    return parse_cpulist(text)


@functools.lru_cache(maxsize=256)
def cpulist_text(ids: Ids) -> str:
    """:func:`format_cpulist` of a sorted tuple, remembered for the same reason."""
    return format_cpulist(ids)


def _check_rel(rel: str) -> str:
    if "\0" in rel:
        raise PathEscapeError(rel.replace("\0", "\\0"), "NUL in path")
    if rel.startswith("/"):
        raise PathEscapeError(rel, "absolute path; paths are relative to the host root")
    parts = rel.split("/")
    if "" in parts or "." in parts or ".." in parts:  # list membership in C: runs once per write
        raise PathEscapeError(rel, "empty, '.' or '..' path component")
    return rel


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


class HostFiles:
    """Reads anywhere under the root; writes only below the writable prefixes (root-relative)."""

    # False in a subclass that overrides ``_write`` (a fake kernel filesystem): write_read then
    # writes through it and reads separately.
    _plain_writes: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._plain_writes = cls._write is HostFiles._write or cls._write_read is not HostFiles._write_read

    def __init__(self, fs: HostFS, writable: Iterable[str] = ()) -> None:
        self.fs = fs
        self._root_real = os.path.realpath(fs.root)
        self._root_slash = self._root_real.rstrip("/") + "/"
        self._writable: tuple[str, ...] = ()
        self._writable_real: tuple[str, ...] = ()
        self._writable_match: tuple[tuple[str, str, str], ...] = ()
        self.allow_writes(writable)

    @property
    def writable(self) -> tuple[str, ...]:
        return self._writable

    def allow_writes(self, prefixes: Iterable[str]) -> None:
        """Add write prefixes (found at run time: the cgroup mount comes from the mount table)."""
        new = [_check_rel(p.strip("/")) for p in prefixes if p.strip("/")]
        if all(p in self._writable for p in new):
            return  # every apply re-adds the same two; their resolution stands
        self._writable = tuple(dict.fromkeys((*self._writable, *new)))
        self._writable_real = tuple(os.path.realpath(os.path.join(self._root_real, p)) for p in self._writable)
        self._writable_match = tuple((p, p.rstrip("/") + "/", real)
                                     for p, real in zip(self._writable, self._writable_real, strict=True))

    # Reads: HostFS's error type, plus a bigger limit for files that grow with the machine.
    def read_text(self, rel: str) -> str:
        return self.fs.read_text(rel)

    def read_big(self, rel: str, limit: int = MAX_PROC_BYTES) -> str:
        path = self.fs.path(rel)
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError as exc:
            raise HostReadError(rel, "missing") from exc
        except OSError as exc:
            raise HostReadError(rel, exc.strerror or type(exc).__name__) from exc
        if len(data) > limit:
            raise HostReadError(rel, f"larger than {limit} bytes")
        return data.decode("utf-8", "replace")

    def read_record(self, rel: str) -> str:
        return self.fs.read_record(rel)

    def read_ids(self, rel: str) -> Ids:
        """A kernel list file (``0-3,8``)."""
        text = self.fs.read_record(rel)
        try:
            return cpulist(text)
        except CpuListError as exc:
            raise HostReadError(rel, str(exc)) from exc

    def exists(self, rel: str) -> bool:
        return self.fs.exists(rel)

    def is_dir(self, rel: str) -> bool:
        return self.fs.is_dir(rel)

    def listdir(self, rel: str) -> list[str]:
        try:
            return self.fs.listdir(rel)
        except HostReadError:
            return []

    def writable_by_us(self, rel: str) -> bool:
        """access(W_OK): false on a read-only /proc or without privilege (root ignores mode bits)."""
        try:
            return os.access(self._root_slash + _check_rel(rel), os.W_OK)  # the checked rel is relative
        except (PathEscapeError, OSError):
            return False

    def resolve_inside(self, rel: str, top: str) -> str | None:
        """Why ``rel`` is not inside ``top`` once symlinks in its existing part are resolved, or None."""
        try:
            _check_rel(rel)
        except PathEscapeError as exc:
            return exc.reason
        top_real = os.path.realpath(os.path.join(self._root_real, top))
        # The deepest existing ancestor decides: a missing tail cannot hold a symlink yet.
        probe = os.path.join(self._root_real, rel)
        while not os.path.lexists(probe) and probe != self._root_real:
            probe = os.path.dirname(probe)
        if not _inside(os.path.realpath(probe), top_real):
            return f"resolves outside /{top} (symlink)"
        return None

    # Writes: the checks, then one primitive.
    def _check_real(self, rel: str, real: str) -> str:
        if not any(_inside(real, p) for p in self._writable_real):
            raise PathEscapeError(rel, "resolves outside the writable prefixes (symlink)")
        return real

    def _below(self, rel: str) -> tuple[str, str]:
        """(the real path of ``rel``'s writable prefix, the rest of ``rel`` below it), or PathEscapeError."""
        _check_rel(rel)
        # _inside(rel, prefix) for each prefix, with their "/"-terminated forms built once.
        match = next((m for m in self._writable_match if rel == m[0] or rel.startswith(m[1])), None)
        if match is None:
            raise PathEscapeError(rel, f"not below a writable prefix ({', '.join(self._writable) or 'none'})")
        prefix, _, real = match
        return real, rel[len(prefix):].strip("/")

    def _target(self, rel: str) -> str:
        """The real path to write, or PathEscapeError. The prefix was resolved once; below it each
        component is lstat'ed (cheaper than realpath's walk from /) and a symlink is followed and
        checked again."""
        path, below = self._below(rel)
        comps = below.split("/") if below else []
        for i, comp in enumerate(comps):
            path = f"{path}/{comp}"
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                # Missing from here on: nothing below can be a symlink yet (mkdir creates, write fails).
                rest = "/".join(comps[i + 1:])
                return f"{path}/{rest}" if rest else path
            if stat.S_ISLNK(mode):
                path = self._check_real(rel, os.path.realpath(path))
        return path

    def write(self, rel: str, text: str) -> None:
        path = self._target(rel)
        try:
            self._write(path, text.encode())
        except OSError as exc:
            raise HostWriteError.from_os(rel, exc) from exc

    def write_read(self, rel: str, text: str) -> str:
        """Write, then read the file back: what the kernel now holds (``/proc/irq/N/*``). Through
        the write's own descriptor when the file is the real one (a read at offset 0 of a kernel
        attribute runs its show routine again), which saves an open and a close. The file must be
        readable. A write error is HostWriteError; a read error HostReadError."""
        if not self._plain_writes:
            # A subclass emulating a kernel filesystem decides what a write does: read after it.
            self.write(rel, text)
            return self.fs.read_record(rel)
        try:
            if type(self)._write_read is HostFiles._write_read:
                data = self._write_read_fd(self._open_below(rel, _WRITE_READ_FLAGS), text.encode())
            else:
                data = self._write_read(self._target(rel), text.encode())
        except _ReadBackError as exc:
            raise HostReadError(rel, exc.strerror or type(exc).__name__) from exc
        except OSError as exc:
            raise HostWriteError.from_os(rel, exc) from exc
        return self.fs.record_text(rel, data)

    def _open_below(self, rel: str, flags: int) -> int:
        """``rel`` opened below its writable prefix. Where no component is a symlink the kernel checks
        that in the open itself (openat2: one system call for an IRQ file, where the walk makes three);
        a symlink on the way, or no openat2 here, takes the walk (_target), which follows links that
        stay below a prefix and refuses the others."""
        real, below = self._below(rel)
        try:
            fd = open_without_symlinks(f"{real}/{below}" if below else real, flags)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            fd = None
        return fd if fd is not None else os.open(self._target(rel), flags)

    def mkdir(self, rel: str) -> None:
        path = self._target(rel)
        try:
            self._mkdir(path)
        except OSError as exc:
            raise HostWriteError.from_os(rel, exc) from exc

    def rmdir(self, rel: str) -> None:
        path = self._target(rel)
        try:
            self._rmdir(path)
        except OSError as exc:
            raise HostWriteError.from_os(rel, exc) from exc

    def _write(self, path: str, data: bytes) -> None:
        # One write(2): kernel attribute files parse exactly one buffer per call. No O_CREAT: a
        # missing attribute means the wrong path, never a file to make.
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _write_read(self, path: str, data: bytes) -> bytes:
        # As _write, opened for reading too; a failed read is a _ReadBackError (the write held).
        return self._write_read_fd(os.open(path, _WRITE_READ_FLAGS), data)

    @staticmethod
    def _write_read_fd(fd: int, data: bytes) -> bytes:
        """One write(2) to ``fd``, then what a read at offset 0 gives; closes ``fd``."""
        try:
            os.write(fd, data)
            try:
                return os.pread(fd, RECORD_CHUNK, 0)
            except OSError as exc:
                raise _ReadBackError(exc.errno, exc.strerror) from exc
        finally:
            os.close(fd)

    def _mkdir(self, path: str) -> None:
        os.mkdir(path, 0o755)

    def _rmdir(self, path: str) -> None:
        os.rmdir(path)


# ---- the state directory's writes -----------------------------------------------------------------
class StateFiles:
    """System calls on the state directory's open files. Errors are OSError; the journal turns
    them into StateError. ``write`` returns what write(2) returns: a short count is the caller's
    to notice (a filesystem that fills up mid-write answers with one)."""

    def write(self, fd: int, data: bytes | memoryview) -> int:
        return os.write(fd, data)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def allocate(self, fd: int, length: int) -> bool:
        """Give the file ``length`` bytes of real blocks (posix_fallocate). False where the
        filesystem cannot; ENOSPC raises."""
        try:
            os.posix_fallocate(fd, 0, length)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise
        return True


def write_all(io: StateFiles, fd: int, data: bytes) -> None:
    """Every byte or OSError: a short write is retried for the rest, and a write that makes no
    progress is the full disk it stands for (ENOSPC)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = io.write(fd, view[done:])
        if n <= 0:
            raise OSError(errno.ENOSPC, f"short write ({done} of {len(view)} bytes)")
        done += n


# ---- processes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    flags: int
    num_threads: int
    # Clock ticks after boot: with the pid it names one process for its whole life (pids recycle).
    starttime: int

    @property
    def is_kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def parse_stat(text: str) -> ProcStat | None:
    """``/proc/PID/stat``; the comm may hold spaces and parentheses, so split at the last ')'."""
    head, sep, tail = text.rpartition(")")
    pid_s, paren, comm = head.partition(" (")
    rest = tail.split()
    if not sep or not paren or len(rest) < 20:
        return None
    try:
        return ProcStat(int(pid_s), comm, rest[0], int(rest[1]), int(rest[6]), int(rest[17]), int(rest[19]))
    except ValueError:
        return None


_NUMA_N = re.compile(r"(?:^|\s)N(\d{1,5})=(\d{1,20})(?=\s|$)")


def parse_numa_maps(text: str) -> dict[int, int]:
    """Pages per node summed over every mapping (``N<node>=<pages>`` tokens, one line per VMA). Garbage → {}."""
    out: dict[int, int] = {}
    for node_s, pages_s in _NUMA_N.findall(text):
        node = int(node_s)
        out[node] = out.get(node, 0) + int(pages_s)
    return dict(sorted(out.items()))


class Procs:
    """Process state under the root. Missing processes are ``None``/empty, never an exception."""

    def __init__(self, files: HostFiles) -> None:
        self.files = files

    def stat(self, pid: int) -> ProcStat | None:
        # The main thread's own stat first: for the fields read here (state, flags, thread count,
        # start time) it says what /proc/PID/stat says, without the kernel summing every thread's
        # counters for it (0.4 ms for a process of a thousand threads). A root without it (a
        # capture) has the process's.
        files = self.files
        try:
            return parse_stat(files.read_text(f"proc/{pid}/task/{pid}/stat"))
        except HostReadError:
            pass
        try:
            return parse_stat(files.read_text(f"proc/{pid}/stat"))
        except HostReadError:
            return None

    def starttime(self, pid: int) -> int | None:
        st = self.stat(pid)
        return st.starttime if st is not None else None

    def tids(self, pid: int) -> list[int]:
        # os.listdir directly: HostFS sorts, and this runs on processes with thousands of threads.
        try:
            names = os.listdir(self.files.fs.join(f"proc/{pid}/task"))
        except (OSError, HostReadError):
            return []
        try:
            return list(map(int, names))
        except ValueError:  # not procfs: keep what looks like a tid
            return [int(n) for n in names if n.isdigit()]

    def comm(self, pid: int, tid: int) -> str | None:
        try:
            return self.files.read_text(f"proc/{pid}/task/{tid}/comm").rstrip("\n")
        except HostReadError:
            return None

    def status(self, pid: int) -> dict[str, str]:
        try:
            text = self.files.read_text(f"proc/{pid}/status")
        except HostReadError:
            return {}
        out: dict[str, str] = {}
        for line in text.split("\n"):
            key, sep, value = line.partition(":")
            if sep:
                out[key] = value.strip()
        return out

    def cgroups(self, pid: int) -> ProcCgroups | None:
        try:
            return parse_proc_cgroup(self.files.read_text(f"proc/{pid}/cgroup"))
        except HostReadError:
            return None

    def numa_pages(self, pid: int) -> dict[int, int] | None:
        try:
            return parse_numa_maps(self.files.read_big(f"proc/{pid}/numa_maps"))
        except HostReadError:
            return None

    def pids(self) -> list[int]:
        return [int(n) for n in self.files.listdir("proc") if n.isdigit()]


def parse_proc_locks(text: str) -> dict[tuple[int, int, int], set[int]]:
    """``/proc/locks``: {(major, minor, inode): pids holding a lock on it}; blocked waiters
    (``->`` lines) are not holders. A line that does not parse is skipped."""
    out: dict[tuple[int, int, int], set[int]] = {}
    for line in text.split("\n"):
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        if pid > 0:
            out.setdefault(key, set()).add(pid)
    return out


def flock_holders(files: HostFiles, paths: Iterable[str]) -> dict[int, str]:
    """Processes holding a lock on any of these (live) files, from ``/proc/locks``: {pid: path}.
    The kernel drops a lock with its holder, so a stale file names no one (a pid file could)."""
    wanted: dict[tuple[int, int, int], str] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        wanted[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = path
    if not wanted:
        return {}
    try:
        locks = parse_proc_locks(files.read_big("proc/locks"))
    except HostReadError:
        return {}
    return {pid: wanted[key] for key, pids in locks.items() if key in wanted for pid in pids}


@dataclass(frozen=True)
class Host:
    """One host as the engine sees it: its system calls, its files, and its tools (systemctl)."""

    kernel: Kernel
    files: HostFiles
    runner: Runner = field(default_factory=SubprocessRunner)
    # Where /proc/PID is read when it is not under ``files`` (an agent in a container with the
    # host's /proc mounted elsewhere; a benchmark with real processes and a fake IRQ tree).
    proc_files: HostFiles | None = None
    # The state directory's writes (journal, results).
    state: StateFiles = field(default_factory=StateFiles)

    @functools.cached_property
    def procs(self) -> Procs:
        return Procs(self.proc_files or self.files)

    @classmethod
    def live(cls) -> Host:
        return cls(LinuxKernel(), HostFiles(HostFS.at("/")))
