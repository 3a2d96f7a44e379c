"""Memory policy of a running process.

A process's mempolicy can only be set by the process itself (set_mempolicy acts on the caller),
so from outside the engine enforces MODE_BIND the one way the kernel offers: the mems of the
process's cpuset, plus migrate_pages of what already lies elsewhere when asked. The result says
so (``method``). New processes get a real mempolicy through ``memtopo exec`` (apply/launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from memtopo.apply import cgroups
from memtopo.apply.actions.base import ActionKind, Applied, Overlay, Prepared, RunContext, Step, ids
from memtopo.apply.actions.cpuset import CpusetStep, CpusetTarget
from memtopo.apply.actions.migrate import MigrationStep, MigrationTarget
from memtopo.apply.cgroups import Hierarchy
from memtopo.apply.checks import CheckContext, ProcRef, fmt_ids
from memtopo.apply.host import Ids
from memtopo.hostfs import HostReadError
from memtopo.v1 import plan_pb2 as planpb

Mode = planpb.MemoryPolicy.Mode


@dataclass(frozen=True)
class MemPolicyTarget:
    proc: ProcRef
    nodes: Ids
    cpuset: CpusetTarget
    migration: MigrationTarget | None


def check(action: planpb.PlanAction, ctx: CheckContext) -> MemPolicyTarget | None:
    aid, mp = action.id, action.memory_policy
    if mp.mode == planpb.MemoryPolicy.MODE_UNSPECIFIED:
        ctx.reject(aid, "memory_policy: mode is unset")
        return None
    if mp.mode != planpb.MemoryPolicy.MODE_BIND:
        name = planpb.MemoryPolicy.Mode.Name(mp.mode) if mp.mode in Mode.values() else str(mp.mode)
        ctx.reject(aid, f"memory_policy: {name} cannot be imposed on a running process (only MODE_BIND, "
                        "through its cpuset mems); start the process with `memtopo exec` instead")
        return None
    nodes = ctx.nodes(aid, mp.nodes, "nodes")
    proc = ctx.proc(action, mp.pid)
    if nodes is None or proc is None:
        return None
    unified = set(nodes) & ctx.facts.unified_nodes
    if unified and not mp.apply_on_unified:
        # On unified memory the policy has little effect: skipped unless asked for.
        ctx.skip(aid, f"node(s) {fmt_ids(unified)} belong to a Unified memory domain: memory policy skipped "
                      "(set apply_on_unified to apply it)")
        return None
    hier = ctx.hierarchy
    if isinstance(hier, str):
        ctx.host_problem(action, f"no cpuset hierarchy: {hier}")
        return None
    current = ctx.proc_cgroup(action, hier, proc)
    if current is None:
        return None
    if cgroups.path_problem(current, ctx.config.cgroup_prefixes) is None:
        cpuset = CpusetTarget(hier, current, True, False, None, nodes)
    elif hier.version == 1:
        managed = f"{cgroups.normalize(ctx.config.managed_cgroup)}/pid-{proc.pid}"
        if ctx.cgroup_path(action, hier, managed) is None:
            return None
        cpus = _effective(ctx, hier, current)
        if cpus is None:
            ctx.host_problem(action, f"pid {proc.pid}: cannot read the CPUs of its cpuset {current!r}")
            return None
        exists = ctx.host.files.is_dir(hier.dir(managed))
        cpuset = CpusetTarget(hier, managed, exists, not exists, cpus, nodes, (proc,))
    else:
        ctx.host_problem(action, f"pid {proc.pid} is in cgroup /{current} outside the configured prefixes; on "
                                 "cgroup v2 moving it would move every controller: place it with a cpuset "
                                 "action first")
        return None
    migration = None
    if mp.migrate_existing:
        away = tuple(sorted(ctx.facts.memory_nodes - set(nodes)))
        migration = MigrationTarget(proc, away, nodes) if away else None
    return MemPolicyTarget(proc, nodes, cpuset, migration)


def _effective(ctx: CheckContext, hier: Hierarchy, path: str) -> Ids | None:
    for name in (hier.effective_cpus_file, hier.cpus_file):
        try:
            ids = ctx.host.files.read_ids(hier.file(path, name))
        except HostReadError:
            continue
        if ids:
            return ids
    return None


class MemPolicyStep(Step):
    kind = "memory_policy"

    def __init__(self, ctx: RunContext, action: planpb.PlanAction, target: MemPolicyTarget) -> None:
        super().__init__(ctx, action)
        self.target = target
        self.cpuset = CpusetStep(ctx, action, target.cpuset)
        self.migration = MigrationStep(ctx, action, target.migration) if target.migration else None
        self._parts: list[tuple[Step, Prepared]] = []

    def prepare(self, overlay: Overlay) -> Prepared:
        t = self.target
        cs = self.cpuset.prepare(overlay)
        parts: list[tuple[Step, Prepared]] = [(self.cpuset, cs)]
        method = (f"cpuset mems of cgroup /{t.cpuset.hierarchy.dir(t.cpuset.path)} "
                  f"({'created for it' if t.cpuset.create else 'its own'}, {t.cpuset.hierarchy.describe()})")
        if self.migration is not None:
            parts.append((self.migration, self.migration.prepare(overlay)))
            method += " + migrate_pages of pages already placed"
        elif t.cpuset.hierarchy.version == 1:
            method += "; pages already placed stay (migrate_existing not set)"
        self._parts = parts
        details = {"method": f"running process: bind to node(s) {ids(t.nodes)} through {method}",
                   "mode": "MODE_BIND"}
        for _, p in parts:
            details.update({k: v for k, v in p.details.items() if k not in details})
        return Prepared([line for _, p in parts for line in p.before], [line for _, p in parts for line in p.after],
                        [op for _, p in parts for op in p.undo], any(p.changes for _, p in parts), details,
                        run_anyway=any(p.run_anyway for _, p in parts))

    def apply(self, prepared: Prepared) -> Applied:
        after: list[str] = []
        details = dict(prepared.details)
        changed = False
        for step, p in self._parts:
            if not (p.changes or p.run_anyway):
                after.extend(p.after)
                continue
            done = step.apply(p)
            after.extend(done.after)
            details.update(done.details)
            changed = changed or not done.unchanged
        return Applied(after, details, unchanged=not changed)


KIND = ActionKind("memory_policy", check, MemPolicyStep)
