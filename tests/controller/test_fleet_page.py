"""The fleet page (fleetpage/: page.py and its assets): its data over fixture topologies, its routes
on the controller's HTTP listener, and both pages in a real headless browser (Debian's Chromium
driven by playwright) against a controller holding four real agents, and against an in-process fleet
for what is about rendering (words, plurals, times, name wrapping).

The browser tests skip, saying why, where Chromium or playwright is missing; ``tools/setup.sh``
installs both, so on a set-up machine and in CI they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.cli.controller import listener_routes
from memtopo.cli.extender import ExtenderOptions
from memtopo.controller.fleet import Fleet, Hello
from memtopo.controller.metrics import ControllerMetrics
from memtopo.controller.server import start_controller
from memtopo.controller.state import ControllerState
from memtopo.fleetpage import page as fleet_page
from memtopo.fleetpage.assets import assets
from memtopo.httpserve import HttpServer, Routes, ServerThread, bind
from memtopo.planner import fleet as fleet_policies
from memtopo.planner import hccs, xpu
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import agent_pb2_grpc
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests.agents import Agent, Controller, pin_plan, wait_for
from tests.chromium import chromium
from tests.controllers import SimAgent, admin
from tests.fixtures import REPO, SHARED, extracted, lab_root
from tests.fleet_nodes import NPU_SMI_910A_X8, node, npu
from tests.http_client import exchange, get

FIXTURES = Path(__file__).parents[1] / "fixtures"
# No spaces (agents refuse them in a node name); a '/' so the name also tests the page's paths.
HOSTILE = "<script>window.pwned=1;alert(1)</script><img/src=x/onerror=alert(2)>"


def topology(kind: str, name: str, edit: Callable[[pb.MemoryTopology], None] | None = None) -> pb.MemoryTopology:
    topo = node(kind, name, edit).topology
    assert topo is not None
    return topo


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def join(fleet: Fleet, topo: pb.MemoryTopology, instance: str = "i1") -> int:
    connected = fleet.connect(Hello(topo.node_name, instance, generation=topo.generation,
                                    fingerprint=topo.fingerprint), "ipv4:127.0.0.1:4000")
    assert fleet.snapshot(connected.session, topo).stored
    return connected.session


# ---- what the page shows of a node ------------------------------------------------------------------
def shown(topo: pb.MemoryTopology, allocated: frozenset[int] = frozenset()) -> dict[str, Any] | None:
    return fleet_page.topology_summary(topo, allocated)["devices"]  # type: ignore[no-any-return]


def test_device_view_is_what_the_hccs_and_xpu_policies_see() -> None:
    def busy(topo: pb.MemoryTopology) -> None:
        npu(1, running="true", processes="4242")(topo)
        npu(5, health="Alarm")(topo)

    view = shown(topology("910", "n", busy))
    assert view is not None
    # NPU1 runs a process and NPU5 is unhealthy: ring 0–3 keeps 3 free, ring 4–7 3 of 7 healthy.
    assert view["available"] == [0, 2, 3, 4, 6, 7]
    assert (view["capacity"], view["ring_free"], view["free_rings"]) == (7, [3, 3], 0)
    assert view["groups"] == {str(n): hccs.group_of(n, 3, 3) for n in (1, 2, 4, 8)}
    assert view["groups"]["4"] is None  # no whole ring is free
    # The fleet policy derives the same node: the page shows what `controller place hccs` would use.
    doc = fleet_policies.decide("hccs", {"request": 1}, [node("910", "n", busy)])
    assert doc["nodes"][0]["available"] == view["available"]

    allocated = shown(topology("910", "n", busy), frozenset({0, 4}))
    assert allocated is not None and (allocated["available"], allocated["ring_free"]) == ([2, 3, 6, 7], [2, 2])
    doc = fleet_policies.decide("hccs", {"request": 1, "allocated": {"n": [0, 4]}}, [node("910", "n", busy)])
    assert doc["nodes"][0]["available"] == allocated["available"]

    free = shown(topology("910", "f"))
    assert free is not None and (free["ring_free"], free["free_rings"], free["groups"]["8"]) == ([4, 4], 2, "A")

    p800 = topology("p800", "x")
    assert shown(p800) == {"policy": "xpu", "used": [], "mtf": 1}
    used = shown(p800, frozenset({0, 1, 4}))
    assert used == {"policy": "xpu", "used": [0, 1, 4], "mtf": xpu.mtf(0b10011)}

    def ringless(topo: pb.MemoryTopology) -> None:
        del topo.accelerator_groups[:]

    assert shown(topology("910", "r", ringless)) == {
        "policy": "hccs", "unusable": "no hccs-ring group NPU0–NPU3 in its topology"}

    def no_accelerators(topo: pb.MemoryTopology) -> None:
        del topo.accelerators[:]

    assert shown(topology("p800", "plain", no_accelerators)) is None


def test_summary_totals_and_degraded_sources_are_bounded() -> None:
    def degrade(topo: pb.MemoryTopology) -> None:
        topo.sources.add(source="sysfs.pci", state=pb.SOURCE_STATE_DEGRADED,
                         reasons=["x" * 10_000, *(f"reason {i}" for i in range(9))])

    topo = topology("p800", "x", degrade)
    s = fleet_page.topology_summary(topo)
    assert s["cpus"] == len(topo.cpus.online) > 0
    assert s["memory_bytes"] == topo.total_capacity_bytes
    assert sum(s["memory_by_type"].values()) == sum(d.capacity_bytes for d in topo.domains)
    assert s["accelerators"] == 8
    assert s["accelerator_models"] == [{"model": topo.accelerators[0].model, "count": 8}]
    assert s["accelerator_memory_bytes"] == sum(a.memory_bytes for a in topo.accelerators)
    assert s["devices"] == {"policy": "xpu", "used": [], "mtf": 1}
    [pci] = [d for d in s["degraded"] if d["source"] == "sysfs.pci"]
    assert len(pci["reasons"]) == fleet_page.FLEET_REASONS and pci["more"] == 10 - fleet_page.FLEET_REASONS
    assert len(pci["reasons"][0]) == fleet_page.REASON_CHARS and pci["reasons"][0].endswith("…")
    detail = fleet_page.topology_detail(topo)
    assert [a["id"] for a in detail["accelerators"]] == [f"XPU{i}" for i in range(8)]
    assert {d["id"] for d in detail["domains"]} == {d.id for d in topo.domains}


def test_fleet_json_rows_ages_and_link_state() -> None:
    clock = Clock()
    fleet = Fleet(clock=clock)
    join(fleet, topology("p800", "x1"))
    gone = join(fleet, topology("910", "n1"))
    fleet.connect(Hello("fresh", "i9"), "ipv4:127.0.0.1:4001")  # no snapshot yet
    clock.now += 30
    fleet.disconnect(gone)
    clock.now += 12
    page = fleet_page.FleetPage(fleet, clock=clock)
    doc = asyncio.run(page.fleet_json())
    rows = {r["name"]: r for r in doc["nodes"]}
    assert (doc["total"], doc["connected"]) == (3, 2)
    assert rows["x1"]["connected"] and not rows["n1"]["connected"]
    assert (rows["x1"]["updated_age_s"], rows["x1"]["last_seen_age_s"]) == (42.0, 42.0)
    assert (rows["n1"]["updated_age_s"], rows["n1"]["last_seen_age_s"]) == (42.0, 12.0)
    assert rows["fresh"]["topology"] is None and rows["fresh"]["generation"] is None
    assert rows["n1"]["topology"]["devices"]["ring_free"] == [4, 4]
    assert rows["x1"]["topology"]["devices"]["mtf"] == 1


def test_a_new_snapshot_replaces_the_cached_summary() -> None:
    fleet = Fleet()
    session = join(fleet, topology("910", "n"))
    page = fleet_page.FleetPage(fleet)
    first = asyncio.run(page.fleet_json())["nodes"][0]
    assert first["topology"]["devices"]["available"] == list(range(8))
    newer = topology("910", "n", npu(0, running="true"))
    newer.generation += 1
    newer.fingerprint = "f" * 64
    assert fleet.snapshot(session, newer).stored
    second = asyncio.run(page.fleet_json())["nodes"][0]
    assert second["generation"] == first["generation"] + 1
    assert second["topology"]["devices"]["available"] == list(range(1, 8))


class InUse:
    """A stand-in for the scheduler extender's device views (its ledger of bound pods)."""

    def __init__(self, allocated: dict[str, dict[str, frozenset[int]]]) -> None:
        self.allocated = allocated
        self.asked: list[str] = []

    def in_use(self, policy: str) -> dict[str, frozenset[int]]:
        self.asked.append(policy)
        return self.allocated.get(policy, {})


def test_rows_show_the_devices_the_scheduler_extender_handed_out() -> None:
    fleet = Fleet()
    join(fleet, topology("p800", "x1"))
    join(fleet, topology("p800", "x2"))
    join(fleet, topology("910", "n1"))
    state = ControllerState(fleet, ControllerMetrics())
    ledger = InUse({"xpu": {"x2": frozenset({0, 1, 4})}, "hccs": {"n1": frozenset({0, 1, 2, 3})}})
    page = fleet_page.install(Routes(), state, in_use=ledger.in_use)
    rows = {r["name"]: r["topology"]["devices"] for r in asyncio.run(page.fleet_json())["nodes"]}
    assert rows["x1"] == {"policy": "xpu", "used": [], "mtf": 1}
    assert rows["x2"] == {"policy": "xpu", "used": [0, 1, 4], "mtf": xpu.mtf(0b10011)}
    assert (rows["n1"]["available"], rows["n1"]["free_rings"], rows["n1"]["groups"]["8"]) == ([4, 5, 6, 7], 1, None)
    assert sorted(ledger.asked) == ["hccs", "xpu"]  # once per policy per answer, not once per node
    # A later allocation shows on the next poll: the snapshot is unchanged, the view is not cached.
    ledger.allocated["xpu"] = {"x1": frozenset({7})}
    doc = asyncio.run(page.node_json("x1"))
    assert doc is not None and doc["topology"]["devices"]["used"] == [7]


def test_node_json_lists_results_newest_first_and_plans_in_flight() -> None:
    fleet = Fleet()
    session = join(fleet, topology("p800", "x1"))
    for i, state in enumerate((planpb.PlanResult.STATE_APPLIED, planpb.PlanResult.STATE_REJECTED)):
        applied = planpb.ActionResult(action_id="a", status=planpb.ActionResult.STATUS_APPLIED)
        result = planpb.PlanResult(plan_id=f"p{i}", state=state, message="m" * 1000, rejections=["a1: no"],
                                   actions=[applied])
        result.finished.FromSeconds(1_700_000_000 + i)
        fleet.record_result(session, result)
    page = fleet_page.FleetPage(fleet, pending=lambda n: [("later", False), ("soon", True)] if n == "x1" else [])
    doc = asyncio.run(page.node_json("x1"))
    assert doc is not None
    assert [(r["plan_id"], r["state"], r["ok"]) for r in doc["results"]] == [("p1", "rejected", False),
                                                                            ("p0", "applied", True)]
    assert doc["results"][0]["actions"] == {"applied": 1} and doc["results"][0]["finished"] == 1_700_000_001
    assert len(doc["results"][0]["message"]) == fleet_page.REASON_CHARS
    assert doc["pending"] == [{"plan_id": "later", "dry_run": False}, {"plan_id": "soon", "dry_run": True}]
    assert doc["drawing"] == "/api/node.svg?name=x1"
    assert asyncio.run(page.node_json("nobody")) is None


# ---- the routes, over the controller's HTTP listener ---------------------------------------------
@contextlib.asynccontextmanager
async def page_server(fleet: Fleet, **kw: Any) -> AsyncIterator[int]:
    state = ControllerState(fleet, ControllerMetrics())
    routes = Routes()
    fleet_page.install(routes, state, **kw)
    server = HttpServer(routes)
    await server.start(bind("127.0.0.1:0"))
    try:
        yield server.port
    finally:
        await server.stop()


def test_routes_answer_read_only_with_a_strict_content_security_policy() -> None:
    fleet = Fleet()
    join(fleet, topology("p800", "x/1?#"))
    join(fleet, topology("910", HOSTILE))
    join(fleet, topology("p800", ".."))
    calls: list[str] = []

    def draw(topo: pb.MemoryTopology) -> str:
        calls.append(topo.node_name)
        from memtopo.draw.svg import topology_svg

        return topology_svg(topo)

    async def main() -> None:
        async with page_server(fleet, draw=draw) as port:
            status, headers, body = await exchange(port, get("/"))
            assert status == 200 and headers["content-type"].startswith("text/html")
            assert headers["content-security-policy"] == fleet_page.CSP_PAGE
            assert "script-src 'self'" in fleet_page.CSP_PAGE and "unsafe-inline" not in fleet_page.CSP_PAGE
            assert b'<script src="/static/fleet.js" defer></script>' in body
            assert body.count(b"<script") == 1  # the one script is the static file: nothing inline

            for path, kind in (("/static/fleet.js", "text/javascript"), ("/static/fleet.css", "text/css")):
                status, headers, body = await exchange(port, get(path))
                assert (status, headers["content-type"].split(";")[0]) == (200, kind)
                assert headers["x-content-type-options"] == "nosniff"
            assert (await exchange(port, get("/static/nothing.js")))[0] == 404

            status, _, body = await exchange(port, get("/api/fleet"))
            assert status == 200
            assert sorted(r["name"] for r in json.loads(body)["nodes"]) == sorted([HOSTILE, "x/1?#", ".."])

            # A name with '/', '?' and '#' reaches its page percent-encoded, as the script encodes it.
            status, _, body = await exchange(port, get("/nodes/" + quote("x/1?#", safe="")))
            assert status == 200 and b"x/1?#" in body
            status, _, body = await exchange(port, get("/api/node?name=" + quote("x/1?#", safe="")))
            assert status == 200 and json.loads(body)["name"] == "x/1?#"

            # ".." would be a dot segment of the path: its page goes by query.
            assert fleet_page.node_path("..") == "/nodes/?name=.."
            status, _, body = await exchange(port, get(fleet_page.node_path("..")))
            assert status == 200 and b"<h1><span id=\"name\">..</span>" in body

            # The hostile name is escaped wherever the server renders it.
            status, _, body = await exchange(port, get(fleet_page.node_path(HOSTILE)))
            assert status == 200
            assert b"<script>window" not in body and b"<img/src" not in body
            assert b"&lt;script&gt;window.pwned=1;alert(1)&lt;/script&gt;" in body

            status, headers, svg = await exchange(port, get(fleet_page.drawing_path(HOSTILE)))
            assert (status, headers["content-type"]) == (200, "image/svg+xml")
            assert headers["content-security-policy"] == fleet_page.CSP_SVG
            assert svg.startswith(b"<?xml") and b"<svg" in svg and b"<script>" not in svg
            assert (await exchange(port, get(fleet_page.drawing_path(HOSTILE))))[2] == svg
            assert calls == [HOSTILE]  # drawn once per snapshot, then served from the cache

            for path, code in (("/nodes/nobody", 404), ("/api/node?name=nobody", 404), ("/api/node", 400),
                               ("/api/node?name=a&name=b", 400), ("/api/node.svg?name=nobody", 404),
                               ("/nodes/", 404)):
                status, _, body = await exchange(port, get(path))
                assert status == code, path
                assert "error" in json.loads(body)
            for method in ("POST", "PUT", "DELETE"):
                raw = f"{method} / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n".encode()
                status, headers, _ = await exchange(port, raw)
                assert status == 405 and headers["allow"] == "GET, HEAD"

    asyncio.run(main())


# Any name the fleet accepts: printable, no control characters, up to 253 characters.
NAMES = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=253)


@settings(max_examples=60, deadline=None)
@given(name=NAMES)
def test_every_name_the_fleet_accepts_reaches_its_page_and_data(name: str) -> None:
    fleet = Fleet()
    fleet.connect(Hello(name, "i1"), "ipv4:127.0.0.1:4000")

    async def main() -> None:
        async with page_server(fleet) as port:
            status, _, body = await exchange(port, get(fleet_page.node_path(name)))
            assert status == 200
            assert html.escape(name, quote=True).encode() in body
            status, _, body = await exchange(port, get("/api/node?" + urlencode({"name": name})))
            assert status == 200 and json.loads(body)["name"] == name

    asyncio.run(main())


def test_a_drawing_that_fails_answers_500_without_a_traceback() -> None:
    fleet = Fleet()
    join(fleet, topology("p800", "x1"))

    def broken(topo: pb.MemoryTopology) -> str:
        raise RuntimeError("secret internals")

    async def main() -> None:
        async with page_server(fleet, draw=broken) as port:
            status, _, body = await exchange(port, get(fleet_page.drawing_path("x1")))
            assert status == 500
            assert json.loads(body) == {"error": "drawing failed: RuntimeError"}
            assert (await exchange(port, get("/api/node?name=x1")))[0] == 200  # the page itself still works

    asyncio.run(main())


def test_the_script_builds_text_nodes_only() -> None:
    # Untrusted text must never be parsed as markup by the page's own script.
    for forbidden in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert forbidden not in assets().js, forbidden
    assert "createTextNode" in assets().js


def test_a_real_controller_shows_plans_in_flight_then_their_results() -> None:
    """Over the controller's own listener: a plan submitted and not answered yet is listed as
    pending; once the agent's result arrives it moves to the results."""
    async def main() -> None:
        running = await start_controller("127.0.0.1:0", http="127.0.0.1:0",
                                         http_routes=listener_routes(ExtenderOptions()))
        assert running.http is not None
        port = running.http.port
        agent = SimAgent(f"127.0.0.1:{running.port}")
        try:
            await agent.join("x1", topology("p800", "x1"))
            async with admin(f"127.0.0.1:{running.port}") as stub:
                submit = asyncio.ensure_future(stub.SubmitPlan(apb.SubmitPlanRequest(
                    node_name="x1", plan=planpb.BindingPlan(plan_id="pin-1"), timeout_seconds=30)))
                sent = await agent.expect("plan")
                assert sent.plan.plan.plan_id == "pin-1"
                doc = json.loads((await exchange(port, get("/api/node?name=x1")))[2])
                assert (doc["pending"], doc["results"]) == ([{"plan_id": "pin-1", "dry_run": False}], [])
                await agent.send(plan_result=planpb.PlanResult(plan_id="pin-1", state=planpb.PlanResult.STATE_APPLIED))
                assert (await submit).state == planpb.PlanResult.STATE_APPLIED
            doc = json.loads((await exchange(port, get("/api/node?name=x1")))[2])
            assert doc["pending"] == []
            assert [(r["plan_id"], r["state"]) for r in doc["results"]] == [("pin-1", "applied")]
        finally:
            await agent.close()
            await running.stop(0.5)

    asyncio.run(main())


# ---- in a real browser, against real agents ----------------------------------------------------------
def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def ascend910_root(tmp: Path) -> Path:
    """The synthesized A2 host's tree with the real Ascend 910A x8 `npu-smi info` capture recorded
    in place of its own (as tests/fleet_nodes.py replays it): an 8-NPU, two-ring node."""
    root = tmp / "root"
    shutil.copytree(extracted(FIXTURES / "ascend-a2-8x910b" / "root.tar.gz"), root, symlinks=True)
    shutil.copyfile(NPU_SMI_910A_X8, root / ".memtopo" / "tools" / "npu-smi-info.txt")
    return root


class Fleet4:
    def __init__(self, controller: Any, grpc_port: int, http_port: int, agents: dict[str, Agent]) -> None:
        self.controller = controller
        self.grpc_address = f"127.0.0.1:{grpc_port}"
        self.url = f"http://127.0.0.1:{http_port}"
        self.agents = agents


# The browser tests share one controller, four agents and one Chromium: on one xdist worker.
FLEET4 = pytest.mark.xdist_group("fleet4")


@pytest.fixture(scope="module")
def fleet4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet4]:
    """A controller (gRPC + HTTP) and four real agents on captured roots, each with its own name and
    socket; one agent's name is hostile markup."""
    if not (SHARED / "lab" / "captures").exists():
        pytest.skip(f"the shared lab captures are missing ({SHARED})")
    base = tmp_path_factory.mktemp("fleet4")
    controller = Controller(http=True)
    controller.start()
    grpc_port, http_port = controller.port, controller.http_port
    assert http_port is not None
    roots = {
        "ascend910-01": ascend910_root(base / "a910"),
        "p800-01": FIXTURES / "kunlunxin-p800-8xpu" / "root.tar.gz",
        "gh200-01": FIXTURES / "gh200" / "root.tar.gz",
        HOSTILE: lab_root("dual-socket-cxl"),
    }
    agents: dict[str, Agent] = {}
    try:
        for i, (name, root) in enumerate(roots.items()):
            tmp = base / f"agent{i}"
            tmp.mkdir(exist_ok=True)
            agents[name] = Agent(tmp, root, grpc_port, node_name=name)
        for agent in agents.values():
            agent.launch()
        for agent in agents.values():
            agent.wait_ready()
        fleet = Fleet4(controller, grpc_port, http_port, agents)

        def all_held() -> bool:
            import urllib.request

            with urllib.request.urlopen(fleet.url + "/api/fleet", timeout=5) as r:
                rows = json.loads(r.read())["nodes"]
            return sorted(r["name"] for r in rows if r["connected"] and r["topology"]) == sorted(roots)

        wait_for(all_held, timeout=120, what="the controller to hold all four topologies")
        yield fleet
    finally:
        for agent in agents.values():
            if agent.proc is not None and agent.proc.poll() is None:
                agent.stop()
        controller.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as b:
        yield b


def until(page: Any, predicate: str) -> None:
    """Wait (generously: a busy machine) until the JS arrow function ``predicate`` holds. A function,
    not an expression string: the page's CSP forbids eval, which playwright uses for expressions."""
    assert predicate.startswith("() =>")
    page.wait_for_function(predicate, timeout=60_000)


class Watched:
    """A page whose dialogs (alert) and page errors are recorded: a hostile name must raise none."""

    def __init__(self, browser: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.page.on("dialog", self._dialog)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()


def row(name: str) -> str:
    """A JS expression for the fleet page's row of ``name`` (matched by text, never by a selector
    built from the name)."""
    return f"[...document.querySelectorAll('#nodes tr')].find(r => r.dataset.node === {json.dumps(name)})"


@FLEET4
def test_the_fleet_page_lists_the_four_agents(browser: Any, fleet4: Fleet4, tmp_path: Path) -> None:
    w = Watched(browser)
    w.page.goto(fleet4.url + "/")
    until(w.page, "() => document.querySelectorAll('#nodes tr[data-state=connected]').length === 4")
    names = w.page.eval_on_selector_all("#nodes tr", "rows => rows.map(r => r.querySelector('td.name').textContent)")
    assert sorted(names) == sorted(fleet4.agents)
    text = {n: w.page.evaluate(f"{row(n)}.textContent") for n in fleet4.agents}
    assert "HCCS rings free 4 + 4 of 8 healthy" in text["ascend910-01"]
    assert "XPU MTF 1" in text["p800-01"]
    assert "8 × P800 OAM" in text["p800-01"]
    assert "Unified" in text["gh200-01"] and "UNIFIED" not in text["gh200-01"]
    shot = tmp_path / "page-fleet.png"
    w.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    assert png_size(shot)[0] == 1400 and png_size(shot)[1] >= 300
    assert (w.dialogs, w.errors) == ([], [])


@FLEET4
def test_the_hostile_name_is_shown_as_text_and_runs_nothing(browser: Any, fleet4: Fleet4) -> None:
    w = Watched(browser)
    w.page.goto(fleet4.url + "/")
    until(w.page, f"() => {row(HOSTILE)} !== undefined")
    assert w.page.evaluate(f"{row(HOSTILE)}.querySelector('td.name').textContent") == HOSTILE
    # Only the page's own script element exists; the name made no element of its own.
    assert w.page.evaluate("document.querySelectorAll('script').length") == 1
    assert w.page.evaluate("document.querySelectorAll('#nodes img').length") == 0
    w.page.evaluate(f"{row(HOSTILE)}.querySelector('td.name a').click()")
    until(w.page, "() => document.querySelector('#domains table') !== null")
    assert w.page.text_content("#name") == HOSTILE
    assert w.page.title().startswith(HOSTILE)
    assert w.page.evaluate("document.querySelectorAll('script').length") == 1
    assert w.page.evaluate("window.pwned") is None
    assert (w.dialogs, w.errors) == ([], [])


@FLEET4
def test_the_node_page_shows_the_drawing(browser: Any, fleet4: Fleet4, tmp_path: Path) -> None:
    w = Watched(browser)
    w.page.goto(fleet4.url + "/")
    until(w.page, f"() => {row('ascend910-01')} !== undefined")
    w.page.evaluate(f"{row('ascend910-01')}.querySelector('td.name a').click()")
    w.page.wait_for_url("**/nodes/ascend910-01")
    # Loaded and decoded: an image that failed would have naturalWidth 0.
    until(w.page, "() => document.getElementById('drawing').complete"
                             " && document.getElementById('drawing').naturalWidth > 0")
    src = w.page.get_attribute("#drawing", "src")
    assert src is not None
    svg = w.page.request.get(fleet4.url + src).text()
    assert all(f"NPU{i}" in svg for i in range(8))
    until(w.page, "() => document.querySelector('#accelerators table') !== null")
    assert w.page.eval_on_selector_all("#accelerators tbody tr", "rows => rows.length") == 8
    assert "HCCS rings free 4 + 4" in (w.page.text_content("#facts") or "")
    shot = tmp_path / "page-node.png"
    w.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    width, height = png_size(shot)
    assert width == 1400 and height > 900  # the drawing and the tables run past one screen
    assert (w.dialogs, w.errors) == ([], [])


@FLEET4
def test_an_unchanged_row_is_kept_across_polls(browser: Any, fleet4: Fleet4) -> None:
    """Only the ages are rewritten in place: a tooltip being read or text being selected in a row
    survives the page's next poll."""
    w = Watched(browser)
    w.page.goto(fleet4.url + "/")
    until(w.page, f"() => {row('gh200-01')} !== undefined")
    w.page.evaluate(f"() => {{ window.kept = {row('gh200-01')}; }}")
    for _ in range(2):  # two more polls: the indicator shows each poll's time
        shown = w.page.text_content("#live") or ""
        until(w.page, f"() => document.getElementById('live').textContent !== {json.dumps(shown)}")
    assert w.page.evaluate(f"() => window.kept === {row('gh200-01')}") is True
    assert w.page.evaluate("() => window.kept.isConnected") is True
    assert (w.dialogs, w.errors) == ([], [])


@FLEET4
def test_a_node_started_on_a_tarball_names_the_tarball_as_its_source(browser: Any, fleet4: Fleet4) -> None:
    """Not the temporary directory the agent extracted it to: the page and the drawing say what
    the operator gave."""
    tarball = str(FIXTURES / "kunlunxin-p800-8xpu" / "root.tar.gz")
    w = Watched(browser)
    w.page.goto(fleet4.url + fleet_page.node_path("p800-01"))
    until(w.page, "() => document.querySelector('#facts dt') !== null")
    facts = w.page.text_content("#facts") or ""
    assert "Source" in facts and tarball in facts and "memtopo-root" not in facts
    svg = w.page.request.get(fleet4.url + fleet_page.drawing_path("p800-01")).text()
    assert tarball in svg
    assert (w.dialogs, w.errors) == ([], [])


@FLEET4
def test_a_local_rollback_replaces_the_applied_result_on_the_page(browser: Any, fleet4: Fleet4) -> None:
    """A plan applied through the controller, then rolled back on the node with `memtopo rollback`:
    the agent reports the changed result at its next heartbeat and the page shows it."""
    agent = fleet4.agents["ascend910-01"]
    child = subprocess.Popen(["sleep", "600"])
    try:
        os.sched_setaffinity(child.pid, {0, 1} & os.sched_getaffinity(0) or {0})
        plan = pin_plan("pin-then-rollback", child.pid, [0])
        with grpc.insecure_channel(fleet4.grpc_address) as ch:
            result = agent_pb2_grpc.ControllerAdminStub(ch).SubmitPlan(
                apb.SubmitPlanRequest(node_name="ascend910-01", plan=plan, timeout_seconds=30), timeout=60)
        assert result.state == planpb.PlanResult.STATE_APPLIED, result

        def shown() -> list[str]:
            with urllib.request.urlopen(fleet4.url + "/api/node?name=ascend910-01", timeout=10) as r:
                return [x["state"] for x in json.loads(r.read())["results"] if x["plan_id"] == plan.plan_id]

        assert shown() == ["applied"]
        rolled = subprocess.run([sys.executable, "-m", "memtopo.cli", "rollback", plan.plan_id,
                                 "--state-dir", str(agent.tmp / "state" / "apply")],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr
        wait_for(lambda: shown() == ["rolled back"], timeout=60, what="the page to show the rollback")
        w = Watched(browser)
        w.page.goto(fleet4.url + fleet_page.node_path("ascend910-01"))
        until(w.page, "() => document.querySelector('#results table') !== null")
        cells = w.page.evaluate("() => [...document.querySelectorAll('#results tbody tr')]"
                                ".map(r => [...r.cells].map(c => c.textContent))"
                                ".find(c => c[0] === 'pin-then-rollback')")
        assert cells[1] == "rolled back"
        assert (w.dialogs, w.errors) == ([], [])
    finally:
        child.kill()
        child.wait(10)


@FLEET4
def test_a_killed_agent_turns_disconnected_without_a_reload(browser: Any, fleet4: Fleet4, tmp_path: Path) -> None:
    w = Watched(browser)
    w.page.goto(fleet4.url + "/")
    until(w.page, "() => document.querySelectorAll('#nodes tr[data-state=connected]').length === 4")
    w.page.evaluate("window.sameDocument = true")
    victim = fleet4.agents["p800-01"]
    assert victim.proc is not None
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(30)
    killed = time.monotonic()
    # The page polls every second; the wait is generous for a busy machine, the figure is printed.
    until(w.page, f"() => {row('p800-01')}.dataset.state === 'disconnected'")
    print(f"row disconnected {time.monotonic() - killed:.2f} s after the kill")
    assert w.page.evaluate("window.sameDocument") is True  # no reload happened
    assert "disconnected" in w.page.evaluate(f"{row('p800-01')}.textContent")
    states = w.page.eval_on_selector_all("#nodes tr", "rows => rows.map(r => r.dataset.state)")
    assert sorted(states) == ["connected"] * 3 + ["disconnected"]
    shot = tmp_path / "page-fleet-disconnected.png"
    w.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000 and png_size(shot)[0] == 1400
    assert (w.dialogs, w.errors) == ([], [])


@FLEET4
def test_the_page_says_when_the_controller_is_gone(browser: Any, fleet4: Fleet4) -> None:
    """Last in the module: it stops the controller the other browser tests share."""
    w = Watched(browser)
    w.page.goto(fleet4.url + "/")
    until(w.page, "() => document.getElementById('live').textContent.startsWith('live')")
    fleet4.controller.kill()
    until(w.page, "() => document.getElementById('live').classList.contains('down')")
    assert "controller unreachable" in (w.page.text_content("#live") or "")
    # The last rows stay on screen for the reader.
    assert w.page.eval_on_selector_all("#nodes tr", "rows => rows.length") == 4
    assert (w.dialogs, w.errors) == ([], [])


# ---- rendering, against an in-process fleet ---------------------------------------------------------
@contextlib.contextmanager
def fleet_page_thread(populate: Callable[[Fleet], None]) -> Iterator[str]:
    """The page's routes over a fleet ``populate`` fills, on a server thread (the browser is driven
    synchronously); the page's URL."""
    def make() -> HttpServer:
        fleet = Fleet()
        populate(fleet)
        routes = Routes()
        fleet_page.install(routes, ControllerState(fleet, ControllerMetrics()))
        return HttpServer(routes)

    thread = ServerThread(make, bind("127.0.0.1:0"))
    try:
        yield f"http://127.0.0.1:{thread.port}"
    finally:
        thread.stop()


def one_numa_node(topo: pb.MemoryTopology) -> None:
    del topo.numa_nodes[1:]


def unified_and_cxl(topo: pb.MemoryTopology) -> None:
    topo.domains[0].type = pb.MEMORY_DOMAIN_TYPE_UNIFIED
    topo.domains[-1].type = pb.MEMORY_DOMAIN_TYPE_CXL_ATTACHED


# 2023-11-14 13:05:09 local time: an afternoon hour, which a 12-hour clock shows as 1 PM.
FINISHED = time.mktime((2023, 11, 14, 13, 5, 9, 0, 0, -1))


def populated(fleet: Fleet) -> None:
    session = join(fleet, topology("p800", "solo-01", one_numa_node))
    join(fleet, topology("p800", "mixed-01", unified_and_cxl))
    for state in (planpb.PlanResult.STATE_APPLIED, planpb.PlanResult.STATE_ROLLED_BACK):
        result = planpb.PlanResult(plan_id="pin-1", state=state, actions=[planpb.ActionResult(
            action_id="a", status=planpb.ActionResult.STATUS_ROLLED_BACK)])
        result.finished.FromSeconds(int(FINISHED))
        fleet.record_result(session, result)


def test_the_page_shows_words_plurals_and_one_time_format(browser: Any) -> None:
    with fleet_page_thread(populated) as url:
        page = browser.new_page(locale="en-US", viewport={"width": 1400, "height": 900})
        page.goto(url + "/")
        until(page, "() => document.querySelectorAll('#nodes tr').length === 2")
        rows = {n: page.evaluate(f"{row(n)}.textContent") for n in ("solo-01", "mixed-01")}
        assert "1 NUMA node" in rows["solo-01"] and "1 NUMA nodes" not in rows["solo-01"]
        assert "Unified" in rows["mixed-01"] and "CXL" in rows["mixed-01"]
        assert "UNIFIED" not in rows["mixed-01"] and "CXL_ATTACHED" not in rows["mixed-01"]
        live = page.text_content("#live") or ""
        assert re.fullmatch(r"live · \d\d:\d\d:\d\d", live), live

        page.goto(url + fleet_page.node_path("solo-01"))
        until(page, "() => document.querySelector('#results table') !== null")
        facts = page.text_content("#facts") or ""
        assert "1 NUMA node" in facts and "1 NUMA nodes" not in facts
        cells = page.eval_on_selector_all("#results tbody tr td", "tds => tds.map(td => td.textContent)")
        assert cells[1] == "rolled back" and cells[2] == "1 rolled back" and "ROLLED_BACK" not in cells
        assert cells[4] == "2023-11-14 13:05:09"
        assert not re.search(r"\b[AP]M\b", page.text_content("body") or "")

        page.goto(url + fleet_page.node_path("mixed-01"))
        until(page, "() => document.querySelector('#domains table') !== null")
        types = page.eval_on_selector_all("#domains tbody tr td:nth-child(2)", "tds => tds.map(td => td.textContent)")
        assert types[0].startswith("Unified") and types[-1].startswith("CXL") and not any("_" in t for t in types)
        page.close()


NAMES_THAT_WRAP = ("ascend910-01", "gpu-node-0042.rack-7.example.com", "cxl-tier-b.rack-12")


def test_node_names_break_only_between_their_parts(browser: Any) -> None:
    def names(fleet: Fleet) -> None:
        for name in NAMES_THAT_WRAP:
            join(fleet, topology("910", name))

    with fleet_page_thread(names) as url:
        for width in (1400, 640):
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.goto(url + "/")
            until(page, f"() => document.querySelectorAll('#nodes tr').length === {len(NAMES_THAT_WRAP)}")
            # Each text node of a name is one part; a part laid out over two lines was broken inside.
            lines = page.evaluate("""() => [...document.querySelectorAll('#nodes td.name a')].map(a =>
                [...a.childNodes].filter(n => n.nodeType === Node.TEXT_NODE).map(t => {
                    const r = document.createRange(); r.selectNodeContents(t);
                    return new Set([...r.getClientRects()].map(b => Math.round(b.top))).size; }))""")
            assert all(count == 1 for name in lines for count in name), (width, lines)
            texts = page.eval_on_selector_all("#nodes td.name a", "as => as.map(a => a.textContent)")
            assert sorted(texts) == sorted(NAMES_THAT_WRAP)
            page.close()


def test_the_wheel_ships_the_page_s_assets(tmp_path: Path) -> None:
    """The HTML, CSS, script and icon are package data: a wheel built from the tree carries every
    file the page loads, where the page loads them from. Built from a copy of the sources, so the
    build leaves nothing in the checkout."""
    source = tmp_path / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "tests", "bench", "docs"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    import zipfile

    (wheel,) = tmp_path.glob("memtopo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n.removeprefix("memtopo/fleetpage/assets/") for n in names if n.startswith("memtopo/fleetpage/assets/")}
    on_disk = {p.name for p in (REPO / "fleetpage" / "assets").iterdir()}
    assert shipped == on_disk and {"fleet.html", "node.html", "fleet.css", "fleet.js", "favicon.svg"} <= shipped
