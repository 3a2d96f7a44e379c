"""Memory policy of a running process.

A process's mempolicy can only be set by the process itself (set_mempolicy acts on the caller),
so from outside the engine enforces MODE_BIND the one way the kernel offers: the mems of the
process's cpuset, plus migrate_pages of what already lies elsewhere when asked. The result says
so (``method``). New processes get a real mempolicy through ``memtopo exec`` (apply/launch.py).
"""

from __future__ import annotations

from memtopo.apply.actions.base import Applied, Overlay, Prepared, RunContext, Step, ids
from memtopo.apply.actions.cpuset import CpusetStep
from memtopo.apply.actions.migrate import MigrationStep
from memtopo.apply.validate import MemPolicyTarget
from memtopo.v1 import plan_pb2 as planpb


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
