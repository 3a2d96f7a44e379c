"""The API side of the CPU enforcement: the pods bound to this node, and what the enforcement tells them.

:class:`InformerPods` is ``agent/enforce.py``'s ``PodSource`` over the wing's informer: it lists and
watches ``pods`` with ``fieldSelector=spec.nodeName=<node>`` (the kubelet's own selector), so the
agent holds this node's pods only, each kept as the few fields the enforcement reads. Until the first
complete list has arrived it is not ``synced()``: an agent that restarts sees no pods until then, and
an empty store must never read as "every pod went away" (that would release every pod's CPUs). A watch
that breaks keeps the store as it was (pods are released by a DELETED event or a list that no longer
has them, never by silence); every pod change, status updates included, wakes the enforcement at once.

:class:`ApiReporter` is its ``PodReporter``: the status annotation as a JSON merge patch that carries
the pod's uid (the API server refuses to change an object's uid, so a patch meant for a pod that was
deleted and created again under the same name fails instead of landing on the new one), and core/v1
Events from ``memtopo-agent`` on this node.

What the service account needs (``deploy/kubernetes/enforce/rbac.yaml``): pods ``list``, ``watch``,
``patch``; events ``create``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

from memtopo.agent.config import KubernetesConfig
from memtopo.k8s import enforcement, names
from memtopo.k8s.informer import Informer
from memtopo.k8s.kubeapi import KubeApi, core

EVENT_COMPONENT: Final = "memtopo-agent"
REQUEST_TIMEOUT_S: Final = 10.0
# What the enforcement reads of a container's resources (the pod's QoS class and its CPU count).
_RESOURCES: Final = ("cpu", "memory")
_CONTAINER_LISTS: Final = ("containers", "initContainers")
_ANNOTATIONS: Final = (enforcement.PLACEMENT_ANNOTATION,)


def _resources(value: object) -> object:
    # Absent is no resources; any other value that is not an object is kept as it came, so that
    # pod_view refuses it with the same reason as it would the whole pod.
    if not isinstance(value, Mapping):
        return {} if value is None else value
    out: dict[str, Any] = {}
    for key in ("requests", "limits"):
        amounts = value.get(key)
        if isinstance(amounts, Mapping):
            out[key] = {k: v for k, v in amounts.items() if k in _RESOURCES}
        elif amounts is not None:
            out[key] = amounts
    return out


def compact_pod(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a Pod the enforcement reads (``k8s/enforcement.py``'s ``pod_view``), as the same
    shape: identity, creation time and generation, the placement annotation, each container's name and
    cpu/memory requests and limits, ``spec.nodeName`` and ``status.phase``. The rest of the object (env,
    volumes, status of every container, other annotations) is not kept. A field of the wrong type is
    kept as it came, for ``pod_view`` to refuse with its reason."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    kept_meta = {k: meta[k] for k in ("uid", "name", "namespace", "generation", "creationTimestamp") if k in meta}
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping):
        # An oversized value is kept only as far as it shows it is too large to be a placement.
        kept_meta["annotations"] = {k: v[:enforcement.MAX_PLACEMENT_BYTES + 1] if isinstance(v, str) else v
                                    for k, v in annotations.items() if k in _ANNOTATIONS}
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    kept_spec: dict[str, Any] = {}
    if "nodeName" in spec:
        kept_spec["nodeName"] = spec["nodeName"]
    for key in _CONTAINER_LISTS:
        listed = spec.get(key)
        if isinstance(listed, list):
            kept_spec[key] = [{"name": c.get("name"), "resources": _resources(c.get("resources"))}
                              if isinstance(c, Mapping) else c for c in listed]
        elif listed is not None:
            kept_spec[key] = listed
    status = obj.get("status")
    phase = status.get("phase") if isinstance(status, Mapping) else None
    return {"metadata": kept_meta, "spec": kept_spec, "status": {"phase": phase} if phase is not None else {}}


class InformerPods:
    """The pods bound to ``node_name``, from an informer on ``api`` (run :meth:`run` as a task)."""

    def __init__(self, api: KubeApi, node_name: str, **informer_options: Any) -> None:
        self.node_name = names.node_name(node_name)
        self.api = api
        self._changed = asyncio.Event()
        self.informer: Informer[dict[str, Any]] = Informer(
            api, core("pods"), compact_pod, field_selector=f"spec.nodeName={self.node_name}",
            on_upsert=self._on_change, on_delete=self._on_change, **informer_options)

    def _on_change(self, _key: str, _value: object) -> None:
        self._changed.set()

    # ---- PodSource ----------------------------------------------------------------------------------
    def synced(self) -> bool:
        return self.informer.status().synced

    def bound_pods(self) -> Sequence[Mapping[str, Any]]:
        return [v for v in self.informer.items().values() if not isinstance(v, Exception)]

    async def wait_changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    # ---- the task -----------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self.informer.run()
        finally:
            await self.api.close()

    def stop(self) -> None:
        self.informer.stop()

    def status(self) -> str:
        """What ``/readyz`` shows (check ``enforce_pods``)."""
        s = self.informer.status()
        if not s.synced:
            return f"listing pods of node {self.node_name}" + (f": {s.last_error}" if s.last_error else "")
        text = f"{s.objects} pods on node {self.node_name}"
        if s.stale_since is not None:
            text += f"; watch broken for {s.stale_for(time.monotonic()):.0f} s: {s.last_error}"
        return text


class ApiReporter:
    """Writes the enforcement's status annotation and Events through ``api``."""

    def __init__(self, api: KubeApi, node_name: str) -> None:
        self.api = api
        self.node_name = node_name

    async def annotate(self, namespace: str, name: str, uid: str, key: str, value: str) -> None:
        await self.api.annotate_pod(namespace, name, {key: value}, uid=uid)

    async def event(self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        kind: Literal["Normal", "Warning"] = "Warning" if type_ == "Warning" else "Normal"
        await self.api.create_event(namespace=namespace, pod_name=name, pod_uid=uid, reason=reason,
                                    message=message, event_type=kind,
                                    component=EVENT_COMPONENT, host=self.node_name)


def pod_api_for(cfg: KubernetesConfig, agent_node_name: str) -> tuple[InformerPods, ApiReporter]:
    """The enforcement's pod source and reporter for the agent's ``[kubernetes]`` section (one client
    for both); :class:`~memtopo.k8s.kubeapi.KubeApiError` when no API server can be named (outside a
    cluster without ``api_server``), :class:`~memtopo.k8s.names.InvalidNameError` for a node name the
    API server would refuse."""
    node = cfg.node_name or os.environ.get("NODE_NAME", "") or agent_node_name
    api = KubeApi.from_flag(cfg.api_server, timeout_s=REQUEST_TIMEOUT_S)
    return InformerPods(api, node), ApiReporter(api, node)
