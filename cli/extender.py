"""The scheduler extender put together with the controller's HTTP listener (the composition root).

The extender's verbs are plain async functions over JSON (``extender.service``); this module makes
them routes of the listener ``memtopo controller serve`` (and ``memtopo serve --with-controller``)
opens: ``POST /scheduler/filter|prioritize|bind`` and ``GET /readyz``, and gives the extender what it
reads of the controller (its fleet, for ``--fleet agents``) or starts its own view of the API server
(``--fleet nrt``). The controller never imports the extender, nor the extender the controller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from memtopo.controller.server import RouteInstaller
    from memtopo.controller.state import ControllerState
    from memtopo.extender.auth import Authenticator
    from memtopo.extender.service import Extender
    from memtopo.httpserve import Request, Response, Routes
    from memtopo.k8s.kubeapi import KubeApi

FLEETS: Final = ("agents", "nrt")


@dataclass(frozen=True)
class ExtenderOptions:
    """``fleet``: ``agents`` (the topologies agents stream to this controller) or ``nrt`` (the API
    server's NodeResourceTopology objects and pods, ``kube`` required)."""

    fleet: str = "agents"
    kube: KubeApi | None = None
    auth: Authenticator | None = None
    refresh_s: float = 10.0  # agents: seconds between reads of the bound pods' device annotations
    max_age: float = 120.0  # nrt: how far a node's object may lag the pods bound to it
    claim_ttl: float = 30.0  # nrt: how long an unbound pod's claim holds its zones
    score: str = "memtopo"  # nrt: prioritize's strategy
    weights: Mapping[str, int] = field(default_factory=dict)
    # nrt: the informers' settings (k8s.informer.Informer's keywords: watch_seconds, backoff …)
    informer: Mapping[str, Any] = field(default_factory=dict)


def installer(options: ExtenderOptions) -> RouteInstaller:
    """The routes of the extender, to hand to ``start_controller(http_routes=…)``."""

    def install(routes: Routes, state: ControllerState) -> None:
        extender = build(options, state)
        add_routes(routes, extender, state)

    return install


def build(options: ExtenderOptions, state: ControllerState) -> Extender:
    """The extender over the fleet ``options`` name, its background work started on ``state``'s loop."""
    from memtopo.extender.agents import AgentsFleet
    from memtopo.extender.auth import Authenticator
    from memtopo.extender.metrics import ExtenderMetrics
    from memtopo.extender.nrt import NrtFleet
    from memtopo.extender.service import Extender

    metrics = ExtenderMetrics(state.metrics.registry)
    fleet: AgentsFleet | NrtFleet
    if options.fleet == "nrt":
        if options.kube is None:
            raise ValueError("--fleet nrt reads the API server: give --kube-api")
        fleet = NrtFleet(options.kube, max_age=options.max_age, claim_ttl=options.claim_ttl, strategy=options.score,
                         weights=options.weights, **options.informer)
        metrics.gauges(fleet.gauges)
        state.start("extender-view", fleet.run())
    else:
        fleet = AgentsFleet(state, options.kube, refresh_s=options.refresh_s)
        state.extender = fleet  # the fleet page shows the devices it handed out
        if options.kube is not None:
            state.start("extender-refresh", fleet.refresh_forever())
    return Extender(fleet, api=options.kube, auth=options.auth or Authenticator(), metrics=metrics)


def add_routes(routes: Routes, extender: Extender, state: ControllerState) -> None:
    from memtopo.extender.auth import Caller
    from memtopo.extender.wire import PREFIX, VERBS
    from memtopo.httpserve import Response

    def verb_route(verb: str) -> Any:
        async def handle(request: Request) -> Response:
            caller = Caller.of(request.client_subject, request.headers)
            status, answer = await extender.answer(verb, request.body, caller, request.peer)
            return Response.json(answer, status)
        return handle

    async def readyz(request: Request) -> Response:
        ready, detail = extender.readiness()
        if state.stopping:
            ready, detail = False, {**detail, "status": "stopping"}
        return Response.json(detail, HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE)

    for verb in VERBS:
        routes.add("POST", PREFIX + verb, verb_route(verb))
    routes.add("GET", "/readyz", readyz)
