"""The agent's NodeResourceTopology publisher: server-side apply of this node's object.

One asyncio task in the agent. It builds the object from the published topology, the kubelet's
configuration and its PodResources answers, and applies it (``application/apply-patch+yaml``, field
manager ``memtopo``) whenever that object changes: on every new topology generation at once, and
when a PodResources poll finds containers' exclusive CPUs, devices or memory changed. The object
carries an owner reference to the Node, so it is garbage-collected with it.

An API server that is unreachable, refuses, or answers a conflict (another field manager owns a field,
e.g. NFD's topology-updater on the same node) is retried with capped, jittered backoff; the agent
keeps serving meanwhile, and :meth:`Publisher.status` (the agent's ``/readyz``) and the
``memtopo_k8s_nrt_behind`` gauge say the object in the cluster is behind. Its client is the wing's
one :class:`~memtopo.k8s.kubeapi.KubeApi` (deadlines, bounded answers, typed errors): whatever the API
server answers, the publisher reports it and retries; it never ends for it.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge

from memtopo.agent.config import KubernetesConfig
from memtopo.agent.state import TopologyState
from memtopo.backoff import Backoff
from memtopo.hostfs import HostFS
from memtopo.k8s.facts import EnforcedCpus, KubeletFacts, PodResourcesView
from memtopo.k8s.kubeapi import KubeApi, KubeApiError, metadata
from memtopo.k8s.names import InvalidNameError
from memtopo.k8s.nrt import NrtError, build_nrt
from memtopo.logs import get_logger
from memtopo.text import excerpt, shorten
from memtopo.v1 import topology_pb2 as pb

log = get_logger(component="k8s_publisher")

FIELD_MANAGER: Final = "memtopo"
REQUEST_TIMEOUT_S: Final = 10.0
# The publisher reads one Node and applies one object: answers are small.
MAX_ANSWER_BYTES: Final = 4 << 20
OUTCOMES: Final = ("ok", "unreachable", "conflict", "rejected")


class ApplyError(Exception):
    """An apply that did not land. ``outcome``: unreachable, conflict or rejected (``status`` set)."""

    def __init__(self, outcome: str, reason: str, status: int = 0) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason
        self.status = status

    @classmethod
    def of(cls, exc: KubeApiError) -> ApplyError:
        outcome = "conflict" if exc.kind == "conflict" else "unreachable" if exc.transient else "rejected"
        return cls(outcome, str(exc), exc.status)


@dataclass(frozen=True)
class PublisherSettings:
    node_name: str
    # Seconds between PodResources polls (the kubelet offers no watch).
    pod_resources_seconds: float = 10.0
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 60.0
    # Take fields another manager owns (server-side apply's force); off: a conflict is reported.
    force_conflicts: bool = False
    # Apply again this often even when nothing changed, with the Node's uid read afresh: heals an
    # object someone deleted and a Node that registered again under a new uid.
    resync_seconds: float = 600.0


@dataclass
class _Status:
    published_generation: int = 0
    published: dict[str, Any] | None = None
    applied_at: float = 0.0
    behind: bool = False
    last_error: str = ""
    attempts: int = 0
    pods_problem: str = "not read yet"


class Publisher:
    """``api``: the client, or a function making it at the first apply (in-cluster credentials missing
    then are an apply failure, retried and reported, not a failure to start)."""

    def __init__(self, settings: PublisherSettings, state: TopologyState, api: KubeApi | Callable[[], KubeApi], *,
                 read_kubelet: Callable[[], KubeletFacts], read_pods: Callable[[], PodResourcesView],
                 registry: CollectorRegistry | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.state = state
        self._api = api
        self._read_kubelet = read_kubelet
        self._read_pods = read_pods
        self._sleep = sleep
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self._status = _Status()
        self._owner_uid = ""
        self._stop = asyncio.Event()
        self._poked = asyncio.Event()
        self._read_enforced: Callable[[], EnforcedCpus | None] = lambda: None
        self._backoff = Backoff(settings.backoff_initial_seconds, settings.backoff_max_seconds)
        reg = registry or CollectorRegistry()
        self._m_generation = Gauge("memtopo_k8s_nrt_published_generation",
                                   "Topology generation of the NodeResourceTopology last applied.", registry=reg)
        self._m_behind = Gauge("memtopo_k8s_nrt_behind",
                               "1 while the NodeResourceTopology in the cluster is older than the agent's.",
                               registry=reg)
        self._m_applies = Counter("memtopo_k8s_nrt_applies", "Server-side applies of the NodeResourceTopology, "
                                  "by outcome.", ["outcome"], registry=reg)
        for outcome in OUTCOMES:
            self._m_applies.labels(outcome)

    # ---- readiness (read from the health server's threads: plain attribute reads) -------------------
    def status(self) -> tuple[bool, str]:
        s = self._status
        if s.behind:
            return False, f"behind: generation {self.state.generation} not applied ({s.last_error})"
        if s.published is None:
            return True, "not applied yet"
        return True, f"applied generation {s.published_generation}"

    @property
    def published(self) -> dict[str, Any] | None:
        return self._status.published

    def stop(self) -> None:
        self._stop.set()

    def follow_enforcement(self, read: Callable[[], EnforcedCpus | None]) -> None:
        """Count the exclusive CPUs memtopo's own enforcement holds (``read()`` at every build): where
        memtopo is the CPU manager the kubelet's PodResources does not know them. Call :meth:`poke`
        when they change."""
        self._read_enforced = read

    def poke(self) -> None:
        """Build and apply again now (what the object counts changed outside the topology)."""
        self._poked.set()

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    @property
    def api(self) -> KubeApi:
        if not isinstance(self._api, KubeApi):
            self._api = self._api()
        return self._api

    # ---- building -----------------------------------------------------------------------------------
    async def desired(self, topo: pb.MemoryTopology) -> dict[str, Any]:
        """The object for ``topo`` with the kubelet's facts and PodResources answers read now."""
        from memtopo.k8s.podresources import PodResourcesError

        kubelet = await asyncio.to_thread(self._read_kubelet)
        try:
            pods: PodResourcesView | None = await asyncio.to_thread(self._read_pods)
            problem = ""
        except PodResourcesError as exc:
            pods, problem = None, exc.reason
        except Exception as exc:  # a PodResources bug costs the pod counts, not the object
            pods, problem = None, shorten(f"{type(exc).__name__}: {exc}", 160)
        if problem != self._status.pods_problem:
            # Once per distinct cause: a kubelet answering garbage every poll is one line, not one a poll.
            if problem:
                log.warning("pod_resources_state", available=False, reason=problem)
            else:
                log.info("pod_resources_state", available=True)
            self._status.pods_problem = problem
        owner = {"name": self.settings.node_name, "uid": self._owner_uid} if self._owner_uid else None
        try:
            return build_nrt(topo, self.settings.node_name, kubelet=kubelet, pods=pods, pods_problem=problem,
                             owner=owner, enforced=self._read_enforced())
        except NrtError as exc:  # a node name no API server accepts: retried, but only a fix helps
            raise ApplyError("rejected", str(exc)) from None

    async def _node_uid(self) -> str:
        name = self.settings.node_name
        action = f"read Node {name}"
        try:
            uid = metadata(await self.api.get_node(name), action).get("uid")
        except InvalidNameError as exc:
            raise ApplyError("rejected", f"{action}: {exc}") from None
        if not isinstance(uid, str) or not uid:
            raise ApplyError("rejected", f"{action}: the Node has no uid: {excerpt(shorten(uid))}")
        return uid

    # ---- the task -----------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run()
        finally:
            if isinstance(self._api, KubeApi):
                await self._api.close()

    async def _run(self) -> None:
        s = self._status
        while not self._stop.is_set() and not self.state.closing:
            cur = self.state.current
            if cur is None:
                await self.state.wait_change(0, self.settings.pod_resources_seconds)
                continue
            if s.published is not None and self._now() - s.applied_at >= self.settings.resync_seconds:
                self._owner_uid, s.published = "", None
            try:
                try:
                    if not self._owner_uid:
                        self._owner_uid = await self._node_uid()
                    obj = await self.desired(cur.topology)
                    if obj != s.published:
                        await self._apply(obj, cur.generation)
                except KubeApiError as exc:
                    raise ApplyError.of(exc) from None
                if s.behind:
                    log.info("nrt_caught_up", generation=cur.generation)
                s.behind, s.attempts, s.last_error = False, 0, ""
                self._m_behind.set(0)
            except ApplyError as exc:
                self._m_applies.labels(exc.outcome).inc()
                s.behind, s.last_error = True, exc.reason
                self._m_behind.set(1)
                delay = self._backoff.delay(s.attempts, self._rng)
                s.attempts += 1
                log.warning("nrt_apply_failed", outcome=exc.outcome, error=exc.reason, attempt=s.attempts,
                            retry_seconds=round(delay, 3), generation=cur.generation)
                await self._sleep(delay)
                continue
            # A new generation wakes at once; otherwise poll PodResources.
            await self._wait_for_change(cur.generation)

    async def _wait_for_change(self, generation: int) -> None:
        change = asyncio.ensure_future(self.state.wait_change(generation, self.settings.pod_resources_seconds))
        stop = asyncio.ensure_future(self._stop.wait())
        poked = asyncio.ensure_future(self._poked.wait())
        try:
            await asyncio.wait({change, stop, poked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (change, stop, poked):
                task.cancel()
            await asyncio.gather(change, stop, poked, return_exceptions=True)
        self._poked.clear()

    async def _apply(self, obj: dict[str, Any], generation: int) -> None:
        await self.api.apply_nrt(obj, field_manager=FIELD_MANAGER, force=self.settings.force_conflicts)
        s = self._status
        s.published, s.published_generation, s.applied_at = obj, generation, self._now()
        self._m_generation.set(generation)
        self._m_applies.labels("ok").inc()
        log.info("nrt_applied", node=self.settings.node_name, generation=generation, zones=len(obj["zones"]))


def publisher_for(cfg: KubernetesConfig, agent_node_name: str, fs: HostFS, state: TopologyState,
                  registry: CollectorRegistry | None = None) -> Publisher:
    """The agent's publisher for its ``[kubernetes]`` section; ``fs`` is the root the agent discovers."""
    from memtopo.k8s.defaults import DEFAULT_CONFIG_PATHS
    from memtopo.k8s.kubelet import read_kubelet_facts
    from memtopo.k8s.podresources import PodResourcesError, read_pod_resources

    paths = (cfg.kubelet_config,) if cfg.kubelet_config else DEFAULT_CONFIG_PATHS

    def read_pods() -> PodResourcesView:
        if not cfg.pod_resources_socket:
            raise PodResourcesError("kubernetes.pod_resources_socket is empty")
        return read_pod_resources(cfg.pod_resources_socket)

    settings = PublisherSettings(
        node_name=cfg.node_name or os.environ.get("NODE_NAME", "") or agent_node_name,
        pod_resources_seconds=cfg.pod_resources_seconds, backoff_initial_seconds=cfg.backoff_initial_seconds,
        backoff_max_seconds=cfg.backoff_max_seconds, force_conflicts=cfg.force_conflicts)
    def api() -> KubeApi:
        return KubeApi.from_flag(cfg.api_server, timeout_s=REQUEST_TIMEOUT_S, max_answer_bytes=MAX_ANSWER_BYTES)

    return Publisher(settings, state, api, read_kubelet=lambda: read_kubelet_facts(fs, paths),
                     read_pods=read_pods, registry=registry)
