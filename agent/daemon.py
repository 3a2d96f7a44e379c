"""``memtopo serve``: the long-running agent.

One asyncio loop owns the published state. Discovery (blocking: hwloc, sysfs, vendor tools) runs
in a worker thread; rescans are triggered by udev events, SIGHUP and a slow periodic timer, and are
debounced so a burst of hotplug events costs one discovery. The gRPC server (Unix socket through
the credential-checking front, optional TLS TCP), the controller link and the HTTP health endpoint
all read the same state. systemd hears READY=1 once the first discovery is published and the
servers listen, WATCHDOG=1 from the loop itself (so a wedged loop is restarted), and STOPPING=1 on
SIGTERM, after which watchers get a closing event, in-flight plans finish and the link closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memtopo.apply.engine import Engine
from memtopo.apply.host import Host
from memtopo.discovery.capture import open_root
from memtopo.discovery.discover import discover
from memtopo.discovery.fingerprint import fingerprint
from memtopo.discovery.source import ProbeContext
from memtopo.v1 import topology_pb2 as pb

from . import transport
from .config import AgentConfig
from .health import HealthServer, LoopLiveness, start_health_server
from .link import Backoff, ControllerLink, LinkState
from .logs import get_logger
from .metrics import AgentMetrics, plan_outcome
from .node_service import SERVICE_NAME, NodeAgentService, PlanRunner
from .sdnotify import Notifier
from .state import TopologyState

log = get_logger(component="agent")

UDEV_SUBSYSTEMS = ("pci", "cxl", "memory", "cpu", "dax", "node")
# The loop ticks at least this often even without a systemd watchdog, for /healthz.
TICK_SECONDS = 5.0
VERSION = "0.1.0"
EXIT_OK = 0
EXIT_FAILURE = 1


@dataclass
class _Readiness:
    discovered: bool = False
    listening: bool = False
    checks: dict[str, str] = field(default_factory=dict)


class Sidecar(Protocol):
    """A controller started in the agent's process (``serve --with-controller``), which the agent links
    to over loopback; the command line provides it, so the agent never imports the controller."""

    async def start(self) -> str:
        """Starts it; the loopback address the agent's link dials."""

    async def stop(self) -> None: ...


class Agent:
    def __init__(self, config: AgentConfig, notifier: Notifier | None = None,
                 sidecar: Sidecar | None = None) -> None:
        self.config = config
        self.sidecar = sidecar
        self.notifier = notifier or Notifier.from_environment()
        self.state = TopologyState()
        self.metrics = AgentMetrics()
        self.liveness = LoopLiveness(max_silence=max(3 * TICK_SECONDS, 30.0))
        self._ready = _Readiness()
        self._rescan = asyncio.Event()
        self._stop = asyncio.Event()
        self._rescan_reasons: set[str] = set()
        self.link: ControllerLink | None = None
        self.server: grpc.aio.Server | None = None
        self.health_server: HealthServer | None = None
        self.socket_path = config.listen.socket
        self.tcp_port: int | None = None
        self.engine: Engine | None = None
        self.k8s_publisher: Any = None  # agent.k8s_publisher.Publisher when [kubernetes] is enabled

    # ---- HealthSource (read from the HTTP threads) -------------------------------------------------
    def alive(self) -> tuple[bool, str]:
        return self.liveness.alive()

    def ready(self) -> tuple[bool, dict[str, str]]:
        r = self._ready
        checks = {
            "discovery": f"generation {self.state.generation}" if r.discovered else "pending",
            "servers": "listening" if r.listening else "starting",
            "controller_link": self.link.link_state.value if self.link else "not configured",
        }
        engine = self.engine
        bad = engine.unreadable if engine is not None else []
        checks["apply_journals"] = engine.unreadable_message()[:1000] if engine is not None and bad else "ok"
        # A NodeResourceTopology behind the topology makes the pod unready (the agent keeps serving).
        k8s_ok, checks["kubernetes"] = self.k8s_publisher.status() if self.k8s_publisher else (True, "not configured")
        return r.discovered and r.listening and not bad and k8s_ok, checks

    # ---- triggers -----------------------------------------------------------------------------------
    def request_rescan(self, reason: str) -> None:
        self._rescan_reasons.add(reason)
        self._rescan.set()

    def request_stop(self) -> None:
        self._stop.set()

    # ---- discovery ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _context(self) -> Iterator[ProbeContext]:
        root = self.config.root
        if root in ("", "/"):
            yield ProbeContext.live()
            return
        with open_root(root) as path:
            yield ProbeContext.at_root(path)

    def _discover(self, ctx: ProbeContext) -> pb.MemoryTopology:
        topo = discover(ctx)
        if self.config.node_name:
            # The operator's name for the node wins (a Kubernetes node name need not be the hostname).
            topo.node_name = self.config.node_name
            topo.fingerprint = fingerprint(topo)
        return topo

    async def _discover_and_publish(self, ctx: ProbeContext, reasons: str) -> None:
        started = time.perf_counter()
        try:
            topo = await asyncio.to_thread(self._discover, ctx)
        except Exception as exc:  # a probe bug must not kill the agent: keep serving the last topology
            self.metrics.observe_discovery(time.perf_counter() - started, "error")
            log.error("discovery_failed", error=repr(exc), trigger=reasons)
            return
        elapsed = time.perf_counter() - started
        self.metrics.observe_discovery(elapsed, "ok")
        pub = self.state.publish(topo)
        if pub is None:
            log.debug("discovery_unchanged", trigger=reasons, seconds=round(elapsed, 4))
            return
        self.metrics.set_topology(topo)
        # Unavailable is not degraded: a vendor that is simply absent (no AMD GPU, no npu-smi) is no fault.
        degraded = [s.source for s in topo.sources if s.state == pb.SOURCE_STATE_DEGRADED]
        log.info("generation_published", node=topo.node_name, generation=pub.generation,
                 fingerprint=pub.fingerprint[:16], trigger=reasons, seconds=round(elapsed, 4),
                 numa_nodes=len(topo.numa_nodes), accelerators=len(topo.accelerators),
                 degraded_sources=degraded)
        self.notifier.status(f"generation {pub.generation}, {len(topo.numa_nodes)} NUMA nodes")

    async def _rescan_loop(self, ctx: ProbeContext) -> None:
        cfg = self.config.discovery
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rescan.wait(), cfg.rescan_seconds)
            if self._stop.is_set():
                return
            if cfg.debounce_seconds > 0:
                # Collect the rest of a burst (a hot-added GPU brings a dozen udev events).
                await asyncio.sleep(cfg.debounce_seconds)
            self._rescan.clear()
            reasons = ",".join(sorted(self._rescan_reasons)) or "periodic"
            self._rescan_reasons.clear()
            await self._discover_and_publish(ctx, reasons)

    def _start_udev(self) -> Any:
        """A netlink monitor on the topology subsystems; None when netlink is unusable."""
        try:
            import pyudev

            # The kernel's own uevents, not udevd's re-broadcast: the agent rereads sysfs and needs
            # no udev rule to have run, and hosts without udevd (containers, minimal images) get
            # only these (a monitor on the "udev" source hears nothing there).
            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
            for subsystem in UDEV_SUBSYSTEMS:
                monitor.filter_by(subsystem)
            monitor.start()
        except Exception as exc:  # no netlink access: the periodic rescan still runs
            log.warning("udev_unavailable", error=repr(exc))
            return None

        def readable() -> None:
            while (device := monitor.poll(timeout=0)) is not None:
                self.request_rescan(f"udev:{device.subsystem}:{device.action}")

        asyncio.get_running_loop().add_reader(monitor.fileno(), readable)
        return monitor

    # ---- servers ------------------------------------------------------------------------------------
    async def _start_grpc(self, plans: PlanRunner) -> tuple[grpc.aio.Server, transport.Front]:
        cfg = self.config.listen
        service = NodeAgentService(self.state, plans,
                                   lambda ctx: transport.authorize_apply(ctx, cfg.socket_group or None))
        server = grpc.aio.server(interceptors=[self.metrics.interceptor()], options=[
            ("grpc.max_send_message_length", 64 << 20), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000)])
        server.add_generic_rpc_handlers((service.handler(),))
        self.health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        front = (transport.prepare_local(server, cfg.socket, cfg.socket_mode, cfg.socket_group or None)
                 if cfg.socket else transport.Front(server))
        if cfg.read_socket:
            # Readers skip the credential-recording relay there; ApplyPlan is refused on it.
            front.listen_direct(server, cfg.read_socket, cfg.socket_mode, cfg.socket_group or None)
        if cfg.tcp:
            # Through the front too: grpc's own TLS port cannot make a client certificate optional.
            tls = transport.server_tls_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca or None)
            self.tcp_port = front.listen_tcp(cfg.tcp, tls)
        await server.start()
        await front.start()
        for name in ("", SERVICE_NAME):
            await self.health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return server, front

    def _start_link(self, plans: PlanRunner) -> ControllerLink | None:
        cfg = self.config.controller
        if not cfg.address:
            return None
        creds = None if cfg.insecure else transport.channel_credentials(
            cfg.tls_ca or None, cfg.tls_cert or None, cfg.tls_key or None)
        cur = self.state.current
        boot_id = cur.topology.boot_id if cur else ""

        def on_state(s: LinkState) -> None:
            self.metrics.set_link_state(s.value)
            log.info("controller_link_state", state=s.value, address=cfg.address)

        return ControllerLink(cfg.address, self.state, self.config.node_name or (cur.topology.node_name if cur else ""),
                              boot_id, plans.apply, credentials=creds, heartbeat_seconds=cfg.heartbeat_seconds,
                              backoff=Backoff(cfg.backoff_initial_seconds, cfg.backoff_max_seconds),
                              on_state=on_state, on_reconnect=self.metrics.count_reconnect, version=VERSION)

    # ---- main ---------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig, handler in ((signal.SIGTERM, self.request_stop), (signal.SIGINT, self.request_stop),
                             (signal.SIGHUP, lambda: self.request_rescan("sighup"))):
            loop.add_signal_handler(sig, handler)
        self.liveness.tick()
        if self.config.health.listen:
            self.health_server = start_health_server(self.config.health.listen, self)
        self.notifier.status("discovering")
        engine = Engine(Host.live(), self._current_topology, self.config.apply_state_dir,
                        self.config.apply)
        plans = PlanRunner(engine, observe=self._observe_plan)
        recovered = await asyncio.to_thread(engine.recover)
        for res in recovered:
            log.warning("plan_recovered", plan_id=res.plan_id, state=plan_outcome(res), message=res.message)
        for js in engine.unreadable:
            log.error("plan_journal_unreadable", key=js.key, path=js.path, reason=js.unreadable,
                      action="restore the host by hand, then remove the pending marker; applies are refused")
        self.engine = engine
        self.metrics.track_unreadable_journals(lambda: len(engine.unreadable))
        tasks: list[asyncio.Task[Any]] = []
        monitor = None
        with self._context() as ctx:
            # Listening before the first discovery: a change while it runs still triggers a rescan.
            if self.config.discovery.udev and self.config.root in ("", "/"):
                monitor = self._start_udev()
            await self._discover_and_publish(ctx, "start")
            self._ready.discovered = self.state.current is not None
            server, front = await self._start_grpc(plans)
            self.server = server
            self._ready.listening = True
            tasks.append(asyncio.create_task(self._rescan_loop(ctx), name="rescan_loop"))
            if self.sidecar is not None:
                await self._start_sidecar(self.sidecar)
            self.link = self._start_link(plans)
            if self.link is not None:
                tasks.append(asyncio.create_task(self.link.run(), name="controller_link"))
            if self.config.kubernetes.enabled:
                from memtopo.agent.k8s_publisher import publisher_for

                self.k8s_publisher = publisher_for(self.config.kubernetes, self.config.node_name, ctx.fs, self.state,
                                                   self.metrics.registry)
                tasks.append(asyncio.create_task(self.k8s_publisher.run(), name="kubernetes_publisher"))
            self.notifier.ready(f"serving generation {self.state.generation}")
            log.info("agent_ready", node=self.config.node_name, generation=self.state.generation,
                     socket=self.socket_path, tcp_port=self.tcp_port,
                     health=self.health_server.url if self.health_server else None,
                     controller=self.config.controller.address or None)
            failed = await self._tick_until_stopped(tasks)
            await self._shutdown(server, front, plans, tasks, monitor)
        return EXIT_FAILURE if failed else EXIT_OK

    async def _start_sidecar(self, sidecar: Sidecar) -> None:
        import dataclasses

        address = await sidecar.start()
        self.config = dataclasses.replace(self.config, controller=dataclasses.replace(
            self.config.controller, address=address, insecure=True))
        log.info("embedded_controller_started", address=address)

    def _current_topology(self) -> pb.MemoryTopology:
        cur = self.state.current
        if cur is None:
            raise RuntimeError("no topology discovered yet")
        return cur.topology

    def _observe_plan(self, result: Any) -> None:
        self.metrics.observe_plan(result)
        log.info("plan_handled", plan_id=result.plan_id, state=plan_outcome(result), message=result.message)

    async def _tick_until_stopped(self, tasks: list[asyncio.Task[Any]]) -> bool:
        """Watchdog pings until a stop is requested; True when a background task ended first.

        The rescan loop and the controller link run until stop: one that ends before is a bug, and an
        agent that kept pinging without it would look healthy while serving a frozen topology or
        never reaching the controller. It stops instead (exit 1: systemd's Restart=on-failure)."""
        interval = min(TICK_SECONDS, self.notifier.watchdog_interval() or TICK_SECONDS)
        stopped = asyncio.create_task(self._stop.wait())
        try:
            while not self._stop.is_set():
                ended = [t for t in tasks if t.done()]
                if ended:
                    for task in ended:
                        exc = None if task.cancelled() else task.exception()
                        log.error("agent_task_ended", task=task.get_name(), error=repr(exc) if exc else None)
                    self._stop.set()
                    return True
                self.liveness.tick()
                self.notifier.watchdog()
                await asyncio.wait({stopped, *tasks}, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
            return False
        finally:
            stopped.cancel()

    async def _shutdown(self, server: grpc.aio.Server, front: transport.Front, plans: PlanRunner,
                        tasks: list[asyncio.Task[Any]], monitor: Any) -> None:
        log.info("agent_stopping", generation=self.state.generation)
        self.notifier.stopping()
        if monitor is not None:
            asyncio.get_running_loop().remove_reader(monitor.fileno())
        await self.health_servicer.enter_graceful_shutdown()
        self.state.close()  # watchers get their closing event
        await plans.drain()  # in-flight plans finish (or roll back) inside the engine
        if self.link is not None:
            await self.link.stop()
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(grace=2.0)  # answers in flight still pass through the front
        await front.stop()
        if self.sidecar is not None:
            await self.sidecar.stop()
        if self.health_server is not None:
            self.health_server.stop()
        log.info("agent_stopped")

