"""Devices handed out, for the agents' fleet: the ``memtopo.io/allocation`` annotations bind writes.

An agent cannot see which NPUs or XPUs a device plugin handed out; the extender knows the ones it chose.
``DeviceLedger`` holds them: every bound, unfinished pod's annotation, listed from the API server every
refresh, plus the extender's own binds since (which a listing that started before them cannot show).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from memtopo.k8s.jsonvalue import json_object_or_none

# Written by bind: {"node", "resource", "ids"}; the ledger reads them back from every bound pod.
ALLOCATION_ANNOTATION: Final = "memtopo.io/allocation"
# The pods the ledger reads its allocations from: bound to a node and not finished.
BOUND_PODS: Final = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
MAX_ANNOTATION: Final = 4096


class DeviceUseView(Protocol):
    """Device ids in use per node for one extended resource (``huawei.com/Ascend910``,
    ``kunlunxin.com/xpu``). Views are merged by union."""

    def allocated(self, resource: str) -> Mapping[str, frozenset[int]]: ...


@dataclass(frozen=True)
class Allocation:
    node: str
    resource: str
    ids: tuple[int, ...]

    def to_annotation(self) -> str:
        return json.dumps({"node": self.node, "resource": self.resource, "ids": list(self.ids)},
                          separators=(",", ":"))


def parse_allocation(pod: Mapping[str, Any]) -> tuple[str, Allocation] | None:
    """(uid, Allocation) from a bound pod's ``memtopo.io/allocation``; None when it has none (or a
    broken one: a hand-edited annotation must not stop the ledger)."""
    meta = pod.get("metadata")
    spec = pod.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        return None
    annotations = meta.get("annotations")
    raw = annotations.get(ALLOCATION_ANNOTATION) if isinstance(annotations, dict) else None
    node = spec.get("nodeName")
    uid = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
    doc = json_object_or_none(raw, MAX_ANNOTATION)
    if doc is None or not isinstance(node, str) or not node:
        return None
    resource, ids = doc.get("resource"), doc.get("ids")
    if (not isinstance(resource, str) or not isinstance(ids, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 8 for i in ids)):
        return None
    # The pod's spec.nodeName is where it runs, whatever the annotation claims.
    return str(uid), Allocation(node, resource, tuple(ids))


class DeviceLedger:
    """Devices handed out, by pod: the API server's bound pods (``replace``, each refresh) plus the
    extender's own binds since (``record``), which a listing that started before them cannot show."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._listed: dict[str, Allocation] = {}
        self._recent: dict[str, tuple[float, Allocation]] = {}
        self.clock = clock
        # Grows with every change: a decision taken at one version is stale at the next.
        self.version = 0

    def record(self, uid: str, allocation: Allocation) -> None:
        self._recent[uid] = (self.clock(), allocation)
        self.version += 1

    def forget(self, uid: str) -> None:
        self._recent.pop(uid, None)
        self.version += 1

    def replace(self, pods: Iterable[Mapping[str, Any]], listed_at: float) -> None:
        """A full listing of bound pods that started at ``listed_at`` (this ledger's clock)."""
        listed = dict(p for pod in pods if (p := parse_allocation(pod)) is not None)
        self._listed = listed
        self.version += 1
        # A recent bind the listing shows is now listed; one made before the listing started and
        # absent from it belongs to a pod that is gone.
        self._recent = {uid: (t, a) for uid, (t, a) in self._recent.items() if uid not in listed and t >= listed_at}

    def allocated(self, resource: str) -> Mapping[str, frozenset[int]]:
        out: dict[str, set[int]] = {}
        for a in (*self._listed.values(), *(a for _, a in self._recent.values())):
            if a.resource == resource:
                out.setdefault(a.node, set()).update(a.ids)
        return {node: frozenset(ids) for node, ids in out.items()}
