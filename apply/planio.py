"""Plans in and results out as proto3 JSON (snake_case field names, as ``memtopo topo`` prints)."""

from __future__ import annotations

import json
import re

from google.protobuf import descriptor_pool, json_format

from memtopo.apply.errors import PlanFormatError
from memtopo.v1 import plan_pb2 as planpb

MAX_PLAN_BYTES = 16 << 20
# protobuf's own wording names the fields in camelCase; the project writes them as the .proto does.
_NO_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "(.*?)" at "([^"]*)"', re.S)


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
    plan = planpb.BindingPlan()
    try:
        json_format.ParseDict(obj, plan)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise PlanFormatError(f"not a BindingPlan: {_reworded(str(exc))}") from exc
    return plan


def _reworded(message: str) -> str:
    """An unknown-field error in the project's words: snake_case field names, a short quoted excerpt."""
    m = _NO_FIELD.search(message)
    if m is None:
        return message
    type_name, field, where = m.groups()
    try:
        fields = [f.name for f in descriptor_pool.Default().FindMessageTypeByName(type_name).fields]
    except KeyError:
        return message
    return f"{where}: no field {field[:60]!r} (a {type_name.rsplit('.', 1)[-1]} has: {', '.join(fields)})"

