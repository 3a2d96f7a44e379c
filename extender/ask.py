"""What a pod asks memtopo: which policy places it, and the request that policy reads.

The pod's requests pick the policy: ``huawei.com/Ascend910`` → hccs, ``kunlunxin.com/xpu`` → xpu,
``nvidia.com/gpu``/``amd.com/gpu`` or a ``memtopo.io/`` annotation → place with the pod's CPU and
memory requests; ``memtopo.io/policy`` names one outright (``none``: pass through). A pod asking for
nothing memtopo places has no policy (``PodAsk.policy`` None): with the agents' fleet it passes
through, with the API server's it is judged by what the kubelet will admit alone.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

from memtopo.extender.wire import ExtenderError, obj
from memtopo.k8s import quantity
from memtopo.k8s.resources import AMD_GPU, ASCEND_910, KUNLUNXIN_XPU, NVIDIA_GPU
from memtopo.planner.names import FLEET_POLICIES
from memtopo.text import shorten

NPU_RESOURCE: Final = ASCEND_910
XPU_RESOURCE: Final = KUNLUNXIN_XPU
GPU_RESOURCES: Final = (NVIDIA_GPU, AMD_GPU)
ANNOTATION_PREFIX: Final = "memtopo.io/"
POLICY_ANNOTATION: Final = "memtopo.io/policy"
WORKLOAD_ANNOTATION: Final = "memtopo.io/workload"
MEMORY_POLICY_ANNOTATION: Final = "memtopo.io/memory-policy"
ALLOW_CXL_ANNOTATION: Final = "memtopo.io/allow-cxl"
POD_SIZES: Final = (1, 2, 4, 8)
GIB: Final = 1 << 30
DEVICE_RESOURCE: Final = {"hccs": NPU_RESOURCE, "xpu": XPU_RESOURCE}
# What the shape of a pod's ask is made of: two pods alike in these are judged alike on a node.
_SHAPE_SPEC: Final = ("containers", "initContainers", "overhead")


def parse_quantity(value: object) -> Fraction:
    """A Kubernetes resource quantity (``500m``, ``2``, ``64Gi``, ``1e3``) → its exact value;
    ExtenderError for anything else (negative quantities included)."""
    try:
        return quantity.parse_nonnegative(value)
    except quantity.QuantityError as exc:
        raise ExtenderError("invalid_pod", f"resource quantity {exc}") from None


def _container_requests(container: object, where: str) -> dict[str, Fraction]:
    resources = obj(obj(container, where).get("resources"), f"{where}.resources")
    requests = obj(resources.get("requests"), f"{where}.resources.requests")
    limits = obj(resources.get("limits"), f"{where}.resources.limits")
    # The API server defaults a request to its limit; extended resources are often given as limits only.
    return {name: parse_quantity(q) for name, q in {**limits, **requests}.items()}


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Fraction]:
    """The pod's effective requests: the larger of its containers' sum and any one init container."""
    spec = obj(pod.get("spec"), "Pod.spec")
    total: dict[str, Fraction] = {}
    containers = spec.get("containers") or []
    inits = spec.get("initContainers") or []
    if not isinstance(containers, list) or not isinstance(inits, list):
        raise ExtenderError("invalid_pod", "Pod.spec.containers is not a list")
    for i, c in enumerate(containers):
        for name, q in _container_requests(c, f"Pod.spec.containers[{i}]").items():
            total[name] = total.get(name, Fraction(0)) + q
    for i, c in enumerate(inits):
        for name, q in _container_requests(c, f"Pod.spec.initContainers[{i}]").items():
            total[name] = max(total.get(name, Fraction(0)), q)
    return total


@dataclass(frozen=True)
class PodAsk:
    """What a pod asks memtopo: ``policy`` None = nothing memtopo places; ``request`` is the fleet
    request body (as ``memtopo controller place --request`` takes it, without node_names/allocated)."""

    policy: str | None
    request: Mapping[str, Any]
    why: str

    @property
    def resource(self) -> str | None:
        """The extended resource of a device policy (hccs, xpu); None for place or no policy."""
        return DEVICE_RESOURCE.get(self.policy or "")


def _count(requests: Mapping[str, Fraction], name: str) -> int:
    q = requests.get(name, Fraction(0))
    if q.denominator != 1:
        raise ExtenderError("invalid_pod", f"{name}: {float(q):g} is not a whole number of devices")
    return int(q)


def _device_count(policy: str, requests: Mapping[str, Fraction]) -> int:
    resource = DEVICE_RESOURCE[policy]
    n = _count(requests, resource)
    if n == 0:
        raise ExtenderError("invalid_pod", f"{POLICY_ANNOTATION}={policy} needs a {resource} request")
    if n not in POD_SIZES:
        # The hccs policy also takes jobs of 8·N NPUs, as N pods: one pod holds at most one node's 8.
        raise ExtenderError("invalid_pod", f"{resource}: a pod asks for 1, 2, 4 or 8, not {n}")
    return n


def _annotations(pod: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj(pod.get("metadata"), "Pod.metadata")
    return {k: v for k, v in obj(meta.get("annotations"), "Pod.metadata.annotations").items()
            if isinstance(k, str) and k.startswith(ANNOTATION_PREFIX)}


def pod_ask(pod: Mapping[str, Any]) -> PodAsk:
    """Which policy places this pod, and its request; ExtenderError for a pod that asks nonsense."""
    annotations = _annotations(pod)
    requests = pod_requests(pod)
    named = annotations.get(POLICY_ANNOTATION)
    if named is not None and named not in (*FLEET_POLICIES, "none"):
        raise ExtenderError("invalid_pod", f"{POLICY_ANNOTATION}: {shorten(str(named))!r} is not one of "
                                           f"{', '.join((*FLEET_POLICIES, 'none'))}")
    npus, xpus = _count(requests, NPU_RESOURCE), _count(requests, XPU_RESOURCE)
    gpus = sum(_count(requests, r) for r in GPU_RESOURCES)
    if named == "none":
        return PodAsk(None, {}, f"{POLICY_ANNOTATION}=none")
    policy = named
    if policy is None:
        if npus and xpus:
            raise ExtenderError("invalid_pod", f"the pod asks for both {NPU_RESOURCE} and {XPU_RESOURCE}; "
                                               f"name one with {POLICY_ANNOTATION}")
        policy = ("hccs" if npus else "xpu" if xpus else "place" if gpus or annotations else None)
    if policy is None:
        return PodAsk(None, {}, "no Ascend 910, Kunlunxin XPU or GPU request and no memtopo.io annotation")
    if policy in DEVICE_RESOURCE:
        return PodAsk(policy, {"request": _device_count(policy, requests)},
                      f"{DEVICE_RESOURCE[policy]} request" if named is None else f"{POLICY_ANNOTATION}={policy}")
    cpu = requests.get("cpu", Fraction(0))
    memory = requests.get("memory", Fraction(0))
    body: dict[str, Any] = {"cpus": max(1, math.ceil(cpu)), "gpus": gpus, "memory_gb": float(memory / GIB)}
    workload = annotations.get(WORKLOAD_ANNOTATION)
    if workload is not None:
        body["workload"] = workload
    constraints: dict[str, Any] = {}
    memory_policy = annotations.get(MEMORY_POLICY_ANNOTATION)
    if memory_policy is not None:
        constraints["memory_policy"] = memory_policy
    cxl = annotations.get(ALLOW_CXL_ANNOTATION)
    if cxl is not None:
        if cxl not in ("true", "false"):
            raise ExtenderError("invalid_pod", f"{ALLOW_CXL_ANNOTATION}: expected true or false, "
                                               f"got {shorten(str(cxl))!r}")
        constraints["allow_cxl_memory"] = cxl == "true"
    if constraints:
        body["constraints"] = constraints
    return PodAsk("place", body, "GPU request" if gpus and named is None else
                  f"{POLICY_ANNOTATION}=place" if named else "memtopo.io annotations")


def shape_key(pod: Mapping[str, Any]) -> str:
    """A short key for what a judgement of this pod depends on: its containers' names (the kubelet's
    reasons name them), resources and restart policies (sidecars), overhead, QoS class and memtopo
    annotations, not the pod's own name. Pods of one ReplicaSet share it, so a node's verdict is computed
    once for all of them."""
    spec = pod.get("spec")
    status = pod.get("status")
    parts: list[Any] = []
    if isinstance(spec, dict):
        for key in _SHAPE_SPEC:
            value = spec.get(key)
            if isinstance(value, list):
                value = [{k: c.get(k) for k in ("name", "resources", "restartPolicy")} if isinstance(c, dict)
                         else c for c in value]
            parts.append(value)
    parts.append(status.get("qosClass") if isinstance(status, dict) else None)
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    if isinstance(annotations, dict):
        parts.append(sorted((k, v) for k, v in annotations.items() if isinstance(k, str)
                            and k.startswith(ANNOTATION_PREFIX) and isinstance(v, str)))
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
