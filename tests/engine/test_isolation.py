"""A failure inside one request fails that request alone: failures injected at each stage of
the step (the forward, the sampler, the output processing) while other requests, greedy and
seeded, share the step with it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.errors import RequestFailedError
from yaie.outputs import RequestOutput

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of"]
GOOD = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, seed=11, n=2, top_p=0.9, max_tokens=12, ignore_eos=True),
]
BAD = "bad"


class Boom(RuntimeError):
    pass


def run(llm: LLM, bad_params: SamplingParams) -> dict[str, RequestOutput]:
    engine = llm.engine
    for i, params in enumerate(GOOD):
        engine.add_request(f"good-{i}", PROMPTS[i], params)
    engine.add_request(BAD, PROMPTS[3], bad_params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update((output.request_id, output) for output in engine.step() if output.finished)
    return done


def check(llm: LLM, done: dict[str, RequestOutput]) -> None:
    assert isinstance(done[BAD].error, RequestFailedError) and "Boom" in str(done[BAD].error)
    for i, params in enumerate(GOOD):
        output = done[f"good-{i}"]
        assert output.error is None
        [alone] = llm.generate([PROMPTS[i]], params)
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in alone.outputs]
        assert [c.text for c in output.outputs] == [c.text for c in alone.outputs]
    assert_no_leak(llm)


def failing_for_bad(original: Callable[..., Any], seqs_of: Callable[..., list[Any]]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        if any(seq.request_id == BAD for seq in seqs_of(*args)):
            raise Boom("injected")
        return original(*args)

    return wrapper


@pytest.fixture
def patched(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    engine = llm.engine

    def patch(stage: str) -> None:
        if stage == "forward":
            seqs_of = lambda batch: [item.seq for item in batch.scheduled]  # noqa: E731
            monkeypatch.setattr(engine.runner, "execute", failing_for_bad(engine.runner.execute, seqs_of))
        elif stage == "sampler":
            seqs_of = lambda seqs, device: list(seqs)  # noqa: E731
            monkeypatch.setattr(engine.sampler, "prepare", failing_for_bad(engine.sampler.prepare, seqs_of))
        else:
            original = engine._new_request

            def new_request(request_id: str, *args: Any) -> Any:
                request = original(request_id, *args)
                if request_id == BAD:
                    for choice in request.choices:
                        choice.detokenizer.add = failing_token  # type: ignore[method-assign]
                return request

            def failing_token(token_id: int) -> str:
                raise Boom("injected")

            monkeypatch.setattr(engine, "_new_request", new_request)

    yield patch


@pytest.mark.parametrize("stage", ["forward", "sampler", "output"])
def test_a_failure_fails_only_its_request(llm: LLM, patched: Callable[[str], None], stage: str) -> None:
    patched(stage)
    check(llm, run(llm, SamplingParams(temperature=0, max_tokens=12)))


def test_a_failing_request_with_several_choices_goes_as_a_whole(
    llm: LLM, patched: Callable[[str], None]
) -> None:
    patched("forward")
    check(llm, run(llm, SamplingParams(temperature=0.7, n=3, seed=3, max_tokens=12)))


def test_a_failure_after_some_tokens_keeps_the_others_going(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bad request fails mid-generation, when its 5th token is being sampled."""
    engine = llm.engine
    original = engine.sampler.prepare

    def prepare(seqs: Any, device: Any) -> Any:
        if any(seq.request_id == BAD and seq.num_output_tokens == 4 for seq in seqs):
            raise Boom("injected")
        return original(seqs, device)

    monkeypatch.setattr(engine.sampler, "prepare", prepare)
    check(llm, run(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
