"""The NodeAgent gRPC service (grpc.aio).

GetTopology and WatchTopology answer with bytes cached per generation (see agent.state), so they
are registered through a generic handler whose response serializer is the identity; the other
methods use the generated message classes. Names and types still come from agent.proto, which is
what reflection and clients see.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from memtopo.apply.engine import Engine
from memtopo.apply.errors import UnreadableJournalError
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import plan_pb2 as planpb

from .state import TopologyState

SERVICE_NAME = "memtopo.v1.NodeAgent"

# Returns None when the caller may change the host, else the reason it may not.
Authorizer = Callable[[grpc.aio.ServicerContext[bytes, bytes]], str | None]
PlanObserver = Callable[[planpb.PlanResult], None]


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
    def __init__(self, state: TopologyState, plans: PlanRunner, authorize: Authorizer,
                 heartbeat_seconds: float = 15.0) -> None:
        self.state = state
        self.plans = plans
        self.authorize = authorize
        self.heartbeat_seconds = heartbeat_seconds

    # ---- topology ---------------------------------------------------------------------------------
    async def get_topology(self, request: apb.GetTopologyRequest,
                           context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        cur = self.state.current
        if cur is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "first discovery has not finished")
        assert cur is not None
        return cur.payload

    async def watch_topology(self, request: apb.WatchTopologyRequest,
                             context: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
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
        yield cur.event_bytes(state.instance_id, kind="unchanged" if current_for_client else "")
        sent, rescans = cur.generation, state.rescans
        while True:
            nxt = await state.wait_change(sent, self.heartbeat_seconds, after_rescans=rescans)
            if state.closing:
                last = state.current or cur
                yield last.event_bytes(state.instance_id, kind="agent shutting down")
                return
            if nxt is None:
                beat = state.current or cur
                yield beat.event_bytes(state.instance_id, kind="heartbeat")
                continue
            rescans = state.rescans
            if nxt.generation == sent:  # a rescan found the same topology: say so, send nothing new
                yield nxt.event_bytes(state.instance_id, kind="unchanged")
                continue
            yield nxt.event_bytes(state.instance_id)
            sent = nxt.generation

    # ---- plans ------------------------------------------------------------------------------------
    async def apply_plan(self, request: apb.ApplyPlanRequest,
                         context: grpc.aio.ServicerContext[bytes, bytes]) -> planpb.PlanResult:
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

    async def get_plan_result(self, request: apb.GetPlanResultRequest,
                              context: grpc.aio.ServicerContext[bytes, bytes]) -> planpb.PlanResult:
        result = await self.plans.result(request.plan_id)
        if result is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no plan {request.plan_id!r} on this node")
        assert result is not None
        return result

    async def list_plans(self, request: apb.ListPlansRequest,
                         context: grpc.aio.ServicerContext[bytes, bytes]) -> apb.ListPlansResponse:
        return apb.ListPlansResponse(plans=await self.plans.list_plans())

    # ---- registration -----------------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[..., Awaitable[object]], req: type,
                  raw: bool = False) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=req.FromString,  # type: ignore[attr-defined]
                response_serializer=None if raw else _serialize)

        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "GetTopology": unary(self.get_topology, apb.GetTopologyRequest, raw=True),
            "WatchTopology": grpc.unary_stream_rpc_method_handler(
                self.watch_topology, request_deserializer=apb.WatchTopologyRequest.FromString,
                response_serializer=None),
            "ApplyPlan": unary(self.apply_plan, apb.ApplyPlanRequest),
            "GetPlanResult": unary(self.get_plan_result, apb.GetPlanResultRequest),
            "ListPlans": unary(self.list_plans, apb.ListPlansRequest),
        })


def _serialize(msg: object) -> bytes:
    data: bytes = msg.SerializeToString()  # type: ignore[attr-defined]
    return data
