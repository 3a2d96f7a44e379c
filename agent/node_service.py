"""The NodeAgent gRPC service (grpc.aio).

GetTopology and WatchTopology answer with bytes cached per generation (see agent.state), so they
are registered through a generic handler whose response serializer is the identity; the other
methods use the generated message classes. Names and types still come from agent.proto, which is
what reflection and clients see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from memtopo.apply.engine import Engine
from memtopo.apply.errors import UnreadableJournalError
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import plan_pb2 as planpb

from .state import TopologyState

SERVICE_NAME = "memtopo.v1.NodeAgent"

# Returns None when the caller may change the host, else the reason it may not.
Authorizer = Callable[[grpc.aio.ServicerContext[bytes, bytes]], str | None]
PlanObserver = Callable[[planpb.PlanResult], None]
# (what happened, method, the call's context): see NodeAgentService.
ServiceEvents = Callable[[str, str, grpc.aio.ServicerContext[bytes, bytes]], None]


class PlanRunner:
    """Runs plans through the apply engine off the event loop and remembers them until done, so a
    graceful shutdown can wait for in-flight plans (which finish or roll back inside the engine)."""

    def __init__(self, engine: Engine, observe: PlanObserver | None = None) -> None:
        self.engine = engine
        self.observe = observe
        self._inflight: set[asyncio.Future[planpb.PlanResult]] = set()

    async def apply(self, plan: planpb.BindingPlan, dry_run: bool) -> planpb.PlanResult:
        fut = asyncio.ensure_future(asyncio.to_thread(self.engine.apply, plan, dry_run))
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        # Shielded: a client that goes away must not abandon a plan half-way through the engine.
        result = await asyncio.shield(fut)
        if self.observe is not None:
            self.observe(result)
        return result

    async def result(self, plan_id: str) -> planpb.PlanResult | None:
        return await asyncio.to_thread(self.engine.result, plan_id)

    async def list_plans(self) -> list[planpb.PlanResult]:
        return await asyncio.to_thread(self.engine.list_plans)

    async def drain(self) -> None:
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)


class NodeAgentService:
    """``max_watchers``: WatchTopology streams at once (more are refused with RESOURCE_EXHAUSTED);
    ``stall_seconds``: how long one event may take to leave before the stream is ended (its client
    stopped reading). ``events`` hears ("undecodable", method, context), ("watch_refused", …) and
    ("watch_stalled", …), for metrics and logs."""

    def __init__(self, state: TopologyState, plans: PlanRunner, authorize: Authorizer,
                 heartbeat_seconds: float = 15.0, *, max_watchers: int = 256, stall_seconds: float = 60.0,
                 events: ServiceEvents | None = None) -> None:
        self.state = state
        self.plans = plans
        self.authorize = authorize
        self.heartbeat_seconds = heartbeat_seconds
        self.max_watchers = max_watchers
        self.stall_seconds = stall_seconds
        self.events = events
        self.watchers = 0

    def _event(self, what: str, method: str, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        if self.events is not None:
            self.events(what, method, context)

    async def _decode[M: Message](self, cls: type[M], data: bytes, method: str,
                                  context: grpc.aio.ServicerContext[bytes, bytes]) -> M:
        """The request message, or INVALID_ARGUMENT. Decoded here rather than by grpc, whose failed
        deserializer logs a traceback per request: a peer sending garbage would flood the journal."""
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RecursionError):
            self._event("undecodable", method, context)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {cls.DESCRIPTOR.name}")
            raise  # abort raises; this line is never reached

    async def _send(self, context: grpc.aio.ServicerContext[bytes, bytes], data: bytes) -> None:
        try:
            await asyncio.wait_for(context.write(data), self.stall_seconds)
        except TimeoutError:
            self._event("watch_stalled", "WatchTopology", context)
            # Not context.abort(): a status goes out after the data queued before it, which is
            # exactly what does not move. Ending the handler as cancelled makes grpc reset the
            # stream (RST_STREAM) and drop what it held for it.
            raise asyncio.CancelledError("watcher stopped reading") from None

    # ---- topology ---------------------------------------------------------------------------------
    async def get_topology(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await self._decode(apb.GetTopologyRequest, request, "GetTopology", context)
        cur = self.state.current
        if cur is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "first discovery has not finished")
        assert cur is not None
        return cur.payload

    async def watch_topology(self, request_bytes: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        request = await self._decode(apb.WatchTopologyRequest, request_bytes, "WatchTopology", context)
        if self.watchers >= self.max_watchers:
            self._event("watch_refused", "WatchTopology", context)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.watchers} watchers already (listen.max_watchers)")
        self.watchers += 1
        try:
            await self._watch(request, context)
        finally:
            self.watchers -= 1

    async def _watch(self, request: apb.WatchTopologyRequest, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        # Each event is written only after the one before has left, and it is the newest
        # generation then: a watcher that falls behind skips generations, nothing queues up for it.
        state = self.state
        cur = state.current
        while cur is None and not state.closing:
            cur = await state.wait_change(0, None)
        if cur is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "agent is shutting down")
        assert cur is not None
        current_for_client = (request.agent_instance_id == state.instance_id
                              and request.generation == cur.generation
                              and request.fingerprint == cur.fingerprint)
        # Counted before the send: the client may see the snapshot and a rescan may finish while the
        # send is still returning here, and that rescan must not go untold.
        sent, rescans = cur.generation, state.rescans
        await self._send(context, cur.event_bytes(state.instance_id, kind="unchanged" if current_for_client else ""))
        while True:
            nxt = await state.wait_change(sent, self.heartbeat_seconds, after_rescans=rescans)
            if state.closing:
                last = state.current or cur
                await self._send(context, last.event_bytes(state.instance_id, kind="agent shutting down"))
                return
            if nxt is None:
                beat = state.current or cur
                await self._send(context, beat.event_bytes(state.instance_id, kind="heartbeat"))
                continue
            rescans = state.rescans
            if nxt.generation == sent:  # a rescan found the same topology: say so, send nothing new
                await self._send(context, nxt.event_bytes(state.instance_id, kind="unchanged"))
                continue
            await self._send(context, nxt.event_bytes(state.instance_id))
            sent = nxt.generation

    # ---- plans ------------------------------------------------------------------------------------
    async def apply_plan(self, request_bytes: bytes,
                         context: grpc.aio.ServicerContext[bytes, bytes]) -> planpb.PlanResult:
        request = await self._decode(apb.ApplyPlanRequest, request_bytes, "ApplyPlan", context)
        denied = self.authorize(context)
        if denied is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
        if request.expected_generation and request.expected_generation != self.state.generation:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"plan computed against generation {request.expected_generation}, "
                                f"agent is at {self.state.generation}")
        if self.state.current is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "first discovery has not finished")
        try:
            return await self.plans.apply(request.plan, request.dry_run)
        except UnreadableJournalError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)[:2000])
            raise

    async def get_plan_result(self, request_bytes: bytes,
                              context: grpc.aio.ServicerContext[bytes, bytes]) -> planpb.PlanResult:
        request = await self._decode(apb.GetPlanResultRequest, request_bytes, "GetPlanResult", context)
        result = await self.plans.result(request.plan_id)
        if result is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no plan {request.plan_id!r} on this node")
        assert result is not None
        return result

    async def list_plans(self, request_bytes: bytes,
                         context: grpc.aio.ServicerContext[bytes, bytes]) -> apb.ListPlansResponse:
        await self._decode(apb.ListPlansRequest, request_bytes, "ListPlans", context)
        return apb.ListPlansResponse(plans=await self.plans.list_plans())

    # ---- registration -----------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        # Requests arrive as bytes (no request_deserializer): each method decodes its own (_decode).
        def unary(fn: Callable[..., Awaitable[object]], raw: bool = False) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(fn, response_serializer=None if raw else _serialize)

        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "GetTopology": unary(self.get_topology, raw=True),
            "WatchTopology": grpc.unary_stream_rpc_method_handler(self.watch_topology),
            "ApplyPlan": unary(self.apply_plan),
            "GetPlanResult": unary(self.get_plan_result),
            "ListPlans": unary(self.list_plans),
        })


def _serialize(msg: object) -> bytes:
    data: bytes = msg.SerializeToString()  # type: ignore[attr-defined]
    return data
