"""kube-scheduler's extender wire format (``k8s.io/kube-scheduler/extender/v1``), read and written.

The extender structs have no JSON tags, so their fields travel with Go's capitalised names (``Pod``,
``Nodes``, ``NodeNames``, ``FailedNodes`` …) and Go reads answers case-insensitively; this module reads
them case-insensitively too (an exact match first, as ``encoding/json`` does). The Pod and NodeList
inside are Kubernetes objects with their usual lower-case fields. Every answer is HTTP 200: a failure
is the answer's ``Error`` (filter, bind); a prioritize failure answers ``{"Error": …}`` too, which
kube-scheduler reports as a failed prioritize and scores without this extender.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from memtopo.text import shorten

PREFIX: Final = "/scheduler/"
VERBS: Final = ("filter", "prioritize", "bind")
MAX_EXTENDER_PRIORITY: Final = 10  # k8s.io/kube-scheduler/extender/v1.MaxExtenderPriority
MAX_NAME: Final = 253


class ExtenderError(Exception):
    """A request the extender answers with ``Error``; ``reason`` is the failure metric's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def field(obj: Mapping[str, Any], name: str) -> Any:
    """Go's case-insensitive field match (an exact match first, as encoding/json does)."""
    if name in obj:
        return obj[name]
    lower = name.lower()
    for key, value in obj.items():
        if isinstance(key, str) and key.lower() == lower:
            return value
    return None


def obj(value: object, what: str, reason: str = "invalid_pod") -> Mapping[str, Any]:
    """``value`` as a JSON object (None: an empty one); ExtenderError otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ExtenderError(reason, f"{what} is not a JSON object")
    return value


@dataclass(frozen=True)
class Candidates:
    """The nodes kube-scheduler asks about: ``names``, and the NodeList's items when it sent one
    (``nodeCacheCapable: false``), which filter then answers with."""

    names: list[str]
    items: list[dict[str, Any]] | None


def pod_of(args: Mapping[str, Any]) -> dict[str, Any]:
    pod = field(args, "Pod")
    if not isinstance(pod, dict):
        raise ExtenderError("invalid_request", "ExtenderArgs.Pod is missing or not an object")
    return pod


def candidates(args: Mapping[str, Any]) -> Candidates:
    names = field(args, "NodeNames")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ExtenderError("invalid_request", "NodeNames is not a list of strings")
        return Candidates(_checked_names(names), None)
    node_list = field(args, "Nodes")
    if node_list is None:
        raise ExtenderError("invalid_request", "ExtenderArgs carries neither NodeNames nor Nodes")
    if not isinstance(node_list, dict):
        raise ExtenderError("invalid_request", "Nodes is not a NodeList object")
    items = node_list.get("items") or []
    if not isinstance(items, list):
        raise ExtenderError("invalid_request", "Nodes.items is not a list")
    out: list[str] = []
    for i, item in enumerate(items):
        meta = item.get("metadata") if isinstance(item, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            raise ExtenderError("invalid_request", f"Nodes.items[{i}] has no metadata.name")
        out.append(name)
    return Candidates(_checked_names(out), items)


def _checked_names(names: list[str]) -> list[str]:
    if names and (not all(names) or max(map(len, names)) > MAX_NAME):
        bad = next(n for n in names if not n or len(n) > MAX_NAME)
        raise ExtenderError("invalid_request", f"node name {shorten(bad)!r} is not a node name")
    return names


@dataclass(frozen=True)
class Verdict:
    """One node for one pod, as filter answers it: fits, or the reason it does not and whether
    preemption could change that (``unresolvable``: it cannot)."""

    fits: bool
    reason: str = ""
    unresolvable: bool = False


class Failure(Protocol):
    @property
    def reason(self) -> str: ...

    @property
    def unresolvable(self) -> bool: ...


def filter_answer(nodes: Candidates, failed: Mapping[str, Failure]) -> dict[str, Any]:
    """``ExtenderFilterResult``: the candidates in ``failed`` fail with their reasons, the others pass."""
    failed_nodes: dict[str, str] = {}
    unresolvable: dict[str, str] = {}
    for name, v in failed.items():
        (unresolvable if v.unresolvable else failed_nodes)[name] = v.reason
    out: dict[str, Any] = {"FailedNodes": failed_nodes, "FailedAndUnresolvableNodes": unresolvable, "Error": ""}
    if nodes.items is None:
        out["NodeNames"] = [n for n in nodes.names if n not in failed] if failed else nodes.names
    else:
        out["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "metadata": {},
                        "items": [item for n, item in zip(nodes.names, nodes.items, strict=True) if n not in failed]}
    return out


def priorities(names: Sequence[str], scores: Sequence[int]) -> list[dict[str, Any]]:
    """``HostPriorityList``."""
    return [{"Host": n, "Score": s} for n, s in zip(names, scores, strict=True)]


@dataclass(frozen=True)
class BindArgs:
    name: str
    namespace: str
    uid: str
    node: str


def bind_args(args: Mapping[str, Any]) -> BindArgs:
    fields = {k: field(args, k) for k in ("PodName", "PodNamespace", "PodUID", "Node")}
    for key in ("PodName", "PodNamespace", "Node"):
        if not isinstance(fields[key], str) or not fields[key]:
            raise ExtenderError("invalid_request", f"ExtenderBindingArgs.{key} is missing")
    uid = fields["PodUID"] if isinstance(fields["PodUID"], str) else ""
    return BindArgs(fields["PodName"], fields["PodNamespace"], uid, fields["Node"])
