"""The fleet page, on the controller's HTTP listener: ``/`` lists the nodes, ``/nodes/NAME`` shows
one (its drawing, its plans and results). Both pages are fixed text that keeps itself live by
polling the JSON it reads: ``/api/fleet`` and ``/api/node?name=NAME`` (the drawing is
``/api/node.svg?name=NAME``). Read-only: GET (and HEAD) routes only.

The handlers read the fleet on the controller's loop; what costs (parsing a new snapshot for its
summary, drawing a node) runs in a thread on bytes copied there, and both are cached per snapshot.
The summaries are pure functions of a topology (``topology_summary``, ``node_row``).

Everything shown is untrusted (node names come from agents, source reasons quote tool output): the
page builds its DOM with ``textContent`` only, the server escapes the little text it renders itself,
and every answer carries a Content-Security-Policy that allows no inline script and nothing from
another origin, so a name like ``<script>`` is only ever text.
"""

from __future__ import annotations

import asyncio
import html
import json
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final
from urllib.parse import quote, urlencode

from memtopo.controller.fleet import Fleet, NodeInfo
from memtopo.controller.state import ControllerState
from memtopo.cpulist import format_cpulist
from memtopo.draw.svg import TYPE_WORD, topology_svg
from memtopo.fleetpage.assets import assets
from memtopo.httpserve import HTML_TYPE, HttpError, Request, Response, Routes
from memtopo.logs import get_logger
from memtopo.planner.fleet import DeviceView, node_device_view, view_json
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

log = get_logger(component="fleet_page")

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
CSP_DATA: Final = "default-src 'none'; frame-ancestors 'none'"
_SECURITY: Final = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

Draw = Callable[[pb.MemoryTopology], str]
# node → the (plan_id, dry_run) of its plans sent and not answered yet.
Pending = Callable[[str], Iterable[tuple[str, bool]]]
# device policy (hccs, xpu) → node → the device ids handed out there (the scheduler extender's view).
InUse = Callable[[str], Mapping[str, frozenset[int]]]


def _answer(body: bytes, content_type: str, csp: str = CSP_DATA, status: int = 200) -> Response:
    return Response(status, body, content_type, {**_SECURITY, "Content-Security-Policy": csp})


def _word(enum: Any, value: int, prefix: str) -> str:
    """An enum value as people read it: ``STATE_ROLLED_BACK`` → "rolled back"."""
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    return name.removeprefix(prefix).replace("_", " ").lower()


def domain_word(value: int) -> str:
    """A memory domain's type as the drawing names it (DRAM, CXL, Unified, GPU memory …)."""
    word = TYPE_WORD.get(pb.MemoryDomainType.ValueType(value))
    return word if word is not None else _word(pb.MemoryDomainType, value, "MEMORY_DOMAIN_TYPE_")


def kind_word(value: int) -> str:
    word = _word(pb.AcceleratorKind, value, "ACCELERATOR_KIND_")
    return word.upper() if word in ("gpu", "npu", "xpu") else word


# Plan states the page shows as done as asked (the rest as refused or undone).
OK_STATES: Final = frozenset({planpb.PlanResult.STATE_APPLIED, planpb.PlanResult.STATE_UNCHANGED,
                              planpb.PlanResult.STATE_DRY_RUN})


def _short(text: str, limit: int = REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---- what a topology says, summarised ------------------------------------------------------------
def topology_summary(topo: pb.MemoryTopology, allocated: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The facts of one node the fleet page shows in its row: CPUs, memory by domain type,
    accelerators by model, degraded sources (their reasons cut short), and what the hccs or xpu
    policy sees of it with ``allocated`` handed out."""
    return {**topology_facts(topo), "devices": devices_json(node_device_view(topo), allocated)}


def devices_json(found: tuple[str, DeviceView | str] | None, allocated: frozenset[int]) -> dict[str, Any] | None:
    return view_json(found[0], found[1], allocated) if found is not None else None


def topology_facts(topo: pb.MemoryTopology) -> dict[str, Any]:
    """``topology_summary`` less the device view (which changes with allocations, not snapshots)."""
    cpus = len(topo.cpus.online) if topo.cpus.online else sum(len(n.cpus) for n in topo.numa_nodes)
    by_type: Counter[str] = Counter()
    free = 0
    for d in topo.domains:
        by_type[domain_word(d.type)] += d.capacity_bytes
        free += d.free_bytes
    models: Counter[str] = Counter()
    for a in topo.accelerators:
        models[a.model or kind_word(a.kind)] += 1
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
        "id": d.id, "type": domain_word(d.type), "subtype": d.subtype,
        "capacity_bytes": d.capacity_bytes, "free_bytes": d.free_bytes, "numa_nodes": format_cpulist(d.numa_nodes),
        "cpus": format_cpulist(d.attached_cpus), "kernel_tier": d.kernel_tier, "note": _short(d.note),
    } for d in topo.domains]
    accelerators = [{
        "id": a.id, "kind": kind_word(a.kind), "vendor": a.vendor,
        "model": a.model, "health": a.health, "numa_node": a.numa_node, "domain": a.domain,
        "memory_bytes": a.memory_bytes, "bdf": a.bdf,
    } for a in topo.accelerators]
    return {"domains": domains, "accelerators": accelerators,
            "degraded": degraded_sources(topo, NODE_REASONS), "source_root": topo.source_root}


def result_json(result: planpb.PlanResult) -> dict[str, Any]:
    statuses = Counter(_word(planpb.ActionResult.Status, a.status, "STATUS_") for a in result.actions)
    return {
        "plan_id": result.plan_id,
        "state": _word(planpb.PlanResult.State, result.state, "STATE_"),
        "ok": result.state in OK_STATES,
        "message": _short(result.message),
        "actions": dict(sorted(statuses.items())),
        "rejections": [_short(r) for r in result.rejections[:NODE_REASONS]],
        "finished": result.finished.ToNanoseconds() / 1e9 if result.HasField("finished") else 0.0,
    }



# ---- the page's JSON -------------------------------------------------------------------------------
def _age(now: float, then: float) -> float | None:
    return round(max(now - then, 0.0), 1) if then else None


def node_row(info: NodeInfo, summary: Mapping[str, Any] | None, now: float) -> dict[str, Any]:
    """One node as the fleet page lists it (ages in seconds before ``now``; None = never)."""
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


@dataclass(frozen=True)
class _Summary:
    key: tuple[int, str]  # (generation, fingerprint) of the snapshot it was made from
    facts: dict[str, Any]
    devices: tuple[str, DeviceView | str] | None


def _summarise(todo: list[tuple[str, tuple[int, str], bytes]]) -> list[tuple[str, _Summary]]:
    out = []
    for name, key, payload in todo:
        topo = pb.MemoryTopology.FromString(payload)
        out.append((name, _Summary(key, topology_facts(topo), node_device_view(topo))))
    return out


def _snapshot_key(info: NodeInfo) -> tuple[int, str]:
    return info.generation, info.fingerprint


class FleetPage:
    """The page's data over one controller's fleet. ``draw`` renders a node's drawing (default:
    ``draw.svg.topology_svg``); ``pending`` lists the plans awaiting a node's
    result; ``in_use`` the devices handed out per policy and node; ``clock`` is the fleet's clock.
    Call its coroutines on the fleet's loop."""

    def __init__(self, fleet: Fleet, *, draw: Draw | None = None, pending: Pending | None = None,
                 in_use: InUse | None = None, clock: Callable[[], float] = time.time) -> None:
        self._fleet = fleet
        self._draw: Draw = draw or topology_svg
        self._pending = pending
        self._in_use = in_use
        self._clock = clock
        # A snapshot is parsed once, not once per poll.
        self._summaries: dict[str, _Summary] = {}
        self._svgs: OrderedDict[tuple[str, int, str], bytes] = OrderedDict()

    async def _fresh_summaries(self, infos: list[NodeInfo]) -> None:
        todo: list[tuple[str, tuple[int, str], bytes]] = []
        for info in infos:
            cached = self._summaries.get(info.node_name)
            if not info.fingerprint or (cached is not None and cached.key == _snapshot_key(info)):
                continue
            payload = self._fleet.topology_bytes(info.node_name)
            if payload is not None:
                # Keyed by what was read with the payload: a snapshot newer by now is parsed next time.
                todo.append((info.node_name, _snapshot_key(info), payload))
        if todo:
            self._summaries.update(await asyncio.to_thread(_summarise, todo))

    def _summary(self, info: NodeInfo, in_use: dict[str, Mapping[str, frozenset[int]]]) -> dict[str, Any] | None:
        """The cached facts plus the device view under the allocations of this request (``in_use``:
        policy → node → ids, filled on first need)."""
        cached = self._summaries.get(info.node_name)
        if cached is None or not info.fingerprint:
            return None
        allocated: frozenset[int] = frozenset()
        if cached.devices is not None and self._in_use is not None:
            policy = cached.devices[0]
            if policy not in in_use:
                in_use[policy] = self._in_use(policy)
            allocated = in_use[policy].get(info.node_name, frozenset())
        return {**cached.facts, "devices": devices_json(cached.devices, allocated)}

    async def fleet_json(self) -> dict[str, Any]:
        await self._fresh_summaries(self._fleet.nodes())
        infos = self._fleet.nodes()
        now = self._clock()
        known = {i.node_name for i in infos}
        for gone in self._summaries.keys() - known:
            del self._summaries[gone]
        in_use: dict[str, Mapping[str, frozenset[int]]] = {}
        return {"nodes": [node_row(i, self._summary(i, in_use), now) for i in infos],
                "connected": sum(1 for i in infos if i.connected), "total": len(infos)}

    async def node_json(self, name: str) -> dict[str, Any] | None:
        info = self._fleet.info(name)
        if info is None:
            return None
        await self._fresh_summaries([info])
        info = self._fleet.info(name)
        if info is None:
            return None
        now = self._clock()
        topo = self._fleet.topology(name)
        doc = node_row(info, self._summary(info, {}), now)
        doc["detail"] = topology_detail(topo) if topo is not None else None
        doc["results"] = [result_json(r) for r in self._fleet.results(name, NODE_RESULTS)]
        pending = self._pending(name) if self._pending is not None else ()
        doc["pending"] = [{"plan_id": p, "dry_run": dry} for p, dry in sorted(pending)]
        doc["drawing"] = drawing_path(name) if topo is not None else None
        return doc

    async def svg(self, name: str) -> bytes | None:
        """The node's drawing (None before its first snapshot); drawn once per snapshot."""
        info = self._fleet.info(name)
        topo = self._fleet.topology(name) if info is not None and info.fingerprint else None
        if info is None or topo is None:
            return None
        key = (name, *_snapshot_key(info))
        cached = self._svgs.get(key)
        if cached is not None:
            self._svgs.move_to_end(key)
            return cached
        body = (await asyncio.to_thread(self._draw, topo)).encode()
        self._svgs[key] = body
        while len(self._svgs) > SVG_CACHE:
            self._svgs.popitem(last=False)
        return body


def node_path(name: str) -> str:
    """The node page's path. Percent-encoded whole, as the page's script does (encodeURIComponent):
    a name may hold '/', '?' or '#'. '.' and '..' would be dot segments, so they go by query."""
    if name in (".", ".."):
        return "/nodes/?" + urlencode({"name": name})
    return "/nodes/" + quote(name, safe="")


def drawing_path(name: str) -> str:
    return "/api/node.svg?" + urlencode({"name": name})


def node_html(name: str) -> str:
    """The node page: the name is rendered escaped (for the title and readers without script); the
    rest is filled in by the script from ``/api/node?name=NAME``."""
    return assets().node_html.format(name=html.escape(name, quote=True),
                                     api=html.escape("/api/node?" + urlencode({"name": name}), quote=True))


def _name_arg(request: Request) -> str:
    names = request.query.get("name", [])
    if len(names) != 1:
        raise HttpError(HTTPStatus.BAD_REQUEST, "give one node as ?name=NAME")
    return names[0]


def install(routes: Routes, state: ControllerState, *, in_use: InUse | None = None, draw: Draw | None = None,
            clock: Callable[[], float] = time.time) -> FleetPage:
    """The fleet page's routes: ``/``, ``/nodes/NAME``, ``/api/fleet``, ``/api/node``,
    ``/api/node.svg`` and ``/static/*``. ``in_use``: the devices handed out per policy and node (the
    scheduler extender's view, when the listener serves one)."""
    page = FleetPage(state.fleet, draw=draw, pending=state.pending_plans, in_use=in_use, clock=clock)
    fleet = state.fleet
    files = assets()

    async def index(request: Request) -> Response:
        return _answer(files.fleet_html.encode(), HTML_TYPE, CSP_PAGE)

    async def node_page(request: Request) -> Response:
        name = request.path.removeprefix("/nodes/")
        if not name and "name" in request.query:
            name = _name_arg(request)
        if not fleet.knows(name):
            raise HttpError(HTTPStatus.NOT_FOUND, "unknown node")
        return _answer(node_html(name).encode(), HTML_TYPE, CSP_PAGE)

    async def fleet_api(request: Request) -> Response:
        return _json(await page.fleet_json())

    async def node_api(request: Request) -> Response:
        doc = await page.node_json(_name_arg(request))
        if doc is None:
            raise HttpError(HTTPStatus.NOT_FOUND, "unknown node")
        return _json(doc)

    async def node_svg(request: Request) -> Response:
        name = _name_arg(request)
        try:
            body = await page.svg(name)
        except Exception as exc:  # a drawing bug must not break the page; the log keeps the traceback
            log.exception("fleet_page_draw_failed", node=name)
            raise HttpError(HTTPStatus.INTERNAL_SERVER_ERROR, f"drawing failed: {type(exc).__name__}") from exc
        if body is None:
            raise HttpError(HTTPStatus.NOT_FOUND, "no topology for this node yet")
        return _answer(body, "image/svg+xml", CSP_SVG)

    async def static(request: Request) -> Response:
        asset = files.static.get(request.path)
        if asset is None:
            raise HttpError(HTTPStatus.NOT_FOUND, "no such file")
        content_type, body = asset
        return _answer(body, content_type)

    routes.add("GET", "/", index)
    routes.add("GET", "/nodes/", node_page, prefix=True)
    routes.add("GET", "/api/fleet", fleet_api)
    routes.add("GET", "/api/node", node_api)
    routes.add("GET", "/api/node.svg", node_svg)
    routes.add("GET", "/static/", static, prefix=True)
    return page


def _json(doc: Mapping[str, Any]) -> Response:
    # json.dumps escapes every character beyond ASCII, so nothing odd travels raw.
    return _answer(json.dumps(doc, separators=(",", ":")).encode(), "application/json")
