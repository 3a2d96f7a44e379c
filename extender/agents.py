"""The agents' fleet: the topologies agents stream to the controller, decided by ``planner.fleet``.

The decision is ``planner.fleet.evaluate``, the code ``memtopo controller place`` runs: one decision
path, two front ends; each node comes to it through ``planner.fleet.SnapshotNodes``, the road the
Place RPC takes too (device views derived once per snapshot). The extender reads the controller's fleet
through :class:`AgentFleet` only; the command that runs both passes the controller's state in.

Devices already handed out (hccs, xpu) come from ``DeviceUseView``s: the extender's own
``DeviceLedger`` (the ``memtopo.io/allocation`` annotations bind writes, read back from the API server
every ``refresh_s``), plus any other view given.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from memtopo.extender.ask import DEVICE_RESOURCE, PodAsk, pod_ask
from memtopo.extender.ledger import (
    ALLOCATION_ANNOTATION,
    BOUND_PODS,
    Allocation,
    DeviceLedger,
    DeviceUseView,
    parse_allocation,
)
from memtopo.extender.wire import MAX_EXTENDER_PRIORITY, BindArgs, ExtenderError, Verdict, obj
from memtopo.k8s import enforcement, kubeapi
from memtopo.k8s.kubeapi import KubeApi, KubeApiError
from memtopo.logs import get_logger
from memtopo.planner import fleet as fleet_policies
from memtopo.planner.errors import PlanError
from memtopo.planner.fleet import FleetNode, Held, NodePick, NodeVerdict, SnapshotNodes
from memtopo.text import shorten

log = get_logger(component="extender")

UNKNOWN_NODE: Final = "memtopo: no agent has reported this node to the controller"
PLACEMENT_ANNOTATION: Final = enforcement.PLACEMENT_ANNOTATION
DEFAULT_REFRESH_S: Final = 10.0
_UNKNOWN: Final = NodeVerdict(False, UNKNOWN_NODE, True)


class AgentFleet(Protocol):
    """What the extender reads of the controller's fleet (``controller.state.ControllerState``)."""

    @property
    def version(self) -> int:
        """Grows whenever a node's link state or topology changes."""
        ...

    @property
    def nodes(self) -> SnapshotNodes:
        """Stored snapshots → FleetNodes, shared with the controller's Place RPC."""
        ...

    def held(self, names: Sequence[str]) -> tuple[list[Held], list[str]]:
        """(name, link up, snapshot bytes or None) of the named nodes held, and the names not held."""
        ...


@dataclass(frozen=True)
class Judgement:
    """Every candidate's verdict under the pod's policy (``ask.policy`` None: none, every node passes)."""

    ask: PodAsk
    verdicts: Mapping[str, NodeVerdict]
    evaluation: fleet_policies.Evaluation | None = None
    tagged: dict[int, Verdict] = field(default_factory=dict)

    def verdict(self, name: str) -> Verdict | None:
        v = self.verdicts.get(name)
        if v is None or v.fits:
            return None
        out = self.tagged.get(id(v))
        if out is None:
            # The unknown-node reason is memtopo's own; the policies' get the policy's name.
            reason = v.reason if v is _UNKNOWN else f"memtopo {self.ask.policy}: {v.reason}"
            out = self.tagged[id(v)] = Verdict(False, reason, v.unresolvable)
        return out

    def failures(self, names: Sequence[str]) -> dict[str, Verdict]:
        out: dict[str, Verdict] = {}
        for name in names:
            v = self.verdict(name)
            if v is not None:
                out[name] = v
        return out

    def scores(self, names: Sequence[str]) -> list[int]:
        """0–10 for ``names`` (the judged nodes or some of them): the dense rank of the policy's score
        among these names, so the best of them gets 10 even when the judgement covered more nodes
        (kube-scheduler prioritizes what survived every filter); 0 for a node that does not fit."""
        get = self.verdicts.get
        verdicts = [get(name) for name in names]
        present = sorted({v.level for v in verdicts if v is not None and v.fits})
        score_of = {level: max(1, MAX_EXTENDER_PRIORITY - rank) for rank, level in enumerate(present)}
        return [score_of[v.level] if v is not None and v.fits else 0 for v in verdicts]

    def pick(self, name: str) -> NodePick | None:
        return self.evaluation.pick(name) if self.evaluation is not None else None


def judge(ask: PodAsk, nodes: Sequence[FleetNode], allocated: Mapping[str, frozenset[int]],
          unknown: Sequence[str] = ()) -> Judgement:
    """Every node's verdict under the pod's policy, through ``planner.fleet.evaluate``. ``nodes`` are
    the candidates (unique names); ``unknown`` the candidates no agent has reported."""
    policy = ask.policy
    assert policy is not None
    verdicts: dict[str, NodeVerdict] = dict.fromkeys(unknown, _UNKNOWN)
    if not nodes:
        return Judgement(ask, verdicts)
    # No node_names: the nodes given are exactly the candidates.
    body: dict[str, Any] = dict(ask.request)
    if policy != "place" and allocated:
        known = {n.name for n in nodes}
        body["allocated"] = {n: sorted(ids) for n, ids in allocated.items() if n in known and ids}
    try:
        evaluation = fleet_policies.evaluate(policy, body, nodes)
    except PlanError as exc:
        raise ExtenderError("invalid_pod", f"{policy}: {exc.message}") from exc
    verdicts.update(evaluation.verdicts())
    return Judgement(ask, verdicts, evaluation)


class AgentsFleet:
    """The verbs' decisions over the controller's fleet. ``api`` (None: bind answers an Error and the
    ledger holds nothing) reads and binds pods; ``views`` are further sources of devices in use."""

    def __init__(self, fleet: AgentFleet, api: KubeApi | None = None, views: Sequence[DeviceUseView] = (),
                 refresh_s: float = DEFAULT_REFRESH_S) -> None:
        self.fleet = fleet
        self.api = api
        self.ledger = DeviceLedger()
        self.views: tuple[DeviceUseView, ...] = (self.ledger, *views)
        self.refresh_s = refresh_s
        self._bind_lock = asyncio.Lock()
        # The last judgement, for the prioritize that follows a filter of the same pod: (what it
        # depends on, the names it covers, it). Valid while the fleet and the ledger are unchanged.
        self._last: tuple[tuple[Any, ...], frozenset[str], Judgement] | None = None

    # ---- judging ----------------------------------------------------------------------------------
    async def judge(self, pod: Mapping[str, Any], names: Sequence[str]) -> Judgement:
        ask = pod_ask(pod)
        if ask.policy is None or not names:
            return Judgement(ask, {})
        # Only the ledger's version is known; other device views could change unseen.
        key = (ask.policy, json.dumps(ask.request, sort_keys=True), self.fleet.version,
               self.ledger.version) if len(self.views) == 1 else None
        last = self._last
        wanted = frozenset(names)
        if key is not None and last is not None and last[0] == key and wanted <= last[1]:
            return last[2]
        judgement = await self.judge_names(ask, names)
        if key is not None:
            self._last = (key, wanted, judgement)
        return judgement

    async def judge_names(self, ask: PodAsk, names: Sequence[str]) -> Judgement:
        # Taken on the loop, where the fleet lives; the ranking runs in a thread so the loop keeps
        # serving agent links (the same split as the Place RPC).
        held, unknown = self.fleet.held(list(dict.fromkeys(names)))
        allocated = self.allocated(ask.resource) if ask.resource is not None else {}
        policy = ask.policy
        assert policy is not None
        road = self.fleet.nodes
        return await asyncio.to_thread(lambda: judge(ask, road.nodes(held, policy), allocated, unknown))

    def allocated(self, resource: str) -> dict[str, frozenset[int]]:
        """Device ids (0–7) in use per node for ``resource``: the union of every view."""
        merged: dict[str, set[int]] = {}
        for view in self.views:
            for node, ids in view.allocated(resource).items():
                merged.setdefault(node, set()).update(ids)
        return {n: frozenset(i for i in ids if 0 <= i < 8) for n, ids in merged.items()}

    def in_use(self, policy: str) -> dict[str, frozenset[int]]:
        """``allocated`` for the resource of a device policy (hccs, xpu): what the fleet page shows."""
        return self.allocated(DEVICE_RESOURCE[policy])

    # ---- bind -------------------------------------------------------------------------------------
    async def bind(self, api: KubeApi, args: BindArgs, pod: Mapping[str, Any]) -> dict[str, str]:
        """Choose the pod's devices on ``args.node`` again with the current ledger, write them into the
        pod's annotations, then the Binding. The choice and its entry in the ledger are made under a
        lock, the API calls after it: a slow API server delays (or fails) its own bind only, while
        later binds already see these devices as taken."""
        meta = obj(pod.get("metadata"), "Pod.metadata")
        key = args.uid or str(meta.get("uid", "")) or f"{args.namespace}/{args.name}"
        allocation: Allocation | None = None
        annotations: dict[str, str] = {}
        async with self._bind_lock:
            ask = pod_ask(pod)
            if ask.policy is not None:
                judgement = await self.judge_names(ask, [args.node])
                pick = judgement.pick(args.node)
                if pick is None:
                    v = judgement.verdict(args.node)
                    raise ExtenderError("no_fit", f"bind: {args.node} no longer fits pod {args.namespace}/"
                                                  f"{args.name}: {v.reason if v is not None else 'no verdict'}")
                annotations, allocation = _annotations(pick)
                if allocation is not None:
                    self.ledger.record(key, allocation)
        try:
            if annotations:
                await api.annotate_pod(args.namespace, args.name, annotations)
            await api.bind_pod(args.namespace, args.name, args.uid, args.node)
        except KubeApiError as exc:
            if allocation is not None:
                self.ledger.forget(key)
            raise ExtenderError("api", f"bind: {args.namespace}/{args.name} → {args.node}: {exc}") from exc
        log.info("extender_bound", pod=f"{args.namespace}/{args.name}", node=args.node, policy=ask.policy,
                 why=ask.why, devices=annotations.get(ALLOCATION_ANNOTATION))
        return annotations

    # ---- the ledger's refresh -----------------------------------------------------------------------
    async def refresh_once(self) -> None:
        api = self.api
        if api is None:
            return
        started = self.ledger.clock()
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
                log.warning("extender_refresh_failed", error=shorten(str(exc), 200))
            except Exception:
                log.exception("extender_refresh_failed")
            await asyncio.sleep(self.refresh_s)

    def scores(self, judgement: Judgement, names: Sequence[str]) -> list[int]:
        return judgement.scores(names)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        return True, {"fleet": "agents", "status": "ok", "ledger_version": self.ledger.version}


def _annotations(pick: NodePick) -> tuple[dict[str, str], Allocation | None]:
    """What the device plugin reads (hccs: ``huawei.com/Ascend910``; xpu: ``BAIDU_COM_DEVICE_IDX``),
    plus memtopo's own record of the devices (or, for place, of the placement)."""
    resource = DEVICE_RESOURCE.get(pick.policy)
    if resource is not None:
        allocation = Allocation(pick.node, resource, pick.devices)
        return {**pick.annotations, ALLOCATION_ANNOTATION: allocation.to_annotation()}, allocation
    return {PLACEMENT_ANNOTATION: json.dumps(pick.placement, separators=(",", ":"))}, None
