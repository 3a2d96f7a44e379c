"""The agent's long-lived link to the controller (Controller.Connect), reconnecting forever.

Protocol (docs/controller.md): hello first; the controller answers ack or snapshot_request; the
agent sends a full snapshot on request and on every new generation, heartbeats between, and the
result of every plan the controller sends down — again when that result changes on the node (a local
``memtopo rollback`` of the plan): at each heartbeat the link reads the stored results of the last
plans it reported and sends those whose state changed.

Nothing queues without bound while disconnected: a topology is never queued at all, only the
fact that the controller must get the latest one (the snapshot is read from the state at send
time, so updates coalesce to the newest); plan results wait in a small bounded deque and stay in
the engine's state directory anyway (a resubmitted plan id answers with the stored result).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable

import grpc
import structlog

from memtopo.backoff import Backoff
from memtopo.grpcserve import MAX_MESSAGE_BYTES
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import plan_pb2 as planpb
from memtopo.wire import embed

from .state import Published, TopologyState, now

log = structlog.get_logger("memtopo.link")

PlanHandler = Callable[[planpb.BindingPlan, bool], Awaitable[planpb.PlanResult]]
# The result the node has stored for a plan id (None: none), read off the loop.
StoredResult = Callable[[str], Awaitable[planpb.PlanResult | None]]

# Keepalive pings notice a controller that vanished without closing the TCP connection.
CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 64 << 20),
)
MAX_PENDING_RESULTS = 256
# Reported plans whose stored results are read again at each heartbeat (the fleet page shows 20).
MAX_WATCHED_RESULTS = 32

CONNECT = "/memtopo.v1.Controller/Connect"
SNAPSHOT_FIELD = apb.AgentMessage.DESCRIPTOR.fields_by_name["snapshot"].number
# What the link writes: a message, or a snapshot message already serialized around the cached bytes.
LinkCall = grpc.aio.StreamStreamCall[apb.AgentMessage | bytes, apb.ControllerMessage]


def _serialized(message: apb.AgentMessage | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class LinkState(enum.StrEnum):
    DISCONNECTED = "disconnected"
    CONNECTING = "connecting"
    CONNECTED = "connected"


class ControllerLink:
    def __init__(self, address: str, state: TopologyState, node_name: str, boot_id: str,
                 plans: PlanHandler, *, credentials: grpc.ChannelCredentials | None = None,
                 heartbeat_seconds: float = 10.0, backoff: Backoff | None = None,
                 on_state: Callable[[LinkState], None] | None = None,
                 on_reconnect: Callable[[], None] | None = None, version: str = "",
                 stored_result: StoredResult | None = None) -> None:
        self.address = address
        self.state = state
        self.node_name = node_name
        self.boot_id = boot_id
        self.plans = plans
        self.credentials = credentials
        self.heartbeat_seconds = heartbeat_seconds
        self.backoff = backoff or Backoff()
        self.on_state = on_state
        self.on_reconnect = on_reconnect
        self.version = version
        self.link_state = LinkState.DISCONNECTED
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._snapshot_wanted = True
        self._sent_generation = 0
        self._results: deque[planpb.PlanResult] = deque(maxlen=MAX_PENDING_RESULTS)
        self.stored_result = stored_result
        # plan id → the state the controller was last told, newest last.
        self._reported: OrderedDict[str, int] = OrderedDict()
        self._plan_tasks: set[asyncio.Task[None]] = set()
        self._rng = random.Random()  # noqa: S311 - jitter, not security
        self.sessions = 0
        state.add_listener(self._on_publish)

    # ---- public -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Connect, serve the session, back off, repeat — until stop()."""
        attempt = 0
        while not self._stop.is_set():
            self._set_state(LinkState.CONNECTING)
            productive = False
            try:
                productive = await self._session()
            except grpc.aio.AioRpcError as exc:
                log.info("controller_link_lost", address=self.address, code=exc.code().name,
                         details=exc.details())
            except (OSError, grpc.RpcError, asyncio.InvalidStateError) as exc:
                # InvalidStateError: grpc.aio refuses a write on a call the controller already ended
                # (it died between our read and our write); that is a lost link like any other.
                log.info("controller_link_lost", address=self.address, error=repr(exc))
            except Exception as exc:
                # The link must outlive anything one session throws: a dead link task would leave the
                # node silently off the controller until the agent restarts.
                log.error("controller_link_error", address=self.address, error=repr(exc))
            self._set_state(LinkState.DISCONNECTED)
            if self._stop.is_set():
                break
            attempt = 0 if productive else attempt + 1
            if self.on_reconnect is not None:
                self.on_reconnect()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.backoff.delay(attempt, self._rng))

    async def stop(self) -> None:
        """Let in-flight plans finish and report, then close the stream cleanly."""
        if self._plan_tasks:
            await asyncio.gather(*self._plan_tasks, return_exceptions=True)
        self._stop.set()
        self._wake.set()

    # ---- internals --------------------------------------------------------------------------------
    def _set_state(self, new: LinkState) -> None:
        if new != self.link_state:
            self.link_state = new
            if self.on_state is not None:
                self.on_state(new)

    def _on_publish(self, pub: Published) -> None:
        self._wake.set()

    def _hello(self) -> apb.AgentMessage:
        cur = self.state.current
        return apb.AgentMessage(sent=now(), hello=apb.AgentHello(
            node_name=self.node_name, agent_instance_id=self.state.instance_id, boot_id=self.boot_id,
            generation=cur.generation if cur else 0, fingerprint=cur.fingerprint if cur else "",
            agent_version=self.version))

    async def _session(self) -> bool:
        """One connection. Returns True when the controller answered (the backoff starts over)."""
        options = list(CHANNEL_OPTIONS)
        channel = (grpc.aio.secure_channel(self.address, self.credentials, options=options)
                   if self.credentials is not None else grpc.aio.insecure_channel(self.address, options=options))
        async with channel:
            call: LinkCall = channel.stream_stream(CONNECT, request_serializer=_serialized,
                                                   response_deserializer=apb.ControllerMessage.FromString)()
            await call.write(self._hello())
            # The hello told the controller which generation we hold; it asks for the snapshot if it
            # lacks it, and anything newer is sent by the writer below.
            self._snapshot_wanted = False
            self._sent_generation = self.state.generation
            reader = asyncio.create_task(self._read(call))
            writer = asyncio.create_task(self._write(call))
            stopper = asyncio.create_task(self._stop.wait())
            try:
                done, _ = await asyncio.wait({reader, writer, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if stopper in done:
                    writer.cancel()
                    with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                        await writer
                    with contextlib.suppress(grpc.RpcError):
                        await call.done_writing()
                    with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
                        await asyncio.wait_for(reader, 2.0)
                    log.info("controller_link_closed", address=self.address)
                    return True
                for task in done:
                    task.result()  # re-raise what ended the session
                return reader.result() if reader in done else False
            finally:
                for task in (reader, writer, stopper):
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.gather(reader, writer, stopper, return_exceptions=True)
                call.cancel()

    async def _read(self, call: LinkCall) -> bool:
        answered = False
        async for msg in call:
            kind = msg.WhichOneof("message")
            if not answered:
                answered = True
                self.sessions += 1
                self._set_state(LinkState.CONNECTED)
                log.info("controller_link_up", address=self.address, node=self.node_name,
                         generation=self.state.generation)
            if kind == "snapshot_request":
                log.info("snapshot_requested", reason=msg.snapshot_request.reason)
                self._snapshot_wanted = True
                self._wake.set()
            elif kind == "plan":
                task = asyncio.create_task(self._run_plan(msg.plan))
                self._plan_tasks.add(task)
                task.add_done_callback(self._plan_tasks.discard)
        return answered

    async def _run_plan(self, req: apb.PlanRequest) -> None:
        try:
            result = await self.plans(req.plan, req.dry_run)
        except Exception as exc:  # the engine reports failures in results; this is a bug guard
            log.error("plan_crashed", plan_id=req.plan.plan_id, error=repr(exc))
            result = planpb.PlanResult(plan_id=req.plan.plan_id, state=planpb.PlanResult.STATE_FAILED,
                                       message=f"agent error: {exc!r}")
        self._results.append(result)
        self._wake.set()

    def _note_reported(self, result: planpb.PlanResult) -> None:
        if result.state == planpb.PlanResult.STATE_DRY_RUN or not result.plan_id:
            return  # the engine stores no dry run: nothing to watch
        self._reported.pop(result.plan_id, None)
        self._reported[result.plan_id] = result.state
        while len(self._reported) > MAX_WATCHED_RESULTS:
            self._reported.popitem(last=False)

    async def _recheck_reported(self) -> None:
        """Queue the stored results of reported plans whose state changed since they were sent."""
        if self.stored_result is None or not self._reported:
            return
        for plan_id, told in list(self._reported.items()):
            try:
                stored = await self.stored_result(plan_id)
            except Exception as exc:  # an unreadable result is the engine's to report, not the link's
                log.debug("plan_result_recheck_failed", plan_id=plan_id, error=repr(exc))
                continue
            if stored is not None and stored.state != told and stored.state != planpb.PlanResult.STATE_UNSPECIFIED:
                log.info("plan_result_changed", plan_id=plan_id, state=planpb.PlanResult.State.Name(stored.state))
                self._reported[plan_id] = stored.state
                self._results.append(stored)

    async def _write(self, call: LinkCall) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + self.heartbeat_seconds
        while True:
            timeout = max(0.0, next_beat - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            sent = False
            cur = self.state.current
            if cur is not None and (self._snapshot_wanted or cur.generation > self._sent_generation):
                self._snapshot_wanted = False
                self._sent_generation = cur.generation
                # The generation's bytes as published, not the message copied into another and encoded.
                await call.write(embed(apb.AgentMessage(sent=now()).SerializeToString(), SNAPSHOT_FIELD, cur.payload))
                log.debug("snapshot_sent", generation=cur.generation)
                sent = True
            if loop.time() >= next_beat:
                await self._recheck_reported()
            while self._results:
                result = self._results[0]
                await call.write(apb.AgentMessage(sent=now(), plan_result=result))
                self._results.popleft()
                self._note_reported(result)
                sent = True
            if not sent and loop.time() >= next_beat:
                await call.write(apb.AgentMessage(sent=now(), heartbeat=apb.AgentHeartbeat(
                    generation=cur.generation if cur else 0, fingerprint=cur.fingerprint if cur else "")))
                sent = True
            if sent:
                next_beat = loop.time() + self.heartbeat_seconds
