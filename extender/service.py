"""The three verbs over a fleet: plain async functions from the request's JSON to the answer's.

``Extender.answer(verb, body, caller)`` is all an HTTP front end calls: it checks the caller
(``auth.Authenticator``), decodes the body, runs the verb and answers kube-scheduler's JSON — an
``Error`` for every failure (a malformed request, a pod asking nonsense, an API server that fails), never
a traceback. The fleet (``Fleet``) decides: the agents' topologies (``agents.AgentsFleet``) or the API
server's NodeResourceTopologies (``nrt.NrtFleet``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, Protocol

from memtopo.extender.auth import Authenticator, Caller
from memtopo.extender.metrics import ExtenderMetrics
from memtopo.extender.wire import (
    BindArgs,
    ExtenderError,
    Failure,
    bind_args,
    candidates,
    filter_answer,
    obj,
    pod_of,
    priorities,
)
from memtopo.k8s import names as k8s_names
from memtopo.k8s.kubeapi import KubeApi, KubeApiError
from memtopo.k8s.names import InvalidNameError
from memtopo.logs import get_logger
from memtopo.text import shorten

log = get_logger(component="extender")


class Judged(Protocol):
    def failures(self, names: Sequence[str]) -> Mapping[str, Failure]: ...


class Fleet(Protocol):
    """What decides: a judgement of a pod over candidate names, scores from it, a bind."""

    async def judge(self, pod: Mapping[str, Any], names: Sequence[str]) -> Judged: ...

    def scores(self, judgement: Any, names: Sequence[str]) -> list[int]: ...

    async def bind(self, api: KubeApi, args: BindArgs, pod: Mapping[str, Any]) -> dict[str, str]: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]: ...


class Extender:
    def __init__(self, fleet: Fleet, *, api: KubeApi | None = None, auth: Authenticator | None = None,
                 metrics: ExtenderMetrics | None = None) -> None:
        self.fleet = fleet
        self.api = api
        self.auth = auth or Authenticator()
        self.metrics = metrics

    async def answer(self, verb: str, body: bytes, caller: Caller, peer: str = "") -> tuple[int, Any]:
        """(HTTP status, the answer's JSON) for one call: 200 with the verb's answer or its ``Error``;
        403 with an ``Error`` for a caller the extender does not accept."""
        started = time.perf_counter()
        failure: str | None = None
        status = int(HTTPStatus.OK)
        try:
            refusal = self.auth.refusal(verb, caller)
            if refusal is not None:
                status = int(HTTPStatus.FORBIDDEN)
                if self.metrics is not None:
                    self.metrics.refused.labels(verb).inc()
                raise ExtenderError("unauthenticated", f"{verb}: {refusal}")
            try:
                args = json.loads(body)
            except (ValueError, RecursionError) as exc:
                raise ExtenderError("invalid_json", f"the body is not JSON: {shorten(str(exc), 80)}") from None
            if not isinstance(args, dict):
                wanted = "ExtenderBindingArgs" if verb == "bind" else "ExtenderArgs"
                raise ExtenderError("invalid_json", f"the body is not a JSON object ({verb} takes {wanted})")
            answer: Any = await getattr(self, verb)(args)
        except ExtenderError as exc:
            failure = exc.reason
            log.info("extender_refused", verb=verb, reason=exc.reason, error=str(exc), peer=peer)
            answer = {"Error": str(exc)}
        except Exception as exc:  # an answer for the scheduler, the traceback for the log
            failure = "internal"
            log.exception("extender_failed", verb=verb, peer=peer)
            answer = {"Error": f"memtopo extender internal error: {type(exc).__name__} (see the extender's log)"}
        if self.metrics is not None:
            self.metrics.observe(verb, time.perf_counter() - started, failure)
        return status, answer

    # ---- verbs ----------------------------------------------------------------------------------
    async def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        pod = pod_of(args)
        nodes = candidates(args)
        judgement = await self.fleet.judge(pod, nodes.names)
        return filter_answer(nodes, judgement.failures(nodes.names))

    async def prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        pod = pod_of(args)
        nodes = candidates(args)
        judgement = await self.fleet.judge(pod, nodes.names)
        return priorities(nodes.names, self.fleet.scores(judgement, nodes.names))

    async def bind(self, args: Mapping[str, Any]) -> dict[str, Any]:
        binding = bind_args(args)
        api = self.api
        if api is None:
            raise ExtenderError("no_api", "bind: this extender has no Kubernetes API server to bind through "
                                          "(memtopo controller serve --kube-api)")
        try:
            k8s_names.node_name(binding.node)  # before it is part of a message or a Binding
            k8s_names.namespace(binding.namespace)
            pod = await api.get_pod(binding.namespace, binding.name)
        except InvalidNameError as exc:
            raise ExtenderError("invalid_request", f"bind: {exc}") from None
        except KubeApiError as exc:
            raise ExtenderError("api", f"bind: {exc}") from exc
        pod_uid = obj(pod.get("metadata"), "Pod.metadata").get("uid", "")
        if binding.uid and pod_uid and binding.uid != pod_uid:
            raise ExtenderError("stale", f"bind: pod {binding.namespace}/{binding.name} is now uid "
                                         f"{shorten(str(pod_uid))}, not {shorten(binding.uid)}")
        try:
            await self.fleet.bind(api, binding, pod)
        except InvalidNameError as exc:
            raise ExtenderError("invalid_request", f"bind: {exc}") from None
        return {"Error": ""}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        return self.fleet.readiness()
