"""The cost-model fitter behind `yaie bench --fit-cost-model`.

It measures the engine itself: it times `Engine.step` over prefills of several lengths and
decodes of several batch sizes and contexts, and fits the step-time model `yaie simulate` runs
on (yaie/simulate/cost_model.py); `fit_front_end` then load-tests a server running the same
engine to price its front end.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

from rich.console import Console

from yaie.config import EngineConfig
from yaie.engine.engine import Engine
from yaie.engine.step_shape import StepShape, StepTotals
from yaie.sampling_params import SamplingParams
from yaie.simulate.cost_model import CostModel, ServedLevel
from yaie.simulate.report import percentile
from yaie_bench.counters import STEP_COUNTERS
from yaie_bench.load_generator import BenchConfig, run_bench

# Step shapes timed for the fit, chosen so that every coefficient of the cost model moves on its
# own: one prompt of each length (prefill: many tokens, one sample); batches of each size at each
# context (decode: one token and one sample per sequence; their prompts, several to a step, are
# prefills that sample several times, and the long ones are chunks that sample nothing); and
# decoding batches that prompts join one per step (mixed steps, as a server's are while requests
# come and go).
FIT_PROMPT_LENS = (16, 64, 256, 1024, 2048)
FIT_BATCHES = (1, 4, 8, 16, 32)
FIT_CONTEXTS = (32, 512)
FIT_DECODE_STEPS = 16
FIT_MIXED_BATCHES = (4, 16)
FIT_JOINING_PROMPT_LENS = (8, 32, 128, 512)


def fit_cost_model(config: EngineConfig) -> tuple[CostModel, float]:
    """Build the engine `config` describes, time its steps, and fit a cost model to them.

    Returns the model and its median relative error over the timed steps.
    """
    engine = Engine(config)
    shapes, seconds = time_steps(engine)
    settings = {
        "model": str(engine.model_info.path),
        "block_size": config.block_size,
        "num_kv_blocks": engine.block_pool.num_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "long_prefill_token_threshold": config.long_prefill_token_threshold,
        "prefix_caching": config.enable_prefix_caching,
    }
    cost = CostModel.fit(shapes, seconds, settings)
    errors = [abs(cost.step_time(shape) - t) / t for shape, t in zip(shapes, seconds, strict=True)]
    return cost, percentile(errors, 50) or 0.0


def time_steps(engine: Engine) -> tuple[list[StepShape], list[float]]:
    """The shapes and times of the steps the fit runs on `engine` (see FIT_PROMPT_LENS)."""
    config = engine.config
    budget = min(config.max_num_batched_tokens, engine.max_model_len - FIT_DECODE_STEPS)
    _run_timed(engine, [min(16, budget)], 4, [], [])  # warm-up: first-call costs are not step costs
    shapes: list[StepShape] = []
    seconds: list[float] = []
    for length in FIT_PROMPT_LENS:
        _run_timed(engine, [min(length, budget)], 1, shapes, seconds)
    for batch in FIT_BATCHES:
        for context in FIT_CONTEXTS:
            lengths = [min(context, budget)] * min(batch, config.max_num_seqs)
            _run_timed(engine, lengths, FIT_DECODE_STEPS, shapes, seconds)
    for batch in FIT_MIXED_BATCHES:
        lengths = [min(FIT_CONTEXTS[0], budget)] * min(batch, config.max_num_seqs - 1)
        joining = tuple(min(length, budget - batch) for length in FIT_JOINING_PROMPT_LENS)
        _run_timed(engine, lengths, FIT_DECODE_STEPS, shapes, seconds, joining)
    return shapes, seconds


def _run_timed(
    engine: Engine,
    prompt_lens: list[int],
    max_tokens: int,
    shapes: list[StepShape],
    seconds: list[float],
    joining: tuple[int, ...] = (),
) -> None:
    """Run requests of random (so uncached) prompts to the end, recording each step's shape and
    time (what the step added to the engine's StepTotals). Once they decode, a one-token request
    of each `joining` length joins, one per step."""
    rng = random.Random(len(shapes))
    vocab = engine.model_config.vocab_size

    def add(length: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(None, [rng.randrange(vocab) for _ in range(length)], params)

    for length in prompt_lens:
        add(length, max_tokens)
    waiting = list(joining)
    while engine.has_unfinished_requests():
        before = replace(engine.step_totals)
        engine.step()
        after = engine.step_totals
        if after.num_steps == before.num_steps:
            continue  # the step computed nothing
        shape = StepShape(
            after.num_prefill_tokens - before.num_prefill_tokens,
            after.num_decode_tokens - before.num_decode_tokens,
            after.num_kv_tokens - before.num_kv_tokens,
            after.num_sampled - before.num_sampled,
        )
        shapes.append(shape)
        seconds.append(after.busy_s - before.busy_s)
        if waiting and shape.num_sampled:  # the batch is past its prompts: it decodes
            add(waiting.pop(0), 1)


# Load-test levels that price the front end (CostModel.with_front_end): (clients, requests, max
# tokens). One client measures a request's time outside the engine; the others, at two output
# lengths, how much the front end's work for requests and for outputs lengthens the steps.
FRONT_END_LEVELS = ((1, 8, 16), (4, 16, 64), (16, 32, 16), (16, 32, 64))


def fit_front_end(base_url: str, cost: CostModel, console: Console) -> CostModel:
    """`cost` with the front end's terms, from FRONT_END_LEVELS against the yaie server at
    `base_url` (running the engine `cost` was fitted on), short prompts, streamed."""
    served: list[ServedLevel] = []
    for clients, num_requests, max_tokens in FRONT_END_LEVELS:
        config = BenchConfig(
            base_url=base_url, model="", prompt_set="short", max_tokens=max_tokens, temperature=0.0,
            ignore_eos=True, eos_logit_bias=[], extra_body={}, api_key=None, timeout_s=300.0,
            long_prompt_tokens=1000,
        )  # fmt: skip
        [level] = asyncio.run(run_bench(config, [clients], num_requests, 1, console))
        summary = level.summary()
        if level.steps is None or summary["errors"]:
            raise SystemExit(f"the front-end level of {clients} clients failed: {summary['error_samples']}")
        totals = StepTotals()
        for name, attribute in STEP_COUNTERS.items():
            value = level.steps[name]
            setattr(totals, attribute, value if attribute == "busy_s" else round(value))
        served.append(ServedLevel(totals, num_requests, clients, level.duration_s))
    return cost.with_front_end(served)
