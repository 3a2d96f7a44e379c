"""The object builders of scheduler-plugins' NodeResourceTopologyMatch tests, as JSON, so that their
tables port row by row (``pkg/noderesourcetopology/objects.go``, ``filter_test.go``, ``score_test.go``).

Upstream's ``MakeTopologyResInfo(name, capacity, available)`` leaves ``allocatable`` unset: its plugin never
reads it. The CRD requires it and the kubelet's memory manager counts on it, so here it is the capacity
(nothing reserved), which is what a publisher writes for a node without reservations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CPU = "cpu"
MEMORY = "memory"
EXTENDED = "namespace/extended"
HUGEPAGES_2MI = "hugepages-2Mi"
NIC = "vendor/nic1"
NOT_EXISTING_NIC = "vendor/notexistingnic"
CONTAINER_NAME = "container1"
NIC_NO_NUMA = "vendor.com/old-nic-model"
GPU = "gpu"

Resources = Mapping[str, str]


def res_info(name: str, capacity: str, available: str) -> dict[str, str]:
    return {"name": name, "capacity": capacity, "allocatable": capacity, "available": available}


def zone(name: str, *resources: dict[str, str], costs: Mapping[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "type": "Node", "resources": list(resources)}
    if costs is not None:
        out["costs"] = [{"name": k, "value": v} for k, v in costs.items()]
    return out


def nrt(name: str, zones: Sequence[dict[str, Any]], policy: str | None = None) -> dict[str, Any]:
    """An object with the deprecated ``topologyPolicies`` field, as upstream's tables write them."""
    obj: dict[str, Any] = {"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
                           "metadata": {"name": name}, "zones": list(zones)}
    if policy is not None:
        obj["topologyPolicies"] = [policy]
    return obj


def container(name: str, requests: Resources | None = None, limits: Resources | None = None) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if requests is not None:
        resources["requests"] = dict(requests)
    if limits is not None:
        resources["limits"] = dict(limits)
    return {"name": name, "resources": resources}


def pod_by_resource_list(res: Resources) -> dict[str, Any]:
    """``makePodByResourceList``: one container, requests = limits (the filter test names it container1)."""
    return {"spec": {"containers": [container(CONTAINER_NAME, res, res)]}}


def pod_with_requests(res: Resources) -> dict[str, Any]:
    """``makePodWithReqByResourceList``: requests only."""
    return {"spec": {"containers": [container(CONTAINER_NAME, res)]}}


def pod_with_requests_and_limits(req: Resources, lim: Resources) -> dict[str, Any]:
    return {"spec": {"containers": [container(CONTAINER_NAME, req, lim)]}}


def pod_with_many_containers(res: Resources, count: int) -> dict[str, Any]:
    """``makePodByResourceListWithManyContainers`` (the filter test renames the first container1)."""
    names = [CONTAINER_NAME] + [""] * (count - 1)
    return {"spec": {"containers": [container(n, res, res) for n in names]}}


def pod_by_resource_lists(*lists: Resources) -> dict[str, Any]:
    """``makePodByResourceLists``: one container per list, requests = limits, unnamed."""
    return {"spec": {"containers": [container("", r, r) for r in lists]}}


def pod_multi(app: Sequence[Resources], init: Sequence[Resources] = ()) -> dict[str, Any]:
    """``makePod`` with ``withMultiInitContainers``/``withMultiContainers``: cnt-1, cnt-2 … in each list."""
    return {"spec": {"initContainers": [container(f"cnt-{i + 1}", r, r) for i, r in enumerate(init)],
                     "containers": [container(f"cnt-{i + 1}", r, r) for i, r in enumerate(app)]}}
