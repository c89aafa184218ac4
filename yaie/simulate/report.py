"""What a simulation measured, in the figures `yaie bench` reports, and plots of them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from yaie.simulate.simulator import SimulationResult


def percentile(values: list[float], pct: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values. The load
    generator (yaie_bench) reports its measured figures with this one too, so that a simulation
    and the measurement it is checked against are summarised alike."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(result: SimulationResult) -> dict[str, Any]:
    records = result.records
    start = min(r.arrival_s for r in records)
    end = max(r.finish_s or 0.0 for r in records)
    output_tokens = sum(r.output_len for r in records)
    ttfts = [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
    e2es = [r.finish_s - r.arrival_s for r in records if r.finish_s is not None]
    tpots = [
        (r.finish_s - r.first_token_s) / (r.output_len - 1)
        for r in records
        if r.finish_s is not None and r.first_token_s is not None and r.output_len > 1
    ]
    prompt_tokens = sum(r.prompt_len for r in records)
    usage = [share for _, share in result.kv_timeline]
    return {
        "scenario": result.scenario,
        "requests": len(records),
        "duration_s": end - start,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / (end - start) if end > start else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "e2e_p50_s": percentile(e2es, 50),
        "e2e_p99_s": percentile(e2es, 99),
        "prefix_hit_rate": sum(r.cached_tokens for r in records) / prompt_tokens if prompt_tokens else 0.0,
        "kv_usage_mean": sum(usage) / len(usage) if usage else 0.0,
        "kv_usage_peak": max(usage, default=0.0),
        "num_steps": result.num_steps,
        "num_preemptions": result.num_preemptions,
    }


def plot(results: list[SimulationResult], path: Path) -> None:
    """Three panels: TTFT CDF, end-to-end latency CDF, and KV cache use over time, one line per
    scenario. matplotlib is an optional dependency (`pip install yaie[bench]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'yaie[bench]'") from None
    figure, (ttft_axes, e2e_axes, kv_axes) = plt.subplots(1, 3, figsize=(16, 4.5))
    for result in results:
        done = [r for r in result.records if r.first_token_s is not None and r.finish_s is not None]
        for axes, values in (
            (ttft_axes, [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]),
            (e2e_axes, [r.finish_s - r.arrival_s for r in done if r.finish_s is not None]),
        ):
            ordered = sorted(values)
            axes.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=result.scenario)
        times = [t for t, _ in result.kv_timeline]
        shares = [100 * share for _, share in result.kv_timeline]
        kv_axes.plot(times, shares, label=result.scenario, linewidth=0.8)
    ttft_axes.set(xlabel="time to first token (s)", ylabel="share of requests", title="TTFT CDF")
    e2e_axes.set(xlabel="end-to-end latency (s)", ylabel="share of requests", title="Latency CDF")
    kv_axes.set(xlabel="simulated time (s)", ylabel="KV blocks held, prefix cache's too (%)", title="KV use")
    for axes in (ttft_axes, e2e_axes, kv_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
