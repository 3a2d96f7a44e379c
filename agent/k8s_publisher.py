"""The agent's NodeResourceTopology publisher: server-side apply of this node's object.

One asyncio task in the agent. It builds the object from the published topology, the kubelet's
configuration and its PodResources answers, and applies it (``application/apply-patch+yaml``, field
manager ``memtopo``) whenever that object changes: on every new topology generation at once, and
when a PodResources poll finds containers' exclusive CPUs, devices or memory changed. The object
carries an owner reference to the Node, so it is garbage-collected with it.

An API server that is unreachable, refuses, or answers a conflict (another field manager owns a field,
e.g. NFD's topology-updater on the same node) is retried with capped, jittered backoff; the agent
keeps serving meanwhile, and :meth:`Publisher.status` (the agent's ``/readyz``) and the
``memtopo_k8s_nrt_behind`` gauge say the object in the cluster is behind. The Kubernetes client
(``kubernetes_asyncio``) is imported only when the publisher connects.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from memtopo.agent.config import KubernetesConfig
from memtopo.agent.logs import get_logger
from memtopo.agent.state import TopologyState
from memtopo.backoff import Backoff
from memtopo.hostfs import HostFS
from memtopo.k8s.facts import KubeletFacts, PodResourcesView
from memtopo.k8s.nrt import API_VERSION, NrtError, build_nrt
from memtopo.v1 import topology_pb2 as pb

log = get_logger(component="k8s_publisher")

FIELD_MANAGER = "memtopo"
GROUP, VERSION = API_VERSION.split("/")
PLURAL = "noderesourcetopologies"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
REQUEST_TIMEOUT_S = 10.0
OUTCOMES = ("ok", "unreachable", "conflict", "rejected")


class ApplyError(Exception):
    """An apply that did not land. ``outcome``: unreachable, conflict or rejected (``status`` set)."""

    def __init__(self, outcome: str, reason: str, status: int = 0) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason
        self.status = status


class ApiClient(Protocol):
    """What the publisher needs from the API server."""

    async def node_uid(self, name: str) -> str: ...

    async def apply(self, obj: Mapping[str, Any], *, force: bool) -> Mapping[str, Any]: ...

    async def close(self) -> None: ...


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


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 160 else text[:159] + "…"


class KubernetesApi:
    """:class:`ApiClient` over ``kubernetes_asyncio``: in-cluster credentials (the pod's service
    account), or ``host`` for an API server named explicitly."""

    def __init__(self, host: str = "") -> None:
        self.host = host
        self._api: Any = None

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes_asyncio import client, config

            configuration = client.Configuration()
            if self.host:
                configuration.host = self.host
            else:
                try:
                    config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                except config.ConfigException as exc:
                    raise ApplyError("unreachable", f"no in-cluster credentials: {_message(exc)}") from None
            self._api = client.ApiClient(configuration)
        return self._api

    async def _call(self, make: Callable[[Any], Awaitable[Any]]) -> Any:
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await make(self._client())
        except ApiException as exc:
            status = int(exc.status or 0)
            outcome = "conflict" if status == 409 else "unreachable" if status >= 500 or status == 429 else "rejected"
            raise ApplyError(outcome, f"{status} {_status_message(exc.body) or exc.reason}", status) from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ApplyError("unreachable", _message(exc)) from None

    async def node_uid(self, name: str) -> str:
        from kubernetes_asyncio import client

        node = await self._call(lambda api: client.CoreV1Api(api).read_node(name, _request_timeout=REQUEST_TIMEOUT_S))
        return str(node.metadata.uid)

    async def apply(self, obj: Mapping[str, Any], *, force: bool) -> Mapping[str, Any]:
        from kubernetes_asyncio import client

        # The library's stub omits _content_type, which the method takes: without it the patch would go
        # out as a JSON merge patch, not an apply.
        result = await self._call(lambda api: client.CustomObjectsApi(api).patch_cluster_custom_object(
            GROUP, VERSION, PLURAL, obj["metadata"]["name"], dict(obj), field_manager=FIELD_MANAGER,
            # Only sent when set: the library would write Python's "False".
            force=True if force else None, _content_type=APPLY_CONTENT_TYPE,  # type: ignore[call-arg, arg-type]
            _request_timeout=REQUEST_TIMEOUT_S))
        return result if isinstance(result, Mapping) else {}

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None


def _status_message(body: object) -> str:
    """The ``message`` of a Kubernetes Status body, shortened; "" when it is not one."""
    import json

    try:
        doc = json.loads(body) if isinstance(body, str | bytes) else None
    except ValueError:
        return ""
    msg = doc.get("message") if isinstance(doc, dict) else None
    return _message(Exception(msg)) if isinstance(msg, str) else ""


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
    def __init__(self, settings: PublisherSettings, state: TopologyState, api: ApiClient, *,
                 read_kubelet: Callable[[], KubeletFacts], read_pods: Callable[[], PodResourcesView],
                 registry: CollectorRegistry | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.state = state
        self.api = api
        self._read_kubelet = read_kubelet
        self._read_pods = read_pods
        self._sleep = sleep
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self._status = _Status()
        self._owner_uid = ""
        self._stop = asyncio.Event()
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

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

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
        if problem != self._status.pods_problem:
            log.info("pod_resources_state", available=not problem, reason=problem or None)
            self._status.pods_problem = problem
        owner = {"name": self.settings.node_name, "uid": self._owner_uid} if self._owner_uid else None
        try:
            return build_nrt(topo, self.settings.node_name, kubelet=kubelet, pods=pods, pods_problem=problem,
                             owner=owner)
        except NrtError as exc:  # a node name no API server accepts: retried, but only a fix helps
            raise ApplyError("rejected", str(exc)) from None

    # ---- the task -----------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run()
        finally:
            await self.api.close()

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
                if not self._owner_uid:
                    self._owner_uid = await self.api.node_uid(self.settings.node_name)
                obj = await self.desired(cur.topology)
                if obj != s.published:
                    await self._apply(obj, cur.generation)
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
        try:
            await asyncio.wait({change, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (change, stop):
                task.cancel()
            await asyncio.gather(change, stop, return_exceptions=True)

    async def _apply(self, obj: dict[str, Any], generation: int) -> None:
        await self.api.apply(obj, force=self.settings.force_conflicts)
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
    return Publisher(settings, state, KubernetesApi(cfg.api_server), read_kubelet=lambda: read_kubelet_facts(fs, paths),
                     read_pods=read_pods, registry=registry)
