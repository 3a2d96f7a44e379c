"""The reference controller: the pure fleet state, then a real grpc.aio server on 127.0.0.1:0 with
simulated agents (raw Controller.Connect streams written message by message, so each test controls
exactly what the agent says and when), the admin RPCs, health, reflection, TLS and the CLI.

One test drives the controller with the agent's own ControllerLink (agent/link.py) to check that
both sides implement the same protocol (docs/controller.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped, unused-ignore]
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # type: ignore[import-untyped, unused-ignore]
from hypothesis import given, settings
from hypothesis import strategies as st

from memtopo.agent.link import ControllerLink, LinkState
from memtopo.agent.state import TopologyState
from memtopo.backoff import Backoff
from memtopo.cli import controller as cli
from memtopo.cli.main import main as memtopo_main
from memtopo.cli.output import EXIT_USAGE
from memtopo.controller.fleet import (
    RESULTS_PER_NODE,
    Ack,
    Fleet,
    FleetFullError,
    Hello,
    ProtocolError,
    RequestSnapshot,
)
from memtopo.controller.server import (
    SERVICE_NAMES,
    ControllerConfigError,
    RunningController,
    check_address,
    start_controller,
)
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.planner.fleet import FleetNode
from memtopo.planner.fleet import decide as fleet_decide
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import agent_pb2_grpc
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests.controllers import Background, SimAgent, admin, answering_agent, topo
from tests.fixtures import REPO, hwloc_root
from tests.fleet_nodes import node, npu
from tests.pki import pki

__all__ = ["pki"]  # the PKI fixture (a CA, server and client certificates)
P = planpb.PlanResult
SC = grpc.StatusCode
T = TypeVar("T")


# ---- fleet (pure) ------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_snapshot_is_held_as_its_bytes_arrived() -> None:
    """What the link read is stored, not the parsed message encoded again: bytes that protobuf would
    encode differently (fields out of their order here) are kept exactly."""
    from memtopo.controller.server import Received
    from memtopo.wire import embed

    # fingerprint (field 4...) before node_name and generation: valid, but not protobuf's own order.
    payload = (pb.MemoryTopology(fingerprint="fp7").SerializeToString()
               + pb.MemoryTopology(node_name="n1", generation=7).SerializeToString())
    snapshot_field = apb.AgentMessage.DESCRIPTOR.fields_by_name["snapshot"].number
    got = Received.parse(embed(apb.AgentMessage().SerializeToString(), snapshot_field, payload))
    assert got.snapshot == payload and got.message.snapshot.SerializeToString() != payload
    fleet = Fleet()
    c = fleet.connect(Hello("n1", "inst-a", "boot-1", 7, "fp7"), "peer")
    assert fleet.snapshot(c.session, got.message.snapshot, got.snapshot).stored
    assert fleet.topology_bytes("n1") == payload
    assert Received.parse(apb.AgentMessage(heartbeat=apb.AgentHeartbeat(generation=1)).SerializeToString()).snapshot \
        is None


def test_unknown_node_is_asked_for_a_snapshot_then_acked_and_summarised() -> None:
    clock = Clock()
    fleet = Fleet(clock=clock)
    c = fleet.connect(Hello("n1", "inst-a", "boot-1", 5, "fp5"), "ipv4:10.0.0.1:5000")
    assert c.reply == RequestSnapshot("unknown node") and c.replaced is None
    clock.now = 1001.0
    out = fleet.snapshot(c.session, topo(5, "fp5", numa=4, accel=8))
    assert out.stored and out.reply == Ack(5, "fp5")
    (info,) = fleet.nodes()
    assert (info.node_name, info.agent_instance_id, info.boot_id, info.generation, info.fingerprint) == \
        ("n1", "inst-a", "boot-1", 5, "fp5")
    assert (info.connected, info.numa_nodes, info.accelerators, info.last_seen, info.peer) == \
        (True, 4, 8, 1001.0, "ipv4:10.0.0.1:5000")
    held = fleet.topology("n1")
    assert held is not None and held.generation == 5


def test_reconnect_with_what_is_held_is_acked_and_replaces_the_old_session() -> None:
    fleet = Fleet()
    first = fleet.connect(Hello("n1", "inst-a", generation=5, fingerprint="fp5"), "p1")
    fleet.snapshot(first.session, topo(5, "fp5"))
    second = fleet.connect(Hello("n1", "inst-a", generation=5, fingerprint="fp5"), "p2")
    assert second.reply == Ack(5, "fp5")
    assert second.replaced == first.session and second.replaced_peer == "p1"
    # The superseded stream can no longer change anything, and its end does not disconnect the node.
    assert not fleet.snapshot(first.session, topo(6, "fp6")).stored
    assert fleet.heartbeat(first.session, 9, "x") is None
    assert fleet.record_result(first.session, P(plan_id="p", state=P.STATE_APPLIED)) is None
    assert fleet.disconnect(first.session) is None
    (info,) = fleet.nodes()
    assert info.connected and info.peer == "p2" and info.generation == 5


@pytest.mark.parametrize(("hello", "reason"), [
    (Hello("n1", "inst-b", generation=5, fingerprint="fp5"), "new agent instance"),
    (Hello("n1", "inst-a", generation=7, fingerprint="fp7"), "stale generation 5 < 7"),
    (Hello("n1", "inst-a", generation=5, fingerprint="other"), "fingerprint differs at generation 5"),
])
def test_hello_that_does_not_match_the_held_snapshot_asks_for_one(hello: Hello, reason: str) -> None:
    fleet = Fleet()
    c = fleet.connect(Hello("n1", "inst-a", generation=5, fingerprint="fp5"), "p")
    fleet.snapshot(c.session, topo(5, "fp5"))
    assert fleet.connect(hello, "p").reply == RequestSnapshot(reason)


def test_older_snapshot_of_the_same_instance_is_ignored_but_a_new_instance_replaces() -> None:
    fleet = Fleet()
    c = fleet.connect(Hello("n1", "inst-a"), "p")
    fleet.snapshot(c.session, topo(5, "fp5"))
    late = fleet.snapshot(c.session, topo(4, "fp4"))
    assert not late.stored and late.reply is None and "older" in late.reason
    assert fleet.nodes()[0].generation == 5
    # A restarted agent counts generations from 1 again: its snapshot is the truth now.
    c2 = fleet.connect(Hello("n1", "inst-b", generation=1, fingerprint="fp1"), "p")
    assert fleet.snapshot(c2.session, topo(1, "fp1")).reply == Ack(1, "fp1")
    assert fleet.nodes()[0].generation == 1


def test_stale_heartbeat_asks_once_until_the_snapshot_arrives() -> None:
    fleet = Fleet()
    c = fleet.connect(Hello("n1", "inst-a"), "p")
    fleet.snapshot(c.session, topo(3, "fp3"))
    assert fleet.heartbeat(c.session, 3, "fp3") is None
    assert fleet.heartbeat(c.session, 5, "fp5") == RequestSnapshot("stale generation 3 < 5")
    # Coalesced: the agent answers every request with a full snapshot, so one is enough.
    assert fleet.heartbeat(c.session, 5, "fp5") is None
    fleet.snapshot(c.session, topo(5, "fp5"))
    assert fleet.heartbeat(c.session, 5, "fp5") is None
    assert fleet.heartbeat(c.session, 6, "fp6") == RequestSnapshot("stale generation 5 < 6")


def test_disconnect_keeps_the_node_with_its_topology() -> None:
    clock = Clock()
    fleet = Fleet(clock=clock)
    c = fleet.connect(Hello("n1", "inst-a"), "p")
    fleet.snapshot(c.session, topo(2, "fp2"))
    clock.now = 2000.0
    assert fleet.disconnect(c.session) == "n1"
    assert fleet.disconnect(c.session) is None
    (info,) = fleet.nodes()
    assert not info.connected and info.last_seen == 2000.0 and info.generation == 2
    assert fleet.session_of("n1") is None and fleet.topology("n1") is not None


def test_plan_results_are_bounded_per_node_and_a_dry_run_never_hides_an_applied_result() -> None:
    fleet = Fleet()
    c = fleet.connect(Hello("n1", "inst-a"), "p")
    for i in range(RESULTS_PER_NODE + 10):
        assert fleet.record_result(c.session, P(plan_id=f"plan-{i}", state=P.STATE_APPLIED)) == "n1"
    assert fleet.result("n1", "plan-9") is None
    kept = fleet.result("n1", "plan-10")
    assert kept is not None and kept.node_name == "n1"
    fleet.record_result(c.session, P(plan_id="plan-10", state=P.STATE_DRY_RUN))
    kept = fleet.result("n1", "plan-10")
    assert kept is not None and kept.state == P.STATE_APPLIED
    fleet.record_result(c.session, P(plan_id="new", state=P.STATE_DRY_RUN))
    fleet.record_result(c.session, P(plan_id="new", state=P.STATE_APPLIED))
    new = fleet.result("n1", "new")
    assert new is not None and new.state == P.STATE_APPLIED


@pytest.mark.parametrize(("hello", "message"), [
    (Hello("", "inst"), "without node_name"),
    (Hello("n1", ""), "without agent_instance_id"),
    (Hello("n\n1", "inst"), "control characters"),
    (Hello("n" * 300, "inst"), "longer than"),
])
def test_bad_hello_is_a_protocol_error(hello: Hello, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        Fleet().connect(hello, "p")


def test_the_number_of_nodes_is_bounded() -> None:
    fleet = Fleet(max_nodes=2)
    fleet.connect(Hello("a", "i"), "p")
    fleet.connect(Hello("b", "i"), "p")
    fleet.connect(Hello("a", "j"), "p")  # a known node reconnecting is always accepted
    with pytest.raises(FleetFullError):
        fleet.connect(Hello("c", "i"), "p")


# Random link traffic from a few agents: whatever happens, the fleet's bounds and rules hold.
_op = st.one_of(
    st.tuples(st.just("connect"), st.sampled_from("ab"), st.sampled_from(["i1", "i2"]), st.integers(0, 6)),
    st.tuples(st.just("snapshot"), st.sampled_from("ab"), st.integers(0, 6)),
    st.tuples(st.just("heartbeat"), st.sampled_from("ab"), st.integers(0, 6)),
    st.tuples(st.just("result"), st.sampled_from("ab"), st.integers(0, 9), st.sampled_from([1, 2, 3, 6])),
    st.tuples(st.just("disconnect"), st.sampled_from("ab")),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_op, max_size=60))
def test_fleet_invariants_under_random_link_traffic(ops: list[tuple[Any, ...]]) -> None:
    fleet = Fleet(results_per_node=4)
    sessions: dict[str, list[int]] = {"a": [], "b": []}  # every session ever opened per node
    instance: dict[str, str] = {}
    held: dict[str, tuple[str, int]] = {}
    for op in ops:
        kind, node = op[0], op[1]
        live = fleet.session_of(node)
        any_session = sessions[node][-1] if sessions[node] else 0
        if kind == "connect":
            c = fleet.connect(Hello(node, op[2], generation=op[3], fingerprint=f"fp{op[3]}"), "p")
            sessions[node].append(c.session)
            instance[node] = op[2]
            expect_ack = held.get(node) == (op[2], op[3])
            assert isinstance(c.reply, Ack) == expect_ack
        elif kind == "snapshot":
            out = fleet.snapshot(any_session, topo(op[2], f"fp{op[2]}"))
            if out.stored:
                assert live == any_session
                prev = held.get(node)
                assert prev is None or prev[0] != instance[node] or prev[1] <= op[2]
                held[node] = (instance[node], op[2])
        elif kind == "heartbeat":
            fleet.heartbeat(any_session, op[2], f"fp{op[2]}")
        elif kind == "result":
            fleet.record_result(any_session, P(plan_id=f"p{op[2]}", state=op[3]))
        else:
            fleet.disconnect(any_session)
        for info in fleet.nodes():
            h = held.get(info.node_name)
            assert info.generation == (h[1] if h else 0)
            assert info.connected == (fleet.session_of(info.node_name) is not None)
    for node in "ab":
        stored = [r for i in range(10) if (r := fleet.result(node, f"p{i}")) is not None]
        assert len(stored) <= 4
        assert all(r.node_name == node for r in stored)




async def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


Body = Callable[[RunningController, str], Awaitable[None]]


def serve(body: Body) -> None:
    async def main() -> None:
        running = await start_controller("127.0.0.1:0")
        try:
            await body(running, f"127.0.0.1:{running.port}")
        finally:
            await running.stop(0.5)

    asyncio.run(main())




async def rpc_code(call: Awaitable[Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    code: grpc.StatusCode = err.value.code()
    return code


# ---- server: the link protocol -----------------------------------------------------------------------
def test_link_hello_snapshot_ack_then_listed_and_served() -> None:
    async def body(running: RunningController, addr: str) -> None:
        agent = SimAgent(addr)
        await agent.hello("n1", gen=3, fp="fp3")
        req = await agent.expect("snapshot_request")
        assert req.snapshot_request.reason == "unknown node"
        t = topo(3, "fp3", numa=2, accel=1, name="n1")
        await agent.send(snapshot=t)
        ack = await agent.expect("ack")
        assert (ack.ack.generation, ack.ack.fingerprint) == (3, "fp3")
        async with admin(addr) as stub:
            (node,) = (await stub.ListNodes(apb.ListNodesRequest())).nodes
            assert (node.node_name, node.agent_instance_id, node.boot_id, node.generation, node.fingerprint,
                    node.connected, node.numa_nodes, node.accelerators) == \
                ("n1", "inst-a", "boot", 3, "fp3", True, 2, 1)
            assert node.peer.startswith("ipv4:127.0.0.1:") and node.HasField("last_seen")
            assert abs(node.last_seen.ToNanoseconds() / 1e9 - time.time()) < 60
            assert await stub.GetNodeTopology(apb.GetNodeTopologyRequest(node_name="n1")) == t
            assert await rpc_code(stub.GetNodeTopology(apb.GetNodeTopologyRequest(node_name="zz"))) == SC.NOT_FOUND
        async with grpc.aio.insecure_channel(addr) as channel:  # the answer's bytes: the held ones, as they are
            raw: grpc.aio.UnaryUnaryMultiCallable[apb.GetNodeTopologyRequest, bytes] = channel.unary_unary(
                "/memtopo.v1.ControllerAdmin/GetNodeTopology",
                request_serializer=apb.GetNodeTopologyRequest.SerializeToString)
            assert await raw(apb.GetNodeTopologyRequest(node_name="n1")) == running.fleet.topology_bytes("n1")
        await agent.close()
    serve(body)


def test_reconnect_with_the_held_fingerprint_is_acked_without_a_request() -> None:
    async def body(running: RunningController, addr: str) -> None:
        a = SimAgent(addr)
        await a.join("n1", topo(4, "fp4"))
        await a.send(heartbeat=apb.AgentHeartbeat(generation=4, fingerprint="fp4"))
        await a.call.done_writing()
        assert await a.ended() == SC.OK
        await wait_until(lambda: not running.fleet.nodes()[0].connected)
        b = SimAgent(addr)
        await b.hello("n1", "inst-a", 4, "fp4")
        ack = await b.expect("ack")
        assert (ack.ack.generation, ack.ack.fingerprint) == (4, "fp4")
        await wait_until(lambda: running.fleet.nodes()[0].connected)
        await a.close()
        await b.close()
    serve(body)


def test_stale_heartbeat_gets_one_snapshot_request_and_the_new_snapshot_is_acked() -> None:
    async def body(running: RunningController, addr: str) -> None:
        a = SimAgent(addr)
        await a.join("n1", topo(1, "fp1"))
        await a.send(heartbeat=apb.AgentHeartbeat(generation=2, fingerprint="fp2"))
        req = await a.expect("snapshot_request")
        assert req.snapshot_request.reason == "stale generation 1 < 2"
        await a.send(heartbeat=apb.AgentHeartbeat(generation=2, fingerprint="fp2"))
        await a.send(snapshot=topo(2, "fp2"))
        # No second request in between: the next message is the ack of generation 2.
        ack = await a.expect("ack")
        assert ack.ack.generation == 2
        assert running.fleet.nodes()[0].generation == 2
        await a.close()
    serve(body)


def test_a_first_message_other_than_hello_is_refused() -> None:
    async def body(running: RunningController, addr: str) -> None:
        a = SimAgent(addr)
        await a.send(heartbeat=apb.AgentHeartbeat(generation=1, fingerprint="x"))
        assert await a.ended() == SC.INVALID_ARGUMENT
        b = SimAgent(addr)
        await b.hello("")
        assert await b.ended() == SC.INVALID_ARGUMENT
        c = SimAgent(addr)
        await c.join("n1", topo(1, "fp1"))
        await c.hello("n1")  # twice on one stream
        assert await c.ended() == SC.INVALID_ARGUMENT
        assert len(running.fleet) == 1
        for x in (a, b, c):
            await x.close()
    serve(body)


def test_a_second_link_for_the_same_node_replaces_the_first() -> None:
    async def body(running: RunningController, addr: str) -> None:
        old = SimAgent(addr)
        await old.join("n1", topo(1, "fp1"))
        new = SimAgent(addr)
        await new.hello("n1", "inst-a", 1, "fp1")
        await new.expect("ack")
        assert await old.ended() == SC.ABORTED
        assert "replaced" in (await old.call.details())
        # The old stream's end leaves the node connected through the new one.
        await asyncio.sleep(0.1)
        (info,) = running.fleet.nodes()
        assert info.connected
        await new.send(snapshot=topo(2, "fp2"))
        assert (await new.expect("ack")).ack.generation == 2
        await new.close()
        await wait_until(lambda: not running.fleet.nodes()[0].connected)
        await old.close()
    serve(body)


# ---- server: plans -----------------------------------------------------------------------------------
def plan(plan_id: str, description: str = "") -> planpb.BindingPlan:
    return planpb.BindingPlan(plan_id=plan_id, policy="manual", description=description)


def test_submit_plan_round_trip_and_stored_result() -> None:
    async def body(running: RunningController, addr: str) -> None:
        a = SimAgent(addr)
        await a.join("n1", topo(1, "fp1"))
        async with admin(addr) as stub:
            submit = asyncio.ensure_future(stub.SubmitPlan(apb.SubmitPlanRequest(
                node_name="n1", plan=plan("p-1"), dry_run=True, timeout_seconds=60)))
            msg = await a.expect("plan")
            assert msg.plan.plan.plan_id == "p-1" and msg.plan.dry_run
            await a.send(plan_result=P(plan_id="p-1", state=P.STATE_DRY_RUN, message="would change 0"))
            result = await submit
            assert (result.plan_id, result.state, result.node_name) == ("p-1", P.STATE_DRY_RUN, "n1")
            stored = await stub.GetNodePlanResult(apb.GetNodePlanResultRequest(node_name="n1", plan_id="p-1"))
            assert stored.message == "would change 0"
            assert await rpc_code(stub.GetNodePlanResult(apb.GetNodePlanResultRequest(
                node_name="n1", plan_id="nope"))) == SC.NOT_FOUND
        await a.close()
    serve(body)


def test_submit_plan_errors() -> None:
    async def body(running: RunningController, addr: str) -> None:
        a = SimAgent(addr)
        await a.join("n1", topo(1, "fp1"))
        gone = SimAgent(addr)
        await gone.join("n2", topo(1, "fp1"))
        await gone.close()
        await wait_until(lambda: not running.fleet.nodes()[1].connected)
        async with admin(addr) as stub:
            def req(node: str, plan_id: str = "p") -> apb.SubmitPlanRequest:
                return apb.SubmitPlanRequest(node_name=node, plan=plan(plan_id), timeout_seconds=1)

            assert await rpc_code(stub.SubmitPlan(req("n1", ""))) == SC.INVALID_ARGUMENT
            assert await rpc_code(stub.SubmitPlan(req("nobody"))) == SC.NOT_FOUND
            assert await rpc_code(stub.SubmitPlan(req("n2"))) == SC.UNAVAILABLE
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitPlan(req("n1"))
            assert err.value.code() == SC.DEADLINE_EXCEEDED
            assert "within 1 s" in (err.value.details() or "")  # the request's timeout, not the default
            assert time.monotonic() - t0 >= 0.9  # it did wait for it (a lower bound holds on any machine)
            await a.expect("plan")  # it was sent; the agent just never answered
        assert running.hub.inflight == {}  # the timed-out waiter left nothing behind
        await a.close()
    serve(body)


def test_a_plan_in_flight_is_resent_when_the_node_reconnects() -> None:
    async def body(running: RunningController, addr: str) -> None:
        a = SimAgent(addr)
        await a.join("n1", topo(1, "fp1"))
        async with admin(addr) as stub:
            submit = asyncio.ensure_future(stub.SubmitPlan(apb.SubmitPlanRequest(
                node_name="n1", plan=plan("p-2"), timeout_seconds=60)))
            await a.expect("plan")
            await a.close()  # the link drops before the agent answers
            await wait_until(lambda: not running.fleet.nodes()[0].connected)
            b = SimAgent(addr)
            await b.hello("n1", "inst-a", 1, "fp1")
            await b.expect("ack")
            again = await b.expect("plan")
            assert again.plan.plan.plan_id == "p-2" and not again.plan.dry_run
            await b.send(plan_result=P(plan_id="p-2", state=P.STATE_APPLIED))
            assert (await submit).state == P.STATE_APPLIED
            await b.close()
    serve(body)


# ---- server: standard services, addresses, shutdown --------------------------------------------------
def test_health_is_serving_and_reflection_lists_the_services() -> None:
    async def body(running: RunningController, addr: str) -> None:
        async with grpc.aio.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", *SERVICE_NAMES):
                resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            names: set[str] = set()
            async for resp in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                    list_services="")])):
                names |= {s.name for s in resp.list_services_response.service}
            assert {"memtopo.v1.Controller", "memtopo.v1.ControllerAdmin", "grpc.health.v1.Health"} <= names
    serve(body)


def test_stop_ends_agent_links_with_unavailable_and_health_goes_not_serving() -> None:
    async def main() -> None:
        running = await start_controller("127.0.0.1:0")
        addr = f"127.0.0.1:{running.port}"
        a = SimAgent(addr)
        await a.join("n1", topo(1, "fp1"))
        stopping = asyncio.ensure_future(running.stop(1.0))
        assert await a.ended() == SC.UNAVAILABLE
        await stopping
        await a.close()

    asyncio.run(main())


@pytest.mark.parametrize("address", ["9470", "host:", ":9470", "host:99999", "::1:9470", "host:port"])
def test_malformed_listen_addresses_are_typed_errors(address: str) -> None:
    with pytest.raises(ControllerConfigError):
        check_address(address)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.text(max_size=300), st.text(max_size=40), st.integers(0, 2**64 - 1))
def test_any_hello_is_accepted_or_refused_with_a_protocol_error(name: str, instance: str, fp: str, gen: int) -> None:
    fleet = Fleet()
    try:
        c = fleet.connect(Hello(name, instance, generation=gen, fingerprint=fp), "p")
    except ProtocolError:
        assert len(fleet) == 0
        return
    assert c.reply == RequestSnapshot("unknown node") and fleet.node_of(c.session) == name


def test_garbage_bytes_on_a_link_fail_that_stream_only() -> None:
    async def body(running: RunningController, addr: str) -> None:
        async with grpc.aio.insecure_channel(addr) as channel:
            raw = channel.stream_stream("/memtopo.v1.Controller/Connect",
                                        request_serializer=lambda b: b, response_deserializer=lambda b: b)
            call = raw()
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call.write(b"\xff\xff\xff\x07garbage")
                await call.read()
            assert await call.code() not in (SC.OK, None)
        a = SimAgent(addr)
        await a.join("after-garbage", topo(1, "fp1"))
        assert [n.node_name for n in running.fleet.nodes()] == ["after-garbage"]
        await a.close()
    serve(body)


def test_plaintext_is_refused_off_loopback() -> None:
    async def main() -> None:
        with pytest.raises(ControllerConfigError, match="plaintext"):
            await start_controller("0.0.0.0:0")

    asyncio.run(main())


def test_a_busy_port_is_a_typed_error() -> None:
    async def main() -> None:
        running = await start_controller("127.0.0.1:0")
        try:
            with pytest.raises(ControllerConfigError, match="cannot listen"):
                await start_controller(f"127.0.0.1:{running.port}")
        finally:
            await running.stop(0)

    asyncio.run(main())


# ---- TLS ---------------------------------------------------------------------------------------------
def test_mtls_controller_accepts_agents_with_a_client_certificate_only(pki: dict[str, str]) -> None:
    from memtopo.controller.server import server_credentials

    async def main() -> None:
        creds = server_credentials(pki["server"], pki["server_key"], pki["ca"])
        running = await start_controller("127.0.0.1:0", creds)
        addr = f"localhost:{running.port}"
        ca = Path(pki["ca"]).read_bytes()
        try:
            good = grpc.ssl_channel_credentials(ca, Path(pki["client_key"]).read_bytes(),
                                                Path(pki["client"]).read_bytes())
            a = SimAgent(addr, good)
            await a.join("n1", topo(1, "fp1"))
            await a.close()
            anonymous = SimAgent(addr, grpc.ssl_channel_credentials(ca))
            with contextlib.suppress(grpc.aio.AioRpcError):  # the handshake fails: no client certificate
                await anonymous.hello("n2")
            assert await anonymous.ended() == SC.UNAVAILABLE
            await anonymous.close()
            assert [n.node_name for n in running.fleet.nodes()] == ["n1"]
        finally:
            await running.stop(0)

    asyncio.run(main())


def test_missing_certificate_file_is_a_typed_error(tmp_path: Path) -> None:
    from memtopo.controller.server import server_credentials

    with pytest.raises(ControllerConfigError, match=r"nope\.pem"):
        server_credentials(str(tmp_path / "nope.pem"), str(tmp_path / "nope.key"))


# ---- interop with the agent's own link ---------------------------------------------------------------
def test_the_agents_controller_link_delivers_each_new_generation() -> None:
    async def body(running: RunningController, addr: str) -> None:
        state = TopologyState()
        state.publish(topo(0, "fp-a", name="real"))

        async def plans(p: planpb.BindingPlan, dry_run: bool) -> planpb.PlanResult:
            return P(plan_id=p.plan_id, state=P.STATE_DRY_RUN if dry_run else P.STATE_APPLIED)

        link = ControllerLink(addr, state, "real", "boot-1", plans, heartbeat_seconds=0.2,
                              backoff=Backoff(0.05, 0.2))
        task = asyncio.create_task(link.run())
        try:
            await wait_until(lambda: running.fleet.held_count() == 1)
            assert running.fleet.nodes()[0].generation == 1
            state.publish(topo(0, "fp-b", name="real"))
            await wait_until(lambda: running.fleet.nodes()[0].fingerprint == "fp-b")
            assert running.fleet.nodes()[0].generation == 2
            assert state.current is not None and running.fleet.topology_bytes("real") == state.current.payload
            async with admin(addr) as stub:
                result = await stub.SubmitPlan(apb.SubmitPlanRequest(node_name="real", plan=plan("interop"),
                                                                     timeout_seconds=60))
            assert result.state == P.STATE_APPLIED and result.node_name == "real"
        finally:
            await link.stop()
            await asyncio.wait_for(task, 30)
        await wait_until(lambda: not running.fleet.nodes()[0].connected)
    serve(body)


def test_a_result_changed_on_the_node_reaches_the_controller_at_the_next_heartbeat() -> None:
    """A plan applied through the controller, then rolled back on the node (`memtopo rollback`
    rewrites the stored result): the link reads the stored results of the plans it reported at each
    heartbeat and sends the one whose state changed."""
    async def body(running: RunningController, addr: str) -> None:
        state = TopologyState()
        state.publish(topo(0, "fp-a", name="real"))
        stored: dict[str, planpb.PlanResult] = {}

        async def plans(p: planpb.BindingPlan, dry_run: bool) -> planpb.PlanResult:
            stored[p.plan_id] = P(plan_id=p.plan_id, state=P.STATE_APPLIED)
            return stored[p.plan_id]

        async def stored_result(plan_id: str) -> planpb.PlanResult | None:
            return stored.get(plan_id)

        link = ControllerLink(addr, state, "real", "boot-1", plans, heartbeat_seconds=0.2,
                              backoff=Backoff(0.05, 0.2), stored_result=stored_result)
        task = asyncio.create_task(link.run())
        try:
            await wait_until(lambda: running.fleet.held_count() == 1)
            async with admin(addr) as stub:
                result = await stub.SubmitPlan(apb.SubmitPlanRequest(node_name="real", plan=plan("undone"),
                                                                     timeout_seconds=60))
            assert result.state == P.STATE_APPLIED
            assert running.fleet.result("real", "undone").state == P.STATE_APPLIED  # type: ignore[union-attr]
            stored["undone"] = P(plan_id="undone", state=P.STATE_ROLLED_BACK, message="rolled back by hand")
            await wait_until(lambda: running.fleet.result("real", "undone").state  # type: ignore[union-attr]
                             == P.STATE_ROLLED_BACK)
            assert running.fleet.result("real", "undone").message == "rolled back by hand"  # type: ignore[union-attr]
        finally:
            await link.stop()
            await asyncio.wait_for(task, 30)
    serve(body)


class DyingController(agent_pb2_grpc.ControllerServicer):
    """A controller that ends its first `dying` streams the way a crashing one does, in turn: at once
    (the agent never hears from it); right after asking for a snapshot, so the agent's next write meets
    a call that is already over (whether the agent read the request first is a race); or once the
    agent's snapshot arrived, so the agent surely heard it (those sessions must all be counted)."""

    def __init__(self, dying: int) -> None:
        self.dying = dying
        self.calls = 0
        self.heard = 0  # dying sessions in which the agent provably read our message

    async def Connect(self, request_iterator: AsyncIterator[apb.AgentMessage],  # noqa: N802 - the RPC's name
                      context: grpc.aio.ServicerContext[apb.AgentMessage, apb.ControllerMessage],
                      ) -> AsyncIterator[apb.ControllerMessage]:
        self.calls += 1
        if self.calls <= self.dying:
            if self.calls % 3 == 1:
                await context.abort(SC.UNAVAILABLE, "controller going away")
            yield apb.ControllerMessage(snapshot_request=apb.SnapshotRequest(reason="unknown node"))
            if self.calls % 3 == 0:
                async for msg in request_iterator:
                    if msg.WhichOneof("message") == "snapshot":  # sent only after it read our request
                        self.heard += 1
                        break
            await context.abort(SC.UNAVAILABLE, "controller going away")
        async for _ in request_iterator:
            yield apb.ControllerMessage(ack=apb.ControllerAck())


def test_the_link_outlives_a_controller_that_dies_mid_session() -> None:
    """Regression: a write on a call the controller had just ended raised InvalidStateError out of
    ControllerLink.run, and the node stayed off the controller until the agent restarted."""
    async def main() -> None:
        controller = DyingController(dying=120)
        server = grpc.aio.server()
        agent_pb2_grpc.add_ControllerServicer_to_server(controller, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        state = TopologyState()
        state.publish(topo(0, "fp-a", name="n1"))

        async def plans(p: planpb.BindingPlan, dry_run: bool) -> planpb.PlanResult:
            raise AssertionError("no plan is sent")

        link = ControllerLink(f"127.0.0.1:{port}", state, "n1", "boot-1", plans, backoff=Backoff(0.001, 0.002))
        task = asyncio.create_task(link.run())
        try:
            await wait_until(lambda: task.done() or (controller.calls > controller.dying
                                                     and link.link_state == LinkState.CONNECTED), timeout=30)
            assert not task.done(), task.exception()
            # Every session the controller answered was counted (the last, live one too), and none it
            # ended unheard: counts of what happened, not of how much fitted in a time window.
            assert controller.heard == controller.dying // 3
            assert controller.heard + 1 <= link.sessions <= controller.calls - (controller.dying + 2) // 3
        finally:
            await link.stop()
            await asyncio.wait_for(task, 30)
            await server.stop(0)
    asyncio.run(main())




@pytest.fixture(scope="module")
def real_topology() -> pb.MemoryTopology:
    """A discovered 2-node machine (hwloc's 32em64t capture), so the text view has real content."""
    t = discover(ProbeContext.at_root(hwloc_root("32em64t-2n8c+dax+nvme+mic+dimms")))
    t.node_name, t.generation = "gpu-1", 7
    return t


@pytest.fixture(scope="module")
def live(real_topology: pb.MemoryTopology) -> Iterator[Background]:
    bg = Background()
    bg.run(answering_agent(bg, "gpu-1", real_topology))
    bg.run(answering_agent(bg, "gpu-2", topo(3, "f" * 64, numa=8, accel=0)))
    try:
        yield bg
    finally:
        bg.close()


Events = list[MutableMapping[str, Any]]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str], events: Events | None = None) -> tuple[int, str, str]:
    """The CLI's exit code, stdout and stderr; the controller's log events (its thread logs to the
    same stdout) are diverted into ``events``."""
    with structlog.testing.capture_logs() as logs:
        rc = memtopo_main(["controller", *argv])
    if events is not None:
        events.extend(logs)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_nodes_table_and_json(live: Background, capsys: pytest.CaptureFixture[str],
                                  real_topology: pb.MemoryTopology) -> None:
    rc, out, _ = run_cli(["nodes", "--addr", live.addr], capsys)
    assert rc == 0
    header, row1, row2 = out.splitlines()
    assert header.split()[:3] == ["NODE", "LINK", "GENERATION"]
    assert row1.split()[:6] == ["gpu-1", "connected", "7", real_topology.fingerprint[:12], "2", "1"]
    assert row2.split()[:6] == ["gpu-2", "connected", "3", "f" * 12, "8", "0"]
    rc, out, _ = run_cli(["nodes", "--addr", live.addr, "--format", "json"], capsys)
    nodes = json.loads(out)["nodes"]
    assert [(n["node_name"], n["generation"], n["connected"]) for n in nodes] == \
        [("gpu-1", "7", True), ("gpu-2", "3", True)]


def test_cli_topology_text_and_json(live: Background, capsys: pytest.CaptureFixture[str],
                                    real_topology: pb.MemoryTopology) -> None:
    from memtopo.cli.render import render

    rc, out, _ = run_cli(["topology", "gpu-1", "--addr", live.addr], capsys)
    assert rc == 0 and out == render(real_topology)
    rc, out, _ = run_cli(["topology", "gpu-1", "--addr", live.addr, "--format", "json"], capsys)
    from google.protobuf import json_format

    assert rc == 0 and json_format.Parse(out, pb.MemoryTopology()) == real_topology
    rc, _, err = run_cli(["topology", "nobody", "--addr", live.addr], capsys)
    assert rc == cli.EXIT_RPC and "NOT_FOUND" in err and "nobody" in err


def test_cli_submit_and_result(live: Background, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from memtopo.protojson import to_json

    ok = tmp_path / "ok.json"
    ok.write_text(to_json(plan("cli-ok")))
    events: Events = []
    rc, out, _ = run_cli(["submit", "gpu-2", str(ok), "--addr", live.addr], capsys, events)
    assert rc == 0 and out.startswith("plan cli-ok: APPLIED — sim gpu-2")
    logged = {e["event"]: e for e in events}
    assert {k: logged["plan_submitted"][k] for k in ("node", "plan_id", "dry_run")} == \
        {"node": "gpu-2", "plan_id": "cli-ok", "dry_run": False}
    assert {k: logged["plan_result"][k] for k in ("node", "plan_id", "state")} == \
        {"node": "gpu-2", "plan_id": "cli-ok", "state": "STATE_APPLIED"}
    rc, out, _ = run_cli(["submit", "gpu-2", str(ok), "--dry-run", "--addr", live.addr], capsys)
    assert rc == 0 and "DRY_RUN" in out.splitlines()[0]
    bad = tmp_path / "bad.json"
    bad.write_text(to_json(plan("cli-bad", "reject")))
    rc, out, _ = run_cli(["submit", "gpu-1", str(bad), "--addr", live.addr, "--timeout", "5"], capsys)
    assert rc == cli.EXIT_NOT_APPLIED and "REJECTED" in out and "a1: no such pid" in out
    rc, out, _ = run_cli(["result", "gpu-2", "cli-ok", "--addr", live.addr, "--format", "json"], capsys)
    assert rc == 0 and '"state": "STATE_APPLIED"' in out and '"node_name": "gpu-2"' in out
    rc, _, err = run_cli(["result", "gpu-2", "never", "--addr", live.addr], capsys)
    assert rc == cli.EXIT_RPC and "NOT_FOUND" in err
    rc, _, err = run_cli(["submit", "gpu-2", str(tmp_path / "missing.json"), "--addr", live.addr], capsys)
    assert rc == EXIT_USAGE and "missing.json" in err
    rc, _, err = run_cli(["submit", "nobody", str(ok), "--addr", live.addr], capsys)
    assert rc == cli.EXIT_RPC and "NOT_FOUND" in err


def test_cli_reports_an_unreachable_controller(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = run_cli(["nodes", "--addr", f"127.0.0.1:{port}"], capsys)
    assert rc == cli.EXIT_RPC and "UNAVAILABLE" in err
    rc, _, err = run_cli(["nodes", "--addr", "nonsense"], capsys)
    assert rc == EXIT_USAGE and "nonsense" in err and "HOST:PORT" in err


def test_cli_parser_defaults_to_serve_and_keeps_options_given_before_serve() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="memtopo")
    cli.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["controller"])
    assert args.func.__name__ == "cmd_serve" and args.listen == "127.0.0.1:9470"
    args = parser.parse_args(["controller", "--listen", "127.0.0.1:1", "serve"])
    assert args.func.__name__ == "cmd_serve" and args.listen == "127.0.0.1:1"
    args = parser.parse_args(["controller", "serve", "--listen", "[::1]:2"])
    assert args.listen == "[::1]:2"
    args = parser.parse_args(["controller", "submit", "n", "-", "--dry-run", "--timeout", "3"])
    assert (args.func.__name__, args.node, args.plan, args.dry_run, args.timeout) == ("cmd_submit", "n", "-", True, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["controller", "submit", "n", "-", "--timeout", "0"])


def test_cli_serve_refuses_plaintext_off_loopback(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["serve", "--listen", "0.0.0.0:0"], capsys)
    assert rc == EXIT_USAGE and "plaintext" in err
    rc, _, err = run_cli(["serve", "--tls-cert", "x.pem"], capsys)
    assert rc == EXIT_USAGE and "--tls-key" in err


def test_cli_serve_process_stops_cleanly_on_sigterm(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "memtopo.cli", "controller", "serve",
                             "--listen", f"127.0.0.1:{port}", "--http", ""],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.communicate()
            rc, out, _ = run_cli(["nodes", "--addr", f"127.0.0.1:{port}"], capsys)
            if rc == 0:
                break
            assert time.monotonic() < deadline, "controller did not come up"
            time.sleep(0.1)
        assert out == "no nodes\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert "controller_listening" in out + err and "controller_stopped" in out + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ---- fleet placement ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerator_fleet() -> Iterator[tuple[Background, list[FleetNode]]]:
    """Two Ascend 910 x8 nodes (NPU5 busy on the second), a P800 node, and a 910 node that left."""
    nodes = [node("910", "a910-1"), node("910", "a910-2", npu(5, running="true", processes="77")),
             node("p800", "p800-1"), node("910", "a910-gone")]
    bg = Background()
    for n in nodes:
        assert n.topology is not None
        n.topology.generation = 1
        bg.run(answering_agent(bg, n.name, n.topology))
    gone = bg.agents.pop()
    bg.run(gone.close())
    bg.run(wait_until(lambda: not any(i.connected for i in bg.running.fleet.nodes() if i.node_name == "a910-gone")))
    try:
        yield bg, [*nodes[:3], FleetNode("a910-gone", nodes[3].topology, connected=False)]
    finally:
        bg.close()


def place_cli(bg: Background, policy: str, request: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path,
              events: Events | None = None) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "request.json"
    path.write_text(request if isinstance(request, str) else json.dumps(request))
    rc, out, _ = run_cli(["place", policy, "--request", str(path), "--addr", bg.addr], capsys, events)
    return rc, json.loads(out)


@pytest.mark.parametrize(("policy", "request_obj", "chosen"), [
    ("hccs", {"request": 4, "allocated": {"a910-1": [0]}}, ["a910-1"]),
    ("hccs", {"request": 2, "node_names": ["a910-2", "p800-1"]}, ["a910-2"]),
    ("xpu", {"request": 2, "allocated": {"p800-1": [4]}}, "p800-1"),
])
def test_cli_place_runs_the_fleet_policy_on_the_held_topologies(
        accelerator_fleet: tuple[Background, list[FleetNode]], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        policy: str, request_obj: dict[str, Any], chosen: Any) -> None:
    bg, nodes = accelerator_fleet
    events: Events = []
    rc, doc = place_cli(bg, policy, request_obj, capsys, tmp_path, events)
    assert rc == 0 and doc["chosen"] == chosen
    # The controller's answer is the planner's, over what the agents sent: nothing lost on the way.
    assert doc == fleet_decide(policy, request_obj, nodes)
    (placed,) = [e for e in events if e["event"] == "fleet_placed"]
    assert (placed["policy"], placed["nodes"], placed["error"]) == (policy, 4, None)


def test_cli_place_memory_placement_and_skipped_nodes(accelerator_fleet: tuple[Background, list[FleetNode]],
                                                      capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bg, _ = accelerator_fleet
    rc, doc = place_cli(bg, "place", {"cpus": 8, "memory_gb": 16, "workload": "cpu-heavy"}, capsys, tmp_path)
    assert rc == 0 and doc["policy"] == "place"
    assert {n["node"] for n in doc["nodes"]} == {"a910-1", "a910-2", "p800-1"}
    assert doc["skipped"] == [{"name": "a910-gone", "reason": "not connected: its topology may be stale"}]
    assert all(n["fits"] for n in doc["nodes"]) and doc["chosen"] == doc["nodes"][0]["node"]


@pytest.mark.parametrize(("policy", "request_text", "rc", "code", "fragment"), [
    ("hccs", '{"request": 3}', 2, "invalid_request", "request: 3"),
    ("hccs", "{oops", 2, "invalid_request", "not JSON"),
    ("xpu", '{"request": 1, "allocated": {"nobody": [0]}}', 2, "invalid_request", "'nobody'"),
    # 2 pods of 8 need two whole free nodes; only a910-1 is (a910-2 runs a process on NPU5).
    ("hccs", '{"request": 16}', 1, "unsatisfiable", "1 have them"),
])
def test_cli_place_errors_follow_the_plan_contract(
        accelerator_fleet: tuple[Background, list[FleetNode]], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        policy: str, request_text: str, rc: int, code: str, fragment: str) -> None:
    got_rc, doc = place_cli(accelerator_fleet[0], policy, request_text, capsys, tmp_path)
    assert got_rc == rc and doc["error"]["code"] == code and fragment in doc["error"]["message"]


def test_cli_place_against_no_controller_is_an_rpc_failure(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "r.json"
    path.write_text('{"request": 1}')
    rc, out, _ = run_cli(["place", "xpu", "--request", str(path), "--addr", f"127.0.0.1:{port}"], capsys)
    doc = json.loads(out)
    assert rc == 3 and doc["error"]["code"] == "rpc_failed" and "UNAVAILABLE" in doc["error"]["message"]
