"""/metrics in Prometheus' text format, parsed with prometheus-client's own parser."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.e2e_helpers import MODEL, Server

pytestmark = pytest.mark.slow

COUNTERS = [
    "tokens_generated_total",
    "prompt_tokens_total",
    "num_preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
]
HISTOGRAMS = ["request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds"]
GAUGES = [
    "kv_cache_used_bytes",
    "kv_cache_cached_bytes",
    "kv_cache_usage_ratio",
    "num_requests_running",
    "num_requests_waiting",
    "prefix_cache_hit_rate",
]


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, keyed by its name and labels."""
    with server.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_all_metrics_are_exposed(server: Server) -> None:
    names = {name for name, _ in scrape(server)}
    for name in COUNTERS + GAUGES:
        assert name in names, name
    for name in HISTOGRAMS:
        assert {f"{name}_bucket", f"{name}_count", f"{name}_sum"} <= names, name


def test_counters_grow_with_a_request(server: Server) -> None:
    before = scrape(server)
    prompt = "Counting tokens for the metrics test, " * 3
    with server.http() as http:
        for _ in range(2):  # the second one finds the prompt in the prefix cache
            response = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True},
            )
            assert response.status_code == 200
    usage = response.json()["usage"]
    after = scrape(server)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("tokens_generated_total") == 2 * 5
    assert grew("prompt_tokens_total") == 2 * usage["prompt_tokens"]
    assert grew("prefix_cache_queries_total") == 2 * usage["prompt_tokens"]
    assert grew("prefix_cache_hits_total") >= usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert grew("request_success_total", finish_reason="length") == 2
    for name in HISTOGRAMS:
        assert grew(f"{name}_count") == 2, name
    assert 0 < value(after, "prefix_cache_hit_rate") <= 1
    assert value(after, "num_requests_running") == 0


def settled(server: Server, timeout: float = 20.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics once no request runs, waits or holds KV blocks (or at `timeout`). The engine
    publishes its gauges after each step, so they may lag a response by up to one step."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        names = ("num_requests_running", "num_requests_waiting", "kv_cache_used_bytes")
        if not any(value(samples, name) for name in names) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_blocks_only_the_prefix_cache_holds_are_cached_not_used(server: Server) -> None:
    prompt = "Blocks that the prefix cache keeps once the request is over, " * 4
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
        assert response.status_code == 200
    samples = settled(server)
    assert value(samples, "num_requests_running") == value(samples, "num_requests_waiting") == 0
    assert value(samples, "kv_cache_used_bytes") == 0
    assert value(samples, "kv_cache_usage_ratio") == 0
    # The prompt's full blocks stay in the prefix cache for the next request that shares them.
    assert value(samples, "kv_cache_cached_bytes") > 0
