"""NodeAgent over a real grpc.aio server on a Unix socket, with the apply engine on a fake host."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from memtopo.agent.node_service import NodeAgentService, PlanRunner
from memtopo.agent.state import TopologyState
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import agent_pb2_grpc
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests import apply_fakes as fk

if TYPE_CHECKING:
    from memtopo.v1.agent_pb2_grpc import NodeAgentAsyncStub


def topo(name: str, fingerprint: str) -> pb.MemoryTopology:
    t = fk.topology()
    t.node_name = name
    t.fingerprint = fingerprint
    return t


Body = Callable[["NodeAgentAsyncStub", TopologyState, fk.FakeMachine], Awaitable[None]]


def run(tmp_path: Path, body: Body, deny: str | None = None, heartbeat: float = 30.0) -> None:
    async def main() -> None:
        m = fk.machine(tmp_path)
        state = TopologyState()
        runner = PlanRunner(m.engine())
        service = NodeAgentService(state, runner, lambda ctx: deny, heartbeat_seconds=heartbeat)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((service.handler(),))
        sock = tmp_path / "agent.sock"
        server.add_insecure_port(f"unix://{sock}")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
                await body(agent_pb2_grpc.NodeAgentStub(channel), state, m)
        finally:
            state.close()
            await server.stop(0.5)

    asyncio.run(main())


def test_get_topology_is_unavailable_until_the_first_discovery_then_serves_it(tmp_path: Path) -> None:
    async def body(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetTopology(apb.GetTopologyRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        state.publish(topo("n1", "a" * 64))
        got = await stub.GetTopology(apb.GetTopologyRequest())
        assert (got.node_name, got.generation, got.fingerprint) == ("n1", 1, "a" * 64)
        assert list(got.allowed_cpus) == list(fk.topology().allowed_cpus)

    run(tmp_path, body)


def test_publish_only_advances_the_generation_when_the_fingerprint_changes() -> None:
    async def main() -> None:
        state = TopologyState()
        assert state.publish(topo("n", "a")) is not None
        assert state.publish(topo("n", "a")) is None
        pub = state.publish(topo("n", "b"))
        assert pub is not None and pub.generation == 2 == state.generation
        assert pb.MemoryTopology.FromString(pub.payload).generation == 2

    asyncio.run(main())


def test_publish_sends_the_discovery_s_own_bytes_when_they_carry_the_next_generation() -> None:
    """The discovery child stamps the generation it would be published as and serializes once; those
    bytes are served as they are. Bytes of another generation are not: the message is encoded again."""
    async def main() -> None:
        state = TopologyState()
        first = topo("n", "a")
        first.generation = 1
        own = first.SerializeToString()
        pub = state.publish(first, own)
        assert pub is not None and pub.payload is own
        stale = topo("n", "b")
        stale.generation = 7  # not the next one (2)
        pub = state.publish(stale, stale.SerializeToString())
        assert pub is not None and pub.generation == 2
        assert pb.MemoryTopology.FromString(pub.payload).generation == 2

    asyncio.run(main())


def events(stub: NodeAgentAsyncStub, req: apb.WatchTopologyRequest) -> AsyncIterator[apb.TopologyEvent]:
    stream: AsyncIterator[apb.TopologyEvent] = stub.WatchTopology(req).__aiter__()
    return stream


async def _next(stream: AsyncIterator[apb.TopologyEvent]) -> apb.TopologyEvent:
    return await asyncio.wait_for(anext(stream), 30)


def test_a_rescan_finishing_while_the_first_snapshot_is_sent_is_still_told(tmp_path: Path) -> None:
    """A watcher that gets its snapshot and sends SIGHUP at once: the rescan can finish before the
    server's send of that snapshot has returned. Replayed here deterministically by publishing from
    inside the first send; the watcher must still get its "unchanged" event (not wait for a beat)."""
    async def body(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        state.publish(topo("n1", "a"))
        stream = events(stub, apb.WatchTopologyRequest())
        assert (await _next(stream)).WhichOneof("event") == "snapshot"
        again = await _next(stream)
        assert (again.WhichOneof("event"), again.generation) == ("unchanged", 1)

    original = NodeAgentService._send
    sends = 0

    async def send_then_rescan(self: NodeAgentService, context: grpc.aio.ServicerContext[bytes, bytes],
                               data: bytes) -> None:
        nonlocal sends
        await original(self, context, data)
        sends += 1
        if sends == 1:
            assert self.state.publish(topo("n1", "a")) is None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NodeAgentService, "_send", send_then_rescan)
        run(tmp_path, body, heartbeat=300.0)


def test_watch_sends_the_snapshot_then_each_new_generation(tmp_path: Path) -> None:
    async def body(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        state.publish(topo("n1", "a"))
        stream = events(stub, apb.WatchTopologyRequest())
        first = await _next(stream)
        assert first.WhichOneof("event") == "snapshot"
        assert (first.generation, first.snapshot.fingerprint, first.agent_instance_id) == (1, "a", state.instance_id)
        state.publish(topo("n1", "a"))  # same content, then new before the watcher runs: the new one
        state.publish(topo("n1", "b"))
        second = await _next(stream)
        assert (second.WhichOneof("event"), second.generation, second.snapshot.fingerprint) == ("snapshot", 2, "b")

    run(tmp_path, body)


def test_a_rescan_that_finds_the_same_topology_is_an_unchanged_event(tmp_path: Path) -> None:
    """SIGHUP with nothing changed: the watcher sees that the rescan happened, without a resend."""
    async def body(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        state.publish(topo("n1", "a"))
        stream = events(stub, apb.WatchTopologyRequest())
        assert (await _next(stream)).WhichOneof("event") == "snapshot"
        assert state.publish(topo("n1", "a")) is None  # the rescan: same fingerprint, no new generation
        again = await _next(stream)
        assert (again.WhichOneof("event"), again.generation, again.fingerprint) == ("unchanged", 1, "a")
        assert not again.HasField("snapshot")
        state.publish(topo("n1", "b"))
        assert (await _next(stream)).WhichOneof("event") == "snapshot"

    run(tmp_path, body)


def test_watch_resumes_without_a_resend_when_the_client_is_current(tmp_path: Path) -> None:
    async def body(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        state.publish(topo("n1", "a"))
        current = apb.WatchTopologyRequest(agent_instance_id=state.instance_id, generation=1, fingerprint="a")
        first = await _next(events(stub, current))
        assert first.WhichOneof("event") == "unchanged" and first.generation == 1
        # Another instance's generation 1 is not ours: full snapshot.
        other = apb.WatchTopologyRequest(agent_instance_id="old-agent", generation=1, fingerprint="a")
        assert (await _next(events(stub, other))).WhichOneof("event") == "snapshot"
        stale = apb.WatchTopologyRequest(agent_instance_id=state.instance_id, generation=1, fingerprint="x")
        assert (await _next(events(stub, stale))).WhichOneof("event") == "snapshot"

    run(tmp_path, body)


def test_watch_heartbeats_while_idle_and_says_closing_at_shutdown(tmp_path: Path) -> None:
    async def body(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        state.publish(topo("n1", "a"))
        stream = events(stub, apb.WatchTopologyRequest())
        await _next(stream)
        beat = await _next(stream)
        assert beat.WhichOneof("event") == "heartbeat" and beat.generation == 1 and not beat.HasField("snapshot")
        state.close()
        last = await _next(stream)
        assert last.WhichOneof("event") == "closing" and last.closing.reason
        with pytest.raises(StopAsyncIteration):
            await _next(stream)

    run(tmp_path, body, heartbeat=0.05)


def _pin_plan(plan_id: str) -> planpb.BindingPlan:
    return fk.plan(plan_id, fk.threads("pin", 100, [2, 3], all=True))


def test_apply_plan_runs_the_engine_once_per_plan_id(tmp_path: Path) -> None:
    async def body(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        state.publish(fk.topology())
        res = await stub.ApplyPlan(apb.ApplyPlanRequest(plan=_pin_plan("p1")))
        assert res.state == planpb.PlanResult.STATE_APPLIED
        assert m.kernel.masks[100] == {2, 3}
        calls = len(m.kernel.mutations())
        again = await stub.ApplyPlan(apb.ApplyPlanRequest(plan=_pin_plan("p1")))
        assert again.state == planpb.PlanResult.STATE_APPLIED and "seen before" in again.message
        assert len(m.kernel.mutations()) == calls  # not applied a second time
        stored = await stub.GetPlanResult(apb.GetPlanResultRequest(plan_id="p1"))
        assert stored.plan_id == "p1" and stored.state == planpb.PlanResult.STATE_APPLIED
        listed = await stub.ListPlans(apb.ListPlansRequest())
        assert [p.plan_id for p in listed.plans] == ["p1"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetPlanResult(apb.GetPlanResultRequest(plan_id="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    run(tmp_path, body)


def test_apply_plan_refuses_unauthorized_peers_and_stale_generations(tmp_path: Path) -> None:
    async def denied(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        state.publish(fk.topology())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ApplyPlan(apb.ApplyPlanRequest(plan=_pin_plan("p1")))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "uid 1000" in (err.value.details() or "")
        assert m.kernel.mutations() == []

    run(tmp_path, denied, deny="uid 1000 is not root and not in group memtopo")

    async def stale(stub: NodeAgentAsyncStub, state: TopologyState, m: fk.FakeMachine) -> None:
        state.publish(fk.topology())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ApplyPlan(apb.ApplyPlanRequest(plan=_pin_plan("p2"), expected_generation=7))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        ok = await stub.ApplyPlan(apb.ApplyPlanRequest(plan=_pin_plan("p2"), expected_generation=1, dry_run=True))
        assert ok.state == planpb.PlanResult.STATE_DRY_RUN

    (tmp_path / "b").mkdir()
    run(tmp_path / "b", stale)


def test_a_watcher_that_stops_reading_is_ended_and_never_queued_for(tmp_path: Path) -> None:
    """A client that opens WatchTopology and never reads: the event that cannot leave resets the
    stream after stall_seconds (its memory is freed), and the watcher slot is given back."""
    events: list[str] = []

    async def main() -> None:
        m = fk.machine(tmp_path)
        state = TopologyState()
        service = NodeAgentService(state, PlanRunner(m.engine()), lambda ctx: None, heartbeat_seconds=30.0,
                                   max_watchers=1, stall_seconds=1.0,
                                   events=lambda what, method, ctx: events.append(what))
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((service.handler(),))
        sock = tmp_path / "agent.sock"
        server.add_insecure_port(f"unix://{sock}")
        await server.start()
        big = "x" * (2 << 20)
        state.publish(topo(big, "0" * 64))
        try:
            async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
                stalled = agent_pb2_grpc.NodeAgentStub(channel).WatchTopology(apb.WatchTopologyRequest())
                await stalled.wait_for_connection()
                # New generations until one cannot leave: how much the client's grpc buffers before
                # its window is full varies (it grows its window while data flows).
                for generation in range(1, 30):
                    for _ in range(40):
                        if "watch_stalled" in events:
                            break
                        await asyncio.sleep(0.05)
                    if "watch_stalled" in events:
                        break
                    state.publish(topo(big, f"{generation:064d}"))
                for _ in range(1200):  # the stall timer: 1 s when idle, more on a busy machine
                    if "watch_stalled" in events:
                        break
                    await asyncio.sleep(0.05)
                assert events == ["watch_stalled"]
                for _ in range(1200):  # the stream ends right after the event
                    if service.watchers == 0:
                        break
                    await asyncio.sleep(0.05)
                assert service.watchers == 0
                stalled.cancel()
            # The slot is free again: a reading watcher gets the newest generation.
            state.publish(topo("small", "f" * 64))
            async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
                fresh = agent_pb2_grpc.NodeAgentStub(channel).WatchTopology(apb.WatchTopologyRequest())
                first = await asyncio.wait_for(fresh.read(), 60)
                assert isinstance(first, apb.TopologyEvent) and first.fingerprint == "f" * 64
                fresh.cancel()
        finally:
            state.close()
            await server.stop(0.5)

    asyncio.run(main())


def test_garbage_requests_are_invalid_argument_and_reported_once_each(tmp_path: Path) -> None:
    events: list[tuple[str, str]] = []

    async def main() -> None:
        m = fk.machine(tmp_path)
        state = TopologyState()
        service = NodeAgentService(state, PlanRunner(m.engine()), lambda ctx: None,
                                   events=lambda what, method, ctx: events.append((what, method)))
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((service.handler(),))
        sock = tmp_path / "agent.sock"
        server.add_insecure_port(f"unix://{sock}")
        await server.start()
        state.publish(topo("n", "a" * 64))
        try:
            async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
                for method in ("GetTopology", "ApplyPlan", "GetPlanResult", "ListPlans", "WatchTopology"):
                    path = f"/memtopo.v1.NodeAgent/{method}"
                    garbage = b"\x0a\xff\xff\xff\xff\x0f"
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        if method == "WatchTopology":
                            stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(path)
                            await stream(garbage, timeout=10).read()
                        else:
                            unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(path)
                            await unary(garbage, timeout=10)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        finally:
            state.close()
            await server.stop(0.5)

    asyncio.run(main())
    assert events == [("undecodable", m) for m in ("GetTopology", "ApplyPlan", "GetPlanResult", "ListPlans",
                                                   "WatchTopology")]
