"""Prometheus families for speculative decoding, with vLLM's names less the `vllm:` prefix."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from yaie.spec.decoder import SpecDecodeStats


def spec_decode_metrics(stats: SpecDecodeStats) -> Iterator[Metric]:
    yield CounterMetricFamily(
        "spec_decode_num_drafts", "Sequence-steps that verified a draft.", value=stats.num_drafts
    )
    yield CounterMetricFamily(
        "spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", value=stats.num_draft_tokens
    )
    yield CounterMetricFamily(
        "spec_decode_num_accepted_tokens", "Draft tokens the target kept.", value=stats.num_accepted_tokens
    )
    per_position = CounterMetricFamily(
        "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens the target kept, by position in the draft.",
        labels=["position"],
    )
    for position, count in enumerate(stats.num_accepted_tokens_per_pos):
        per_position.add_metric([str(position)], count)
    yield per_position
