"""The step-time cost model: its formula, its file format, and the fit `yaie bench --fit-cost-model`
runs (the engine's steps, then the front end from a server's load-test levels), on synthetic
records and on a real (tiny) engine and server."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from yaie.engine.step_shape import StepTotals
from yaie.simulate import CostModel, ServedLevel, StepShape
from yaie.simulate.cost_model import COEFFICIENTS, step_features

TRUTH = CostModel(
    fixed_s=0.02, prefill_step_s=0.03, per_prefill_token_s=1e-4, per_decode_token_s=6e-4,
    per_kv_token_s=2e-7, per_sample_s=3e-4,
)  # fmt: skip


def test_the_formula_prices_prompt_and_decode_tokens_apart() -> None:
    decode = StepShape(num_prefill_tokens=0, num_decode_tokens=8, num_kv_tokens=800, num_sampled=8)
    assert TRUTH.step_time(decode) == pytest.approx(0.02 + 8 * 6e-4 + 800 * 2e-7 + 8 * 3e-4)
    mixed = StepShape(num_prefill_tokens=100, num_decode_tokens=8, num_kv_tokens=900, num_sampled=9)
    expected = 0.02 + 0.03 + 100 * 1e-4 + 8 * 6e-4 + 900 * 2e-7 + 9 * 3e-4
    assert TRUTH.step_time(mixed) == pytest.approx(expected)


def test_fit_recovers_known_coefficients() -> None:
    # (prefill tokens, decode tokens, KV tokens read, sampled): prompts alone, a chunk that does
    # not sample, several prompts in one step, decodes, and decodes joined by a prompt.
    measured = [(16, 0, 16, 1), (2048, 0, 2048, 1), (2048, 0, 2048, 0), (512, 0, 512, 4), (0, 1, 100, 1),
                (0, 8, 4000, 8), (0, 32, 20000, 32), (64, 16, 1000, 17), (300, 4, 600, 5)]  # fmt: skip
    shapes = [StepShape(*shape) for shape in measured]
    fitted = CostModel.fit(shapes, [TRUTH.step_time(s) for s in shapes], {"block_size": 16})
    for name in COEFFICIENTS:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    assert fitted.engine == {"block_size": 16}


def test_fit_keeps_costs_non_negative() -> None:
    shapes = [StepShape(n, n, 2 * n, 1 + n % 3) for n in (1, 2, 4, 8, 16, 32, 64)]
    fitted = CostModel.fit(shapes, [0.05 - 0.0005 * n for n in (1, 2, 4, 8, 16, 32, 64)])
    assert min(getattr(fitted, name) for name in COEFFICIENTS) >= 0.0
    assert all(fitted.step_time(shape) > 0.0 for shape in shapes)


def test_fit_needs_a_step_per_coefficient() -> None:
    with pytest.raises(ValueError, match="at least 6 timed steps"):
        CostModel.fit([StepShape(1, 0, 1, 1)] * 3, [0.1] * 3)


def served(shapes: list[StepShape], num_requests: int, clients: int, front_end: CostModel) -> ServedLevel:
    """A level whose steps had these shapes, each taking what `front_end` prices it at with its
    share of the front end (the requests spread over the steps), the client(s) idle for
    `front_end.request_overhead_s` per request outside the engine."""
    totals = StepTotals()
    for index, shape in enumerate(shapes):
        admitted = num_requests // len(shapes) + (index < num_requests % len(shapes))
        totals.add(shape, front_end.step_time(shape) + front_end.front_end_time(admitted, shape.num_sampled))
    idle = front_end.request_overhead_s * num_requests if clients == 1 else 0.0
    return ServedLevel(totals, num_requests, clients, totals.busy_s + idle)


def test_the_front_end_is_priced_from_served_levels() -> None:
    truth = replace(
        TRUTH, request_overhead_s=0.006, front_end_per_request_s=0.004, front_end_per_output_s=2e-4
    )
    decode = [StepShape(0, 4, 400, 4)] * 60 + [StepShape(64, 0, 64, 4)] * 2
    busy = [StepShape(0, 16, 2000, 16)] * 40 + [StepShape(128, 8, 900, 16)] * 4
    levels = [
        served([StepShape(20, 0, 20, 1)] + [StepShape(0, 1, 30, 1)] * 15, 8, 1, truth),
        served(decode, 16, 4, truth),
        served(busy, 64, 16, truth),  # many short requests
        served(busy, 8, 16, truth),  # a few long ones
    ]
    priced = TRUTH.with_front_end(levels)
    assert priced.request_overhead_s == pytest.approx(0.006)
    assert priced.front_end_per_request_s == pytest.approx(0.004)
    assert priced.front_end_per_output_s == pytest.approx(2e-4)
    for name in COEFFICIENTS:  # the engine's own prices stay
        assert getattr(priced, name) == getattr(TRUTH, name)
    # A front end that costs nothing (spare cores) is priced at nothing, never below.
    free = TRUTH.with_front_end(
        [served(decode, 16, 1, TRUTH), served(decode, 16, 4, TRUTH), served(busy, 8, 16, TRUTH)]
    )
    terms = (free.request_overhead_s, free.front_end_per_request_s, free.front_end_per_output_s)
    assert terms == pytest.approx((0.0, 0.0, 0.0), abs=1e-12) and min(terms) >= 0.0
    with pytest.raises(ValueError, match="one-client level and two or more"):
        TRUTH.with_front_end(levels[:2])


def test_a_file_round_trips(tmp_path: Path) -> None:
    cost = CostModel(0.01, 0.02, 1e-4, 2e-4, 1e-7, 1e-5, request_overhead_s=0.003,
                     front_end_per_request_s=0.002, front_end_per_output_s=1e-4,
                     engine={"block_size": 16})  # fmt: skip
    cost.save(tmp_path / "cost.json")
    assert CostModel.load(tmp_path / "cost.json") == cost


def test_a_file_with_one_per_token_price_loads_it_for_both_kinds_of_token() -> None:
    old = {"fixed_s": 0.07, "per_token_s": 0.002, "per_kv_token_s": 7e-6, "per_sample_s": 0.0}
    cost = CostModel.from_json(old)
    assert cost.per_prefill_token_s == cost.per_decode_token_s == 0.002
    assert cost.prefill_step_s == 0.0 and cost.request_overhead_s == 0.0


def test_a_file_missing_a_coefficient_says_what_a_cost_model_needs() -> None:
    with pytest.raises(ValueError, match="it needs fixed_s, per_prefill_token_s"):
        CostModel.from_json({"fixed_s": 0.07, "per_kv_token_s": 7e-6})


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.model.tiny_models import make_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", path, seed=0)
    return str(path)


def test_the_fit_steps_of_a_real_engine_tell_every_coefficient_apart(tiny_model: str) -> None:
    from yaie.config import EngineConfig
    from yaie.engine.engine import Engine
    from yaie_bench.cost_fit import time_steps

    shapes, seconds = time_steps(Engine(EngineConfig(model=tiny_model, kv_cache_memory=8 * 2**20)))
    assert len(shapes) == len(seconds) and min(seconds) > 0
    # Every feature varies independently of the others, so a fit pins down every coefficient:
    # given these very shapes priced by a known model, it gives that model back.
    assert np.linalg.matrix_rank(np.array([step_features(shape) for shape in shapes])) == len(COEFFICIENTS)
    fitted = CostModel.fit(shapes, [TRUTH.step_time(s) for s in shapes])
    for name in COEFFICIENTS:
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    kinds = {(bool(s.num_prefill_tokens), bool(s.num_decode_tokens)) for s in shapes}
    assert kinds == {(True, False), (False, True), (True, True)}  # prefill, decode and mixed steps


def test_the_engine_sums_the_shapes_and_times_of_its_steps(tiny_model: str) -> None:
    from yaie.config import EngineConfig
    from yaie.engine.engine import Engine
    from yaie.sampling_params import SamplingParams

    config = EngineConfig(model=tiny_model, kv_cache_memory=8 * 2**20, max_num_batched_tokens=16)
    engine = Engine(config)
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    engine.add_request(None, list(range(1, 21)), params)  # 20 prompt tokens: chunks of 16 and 4
    engine.add_request(None, list(range(30, 33)), params)  # joins in the second step
    while engine.has_unfinished_requests():
        engine.step()
    totals = engine.stats().steps
    # Step 1: 16 prompt tokens of the first (no sample). Step 2: its last 4 and all 3 of the
    # second (both sample). Then 4 decode steps of both.
    assert (totals.num_steps, totals.num_prefill_steps) == (6, 2)
    assert (totals.num_prefill_tokens, totals.num_decode_tokens, totals.num_sampled) == (23, 8, 10)
    kv_first = 16 + 20 + sum(20 + i for i in range(1, 5))
    kv_second = 3 + sum(3 + i for i in range(1, 5))
    assert totals.num_kv_tokens == kv_first + kv_second
    assert totals.busy_s > 0.0


@pytest.mark.slow  # load-tests a server of the tiny model
def test_yaie_bench_fit_cost_model_writes_a_model_simulate_loads(tiny_model: str, tmp_path: Path) -> None:
    from yaie.cli import main

    out = tmp_path / "cost.json"
    assert main(["bench", "--fit-cost-model", str(out), tiny_model, "--kv-cache-memory", "8MiB"]) == 0
    cost = CostModel.load(out)
    assert min(getattr(cost, name) for name in COEFFICIENTS) >= 0.0
    assert cost.fixed_s + cost.prefill_step_s > 0.0  # a step takes time
    assert cost.engine["block_size"] == 16 and cost.engine["num_kv_blocks"] > 0
    assert json.loads(out.read_text())["engine"]["model"]
    # The front end was measured against a real server: a request spends time outside the engine.
    assert cost.request_overhead_s > 0.0
    assert cost.front_end_per_request_s >= 0.0 and cost.front_end_per_output_s >= 0.0


def test_requests_reach_the_engine_one_front_end_overhead_apart() -> None:
    from yaie.simulate import EngineSettings, Request, Scenario, Traffic, simulate

    settings = EngineSettings(num_kv_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    # Decode-only prices: a step costs 10 ms and a prompt 1 ms more per token.
    cost = CostModel(0.01, 0.0, 1e-3, 0.0, 0.0)
    requests = [Request(f"r{i}", [1 + i] * 10, 1) for i in range(3)]  # all sent at 0
    direct = simulate(Traffic(requests), Scenario.parse("continuous"), settings, cost)
    assert [r.first_token_s for r in direct.records] == pytest.approx([0.01 + 30 * 1e-3] * 3)  # one step
    # With 4 ms each in front: r0 reaches the engine at 4 ms and is computed alone (20 ms); r1
    # (8 ms) and r2 (12 ms) wait for that step and share the next one.
    cost = replace(cost, request_overhead_s=0.004)
    delayed = simulate(Traffic(requests), Scenario.parse("continuous"), settings, cost)
    first = {r.request_id: r.first_token_s for r in delayed.records}
    assert first["r0"] == pytest.approx(0.004 + 0.02)
    assert first["r1"] == pytest.approx(0.024 + 0.03) and first["r2"] == first["r1"]
    assert all(r.arrival_s == 0.0 for r in delayed.records)  # TTFT counts from the send


def test_the_front_end_lengthens_the_steps_that_admit_requests_and_stream_outputs() -> None:
    from yaie.simulate import EngineSettings, Request, Scenario, Traffic, simulate

    settings = EngineSettings(num_kv_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    cost = CostModel(0.01, 0.0, 1e-3, 0.0, 0.0, front_end_per_request_s=0.005, front_end_per_output_s=0.002)
    requests = [Request(f"r{i}", [1 + i] * 10, 3) for i in range(3)]  # all sent at 0
    result = simulate(Traffic(requests), Scenario.parse("continuous"), settings, cost)
    # Step 1 admits all three and streams their first tokens; steps 2 and 3 stream one each.
    first_step = 0.01 + 30 * 1e-3 + 3 * 0.005 + 3 * 0.002
    assert [r.first_token_s for r in result.records] == pytest.approx([first_step] * 3)
    assert [r.finish_s for r in result.records] == pytest.approx([first_step + 2 * (0.01 + 3 * 0.002)] * 3)
