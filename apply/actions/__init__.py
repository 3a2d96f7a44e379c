"""The action kinds, by the PlanAction oneof that names them. Each kind's module holds its target,
its check and its step (apply/actions/base.py ``ActionKind``); a new kind is one module and one
entry here (tests/apply/test_apply_actions.py checks every oneof has one)."""

from __future__ import annotations

from typing import Any

from memtopo.apply.actions import cpuset, irq, mempolicy, migrate, threads
from memtopo.apply.actions.base import (
    ActionError,
    ActionKind,
    ActionSkipError,
    Applied,
    Overlay,
    Prepared,
    RunContext,
    Step,
)
from memtopo.v1 import plan_pb2 as planpb

ACTIONS: dict[str, ActionKind[Any]] = {
    k.name: k for k in (threads.KIND, cpuset.KIND, mempolicy.KIND, irq.KIND, migrate.KIND)
}


def make_step(ctx: RunContext, action: planpb.PlanAction, target: object) -> Step:
    """The step for a validated action and the target its kind's check returned."""
    kind = action.WhichOneof("action")
    assert kind is not None  # validation rejects an action without one
    return ACTIONS[kind].step(ctx, action, target)


__all__ = ["ACTIONS", "ActionError", "ActionKind", "ActionSkipError", "Applied", "Overlay", "Prepared",
           "RunContext", "Step", "make_step"]
