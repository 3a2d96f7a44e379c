"""Typed reads from a decoded JSON request: every policy validates its input through these."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, NoReturn, Protocol

from memtopo.cpulist import CpuListError, parse_cpulist
from memtopo.planner.errors import PlanError

# A 10,000-node fleet request is about 1 MB; far above any real request, far below memory trouble.
MAX_REQUEST_BYTES: Final = 64 << 20


def _no_constant(name: str) -> NoReturn:
    # Python's json accepts NaN and Infinity; JSON does not, and a NaN would slip past range checks.
    raise ValueError(f"{name} is not a JSON value")


def parse_json(text: str | bytes) -> Any:
    """Decoded JSON, or PlanError("invalid_request") saying why it is not JSON."""
    if len(text) > MAX_REQUEST_BYTES:
        raise PlanError("invalid_request", f"request: larger than {MAX_REQUEST_BYTES} bytes")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PlanError("invalid_request", f"request: not JSON: {exc}") from None


def _bad(field: str, why: str) -> PlanError:
    return PlanError("invalid_request", f"{field}: {why}")


def as_object(obj: Any, field: str = "request") -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise _bad(field, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _missing(field: str) -> PlanError:
    return _bad(field, "required field is missing")


def get_int(obj: Mapping[str, Any], field: str, default: int | None = None, *, minimum: int | None = None) -> int:
    value = obj.get(field, default)
    if value is None:
        raise _missing(field)
    # bool is an int in Python; JSON true is not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(field, f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise _bad(field, f"must be ≥ {minimum}, got {value}")
    return value


def get_bool(obj: Mapping[str, Any], field: str, default: bool | None = None) -> bool:
    value = obj.get(field, default)
    if value is None:
        raise _missing(field)
    if not isinstance(value, bool):
        raise _bad(field, f"expected true or false, got {value!r}")
    return value


def get_str(obj: Mapping[str, Any], field: str, default: str | None = None) -> str:
    value = obj.get(field, default)
    if value is None:
        raise _missing(field)
    if not isinstance(value, str):
        raise _bad(field, f"expected a string, got {value!r}")
    return value


def get_list(obj: Mapping[str, Any], field: str, default: list[Any] | None = None) -> list[Any]:
    value = obj.get(field, default)
    if value is None:
        raise _missing(field)
    if not isinstance(value, list):
        raise _bad(field, f"expected a list, got {type(value).__name__}")
    return value


def get_int_list(obj: Mapping[str, Any], field: str, default: list[int] | None = None) -> tuple[int, ...]:
    items = get_list(obj, field, list(default) if default is not None else None)
    for i, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise _bad(f"{field}[{i}]", f"expected a non-negative integer, got {item!r}")
    return tuple(items)


def cpulist(value: Any, field: str) -> tuple[int, ...]:
    """A Linux cpulist string ("0-37,40") → sorted ids."""
    if not isinstance(value, str):
        raise _bad(field, f"expected a cpulist string like \"0-3,8\", got {value!r}")
    try:
        return parse_cpulist(value)
    except CpuListError as exc:
        raise _bad(field, str(exc)) from None


def get_cpulist(obj: Mapping[str, Any], field: str, default: str | None = None) -> tuple[int, ...]:
    value = obj.get(field, default)
    if value is None:
        raise _missing(field)
    return cpulist(value, field)


def get_cpulist_map(obj: Mapping[str, Any], field: str) -> dict[int, tuple[int, ...]] | None:
    """{"<id>": "<cpulist>"} → {id: cpus}; None when the field is absent."""
    value = obj.get(field)
    if value is None:
        return None
    mapping = as_object(value, field)
    out: dict[int, tuple[int, ...]] = {}
    for key, cpus in mapping.items():
        # isdigit() alone lets Unicode digits ("²") through to int(), which refuses them.
        if not isinstance(key, str) or not (key.isascii() and key.isdigit()):
            raise _bad(field, f"key {key!r} is not a non-negative integer")
        out[int(key)] = cpulist(cpus, f"{field}[{key}]")
    return out


def reject_unknown(obj: Mapping[str, Any], allowed: Iterable[str], field: str) -> None:
    """Refuse keys the policy does not know: a misspelt hard constraint must not be silently ignored."""
    known = set(allowed)
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise _bad(field, f"unknown keys {unknown}; expected {sorted(known)}")


def id_mask(raw: Any, limit: int) -> int:
    """Bitmask of a JSON list of unique ints in [0, limit), or -1 for anything else (the caller then
    explains what is wrong). One pass, no allocation: the fleet policies call it per node."""
    if type(raw) is not list:
        return -1
    mask = 0
    for i in raw:
        if type(i) is not int or not 0 <= i < limit or mask >> i & 1:
            return -1
        mask |= 1 << i
    return mask


class _Named(Protocol):
    @property
    def name(self) -> str: ...


def get_named_nodes[N: _Named](obj: Mapping[str, Any], parse_node: Callable[[Any], N]) -> tuple[N, ...]:
    """The request's non-empty ``nodes`` list, each parsed by ``parse_node``, names unique; an error
    in a node is re-raised with its position (``nodes[3].available: …``)."""
    items = get_list(obj, "nodes")
    if not items:
        raise PlanError("invalid_request", "nodes: at least one node is required")
    nodes: list[N] = []
    names: set[str] = set()
    for index, item in enumerate(items):
        try:
            node = parse_node(item)
        except PlanError as exc:
            raise PlanError(exc.code, f"nodes[{index}].{exc.message}") from None
        if node.name in names:
            raise PlanError("invalid_request", f"nodes[{index}].name: {node.name!r} appears twice")
        names.add(node.name)
        nodes.append(node)
    return tuple(nodes)


def check_plan_target(pid: Any, plan_id: str) -> int:
    """The process a BindingPlan binds and its id, checked the same way for every policy."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise PlanError("invalid_request", f"pid: expected a positive integer, got {pid!r}")
    if not plan_id:
        raise PlanError("invalid_request", "plan_id: must not be empty")
    return pid
