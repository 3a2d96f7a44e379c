"""The fleet policies as a kube-scheduler extender (``k8s.io/kube-scheduler/extender/v1``).

kube-scheduler POSTs JSON to ``urlPrefix/VERB``; with ``urlPrefix: http://HOST:9471/scheduler`` the
verbs are ``/scheduler/filter``, ``/scheduler/prioritize`` and ``/scheduler/bind``. The extender
structs have no JSON tags, so their fields travel with Go's capitalised names (``Pod``, ``Nodes``,
``NodeNames``, ``FailedNodes`` …) and Go reads answers case-insensitively; this module reads them
case-insensitively too. The Pod and NodeList inside are Kubernetes objects with their usual
lower-case fields. Every answer is HTTP 200: a failure is the answer's ``Error`` (filter, bind) — a
prioritize failure answers ``{"Error": …}`` too, which kube-scheduler reports as a failed
prioritize and scores without this extender (its documented behaviour for prioritize errors).

The decision is ``planner.fleet.evaluate``, the code ``memtopo controller place`` runs: one
decision path, two front ends. The pod says which policy (``pod_ask``): ``huawei.com/Ascend910`` →
hccs, ``kunlunxin.com/xpu`` → xpu, ``nvidia.com/gpu``/``amd.com/gpu`` or a ``memtopo.io/`` annotation
→ place with the pod's CPU and memory requests; ``memtopo.io/policy`` names one outright (``none``:
pass through). A pod asking for nothing memtopo places passes through: filter keeps every node,
prioritize gives every node 0.

Devices already handed out (hccs, xpu) come from ``DeviceUseView``s: the extender's own
``DeviceLedger`` (the ``memtopo.io/allocation`` annotations bind writes, read back from the API
server every ``refresh_s``), plus any other view given — that seam is where a NodeResourceTopology /
PodResources view of the kubelet's device assignments plugs in.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final, Protocol

from memtopo.controller.state import ControllerState
from memtopo.httpserve import HttpError, Request, Response, Routes
from memtopo.k8s import enforcement, kubeapi, quantity
from memtopo.k8s import names as k8s_names
from memtopo.k8s.kubeapi import KubeApi, KubeApiError
from memtopo.k8s.names import InvalidNameError
from memtopo.k8s.resources import AMD_GPU, ASCEND_910, KUNLUNXIN_XPU, NVIDIA_GPU, XPU_DEVICE_ANNOTATION
from memtopo.logs import get_logger
from memtopo.planner import fleet as fleet_policies
from memtopo.planner import hccs, place, xpu
from memtopo.planner.errors import PlanError
from memtopo.planner.fleet import DeviceView, FleetNode
from memtopo.text import shorten
from memtopo.v1 import topology_pb2 as pb

log = get_logger(component="extender")

PREFIX: Final = "/scheduler/"
VERBS: Final = ("filter", "prioritize", "bind")
MAX_EXTENDER_PRIORITY: Final = 10  # k8s.io/kube-scheduler/extender/v1.MaxExtenderPriority

NPU_RESOURCE: Final = ASCEND_910
XPU_RESOURCE: Final = KUNLUNXIN_XPU
GPU_RESOURCES: Final = (NVIDIA_GPU, AMD_GPU)
ANNOTATION_PREFIX: Final = "memtopo.io/"
POLICY_ANNOTATION: Final = "memtopo.io/policy"
WORKLOAD_ANNOTATION: Final = "memtopo.io/workload"
MEMORY_POLICY_ANNOTATION: Final = "memtopo.io/memory-policy"
ALLOW_CXL_ANNOTATION: Final = "memtopo.io/allow-cxl"
# Written by bind: {"node", "resource", "ids"}; the ledger reads them back from every bound pod.
ALLOCATION_ANNOTATION: Final = "memtopo.io/allocation"
# Written by bind for a place pod: the node's decision (CPUs, GPUs, memory nodes, memory policy),
# which the node's CPU enforcement (agent/enforce.py) carries out.
PLACEMENT_ANNOTATION: Final = enforcement.PLACEMENT_ANNOTATION
XPU_ANNOTATION: Final = XPU_DEVICE_ANNOTATION
POD_SIZES: Final = (1, 2, 4, 8)
MAX_NAME: Final = 253
GIB: Final = 1 << 30
DEFAULT_REFRESH_S: Final = 10.0
# The pods the ledger reads its allocations from: bound to a node and not finished.
BOUND_PODS: Final = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
_DEVICE_RESOURCE: Final = {"hccs": NPU_RESOURCE, "xpu": XPU_RESOURCE}


class ExtenderError(Exception):
    """A request the extender answers with ``Error``; ``reason`` is the failure metric's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---- the pod -----------------------------------------------------------------------------------------
def parse_quantity(value: object) -> Fraction:
    """A Kubernetes resource quantity (``500m``, ``2``, ``64Gi``, ``1e3``) → its exact value;
    ExtenderError for anything else (negative quantities included)."""
    try:
        return quantity.parse_nonnegative(value)
    except quantity.QuantityError as exc:
        raise ExtenderError("invalid_pod", f"resource quantity {exc}") from None


def _obj(value: object, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ExtenderError("invalid_pod", f"{what} is not a JSON object")
    return value


def _container_requests(container: object, where: str) -> dict[str, Fraction]:
    resources = _obj(_obj(container, where).get("resources"), f"{where}.resources")
    requests = _obj(resources.get("requests"), f"{where}.resources.requests")
    limits = _obj(resources.get("limits"), f"{where}.resources.limits")
    # The API server defaults a request to its limit; extended resources are often given as limits only.
    return {name: parse_quantity(q) for name, q in {**limits, **requests}.items()}


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Fraction]:
    """The pod's effective requests: the larger of its containers' sum and any one init container."""
    spec = _obj(pod.get("spec"), "Pod.spec")
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
    """What a pod asks memtopo: ``policy`` None = nothing (pass through); ``request`` is the fleet
    request body (as ``memtopo controller place --request`` takes it, without node_names/allocated)."""

    policy: str | None
    request: Mapping[str, Any]
    why: str

    @property
    def resource(self) -> str | None:
        return _DEVICE_RESOURCE.get(self.policy or "")


def _count(requests: Mapping[str, Fraction], name: str) -> int:
    q = requests.get(name, Fraction(0))
    if q.denominator != 1:
        raise ExtenderError("invalid_pod", f"{name}: {float(q):g} is not a whole number of devices")
    return int(q)


def _device_count(policy: str, requests: Mapping[str, Fraction]) -> int:
    resource = _DEVICE_RESOURCE[policy]
    n = _count(requests, resource)
    if n == 0:
        raise ExtenderError("invalid_pod", f"{POLICY_ANNOTATION}={policy} needs a {resource} request")
    if n not in POD_SIZES:
        # The hccs policy also takes jobs of 8·N NPUs, as N pods: one pod holds at most one node's 8.
        raise ExtenderError("invalid_pod", f"{resource}: a pod asks for 1, 2, 4 or 8, not {n}")
    return n


def pod_ask(pod: Mapping[str, Any]) -> PodAsk:
    """Which policy places this pod, and its request; ExtenderError for a pod that asks nonsense."""
    meta = _obj(pod.get("metadata"), "Pod.metadata")
    annotations = {k: v for k, v in _obj(meta.get("annotations"), "Pod.metadata.annotations").items()
                   if isinstance(k, str) and k.startswith(ANNOTATION_PREFIX)}
    requests = pod_requests(pod)
    named = annotations.get(POLICY_ANNOTATION)
    if named is not None and named not in (*fleet_policies.POLICIES, "none"):
        raise ExtenderError("invalid_pod", f"{POLICY_ANNOTATION}: {shorten(named)!r} is not one of "
                                           f"{', '.join((*fleet_policies.POLICIES, 'none'))}")
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
    if policy in _DEVICE_RESOURCE:
        return PodAsk(policy, {"request": _device_count(policy, requests)},
                      f"{_DEVICE_RESOURCE[policy]} request" if named is None else f"{POLICY_ANNOTATION}={policy}")
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
            raise ExtenderError("invalid_pod", f"{ALLOW_CXL_ANNOTATION}: expected true or false, got {shorten(cxl)!r}")
        constraints["allow_cxl_memory"] = cxl == "true"
    if constraints:
        body["constraints"] = constraints
    return PodAsk("place", body, "GPU request" if gpus and named is None else
                  f"{POLICY_ANNOTATION}=place" if named else "memtopo.io annotations")


# ---- devices already handed out ----------------------------------------------------------------------
class DeviceUseView(Protocol):
    """Device ids in use per node for one extended resource (``huawei.com/Ascend910``,
    ``kunlunxin.com/xpu``). ``DeviceLedger`` derives it from the annotations bind writes; a
    NodeResourceTopology / kubelet PodResources view (allocatable minus available devices per
    zone) is the other source meant for this seam. Views are merged by union."""

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
    if not isinstance(raw, str) or not isinstance(node, str) or not node or len(raw) > 4096:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
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
        self._clock = clock
        # Grows with every change: a decision taken at one version is stale at the next.
        self.version = 0

    def record(self, uid: str, allocation: Allocation) -> None:
        self._recent[uid] = (self._clock(), allocation)
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


# ---- verdicts ----------------------------------------------------------------------------------------
UNKNOWN_NODE: Final = "memtopo: no agent has reported this node to the controller"
# What bind writes from: the node's own result in the policy's decision.
Pick = hccs.NodeResult | xpu.NodeResult | place.PlaceDecision


@dataclass(frozen=True)
class NodeVerdict:
    fits: bool
    reason: str = ""
    unresolvable: bool = False  # preemption cannot make it fit
    level: int = 0  # 0 = the policy's best; one more per distinct, lower policy score


@dataclass(frozen=True)
class Judgement:
    ask: PodAsk
    verdicts: Mapping[str, NodeVerdict]
    decision: fleet_policies.Decision | None = None

    def scores(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """The HostPriorityList for ``names`` (the judged nodes or some of them): the dense rank of
        the policy's score among these names, so the best of them gets 10 even when the judgement
        covered more nodes (kube-scheduler prioritizes what survived every filter)."""
        get = self.verdicts.get
        verdicts = [get(name) for name in names]
        present = sorted({v.level for v in verdicts if v is not None and v.fits})
        score_of = {level: max(1, MAX_EXTENDER_PRIORITY - rank) for rank, level in enumerate(present)}
        return [{"Host": name, "Score": score_of[v.level] if v is not None and v.fits else 0}
                for name, v in zip(names, verdicts, strict=True)]

    def pick(self, name: str) -> Pick | None:
        """The node's own result in the decision (what bind writes from); None unless it fits."""
        d = self.decision
        if isinstance(d, hccs.Decision):
            return next((hccs.NodeResult(n, f, d.per_pod) for n, f in zip(d.ranked, d.fits, strict=True)
                         if n.name == name and f.fits), None)
        if isinstance(d, xpu.Decision):
            return next((xpu.NodeResult(n, o) for n, o in zip(d.ranked, d.outcomes, strict=True)
                         if n.name == name and o.devices), None)
        if isinstance(d, place.FleetDecision):
            return next((p for p in d.ranked if p.node == name), None)
        return None


def _levels(verdicts: dict[str, NodeVerdict], fitting: Iterable[tuple[Any, str]]) -> None:
    """Fitting nodes in the policy's order (best first) → verdicts with their dense rank (one shared
    verdict object per rank: a 5,000-node answer builds a handful, not 5,000)."""
    level, previous = -1, object()
    verdict = NodeVerdict(True)
    for key, name in fitting:
        if key != previous:
            level, previous = level + 1, key
            verdict = NodeVerdict(True, level=level)
        verdicts[name] = verdict


def judge(ask: PodAsk, nodes: Sequence[FleetNode], allocated: Mapping[str, frozenset[int]],
          unknown: Iterable[str] = ()) -> Judgement:
    """Every node's verdict under the pod's policy, through ``planner.fleet.evaluate``: the nodes it
    ranks as fitting pass, in its order; the others fail with its reason. ``nodes`` are the
    candidates (unique names); ``unknown`` the candidates no agent has reported."""
    policy = ask.policy
    assert policy is not None
    verdicts: dict[str, NodeVerdict] = dict.fromkeys(unknown, NodeVerdict(False, UNKNOWN_NODE, True))
    if not nodes:
        return Judgement(ask, verdicts)
    # No node_names: the nodes given are exactly the candidates.
    body: dict[str, Any] = dict(ask.request)
    if policy != "place" and allocated:
        known = {n.name for n in nodes}
        body["allocated"] = {n: sorted(ids) for n, ids in allocated.items() if n in known and ids}
    try:
        ev = fleet_policies.evaluate(policy, body, nodes)
    except PlanError as exc:
        raise ExtenderError("invalid_pod", f"{policy}: {exc.message}") from exc
    for s in ev.skipped:
        verdicts[s.name] = NodeVerdict(False, f"memtopo {policy}: {s.reason}", True)
    d = ev.decision
    tag = f"memtopo {policy}: "
    failed: dict[tuple[str, bool], NodeVerdict] = {}  # nodes that fail alike share one verdict

    def fail(reason: str, unresolvable: bool) -> NodeVerdict:
        v = failed.get((reason, unresolvable))
        if v is None:
            v = failed[(reason, unresolvable)] = NodeVerdict(False, tag + reason, unresolvable)
        return v

    if isinstance(d, hccs.Decision):
        # Fewer healthy NPUs than the pod asks is for good; busy ones preemption may free.
        for node, fit in zip(d.ranked, d.fits, strict=True):
            if fit.score is None:
                verdicts[node.name] = fail(fit.reason or "", node.capacity < d.per_pod)
        _levels(verdicts, ((fit.score, node.name) for node, fit in zip(d.ranked, d.fits, strict=True)
                           if fit.score is not None))
    elif isinstance(d, xpu.Decision):
        # Every XPU of a P800 node is usable once freed: a node that does not fit now is resolvable.
        for xnode, outcome in zip(d.ranked, d.outcomes, strict=True):
            if not outcome.devices:
                verdicts[xnode.name] = fail(outcome.reason or "", False)
        _levels(verdicts, (((outcome.score, xnode.occupancy.bit_count()), xnode.name)
                           for xnode, outcome in zip(d.ranked, d.outcomes, strict=True) if outcome.devices))
    elif isinstance(d, place.FleetDecision):
        # place weighs the node's topology as a whole, not what runs on it: no preemption helps.
        for r in d.rejected:
            verdicts[r.node] = fail(f"{r.constraint}: {r.reason}", True)
        # The score place prints (rounded to 6 digits) is the one its order is read by.
        _levels(verdicts, ((round(p.intra_node_fitness, 6), p.node) for p in d.ranked))
    return Judgement(ask, verdicts, d)


# ---- the extender ------------------------------------------------------------------------------------
def _field(obj: Mapping[str, Any], name: str) -> Any:
    """Go's case-insensitive field match (an exact match first, as encoding/json does)."""
    if name in obj:
        return obj[name]
    lower = name.lower()
    for key, value in obj.items():
        if isinstance(key, str) and key.lower() == lower:
            return value
    return None


@dataclass(frozen=True)
class _Nodes:
    names: list[str]
    items: list[dict[str, Any]] | None  # the NodeList's items when the scheduler sent Nodes


def _candidate_nodes(args: Mapping[str, Any]) -> _Nodes:
    names = _field(args, "NodeNames")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ExtenderError("invalid_request", "NodeNames is not a list of strings")
        return _Nodes(_checked_names(names), None)
    node_list = _field(args, "Nodes")
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
    return _Nodes(_checked_names(out), items)


def _checked_names(names: list[str]) -> list[str]:
    if names and (not all(names) or max(map(len, names)) > MAX_NAME):
        bad = next(n for n in names if not n or len(n) > MAX_NAME)
        raise ExtenderError("invalid_request", f"node name {shorten(bad)!r} is not a node name")
    return names


class Extender:
    """The three verbs over the controller's fleet. ``api`` (None: bind answers an Error and the
    ledger holds nothing) reads and binds pods; ``views`` are further sources of devices in use."""

    def __init__(self, state: ControllerState, api: KubeApi | None = None,
                 views: Sequence[DeviceUseView] = (), refresh_s: float = DEFAULT_REFRESH_S) -> None:
        self.state = state
        self.api = api
        self.ledger = DeviceLedger()
        self.views: tuple[DeviceUseView, ...] = (self.ledger, *views)
        self.refresh_s = refresh_s
        # node → (the snapshot bytes it was derived from, link up, its FleetNode carrying the views:
        # policy → DeviceView or unusable reason, filled per policy on first use).
        self._derived: dict[str, tuple[bytes, bool, FleetNode, dict[str, DeviceView | str]]] = {}
        self._bind_lock = asyncio.Lock()
        # The last judgement, for the prioritize that follows a filter of the same pod: (what it
        # depends on, the names it covers, it). Valid while the fleet and the ledger are unchanged.
        self._last: tuple[tuple[Any, ...], frozenset[str], Judgement] | None = None

    @property
    def derived_nodes(self) -> int:
        """How many nodes' device views are derived (as their snapshots arrived, or on first use)."""
        return len(self._derived)

    # ---- routes ---------------------------------------------------------------------------------
    def install(self, routes: Routes) -> None:
        routes.add("POST", PREFIX + "filter", self._handler("filter", self.filter))
        routes.add("POST", PREFIX + "prioritize", self._handler("prioritize", self.prioritize))
        routes.add("POST", PREFIX + "bind", self._handler("bind", self.bind))

    def _handler(self, verb: str, fn: Callable[[Any], Any]) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            started = time.perf_counter()
            failure: str | None = None
            try:
                try:
                    args = await request.json()  # a large body is decoded off the loop
                except HttpError as exc:
                    raise ExtenderError("invalid_json", exc.message) from None
                if not isinstance(args, dict):
                    wanted = "ExtenderBindingArgs" if verb == "bind" else "ExtenderArgs"
                    raise ExtenderError("invalid_json", f"the body is not a JSON object ({verb} takes {wanted})")
                answer = await fn(args)
            except ExtenderError as exc:
                failure = exc.reason
                log.info("extender_refused", verb=verb, reason=exc.reason, error=str(exc), peer=request.peer)
                answer = {"Error": str(exc)}
            except Exception as exc:  # an answer for the scheduler, the traceback for the log
                failure = "internal"
                log.exception("extender_failed", verb=verb, peer=request.peer)
                answer = {"Error": f"memtopo extender internal error: {type(exc).__name__} (see the controller's log)"}
            self.state.metrics.observe_verb(verb, time.perf_counter() - started, failure)
            return Response.json(answer)
        return handle

    # ---- verbs ----------------------------------------------------------------------------------
    async def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        _, nodes, judgement = await self._judge(args)
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        passing: list[int] = []
        for i, name in enumerate(nodes.names):
            v = judgement.verdicts.get(name) if judgement is not None else None
            if v is None or v.fits:
                passing.append(i)
            else:
                (unresolvable if v.unresolvable else failed)[name] = v.reason
        out: dict[str, Any] = {"FailedNodes": failed, "FailedAndUnresolvableNodes": unresolvable, "Error": ""}
        if nodes.items is None:
            out["NodeNames"] = [nodes.names[i] for i in passing]
        else:
            out["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "metadata": {},
                            "items": [nodes.items[i] for i in passing]}
        return out

    async def prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        _, nodes, judgement = await self._judge(args)
        if judgement is None:
            return [{"Host": n, "Score": 0} for n in nodes.names]
        return judgement.scores(nodes.names)

    async def bind(self, args: Mapping[str, Any]) -> dict[str, Any]:
        fields = {k: _field(args, k) for k in ("PodName", "PodNamespace", "PodUID", "Node")}
        for key in ("PodName", "PodNamespace", "Node"):
            if not isinstance(fields[key], str) or not fields[key]:
                raise ExtenderError("invalid_request", f"ExtenderBindingArgs.{key} is missing")
        name, namespace, node = fields["PodName"], fields["PodNamespace"], fields["Node"]
        uid = fields["PodUID"] if isinstance(fields["PodUID"], str) else ""
        api = self.api
        if api is None:
            raise ExtenderError("no_api", "bind: this controller has no Kubernetes API server to bind through "
                                          "(memtopo controller serve --kube-api)")
        try:
            k8s_names.node_name(node)  # before it is part of a message or a Binding
            pod = await api.get_pod(namespace, name)
        except InvalidNameError as exc:
            raise ExtenderError("invalid_request", f"bind: {exc}") from None
        except KubeApiError as exc:
            raise ExtenderError("api", f"bind: {exc}") from exc
        pod_uid = _obj(pod.get("metadata"), "Pod.metadata").get("uid", "")
        if uid and pod_uid and uid != pod_uid:
            raise ExtenderError("stale", f"bind: pod {namespace}/{name} is now uid {shorten(pod_uid)}, "
                                         f"not {shorten(uid)}")
        key = uid or str(pod_uid) or f"{namespace}/{name}"
        # Two binds must not both take the same free devices: the choice and its entry in the ledger are
        # made under the lock, the API calls after it, so a slow API server delays (or fails) its own
        # bind only, while later binds already see these devices as taken.
        allocation: Allocation | None = None
        async with self._bind_lock:
            annotations: dict[str, str] = {}
            ask = pod_ask(pod)
            if ask.policy is not None:
                judgement = await self._judge_names(ask, [node])
                verdict = judgement.verdicts[node]
                pick = judgement.pick(node)
                if not verdict.fits or pick is None:
                    raise ExtenderError("no_fit", f"bind: {node} no longer fits pod {namespace}/{name}: "
                                                  f"{verdict.reason}")
                annotations = _annotations(node, pick)
                allocation = _allocation(node, pick)
                if allocation is not None:
                    self.ledger.record(key, allocation)
        try:
            if annotations:
                await api.annotate_pod(namespace, name, annotations)
            await api.bind_pod(namespace, name, uid, node)
        except (KubeApiError, InvalidNameError) as exc:
            if allocation is not None:
                self.ledger.forget(key)
            raise ExtenderError("api" if isinstance(exc, KubeApiError) else "invalid_request",
                                f"bind: {namespace}/{name} → {node}: {exc}") from exc
        log.info("extender_bound", pod=f"{namespace}/{name}", node=node, policy=ask.policy, why=ask.why,
                 devices=annotations.get(ALLOCATION_ANNOTATION))
        return {"Error": ""}

    # ---- shared ---------------------------------------------------------------------------------
    async def _judge(self, args: Mapping[str, Any]) -> tuple[PodAsk | None, _Nodes, Judgement | None]:
        pod = _field(args, "Pod")
        if not isinstance(pod, dict):
            raise ExtenderError("invalid_request", "ExtenderArgs.Pod is missing or not an object")
        nodes = _candidate_nodes(args)
        ask = pod_ask(pod)
        if ask.policy is None or not nodes.names:
            return ask, nodes, None
        # Only the ledger's version is known; other device views could change unseen.
        key = (ask.policy, json.dumps(ask.request, sort_keys=True), self.state.changes.version,
               self.ledger.version) if len(self.views) == 1 else None
        last = self._last
        names = frozenset(nodes.names)
        if key is not None and last is not None and last[0] == key and names <= last[1]:
            return ask, nodes, last[2]
        judgement = await self._judge_names(ask, nodes.names)
        if key is not None:
            self._last = (key, names, judgement)
        return ask, nodes, judgement

    async def _judge_names(self, ask: PodAsk, names: Sequence[str]) -> Judgement:
        # Taken on the loop, where the fleet lives; the ranking runs in a thread so the loop keeps
        # serving agent links (the same split as the Place RPC).
        held, unknown = self.state.fleet.held_many(dict.fromkeys(names))
        allocated = self.allocated(ask.resource) if ask.resource is not None else {}
        return await asyncio.to_thread(self._judge_held, ask, held, unknown, allocated)

    def allocated(self, resource: str) -> dict[str, frozenset[int]]:
        """Device ids (0–7) in use per node for ``resource``: the union of every view."""
        merged: dict[str, set[int]] = {}
        for view in self.views:
            for node, ids in view.allocated(resource).items():
                merged.setdefault(node, set()).update(ids)
        return {n: frozenset(i for i in ids if 0 <= i < 8) for n, ids in merged.items()}

    def in_use(self, policy: str) -> dict[str, frozenset[int]]:
        """``allocated`` for the resource of a device policy (hccs, xpu)."""
        return self.allocated(_DEVICE_RESOURCE[policy])

    def _judge_held(self, ask: PodAsk, held: Sequence[tuple[str, bool, bytes | None]], unknown: Sequence[str],
                    allocated: Mapping[str, frozenset[int]]) -> Judgement:
        policy = ask.policy
        assert policy is not None
        nodes: list[FleetNode] = []
        append = nodes.append
        derived = self._derived
        for name, connected, payload in held:
            if payload is None:
                append(FleetNode(name, None, connected))
            elif policy == "place":
                # place reads the whole topology; parsed per call (a parsed topology is several times
                # its wire size, too much to keep for every node of a large fleet).
                append(FleetNode(name, pb.MemoryTopology.FromString(payload), connected))
            else:
                cached = derived.get(name)
                if cached is not None and cached[0] is payload and cached[1] == connected and policy in cached[3]:
                    append(cached[2])
                else:
                    append(self._derive(name, connected, payload, (policy,)))
        return judge(ask, nodes, allocated, unknown)

    def _derive(self, name: str, connected: bool, payload: bytes, policies: Sequence[str]) -> FleetNode:
        """The node's FleetNode with the device views of ``policies``, from the cache when its
        snapshot (the bytes object) and link state are the ones the cache holds."""
        cached = self._derived.get(name)
        if cached is None or cached[0] is not payload or cached[1] != connected:
            views: dict[str, DeviceView | str] = cached[3] if cached is not None and cached[0] is payload else {}
            cached = self._derived[name] = (payload, connected, FleetNode(name, None, connected, views), views)
        missing = [p for p in policies if p not in cached[3]]
        if missing:
            topo = pb.MemoryTopology.FromString(payload)
            for p in missing:
                cached[3][p] = fleet_policies.device_view(p, topo)
        return cached[2]

    async def warm_forever(self, batch: int = 512) -> None:
        """Derive the device views of nodes whose snapshot changed as they arrive, off the loop, so the
        first filter after a start (or after a fleet-wide rescan) does not pay for thousands of them."""
        changes = self.state.changes
        seen = 0
        while True:
            now = await changes.wait(seen)
            changed = changes.since(seen)
            seen = now
            fleet = self.state.fleet
            names = [n.node_name for n in fleet.nodes()] if changed is None else sorted(changed)
            for i in range(0, len(names), batch):
                held, _ = fleet.held_many(names[i:i + batch])
                todo = [(n, c, p) for n, c, p in held if p is not None]
                if todo:
                    await asyncio.to_thread(self._warm, todo)

    def _warm(self, held: Sequence[tuple[str, bool, bytes | None]]) -> None:
        for name, connected, payload in held:
            if payload is None:
                continue
            try:
                self._derive(name, connected, payload, tuple(_DEVICE_RESOURCE))
            except Exception:  # a bad snapshot is the filter's to report, not the warmer's to die of
                log.exception("extender_warm_failed", node=name)

    # ---- the ledger's refresh -------------------------------------------------------------------
    async def refresh_once(self) -> None:
        api = self.api
        if api is None:
            return
        started = self.ledger._clock()
        pods: list[dict[str, Any]] = []
        async for page in api.list_pages(kubeapi.core("pods"), {"fieldSelector": BOUND_PODS}):
            # Only the pods carrying an allocation are kept: a large cluster's pods are not held at once.
            pods.extend(p for p in page.items if parse_allocation(p) is not None)
        self.ledger.replace(pods, started)
        log.debug("extender_ledger_refreshed", pods=len(pods), ledger_version=self.ledger.version)

    async def refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh_once()
            except KubeApiError as exc:
                log.warning("extender_refresh_failed", error=str(exc))
            except Exception:
                log.exception("extender_refresh_failed")
            await asyncio.sleep(self.refresh_s)


def _allocation(node: str, pick: Pick) -> Allocation | None:
    if isinstance(pick, hccs.NodeResult):
        return Allocation(node, NPU_RESOURCE, pick.npus)
    if isinstance(pick, xpu.NodeResult):
        return Allocation(node, XPU_RESOURCE, pick.outcome.devices)
    return None


def _annotations(node: str, pick: Pick) -> dict[str, str]:
    """What the device plugin reads (hccs: ``huawei.com/Ascend910``; xpu: ``BAIDU_COM_DEVICE_IDX``),
    plus memtopo's own record of the devices (or, for place, of the placement)."""
    allocation = _allocation(node, pick)
    if isinstance(pick, hccs.NodeResult):
        assert allocation is not None
        return {hccs.ANNOTATION_KEY: pick.annotation, ALLOCATION_ANNOTATION: allocation.to_annotation()}
    if isinstance(pick, xpu.NodeResult):
        assert allocation is not None
        return {XPU_ANNOTATION: ",".join(map(str, allocation.ids)), ALLOCATION_ANNOTATION: allocation.to_annotation()}
    return {PLACEMENT_ANNOTATION: json.dumps(pick.to_json(), separators=(",", ":"))}


def install(routes: Routes, state: ControllerState) -> None:
    """Register the verbs and start deriving device views as snapshots arrive; with an API server in
    ``state.kube``, also the ledger's refresh."""
    extender = Extender(state, state.kube, refresh_s=state.kube_refresh_s)
    extender.install(routes)
    state.extender = extender
    loop = asyncio.get_running_loop()
    jobs: list[tuple[str, Coroutine[Any, Any, None]]] = [("extender-warm", extender.warm_forever())]
    if state.kube is not None:
        jobs.append(("extender-refresh", extender.refresh_forever()))
    for name, job in jobs:
        task = loop.create_task(job, name=name)
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)

