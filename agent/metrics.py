"""The agent's Prometheus metrics, and a grpc.aio server interceptor that records RPC counts and latencies.

Every AgentMetrics owns its registry (never prometheus_client's global one): tests and benchmarks
create many agents in one process, and the global registry refuses a metric name twice.

State-like metrics (per-source status, controller link state) are enum-style gauges: one series per
possible state, 1 for the current one and 0 for the others. They are rendered by a small collector
from one stored value rather than by flipping several gauge children, so a scrape never sees two
states at 1 (or none) half-way through a change, and a source that disappears from the topology
disappears from the metrics instead of lingering with stale values.

gRPC: every finished call is counted by method and status code. Unary calls are timed in
`grpc_request_duration_seconds`; streams are counted when they end and timed in their own
`grpc_stream_duration_seconds` (with `grpc_streams_open` for the ones in progress). A WatchTopology
stream or a controller link lives for hours: in the request histogram it would turn every latency
quantile into "hours", and its buckets (µs to seconds) cannot describe a lifetime anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from time import perf_counter
from typing import Any, Final, Literal, cast, get_args

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from memtopo.v1 import plan_pb2 as planpb
from memtopo.v1 import topology_pb2 as pb

PREFIX: Final = "memtopo_"

# Discovery takes ~5 ms on a small VM and several seconds on a 64-node box with a hung vendor tool
# (each tool has its own timeout, so 30 s is the realistic ceiling).
DISCOVERY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Unary RPCs: GetTopology over the Unix socket answers from cached bytes in ~100 µs; ApplyPlan runs
# the apply engine (cgroup writes, page migration) and can take seconds.
RPC_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 5.0, 10.0)
# Streams (WatchTopology, the controller link) live from seconds (a reconnecting client) to days.
STREAM_BUCKETS: Final = (1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 6 * 3600.0, 24 * 3600.0, 7 * 24 * 3600.0)

DiscoveryOutcome = Literal["ok", "error"]
LinkState = Literal["disconnected", "connecting", "connected"]
PlanOutcome = Literal["applied", "unchanged", "rejected", "rolled_back", "failed", "dry_run"]
SourceStatusName = Literal["unspecified", "ok", "degraded", "unavailable"]

# Why the front refused a connection: every connection slot taken (root is exempt), the peer's user
# at its own cap, or the unprivileged share (all but listen.reserved_connections) taken.
CONNECTION_LIMITS: Final = ("max_connections", "per_user", "reserved")

LINK_STATES: Final[tuple[LinkState, ...]] = get_args(LinkState)
PLAN_OUTCOMES: Final[tuple[PlanOutcome, ...]] = get_args(PlanOutcome)
SOURCE_STATUSES: Final[tuple[SourceStatusName, ...]] = get_args(SourceStatusName)

_PLAN_OUTCOME: Final[Mapping[int, PlanOutcome]] = {
    planpb.PlanResult.STATE_APPLIED: "applied",
    planpb.PlanResult.STATE_UNCHANGED: "unchanged",
    planpb.PlanResult.STATE_REJECTED: "rejected",
    planpb.PlanResult.STATE_ROLLED_BACK: "rolled_back",
    planpb.PlanResult.STATE_FAILED: "failed",
    planpb.PlanResult.STATE_DRY_RUN: "dry_run",
}

_SOURCE_STATUS: Final[Mapping[int, SourceStatusName]] = {
    pb.SOURCE_STATE_UNSPECIFIED: "unspecified",
    pb.SOURCE_STATE_OK: "ok",
    pb.SOURCE_STATE_DEGRADED: "degraded",
    pb.SOURCE_STATE_UNAVAILABLE: "unavailable",
}


def plan_outcome(result: planpb.PlanResult) -> PlanOutcome:
    """The `plans_total` outcome of a result. A result without a state (or with one this build does
    not know) counts as failed: it is not a plan that worked, and alerts on failures should see it."""
    return _PLAN_OUTCOME.get(result.state, "failed")


class _StateSet(Collector):
    """An enum-style gauge family: for each key, one series per state, 1 for the current state."""

    def __init__(self, name: str, doc: str, key_label: str | None, state_label: str,
                 states: Sequence[str]) -> None:
        self._name = name
        self._doc = doc
        self._key_label = key_label
        self._state_label = state_label
        self._states = tuple(states)
        self._current: dict[str, str] = {}
        self._lock = threading.Lock()

    def set(self, key: str, state: str) -> None:
        self._check([state])
        with self._lock:
            self._current = {**self._current, key: state}

    def replace(self, current: Mapping[str, str]) -> None:
        self._check(current.values())
        with self._lock:
            self._current = dict(current)

    def _check(self, states: Iterable[str]) -> None:
        unknown = sorted({s for s in states if s not in self._states})
        if unknown:
            raise ValueError(f"{self._name}: unknown state {', '.join(unknown)} (known: {', '.join(self._states)})")

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._current)

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for key, current in sorted(self.snapshot().items()):
            for state in self._states:
                labels = [key, state] if self._key_label is not None else [state]
                family.add_metric(labels, 1.0 if state == current else 0.0)
        return [family]

    def _family(self) -> GaugeMetricFamily:
        labels = [self._key_label, self._state_label] if self._key_label is not None else [self._state_label]
        return GaugeMetricFamily(self._name, self._doc, labels=labels)


class _InfoGauge(Collector):
    """`<name>{<label>="<value>"} 1` once a value is set, nothing before: an Info metric would show an
    unlabelled 1 until then, which reads as a real (empty) fingerprint."""

    def __init__(self, name: str, doc: str, label: str) -> None:
        self._name = name
        self._doc = doc
        self._label = label
        self.value: str | None = None  # one reference assignment: atomic for a concurrent scrape

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self._name, self._doc, labels=[self._label])]

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self._name, self._doc, labels=[self._label])
        value = self.value
        if value is not None:
            family.add_metric([value], 1.0)
        return [family]


class AgentMetrics:
    """Everything the agent exports on /metrics. Thread-safe: discovery runs in a worker thread."""

    def __init__(self, *, process_metrics: bool = True) -> None:
        # The *_created series double every counter and histogram in the text format and nobody reads
        # them. The switch is process-wide in prometheus_client; the agent process has no other users.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.discovery_duration = Histogram(
            PREFIX + "discovery_duration_seconds", "Time one full discovery of the node took.",
            buckets=DISCOVERY_BUCKETS, registry=reg)
        self.discoveries = Counter(
            PREFIX + "discoveries", "Discoveries run, by outcome (error: no topology could be built).",
            ["outcome"], registry=reg)
        self.generation = Gauge(
            PREFIX + "topology_generation", "Generation of the topology the agent currently publishes.",
            registry=reg)
        self._fingerprint = _InfoGauge(
            PREFIX + "topology_fingerprint_info", "Content fingerprint of the published topology.", "fingerprint")
        reg.register(self._fingerprint)
        self._sources = _StateSet(
            PREFIX + "source_status", "Status of each discovery source in the published topology (1 = current).",
            "source", "status", SOURCE_STATUSES)
        reg.register(self._sources)
        self._link = _StateSet(
            PREFIX + "controller_link_state", "State of the link to the controller (1 = current).",
            None, "state", LINK_STATES)
        reg.register(self._link)
        self.controller_reconnects = Counter(
            PREFIX + "controller_reconnects", "Times the controller link was re-established after a loss.",
            registry=reg)
        self.plans = Counter(
            PREFIX + "plans", "Binding plans handled, by outcome.", ["outcome"], registry=reg)
        self.apply_unreadable_journals = Gauge(
            PREFIX + "apply_unreadable_journals",
            "Unfinished plan journals that cannot be read (kept for an operator; applies are refused).",
            registry=reg)
        self.grpc_requests = Counter(
            PREFIX + "grpc_requests", "gRPC calls finished, by full method name and status code.",
            ["method", "code"], registry=reg)
        self.grpc_duration = Histogram(
            PREFIX + "grpc_request_duration_seconds",
            "Latency of unary gRPC calls (streams are in grpc_stream_duration_seconds).",
            ["method"], buckets=RPC_BUCKETS, registry=reg)
        self.grpc_stream_duration = Histogram(
            PREFIX + "grpc_stream_duration_seconds", "Lifetime of streaming gRPC calls.",
            ["method"], buckets=STREAM_BUCKETS, registry=reg)
        self.grpc_streams_open = Gauge(
            PREFIX + "grpc_streams_open", "Streaming gRPC calls in progress (watchers, controller links).",
            ["method"], registry=reg)
        self.discovery_overdue = Gauge(
            PREFIX + "discovery_overdue",
            "1 while a discovery runs past discovery.deadline_seconds (the published topology may be stale).",
            registry=reg)
        self.discoveries_overdue = Counter(
            PREFIX + "discoveries_overdue", "Discoveries that ran past discovery.deadline_seconds.", registry=reg)
        self.undecodable_requests = Counter(
            PREFIX + "grpc_undecodable_requests", "gRPC requests whose message could not be decoded, by method.",
            ["method"], registry=reg)
        self.connections_refused = Counter(
            PREFIX + "connections_refused",
            "Connections to listen.socket/listen.tcp refused, by the limit that refused them.",
            ["reason"], registry=reg)
        self.connections_idle_closed = Counter(
            PREFIX + "connections_idle_closed", "Relayed connections closed after listen.idle_seconds without traffic.",
            registry=reg)
        self.watchers_refused = Counter(
            PREFIX + "watchers_refused", "WatchTopology calls refused at listen.max_watchers.", registry=reg)
        self.watchers_stalled = Counter(
            PREFIX + "watchers_stalled",
            "WatchTopology streams ended because an event did not leave within listen.watch_stall_seconds.",
            registry=reg)
        self.health_connection_events = Counter(
            PREFIX + "health_connection_events",
            "Health endpoint connections refused, closed for a newer one (the longest waiting first), "
            "closed idle or at a deadline, answered busy.", ["event"], registry=reg)
        self.task_restarts = Counter(
            PREFIX + "agent_task_restarts",
            "Background tasks (rescan loop, controller link, Kubernetes publisher) started again after they "
            "failed, by task.", ["task"], registry=reg)
        if process_metrics:
            # Unprefixed process_* names on purpose: that is what every dashboard and alert expects.
            ProcessCollector(registry=reg)

        # Series that exist from the start, so rate() and alerts work before the first event.
        for outcome in get_args(DiscoveryOutcome):
            self.discoveries.labels(outcome)
        for plan in PLAN_OUTCOMES:
            self.plans.labels(plan)
        for reason in CONNECTION_LIMITS:
            self.connections_refused.labels(reason)
        self._link.set("", "disconnected")

    # ---- discovery and topology ------------------------------------------------------------------
    def observe_discovery(self, seconds: float, outcome: DiscoveryOutcome) -> None:
        if outcome not in ("ok", "error"):
            raise ValueError(f"discovery outcome must be ok or error, not {outcome!r}")
        self.discovery_duration.observe(seconds)
        self.discoveries.labels(outcome).inc()

    def set_topology(self, topo: pb.MemoryTopology) -> None:
        """Generation, fingerprint and source statuses of a newly published topology."""
        self.generation.set(topo.generation)
        self._fingerprint.value = topo.fingerprint
        self.set_sources(topo)

    def set_sources(self, topo: pb.MemoryTopology) -> None:
        self._sources.replace({s.source: _SOURCE_STATUS.get(s.state, "unspecified") for s in topo.sources})

    # ---- controller link -------------------------------------------------------------------------
    def set_link_state(self, state: LinkState) -> None:
        self._link.set("", state)

    @property
    def link_state(self) -> LinkState:
        return cast(LinkState, self._link.snapshot()[""])

    def count_reconnect(self) -> None:
        self.controller_reconnects.inc()

    # ---- plans -----------------------------------------------------------------------------------
    def observe_plan(self, result: planpb.PlanResult) -> None:
        self.plans.labels(plan_outcome(result)).inc()

    def track_unreadable_journals(self, count: Callable[[], int]) -> None:
        """The apply engine's count, read at each scrape (an operator's fix shows at once)."""
        self.apply_unreadable_journals.set_function(count)

    # ---- gRPC ------------------------------------------------------------------------------------
    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _MetricsInterceptor(self)

    # ---- exposition ------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The /metrics body and its content type (the classic text format generate_latest writes)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


# ---- the interceptor ------------------------------------------------------------------------------

_Behavior = Callable[..., Any]
_Context = grpc.aio.ServicerContext[Any, Any]


class _MethodMetrics:
    """One method's metric children, resolved once: labels() takes a lock and validates per call."""

    __slots__ = ("_codes", "duration", "method", "metrics", "open")

    def __init__(self, metrics: AgentMetrics, method: str, streaming: bool) -> None:
        self.metrics = metrics
        self.method = method
        self.duration = (metrics.grpc_stream_duration if streaming else metrics.grpc_duration).labels(method)
        self.open = metrics.grpc_streams_open.labels(method) if streaming else None
        self._codes: dict[str, Counter] = {}

    def started(self) -> float:
        if self.open is not None:
            self.open.inc()
        return perf_counter()

    def finished(self, start: float, code: str) -> None:
        self.duration.observe(perf_counter() - start)
        if self.open is not None:
            self.open.dec()
        child = self._codes.get(code)
        if child is None:
            child = self._codes[code] = self.metrics.grpc_requests.labels(self.method, code)
        child.inc()


class _SyncContext:
    """What a sync behaviour (run in the migration thread pool) gets instead of grpc's sync context,
    which has no code(): the same object, except that the code it sets or aborts with is remembered."""

    __slots__ = ("_code", "_inner")

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._code: grpc.StatusCode | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code
        self._inner.set_code(code)

    def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self._code = code
        self._inner.abort(code, details, trailing_metadata)

    def code(self) -> grpc.StatusCode | None:
        return self._code


def _final_code(context: _Context | _SyncContext, exc: BaseException | None) -> str:
    """The status the client receives, as far as the server can tell."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        # grpc.aio cancels the handler both when the client goes away and when the deadline passes.
        remaining = context.time_remaining()
        return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
    code: grpc.StatusCode | None = context.code()  # None (not OK) until something sets it
    if code is not None:
        # Also after an exception: grpc answers with the code set (or aborted with) before it.
        return code.name
    return "OK" if exc is None else "UNKNOWN"


class _MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics
        # Wrapped handlers by method name: grpc hands out the same handler object for a method on every
        # call, so wrapping once keeps the per-call cost to one dict lookup. Keyed by method (not by
        # handler identity) so a generic handler that builds new objects per call cannot grow it.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            # Unknown method: grpc answers UNIMPLEMENTED. Not counted, so a scanner sending random
            # method names cannot create unbounded label values.
            return None
        method = handler_call_details.method
        hit = self._wrapped.get(method)
        if hit is not None and hit[0] is handler:
            return hit[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, h: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        rec = _MethodMetrics(self._metrics, method, streaming=h.request_streaming or h.response_streaming)
        des, ser = h.request_deserializer, h.response_serializer
        if h.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary_response(h.unary_unary, rec), request_deserializer=des, response_serializer=ser)
        if h.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary_response(h.stream_unary, rec), request_deserializer=des, response_serializer=ser)
        if h.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream_response(h.unary_stream, rec), request_deserializer=des, response_serializer=ser)
        if h.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream_response(h.stream_stream, rec), request_deserializer=des, response_serializer=ser)
        return h  # a handler with no behaviour: grpc will fail it; nothing to measure


# grpc.aio picks how to drive a behaviour by its kind (coroutine function, async generator function,
# plain function run in the migration thread pool), so each wrapper must be of the same kind.

@contextlib.contextmanager
def _measured(rec: _MethodMetrics, context: Any) -> Iterator[None]:
    """One call's count and latency, with the status it ended with (the exception it raised, if any)."""
    start = rec.started()
    exc: BaseException | None = None
    try:
        yield
    except BaseException as e:
        exc = e
        raise
    finally:
        rec.finished(start, _final_code(context, exc))


def _wrap_unary_response(behavior: _Behavior, rec: _MethodMetrics) -> _Behavior:
    if inspect.iscoroutinefunction(behavior):
        async def unary_async(request: Any, context: _Context) -> Any:
            with _measured(rec, context):
                return await behavior(request, context)
        return unary_async

    def unary_sync(request: Any, context: _Context) -> Any:
        seen = _SyncContext(context)
        with _measured(rec, seen):
            return behavior(request, seen)
    return unary_sync


def _wrap_stream_response(behavior: _Behavior, rec: _MethodMetrics) -> _Behavior:
    if inspect.isasyncgenfunction(behavior):
        async def stream_asyncgen(request: Any, context: _Context) -> AsyncIterator[Any]:
            # aclosing: when the call ends early (client gone) the inner generator's own cleanup
            # must run now, not whenever the garbage collector finds it.
            with _measured(rec, context):
                async with contextlib.aclosing(behavior(request, context)) as inner:
                    async for item in inner:
                        yield item
        return stream_asyncgen

    if inspect.iscoroutinefunction(behavior):
        # The writer API: the behaviour calls context.write() and returns None.
        return _wrap_unary_response(behavior, rec)

    def stream_sync(request: Any, context: _Context) -> Iterator[Any]:
        seen = _SyncContext(context)
        with _measured(rec, seen):
            yield from behavior(request, seen)
    return stream_sync


# ---- CPU enforcement through the container runtime (agent/enforce.py) ----------------------------
EnforceState = Literal["off", "waiting", "kubelet", "active", "runtime_unavailable", "config_unreadable"]
ENFORCE_STATES: Final[tuple[EnforceState, ...]] = get_args(EnforceState)
ENFORCE_POD_STATES: Final = ("applied", "pending", "failed")
ENFORCE_UPDATE_RESULTS: Final = ("ok", "failed", "undone")
ENFORCE_MIGRATION_RESULTS: Final = ("moved", "in_place", "failed")
# A pass lists the runtime's containers and reads their cgroups: milliseconds, up to seconds with a
# slow runtime (each CRI call has its own deadline).
ENFORCE_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EnforceMetrics:
    """The enforcement's series, on the agent's registry (``memtopo_enforce_*``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry or CollectorRegistry()
        self._state = _StateSet(PREFIX + "enforce_state",
                                "What the CPU enforcement does (1 = current): off, waiting (for pods or a "
                                "topology), kubelet (the kubelet's static CPU manager owns cpusets), active, "
                                "runtime_unavailable, config_unreadable.", None, "state", ENFORCE_STATES)
        reg.register(self._state)
        self._state.set("", "off")
        self.pods = Gauge(PREFIX + "enforce_pods", "Pods with exclusive CPUs, by outcome of the last pass.",
                          ["state"], registry=reg)
        self.updates = Counter(PREFIX + "enforce_updates",
                               "CRI UpdateContainerResources calls, by result (undone: rolled back because another "
                               "container of the same pod failed).", ["result"], registry=reg)
        self.drift = Counter(PREFIX + "enforce_drift",
                             "Containers found off the cpuset memtopo gave them, and put back.", registry=reg)
        self.reports_failed = Counter(PREFIX + "enforce_reports_failed",
                                      "Pod status annotations or Events that could not be written (retried).",
                                      registry=reg)
        self.migrations = Counter(PREFIX + "enforce_migrations",
                                  "Page migration plans for containers pinned to fewer memory nodes than the node "
                                  "has, by result (in_place: nothing was on other nodes).", ["result"], registry=reg)
        self.pass_duration = Histogram(PREFIX + "enforce_pass_duration_seconds", "Time one enforcement pass took.",
                                       buckets=ENFORCE_BUCKETS, registry=reg)
        for s in ENFORCE_POD_STATES:
            self.pods.labels(s)
        for r in ENFORCE_UPDATE_RESULTS:
            self.updates.labels(r)
        for r in ENFORCE_MIGRATION_RESULTS:
            self.migrations.labels(r)

    def set_state(self, state: EnforceState) -> None:
        self._state.set("", state)

    @property
    def state(self) -> EnforceState:
        return cast(EnforceState, self._state.snapshot()[""])
