"""The extender's Prometheus metrics, registered on the registry of the process that serves it (the
controller's ``/metrics``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX: Final = "memtopo_extender_"
# Verbs over thousands of nodes take milliseconds to tens of milliseconds; kube-scheduler's default
# extender timeout is 5 s (its httpTimeout) — above that the verb has failed anyway.
VERB_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# (name, help, labels → value) of the gauges a fleet reports at scrape time.
Gauges = Callable[[], Iterable[tuple[str, str, dict[str, str], float]]]


class _GaugeCollector(Collector):
    def __init__(self, gauges: Gauges) -> None:
        self._gauges = gauges

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        for name, text, labels, value in self._gauges():
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(PREFIX + name, text, labels=sorted(labels))
            family.add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()


class ExtenderMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(PREFIX + "requests", "Scheduler-extender calls, by verb", ["verb"], registry=registry)
        self.duration = Histogram(PREFIX + "request_duration_seconds", "Scheduler-extender call latency, by verb",
                                  ["verb"], buckets=VERB_BUCKETS, registry=registry)
        self.failures = Counter(PREFIX + "failures", "Scheduler-extender calls answered with Error, by verb and reason",
                                ["verb", "reason"], registry=registry)
        self.refused = Counter(PREFIX + "unauthenticated", "Calls refused for want of a client certificate or "
                               "token, by verb", ["verb"], registry=registry)

    def observe(self, verb: str, seconds: float, failure: str | None) -> None:
        self.requests.labels(verb).inc()
        self.duration.labels(verb).observe(seconds)
        if failure is not None:
            self.failures.labels(verb, failure).inc()

    def gauges(self, gauges: Gauges) -> None:
        """Report ``gauges`` (read at every scrape, so never stale)."""
        self.registry.register(_GaugeCollector(gauges))
