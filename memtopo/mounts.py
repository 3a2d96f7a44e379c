"""The mount table and a process's cgroups, as /proc writes them: where the cgroup hierarchies are.
Read by discovery (the agent's own allowed CPUs) and by apply (the cpuset a plan writes)."""

from __future__ import annotations

from memtopo.hostfs import HostFS, HostReadError
from memtopo.model import frozen

MOUNTINFO = "proc/self/mountinfo"
MOUNTS = "proc/mounts"


@frozen
class Mount:
    mount_point: str  # host-absolute
    root: str  # the hierarchy path mounted there ("/" unless bind-mounted or namespaced)
    fstype: str
    options: frozenset[str]


def cgroup_mounts(fs: HostFS) -> tuple[list[Mount], list[HostReadError]]:
    """cgroup/cgroup2/cpuset mounts, from mountinfo (which has the mount root) or /proc/mounts; and
    what could not be read on the way (a missing mountinfo is no problem: old kernels lack it)."""
    problems: list[HostReadError] = []
    try:
        text = fs.read_text(MOUNTINFO)
    except HostReadError as exc:
        if exc.reason != "missing":
            problems.append(exc)
    else:
        out: list[Mount] = []
        for line in text.split("\n"):
            # id parent major:minor root mount-point options [optional...] - fstype source super-options
            head, sep, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if not sep or len(fields) < 5 or len(rest) < 2:
                continue
            if rest[0] in ("cgroup", "cgroup2", "cpuset"):
                opts = rest[2].split(",") if len(rest) > 2 else []
                out.append(Mount(unescape(fields[4]), unescape(fields[3]), rest[0], frozenset(opts)))
        return out, problems
    try:
        text = fs.read_text(MOUNTS)
    except HostReadError as exc:
        return [], [*problems, exc]
    out = []
    for line in text.split("\n"):
        # source mount-point fstype options dump pass
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2", "cpuset"):
            out.append(Mount(unescape(fields[1]), "/", fields[2], frozenset(fields[3].split(","))))
    return out, problems


def unescape(field: str) -> str:
    """The kernel writes space, tab, newline and backslash in mount paths as octal escapes."""
    if "\\" not in field:
        return field
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(esc, ch)
    return field


@frozen
class ProcCgroups:
    """A process's cgroup paths from ``/proc/PID/cgroup``: the v1 cpuset line and the v2 line."""

    v1_cpuset: str | None
    v2: str | None


def parse_proc_cgroup(text: str) -> ProcCgroups:
    v1: str | None = None
    v2: str | None = None
    for line in text.split("\n"):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        # A task whose cgroup was removed shows "<path> (deleted)".
        path = path.removesuffix(" (deleted)")
        if hier == "0" and controllers == "":
            v2 = path
        elif "cpuset" in controllers.split(","):
            v1 = path
    return ProcCgroups(v1, v2)
