"""The reference controller's gRPC server: ``Controller`` (agent links), ``ControllerAdmin``
(operators), ``grpc.health.v1`` and server reflection on one grpc.aio server.

The protocol is written down in docs/controller.md; ``controller.fleet`` makes its decisions and
this module only moves messages. Each link has a small outbox instead of a queue: the latest ack
and at most one snapshot request are slots that coalesce, and plans are bounded by the number of
plans in flight per node, so a slow or stuck agent never makes the controller's memory grow.

``memtopo controller serve`` (cli/controller.py) runs it until SIGTERM/SIGINT, and says what its HTTP
listener serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health, health_pb2  # type: ignore[import-untyped, unused-ignore]

from memtopo import tls
from memtopo.addresses import AddressError, is_loopback, parse_host_port
from memtopo.controller.defaults import DEFAULT_PLAN_TIMEOUT_S, MAX_PLAN_TIMEOUT_S
from memtopo.controller.fleet import (
    Ack,
    Fleet,
    FleetFullError,
    Hello,
    NodeInfo,
    ProtocolError,
    Reply,
    RequestSnapshot,
)
from memtopo.grpcserve import grpc_server
from memtopo.logs import get_logger
from memtopo.planner.fleet import Held, SnapshotNodes, decide_json
from memtopo.v1 import agent_pb2 as apb
from memtopo.v1 import plan_pb2 as planpb
from memtopo.wire import field_bytes

if TYPE_CHECKING:
    # The HTTP side (prometheus_client, the server, whatever routes the entry point installs, the
    # Kubernetes client) is imported when a controller starts, not by every command that imports this
    # module (`memtopo --help`).
    from memtopo.controller.state import ControllerState
    from memtopo.httpserve import HttpServer, Limits, Routes
    from memtopo.k8s.kubeapi import KubeApi

# What the HTTP listener serves: installs routes for this controller's state. The entry point
# composes it (cli/controller.py); the default is the controller's own /healthz and /metrics.
RouteInstaller = Callable[["Routes", "ControllerState"], None]

log = get_logger(component="controller")

# Plans are operator actions, few at a time; beyond this a node's link is not keeping up.
MAX_PLANS_IN_FLIGHT = 64

SERVICE_NAMES = tuple(apb.DESCRIPTOR.services_by_name[s].full_name for s in ("Controller", "ControllerAdmin"))

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    # A second controller on the same port must fail to start, not silently share it.
    ("grpc.so_reuseport", 0),
    # Find dead agent hosts (no FIN) so their nodes show disconnected.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Agents may ping idle links every 10 s or more; grpc's default would GOAWAY them ("too_many_pings").
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)

SC = grpc.StatusCode


class ControllerConfigError(ValueError):
    """A listen address or credential setting the controller refuses to start with."""


# ---- addresses ---------------------------------------------------------------------------------------
def check_address(address: str) -> None:
    """``host:port``, ``[v6]:port`` or ``unix:PATH``; ControllerConfigError naming the problem otherwise."""
    if address.startswith("unix:"):
        return
    try:
        parse_host_port(address)
    except AddressError as exc:
        raise ControllerConfigError(str(exc)) from exc


# ---- per-link outbox ---------------------------------------------------------------------------------
class _Link:
    """One agent stream's outbound side: coalescing slots plus the plans sent down it."""

    def __init__(self, session: int, node: str, peer: str) -> None:
        self.session = session
        self.node = node
        self.peer = peer
        self._ack: apb.ControllerAck | None = None
        self._request: str | None = None
        self._plans: deque[apb.PlanRequest] = deque()
        self._wake = asyncio.Event()
        self.closed = False
        # Status to end the RPC with; None = end it OK.
        self.end: tuple[grpc.StatusCode, str] | None = None

    def reply(self, reply: Reply | None) -> None:
        if isinstance(reply, Ack):
            self._ack = apb.ControllerAck(generation=reply.generation, fingerprint=reply.fingerprint)
            # The snapshot that produced this ack answered any request still waiting to go out.
            self._request = None
        elif isinstance(reply, RequestSnapshot):
            self._request = reply.reason
        else:
            return
        self._wake.set()

    def plan(self, request: apb.PlanRequest) -> None:
        self._plans.append(request)
        self._wake.set()

    def close(self, code: grpc.StatusCode | None = None, details: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        self.end = (code, details) if code is not None else None
        self._wake.set()

    async def next(self) -> apb.ControllerMessage | None:
        """The next message to write, waiting for one; None once the link is closed."""
        while not self.closed:
            if self._ack is not None:
                msg = apb.ControllerMessage(ack=self._ack)
                self._ack = None
                return msg
            if self._request is not None:
                msg = apb.ControllerMessage(snapshot_request=apb.SnapshotRequest(reason=self._request))
                self._request = None
                return msg
            if self._plans:
                return apb.ControllerMessage(plan=self._plans.popleft())
            self._wake.clear()
            await self._wake.wait()
        return None


@dataclass
class _InFlight:
    request: apb.PlanRequest
    waiters: list[asyncio.Future[planpb.PlanResult]] = field(default_factory=list)


class _Hub:
    """The fleet plus the live links and the plans awaiting results; shared by both services."""

    def __init__(self, state: ControllerState) -> None:
        self.state = state
        self.fleet = state.fleet
        self.links: dict[int, _Link] = {}
        # node → (plan_id, dry_run) → in flight. Kept across link drops: a node that reconnects
        # before the submitter gives up gets the plan again (the agent answers a seen id from its store).
        self.inflight: dict[str, dict[tuple[str, bool], _InFlight]] = {}
        state.pending_plans = lambda node: list(self.inflight.get(node, ()))

    def link_of(self, node: str) -> _Link | None:
        session = self.fleet.session_of(node)
        return self.links.get(session) if session is not None else None

    def resend_inflight(self, link: _Link) -> None:
        for entry in self.inflight.get(link.node, {}).values():
            link.plan(entry.request)

    def resolve(self, node: str, result: planpb.PlanResult) -> None:
        plans = self.inflight.get(node)
        if not plans:
            return
        # A dry run's result answers dry-run submitters; any other state answers real submitters
        # first (a refused dry run carries REJECTED, indistinguishable from a refused apply).
        dry = result.state == planpb.PlanResult.STATE_DRY_RUN
        key = (result.plan_id, dry)
        if key not in plans and not dry:
            key = (result.plan_id, True)
        entry = plans.pop(key, None)
        if entry is None:
            return
        for fut in entry.waiters:
            if not fut.done():
                fut.set_result(result)
        if not plans:
            del self.inflight[node]

    def forget_waiter(self, node: str, key: tuple[str, bool], fut: asyncio.Future[planpb.PlanResult]) -> None:
        plans = self.inflight.get(node)
        entry = plans.get(key) if plans else None
        if plans is None or entry is None:
            return
        with contextlib.suppress(ValueError):
            entry.waiters.remove(fut)
        if not entry.waiters:
            del plans[key]
            if not plans:
                del self.inflight[node]

    def close_all(self, details: str) -> None:
        for link in list(self.links.values()):
            link.close(SC.UNAVAILABLE, details)


def _hello(msg: apb.AgentHello) -> Hello:
    return Hello(node_name=msg.node_name, agent_instance_id=msg.agent_instance_id, boot_id=msg.boot_id,
                 generation=msg.generation, fingerprint=msg.fingerprint, agent_version=msg.agent_version)


# ---- Controller (agents) -----------------------------------------------------------------------------
_SNAPSHOT_FIELD = apb.AgentMessage.DESCRIPTOR.fields_by_name["snapshot"].number


@dataclass(frozen=True, slots=True)
class Received:
    """An agent's message as it arrived: parsed, and a snapshot's own bytes beside it (stored as they
    came: the fleet holds snapshots serialized, and encoding the parsed one again would only cost)."""

    message: apb.AgentMessage
    snapshot: bytes | None

    @classmethod
    def parse(cls, data: bytes) -> Received:
        message = apb.AgentMessage.FromString(data)
        return cls(message, field_bytes(data, _SNAPSHOT_FIELD) if message.HasField("snapshot") else None)


AgentContext = grpc.aio.ServicerContext[Received, apb.ControllerMessage]


class ControllerService:
    def __init__(self, hub: _Hub) -> None:
        self._hub = hub

    def handler(self) -> grpc.GenericRpcHandler:
        """The Controller service, its requests read by Received.parse."""
        return grpc.method_handlers_generic_handler("memtopo.v1.Controller", {
            "Connect": grpc.stream_stream_rpc_method_handler(
                self.Connect, request_deserializer=Received.parse,
                response_serializer=apb.ControllerMessage.SerializeToString)})

    async def Connect(self, request_iterator: AsyncIterator[Received] | Iterator[Received],  # noqa: N802
                      context: AgentContext) -> AsyncIterator[apb.ControllerMessage]:
        # Requests are read with context.read(), not request_iterator: grpc's iterator keeps the last
        # message alive while it waits for the next, and on a link that is the last full snapshot.
        peer = context.peer()
        received = await context.read()
        if not isinstance(received, Received):  # grpc.aio.EOF: closed before saying anything
            return
        first = received.message
        if first.WhichOneof("message") != "hello":
            await context.abort(SC.INVALID_ARGUMENT, "the first message on a link must be hello")
        fleet = self._hub.fleet
        try:
            connected = fleet.connect(_hello(first.hello), peer)
        except FleetFullError as exc:
            await context.abort(SC.RESOURCE_EXHAUSTED, str(exc))
        except ProtocolError as exc:
            await context.abort(SC.INVALID_ARGUMENT, str(exc))
        node = first.hello.node_name
        self._hub.state.changes.bump(node)
        link = _Link(connected.session, node, peer)
        self._hub.links[link.session] = link
        if connected.replaced is not None:
            old = self._hub.links.pop(connected.replaced, None)
            if old is not None:
                old.close(SC.ABORTED, f"replaced by a newer link for node {node} from {peer}")
        log.info("agent_connected", node=node, peer=peer, generation=first.hello.generation,
                 agent_instance_id=first.hello.agent_instance_id,
                 replaced_peer=connected.replaced_peer or None)
        self._note_reply(link, connected.reply)
        link.reply(connected.reply)
        self._hub.resend_inflight(link)
        reader = asyncio.create_task(self._read(context, link))
        try:
            while (msg := await link.next()) is not None:
                yield msg
        finally:
            reader.cancel()
            if fleet.disconnect(link.session) is not None:
                log.info("agent_disconnected", node=node, peer=peer)
                self._hub.state.changes.bump(node)
            self._hub.links.pop(link.session, None)
        if link.end is not None:
            await context.abort(*link.end)

    async def _read(self, context: AgentContext, link: _Link) -> None:
        try:
            while isinstance(got := await context.read(), Received):  # else grpc.aio.EOF
                self._handle(link, got.message, got.snapshot)
                # Not kept alive while waiting for the next one: a parsed snapshot is ~60 KiB per link.
                del got
            link.close()
        except ProtocolError as exc:
            link.close(SC.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # the call failed under us, or a bug: end this link, keep the others
            log.warning("link_read_failed", node=link.node, peer=link.peer, error=repr(exc))
            link.close(SC.INTERNAL, "controller could not read the link")

    def _handle(self, link: _Link, msg: apb.AgentMessage, snapshot: bytes | None = None) -> None:
        fleet = self._hub.fleet
        kind = msg.WhichOneof("message")
        if kind == "snapshot":
            outcome = fleet.snapshot(link.session, msg.snapshot, snapshot)
            if outcome.stored:
                self._hub.state.changes.bump(link.node)
                log.info("snapshot_stored", node=link.node, generation=msg.snapshot.generation,
                         fingerprint=msg.snapshot.fingerprint[:16], peer=link.peer)
            elif outcome.reason:
                log.warning("snapshot_ignored", node=link.node, generation=msg.snapshot.generation,
                            reason=outcome.reason, peer=link.peer)
            link.reply(outcome.reply)
        elif kind == "heartbeat":
            request = fleet.heartbeat(link.session, msg.heartbeat.generation, msg.heartbeat.fingerprint)
            self._note_reply(link, request)
            link.reply(request)
        elif kind == "plan_result":
            if fleet.record_result(link.session, msg.plan_result) is not None:
                self._hub.state.changes.bump(link.node)
                log.info("plan_result", node=link.node, plan_id=msg.plan_result.plan_id,
                         state=planpb.PlanResult.State.Name(msg.plan_result.state), peer=link.peer)
                self._hub.resolve(link.node, msg.plan_result)
        elif kind == "hello":
            raise ProtocolError("hello sent twice on one link")
        # Anything else is a message type newer than this controller: ignored, for compatibility.

    @staticmethod
    def _note_reply(link: _Link, reply: Reply | None) -> None:
        if isinstance(reply, RequestSnapshot):
            log.debug("snapshot_requested", node=link.node, reason=reply.reason, peer=link.peer)


# ---- ControllerAdmin (operators) ---------------------------------------------------------------------
def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def node_summary(info: NodeInfo) -> apb.NodeSummary:
    return apb.NodeSummary(
        node_name=info.node_name, agent_instance_id=info.agent_instance_id, boot_id=info.boot_id,
        generation=info.generation, fingerprint=info.fingerprint, connected=info.connected,
        last_seen=_timestamp(info.last_seen) if info.last_seen else None, peer=info.peer,
        numa_nodes=info.numa_nodes, accelerators=info.accelerators)


AdminContext = grpc.aio.ServicerContext[Any, Any]


class ControllerAdminService:
    def __init__(self, hub: _Hub) -> None:
        self._hub = hub

    def handler(self) -> grpc.GenericRpcHandler:
        """The ControllerAdmin service; GetNodeTopology answers with the held bytes as they are."""
        def unary(fn: Any, request: Any, serialize: Any) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=request.FromString,
                                                       response_serializer=serialize)

        return grpc.method_handlers_generic_handler("memtopo.v1.ControllerAdmin", {
            "ListNodes": unary(self.ListNodes, apb.ListNodesRequest, apb.ListNodesResponse.SerializeToString),
            "GetNodeTopology": unary(self.GetNodeTopology, apb.GetNodeTopologyRequest, None),
            "SubmitPlan": unary(self.SubmitPlan, apb.SubmitPlanRequest, planpb.PlanResult.SerializeToString),
            "GetNodePlanResult": unary(self.GetNodePlanResult, apb.GetNodePlanResultRequest,
                                       planpb.PlanResult.SerializeToString),
            "Place": unary(self.Place, apb.FleetPlaceRequest, apb.FleetPlaceResponse.SerializeToString),
        })

    async def GetNodeTopology(self, request: apb.GetNodeTopologyRequest, context: AdminContext) -> bytes:  # noqa: N802
        """The node's topology as its agent sent it: the held snapshot bytes, neither parsed nor
        encoded again."""
        payload = self._hub.fleet.topology_bytes(request.node_name)
        if payload is None:
            what = "no topology yet" if self._hub.fleet.knows(request.node_name) else "unknown node"
            await context.abort(SC.NOT_FOUND, f"{request.node_name}: {what}")
        assert payload is not None  # abort raised
        return payload

    async def ListNodes(self, request: apb.ListNodesRequest, context: AdminContext) -> apb.ListNodesResponse:  # noqa: N802
        return apb.ListNodesResponse(nodes=[node_summary(i) for i in self._hub.fleet.nodes()])

    async def GetNodePlanResult(self, request: apb.GetNodePlanResultRequest,  # noqa: N802
                                context: AdminContext) -> planpb.PlanResult:
        if not self._hub.fleet.knows(request.node_name):
            await context.abort(SC.NOT_FOUND, f"{request.node_name}: unknown node")
        result = self._hub.fleet.result(request.node_name, request.plan_id)
        if result is None:
            await context.abort(SC.NOT_FOUND, f"{request.node_name}: no result for plan {request.plan_id!r}")
        return result

    async def SubmitPlan(self, request: apb.SubmitPlanRequest, context: AdminContext) -> planpb.PlanResult:  # noqa: N802
        hub, node, plan_id = self._hub, request.node_name, request.plan.plan_id
        if not plan_id:
            await context.abort(SC.INVALID_ARGUMENT, "the plan has no plan_id")
        if not hub.fleet.knows(node):
            await context.abort(SC.NOT_FOUND, f"{node}: unknown node")
        link = hub.link_of(node)
        if link is None:
            await context.abort(SC.UNAVAILABLE, f"{node}: not connected")
        key = (plan_id, request.dry_run)
        entry = hub.inflight.get(node, {}).get(key)
        if entry is None:
            if len(hub.inflight.get(node, {})) >= MAX_PLANS_IN_FLIGHT:
                await context.abort(SC.RESOURCE_EXHAUSTED,
                             f"{node}: {MAX_PLANS_IN_FLIGHT} plans already await results")
            entry = _InFlight(apb.PlanRequest(plan=request.plan, dry_run=request.dry_run))
            hub.inflight.setdefault(node, {})[key] = entry
            link.plan(entry.request)
        # else: the same plan is already on its way; wait for its result instead of sending it twice.
        fut: asyncio.Future[planpb.PlanResult] = asyncio.get_running_loop().create_future()
        entry.waiters.append(fut)
        timeout = float(min(request.timeout_seconds or DEFAULT_PLAN_TIMEOUT_S, MAX_PLAN_TIMEOUT_S))
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(remaining, 0.0))
        log.info("plan_submitted", node=node, plan_id=plan_id, dry_run=request.dry_run, peer=context.peer())
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            await context.abort(SC.DEADLINE_EXCEEDED,
                         f"{node}: no result for plan {plan_id!r} within {timeout:g} s "
                         "(resubmitting the same plan id is safe)")
        finally:
            hub.forget_waiter(node, key, fut)


    async def Place(self, request: apb.FleetPlaceRequest, context: AdminContext) -> apb.FleetPlaceResponse:  # noqa: N802
        state = self._hub.state
        fleet = state.fleet
        # Taken on the loop, so the fleet does not change under the worker; parsing and ranking
        # thousands of topologies then runs off the loop, which keeps serving the agents' links.
        held = [(i.node_name, i.connected, fleet.topology_bytes(i.node_name)) for i in fleet.nodes()]
        doc = await asyncio.to_thread(_place, state.nodes, request.policy, request.request_json, held)
        error = doc.get("error")
        log.info("fleet_placed", policy=request.policy, nodes=len(held), peer=context.peer(),
                 chosen=doc.get("chosen"), error=error["code"] if error else None)
        return apb.FleetPlaceResponse(result_json=json.dumps(doc))


def _place(nodes: SnapshotNodes, policy: str, request_json: str, held: Sequence[Held]) -> dict[str, Any]:
    try:
        return decide_json(policy, request_json, nodes.nodes(held, policy))
    except Exception as exc:  # an answer for the operator, a traceback for the log
        log.exception("fleet_place_failed", policy=policy)
        return {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc} (a bug in memtopo)"}}


# ---- the server --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunningController:
    port: int
    fleet: Fleet
    server: grpc.aio.Server
    health: Any
    hub: _Hub
    address: str
    # The HTTP listener (/healthz, /metrics and what the entry point installed); None when not asked for.
    http: HttpServer | None = None

    @property
    def state(self) -> ControllerState:
        return self.hub.state

    async def stop(self, grace: float | None = 5.0) -> None:
        """Health goes NOT_SERVING, every agent link ends with UNAVAILABLE (agents reconnect with
        backoff), then admin calls get ``grace`` seconds to finish."""
        await self.health.enter_graceful_shutdown()
        self.hub.state.stopping = True
        self.hub.close_all("controller shutting down")
        await self.server.stop(grace)
        if self.http is not None:
            await self.http.stop()
        tasks = list(self.hub.state.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.hub.state.kube is not None:
            await self.hub.state.kube.close()
        log.info("controller_stopped", address=self.address)


def _bound_address(listen: str, port: int) -> str:
    if listen.startswith("unix:"):
        return listen
    host, _ = parse_host_port(listen)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_http(state: ControllerState, address: str, ssl_context: ssl.SSLContext | None = None,
                     *, insecure: bool = False, install: RouteInstaller | None = None, hosts: Sequence[str] = (),
                     limits: Limits | None = None) -> HttpServer:
    """The HTTP listener on ``address`` (host:port) serving what ``install`` puts on its routes
    (default: the controller's /healthz and /metrics). Plaintext only on loopback unless ``insecure``
    (routes that change the cluster may be served). ``hosts``: names accepted in ``Host`` besides IP
    literals, ``localhost`` and the address's own host name."""
    try:
        host, _ = parse_host_port(address)
    except AddressError as exc:
        raise ControllerConfigError(f"--http: {exc}") from exc
    if ssl_context is None and not insecure and not is_loopback(address):
        raise ControllerConfigError(f"--http {address}: plaintext HTTP is only served on loopback; give "
                                    "--http-tls-cert/--http-tls-key (or --http-insecure behind a trusted network)")
    from memtopo.controller.routes import install_core
    from memtopo.httpserve import HttpServer, Limits, ListenError, Routes, bind

    table = Routes()
    (install or install_core)(table, state)
    server = HttpServer(table, limits or Limits(), name="memtopo-controller", hosts=(host, *hosts),
                        observer=state.metrics.observe_http, on_event=state.metrics.observe_connection)
    try:
        await server.start(bind(address), ssl_context)
    except ListenError as exc:
        raise ControllerConfigError(f"HTTP listener: {exc}") from exc
    log.info("controller_http_listening", address=server.address, tls=ssl_context is not None,
             routes=len(table.paths()))
    return server


def http_ssl_context(cert: str, key: str, client_ca: str = "") -> ssl.SSLContext:
    """A server TLS context from PEM files; with ``client_ca``, client certificates are verified
    against it (requests then carry their subject; routes decide what a client without one may do).
    ControllerConfigError when they cannot be loaded."""
    try:
        return tls.server_context(cert, key, client_ca=client_ca or None)
    except tls.TlsError as exc:
        raise ControllerConfigError(f"HTTP {exc}") from None
    except (OSError, ssl.SSLError) as exc:
        raise ControllerConfigError(f"HTTP client CA {client_ca}: {exc}") from None


async def start_controller(listen: str, credentials: grpc.ServerCredentials | None = None, *,
                           http: str | None = None, http_ssl: ssl.SSLContext | None = None,
                           http_insecure: bool = False, http_routes: RouteInstaller | None = None,
                           http_hosts: Sequence[str] = (), kube: KubeApi | None = None) -> RunningController:
    """Serve Controller, ControllerAdmin, health and reflection on ``listen`` (host:port, port 0 =
    any, or unix:PATH). Plaintext only on loopback; elsewhere ``credentials`` (grpc.ServerCredentials)
    are required. ``http`` (host:port) also opens the HTTP listener with ``http_routes`` (see
    ``start_http``). ControllerConfigError when an address is refused or cannot be bound."""
    check_address(listen)
    if credentials is None and not is_loopback(listen):
        raise ControllerConfigError(f"{listen}: plaintext is only served on loopback; give TLS credentials")
    from memtopo.controller.metrics import ControllerMetrics
    from memtopo.controller.state import ControllerState

    metrics = ControllerMetrics()
    fleet = Fleet()
    metrics.watch(fleet)
    hub = _Hub(ControllerState(fleet, metrics, kube=kube))
    health_servicer = health.aio.HealthServicer()
    server = grpc_server(SERVICE_NAMES, health_servicer, options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((ControllerService(hub).handler(),))
    server.add_generic_rpc_handlers((ControllerAdminService(hub).handler(),))
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        port = (server.add_secure_port(listen, credentials) if credentials is not None
                else server.add_insecure_port(listen))
    except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind …")
        raise ControllerConfigError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0 and not listen.startswith("unix:"):
        raise ControllerConfigError(f"cannot listen on {listen}")
    http_server = None
    if http:
        try:
            http_server = await start_http(hub.state, http, http_ssl, insecure=http_insecure, install=http_routes,
                                           hosts=http_hosts)
        except ControllerConfigError:
            await server.stop(None)
            raise
    await server.start()
    hub.state.start("controller-warm", hub.state.warm_forever())
    address = _bound_address(listen, port)
    log.info("controller_listening", address=address, tls=credentials is not None)
    return RunningController(port, hub.fleet, server, health_servicer, hub, address, http_server)


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """grpc.ServerCredentials from PEM files; a client CA makes client certificates mandatory (mTLS)."""
    try:
        return tls.server_credentials(cert, key, client_ca)
    except tls.TlsError as exc:
        raise ControllerConfigError(str(exc)) from None


async def serve_until_signalled(listen: str, credentials: grpc.ServerCredentials | None, grace: float = 5.0,
                                signals: Iterable[int] | None = None, *, http: str | None = None,
                                http_ssl: ssl.SSLContext | None = None, http_insecure: bool = False,
                                http_routes: RouteInstaller | None = None, http_hosts: Sequence[str] = (),
                                kube: KubeApi | None = None) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    sigs = tuple(signals) if signals is not None else (signal.SIGTERM, signal.SIGINT)
    # Before the listeners open: a SIGTERM while they start (a client may already have seen
    # controller_listening) is a graceful stop too.
    for sig in sigs:
        loop.add_signal_handler(sig, stop.set)
    try:
        running = await start_controller(listen, credentials, http=http, http_ssl=http_ssl,
                                         http_insecure=http_insecure, http_routes=http_routes,
                                         http_hosts=http_hosts, kube=kube)
        try:
            await stop.wait()
        finally:
            await running.stop(grace)
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)


