"""The load test's results as a terminal table."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def results_table(label: str, summaries: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{label}: streaming chat completions")
    speculating = any(s["spec_acceptance_rate"] is not None for s in summaries)
    spec_headers = ("accepted", "mean len") if speculating else ()
    for header in (
        "conc",
        "reqs",
        "errors",
        "out tok/s",
        "TTFT p50 s",
        "p90",
        "p99",
        "TPOT p50 ms",
        "p99",
        "e2e p50 s",
        "p99",
        "prompt tok",
        "out tok",
        *spec_headers,
    ):
        table.add_column(header, justify="right")
    for s in summaries:
        table.add_row(
            str(s["concurrency"]),
            str(s["num_requests"]),
            str(s["errors"]),
            f"{s['output_tok_s']:.1f}",
            _fmt(s["ttft_p50_s"]),
            _fmt(s["ttft_p90_s"]),
            _fmt(s["ttft_p99_s"]),
            _fmt(s["tpot_p50_s"], 1e3, 1),
            _fmt(s["tpot_p99_s"], 1e3, 1),
            _fmt(s["e2e_p50_s"], digits=2),
            _fmt(s["e2e_p99_s"], digits=2),
            _fmt(s["mean_prompt_tokens"], digits=0),
            _fmt(s["mean_output_tokens"], digits=1),
            *((_fmt(s["spec_acceptance_rate"], digits=2), _fmt(s["spec_mean_accepted_length"], digits=2))
              if speculating else ()),
        )  # fmt: skip
    return table
