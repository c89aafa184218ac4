"""Sampling through the whole engine on the bundled model: seeds whatever the batch, every
per-request control side by side in one batch, logprobs against the model's own log-softmax,
and stop strings across token boundaries with n > 1.

The sampler's statistics are tested in tests/unit/test_sampler.py; here the question is whether
the engine hands each row its own parameters, history and generator, and reports the result.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
import torch

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.engine.engine import Engine
from yaie.outputs import CompletionOutput, RequestOutput, TokenLogprob
from yaie.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, SamplingSeq

pytestmark = pytest.mark.slow

STORY = "Once upon a time"
COUNT = "Count: one, two, three,"
QUIZ = "Q: What is 2 + 2?\nA:"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
OTHER_PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "List three colours:",
    "The capital of Italy is",
    "In 1969, astronauts",
    "Water boils at",
    "Roses are red,",
    "My favourite recipe is",
]
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)


def random_params(index: int) -> SamplingParams:
    """Unseeded sampling, of a different length per request, to vary the batch as it runs."""
    return SamplingParams(temperature=1.0, max_tokens=6 + 5 * index, ignore_eos=True)


def run_engine(engine: Engine) -> tuple[dict[str, RequestOutput], dict[tuple[str, int], str]]:
    """Step until idle: each request's final output, and each choice's streamed text."""
    final: dict[str, RequestOutput] = {}
    streamed: dict[tuple[str, int], str] = defaultdict(str)
    while engine.has_unfinished_requests():
        for output in engine.step():
            for choice in output.outputs:
                streamed[output.request_id, choice.index] += choice.delta_text
            if output.finished:
                final[output.request_id] = output
    return final, streamed


def only(output: RequestOutput) -> CompletionOutput:
    [choice] = output.outputs
    return choice


# -- seeds ----------------------------------------------------------------------------------


def test_seed_gives_the_same_text_whatever_the_batch_and_arrival_order(llm: LLM) -> None:
    alone = only(llm.generate(STORY, SEEDED)[0])
    assert len(alone.token_ids) == SEEDED.max_tokens

    # Among 8 other sampled requests, at the front, in the middle and at the back of the batch.
    for position in (0, 4, 8):
        prompts = [*OTHER_PROMPTS[:position], STORY, *OTHER_PROMPTS[position:]]
        params = [random_params(i) for i in range(len(OTHER_PROMPTS))]
        params.insert(position, SEEDED)
        outputs = llm.generate(prompts, params)
        got = only(outputs[position])
        assert (got.token_ids, got.text) == (alone.token_ids, alone.text), position

    # Arriving while others are mid-decode, and then joined by more requests while it decodes.
    engine = llm.engine
    for i, prompt in enumerate(OTHER_PROMPTS[:4]):
        engine.add_request(f"early-{i}", prompt, random_params(i + 2))
    for _ in range(3):
        engine.step()
    engine.add_request("seeded", STORY, SEEDED)
    for _ in range(4):
        engine.step()
    for i, prompt in enumerate(OTHER_PROMPTS[4:]):
        engine.add_request(f"late-{i}", prompt, random_params(i))
    final, _ = run_engine(engine)
    late = only(final["seeded"])
    assert (late.token_ids, late.text) == (alone.token_ids, alone.text)

    other_seeds = llm.generate([STORY, STORY], [replace(SEEDED, seed=1), replace(SEEDED, seed=2)])
    texts = {alone.text, *(only(output).text for output in other_seeds)}
    assert len(texts) == 3
    assert_no_leak(llm)


# -- every control in one batch -------------------------------------------------------------


@dataclass
class Step:
    """One sampler call's view of one row: the raw logits, and the history they followed."""

    logits: torch.Tensor  # [V], float64
    prompt: list[int]
    output: list[int]  # the row's output tokens before this step
    token: int  # what the sampler picked


class RecordingSampler:
    """Stands in for the engine's sampler, and keeps each row's logits, keyed by its params."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.steps: dict[int, list[Step]] = defaultdict(list)
        self._seqs: Sequence[SamplingSeq] = []  # the rows of the batch last prepared

    def prepare(self, seqs: Sequence[SamplingSeq], device: torch.device) -> SamplingBatch:
        self._seqs = seqs
        return self.inner.prepare(seqs, device)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        result = self.inner.sample(logits, batch)
        for row, seq in enumerate(self._seqs):
            (token,) = result.token_ids[row]  # one token a row: this engine does not speculate
            step = Step(
                logits[row].double().clone(),
                list(seq.prompt_token_ids),
                list(seq.output_token_ids),
                token,
            )
            self.steps[id(seq.sampling_params)].append(step)
        return result


def expected_logits(step: Step, params: SamplingParams, eos_ids: set[int]) -> torch.Tensor:
    """What the documented controls make of a row's raw logits, before temperature: logit_bias,
    min_tokens bans, repetition penalty (prompt and output), frequency and presence penalties."""
    logits = step.logits.clone()
    for token_id, bias in params.logit_bias.items():
        logits[token_id] += bias
    if len(step.output) < params.min_tokens:
        banned = [*params.stop_token_ids, *([] if params.ignore_eos else sorted(eos_ids))]
        logits[banned] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(step.prompt) | set(step.output)))
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    for token_id, count in Counter(step.output).items():
        logits[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return logits


def assert_picks_the_argmax(steps: Sequence[Step], params: SamplingParams, eos_ids: set[int]) -> None:
    for i, step in enumerate(steps):
        logits = expected_logits(step, params, eos_ids)
        # float32 in the engine, float64 here: allow a rounding-sized tie.
        assert logits[step.token] >= logits.max() - 1e-4, f"step {i}"


def test_every_control_applies_per_request_in_one_mixed_batch(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    france = llm.encode_chat(FRANCE)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = {
        name: only(llm.generate([prompt], greedy)[0]).token_ids
        for name, prompt in (("france", france), ("quiz", QUIZ), ("count", COUNT), ("story", STORY))
    }
    assert plain["france"][-1] in engine.eos_token_ids and len(plain["france"]) < 12  # stops early
    stop_id = plain["story"][6]
    assert stop_id not in plain["story"][:6]

    rows: dict[str, tuple[str | list[int], SamplingParams]] = {
        "greedy": (france, greedy),
        "top_k": (STORY, SamplingParams(temperature=1.5, top_k=4, seed=1, max_tokens=16, ignore_eos=True)),
        "top_p": (STORY, SamplingParams(temperature=1.0, top_p=0.5, seed=2, max_tokens=16, ignore_eos=True)),
        "min_p": (STORY, SamplingParams(temperature=1.5, min_p=0.2, seed=3, max_tokens=16, ignore_eos=True)),
        "repetition": (QUIZ, replace(greedy, repetition_penalty=1.5)),
        "frequency": (COUNT, replace(greedy, frequency_penalty=1.0, presence_penalty=0.5)),
        "logit_bias": (france, replace(greedy, logit_bias={plain["france"][0]: -100.0})),
        "min_tokens": (france, replace(greedy, min_tokens=12)),
        "stop_token_ids": (STORY, replace(greedy, stop_token_ids=[stop_id])),
    }
    recorder = RecordingSampler(engine.sampler)
    monkeypatch.setattr(engine, "sampler", recorder)
    outputs = llm.generate([prompt for prompt, _ in rows.values()], [params for _, params in rows.values()])
    got = {name: only(output) for name, output in zip(rows, outputs, strict=True)}
    steps = {name: recorder.steps[id(params)] for name, (_, params) in rows.items()}
    for name, choice in got.items():
        assert [step.token for step in steps[name]] == choice.token_ids, name

    assert got["greedy"].token_ids == plain["france"]

    # Sampled rows: every token lies inside its row's own truncation, and they did sample.
    for step in steps["top_k"]:
        assert step.logits[step.token] >= step.logits.topk(4).values[-1]
    for step in steps["top_p"]:
        probs = torch.softmax(step.logits, dim=-1)
        assert probs[probs > probs[step.token]].sum() < 0.5 + 1e-6
    for step in steps["min_p"]:
        probs = torch.softmax(step.logits / 1.5, dim=-1)
        assert probs[step.token] >= 0.2 * probs.max() * (1 - 1e-6)
    for name in ("top_k", "top_p", "min_p"):
        assert any(step.token != step.logits.argmax() for step in steps[name]), name

    # Greedy rows with penalties, a bias or min_tokens: the argmax of their processed logits,
    # which is not the plain greedy choice.
    eos_ids = engine.eos_token_ids
    for name in ("repetition", "frequency", "logit_bias", "min_tokens"):
        assert_picks_the_argmax(steps[name], rows[name][1], eos_ids)
    assert got["repetition"].token_ids != plain["quiz"]
    assert got["frequency"].token_ids != plain["count"]
    assert got["logit_bias"].token_ids[0] != plain["france"][0]

    assert len(got["min_tokens"].token_ids) >= 12
    assert not eos_ids & set(got["min_tokens"].token_ids[:12])
    assert got["min_tokens"].token_ids[: len(plain["france"]) - 1] == plain["france"][:-1]

    stopped = got["stop_token_ids"]
    assert stopped.token_ids == plain["story"][:7]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_id)

    # Each row's result is its own: the same batch in reverse order gives the same outputs.
    monkeypatch.undo()  # the recorder has served; stop keeping logits
    reverse = llm.generate(
        [prompt for prompt, _ in reversed(rows.values())], [params for _, params in reversed(rows.values())]
    )
    assert [only(output).token_ids for output in reversed(reverse)] == [c.token_ids for c in got.values()]
    assert_no_leak(llm)


# -- logprobs -------------------------------------------------------------------------------


def assert_sorted_top(step: TokenLogprob, k: int) -> None:
    values = [logprob for _, logprob in step.top]
    assert len(values) == k
    assert values == sorted(values, reverse=True)
    assert step.logprob <= values[0] + 1e-6


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=5, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=5, max_tokens=12, logprobs=5, ignore_eos=True),
    ],
    ids=["greedy", "temperature-1", "temperature-0.5"],
)
def test_logprobs_match_the_log_softmax_of_the_models_logits(llm: LLM, params: SamplingParams) -> None:
    [output] = llm.generate(COUNT, params)
    choice = only(output)
    assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
    for token_id, step in zip(choice.token_ids, choice.logprobs, strict=True):
        assert step.token_id == token_id
        assert_sorted_top(step, 5)
        if params.greedy:
            assert step.top[0] == (token_id, pytest.approx(step.logprob))

    # The same tokens as a prompt: its prompt logprobs are the raw log_softmax at each position,
    # computed in one prefill rather than step by step.
    prompt = output.prompt_token_ids
    [echo] = llm.generate(
        [prompt + choice.token_ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    )
    raw = echo.prompt_logprobs
    assert raw is not None and len(raw) == len(prompt) + len(choice.token_ids)
    assert raw[0] is None
    assert [lp.token_id for lp in raw[1:] if lp is not None] == echo.prompt_token_ids[1:]
    temperature = params.temperature or 1.0
    for step, reference in zip(choice.logprobs, raw[len(prompt) :], strict=True):
        assert reference is not None
        assert [t for t, _ in step.top] == [t for t, _ in reference.top]
        if temperature == 1.0:
            assert step.logprob == pytest.approx(reference.logprob, abs=1e-3)
            assert [lp for _, lp in step.top] == pytest.approx([lp for _, lp in reference.top], abs=1e-3)
        else:
            # Scaled by the temperature: differences between alternatives are divided by it.
            best = reference.top[0][1]
            gaps = [(lp - best) / temperature for _, lp in reference.top]
            assert [lp - step.top[0][1] for _, lp in step.top] == pytest.approx(gaps, abs=1e-3)
            assert step.logprob - step.top[0][1] == pytest.approx(
                (reference.logprob - best) / temperature, abs=1e-3
            )
    assert_no_leak(llm)


# -- stop strings ---------------------------------------------------------------------------


def boundary_stop(llm: LLM, token_ids: list[int], text: str) -> str:
    """Four characters of `text` straddling a boundary between two of its tokens, whose first
    occurrence is there: as a stop string, only a later token completes it."""
    ends = [
        len(llm.tokenizer.decode(token_ids[: i + 1], skip_special_tokens=True)) for i in range(len(token_ids))
    ]
    for end in ends[3:-1]:
        candidate = text[end - 2 : end + 2]
        if len(candidate) == 4 and candidate.strip() and text.find(candidate) == end - 2:
            return candidate
    raise AssertionError(f"no stop string spans a token boundary in {text!r}")


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_stop_strings_across_token_boundaries_with_n_2(llm: LLM, include_stop_str_in_output: bool) -> None:
    free_params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=32, ignore_eos=True)
    [free] = llm.generate(STORY, free_params)
    assert free.outputs[0].text != free.outputs[1].text
    stops = [boundary_stop(llm, choice.token_ids, choice.text) for choice in free.outputs]

    params = replace(free_params, stop=stops, include_stop_str_in_output=include_stop_str_in_output)
    llm.engine.add_request("stops", STORY, params)
    final, streamed = run_engine(llm.engine)
    for choice, unstopped in zip(final["stops"].outputs, free.outputs, strict=True):
        # The first stop string to be completed (both have the same length) ends the choice.
        position, stop = min((unstopped.text.find(s), s) for s in stops if s in unstopped.text)
        end = position + len(stop) if include_stop_str_in_output else position
        assert choice.text == unstopped.text[:end] == streamed["stops", choice.index]
        assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
        # Same seed, same tokens, up to the one that completed the stop string.
        assert choice.token_ids == unstopped.token_ids[: len(choice.token_ids)]
        before_last = llm.tokenizer.decode(choice.token_ids[:-1], skip_special_tokens=True)
        assert len(before_last) < position + len(stop)
    assert_no_leak(llm)
