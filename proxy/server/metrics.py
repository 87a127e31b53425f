"""The proxy's own Prometheus metrics, in a registry of its own (served at GET /metrics).

    specproxy_requests_total{arm,route,status}          upstream calls finished (route: primary, shadow,
                                                         split, verify)
    specproxy_inflight{arm}                              upstream calls in flight now
    specproxy_shadow_dropped_total{arm}                  shadow/verify copies not sent (arm over its bound)
    specproxy_identity_mismatches_total{arm}             greedy outputs that differ from the baseline's
    specproxy_identity_checks_total{arm}                 greedy outputs compared with the baseline's
    specproxy_upstream_ttft_seconds{arm,route}           time to first content chunk (streams)
    specproxy_upstream_duration_seconds{arm,route}       whole upstream call
    specproxy_span_queue_depth, specproxy_spans_dropped_total, specproxy_spans_written_total
    specproxy_client_errors_total{status}                requests refused by the proxy (400, 401, 413)
    specproxy_client_connections_refused_total           connections answered 503 at the connection cap
    specproxy_client_connections_closed_idle_total       idle connections closed to make room at the cap

Label children are cached: the hot path pays one dict lookup, not prometheus_client's label parsing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specproxy.record import SpanRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _LiveValues(Collector):
    """Values read at scrape time from the objects that own them (in-flight counts, the span sink)."""

    def __init__(
        self,
        inflight: Mapping[str, int],
        arm_urls: Mapping[str, str],
        sink_stats: Callable[[], tuple[int, int, int]] | None,
    ) -> None:
        self._inflight = inflight
        self._arm_urls = arm_urls
        self.sink_stats = sink_stats
        self.connection_stats: Callable[[], tuple[int, int]] | None = None

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("specproxy_inflight", "Upstream calls in flight now.", labels=["arm"])
        for arm, url in self._arm_urls.items():
            g.add_metric([arm], self._inflight.get(url, 0))
        yield g
        if self.sink_stats is not None:
            depth, dropped, written = self.sink_stats()
            yield GaugeMetricFamily(
                "specproxy_span_queue_depth", "Spans waiting for the DuckDB writer.", value=depth
            )
            yield CounterMetricFamily(
                "specproxy_spans_dropped", "Spans not stored (queue full, or unwritable).", value=dropped
            )
            yield CounterMetricFamily(
                "specproxy_spans_written", "Spans written to the span store.", value=written
            )
        if self.connection_stats is not None:
            closed_idle, refused = self.connection_stats()
            yield CounterMetricFamily(
                "specproxy_client_connections_refused",
                "Client connections answered 503 at the connection cap.",
                value=refused,
            )
            yield CounterMetricFamily(
                "specproxy_client_connections_closed_idle",
                "Idle client connections closed to make room at the connection cap.",
                value=closed_idle,
            )


class ProxyMetrics:
    """Counters and histograms of one proxy process."""

    def __init__(
        self,
        inflight: Mapping[str, int],
        arm_urls: Mapping[str, str],
        sink_stats: Callable[[], tuple[int, int, int]] | None = None,
    ) -> None:
        # `_created` timestamps double the exposition for nothing a dashboard uses (process-wide switch).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self._requests = Counter(
            "specproxy_requests", "Upstream calls finished.", ["arm", "route", "status"], registry=r
        )
        self._dropped = Counter(
            "specproxy_shadow_dropped",
            "Shadow or verify copies not sent (arm over its max_shadow_inflight).",
            ["arm"],
            registry=r,
        )
        self._mismatch = Counter(
            "specproxy_identity_mismatches",
            "Greedy outputs differing from the baseline's.",
            ["arm"],
            registry=r,
        )
        self._checks = Counter(
            "specproxy_identity_checks", "Greedy outputs compared with the baseline's.", ["arm"], registry=r
        )
        self._client_errors = Counter(
            "specproxy_client_errors", "Requests refused by the proxy itself.", ["status"], registry=r
        )
        self._ttft = Histogram(
            "specproxy_upstream_ttft_seconds",
            "Upstream time to first content chunk.",
            ["arm", "route"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self._duration = Histogram(
            "specproxy_upstream_duration_seconds",
            "Upstream call duration.",
            ["arm", "route"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self._live = _LiveValues(inflight, arm_urls, sink_stats)
        r.register(self._live)
        self._children: dict[tuple[str, ...], Any] = {}

    def watch_sink(self, sink_stats: Callable[[], tuple[int, int, int]]) -> None:
        """Report the span sink's (queue depth, dropped, written) from now on."""
        self._live.sink_stats = sink_stats

    def watch_connections(self, connection_stats: Callable[[], tuple[int, int]]) -> None:
        """Report the client connections (closed idle, refused) at the cap from now on."""
        self._live.connection_stats = connection_stats

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_call(self, record: SpanRecord) -> None:
        self._child(self._requests, record.arm, record.routed_as, record.status).inc()
        if record.status == "dropped":
            self._child(self._dropped, record.arm).inc()
            return
        if record.ttft_s is not None:
            self._child(self._ttft, record.arm, record.routed_as).observe(record.ttft_s)
        if record.e2e_s is not None:
            self._child(self._duration, record.arm, record.routed_as).observe(record.e2e_s)

    def observe_identity(self, arm: str, identical: bool) -> None:
        self._child(self._checks, arm).inc()
        if not identical:
            self._child(self._mismatch, arm).inc()

    def client_error(self, status: int) -> None:
        self._child(self._client_errors, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The app's metrics, for what serves its connections (the connection cap counts its refusals there).
METRICS = web.AppKey("specproxy_metrics", ProxyMetrics)
