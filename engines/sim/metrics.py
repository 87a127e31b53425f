"""vLLM's Prometheus series for the simulator: plain counters bumped by the engine, rendered on scrape.

Names, labels and buckets are those of vLLM 0.33 (`vllm/v1/metrics/loggers.py`, `buckets.py`,
`vllm/v1/spec_decode/metrics.py`). The engine updates plain ints and bucket lists (cheap enough for
every step at batch 512); a prometheus_client collector turns them into the text format when scraped.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


class Histogram:
    """Cumulative-on-render bucket counts, as Prometheus histograms are."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            acc += n
            out.append((_fmt(float(bound)), acc))
        out.append(("+Inf", self.count))
        return out


def _fmt(value: float) -> str:
    return repr(value)


class EngineMetrics:
    """Everything `/metrics` shows, as plain numbers the engine bumps directly."""

    def __init__(self, model_name: str, num_spec_tokens: int | None) -> None:
        self.model_name = model_name
        self.num_spec_tokens = num_spec_tokens
        self.created = time.time()
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted = 0
        self.spec_accepted_per_pos = [0] * (num_spec_tokens or 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        self.prefill_time = Histogram(LATENCY_BUCKETS)
        self.decode_time = Histogram(LATENCY_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_BUCKETS)
        self.request_prompt_tokens = Histogram(REQUEST_TOKENS_BUCKETS)
        self.request_generation_tokens = Histogram(REQUEST_TOKENS_BUCKETS)

    def registry(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return registry

    def render(self, registry: CollectorRegistry) -> bytes:
        return bytes(generate_latest(registry))


# The families /metrics shows, in vLLM's order and words: (name, help, the EngineMetrics attribute).
_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
)
_COUNTERS = (
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions"),
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits",
    ),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
)
_SPEC_COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_accepted"),
)
_HISTOGRAMS = (
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration_tokens"),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "request_prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "request_generation_tokens"),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        "tpot",
    ),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue"),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        "prefill_time",
    ),
    (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        "decode_time",
    ),
)


class _Collector(Collector):
    def __init__(self, metrics: EngineMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        labels = ["model_name", "engine"]
        values = [m.model_name, "0"]

        def counters(table: tuple[tuple[str, str, str], ...]) -> Iterator[Metric]:
            for name, doc, attr in table:
                family = CounterMetricFamily(name, doc, labels=labels)
                family.add_metric(values, getattr(m, attr), created=m.created)
                yield family

        def labelled(name: str, doc: str, label: str, counts: Iterable[tuple[str, float]]) -> Metric:
            family = CounterMetricFamily(name, doc, labels=[*labels, label])
            for value, count in counts:
                family.add_metric([*values, value], count, created=m.created)
            return family

        for name, doc, attr in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, getattr(m, attr))
            yield gauge
        yield from counters(_COUNTERS)
        yield labelled(
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            m.success.items(),
        )
        if m.num_spec_tokens is not None:
            yield from counters(_SPEC_COUNTERS)
            yield labelled(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                "position",
                ((str(pos), count) for pos, count in enumerate(m.spec_accepted_per_pos)),
            )
        for name, doc, attr in _HISTOGRAMS:
            h: Histogram = getattr(m, attr)
            histogram = HistogramMetricFamily(name, doc, labels=labels)
            histogram.add_metric(values, h.buckets(), h.total)
            yield histogram
