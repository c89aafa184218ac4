"""`yaie simulate`: the engine's scheduler in virtual time, checked on the policies' known effects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from yaie.simulate import (
    CostModel,
    EngineSettings,
    Request,
    Scenario,
    SimulationError,
    Traffic,
    TrafficSpec,
    load_trace,
    simulate,
    summarize,
    synthetic_traffic,
)  # fmt: skip

# A small GPU-like engine: a fixed cost that rewards batching, a per-token cost that makes long
# prompts expensive, attention that grows with context.
COST = CostModel(
    fixed_s=0.01, prefill_step_s=0.0, per_prefill_token_s=1e-4, per_decode_token_s=1e-4, per_kv_token_s=1e-7,
    per_sample_s=1e-5,
)  # fmt: skip
SETTINGS = EngineSettings(num_kv_blocks=4096, block_size=16, max_num_seqs=32, max_num_batched_tokens=1024)


def run(spec: TrafficSpec, scenario: str, settings: EngineSettings = SETTINGS, seed: int = 0) -> dict:
    return summarize(simulate(synthetic_traffic(spec), Scenario.parse(scenario), settings, COST, seed=seed))


def test_importing_the_simulator_imports_no_torch() -> None:
    code = "import sys, yaie.simulate\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_continuous_batching_beats_static_on_mixed_lengths() -> None:
    spec = TrafficSpec(num_requests=64, rate=20.0, prompt_len=(32, 512), output_len=(8, 400), seed=1)
    static, continuous = run(spec, "static"), run(spec, "continuous")
    assert static["requests"] == continuous["requests"] == 64
    assert static["output_tokens"] == continuous["output_tokens"]
    # Static batches wait for their longest member and pad the others: less throughput, later tokens.
    assert continuous["output_tok_s"] > 1.3 * static["output_tok_s"]
    assert continuous["ttft_p50_s"] < static["ttft_p50_s"]
    assert continuous["e2e_p50_s"] < static["e2e_p50_s"]


def test_prefix_caching_cuts_ttft_on_a_shared_prefix() -> None:
    spec = TrafficSpec(
        num_requests=48, rate=4.0, prompt_len=(1024, 2048), output_len=(16, 64), shared_prefix=0.8
    )
    plain, cached = run(spec, "continuous"), run(spec, "continuous+prefix")
    assert plain["prefix_hit_rate"] == 0.0
    assert cached["prefix_hit_rate"] > 0.6
    assert cached["ttft_p50_s"] < 0.5 * plain["ttft_p50_s"]


def test_same_seed_same_result_and_another_seed_another() -> None:
    spec = TrafficSpec(
        num_requests=40, rate=8.0, prompt_len=(64, 256), output_len=(16, 128), shared_prefix=0.3
    )
    scenario = "continuous+prefix+spec=3@0.6"
    first, again = run(spec, scenario), run(spec, scenario)
    assert first == again
    other = run(TrafficSpec(**{**spec.__dict__, "seed": 7}), scenario)
    assert other != first


def test_a_small_pool_preempts_and_still_finishes_everything() -> None:
    spec = TrafficSpec(num_requests=32, rate=50.0, prompt_len=(256, 512), output_len=(128, 256))
    roomy, tight = run(spec, "continuous"), run(spec, "continuous+pool=96")
    assert roomy["num_preemptions"] == 0 and tight["num_preemptions"] > 0
    assert tight["requests"] == 32 and tight["kv_usage_peak"] > 0.9
    assert tight["output_tok_s"] < roomy["output_tok_s"]


def test_smaller_chunks_keep_decodes_going_during_long_prefills() -> None:
    spec = TrafficSpec(num_requests=32, rate=6.0, prompt_len=(2048, 4096), output_len=(64, 128))
    big, small = run(spec, "continuous+chunk=4096"), run(spec, "continuous+chunk=256")
    # A decode step that shares the batch with a 4096-token prefill chunk waits for all of it.
    assert small["tpot_p99_s"] < big["tpot_p99_s"]


def test_speculative_decoding_cuts_time_per_token_by_its_acceptance() -> None:
    spec = TrafficSpec(num_requests=16, rate=1.0, prompt_len=(32, 64), output_len=(200, 200))
    plain, fast = run(spec, "continuous"), run(spec, "continuous+spec=4@0.8")
    # 1 + 0.8 + 0.8^2 + 0.8^3 + 0.8^4 = 3.36 tokens a step for a slightly dearer step.
    assert fast["num_steps"] < plain["num_steps"] / 2
    assert fast["tpot_p50_s"] < plain["tpot_p50_s"] / 2


def test_closed_loop_clients_keep_that_many_in_flight() -> None:
    spec = TrafficSpec(num_requests=24, arrival="closed", clients=4, prompt_len=(64, 64), output_len=(32, 32))
    result = simulate(synthetic_traffic(spec), Scenario.parse("continuous"), SETTINGS, COST)
    starts = sorted(r.arrival_s for r in result.records)
    assert starts[:4] == [0.0] * 4 and all(t > 0 for t in starts[4:])
    finishes = sorted(r.finish_s or 0.0 for r in result.records)
    assert starts[4:] == pytest.approx(finishes[:20])  # each later request starts as one ends


def test_multi_turn_sessions_reuse_the_conversation() -> None:
    spec = TrafficSpec(
        num_requests=8, rate=2.0, prompt_len=(256, 512), output_len=(32, 64), turns=3, think_s=1.0
    )
    cached = run(spec, "continuous+prefix")
    assert cached["requests"] == 24
    assert cached["prefix_hit_rate"] > 0.4  # turns 2 and 3 find the whole earlier conversation


def test_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"arrival_s": 0.1 * i, "prompt_len": 300, "output_len": 20, "shared_prefix_len": 256}
        for i in range(10)
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    traffic = load_trace(trace)
    assert [len(r.prompt_token_ids) for r in traffic.requests] == [300] * 10
    assert len({tuple(r.prompt_token_ids[:256]) for r in traffic.requests}) == 1
    summary = summarize(simulate(traffic, Scenario.parse("continuous+prefix"), SETTINGS, COST))
    assert summary["requests"] == 10 and summary["prefix_hit_rate"] > 0.7
    trace.write_text('{"arrival_s": 0}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        load_trace(trace)


def test_a_request_larger_than_the_pool_is_refused() -> None:
    spec = TrafficSpec(num_requests=2, prompt_len=(1000, 1000), output_len=(100, 100))
    with pytest.raises(SimulationError, match="needs 69 KV blocks"):
        run(spec, "continuous+pool=16")


@pytest.mark.parametrize("text", ["dynamic", "continuous+chunk=0", "continuous+spec=4@1.5", "static+prefix"])
def test_bad_scenarios(text: str) -> None:
    with pytest.raises(ValueError):
        Scenario.parse(text)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from yaie.simulate import plot

    spec = TrafficSpec(num_requests=8, prompt_len=(32, 64), output_len=(8, 16))
    results = [
        simulate(synthetic_traffic(spec), Scenario.parse(s), SETTINGS, COST) for s in ("static", "continuous")
    ]
    plot(results, tmp_path / "out.png")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json_with_a_cost_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from yaie.cli import main

    cost_file = tmp_path / "cost.json"
    engine = {"num_kv_blocks": 512, "block_size": 16, "max_num_seqs": 8}
    CostModel(0.01, 0.0, 1e-4, 1e-4, 1e-7, engine=engine).save(cost_file)
    argv = ["simulate", "--cost-model", str(cost_file), "--num-requests", "12", "--prompt-len", "64:128",
            "--output-len", "8:16", "--compare", "static,continuous", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["settings"]["num_kv_blocks"] == 512 and report["settings"]["max_num_seqs"] == 8
    assert [s["scenario"] for s in report["scenarios"]] == ["static", "continuous"]
    assert all(s["requests"] == 12 for s in report["scenarios"])


def test_history_leaves_its_prompts_in_the_prefix_cache() -> None:
    prompts = [[7] * 64 + [i] for i in range(4)]  # one shared 64-token prefix
    requests = [Request(f"r{i}", prompt, 8) for i, prompt in enumerate(prompts)]
    scenario = Scenario.parse("continuous+prefix")
    cold = simulate(Traffic(requests, clients=4), scenario, SETTINGS, COST)
    warm = simulate(Traffic(requests, clients=4, history=[prompts[0]]), scenario, SETTINGS, COST)
    assert [r.cached_tokens for r in cold.records] == [0] * 4  # admitted together: nothing to share yet
    assert [r.cached_tokens for r in warm.records] == [64] * 4
    assert summarize(warm)["ttft_p50_s"] < summarize(cold)["ttft_p50_s"]
