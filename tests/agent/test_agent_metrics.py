"""AgentMetrics and its gRPC interceptor, read back the way Prometheus reads them: the text exposition
parsed with prometheus_client's own parser. The interceptor runs in a real grpc.aio server on a Unix
socket with methods of every shape (unary, server stream, client stream, bidi; async and sync)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from memtopo.agent.metrics import DISCOVERY_BUCKETS, PLAN_OUTCOMES, AgentMetrics
from memtopo.discovery.discover import discover
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb
from tests.fixtures import lab_root

Labels = tuple[tuple[str, str], ...]


def samples(m: AgentMetrics) -> dict[str, dict[Labels, float]]:
    """Sample name → {sorted labels → value}, from the rendered exposition."""
    body, _ = m.render()
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(m: AgentMetrics, name: str, **labels: str) -> float | None:
    return samples(m).get(name, {}).get(tuple(sorted(labels.items())))


# ---- plain metrics --------------------------------------------------------------------------------

def test_fresh_metrics_expose_zeroed_outcomes_and_a_disconnected_link() -> None:
    m = AgentMetrics()
    for outcome in ("ok", "error"):
        assert value(m, "memtopo_discoveries_total", outcome=outcome) == 0
    for outcome in PLAN_OUTCOMES:
        assert value(m, "memtopo_plans_total", outcome=outcome) == 0
    assert value(m, "memtopo_controller_link_state", state="disconnected") == 1
    assert value(m, "memtopo_controller_link_state", state="connected") == 0
    # No topology yet: no fingerprint series at all rather than an empty one.
    assert "memtopo_topology_fingerprint_info" not in samples(m)
    assert not any(name.endswith("_created") for name in samples(m))


def test_content_type_is_the_classic_text_format() -> None:
    _, content_type = AgentMetrics().render()
    assert content_type.startswith("text/plain; version=0.0.4")


def test_each_agent_metrics_has_its_own_registry() -> None:
    a, b = AgentMetrics(), AgentMetrics()
    a.observe_discovery(0.1, "ok")
    assert value(a, "memtopo_discoveries_total", outcome="ok") == 1
    assert value(b, "memtopo_discoveries_total", outcome="ok") == 0


def test_discovery_histogram_buckets_and_outcomes() -> None:
    m = AgentMetrics()
    m.observe_discovery(0.003, "ok")
    m.observe_discovery(2.0, "ok")
    m.observe_discovery(45.0, "error")
    s = samples(m)
    buckets = s["memtopo_discovery_duration_seconds_bucket"]
    assert buckets[(("le", "0.005"),)] == 1
    assert buckets[(("le", "1.0"),)] == 1
    assert buckets[(("le", "2.5"),)] == 2
    assert buckets[(("le", "30.0"),)] == 2
    assert buckets[(("le", "+Inf"),)] == 3
    assert {float(le) for ((_, le),) in buckets if le != "+Inf"} == set(DISCOVERY_BUCKETS)
    assert s["memtopo_discovery_duration_seconds_sum"][()] == pytest.approx(47.003)
    assert s["memtopo_discoveries_total"] == {(("outcome", "ok"),): 2, (("outcome", "error"),): 1}


def test_discovery_outcome_must_be_ok_or_error() -> None:
    with pytest.raises(ValueError, match="ok or error"):
        AgentMetrics().observe_discovery(1.0, "fine")  # type: ignore[arg-type]


def test_topology_generation_fingerprint_and_sources_from_a_lab_capture() -> None:
    """A real discovered topology (numa-vm lab capture): ok, degraded and unavailable sources."""
    topo = discover(ProbeContext.at_root(lab_root("dual-socket-cxl")))
    topo.generation = 7
    m = AgentMetrics()
    m.set_topology(topo)
    s = samples(m)
    assert s["memtopo_topology_generation"][()] == 7
    assert s["memtopo_topology_fingerprint_info"] == {(("fingerprint", topo.fingerprint),): 1}
    names = {"ok": pb.SOURCE_STATE_OK, "degraded": pb.SOURCE_STATE_DEGRADED,
             "unavailable": pb.SOURCE_STATE_UNAVAILABLE}
    status = s["memtopo_source_status"]
    assert len(topo.sources) >= 5
    # The capture has all three kinds, so each row of the enum pattern is exercised.
    assert {src.state for src in topo.sources} >= set(names.values())
    for src in topo.sources:
        for word, state in names.items():
            assert status[(("source", src.source), ("status", word))] == (1 if src.state == state else 0)
    # Exactly one status at 1 per source.
    assert sum(status.values()) == len(topo.sources)


def test_sources_that_disappear_leave_the_metrics_and_fingerprint_is_replaced() -> None:
    m = AgentMetrics()
    first = pb.MemoryTopology(generation=1, fingerprint="aa", sources=[
        pb.SourceStatus(source="hwloc", state=pb.SOURCE_STATE_OK),
        pb.SourceStatus(source="sysfs.cxl", state=pb.SOURCE_STATE_DEGRADED)])
    m.set_topology(first)
    second = pb.MemoryTopology(generation=2, fingerprint="bb", sources=[
        pb.SourceStatus(source="hwloc", state=pb.SOURCE_STATE_DEGRADED)])
    m.set_topology(second)
    s = samples(m)
    assert s["memtopo_topology_fingerprint_info"] == {(("fingerprint", "bb"),): 1}
    assert s["memtopo_topology_generation"][()] == 2
    assert {dict(k)["source"] for k in s["memtopo_source_status"]} == {"hwloc"}
    assert s["memtopo_source_status"][(("source", "hwloc"), ("status", "degraded"))] == 1
    assert s["memtopo_source_status"][(("source", "hwloc"), ("status", "ok"))] == 0


def test_link_state_is_one_hot_and_reconnects_count() -> None:
    m = AgentMetrics()
    m.set_link_state("connecting")
    m.set_link_state("connected")
    m.count_reconnect()
    m.count_reconnect()
    s = samples(m)
    assert s["memtopo_controller_link_state"] == {
        (("state", "disconnected"),): 0, (("state", "connecting"),): 0, (("state", "connected"),): 1}
    assert s["memtopo_controller_reconnects_total"][()] == 2
    assert m.link_state == "connected"


def test_unknown_link_state_is_refused_and_changes_nothing() -> None:
    m = AgentMetrics()
    m.set_link_state("connected")
    with pytest.raises(ValueError, match="unknown state up"):
        m.set_link_state("up")  # type: ignore[arg-type]
    assert m.link_state == "connected"


@pytest.mark.parametrize(("state", "outcome"), [
    (planpb.PlanResult.STATE_APPLIED, "applied"),
    (planpb.PlanResult.STATE_UNCHANGED, "unchanged"),
    (planpb.PlanResult.STATE_REJECTED, "rejected"),
    (planpb.PlanResult.STATE_ROLLED_BACK, "rolled_back"),
    (planpb.PlanResult.STATE_FAILED, "failed"),
    (planpb.PlanResult.STATE_DRY_RUN, "dry_run"),
    (planpb.PlanResult.STATE_UNSPECIFIED, "failed"),
])
def test_plan_results_count_by_outcome(state: planpb.PlanResult.State.ValueType, outcome: str) -> None:
    m = AgentMetrics()
    m.observe_plan(planpb.PlanResult(plan_id="p1", state=state))
    plans = samples(m)["memtopo_plans_total"]
    assert plans[(("outcome", outcome),)] == 1
    assert sum(plans.values()) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=30), st.integers(min_value=-5, max_value=40)), max_size=8),
       st.text(max_size=80), st.integers(min_value=0, max_value=2**64 - 1),
       st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_garbage_topologies_and_results_never_break_the_exposition(
        sources: list[tuple[str, int]], fingerprint: str, generation: int, plan_state: int) -> None:
    """Any source name (quotes, newlines, unicode), unknown enum numbers and any fingerprint render
    to an exposition that parses back to the same values."""
    topo = pb.MemoryTopology(generation=generation, fingerprint=fingerprint)
    for name, state in sources:
        topo.sources.add(source=name, state=state)
    m = AgentMetrics(process_metrics=False)
    m.set_topology(topo)
    m.observe_plan(planpb.PlanResult(state=plan_state))  # type: ignore[arg-type]
    s = samples(m)
    assert s["memtopo_topology_fingerprint_info"] == {(("fingerprint", fingerprint),): 1}
    last = {name: state for name, state in sources}
    status = s.get("memtopo_source_status", {})
    assert {dict(k)["source"] for k in status} == set(last)
    known = {1: "ok", 2: "degraded", 3: "unavailable"}
    for name, state in last.items():
        assert status[(("source", name), ("status", known.get(state, "unspecified")))] == 1
    assert sum(s["memtopo_plans_total"].values()) == 1


# ---- the interceptor on a real grpc.aio server ----------------------------------------------------

SERVICE = "test.Probe"
STREAM_LEN = 3


class Probe:
    """Methods of every shape, each ending a known way. Requests and responses are raw bytes."""

    def __init__(self) -> None:
        self.inner_closed = asyncio.Event()
        self.stream_started = asyncio.Event()

    async def ok(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return b"ok:" + req

    async def not_found(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await ctx.abort(grpc.StatusCode.NOT_FOUND, "no such plan")
        raise AssertionError("unreachable")

    async def set_code(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        ctx.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        ctx.set_details("bad request")
        return b""

    async def crash(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        raise RuntimeError("bug")

    async def crash_with_code(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        ctx.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)  # grpc sends this code, not UNKNOWN
        raise RuntimeError("bug")

    async def slow(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await asyncio.sleep(10)
        return b""

    def sync_ok(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        assert threading.current_thread() is not threading.main_thread()
        return b"sync"

    def sync_denied(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        ctx.abort(grpc.StatusCode.PERMISSION_DENIED, "not in group")
        raise AssertionError("unreachable")

    def sync_crash_with_code(self, req: bytes, ctx: grpc.ServicerContext) -> bytes:
        ctx.set_code(grpc.StatusCode.ABORTED)
        raise RuntimeError("bug")

    async def watch(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
        for i in range(STREAM_LEN):
            yield b"%d" % i

    async def watch_abort(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
        yield b"first"
        await ctx.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")

    async def watch_forever(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
        try:
            yield b"snapshot"
            self.stream_started.set()
            while True:
                await asyncio.sleep(3600)
                yield b"heartbeat"
        finally:
            self.inner_closed.set()

    async def watch_writer(self, req: bytes, ctx: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        for i in range(STREAM_LEN):
            await ctx.write(b"w%d" % i)

    def sync_watch(self, req: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        yield from (b"a", b"b")

    async def upload(self, reqs: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return b"".join([r async for r in reqs])

    async def connect(self, reqs: AsyncIterator[bytes],
                      ctx: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
        async for r in reqs:
            yield b"ack:" + r

    def handler(self) -> grpc.GenericRpcHandler:
        unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Ok": unary(self.ok), "NotFound": unary(self.not_found), "SetCode": unary(self.set_code),
            "Crash": unary(self.crash), "CrashWithCode": unary(self.crash_with_code), "Slow": unary(self.slow),
            "SyncOk": unary(self.sync_ok), "SyncDenied": unary(self.sync_denied),
            "SyncCrashWithCode": unary(self.sync_crash_with_code),
            "Watch": stream(self.watch), "WatchAbort": stream(self.watch_abort),
            "WatchForever": stream(self.watch_forever), "WatchWriter": stream(self.watch_writer),
            "SyncWatch": stream(self.sync_watch),
            "Upload": grpc.stream_unary_rpc_method_handler(self.upload),
            "Connect": grpc.stream_stream_rpc_method_handler(self.connect),
        })


Body = Callable[[grpc.aio.Channel, Probe], Awaitable[None]]


def serve(tmp_path: Path, metrics: AgentMetrics, body: Body) -> None:
    async def main() -> None:
        probe = Probe()
        pool = concurrent.futures.ThreadPoolExecutor(2)
        server = grpc.aio.server(migration_thread_pool=pool, interceptors=[metrics.interceptor()])
        server.add_generic_rpc_handlers([probe.handler()])
        address = f"unix://{tmp_path}/probe.sock"
        server.add_insecure_port(address)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await body(channel, probe)
        finally:
            await server.stop(None)
            pool.shutdown()
    asyncio.run(main())


def m_(name: str) -> str:
    return f"/{SERVICE}/{name}"


def uu(ch: grpc.aio.Channel, name: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    return ch.unary_unary(m_(name))


def us(ch: grpc.aio.Channel, name: str) -> grpc.aio.UnaryStreamMultiCallable[bytes, bytes]:
    return ch.unary_stream(m_(name))


def su(ch: grpc.aio.Channel, name: str) -> grpc.aio.StreamUnaryMultiCallable[bytes, bytes]:
    return ch.stream_unary(m_(name))


def ss(ch: grpc.aio.Channel, name: str) -> grpc.aio.StreamStreamMultiCallable[bytes, bytes]:
    return ch.stream_stream(m_(name))


async def expect_code(call: Awaitable[Any], code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code


def test_unary_calls_count_by_method_and_code(tmp_path: Path) -> None:
    m = AgentMetrics()

    async def body(ch: grpc.aio.Channel, probe: Probe) -> None:
        for _ in range(3):
            assert await uu(ch, "Ok")(b"x") == b"ok:x"
        await expect_code(uu(ch, "NotFound")(b""), grpc.StatusCode.NOT_FOUND)
        await expect_code(uu(ch, "SetCode")(b""), grpc.StatusCode.INVALID_ARGUMENT)
        await expect_code(uu(ch, "Crash")(b""), grpc.StatusCode.UNKNOWN)
        await expect_code(uu(ch, "CrashWithCode")(b""), grpc.StatusCode.RESOURCE_EXHAUSTED)
        await expect_code(uu(ch, "Slow")(b"", timeout=0.2), grpc.StatusCode.DEADLINE_EXCEEDED)
        assert await uu(ch, "SyncOk")(b"") == b"sync"
        await expect_code(uu(ch, "SyncDenied")(b""), grpc.StatusCode.PERMISSION_DENIED)
        await expect_code(uu(ch, "SyncCrashWithCode")(b""), grpc.StatusCode.ABORTED)
        await expect_code(uu(ch, "Nope")(b""), grpc.StatusCode.UNIMPLEMENTED)

    # serve() returns after server.stop(), so every handler (the cancelled slow one too) has finished.
    serve(tmp_path, m, body)
    s = samples(m)
    requests = s["memtopo_grpc_requests_total"]
    assert requests == {
        (("code", "OK"), ("method", m_("Ok"))): 3,
        (("code", "NOT_FOUND"), ("method", m_("NotFound"))): 1,
        (("code", "INVALID_ARGUMENT"), ("method", m_("SetCode"))): 1,
        (("code", "UNKNOWN"), ("method", m_("Crash"))): 1,
        (("code", "RESOURCE_EXHAUSTED"), ("method", m_("CrashWithCode"))): 1,
        (("code", "DEADLINE_EXCEEDED"), ("method", m_("Slow"))): 1,
        (("code", "OK"), ("method", m_("SyncOk"))): 1,
        (("code", "PERMISSION_DENIED"), ("method", m_("SyncDenied"))): 1,
        (("code", "ABORTED"), ("method", m_("SyncCrashWithCode"))): 1,
    }
    counts = s["memtopo_grpc_request_duration_seconds_count"]
    assert counts[(("method", m_("Ok")),)] == 3
    assert counts[(("method", m_("Slow")),)] == 1
    # The slow call lasted until its 0.2 s deadline, counted in seconds: a lower bound any machine
    # meets, and an upper one only a unit slip (milliseconds: 200) would break.
    sums = s["memtopo_grpc_request_duration_seconds_sum"]
    assert 0.15 <= sums[(("method", m_("Slow")),)] < 60
    assert 0 < sums[(("method", m_("Ok")),)] < 60


def test_server_streams_count_once_at_stream_end_and_stay_out_of_the_unary_histogram(tmp_path: Path) -> None:
    m = AgentMetrics()
    during: dict[str, float | None] = {}

    async def body(ch: grpc.aio.Channel, probe: Probe) -> None:
        assert [r async for r in us(ch, "Watch")(b"")] == [b"0", b"1", b"2"]
        assert [r async for r in us(ch, "WatchWriter")(b"")] == [b"w0", b"w1", b"w2"]
        assert [r async for r in us(ch, "SyncWatch")(b"")] == [b"a", b"b"]
        call = us(ch, "WatchAbort")(b"")
        assert await call.read() == b"first"
        assert await call.code() == grpc.StatusCode.UNAVAILABLE

        forever = us(ch, "WatchForever")(b"")
        assert await forever.read() == b"snapshot"
        await probe.stream_started.wait()
        during["open"] = value(m, "memtopo_grpc_streams_open", method=m_("WatchForever"))
        during["count"] = value(m, "memtopo_grpc_requests_total", method=m_("WatchForever"), code="CANCELLED")
        forever.cancel()
        # The inner generator's cleanup runs when the call ends, not when it is garbage collected.
        await asyncio.wait_for(probe.inner_closed.wait(), 30)

    serve(tmp_path, m, body)
    assert during == {"open": 1, "count": None}
    s = samples(m)
    requests = s["memtopo_grpc_requests_total"]
    assert requests[(("code", "OK"), ("method", m_("Watch")))] == 1
    assert requests[(("code", "OK"), ("method", m_("WatchWriter")))] == 1
    assert requests[(("code", "OK"), ("method", m_("SyncWatch")))] == 1
    assert requests[(("code", "UNAVAILABLE"), ("method", m_("WatchAbort")))] == 1
    assert requests[(("code", "CANCELLED"), ("method", m_("WatchForever")))] == 1
    assert value(m, "memtopo_grpc_streams_open", method=m_("WatchForever")) == 0
    streams = s["memtopo_grpc_stream_duration_seconds_count"]
    for name in ("Watch", "WatchWriter", "SyncWatch", "WatchAbort", "WatchForever"):
        assert streams[(("method", m_(name)),)] == 1
    assert "memtopo_grpc_request_duration_seconds_count" not in s


def test_client_and_bidi_streams_are_recorded(tmp_path: Path) -> None:
    m = AgentMetrics()

    async def body(ch: grpc.aio.Channel, probe: Probe) -> None:
        async def parts() -> AsyncIterator[bytes]:
            for p in (b"a", b"b", b"c"):
                yield p
        assert await su(ch, "Upload")(parts()) == b"abc"
        call = ss(ch, "Connect")()
        await call.write(b"hello")
        assert await call.read() == b"ack:hello"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK

    serve(tmp_path, m, body)
    requests = samples(m)["memtopo_grpc_requests_total"]
    assert requests == {(("code", "OK"), ("method", m_("Upload"))): 1,
                        (("code", "OK"), ("method", m_("Connect"))): 1}


def test_interceptor_wraps_each_method_handler_once() -> None:
    """The per-call cost is one dict lookup: the same handler object comes back for the same method,
    and a different handler for that method (a re-registered service) is wrapped anew."""
    m = AgentMetrics()
    interceptor = m.interceptor()

    async def ok(req: bytes, ctx: object) -> bytes:
        return req

    first: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(ok)
    second: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(ok)

    class Details(grpc.HandlerCallDetails):
        method = "/test.Probe/Ok"
        invocation_metadata = ()

    async def main() -> None:
        current = first

        async def continuation(_: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
            return current

        a = await interceptor.intercept_service(continuation, Details())
        b = await interceptor.intercept_service(continuation, Details())
        assert a is b and a is not first
        current = second
        c = await interceptor.intercept_service(continuation, Details())
        assert c is not a

        async def missing(_: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
            return None

        assert await interceptor.intercept_service(missing, Details()) is None

    asyncio.run(main())
