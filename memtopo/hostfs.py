"""Reading a host's /sys and /proc under a root, so every probe runs unchanged on a captured tree.

All paths are relative to the root ("sys/devices/system/node"). Under a captured root every lookup
stays inside it: the root is the ``/`` of its paths, so ``..`` stops at it and an absolute symlink
means that path *in the capture* (sysfs's own relative links, ``../../../devices/…``, resolve as on
the host they came from). The kernel does that walk itself (``openat2`` with ``RESOLVE_IN_ROOT``);
where it cannot, the same walk is done here one component at a time with ``O_NOFOLLOW``. Reads are
of regular files only (a FIFO or a device in a capture is an error, never a wait or an endless
stream) and bounded in size. Reads return typed errors that the probe turns into a degraded
status: nothing here raises anything but :class:`HostReadError`.

The live root (``/``) is the kernel's own tree and is read directly.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import struct
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memtopo.cpulist import CpuListError, parse_cpulist, parse_mask
from memtopo.model import frozen
from memtopo.text import excerpt

# A text file (/proc/self/mountinfo, a node's meminfo, a distance row of a 1024-node machine).
MAX_ATTR_BYTES = 1 << 20
# A one-record attribute: the kernel prints those into one page, and pages are 64 KiB at most.
MAX_RECORD_BYTES = 1 << 16
_READ_CHUNK = 1 << 16
# A kernel list attribute is one line; a single read this size that comes back full is read again.
RECORD_CHUNK = 1 << 14
# Symlinks followed in one lookup before it is refused (the kernel's own MAXSYMLINKS).
MAX_SYMLINKS = 40
_TREE_CHECK_LOCK = threading.Lock()

_O_PATH = getattr(os, "O_PATH", 0)
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_DIR_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY | os.O_NONBLOCK
_PATH_FLAGS = _O_PATH | os.O_CLOEXEC


class HostReadError(Exception):
    """A host file that is missing, unreadable or malformed. ``path`` is root-relative."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _os_reason(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "missing"
    if exc.errno == errno.ELOOP:
        return "too many levels of symbolic links"
    return exc.strerror or type(exc).__name__


# ---- confined lookup -------------------------------------------------------------------------------
_SYS_OPENAT2 = 437  # the same number on every architecture (it is in the generic syscall table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_IN_ROOT = 0x10
_AT_FDCWD = -100


class _Openat2:
    """openat2(2) through libc's syscall(), or None where the kernel or a seccomp filter lacks it."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._call = libc.syscall
        self._call.restype = ctypes.c_long
        self._call.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t)
        self._how: dict[int, bytes] = {}

    def __call__(self, dirfd: int, rel: str, flags: int,
                 resolve: int = _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS) -> int:
        how = self._how.get(flags | resolve << 32)
        if how is None:
            how = self._how[flags | resolve << 32] = struct.pack("=QQQ", flags, 0, resolve)
        fd = self._call(_SYS_OPENAT2, dirfd, os.fsencode(rel), how, 24)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return int(fd)


@functools.cache
def _openat2() -> _Openat2 | None:
    """The kernel's in-root walk when this process may use it (Linux 5.6+, no seccomp refusal)."""
    try:
        call = _Openat2()
        root = os.open("/", _PATH_FLAGS | os.O_DIRECTORY)
    except (OSError, AttributeError):
        return None
    try:
        os.close(call(root, ".", _PATH_FLAGS))
    except OSError:
        return None
    finally:
        os.close(root)
    return call


def open_without_symlinks(path: str, flags: int) -> int | None:
    """``path`` opened with ``flags`` where none of its components is a symlink, the kernel checking
    that in the open itself (openat2, RESOLVE_NO_SYMLINKS): OSError as open(2) raises it, ELOOP for a
    symlink anywhere on the way. None where this process cannot use openat2."""
    call = _openat2()
    return call(_AT_FDCWD, path, flags, _RESOLVE_NO_SYMLINKS) if call is not None else None


def _walk(root_fd: int, rel: str, flags: int) -> tuple[int, list[str]]:
    """Open ``rel`` below ``root_fd`` as openat2's RESOLVE_IN_ROOT would, one component at a time:
    every component opened with O_NOFOLLOW, every symlink read and spliced in by hand (an absolute
    one restarting at the root, ``..`` never above it). Returns the fd and the resolved components."""
    # "." and empty components stay: after a name they require it to be a directory ("file/." is
    # ENOTDIR for the kernel too).
    pending = [p or "." for p in reversed(rel.split("/"))]
    names: list[str] = []
    fds: list[int] = []  # the open directories of ``names``
    links = 0
    try:
        while pending:
            name = pending.pop()
            if name == ".":
                continue
            if name == "..":
                if names:
                    names.pop()
                    os.close(fds.pop())
                continue
            parent = fds[-1] if fds else root_fd
            last = not pending
            target: str | None = None
            try:
                fd = os.open(name, (flags if last else _PATH_FLAGS | os.O_DIRECTORY) | os.O_NOFOLLOW,
                             dir_fd=parent)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                try:
                    target = os.readlink(name, dir_fd=parent)
                except OSError:
                    raise exc from None
            else:
                if last and flags & _O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):
                    os.close(fd)
                    target = os.readlink(name, dir_fd=parent)
            if target is None:
                if last:
                    return fd, [*names, name]
                names.append(name)
                fds.append(fd)
                continue
            links += 1
            if links > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
            if target.startswith("/"):
                names.clear()
                while fds:
                    os.close(fds.pop())
            pending.extend(p or "." for p in reversed(target.lstrip("/").split("/")))
        # Every component was ``..`` or a link back up: the lookup ends at a directory.
        return os.open(".", flags, dir_fd=fds[-1] if fds else root_fd), names
    finally:
        for fd in fds:
            os.close(fd)


def _no_climb(rel: str) -> str:
    """``rel``, refused (OSError, EXDEV) where a ``..`` component could climb above where it starts."""
    if ".." in rel and ".." in rel.split("/"):
        raise OSError(errno.EXDEV, "path leaves the root")
    return rel


def attr_value(record: str) -> str:
    """A one-value attribute's record, stripped (some captured trees pad files with NULs)."""
    return record.strip().strip("\0").strip()


def int_value(rel: str, record: str, base: int = 10) -> int:
    """The integer in the record of ``rel``; HostReadError where there is none."""
    text = attr_value(record)
    try:
        return int(text, base)
    except ValueError as exc:
        raise HostReadError(rel, f"not an integer: {excerpt(text)}") from exc


class HostReads:
    """What both a root (HostFS) and a directory held open under it (HostDir) read, by a path
    relative to themselves: the record and link reads each provides, and the parsing shared by both."""

    def read_record(self, rel: str) -> str:
        raise NotImplementedError

    def readlink(self, rel: str) -> str:
        raise NotImplementedError

    def listdir(self, rel: str) -> list[str]:
        raise NotImplementedError

    def root_relative(self, rel: str) -> str:
        """How an error names ``rel``: by its path relative to the root."""
        return rel

    def read_attr(self, rel: str) -> str:
        """A one-value sysfs attribute, stripped (some captured trees pad files with NULs)."""
        return attr_value(self.read_record(rel))

    def read_int(self, rel: str, base: int = 10) -> int:
        """An integer attribute. ``base=0`` accepts the ``%#llx`` form (``0x…``, or ``0``)."""
        return int_value(self.root_relative(rel), self.read_record(rel), base)

    def read_cpulist(self, rel: str) -> tuple[int, ...]:
        text = self.read_record(rel)
        try:
            return parse_cpulist(text)
        except CpuListError as exc:
            raise HostReadError(self.root_relative(rel), str(exc)) from exc

    def read_mask(self, rel: str) -> tuple[int, ...]:
        text = self.read_record(rel)
        try:
            return parse_mask(text)
        except CpuListError as exc:
            raise HostReadError(self.root_relative(rel), str(exc)) from exc

    def readlink_name(self, rel: str) -> str:
        """The last component of a symlink's target (``driver`` → ``nvme``)."""
        return os.path.basename(self.readlink(rel))


@frozen
class HostFS(HostReads):
    """A filesystem root ("/" on the live host, or a captured tree)."""

    root: Path

    @functools.cached_property
    def _root_str(self) -> str:
        root = str(self.root)
        return "" if root == "/" else root

    @functools.cached_property
    def _root_fd(self) -> int:
        """The root, held open for the in-root lookups of a captured tree; closed with this object."""
        try:
            fd = os.open(self.root, _PATH_FLAGS | os.O_DIRECTORY)
        except OSError as exc:
            raise HostReadError("", f"root {excerpt(str(self.root), 200)}: {_os_reason(exc)}") from exc
        weakref.finalize(self, os.close, fd)
        return fd

    @property
    def tree_problems(self) -> tuple[str, ...]:
        """check_tree of a captured root, made once per HostFS, on first use (a root is checked when
        it is opened, as a tarball's members are when it is extracted); the live root has none."""
        return self.once("tree_problems", lambda: tuple(check_tree(self.root)) if self._root_str else ())

    def once[T](self, key: str, compute: Callable[[], T]) -> T:
        """``compute()``, made once per HostFS (per ``key``) on first use: a check of a captured root
        holds for as long as it is open, as the tree check does."""
        made: dict[str, Any] | None = self.__dict__.get("_once")
        if made is None or key not in made:
            with _TREE_CHECK_LOCK:  # probes on several threads ask at once: compute once
                made = self.__dict__.setdefault("_once", {})
                if key not in made:
                    made[key] = compute()
        found: T = made[key]
        return found

    @property
    def _confined(self) -> bool:
        """Whether lookups must be made inside the root one by one: a captured tree that holds a
        link out of it, a FIFO, a device or an oversized file. A tree without any (every real
        capture) is read by plain paths, which then cannot leave it, at the cost they always had."""
        # Asked on every read: answered from the instance once known.
        confined: bool | None = self.__dict__.get("_confined_known")
        if confined is None:
            confined = bool(self._root_str) and bool(self.tree_problems)
            self.__dict__["_confined_known"] = confined
        return confined

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> HostFS:
        return cls(Path(root).absolute())

    @property
    def is_live(self) -> bool:
        return self.root == Path("/")

    def path(self, rel: str) -> Path:
        """The absolute path of ``rel`` under the root, refusing ``..`` components. A path only:
        what it names may be a link out of the root; read through this class, not through it."""
        return Path(self.join(rel))

    def join(self, rel: str) -> str:
        # Plain strings, not pathlib: discovery makes thousands of these per run.
        rel = rel.lstrip("/")
        if ".." in rel and ".." in rel.split("/"):
            raise HostReadError(rel, "path leaves the root")
        return f"{self._root_str}/{rel}" if rel else (self._root_str or "/")

    def open_fd(self, rel: str, flags: int) -> int:
        """An fd for ``rel`` opened with ``flags``; under a captured root looked up inside it.
        Raises OSError (callers turn it into HostReadError)."""
        if not self._confined:
            return os.open(self.join(rel), flags)
        rel = _no_climb(rel.lstrip("/"))
        call = _openat2()
        if call is not None:
            try:
                return call(self._root_fd, rel or ".", flags)
            except OSError as exc:
                if exc.errno != errno.EAGAIN:  # a concurrent rename: walk it by hand instead
                    raise
        return _walk(self._root_fd, rel, flags)[0]

    def _stat(self, rel: str) -> os.stat_result | None:
        try:
            if not self._confined:
                return os.stat(self.join(rel))
            fd = self.open_fd(rel, _PATH_FLAGS)
        except (HostReadError, OSError):
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def exists(self, rel: str) -> bool:
        return self._stat(rel) is not None

    def is_dir(self, rel: str) -> bool:
        st = self._stat(rel)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def is_file(self, rel: str) -> bool:
        st = self._stat(rel)
        return st is not None and stat.S_ISREG(st.st_mode)

    def listdir(self, rel: str) -> list[str]:
        """Sorted entries of a directory; a missing directory is an empty list, not an error."""
        try:
            if not self._confined:
                return sorted(os.listdir(self.join(rel)))
            fd = self.open_fd(rel, _DIR_FLAGS)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc
        try:
            return sorted(os.listdir(fd))
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc
        finally:
            os.close(fd)

    def _open(self, rel: str, limit: int) -> int:
        """A regular file opened for reading, no larger than ``limit`` (a captured root's). In a
        tree that failed the check, what the lookup found is looked at (an O_PATH handle, fstat)
        before it is opened for reading, so a device is never opened and a FIFO never waited on;
        the reopen goes through the handle (/proc/self/fd), not the path, so it is the same file."""
        if not self._confined:
            # The kernel's own files (sysfs and procfs sizes say nothing: 4096, 0), or a checked
            # tree of regular files; O_NONBLOCK all the same, and the read loops stop at the limit.
            try:
                return self.open_fd(rel, _READ_FLAGS)
            except OSError as exc:
                raise HostReadError(rel, _os_reason(exc)) from exc
        try:
            handle = self.open_fd(rel, _PATH_FLAGS)
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc
        try:
            st = os.fstat(handle)
            if not stat.S_ISREG(st.st_mode):
                raise HostReadError(rel, f"not a regular file ({_kind(st.st_mode)})")
            if st.st_size > limit:
                raise HostReadError(rel, f"larger than {limit} bytes ({st.st_size})")
            try:
                fd = os.open(f"/proc/self/fd/{handle}", _READ_FLAGS)
            except FileNotFoundError:  # no /proc here: look it up again, and check what was opened
                fd = self.open_fd(rel, _READ_FLAGS)
                again = os.fstat(fd)
                if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
                    os.close(fd)
                    raise HostReadError(rel, "changed while it was opened") from None
            return fd
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc
        finally:
            os.close(handle)

    @staticmethod
    def _decode(rel: str, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HostReadError(rel, "not UTF-8 text") from exc

    def read_text(self, rel: str, limit: int = MAX_ATTR_BYTES) -> str:
        return self._decode(rel, self.read_bytes(rel, limit))

    def read_bytes(self, rel: str, limit: int = MAX_ATTR_BYTES) -> bytes:
        # os.read with a page-sized buffer: a buffered read(MAX) allocates the whole limit per call,
        # which dominated discovery on machines with thousands of attributes.
        fd = self._open(rel, limit)
        try:
            chunks = []
            total = 0
            while chunk := os.read(fd, _READ_CHUNK):
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise HostReadError(rel, f"larger than {limit} bytes")
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc
        finally:
            os.close(fd)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_record(self, rel: str) -> str:
        """A one-record kernel attribute (``/proc/irq/N/*``, a cgroup or sysfs file), unstripped, in
        one read(2): its show routine fills the buffer at once, so a short read is all of it and the
        read that would return 0 is saved. A read that fills the buffer is read again in full."""
        return self.record_of(rel, self._open(rel, MAX_RECORD_BYTES))

    def record_of(self, rel: str, fd: int) -> str:
        """read_record's read of ``rel`` opened as ``fd`` (closed here)."""
        try:
            data = os.read(fd, RECORD_CHUNK)
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc
        finally:
            os.close(fd)
        return self.record_text(rel, data)

    def record_text(self, rel: str, data: bytes) -> str:
        """The text of ``rel`` from one read of at most RECORD_CHUNK bytes (a full one may have more)."""
        return self.read_text(rel, MAX_RECORD_BYTES) if len(data) >= RECORD_CHUNK else self._decode(rel, data)

    def readlink(self, rel: str) -> str:
        """A symlink's target text, unresolved (sysfs links are relative: ``../../../devices/…``).
        Under a captured root the directory holding it is looked up inside the root."""
        try:
            if not self._confined:
                return os.readlink(self.join(rel))
            parent, _, name = rel.strip("/").rpartition("/")
            if name in ("", ".", ".."):
                raise OSError(errno.EINVAL, "not a symbolic link")
            fd = self.open_fd(parent, _PATH_FLAGS | os.O_DIRECTORY)
            try:
                return os.readlink(name, dir_fd=fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc

    def open_dir(self, rel: str) -> HostDir:
        """``rel``, a directory, held open for reads of its entries by name (close it, or use it as a
        context manager). Raises HostReadError where it is missing or not a directory."""
        if self._confined:
            if not self.is_dir(rel):
                raise HostReadError(rel, "missing, or not a directory")
            return HostDir(self, rel, None)
        try:
            fd = os.open(self.join(rel), _DIR_FLAGS)
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc
        return HostDir(self, rel, fd)

    def resolve(self, rel: str) -> str:
        """The root-relative real path of ``rel`` (it must exist), resolved inside the root."""
        if not self._confined:
            try:
                real = os.path.realpath(self.join(rel), strict=True)
                root = os.path.realpath(self.root)
            except OSError as exc:
                raise HostReadError(rel, _os_reason(exc)) from exc
            if root == "/":
                return real.lstrip("/")
            if not real.startswith(root + "/"):  # a checked tree has no such link: belt and braces
                raise HostReadError(rel, "resolves outside the root")
            return real[len(root) + 1:]
        try:
            fd, names = _walk(self._root_fd, rel.lstrip("/"), _PATH_FLAGS)
        except OSError as exc:
            raise HostReadError(rel, _os_reason(exc)) from exc
        os.close(fd)
        return "/".join(names)


class HostDir(HostReads):
    """A directory under a root held open, its entries read by a path relative to it.

    A read through HostFS looks its path up from the root: for a PCI function's attribute that is
    tens of components and the bus's link to the device, and on a host with hundreds of functions
    the lookups cost more than the reads. Here the directory is looked up once. Under a root whose
    lookups are confined (a tree that failed the check) nothing is held: each read is HostFS's own,
    by the joined path, so the in-root walk and its checks stay in one place. Errors name the
    root-relative path."""

    def __init__(self, fs: HostFS, rel: str, fd: int | None) -> None:
        self.fs = fs
        self.rel = rel.strip("/")
        self._fd = fd

    def __enter__(self) -> HostDir:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def root_relative(self, rel: str) -> str:
        return f"{self.rel}/{rel}" if rel else self.rel

    def _open_at(self, rel: str, flags: int) -> int:
        assert self._fd is not None
        return os.open(_no_climb(rel), flags, dir_fd=self._fd)

    def names(self) -> set[str]:
        """The directory's entries, unordered (what a reader asks "has it?" of)."""
        if self._fd is None:
            return set(self.fs.listdir(self.rel))
        try:
            return set(os.listdir(self._fd))  # of a duplicate, rewound: the held fd stays usable
        except OSError as exc:
            raise HostReadError(self.rel, _os_reason(exc)) from exc

    def listdir(self, rel: str = "") -> list[str]:
        """Sorted entries of the directory (``""``) or of one below it; a missing one is empty."""
        if self._fd is None:
            return self.fs.listdir(self.root_relative(rel))
        if not rel:
            return sorted(self.names())
        try:
            fd = self._open_at(rel, _DIR_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise HostReadError(self.root_relative(rel), _os_reason(exc)) from exc
        try:
            return sorted(os.listdir(fd))
        except OSError as exc:
            raise HostReadError(self.root_relative(rel), _os_reason(exc)) from exc
        finally:
            os.close(fd)

    def read_record(self, rel: str) -> str:
        if self._fd is None:
            return self.fs.read_record(self.root_relative(rel))
        path = self.root_relative(rel)
        try:
            fd = self._open_at(rel, _READ_FLAGS)
        except OSError as exc:
            raise HostReadError(path, _os_reason(exc)) from exc
        return self.fs.record_of(path, fd)

    def readlink(self, rel: str) -> str:
        if self._fd is None:
            return self.fs.readlink(self.root_relative(rel))
        try:
            return os.readlink(_no_climb(rel), dir_fd=self._fd)
        except OSError as exc:
            raise HostReadError(self.root_relative(rel), _os_reason(exc)) from exc

    def open_dir(self, rel: str) -> HostDir:
        """A directory below this one held open (see HostFS.open_dir)."""
        if self._fd is None:
            return self.fs.open_dir(self.root_relative(rel))
        try:
            fd = self._open_at(rel, _DIR_FLAGS)
        except OSError as exc:
            raise HostReadError(self.root_relative(rel), _os_reason(exc)) from exc
        return HostDir(self.fs, self.root_relative(rel), fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return f"mode {mode:o}"


# ---- one file of memtopo's own (a config, a journal) ------------------------------------------------
class NotRegularFileError(OSError):
    """The path is a FIFO, a device, a socket or a directory; ``strerror`` says which."""


def read_regular(path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = True) -> bytes:
    """At most ``limit`` + 1 bytes of a regular file, so that the caller can tell one that is larger.

    O_NONBLOCK: opening a FIFO for reading would block until a writer appears, so the kind is checked
    on the open descriptor, never before it (a device is opened but never read). Without
    ``follow_symlinks`` a link is refused (ELOOP). Raises OSError only: NotRegularFileError for what
    is not a regular file."""
    flags = _READ_FLAGS | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(0, f"not a regular file ({_kind(mode)})")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


# ---- a tree handed to another reader -----------------------------------------------------------------
# hwloc reads a captured root itself (HWLOC_FSROOT), with plain opens that follow every link against
# the real / and read FIFOs and devices as files. Before it may, the tree is checked to be one it can
# read safely: only directories, regular files (of bounded size) and relative links whose target
# stays strictly below the root whatever the links it passes through resolve to.
MAX_TREE_ENTRIES = 1_000_000
MAX_TREE_FILE_BYTES = 64 << 20
# PCI functions a host may have: 16 PFs with 1,000 VFs each, and then some. hwloc's and our work
# grow with each entry of the bus directory (100,000 broken entries kept hwloc busy for minutes).
MAX_PCI_FUNCTIONS = 16_384
DIR_LIMITS = {"sys/bus/pci/devices": MAX_PCI_FUNCTIONS}
# The kernel's cpumasks ("%*pb": 32-bit words in hex, comma-separated), which hwloc parses word by
# word with sscanf, and sscanf measures the rest of the text on every call: a mask of n words costs
# n²/2 byte reads, so the 64 KiB any attribute may have would keep hwloc busy for minutes over a few
# thousand of them. A kernel prints at most KERNEL_MAX_CPUS bits (256 words, 2304 bytes).
MAX_CPUMASK_BYTES = 4096
CPUMASK_FILES = ("cpumap", "local_cpus", "shared_cpu_map", "thread_siblings", "core_siblings", "core_cpus",
                 "cluster_cpus", "die_cpus", "package_cpus", "book_siblings", "drawer_siblings")
FILE_LIMITS = dict.fromkeys(CPUMASK_FILES, MAX_CPUMASK_BYTES)
_PROBLEMS_KEPT = 5


def check_tree(root: Path, max_entries: int = MAX_TREE_ENTRIES,
               max_file_bytes: int = MAX_TREE_FILE_BYTES) -> list[str]:
    """What makes the tree under ``root`` unsafe to hand to a reader that follows links, opens
    FIFOs and reads files whole: the first few entries (root-relative, quoted), and how many more.
    Empty when it is safe."""
    problems: list[str] = []
    more = 0
    seen = 0
    pending: list[tuple[str, int]] = [("", 0)]
    base = str(root)

    def problem(rel: str, why: str) -> None:
        nonlocal more
        if len(problems) < _PROBLEMS_KEPT:
            problems.append(f"{excerpt(rel, 120)}: {why}")
        else:
            more += 1

    while pending:
        rel_dir, depth = pending.pop()
        try:
            it = os.scandir(f"{base}/{rel_dir}" if rel_dir else base)
        except OSError as exc:
            problem(rel_dir or ".", _os_reason(exc))
            continue
        limit = DIR_LIMITS.get(rel_dir)
        with it:
            for count, entry in enumerate(it, 1):
                if limit is not None and count > limit:
                    problem(rel_dir, f"more than {limit} entries")
                    break
                seen += 1
                if seen > max_entries:
                    problems.append(f"more than {max_entries} entries")
                    return problems
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                try:
                    if entry.is_symlink():
                        why = _link_problem(os.readlink(entry.path), depth)
                        if why:
                            problem(rel, why)
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append((rel, depth + 1))
                    elif entry.is_file(follow_symlinks=False):
                        size = entry.stat(follow_symlinks=False).st_size
                        most = min(max_file_bytes, FILE_LIMITS.get(entry.name, max_file_bytes))
                        if size > most:
                            problem(rel, f"larger than {most} bytes ({size})")
                    else:
                        problem(rel, f"not a regular file ({_kind(entry.stat(follow_symlinks=False).st_mode)})")
                except OSError as exc:
                    problem(rel, _os_reason(exc))
    if more:
        problems.append(f"and {more} more")
    return problems


def _link_problem(target: str, depth: int) -> str | None:
    """Why a link in a directory ``depth`` levels below the root may lead out of it, or None.

    Safe: relative, its ``..`` all leading and fewer than ``depth`` (so it lands strictly below the
    root), then only downward names. Every link passed on the way is held to the same rule, so no
    walk through links climbs out; sysfs's own links (``../../../devices/pci0000:00/…``) are this form.
    """
    if target.startswith("/"):
        return f"absolute link to {excerpt(target, 80)}"
    parts = [p for p in target.split("/") if p not in ("", ".")]
    up = 0
    while up < len(parts) and parts[up] == "..":
        up += 1
    if ".." in parts[up:]:
        return f"link {excerpt(target, 80)} climbs after descending"
    if up > depth or (up == depth and up == len(parts)):
        return f"link {excerpt(target, 80)} leaves the root"
    return None
