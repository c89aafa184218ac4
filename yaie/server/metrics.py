"""Prometheus metrics for one server: request timings and token counts, plus engine gauges.

Each app has its own CollectorRegistry, so several apps (tests build many) never clash.
Engine gauges are read from the engine's latest stats when scraped rather than pushed on every
step, which keeps the engine thread free of metrics work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from yaie.engine.engine import EngineStats
from yaie.engine.step_shape import STEP_METRICS, StepTotals
from yaie.outputs import RequestOutput
from yaie.spec.metrics import spec_decode_metrics

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily("num_requests_running", "Sequences being generated.", value=stats.num_running)
        yield GaugeMetricFamily(
            "num_requests_waiting", "Sequences waiting to be admitted.", value=stats.num_waiting
        )
        yield GaugeMetricFamily(
            "kv_cache_used_bytes",
            "KV cache memory held by requests.",
            value=stats.kv_cache_used_bytes,
        )
        yield GaugeMetricFamily(
            "kv_cache_cached_bytes",
            "KV cache memory held only by the prefix cache, which frees it when requests need room.",
            value=stats.kv_cache_cached_bytes,
        )
        yield GaugeMetricFamily(
            "kv_cache_usage_ratio",
            "Fraction of KV cache blocks held by requests (those only the prefix cache holds are free).",
            value=stats.kv_cache_usage,
        )
        yield CounterMetricFamily(
            "num_preemptions", "Sequences preempted to free KV cache blocks.", value=stats.num_preemptions
        )
        yield from step_metrics(stats.steps)
        if stats.spec_decode is not None:
            yield from spec_decode_metrics(stats.spec_decode)


def step_metrics(totals: StepTotals) -> Iterator[Metric]:
    """The sums of the engine's steps, as counters (STEP_METRICS)."""
    for attribute, name, documentation in STEP_METRICS:
        yield CounterMetricFamily(name, documentation, value=getattr(totals, attribute))


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = registry = CollectorRegistry()
        self._num_queried = self._num_hits = 0  # the counters' values, for the hit rate
        # prometheus-client appends "_total" to counter names when it exposes them.
        self.tokens_generated = Counter("tokens_generated", "Completion tokens generated.", registry=registry)
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens of admitted requests.", registry=registry
        )
        self.request_latency = Histogram(
            "request_latency_seconds",
            "Request arrival to last token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds",
            "Request arrival to first token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "time_per_output_token_seconds",
            "Mean time between a request's tokens after the first.",
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.request_success = Counter(
            "request_success", "Finished completions (one per choice).", ["finish_reason"], registry=registry
        )
        self.requests_aborted_slow_client = Counter(
            "num_requests_aborted_slow_client",
            "Requests aborted because their client stopped reading their stream.",
            registry=registry,
        )
        self.prefix_cache_queries = Counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=registry
        )
        self.prefix_cache_hits = Counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=registry
        )
        Gauge(
            "prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache.", registry=registry
        ).set_function(self._prefix_cache_hit_rate)
        registry.register(_EngineStatsCollector(engine_stats))

    def observe_prefix_cache(self, num_queried: int, num_hits: int) -> None:
        self.prefix_cache_queries.inc(num_queried)
        self.prefix_cache_hits.inc(num_hits)
        self._num_queried += num_queried
        self._num_hits += num_hits

    def _prefix_cache_hit_rate(self) -> float:
        return self._num_hits / self._num_queried if self._num_queried else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Follows one request's outputs into the metrics; create it when the request arrives."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None

    def observe(self, output: RequestOutput) -> None:
        metrics, now = self.metrics, time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            if output.pooled is None:  # an embedding has no first token
                metrics.time_to_first_token.observe(now - self.arrival)
            metrics.prompt_tokens.inc(len(output.prompt_token_ids))
            metrics.observe_prefix_cache(len(output.prompt_token_ids), output.num_cached_tokens)
        metrics.tokens_generated.inc(sum(len(choice.delta_token_ids) for choice in output.outputs))
        if not output.finished:
            return
        metrics.request_latency.observe(now - self.arrival)
        if output.pooled is not None:  # an embedding: made in one pass, nothing decoded
            metrics.request_success.labels(finish_reason="stop").inc()
            return
        num_decode_steps = max(len(choice.token_ids) for choice in output.outputs) - 1
        if num_decode_steps > 0:
            metrics.time_per_output_token.observe((now - self.first_token_at) / num_decode_steps)
        for choice in output.outputs:
            metrics.request_success.labels(finish_reason=choice.finish_reason).inc()
