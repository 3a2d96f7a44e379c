"""Page migration with ``migrate_pages(2)``, measured by ``/proc/PID/numa_maps`` (numa(7)).

The syscall's return (pages not moved) is a hint the kernel has not always kept accurate, so the
result carries both it and the per-node page counts of ``/proc/PID/numa_maps`` before and after.
Pages that stay behind (pinned, shared without CAP_SYS_NICE) are reported, not a failure: the
kernel moves what it can, as numactl's migratepages does. The syscall always runs (it is cheap
when nothing lies on the source nodes); the action is UNCHANGED when nothing was there to move.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from memtopo.apply.actions.base import ActionError, ActionKind, Applied, Overlay, Prepared, RunContext, Step, ids
from memtopo.apply.checks import CheckContext, ProcRef
from memtopo.apply.errors import KernelCallError
from memtopo.apply.host import Ids
from memtopo.apply.undo import MigrateUndo, UndoOp
from memtopo.v1 import plan_pb2 as planpb


@dataclass(frozen=True)
class MigrationTarget:
    proc: ProcRef
    from_nodes: Ids
    to_nodes: Ids


def check(action: planpb.PlanAction, ctx: CheckContext) -> MigrationTarget | None:
    aid, pm = action.id, action.page_migration
    from_nodes = ctx.nodes(aid, pm.from_nodes, "from_nodes", need_memory=False)
    to_nodes = ctx.nodes(aid, pm.to_nodes, "to_nodes")
    if from_nodes is None or to_nodes is None:
        return None
    proc = ctx.proc(action, pm.pid)
    if proc is None:
        return None
    return MigrationTarget(proc, from_nodes, to_nodes)


def pages_text(pages: dict[int, int]) -> str:
    return " ".join(f"N{n}={c}" for n, c in sorted(pages.items())) or "no pages"


class MigrationStep(Step):
    kind = "page_migration"

    def __init__(self, ctx: RunContext, action: planpb.PlanAction, target: MigrationTarget) -> None:
        super().__init__(ctx, action)
        self.target = target
        self._before: dict[int, int] = {}

    def _pages(self) -> dict[int, int]:
        pages = self.host.procs.numa_pages(self.target.proc.pid)
        if pages is None:
            raise ActionError(f"cannot read /proc/{self.target.proc.pid}/numa_maps (process exited, or no access)")
        return pages

    def prepare(self, overlay: Overlay) -> Prepared:
        t = self.target
        pages = self._pages()
        self._before = pages
        moving = set(t.from_nodes) - set(t.to_nodes)
        movable = sum(c for n, c in pages.items() if n in moving)
        # Migrating back is exact only if nothing lived on the destination before.
        reversible = not any(c for n, c in pages.items() if n in set(t.to_nodes) - set(t.from_nodes))
        before = [f"{t.proc.describe()} pages per node: {pages_text(pages)}"]
        after = [f"{t.proc.describe()}: pages on node(s) {ids(t.from_nodes)} moved to {ids(t.to_nodes)}"
                 + (f" ({movable} to move)" if movable else " (nothing to move)")]
        undo: list[UndoOp] = [MigrateUndo(t.proc.pid, t.proc.starttime, t.from_nodes, t.to_nodes, reversible)] \
            if movable else []
        details = {"pages_before": pages_text(pages), "pages_to_move": str(movable)}
        return Prepared(before, after, undo, movable > 0, details, run_anyway=True)

    def apply(self, prepared: Prepared) -> Applied:
        t = self.target
        try:
            left = self.host.kernel.migrate_pages(t.proc.pid, t.from_nodes, t.to_nodes)
        except KernelCallError as exc:
            why = {errno.ESRCH: " (process exited)", errno.EPERM: " (no ptrace access or CAP_SYS_NICE)",
                   errno.EINVAL: " (bad node mask)"}.get(exc.errno, "")
            raise ActionError(f"{exc}{why}") from exc
        after_pages = self.host.procs.numa_pages(t.proc.pid) or {}
        moving = set(t.from_nodes) - set(t.to_nodes)
        remaining = sum(c for n, c in after_pages.items() if n in moving)
        details = dict(prepared.details)
        details["pages_after"] = pages_text(after_pages)
        details["not_moved_reported"] = str(left)
        details["pages_left_on_source"] = str(remaining)
        after = [f"{t.proc.describe()} pages per node: {pages_text(after_pages)}"]
        return Applied(after, details, unchanged=not prepared.changes)


KIND = ActionKind("page_migration", check, MigrationStep)
