"""cpuset cgroups, v1 and v2: create, set cpus/mems/partition, attach.

v1: a new cpuset holds no CPUs or nodes, and no task can join it until both are set (ENOSPC), so
every level the plan creates gets its parent's sets (what ``cgroup.clone_children`` would do) and
the leaf the plan's. Pages move on a mems change only with ``cpuset.memory_migrate=1``.
v2: a child has cpuset files only when its parent's ``cgroup.subtree_control`` enables cpuset;
the engine enables it where needed (and disables it again on rollback). Writing mems migrates the
tasks' pages (v2 has no memory_migrate switch).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from memtopo.apply.actions.base import ActionError, ActionKind, Applied, Overlay, Prepared, RunContext, Step, ids
from memtopo.apply.cgroups import Hierarchy
from memtopo.apply.checks import CheckContext, ProcRef
from memtopo.apply.errors import HostWriteError
from memtopo.apply.host import Ids
from memtopo.apply.undo import AttachUndo, FileUndo, MkdirUndo, UndoOp
from memtopo.cpulist import CpuListError, format_cpulist, parse_cpulist
from memtopo.hostfs import HostReadError
from memtopo.v1 import plan_pb2 as planpb

_HINTS = {
    errno.ENOSPC: "a v1 cpuset needs both cpus and mems before tasks can join",
    errno.EINVAL: "not inside the parent cgroup's set, offline, or rejected by the kernel",
    errno.EBUSY: "in use by a child cgroup or an exclusive sibling",
    errno.EACCES: "permission denied",
    errno.EPERM: "not permitted",
    errno.EROFS: "the cgroup filesystem is read-only",
}


PARTITION_VALUES = ("", "member", "root", "isolated")


@dataclass(frozen=True)
class CpusetTarget:
    hierarchy: Hierarchy
    path: str
    exists: bool
    create: bool
    cpus: Ids | None
    mems: Ids | None
    attach: tuple[ProcRef, ...] = ()
    partition: str = ""


def check(action: planpb.PlanAction, ctx: CheckContext) -> CpusetTarget | None:
    aid, cs = action.id, action.cpuset
    target = cs.WhichOneof("target")
    if target is None:
        ctx.reject(aid, "cpuset: no target (cgroup_path or pid_cgroup)")
        return None
    cpus = ctx.cpus(aid, cs.cpus) if cs.cpus else None
    mems = ctx.nodes(aid, cs.mems, "mems") if cs.mems else None
    if (cs.cpus and cpus is None) or (cs.mems and mems is None):
        return None
    if cs.partition not in PARTITION_VALUES:
        ctx.reject(aid, f"partition {cs.partition[:40]!r} is not one of member, root, isolated")
        return None
    if len(cs.attach_pids) > ctx.config.max_attach_pids:
        ctx.reject(aid, f"attach_pids: {len(cs.attach_pids)} entries, more than {ctx.config.max_attach_pids}")
        return None
    if len(set(cs.attach_pids)) != len(cs.attach_pids):
        ctx.reject(aid, "attach_pids: pids repeat")
        return None
    if target == "pid_cgroup" and cs.create:
        ctx.reject(aid, "create applies to cgroup_path only (a process's cgroup exists)")
        return None
    if cpus is None and mems is None and not cs.partition and not cs.attach_pids and not cs.create:
        ctx.reject(aid, "cpuset: nothing to change (no cpus, mems, partition or attach_pids)")
        return None
    attach: list[ProcRef] = []
    for pid in cs.attach_pids:
        ref = ctx.proc(action, pid, "attach_pids")
        if ref is None:
            return None
        attach.append(ref)
    hier = ctx.hierarchy
    if isinstance(hier, str):
        ctx.host_problem(action, f"no cpuset hierarchy: {hier}")
        return None
    if cs.partition and hier.version != 2:
        ctx.reject(aid, f"partition needs cgroup v2 (this host has {hier.describe()})")
        return None
    if target == "cgroup_path":
        path = ctx.cgroup_path(action, hier, cs.cgroup_path)
    else:
        proc = ctx.proc(action, cs.pid_cgroup, "pid_cgroup")
        path = ctx.proc_cgroup(action, hier, proc) if proc is not None else None
        if path is not None:
            path = ctx.cgroup_path(action, hier, path)
    if path is None:
        return None
    exists = ctx.host.files.is_dir(hier.dir(path))
    if not exists and not cs.create:
        ctx.host_problem(action, f"cgroup {path!r} does not exist in {hier.describe()} (set create)")
        return None
    return CpusetTarget(hier, path, exists, cs.create and not exists, cpus, mems, tuple(attach), cs.partition)


@dataclass(frozen=True)
class _Op:
    kind: str  # mkdir | write | enable | attach
    path: str
    value: str = ""
    proc: ProcRef | None = None


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


class CpusetStep(Step):
    # Reads cgroup files only: thread and IRQ masks set before it in the group do not change them.
    closes_group = True
    kind = "cpuset"

    def __init__(self, ctx: RunContext, action: planpb.PlanAction, target: CpusetTarget) -> None:
        super().__init__(ctx, action)
        self.target = target
        self._ops: list[_Op] = []

    def _read(self, rel: str) -> str:
        try:
            return self.host.files.read_text(rel).strip()
        except HostReadError as exc:
            raise ActionError(str(exc)) from exc

    def _read_ids(self, rel: str) -> tuple[int, ...]:
        text = self._read(rel)
        try:
            return parse_cpulist(text)
        except CpuListError as exc:
            raise ActionError(f"/{rel}: {exc}") from exc

    def prepare(self, overlay: Overlay) -> Prepared:
        t, h, files = self.target, self.target.hierarchy, self.host.files
        ops: list[_Op] = []
        undo: list[UndoOp] = []
        before: list[str] = []
        missing: list[str] = []
        p = t.path
        while p and not files.is_dir(h.dir(p)):
            missing.insert(0, p)
            p = _parent(p)
        if missing and not t.create:
            raise ActionError(f"cgroup /{h.dir(t.path)} no longer exists")
        where = f"cgroup /{h.dir(t.path)}"
        levels = [t.path[:i] for i, ch in enumerate(t.path + "/") if ch == "/"]
        for level in levels:
            parent = _parent(level)
            if h.version == 2:
                # Every ancestor down to the leaf must delegate cpuset, or the leaf has no cpuset files.
                control = h.file(parent, "cgroup.subtree_control")
                if parent in missing:
                    ops.append(_Op("enable", control, "+cpuset"))  # removed with its directory
                elif "cpuset" not in self._read(control).split():
                    ops.append(_Op("enable", control, "+cpuset"))
                    undo.append(FileUndo(control, "-cpuset", "subtree"))
            if level not in missing:
                continue
            ops.append(_Op("mkdir", h.dir(level)))
            undo.append(MkdirUndo(h.dir(level), h.file(parent, "cgroup.procs")))
            leaf = level == t.path
            cpus = t.cpus if leaf else None
            mems = t.mems if leaf else None
            if h.version == 1:
                # Parent values for the levels the plan did not ask for: a v1 cpuset starts empty.
                cpus = cpus if cpus is not None else self._read_ids(h.file(parent, h.cpus_file))
                mems = mems if mems is not None else self._read_ids(h.file(parent, h.mems_file))
            if cpus is not None:
                ops.append(_Op("write", h.file(level, h.cpus_file), format_cpulist(cpus)))
            if mems is not None:
                ops.append(_Op("write", h.file(level, h.mems_file), format_cpulist(mems)))
            if leaf and t.partition:
                ops.append(_Op("write", h.file(level, "cpuset.cpus.partition"), t.partition))
        if missing:
            before.append(f"{where}: absent")
        else:
            # Without delegation (enabled just above) the files do not exist yet: empty = inherit.
            delegating = any(op.kind == "enable" for op in ops)
            now: list[str] = []
            for want, name, label in ((t.cpus, h.cpus_file, "cpus"), (t.mems, h.mems_file, "mems")):
                rel = h.file(t.path, name)
                cur_text = "" if delegating and not files.exists(rel) else self._read(rel)
                try:
                    cur = parse_cpulist(cur_text)
                except CpuListError as exc:
                    raise ActionError(f"/{rel}: {exc}") from exc
                now.append(f"{label} {ids(cur)}")
                if want is not None and cur != want:
                    ops.append(_Op("write", rel, format_cpulist(want)))
                    undo.append(FileUndo(rel, cur_text, "list"))
            if t.partition:
                rel = h.file(t.path, "cpuset.cpus.partition")
                cur_part = "member" if delegating and not files.exists(rel) else self._read(rel)
                now.append(f"partition {cur_part}")
                if cur_part.split(" ")[0] != t.partition:
                    ops.append(_Op("write", rel, t.partition))
                    undo.append(FileUndo(rel, cur_part.split(" ")[0], "partition"))
            before.append(f"{where}: {' '.join(now)}")
        for ref in t.attach:
            groups = self.host.procs.cgroups(ref.pid)
            raw = None if groups is None else (groups.v1_cpuset if h.version == 1 else groups.v2)
            cur_path = h.from_proc(raw) if raw is not None else None
            if cur_path is None:
                raise ActionError(f"{ref.describe()}: its current cpuset cgroup is unknown")
            if cur_path == t.path:
                before.append(f"{ref.describe()}: in {where}")
                continue
            before.append(f"{ref.describe()}: in cgroup /{h.dir(cur_path)}")
            ops.append(_Op("attach", h.file(t.path, "cgroup.procs"), str(ref.pid), ref))
            undo.append(AttachUndo(ref.pid, ref.starttime, h.file(cur_path, "cgroup.procs")))
        want_desc = [f"cpus {ids(t.cpus)}" if t.cpus is not None else "",
                     f"mems {ids(t.mems)}" if t.mems is not None else "",
                     f"partition {t.partition}" if t.partition else ""]
        after = [f"{where}: {' '.join(w for w in want_desc if w) or 'created'}"]
        after += [f"{ref.describe()}: in {where}" for ref in t.attach]
        self._ops = ops
        return Prepared(before, after, undo, bool(ops), {"hierarchy": h.describe()})

    def apply(self, prepared: Prepared) -> Applied:
        files = self.host.files
        exited: list[int] = []
        for op in self._ops:
            try:
                if op.kind == "mkdir":
                    files.mkdir(op.path)
                else:
                    files.write(op.path, op.value)
            except HostWriteError as exc:
                if op.kind == "attach" and exc.errno == errno.ESRCH:
                    exited.append(int(op.value))
                    continue
                hint = _HINTS.get(exc.errno)
                raise ActionError(f"{'mkdir' if op.kind == 'mkdir' else 'write ' + repr(op.value) + ' to'} "
                                   f"/{op.path}: {exc.reason}{' (' + hint + ')' if hint else ''}") from exc
        details = dict(prepared.details)
        self._verify(details, exited)
        if exited:
            details["exited"] = ids(exited)
        return Applied(prepared.after, details)

    def _verify(self, details: dict[str, str], exited: list[int]) -> None:
        t, h = self.target, self.target.hierarchy
        for want, name in ((t.cpus, h.cpus_file), (t.mems, h.mems_file)):
            if want is None:
                continue
            got = self._read_ids(h.file(t.path, name))
            if got != want:
                raise ActionError(f"/{h.file(t.path, name)} reads {ids(got)} after writing {ids(want)}")
        if t.partition:
            got_part = self._read(h.file(t.path, "cpuset.cpus.partition"))
            if got_part.split(" ")[0] != t.partition or "invalid" in got_part:
                raise ActionError(f"partition reads {got_part!r} after writing {t.partition!r}")
        if t.attach:
            members = set(self._read(h.file(t.path, "cgroup.procs")).split())
            for ref in t.attach:
                if ref.pid not in exited and str(ref.pid) not in members and self.host.procs.stat(ref.pid) is not None:
                    raise ActionError(f"{ref.describe()} is not in cgroup /{h.dir(t.path)} after attaching it")
        for label, name in (("effective_cpus", h.effective_cpus_file), ("effective_mems", h.effective_mems_file)):
            try:
                details[label] = ids(self.host.files.read_ids(h.file(t.path, name)))
            except HostReadError:
                continue
        if h.version == 1 and t.mems is not None:
            try:
                migrate = self.host.files.read_text(h.file(t.path, "cpuset.memory_migrate")).strip()
            except HostReadError:
                migrate = ""
            if migrate == "0":
                details["memory_migrate"] = ("0: pages already placed stay where they are (v1); "
                                             "a page_migration moves them")



KIND = ActionKind("cpuset", check, CpusetStep)
