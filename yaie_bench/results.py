"""What one load-test level measured, per request and summed up:

- output tok/s: all output tokens of the level / the level's wall time (first send to last finish);
- TTFT (time to first token): from sending the request to the first chunk that carries text;
- TPOT (time per output token), per request: (e2e - ttft) / (output tokens - 1);
- e2e latency: from sending the request to the end of its stream;
- requests and errors (HTTP errors, error events in the stream, timeouts);
- with speculative decoding on the server: the acceptance rate (accepted / proposed draft
  tokens) and the mean accepted length (tokens a verifying step yields: 1 + accepted / drafts),
  from the server's spec_decode_* counters in /metrics before and after the level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yaie.simulate.report import percentile  # the same percentile as the simulated figures


@dataclass
class RequestResult:
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    duration_s: float
    requests: list[RequestResult] = field(default_factory=list)
    # The server's speculative-decoding counters (SPEC_COUNTERS) and the sums of its engine's
    # steps (STEP_COUNTERS) over the level, set by run_bench; None where the server keeps none.
    spec: dict[str, float] | None = None
    steps: dict[str, float] | None = None

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.requests if r.error is None]
        output_tokens = sum(r.output_tokens for r in ok)
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpots = [t for r in ok if (t := r.tpot_s) is not None]
        e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        return {
            "concurrency": self.concurrency,
            "num_requests": self.num_requests,
            "ok": len(ok),
            "errors": len(self.requests) - len(ok),
            "duration_s": self.duration_s,
            "output_tokens": output_tokens,
            "output_tok_s": output_tokens / self.duration_s if self.duration_s > 0 else 0.0,
            "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
            "mean_output_tokens": output_tokens / len(ok) if ok else None,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90),
            "ttft_p99_s": percentile(ttfts, 99),
            "tpot_p50_s": percentile(tpots, 50),
            "tpot_p99_s": percentile(tpots, 99),
            "e2e_p50_s": percentile(e2es, 50),
            "e2e_p99_s": percentile(e2es, 99),
            "error_samples": sorted({r.error for r in self.requests if r.error})[:5],
            "engine_steps": self.steps,
            **self.spec_summary(),
        }

    def spec_summary(self) -> dict[str, float | None]:
        drafts = self.spec["spec_decode_num_drafts"] if self.spec else 0
        if not self.spec or not drafts:
            return {"spec_acceptance_rate": None, "spec_mean_accepted_length": None}
        accepted = self.spec["spec_decode_num_accepted_tokens"]
        return {
            "spec_acceptance_rate": accepted / self.spec["spec_decode_num_draft_tokens"],
            "spec_mean_accepted_length": 1 + accepted / drafts,
        }
