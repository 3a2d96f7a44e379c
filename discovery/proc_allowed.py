"""The CPUs and memory nodes this process may use: /proc/self/status and its cpuset cgroup.

The cgroup's hierarchy (v1 ``cpuset`` or v2 with the cpuset controller) is found from the mount
table; mount points are host-absolute and are read under the root like everything else.
"""

from __future__ import annotations

from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.discovery.parts import Allowed, Ids
from memtopo.discovery.source import ProbeContext, ProbeResult, StatusBuilder
from memtopo.hostfs import HostReadError
from memtopo.hostinfo import ALLOWED_KEYS, STATUS, allowed_lists
from memtopo.mounts import Mount, cgroup_mounts, parse_proc_cgroup

SOURCE = "proc.allowed"

CGROUP = "proc/self/cgroup"
# Legacy single-line cpuset path; the only cgroup file some captures (hwloc's) have.
SELF_CPUSET = "proc/self/cpuset"
CPU_ONLINE = "sys/devices/system/cpu/online"
NODE_ONLINE = "sys/devices/system/node/online"

# (effective cpus, effective mems, requested cpus, requested mems) file names per hierarchy kind.
_V1_FILES = ("cpuset.effective_cpus", "cpuset.effective_mems", "cpuset.cpus", "cpuset.mems")
# The pre-cgroup "cpuset" filesystem (mount -t cpuset), and v1 mounted with `noprefix`, drop the prefix.
_LEGACY_FILES = ("effective_cpus", "effective_mems", "cpus", "mems")
_V2_FILES = ("cpuset.cpus.effective", "cpuset.mems.effective", "", "")

EMPTY = Allowed(cpus=(), mems=(), cgroup_version=0, cgroup_path="", effective_cpus=(), effective_mems=())


def probe(ctx: ProbeContext) -> ProbeResult[Allowed]:
    sb = StatusBuilder(SOURCE)
    if not ctx.sysfs_available:
        sb.unavailable("input is an hwloc XML export")
        return ProbeResult(EMPTY, sb.finish())
    status_cpus, status_mems = _status(ctx, sb)
    version, path, eff_cpus, eff_mems = _cgroup(ctx, sb)
    data = Allowed(
        cpus=_intersect(status_cpus, eff_cpus),
        mems=_intersect(status_mems, eff_mems),
        cgroup_version=version,
        cgroup_path=path,
        effective_cpus=eff_cpus or (),
        effective_mems=eff_mems or (),
    )
    return ProbeResult(data, sb.finish())


def _intersect(a: Ids | None, b: Ids | None) -> Ids:
    if a is None:
        return b or ()
    if b is None:
        return a
    keep = set(b)
    return tuple(i for i in a if i in keep)


def _parse_list(rel: str, text: str) -> Ids:
    try:
        return parse_cpulist(text)
    except CpuListError as exc:
        raise HostReadError(rel, str(exc)) from exc


def _status(ctx: ProbeContext, sb: StatusBuilder) -> tuple[Ids | None, Ids | None]:
    try:
        text = ctx.fs.read_text(STATUS)
    except HostReadError as exc:
        sb.problem(exc)
        return None, None
    listed = allowed_lists(text)
    found: dict[str, Ids | None] = dict.fromkeys(ALLOWED_KEYS)
    for key in ALLOWED_KEYS:
        if key not in listed:
            sb.problem(HostReadError(STATUS, f"no {key} line"))
            continue
        try:
            found[key] = _parse_list(STATUS, listed[key])
        except HostReadError as exc:
            sb.problem(HostReadError(STATUS, f"{key}: {exc.reason}"))
    return found["Cpus_allowed_list"], found["Mems_allowed_list"]


def _self_cgroups(ctx: ProbeContext, sb: StatusBuilder) -> tuple[str | None, str | None]:
    """(v1 cpuset path, v2 path) from /proc/self/cgroup; falls back to /proc/self/cpuset for both."""
    try:
        text = ctx.fs.read_text(CGROUP)
    except HostReadError as exc:
        if exc.reason != "missing":
            sb.problem(exc)
        text = None
    if text is not None:
        found = parse_proc_cgroup(text)
        return found.v1_cpuset, found.v2
    try:
        cpuset = ctx.fs.read_attr(SELF_CPUSET)
    except HostReadError as exc:
        if exc.reason != "missing":
            sb.problem(exc)
        sb.problem(f"{CGROUP} and {SELF_CPUSET} missing: cgroup path unknown")
        return None, None
    return cpuset, cpuset


def _cgroup(ctx: ProbeContext, sb: StatusBuilder) -> tuple[int, str, Ids | None, Ids | None]:
    """(version, cpuset cgroup path, effective cpus, effective mems); None for an unknown set."""
    mounts, problems = cgroup_mounts(ctx.fs)
    for problem in problems:
        sb.problem(problem)
    v1_path, v2_path = _self_cgroups(ctx, sb)
    v1 = next((m for m in mounts if m.fstype == "cpuset"
               or (m.fstype == "cgroup" and "cpuset" in m.options)), None)
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)

    if v1 is not None and v1_path is not None:
        files = _LEGACY_FILES if v1.fstype == "cpuset" or "noprefix" in v1.options else _V1_FILES
        cpus, mems = _effective(ctx, sb, v1, v1_path, files)
        return 1, v1_path, cpus, mems
    if v2 is not None and v2_path is not None:
        controllers_rel = f"{v2.mount_point.strip('/')}/cgroup.controllers"
        try:
            controllers = ctx.fs.read_text(controllers_rel).split()
        except HostReadError as exc:
            sb.problem(exc)
            return 2, v2_path, None, None
        if "cpuset" not in controllers:
            # No cpuset controller anywhere: the cgroup restricts nothing beyond what status says.
            return 2, v2_path, None, None
        cpus, mems = _effective(ctx, sb, v2, v2_path, _V2_FILES)
        return 2, v2_path, cpus, mems
    if v1 is None and v2 is None:
        sb.problem("no cgroup or cpuset mount in the mount table")
    else:
        sb.problem("cgroup mounted but this process's cgroup path is unknown")
    return 0, v1_path or v2_path or "", None, None


def _effective(ctx: ProbeContext, sb: StatusBuilder, mount: Mount, path: str,
               files: tuple[str, str, str, str]) -> tuple[Ids | None, Ids | None]:
    # /proc/self/cgroup paths are relative to the hierarchy root; a mount of a sub-hierarchy
    # (container bind mounts) shows that part as its root, so it is not repeated on disk.
    rel_path = path
    if mount.root not in ("", "/") and (path == mount.root or path.startswith(mount.root + "/")):
        rel_path = path[len(mount.root):]
    cgroup_dir = (mount.mount_point.strip("/") + "/" + rel_path.strip("/")).strip("/")
    if not ctx.fs.is_dir(cgroup_dir):
        sb.problem(f"{cgroup_dir}: cgroup directory missing")
        return None, None
    cpus = _effective_one(ctx, sb, cgroup_dir, mount.mount_point, files[0], files[2], CPU_ONLINE)
    mems = _effective_one(ctx, sb, cgroup_dir, mount.mount_point, files[1], files[3], NODE_ONLINE)
    return cpus, mems


def _effective_one(ctx: ProbeContext, sb: StatusBuilder, cgroup_dir: str, top: str, effective: str,
                   requested: str, online_rel: str) -> Ids | None:
    """The effective set, walking up to the nearest ancestor that has the file.

    In v2 a child without the cpuset controller enabled has no cpuset files and inherits its
    parent's sets. Without an effective file (old v1, the legacy cpuset fs) the requested set
    minus offline CPUs/nodes is what the kernel enforces.
    """
    top = top.strip("/")
    d = cgroup_dir
    while True:
        for name, is_effective in ((effective, True), (requested, False)):
            if not name:
                continue
            rel = f"{d}/{name}"
            try:
                text = ctx.fs.read_text(rel)
            except HostReadError as exc:
                if exc.reason == "missing":
                    continue
                sb.problem(exc)
                return None
            try:
                ids = _parse_list(rel, text)
            except HostReadError as exc:
                sb.problem(exc)
                return None
            # An empty requested set in v2 means "inherit"; in v1 it would mean nothing allowed,
            # which cannot hold a running task, so both are read as "look at the parent".
            if ids or is_effective:
                return ids if is_effective else _minus_offline(ctx, ids, online_rel)
        if d == top or "/" not in d or len(d) <= len(top):
            sb.problem(f"{cgroup_dir}: no {effective} in it or its parents")
            return None
        d = d.rsplit("/", 1)[0]


def _minus_offline(ctx: ProbeContext, ids: Ids, online_rel: str) -> Ids:
    try:
        online = set(_parse_list(online_rel, ctx.fs.read_text(online_rel)))
    except HostReadError:
        return ids
    return tuple(i for i in ids if i in online)
