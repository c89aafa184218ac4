"""`yaie bench` reads a server's counters from its /metrics: speculative decoding's acceptance,
and the sums of the engine's steps."""

from __future__ import annotations

from prometheus_client import generate_latest

from yaie.engine.engine import EngineStats
from yaie.engine.step_shape import StepShape, StepTotals
from yaie.server.metrics import ServerMetrics
from yaie.spec.decoder import SpecDecodeStats
from yaie_bench.counters import STEP_COUNTERS, counters_between, spec_counters
from yaie_bench.results import LevelResult


def exposition(spec: SpecDecodeStats | None, steps: StepTotals | None = None) -> str:
    """What yaie's /metrics serves for these counters."""
    stats = EngineStats(num_running=0, num_waiting=0, num_kv_blocks=8, num_used_kv_blocks=0,
                        num_cached_kv_blocks=0, kv_block_bytes=64, num_preemptions=0,
                        num_computed_prompt_tokens=0, steps=steps or StepTotals(),
                        spec_decode=spec)  # fmt: skip
    return generate_latest(ServerMetrics(lambda: stats).registry).decode()


def test_counters_from_yaie_and_vllm_expositions() -> None:
    spec = SpecDecodeStats(num_drafts=10, num_draft_tokens=40, num_accepted_tokens=25,
                           num_accepted_tokens_per_pos=[9, 7, 5, 4])  # fmt: skip
    expected = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
                "spec_decode_num_accepted_tokens": 25}  # fmt: skip
    assert spec_counters(exposition(spec)) == expected
    vllm = "\n".join(
        f"# TYPE vllm:{name} counter\nvllm:{name}_total{{model_name=\"m\"}} {value}"
        for name, value in expected.items()
    )
    assert spec_counters(vllm + "\n") == expected
    assert spec_counters(exposition(None)) is None  # a server that does not speculate


def test_level_summary_reports_acceptance() -> None:
    level = LevelResult(concurrency=1, num_requests=0, duration_s=1.0)
    assert level.summary()["spec_acceptance_rate"] is None
    level.spec = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
                  "spec_decode_num_accepted_tokens": 25}  # fmt: skip
    summary = level.summary()
    assert summary["spec_acceptance_rate"] == 25 / 40
    assert summary["spec_mean_accepted_length"] == 1 + 25 / 10


def test_a_level_gets_the_sums_of_the_steps_it_ran() -> None:
    before, after = StepTotals(), StepTotals()
    after.add(StepShape(40, 0, 40, 1), 0.25)  # a step the level before left behind
    before.add(StepShape(40, 0, 40, 1), 0.25)
    after.add(StepShape(0, 8, 400, 8), 0.5)
    after.add(StepShape(16, 7, 300, 8), 0.125)
    grown = counters_between(exposition(None, before), exposition(None, after), STEP_COUNTERS)
    assert grown == {
        "engine_steps": 2, "engine_step_seconds": 0.625, "engine_prefill_steps": 1,
        "engine_prefill_tokens": 16, "engine_decode_tokens": 15, "engine_kv_tokens_read": 700,
        "engine_sampled_rows": 16,
    }  # fmt: skip
    assert counters_between(None, exposition(None, after), STEP_COUNTERS) is None  # no /metrics
