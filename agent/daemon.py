"""``memtopo serve``: the long-running agent.

One asyncio loop owns the published state. Discovery (blocking: hwloc, sysfs, vendor tools) runs
in a child the discovery helper forks (discovery/isolated.py), or on a thread of its own
(``discovery.isolate = false``); rescans are triggered by udev events, SIGHUP and a slow periodic
timer, and are debounced so a burst of hotplug events costs one discovery. A udev event's rescan
reruns only the probes its subsystem reaches (discovery/changes.py); SIGHUP, the periodic timer and
anything unclassified rescan everything. The gRPC server (Unix socket through
the credential-checking front, optional TLS TCP), the controller link and the HTTP health endpoint
all read the same state. systemd hears READY=1 once the first discovery is published and the
servers listen, WATCHDOG=1 from the loop itself (so a wedged loop is restarted), and STOPPING=1 on
SIGTERM, after which watchers get a closing event, in-flight plans finish and the link closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2

from memtopo import __version__
from memtopo.addresses import AddressError
from memtopo.apply.engine import Engine
from memtopo.apply.host import Host
from memtopo.backoff import Backoff
from memtopo.discovery import changes
from memtopo.discovery.capture import context_for
from memtopo.discovery.changes import Change
from memtopo.discovery.isolated import Discovered, DiscoveryHelper
from memtopo.discovery.source import ProbeContext
from memtopo.grpcserve import grpc_server
from memtopo.httpserve import ListenError
from memtopo.logs import Throttle, get_logger
from memtopo.ports import AddressInUseError, check_free
from memtopo.v1 import topology_pb2 as pb

from . import peers, transport
from .config import AgentConfig, ConfigError
from .health import HealthServer, LoopLiveness, start_health_server
from .link import ControllerLink, LinkState
from .metrics import AgentMetrics, plan_outcome
from .node_service import SERVICE_NAME, NodeAgentService, PlanRunner
from .sdnotify import Notifier
from .sockets import SocketInUseError
from .state import TopologyState
from .tasks import Supervisor

if TYPE_CHECKING:
    from memtopo.hostfs import HostFS

    from .enforce import Enforcer, PodReporter, PodSource
    from .k8s_pods import InformerPods

log = get_logger(component="agent")

UDEV_SUBSYSTEMS = ("pci", "cxl", "memory", "cpu", "dax", "node")
# The loop ticks at least this often even without a systemd watchdog, for /healthz.
TICK_SECONDS = 5.0
# A stop (SIGTERM) ends the process within this many seconds, below the unit's TimeoutStopSec=30.
STOP_DEADLINE_SECONDS = 20.0
# A discovery child still running after this long is killed; the next rescan starts a new one.
ISOLATED_DISCOVERY_LIMIT_SECONDS = 3600.0
VERSION = __version__
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

    source: str  # what names its addresses in an error ("command line")

    def addresses(self) -> Mapping[str, str]:
        """The TCP addresses it will listen on, by the option that gave each (checked with the
        agent's own before anything starts)."""

    async def start(self) -> str:
        """Starts it (ConfigError when it cannot listen); the loopback address the agent's link dials."""

    async def stop(self) -> None: ...


class Agent:
    def __init__(self, config: AgentConfig, notifier: Notifier | None = None,
                 sidecar: Sidecar | None = None, pod_source: PodSource | None = None,
                 pod_reporter: PodReporter | None = None) -> None:
        self.config = config
        # The API side of kubernetes.enforce (agent/enforce.py's seams): given by whoever builds the
        # agent (tests, benches), else the API server's (agent/k8s_pods.py), made when it starts.
        self.pod_source, self.pod_reporter = pod_source, pod_reporter
        self.pod_informer: InformerPods | None = None
        self.enforcer: Enforcer | None = None
        self._enforce_problem = "not started"
        self.sidecar = sidecar
        self.notifier = notifier or Notifier.from_environment()
        self.state = TopologyState()
        self.metrics = AgentMetrics()
        self.liveness = LoopLiveness(max_silence=max(3 * TICK_SECONDS, 30.0))
        self._ready = _Readiness()
        self._rescan = asyncio.Event()
        self._stop = asyncio.Event()
        # What the events since the last rescan say may have changed (None: no event yet).
        self._rescan_change: Change | None = None
        # Where discoveries run: the helper (discovery.isolate), else a Rescanner on this process's
        # threads (discovery.discover, imported when first used: an isolated agent never loads it).
        self._helper: DiscoveryHelper | None = None
        self._rescanner: Any = None
        self.link: ControllerLink | None = None
        self.server: grpc.aio.Server | None = None
        self.read_server: grpc.aio.Server | None = None
        self.health_server: HealthServer | None = None
        self.socket_path = config.listen.socket
        self.tcp_port: int | None = None
        self.engine: Engine | None = None
        self.k8s_publisher: Any = None  # agent.k8s_publisher.Publisher when [kubernetes] is enabled
        # Read by the health thread: plain attributes, each assignment atomic.
        self.discovery_started: float | None = None
        self.discovery_overdue = False
        # `memtopo serve` sets it: a stop that overruns STOP_DEADLINE_SECONDS ends the process.
        self.exit_on_stop_overrun = False
        self._overrun_timer: threading.Timer | None = None
        self._throttle = Throttle()
        # Called once the agent serves (its listeners bound, the first generation published): the
        # command line prints what a person can do with it, at the addresses actually bound.
        self.on_ready: Callable[[], None] | None = None
        # The rescan loop, the controller link and the publisher: restarted when they fail (agent/tasks.py).
        self.tasks = Supervisor(self._stop.is_set, lambda name: self.metrics.task_restarts.labels(name).inc())

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
        if self.config.kubernetes.enforce:
            checks["enforce"] = self.enforcer.status()[1] if self.enforcer else self._enforce_problem
            if self.pod_informer is not None:
                checks["enforce_pods"] = self.pod_informer.status()
        tasks_ok = True
        for name, (ok, text) in self.tasks.checks().items():
            checks[name] = text
            tasks_ok = tasks_ok and ok
        started, overdue = self.discovery_started, self.discovery_overdue
        if overdue and started is not None:
            # Unready: what is served may no longer be the host. The loop itself is fine (/healthz).
            checks["discovery"] += (f"; stale: a rescan has run {time.monotonic() - started:.0f}s, over "
                                    f"discovery.deadline_seconds ({self.config.discovery.deadline_seconds:g}s)")
        return r.discovered and r.listening and not bad and k8s_ok and tasks_ok and not overdue, checks

    # ---- triggers -----------------------------------------------------------------------------------
    def request_rescan(self, reason: str, change: Change | None = None) -> None:
        """A rescan soon; ``change`` is what may have changed (None: anything, a full rescan)."""
        change = change if change is not None else changes.full(reason)
        self._rescan_change = change if self._rescan_change is None else self._rescan_change | change
        self._rescan.set()

    def request_stop(self) -> None:
        self._stop.set()
        self._arm_stop_deadline()

    def _arm_stop_deadline(self) -> None:
        """After a stop begins, the process ends within STOP_DEADLINE_SECONDS whatever still runs
        (a thread stuck in a probe or a tool): systemd's TimeoutStopSec would otherwise SIGKILL it,
        and a process that never exits is never restarted."""
        if not self.exit_on_stop_overrun or self._overrun_timer is not None:
            return

        def overrun() -> None:
            log.error("agent_stop_overrun", seconds=STOP_DEADLINE_SECONDS,
                      threads=sorted(t.name for t in threading.enumerate() if t is not threading.current_thread()))
            # No logging.shutdown(): it takes handler locks a stuck thread may hold (each event
            # is flushed as it is written anyway).
            os._exit(EXIT_FAILURE)

        self._overrun_timer = threading.Timer(STOP_DEADLINE_SECONDS, overrun)
        self._overrun_timer.name = "memtopo-stop-deadline"
        self._overrun_timer.daemon = True
        self._overrun_timer.start()

    # ---- discovery ----------------------------------------------------------------------------------
    def _discover_here(self, ctx: ProbeContext, change: Change, generation: int) -> Discovered:
        if self._rescanner is None:
            from memtopo.discovery.discover import Rescanner

            self._rescanner = Rescanner(ctx)
        # The operator's name for the node wins (a Kubernetes node name need not be the hostname).
        topo = self._rescanner.discover(change, generation=generation, node_name=self.config.node_name)
        return Discovered(topo, topo.SerializeToString(), tuple(sorted(self._rescanner.ran)))

    async def _discover_isolated(self, ctx: ProbeContext, change: Change, generation: int) -> Discovered:
        # Not bounded by the deadline: past it the rescan is reported overdue, as on a thread; a
        # stop cancels this and so kills the helper and its child.
        if self._helper is None:
            self._helper = DiscoveryHelper()
        root = None if ctx.libraries_live else str(ctx.fs.root)
        return await self._helper.discover(root, change=change, node_name=self.config.node_name,
                                           generation=generation, timeout=ISOLATED_DISCOVERY_LIMIT_SECONDS)

    def _as_named(self, found: Discovered) -> Discovered:
        """``found`` with the root the operator named: a tarball's temporary extraction directory
        means nothing to a reader. The source root is outside the fingerprint, so only the bytes change."""
        if self.config.root in ("", "/") or found.topology.source_root == self.config.root:
            return found
        found.topology.source_root = self.config.root
        return replace(found, payload=found.topology.SerializeToString())

    def _start_discovery(self, ctx: ProbeContext, change: Change) -> asyncio.Future[Discovered]:
        """One discovery: in a child of the discovery helper (``discovery.isolate``; cancelling the
        future kills both), else on its own daemon thread. Not the loop's executor: a probe stuck in
        the kernel (a hung NFS mount, a wedged driver) would keep the process alive at exit, because
        executor threads are joined then; a daemon thread is left behind."""
        generation = self.state.generation + 1  # what it is published as, if it is new
        if self.config.discovery.isolate:
            return asyncio.ensure_future(self._discover_isolated(ctx, change, generation))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Discovered] = loop.create_future()

        def settle(value: Discovered | None, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)  # type: ignore[arg-type]

        def work() -> None:
            found: Discovered | None = None
            try:
                found, exc = self._discover_here(ctx, change, generation), None
            except BaseException as e:  # delivered to the loop, which decides
                exc = e
            with contextlib.suppress(RuntimeError):  # the loop is gone: the agent has stopped
                loop.call_soon_threadsafe(settle, found, exc)

        threading.Thread(target=work, name="memtopo-discovery", daemon=True).start()
        return fut

    async def _await_discovery(self, fut: asyncio.Future[Discovered], reasons: str) -> bool:
        """Wait for ``fut`` until it is done (True) or a stop is requested (False). Past the
        deadline it is reported as overdue: the topology being served may be stale."""
        stop = asyncio.ensure_future(self._stop.wait())
        waiting: set[asyncio.Future[Any]] = {fut, stop}
        try:
            await asyncio.wait(waiting, timeout=self.config.discovery.deadline_seconds,
                               return_when=asyncio.FIRST_COMPLETED)
            if fut.done() or self._stop.is_set():
                return fut.done()
            self.discovery_overdue = True
            self.metrics.discovery_overdue.set(1)
            self.metrics.discoveries_overdue.inc()
            log.error("discovery_overdue", trigger=reasons, deadline_seconds=self.config.discovery.deadline_seconds,
                      generation=self.state.generation)
            self.notifier.status(f"discovery overdue; serving generation {self.state.generation}")
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            return fut.done()
        finally:
            stop.cancel()

    async def _discover_and_publish(self, ctx: ProbeContext, change: Change) -> None:
        reasons = ",".join(sorted(set(change.reasons))) or "periodic"
        started = time.perf_counter()
        self.discovery_started = time.monotonic()
        fut = self._start_discovery(ctx, change)
        try:
            if not await self._await_discovery(fut, reasons):
                fut.cancel()  # a child process is killed; a thread is left to the process's exit
                return
        finally:
            if self.discovery_overdue and fut.done():
                log.warning("discovery_finished_late", trigger=reasons,
                            seconds=round(time.perf_counter() - started, 3))
            if fut.done():
                self.discovery_started = None
                self.discovery_overdue = False
                self.metrics.discovery_overdue.set(0)
        try:
            found = self._as_named(fut.result())
        except Exception as exc:  # a probe bug must not kill the agent: keep serving the last topology
            self.metrics.observe_discovery(time.perf_counter() - started, "error")
            log.error("discovery_failed", error=repr(exc), trigger=reasons)
            return
        elapsed = time.perf_counter() - started
        self.metrics.observe_discovery(elapsed, "ok")
        topo = found.topology
        # Which probes ran: "all", or the ones the change reached (the others' results were kept).
        rerun = "all" if change.everything else ",".join(found.ran)
        pub = self.state.publish(topo, found.payload)
        if pub is None:
            log.debug("discovery_unchanged", trigger=reasons, seconds=round(elapsed, 4), rerun=rerun)
            return
        self.metrics.set_topology(topo)
        # Unavailable is not degraded: a vendor that is simply absent (no AMD GPU, no npu-smi) is no fault.
        degraded = [s.source for s in topo.sources if s.state == pb.SOURCE_STATE_DEGRADED]
        log.info("generation_published", node=topo.node_name, generation=pub.generation,
                 fingerprint=pub.fingerprint[:16], trigger=reasons, seconds=round(elapsed, 4), rerun=rerun,
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
            change, self._rescan_change = self._rescan_change or changes.full("periodic"), None
            await self._discover_and_publish(ctx, change)

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
                reason = f"udev:{device.subsystem}:{device.action}"
                pci_id = device.properties.get("PCI_ID") if device.subsystem == changes.PCI else None
                self.request_rescan(reason, changes.of_uevent(device.subsystem or "", pci_id, reason))

        asyncio.get_running_loop().add_reader(monitor.fileno(), readable)
        return monitor

    # ---- servers ------------------------------------------------------------------------------------
    async def _start_grpc(self, plans: PlanRunner) -> tuple[grpc.aio.Server, transport.Front]:
        cfg = self.config.listen
        service = NodeAgentService(self.state, plans,
                                   lambda ctx: peers.authorize_apply(ctx, cfg.socket_group or None),
                                   max_watchers=cfg.max_watchers, stall_seconds=cfg.watch_stall_seconds,
                                   events=self._service_event)
        options: list[tuple[str, Any]] = [
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            # GOAWAY to a connection with no call in progress for listen.idle_seconds (the front
            # also closes silent relayed connections; the read socket has only this).
            ("grpc.max_connection_idle_ms", int(cfg.idle_seconds * 1000))]
        self.health_servicer = health.aio.HealthServicer()

        def make_server(extra: list[tuple[str, Any]]) -> grpc.aio.Server:
            srv = grpc_server((SERVICE_NAME,), self.health_servicer, options=options + extra,
                              interceptors=[self.metrics.interceptor()], receive_limit=False)
            srv.add_generic_rpc_handlers((service.handler(),))
            return srv

        server = make_server([])
        # The read socket on a server of its own, so that grpc's cap on its connections counts only
        # them: its peers are not identified, and the front's connections to `server` (root's
        # among them) must never be refused because of them.
        self.read_server = (make_server([("grpc.max_allowed_incoming_connections", cfg.max_connections)])
                            if cfg.read_socket else None)
        limits = peers.ConnectionLimits(max_connections=cfg.max_connections,
                                        per_user=cfg.max_connections_per_user,
                                        reserved=cfg.reserved_connections, idle_seconds=cfg.idle_seconds)
        with self._config_key("listen.socket"):
            front = (transport.prepare_local(server, cfg.socket, cfg.socket_mode, cfg.socket_group or None,
                                             limits=limits, observer=self._connection_event)
                     if cfg.socket else transport.Front(server, limits=limits, observer=self._connection_event))
        try:
            if cfg.read_socket:
                # Readers skip the credential-recording relay there; ApplyPlan is refused on it.
                assert self.read_server is not None
                with self._config_key("listen.read_socket"):
                    front.listen_direct(self.read_server, cfg.read_socket, cfg.socket_mode, cfg.socket_group or None)
            if cfg.tcp:
                # Through the front too: grpc's own TLS port cannot make a client certificate optional.
                with self._config_key("listen.tls_cert"):
                    tls = transport.server_tls_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca or None)
                with self._config_key("listen.tcp"):
                    self.tcp_port = front.listen_tcp(cfg.tcp, tls)
        except BaseException:
            front.discard()
            raise
        await server.start()
        if self.read_server is not None:
            await self.read_server.start()
        await front.start()
        for name in ("", SERVICE_NAME):
            await self.health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return server, front

    @contextlib.contextmanager
    def _config_key(self, key: str) -> Iterator[None]:
        """A listener that cannot be set up from what ``key`` says (a path that cannot be created, a
        port in use, an unusable certificate) is a configuration error naming the key: exit 78, no
        restart loop. A live agent on the socket is not (SocketInUseError goes through)."""
        try:
            yield
        except SocketInUseError:
            raise
        except (peers.TransportError, ListenError) as exc:
            raise ConfigError(key, str(exc), self.config.source) from None

    def _connection_event(self, what: str, limit: str) -> None:
        # From the front's relay thread: counters only (prometheus_client's are thread-safe).
        if what == "refused":
            self.metrics.connections_refused.labels(limit).inc()
        elif what == "idle_closed":
            self.metrics.connections_idle_closed.inc()

    def _service_event(self, what: str, method: str, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        """Every occurrence counted; one log event per peer and kind per minute, with how many
        were held back since the last one: garbage from one peer must not flood the journal."""
        if what == "undecodable":
            self.metrics.undecodable_requests.labels(f"/{SERVICE_NAME}/{method}").inc()
        elif what == "watch_refused":
            self.metrics.watchers_refused.inc()
        elif what == "watch_stalled":
            self.metrics.watchers_stalled.inc()
        peer = peers.peer_label(context)
        held_back = self._throttle.allow(f"{what}:{peer}")
        if held_back is not None:
            log.warning(f"grpc_{what}", method=method, peer=peer, held_back=held_back,
                        interval_seconds=self._throttle.interval)

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
                              on_state=on_state, on_reconnect=self.metrics.count_reconnect, version=VERSION,
                              stored_result=plans.result)

    # ---- main ---------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig, handler in ((signal.SIGTERM, self.request_stop), (signal.SIGINT, self.request_stop),
                             (signal.SIGHUP, lambda: self.request_rescan("sighup"))):
            loop.add_signal_handler(sig, handler)
        self.liveness.tick()
        self._check_addresses()
        # What has started, undone in reverse if a later step fails: a start that cannot complete
        # leaves no listener and no socket file behind (and exits 78 when a config key is the cause).
        started: list[Callable[[], Awaitable[None]]] = []
        try:
            return await self._run(started)
        except BaseException:
            for undo in reversed(started):
                with contextlib.suppress(Exception):
                    await undo()
            raise

    def _check_addresses(self) -> None:
        """Every TCP address this process will listen on, bound at once before any listener starts: a
        taken one (or one given twice) is a ConfigError naming its key, with nothing started."""
        own = {"health.listen": self.config.health.listen, "listen.tcp": self.config.listen.tcp}
        extra = dict(self.sidecar.addresses()) if self.sidecar is not None else {}
        try:
            check_free({**own, **extra})
        except (AddressInUseError, AddressError) as exc:
            key = getattr(exc, "key", "")
            source = self.sidecar.source if self.sidecar is not None and key in extra else self.config.source
            raise ConfigError(key, str(exc), source) from None

    async def _run(self, started: list[Callable[[], Awaitable[None]]]) -> int:
        if self.config.health.listen:
            with self._config_key("health.listen"):
                self.health_server = start_health_server(self.config.health.listen, self,
                                                         hosts=self.config.health.hosts)
            started.append(self._stop_health)
        if self.sidecar is not None:
            # Before discovery: the controller is there when the link first dials it.
            sidecar = self.sidecar
            await self._start_sidecar(sidecar)
            started.append(sidecar.stop)
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
        monitor = None
        with context_for(self.config.root) as ctx:
            # Listening before the first discovery: a change while it runs still triggers a rescan.
            if self.config.discovery.udev and self.config.root in ("", "/"):
                monitor = self._start_udev()
            started.append(self._close_helper)  # the helper's process, whatever fails after this
            await self._discover_and_publish(ctx, changes.full("start"))
            if self._stop.is_set():  # stopped during the first discovery: nothing else was started
                if monitor is not None:
                    asyncio.get_running_loop().remove_reader(monitor.fileno())
                for undo in reversed(started):
                    await undo()
                started.clear()
                log.info("agent_stopped", generation=self.state.generation)
                return EXIT_OK
            self._ready.discovered = self.state.current is not None
            server, front = await self._start_grpc(plans)
            self.server = server

            async def stop_servers() -> None:
                await server.stop(None)
                if self.read_server is not None:
                    await self.read_server.stop(None)
                await front.stop()

            started.append(stop_servers)
            self._ready.listening = True
            for name in ("rescan_loop", "controller_link", "kubernetes_publisher", "pod_informer", "cpu_enforcement"):
                self.metrics.task_restarts.labels(name)
            self.tasks.start("rescan_loop", lambda: self._rescan_loop(ctx))
            link = self.link = self._start_link(plans)
            if link is not None:
                self.tasks.start("controller_link", link.run)
            if self.config.kubernetes.enabled:
                from memtopo.agent.k8s_publisher import publisher_for

                publisher = self.k8s_publisher = publisher_for(self.config.kubernetes, self.config.node_name, ctx.fs,
                                                               self.state, self.metrics.registry)
                self.tasks.start("kubernetes_publisher", publisher.run)
            if self.config.kubernetes.enforce:
                enforcer = self.enforcer = self._start_enforcer(ctx.fs)
                if enforcer is not None:
                    if self.k8s_publisher is not None:
                        # The object's available CPUs follow what the enforcement pins.
                        self.k8s_publisher.follow_enforcement(enforcer.exclusive)
                        enforcer.on_exclusive_change = self.k8s_publisher.poke
                    self.tasks.start("cpu_enforcement", enforcer.run)
            # Serving: from here a stop is the graceful one below.
            started.clear()
            self.notifier.ready(f"serving generation {self.state.generation}")
            log.info("agent_ready", node=self.config.node_name, generation=self.state.generation,
                     socket=self.socket_path, tcp_port=self.tcp_port,
                     health=self.health_server.url if self.health_server else None,
                     controller=self.config.controller.address or None)
            if self.on_ready is not None:
                self.on_ready()
            await self._tick_until_stopped()
            await self._shutdown(server, front, plans, monitor)
        return EXIT_OK

    def _start_enforcer(self, fs: HostFS) -> Enforcer | None:
        if self.pod_source is None and self.pod_reporter is None:
            from memtopo.k8s.kubeapi import KubeApiError
            from memtopo.k8s.names import InvalidNameError

            from .k8s_pods import pod_api_for

            try:
                informer, reporter = pod_api_for(self.config.kubernetes, self.config.node_name)
            except (KubeApiError, InvalidNameError) as exc:
                self._enforce_problem = f"no pod source: {exc}; nothing is enforced"
                log.error("enforce_without_pod_source", key="kubernetes.enforce", error=str(exc),
                          message="the pods bound to this node cannot be read; nothing is enforced")
                return None
            self.pod_source, self.pod_reporter, self.pod_informer = informer, reporter, informer
            self.tasks.start("pod_informer", informer.run)
        if self.pod_source is None or self.pod_reporter is None:
            log.error("enforce_without_pod_source", key="kubernetes.enforce",
                      message="a pod source was given without a reporter, or a reporter without a pod source; "
                              "nothing is enforced")
            return None
        from memtopo.agent.enforce import EngineMigrator, enforcer_for

        def topology() -> pb.MemoryTopology | None:
            cur = self.state.current
            return cur.topology if cur is not None else None

        migrate = EngineMigrator(self.engine) if self.engine is not None else None
        return enforcer_for(self.config.kubernetes, self.config.node_name, fs, topology, self.pod_source,
                            self.pod_reporter, self.metrics.registry, migrate)

    async def _stop_health(self) -> None:
        if self.health_server is not None:
            self.health_server.stop()

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

    async def _tick_until_stopped(self) -> None:
        """Watchdog pings until a stop is requested. A background task that fails meanwhile is
        restarted by the supervisor (and shown in /readyz), not a reason to stop: the gRPC server,
        health and plan application go on serving."""
        interval = min(TICK_SECONDS, self.notifier.watchdog_interval() or TICK_SECONDS)
        while not self._stop.is_set():
            self.liveness.tick()
            self.notifier.watchdog()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._stop.wait()

    async def _shutdown(self, server: grpc.aio.Server, front: transport.Front, plans: PlanRunner,
                        monitor: Any) -> None:
        log.info("agent_stopping", generation=self.state.generation)
        self._arm_stop_deadline()
        self.notifier.stopping()
        if monitor is not None:
            asyncio.get_running_loop().remove_reader(monitor.fileno())
        await self.health_servicer.enter_graceful_shutdown()
        self.state.close()  # watchers get their closing event
        await plans.drain()  # in-flight plans finish (or roll back) inside the engine
        if self.link is not None:
            await self.link.stop()
        await self.tasks.stop()
        if self.read_server is not None:
            await asyncio.gather(server.stop(grace=2.0), self.read_server.stop(grace=2.0))
        else:
            await server.stop(grace=2.0)  # answers in flight still pass through the front
        await front.stop()
        if self.sidecar is not None:
            await self.sidecar.stop()
        await self._close_helper()
        if self.health_server is not None:
            self.health_server.stop()
        log.info("agent_stopped")

    async def _close_helper(self) -> None:
        if self._helper is not None:
            await self._helper.close()

