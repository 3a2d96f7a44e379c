"""Every route of the controller's own features on its HTTP listener. A feature of the controller adds
one ``install(routes, state)`` call to ``install_routes``; one the controller must not import (the
scheduler extender) is put together with it by the command that runs both (``start_http``'s
``installers``). ``docs/controller-http.md`` says how to write a handler."""

from __future__ import annotations

from http import HTTPStatus

from memtopo.controller import fleet_page
from memtopo.controller.http import Request, Response, Routes
from memtopo.controller.state import ControllerState


def install_routes(routes: Routes, state: ControllerState) -> None:
    install_core(routes, state)
    fleet_page.install(routes, state)


def install_core(routes: Routes, state: ControllerState) -> None:
    """``/healthz`` (200 while serving, 503 once stopping) and ``/metrics`` (Prometheus text)."""

    async def healthz(request: Request) -> Response:
        nodes = state.fleet.nodes()
        body = {"status": "stopping" if state.stopping else "ok", "nodes": len(nodes),
                "connected": sum(1 for n in nodes if n.connected), "topologies": state.fleet.held_count()}
        return Response.json(body, HTTPStatus.SERVICE_UNAVAILABLE if state.stopping else HTTPStatus.OK)

    async def metrics(request: Request) -> Response:
        payload, content_type = state.metrics.render()
        return Response(HTTPStatus.OK, payload, content_type)

    routes.add("GET", "/healthz", healthz)
    routes.add("GET", "/metrics", metrics)
