"""One step class per plan action kind; :func:`make_step` picks it from the validated target."""

from __future__ import annotations

from memtopo.apply.actions.base import ActionError, ActionSkipError, Applied, Overlay, Prepared, RunContext, Step
from memtopo.apply.actions.cpuset import CpusetStep
from memtopo.apply.actions.irq import IrqStep
from memtopo.apply.actions.mempolicy import MemPolicyStep
from memtopo.apply.actions.migrate import MigrationStep
from memtopo.apply.actions.threads import ThreadStep
from memtopo.apply.validate import CpusetTarget, IrqTarget, MemPolicyTarget, MigrationTarget, Target, ThreadTarget
from memtopo.v1 import plan_pb2 as planpb


def make_step(ctx: RunContext, action: planpb.PlanAction, target: Target) -> Step:
    match target:
        case ThreadTarget():
            return ThreadStep(ctx, action, target)
        case CpusetTarget():
            return CpusetStep(ctx, action, target)
        case IrqTarget():
            return IrqStep(ctx, action, target)
        case MigrationTarget():
            return MigrationStep(ctx, action, target)
        case MemPolicyTarget():
            return MemPolicyStep(ctx, action, target)


__all__ = ["ActionError", "ActionSkipError", "Applied", "Overlay", "Prepared", "RunContext", "Step", "make_step"]
