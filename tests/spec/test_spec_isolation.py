"""With speculation on, a failure inside one request still fails that request alone: injected
in its drafting (it then decodes without drafts, its output unchanged), in a verifying forward
and in the verification (its request fails; the others, which shared those steps, get token
for token what they get without speculation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import yaie.spec.decoder as decoder_module
from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.errors import RequestFailedError
from yaie.outputs import RequestOutput

PROMPTS = [
    "hello world hello world hello world hello",
    "the cat sat on the mat and the cat sat on",
    "abc abc abc abc abc",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SPEC = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
    "disable_by_batch_size": 1024, "min_acceptance_rate": 0.0,
}  # fmt: skip
BAD = "bad"


class Boom(RuntimeError):
    pass


def _run(llm: LLM) -> dict[str, RequestOutput]:
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"good-{i}", prompt, GREEDY)
    engine.add_request(BAD, PROMPTS[0], GREEDY)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update((output.request_id, output) for output in engine.step() if output.finished)
    return done


def _failing_for_bad(original: Callable[..., Any], bad: Callable[..., bool]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        if bad(*args):
            raise Boom("injected")
        return original(*args)

    return wrapper


def _bad_is_verified(batch: Any) -> bool:
    return any(item.seq.request_id == BAD and item.spec_token_ids for item in batch.scheduled)


@pytest.mark.parametrize("stage", ["draft", "forward", "verify"])
def test_a_failure_with_speculation_fails_only_its_request(
    tiny_target: str, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = LLM(tiny_target, num_kv_blocks=256).generate(PROMPTS, GREEDY)
    expected = [out.outputs[0].token_ids for out in plain]
    llm = LLM(tiny_target, num_kv_blocks=256, speculative_config=SPEC)
    engine = llm.engine
    assert engine.speculator is not None
    if stage == "draft":
        proposer = engine.speculator.proposer
        bad_seqs = lambda seqs, limits: any(seq.request_id == BAD for seq in seqs)  # noqa: E731
        monkeypatch.setattr(proposer, "propose", _failing_for_bad(proposer.propose, bad_seqs))
    elif stage == "forward":
        execute = _failing_for_bad(engine.runner.execute, _bad_is_verified)
        monkeypatch.setattr(engine.runner, "execute", execute)
    else:
        bad_rows = lambda sampler, logits, seqs, drafts: any(seq.request_id == BAD for seq in seqs)  # noqa: E731
        monkeypatch.setattr(decoder_module, "verify", _failing_for_bad(decoder_module.verify, bad_rows))
    done = _run(llm)
    for i, tokens in enumerate(expected):
        output = done[f"good-{i}"]
        assert output.error is None and output.outputs[0].token_ids == tokens
    if stage == "draft":
        assert done[BAD].error is None and done[BAD].outputs[0].token_ids == expected[0]
    else:
        assert isinstance(done[BAD].error, RequestFailedError) and "Boom" in str(done[BAD].error)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_drafts > 0
    assert_no_leak(llm)
