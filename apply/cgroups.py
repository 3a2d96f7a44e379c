"""The cpuset hierarchy the engine writes to: cgroup v1 ``cpuset`` controller or cgroup v2.

Detected from the mount table under the host root: a v1 mount with
the cpuset controller wins (these machines are hybrid: v1 controllers plus a v2 mount that only
has hugetlb); otherwise a cgroup2 mount whose root ``cgroup.controllers`` lists cpuset.
Cgroup paths here are relative to the hierarchy root, without a leading slash ("" is the root).
"""

from __future__ import annotations

import os
import select
import weakref
from dataclasses import dataclass

from memtopo.apply.host import HostFiles
from memtopo.hostfs import HostReadError
from memtopo.mounts import MOUNTINFO, cgroup_mounts

# v1 with the usual "cpuset." prefix, v1 mounted with noprefix (or the old cpuset fs), v2.
_V1 = ("cpuset.cpus", "cpuset.mems", "cpuset.effective_cpus", "cpuset.effective_mems")
_V1_NOPREFIX = ("cpus", "mems", "effective_cpus", "effective_mems")
_V2 = ("cpuset.cpus", "cpuset.mems", "cpuset.cpus.effective", "cpuset.mems.effective")


@dataclass(frozen=True)
class Hierarchy:
    version: int
    # Root-relative directory of the mount ("sys/fs/cgroup/cpuset").
    mount: str
    # The hierarchy path mounted there ("/" unless a container bind-mounted a sub-tree).
    mount_root: str = "/"
    noprefix: bool = False

    @property
    def names(self) -> tuple[str, str, str, str]:
        if self.version == 2:
            return _V2
        return _V1_NOPREFIX if self.noprefix else _V1

    @property
    def cpus_file(self) -> str:
        return self.names[0]

    @property
    def mems_file(self) -> str:
        return self.names[1]

    @property
    def effective_cpus_file(self) -> str:
        return self.names[2]

    @property
    def effective_mems_file(self) -> str:
        return self.names[3]

    def dir(self, path: str) -> str:
        """Root-relative directory of a cgroup path."""
        path = path.strip("/")
        return f"{self.mount}/{path}" if path else self.mount

    def file(self, path: str, name: str) -> str:
        return f"{self.dir(path)}/{name}"

    def from_proc(self, proc_path: str) -> str | None:
        """A ``/proc/PID/cgroup`` path as a path under this mount; None when it is outside it."""
        root = self.mount_root.rstrip("/")
        if root and proc_path != root and not proc_path.startswith(root + "/"):
            return None
        return proc_path[len(root):].strip("/")

    def describe(self) -> str:
        return f"cgroup v{self.version} cpuset at /{self.mount}"


def detect(files: HostFiles, forced_version: int = 0) -> Hierarchy | str:
    """The cpuset hierarchy, or why there is none usable."""
    mounts, problems = cgroup_mounts(files.fs)
    if not mounts:
        why = "; ".join(str(p) for p in problems)
        return f"no cgroup mount in the mount table{': ' + why if why else ''}"
    v1 = next((m for m in mounts if m.fstype == "cpuset"
               or (m.fstype == "cgroup" and "cpuset" in m.options)), None)
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    if v1 is not None and forced_version in (0, 1):
        return Hierarchy(1, v1.mount_point.strip("/"), v1.root or "/",
                         v1.fstype == "cpuset" or "noprefix" in v1.options)
    if v2 is not None and forced_version in (0, 2):
        mount = v2.mount_point.strip("/")
        try:
            controllers = files.read_text(f"{mount}/cgroup.controllers").split()
        except HostReadError as exc:
            return f"cgroup v2 at /{mount}: {exc.reason}"
        if "cpuset" not in controllers:
            return f"cgroup v2 at /{mount} has no cpuset controller (controllers: {' '.join(controllers) or 'none'})"
        return Hierarchy(2, mount, v2.root or "/")
    wanted = f"cgroup v{forced_version} " if forced_version else ""
    return f"no {wanted}cpuset hierarchy mounted"


class MountWatch:
    """Tells whether this process's mount table changed since the last call, at the cost of one
    ``poll``: procfs marks an open ``/proc/self/mountinfo`` with POLLPRI|POLLERR after any mount or
    unmount in its namespace, and the poll that reports it re-arms it (proc(5), "mountinfo").
    Only on the live procfs: a captured or fake tree's file is a plain file, which never reports
    a change, so there every call says "changed" (nothing is ever cached wrongly)."""

    def __init__(self, files: HostFiles) -> None:
        self._poll: select.poll | None = None
        self._close: weakref.finalize[[int], MountWatch] | None = None
        if not files.fs.is_live:
            return
        try:
            fd = os.open(files.fs.join(MOUNTINFO), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        # Closed with the watch (an Engine per CLI call or test must not leak descriptors).
        self._close = weakref.finalize(self, os.close, fd)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLPRI | select.POLLERR)

    @property
    def armed(self) -> bool:
        return self._poll is not None

    def changed(self) -> bool:
        if self._poll is None:
            return True
        try:
            events = self._poll.poll(0)
        except OSError:
            return True
        return any(ev & (select.POLLPRI | select.POLLERR | select.POLLNVAL) for _, ev in events)

    def close(self) -> None:
        if self._close is not None:
            self._close()
        self._poll = None


class HierarchyCache:
    """:func:`detect`, kept until the mount table changes. The answer depends only on the mount
    table and, for cgroup v2, the root's ``cgroup.controllers``; a controller moves between v1 and
    v2 only by mounting or unmounting a v1 hierarchy, which the watch sees too. Every apply,
    rollback and recovery asks, so re-reading and parsing mountinfo each time cost more than the
    cpuset write it is for."""

    def __init__(self, files: HostFiles, forced_version: int = 0) -> None:
        self.files = files
        self.forced_version = forced_version
        self._watch: MountWatch | None = None
        self._value: Hierarchy | str | None = None

    def get(self) -> tuple[Hierarchy | str, bool]:
        """The hierarchy, and whether it was detected afresh by this call."""
        if self._watch is None:
            self._watch = MountWatch(self.files)
        # Poll before reading: a mount between the two shows at the next call.
        if self._value is None or self._watch.changed():
            self._value = detect(self.files, self.forced_version)
            return self._value, True
        return self._value, False


def normalize(path: str) -> str:
    return path.strip("/")


def path_problem(path: str, prefixes: tuple[str, ...], max_len: int = 4096) -> str | None:
    """Why a plan's cgroup path may not be used, or None: syntax, then the configured prefixes."""
    if "\0" in path or "\n" in path:
        return "cgroup path contains NUL or newline"
    if len(path) > max_len:
        return f"cgroup path longer than {max_len} characters"
    p = normalize(path)
    if not p:
        return "the cpuset hierarchy root cannot be changed by a plan"
    for comp in p.split("/"):
        if comp in ("", ".", ".."):
            return f"cgroup path {path!r} has an empty, '.' or '..' component"
        if len(comp) > 255:
            return "cgroup path component longer than 255 characters"
    if not any(p == pre.strip("/") or p.startswith(pre.strip("/") + "/") for pre in prefixes if pre.strip("/")):
        allowed = ", ".join(pre.strip("/") for pre in prefixes) or "none configured"
        return f"cgroup path {p!r} is outside the configured cgroup prefixes ({allowed})"
    return None
