"""Pods as kube-scheduler serialises them to the scheduler extender."""

from __future__ import annotations

from typing import Any


def pod(requests: dict[str, str] | None = None, limits: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None, name: str = "job-0", uid: str = "uid-0") -> dict[str, Any]:
    """A Pod as kube-scheduler serialises it (json tags: lower-case)."""
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return {"metadata": {"name": name, "namespace": "default", "uid": uid, "annotations": annotations or {}},
            "spec": {"schedulerName": "default-scheduler",
                     "containers": [{"name": "main", "image": "busybox", "resources": resources}]},
            "status": {"phase": "Pending"}}


def npu_pod(n: int, **kw: Any) -> dict[str, Any]:
    return pod(requests={"cpu": "1", "memory": "1Gi"}, limits={"huawei.com/Ascend910": str(n)}, **kw)
