"""Plans in and results out as proto3 JSON (snake_case field names, as ``memtopo topo`` prints)."""

from __future__ import annotations

import json

from memtopo.apply.errors import PlanFormatError
from memtopo.protojson import ProtoJsonError, from_json
from memtopo.v1 import plan_pb2 as planpb

MAX_PLAN_BYTES = 16 << 20


def load_plan(text: str | bytes) -> planpb.BindingPlan:
    """A BindingPlan from proto3 JSON; unknown fields and wrong types are errors, not ignored."""
    if len(text) > MAX_PLAN_BYTES:
        raise PlanFormatError(f"plan is larger than {MAX_PLAN_BYTES} bytes")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise PlanFormatError(f"plan is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise PlanFormatError(f"plan must be a JSON object, got {type(obj).__name__}")
    if "plan" in obj and "decision" in obj:
        raise PlanFormatError('this is `memtopo plan ... --emit both` output ({"decision", "plan"}); '
                              "apply takes the bare plan: run the planner with --emit plan")
    try:
        return from_json(obj, planpb.BindingPlan())
    except ProtoJsonError as exc:
        raise PlanFormatError(f"not a BindingPlan: {exc}") from None
