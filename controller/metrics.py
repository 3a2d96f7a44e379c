"""The controller's Prometheus metrics, served at ``/metrics`` on its HTTP listener.

One registry per controller (never prometheus_client's global one: tests start many controllers
in one process); a feature put together with the controller (the scheduler extender) registers its
own metrics on it. Fleet sizes are read from the fleet at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector

from memtopo.controller.fleet import Fleet

if TYPE_CHECKING:
    from memtopo.httpserve import Exchange

PREFIX: Final = "memtopo_"
HTTP_BUCKETS: Final = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)

disable_created_metrics()  # type: ignore[no-untyped-call]


class _FleetCollector(Collector):
    def __init__(self, fleet: Callable[[], Fleet | None]) -> None:
        self._fleet = fleet

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        fleet = self._fleet()
        if fleet is None:
            return
        nodes = fleet.nodes()
        connected = sum(1 for n in nodes if n.connected)
        family = GaugeMetricFamily(PREFIX + "controller_nodes", "Nodes the controller knows, by link state",
                                   labels=["state"])
        family.add_metric(["connected"], connected)
        family.add_metric(["disconnected"], len(nodes) - connected)
        yield family
        yield GaugeMetricFamily(PREFIX + "controller_topologies", "Nodes whose topology the controller holds",
                                value=fleet.held_count())


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._fleet: Fleet | None = None
        self.registry.register(_FleetCollector(lambda: self._fleet))
        self.http_requests = Counter(PREFIX + "controller_http_requests", "HTTP requests answered, by route and code",
                                     ["route", "method", "code"], registry=self.registry)
        self.http_duration = Histogram(PREFIX + "controller_http_request_duration_seconds",
                                       "HTTP request handling time (streams: until the stream starts)",
                                       ["route"], buckets=HTTP_BUCKETS, registry=self.registry)
        self.http_connection_events = Counter(
            PREFIX + "controller_http_connection_events",
            "HTTP connections refused, evicted for a newer one, closed idle or at a deadline, answered busy",
            ["event"], registry=self.registry)

    def watch(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def observe_http(self, exchange: Exchange) -> None:
        label = exchange.route or "(unrouted)"
        self.http_requests.labels(label, exchange.method or "-", str(exchange.status)).inc()
        self.http_duration.labels(label).observe(exchange.seconds)

    def observe_connection(self, event: str) -> None:
        self.http_connection_events.labels(event).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
