"""The reference controller in this process, for the controller's and the CLI's tests: a simulated
agent driving one Connect stream message by message, the admin stub, and a controller on an event
loop of its own thread (so synchronous code, the CLI, can call it)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc

from memtopo.controller.server import start_controller
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import agent_pb2_grpc
from memtopo.v1 import topology_pb2 as pb
from memtopo.v1.plan_pb2 import PlanResult

T = TypeVar("T")


# ---- server helpers ----------------------------------------------------------------------------------
class SimAgent:
    """One simulated agent: its own channel and one Connect stream, driven message by message."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.channel = (grpc.aio.secure_channel(address, credentials) if credentials
                        else grpc.aio.insecure_channel(address))
        self.call = agent_pb2_grpc.ControllerStub(self.channel).Connect()

    async def send(self, **fields: Any) -> None:
        await self.call.write(apb.AgentMessage(**fields))

    async def hello(self, node: str, instance: str = "inst-a", gen: int = 0, fp: str = "") -> None:
        await self.send(hello=apb.AgentHello(node_name=node, agent_instance_id=instance, boot_id="boot",
                                             generation=gen, fingerprint=fp, agent_version="test"))

    async def recv(self, timeout: float = 30.0) -> apb.ControllerMessage:
        msg = await asyncio.wait_for(self.call.read(), timeout)
        assert isinstance(msg, apb.ControllerMessage), f"stream ended: {msg!r}"
        return msg

    async def expect(self, kind: str) -> apb.ControllerMessage:
        msg = await self.recv()
        assert msg.WhichOneof("message") == kind, msg
        return msg

    async def join(self, node: str, t: pb.MemoryTopology, instance: str = "inst-a") -> None:
        """hello → snapshot_request → snapshot → ack."""
        await self.hello(node, instance, t.generation, t.fingerprint)
        await self.expect("snapshot_request")
        await self.send(snapshot=t)
        ack = await self.expect("ack")
        assert (ack.ack.generation, ack.ack.fingerprint) == (t.generation, t.fingerprint)

    async def ended(self, timeout: float = 30.0) -> grpc.StatusCode:
        """Read until the stream ends; the status it ended with."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            while await asyncio.wait_for(self.call.read(), timeout) is not grpc.aio.EOF:
                pass
        code: grpc.StatusCode = await self.call.code()
        return code

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


@contextlib.asynccontextmanager
async def admin(address: str) -> AsyncIterator[agent_pb2_grpc.ControllerAdminAsyncStub]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield agent_pb2_grpc.ControllerAdminStub(channel)


# ---- CLI against a live controller -------------------------------------------------------------------
class Background:
    """A controller on its own event loop thread, so the (synchronous) CLI can call it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running = self.run(start_controller("127.0.0.1:0"))
        self.addr = f"127.0.0.1:{self.running.port}"
        self.agents: list[SimAgent] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def shutdown() -> None:
            for a in self.agents:
                await a.close()
            await self.running.stop(0)

        self.run(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def topo(gen: int, fp: str, *, numa: int = 2, accel: int = 1, name: str = "") -> pb.MemoryTopology:
    return pb.MemoryTopology(node_name=name, generation=gen, fingerprint=fp,
                             numa_nodes=[pb.NumaNode(id=i) for i in range(numa)],
                             accelerators=[pb.Accelerator(index=i) for i in range(accel)])


async def answering_agent(bg: Background, node: str, t: pb.MemoryTopology) -> None:
    """An agent that applies every plan it gets, except it rejects plans described as "reject"."""
    agent = SimAgent(bg.addr)
    bg.agents.append(agent)
    await agent.join(node, t)

    async def serve_plans() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            while isinstance(msg := await agent.call.read(), apb.ControllerMessage):
                if msg.WhichOneof("message") != "plan":
                    continue
                p = msg.plan.plan
                state = (PlanResult.STATE_DRY_RUN if msg.plan.dry_run else
                         PlanResult.STATE_REJECTED if p.description == "reject" else PlanResult.STATE_APPLIED)
                rejections = ["a1: no such pid"] if state == PlanResult.STATE_REJECTED else []
                await agent.send(plan_result=PlanResult(plan_id=p.plan_id, state=state, message=f"sim {node}",
                                                        rejections=rejections))

    asyncio.get_running_loop().create_task(serve_plans())
