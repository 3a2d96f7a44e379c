"""The controller's own routes on its HTTP listener: ``/healthz`` and ``/metrics``. What else the
listener serves (the scheduler extender, the fleet page) is put together by the entry point that
starts it (``cli/controller.py``); ``docs/controller-http.md`` says how to write a handler."""

from __future__ import annotations

from http import HTTPStatus

from memtopo.controller.state import ControllerState
from memtopo.httpserve import Request, Response, Routes


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
