"""A server's counters read from its Prometheus /metrics: speculative decoding's acceptance
(vLLM's names, with or without its `vllm:` prefix) and the sums of yaie's engine steps."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from yaie.engine.step_shape import STEP_METRICS

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
# The sums of yaie's engine steps, by metric name: the StepTotals field each counts.
STEP_COUNTERS = {name: attribute for attribute, name, _ in STEP_METRICS}


def server_counters(exposition: str, names: Iterable[str]) -> dict[str, float] | None:
    """The totals of the counters `names` in a Prometheus exposition (yaie's names, or vLLM's
    with `vllm:` before them); None if it lacks any of them."""
    wanted = set(names)
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:  # counters' samples end in _total (summed over labels)
            name = sample.name.removeprefix("vllm:")
            if name.endswith("_total") and (counter := name.removesuffix("_total")) in wanted:
                totals[counter] = totals.get(counter, 0.0) + sample.value
    return totals if len(totals) == len(wanted) else None


def spec_counters(metrics_text: str) -> dict[str, float] | None:
    """SPEC_COUNTERS' totals in a Prometheus exposition; None if it lacks any of them."""
    return server_counters(metrics_text, SPEC_COUNTERS)


def counters_between(before: str | None, after: str | None, names: Iterable[str]) -> dict[str, float] | None:
    """How much the counters `names` grew from one exposition to the next; None without them."""
    first = None if before is None else server_counters(before, names)
    last = None if after is None else server_counters(after, names)
    if first is None or last is None:
        return None
    return {name: last[name] - first[name] for name in first}
