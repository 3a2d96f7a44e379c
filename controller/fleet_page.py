"""The controller's fleet page: ``/`` lists the nodes, ``/nodes/NAME`` shows one (its drawing, its
plans and results), both kept live by polling the JSON the page reads (``/api/fleet``,
``/api/nodes/NAME``). Read-only: GET and HEAD, nothing else.

Pure over the controller's ``Fleet``: ``FleetPage.handle`` turns a request line into a ``Response``
and the HTTP listener only carries it. It reads the fleet, so it runs where the fleet lives (the
controller's event loop); the drawing, the one costly answer, is cached per topology fingerprint.

Everything shown is untrusted (node names come from agents, source reasons quote tool output): the
page builds its DOM with ``textContent`` only, the server escapes the little text it renders itself,
and every answer carries a Content-Security-Policy that allows no inline script and nothing from
another origin, so a name like ``<script>`` is only ever text.
"""

from __future__ import annotations

import html
import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, unquote

import structlog

from controller import fleet_assets
from controller.fleet import Fleet, NodeInfo
from discovery.cpulist import format_cpulist
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from planner.fleet import device_view

log = structlog.get_logger()

# Results the node page shows (the fleet keeps more; `memtopo controller result` reads any of them).
NODE_RESULTS: Final = 20
# A degraded source's reasons can quote tool output at length; the fleet view shows a short excerpt.
FLEET_REASONS: Final = 3
REASON_CHARS: Final = 240
NODE_REASONS: Final = 50
# Drawings kept (a 64-node host's is a few hundred KiB).
SVG_CACHE: Final = 16

CSP_PAGE: Final = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                   "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# A drawing opened on its own: styles inside it may apply, nothing may run or load.
CSP_SVG: Final = "default-src 'none'; style-src 'unsafe-inline'; sandbox"
_COMMON_HEADERS: Final = (("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"),
                          ("Cache-Control", "no-store"))

Draw = Callable[[pb.MemoryTopology], str]
# node → (plan_id, dry_run) of plans sent and not answered yet.
Pending = Callable[[str], Iterable[tuple[str, bool]]]


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    def all_headers(self) -> list[tuple[str, str]]:
        """Content-Type, Content-Length and the security headers, then the response's own."""
        return [("Content-Type", self.content_type), ("Content-Length", str(len(self.body))),
                *_COMMON_HEADERS, *self.headers]


def _text(status: int, message: str, *extra: tuple[str, str]) -> Response:
    return Response(status, "text/plain; charset=utf-8", (message + "\n").encode(),
                    (("Content-Security-Policy", "default-src 'none'"), *extra))


def _json(doc: Mapping[str, Any]) -> Response:
    # ensure_ascii: every character beyond ASCII, and so every odd one, travels as an escape.
    return Response(200, "application/json", json.dumps(doc, separators=(",", ":")).encode(),
                    (("Content-Security-Policy", "default-src 'none'"),))


def _page(body: str) -> Response:
    return Response(200, "text/html; charset=utf-8", body.encode(), (("Content-Security-Policy", CSP_PAGE),))


def node_path(name: str) -> str:
    """The node page's path: the name percent-encoded whole (a name may hold '/', '?' or '#')."""
    return "/nodes/" + quote(name, safe="")


def _enum(enum: Any, value: int, prefix: str) -> str:
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix)


def _short(text: str, limit: int = REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---- what a topology says, summarised ------------------------------------------------------------
def topology_summary(topo: pb.MemoryTopology) -> dict[str, Any]:
    """The facts of one node the fleet page shows in its row: CPUs, memory by domain type,
    accelerators by model, degraded sources (their reasons cut short), and the hccs/xpu view."""
    cpus = len(topo.cpus.online) if topo.cpus.online else sum(len(n.cpus) for n in topo.numa_nodes)
    by_type: Counter[str] = Counter()
    free = 0
    for d in topo.domains:
        by_type[_enum(pb.MemoryDomainType, d.type, "MEMORY_DOMAIN_TYPE_")] += d.capacity_bytes
        free += d.free_bytes
    models: Counter[str] = Counter()
    for a in topo.accelerators:
        models[a.model or _enum(pb.AcceleratorKind, a.kind, "ACCELERATOR_KIND_")] += 1
    return {
        "cpus": cpus,
        "numa_nodes": len(topo.numa_nodes),
        "memory_bytes": topo.total_capacity_bytes or sum(by_type.values()),
        "free_bytes": free,
        "memory_by_type": dict(sorted(by_type.items())),
        "cxl_regions": len(topo.cxl_regions),
        "accelerators": len(topo.accelerators),
        "accelerator_memory_bytes": sum(a.memory_bytes for a in topo.accelerators),
        "accelerator_models": [{"model": m, "count": c} for m, c in sorted(models.items())],
        "degraded": degraded_sources(topo, FLEET_REASONS),
        "devices": device_view(topo),
    }


def degraded_sources(topo: pb.MemoryTopology, max_reasons: int) -> list[dict[str, Any]]:
    out = []
    for s in topo.sources:
        if s.state == pb.SOURCE_STATE_DEGRADED:
            reasons = [_short(r) for r in s.reasons[:max_reasons]]
            out.append({"source": s.source, "reasons": reasons, "more": max(len(s.reasons) - max_reasons, 0)})
    return out


def topology_detail(topo: pb.MemoryTopology) -> dict[str, Any]:
    """What the node page lists beside the drawing: domains and accelerators, one row each."""
    domains = [{
        "id": d.id, "type": _enum(pb.MemoryDomainType, d.type, "MEMORY_DOMAIN_TYPE_"), "subtype": d.subtype,
        "capacity_bytes": d.capacity_bytes, "free_bytes": d.free_bytes, "numa_nodes": format_cpulist(d.numa_nodes),
        "cpus": format_cpulist(d.attached_cpus), "kernel_tier": d.kernel_tier, "note": _short(d.note),
    } for d in topo.domains]
    accelerators = [{
        "id": a.id, "kind": _enum(pb.AcceleratorKind, a.kind, "ACCELERATOR_KIND_"), "vendor": a.vendor,
        "model": a.model, "health": a.health, "numa_node": a.numa_node, "domain": a.domain,
        "memory_bytes": a.memory_bytes, "bdf": a.bdf,
    } for a in topo.accelerators]
    return {"domains": domains, "accelerators": accelerators,
            "degraded": degraded_sources(topo, NODE_REASONS), "source_root": topo.source_root}


def result_json(result: planpb.PlanResult) -> dict[str, Any]:
    statuses = Counter(_enum(planpb.ActionResult.Status, a.status, "STATUS_") for a in result.actions)
    return {
        "plan_id": result.plan_id,
        "state": _enum(planpb.PlanResult.State, result.state, "STATE_"),
        "message": _short(result.message),
        "actions": dict(sorted(statuses.items())),
        "rejections": [_short(r) for r in result.rejections[:NODE_REASONS]],
        "finished": result.finished.ToNanoseconds() / 1e9 if result.HasField("finished") else 0.0,
    }


# ---- the page's JSON -------------------------------------------------------------------------------
def _age(now: float, then: float) -> float | None:
    return round(max(now - then, 0.0), 1) if then else None


def node_row(info: NodeInfo, summary: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    return {
        "name": info.node_name,
        "connected": info.connected,
        "generation": info.generation if info.fingerprint else None,
        "fingerprint": info.fingerprint[:12],
        "updated_age_s": _age(now, info.updated),
        "last_seen_age_s": _age(now, info.last_seen),
        "agent_version": info.agent_version,
        "peer": info.peer,
        "topology": summary,
    }


class FleetPage:
    """The page's routes over one controller's fleet. ``draw`` renders a node's drawing (default:
    ``draw.svg.topology_svg``, imported on first use); ``pending`` lists the plans awaiting a node's
    result; ``clock`` is the fleet's clock."""

    def __init__(self, fleet: Fleet, *, draw: Draw | None = None, pending: Pending | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._fleet = fleet
        self._draw = draw
        self._pending = pending
        self._clock = clock
        # node → ((generation, fingerprint), summary): parsed once per snapshot, not once per poll.
        self._summaries: dict[str, tuple[tuple[int, str], dict[str, Any]]] = {}
        self._svgs: OrderedDict[tuple[str, int, str], bytes] = OrderedDict()

    # ---- data ----------------------------------------------------------------------------------
    def _summary(self, info: NodeInfo) -> dict[str, Any] | None:
        if not info.fingerprint:
            return None
        key = (info.generation, info.fingerprint)
        cached = self._summaries.get(info.node_name)
        if cached is not None and cached[0] == key:
            return cached[1]
        topo = self._fleet.topology(info.node_name)
        if topo is None:
            return None
        summary = topology_summary(topo)
        self._summaries[info.node_name] = (key, summary)
        return summary

    def fleet_json(self) -> dict[str, Any]:
        now = self._clock()
        infos = self._fleet.nodes()
        rows = [node_row(i, self._summary(i), now) for i in infos]
        known = {i.node_name for i in infos}
        for gone in self._summaries.keys() - known:
            del self._summaries[gone]
        return {"nodes": rows, "connected": sum(1 for i in infos if i.connected), "total": len(infos)}

    def node_json(self, name: str) -> dict[str, Any] | None:
        info = self._fleet.info(name)
        if info is None:
            return None
        now = self._clock()
        topo = self._fleet.topology(name)
        doc = node_row(info, self._summary(info), now)
        doc["detail"] = topology_detail(topo) if topo is not None else None
        doc["results"] = [result_json(r) for r in self._fleet.results(name, NODE_RESULTS)]
        pending = self._pending(name) if self._pending is not None else ()
        doc["pending"] = [{"plan_id": p, "dry_run": dry} for p, dry in sorted(pending)]
        doc["drawing"] = node_path(name) + "/topology.svg" if topo is not None else None
        return doc

    def svg(self, name: str) -> bytes | None:
        info = self._fleet.info(name)
        if info is None or not info.fingerprint:
            return None
        key = (name, info.generation, info.fingerprint)
        cached = self._svgs.get(key)
        if cached is not None:
            self._svgs.move_to_end(key)
            return cached
        topo = self._fleet.topology(name)
        if topo is None:
            return None
        draw = self._draw
        if draw is None:
            from draw.svg import topology_svg

            draw = self._draw = topology_svg
        body = draw(topo).encode()
        self._svgs[key] = body
        while len(self._svgs) > SVG_CACHE:
            self._svgs.popitem(last=False)
        return body

    # ---- routes --------------------------------------------------------------------------------
    def handle(self, method: str, target: str) -> Response:
        """Answer one request (``target`` as on the request line: path and optional query)."""
        if method not in ("GET", "HEAD"):
            return _text(405, "the fleet page is read-only", ("Allow", "GET, HEAD"))
        path = target.split("?", 1)[0].split("#", 1)[0]
        if path in ("/", "/index.html"):
            return _page(fleet_assets.FLEET_HTML)
        if path == "/api/fleet":
            return _json(self.fleet_json())
        asset = fleet_assets.STATIC.get(path)
        if asset is not None:
            content_type, text = asset
            return Response(200, content_type, text.encode(), (("Content-Security-Policy", "default-src 'none'"),))
        parts = path.split("/")
        if len(parts) >= 3 and parts[1] in ("nodes", "api") and (parts[1] == "nodes" or parts[2] == "nodes"):
            return self._node_route(parts)
        return _text(404, "not found")

    def _node_route(self, parts: list[str]) -> Response:
        # /nodes/NAME, /nodes/NAME/topology.svg, /api/nodes/NAME
        api = parts[1] == "api"
        rest = parts[3:] if api else parts[2:]
        if not rest or not rest[0]:
            return _text(404, "not found")
        name = unquote(rest[0], errors="replace")
        tail = rest[1:]
        if api and not tail:
            doc = self.node_json(name)
            return _json(doc) if doc is not None else _text(404, "unknown node")
        if not api and not tail:
            if not self._fleet.knows(name):
                return _text(404, "unknown node")
            return _page(node_html(name))
        if not api and tail == ["topology.svg"]:
            try:
                body = self.svg(name)
            except Exception as exc:  # a drawing bug must not take the page down; the log keeps it
                log.exception("fleet_page_draw_failed", node=name)
                return _text(500, f"drawing failed: {type(exc).__name__}")
            if body is None:
                return _text(404, "no topology yet")
            return Response(200, "image/svg+xml", body, (("Content-Security-Policy", CSP_SVG),))
        return _text(404, "not found")


def node_html(name: str) -> str:
    """The node page: the name is rendered escaped (for the title and readers without script); the
    rest is filled in by the script from ``/api/nodes/NAME``."""
    return fleet_assets.NODE_HTML.format(name=html.escape(name, quote=True),
                                         api=html.escape("/api" + node_path(name), quote=True))
