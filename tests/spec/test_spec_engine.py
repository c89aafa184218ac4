"""Speculative decoding end to end on tiny random models: greedy outputs are token for token
those without speculation, under every scheduling situation, and nothing leaks."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.spec.proposers import MAX_CATCH_UP_TOKENS, DraftModelProposer

PROMPTS = [
    "hello world hello world hello world hello",
    "the cat sat on the mat and the cat sat on",
    "abc abc abc abc abc",
    "one two three four five six seven eight nine ten one two three",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Every sequence speculates, however many decode together.
ALWAYS = {"disable_by_batch_size": 1024, "min_acceptance_rate": 0.0}


def _generate(model: str, spec: dict[str, Any] | None, prompts: list[str], params: Any, **engine: Any):
    llm = LLM(model, speculative_config=spec, **engine)
    outputs = llm.generate(prompts, params)
    return llm, [[c.token_ids for c in out.outputs] for out in outputs], outputs


def _methods(target: str, other: str) -> dict[str, dict[str, Any]]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, **ALWAYS},
        "draft=target": {"method": "draft_model", "model": target, "num_speculative_tokens": 3, **ALWAYS},
        "draft=other": {"method": "draft_model", "model": other, "num_speculative_tokens": 3, **ALWAYS},
    }


SITUATIONS: dict[str, dict[str, Any]] = {
    "plain": {"num_kv_blocks": 256},
    "chunked_prefill": {"num_kv_blocks": 256, "max_num_batched_tokens": 8},
    "preemption": {"num_kv_blocks": 16, "block_size": 4},
    "no_prefix_cache": {"num_kv_blocks": 256, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("situation", SITUATIONS)
@pytest.mark.parametrize("method", ["ngram", "draft=target", "draft=other"])
def test_greedy_identical_with_and_without_speculation(
    tiny_target: str, tiny_other: str, method: str, situation: str
) -> None:
    engine = SITUATIONS[situation]
    spec = _methods(tiny_target, tiny_other)[method]
    _, expected, _ = _generate(tiny_target, None, PROMPTS, GREEDY, **engine)
    llm, got, _ = _generate(tiny_target, spec, PROMPTS, GREEDY, **engine)
    assert got == expected
    stats = llm.engine.stats()
    assert stats.spec_decode is not None and stats.spec_decode.num_drafts > 0
    if method == "draft=target":  # the target agrees with itself on every proposal
        assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens
    if method == "draft=other":
        assert stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens / 2
    if situation == "preemption":
        assert stats.num_preemptions > 0
    assert_no_leak(llm)
    proposer = llm.engine.speculator.proposer  # type: ignore[union-attr]
    if isinstance(proposer, DraftModelProposer):
        assert proposer.pool.num_used == 0


def test_n_greater_than_one_and_a_shared_prefix(tiny_target: str) -> None:
    spec = {"method": "draft_model", "model": tiny_target, "num_speculative_tokens": 4, **ALWAYS}
    params = SamplingParams(temperature=0, max_tokens=20, n=3, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[0] + " world", PROMPTS[1]]
    _, expected, _ = _generate(tiny_target, None, prompts, params, num_kv_blocks=256, block_size=4)
    llm, got, _ = _generate(tiny_target, spec, prompts, params, num_kv_blocks=256, block_size=4)
    assert got == expected
    # The second run of the same prompts hits the prefix cache, which must hold verified tokens.
    again = [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]
    assert again == expected
    assert llm.engine.stats().spec_decode.num_drafts > 0  # type: ignore[union-attr]
    assert_no_leak(llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_inside_an_accepted_run(tiny_target: str, max_tokens: int) -> None:
    spec = {"method": "draft_model", "model": tiny_target, "num_speculative_tokens": 4, **ALWAYS}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    _, expected, _ = _generate(tiny_target, None, PROMPTS, params, num_kv_blocks=256)
    llm, got, outputs = _generate(tiny_target, spec, PROMPTS, params, num_kv_blocks=256)
    assert got == expected
    assert all(len(out.outputs[0].token_ids) == max_tokens for out in outputs)
    assert_no_leak(llm)


def test_stop_strings_and_stop_tokens_inside_an_accepted_run(tiny_target: str) -> None:
    base = LLM(tiny_target, num_kv_blocks=256)
    free = base.generate(PROMPTS, GREEDY)
    # Stop on text and on a token from the middle of each plain output.
    stops = [out.outputs[0].text[6:9] for out in free]
    stop_ids = [out.outputs[0].token_ids[9] for out in free]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s], stop_token_ids=[t])
        for s, t in zip(stops, stop_ids, strict=True)
    ]
    spec = {"method": "draft_model", "model": tiny_target, "num_speculative_tokens": 4, **ALWAYS}
    expected = base.generate(PROMPTS, params)
    llm = LLM(tiny_target, num_kv_blocks=256, speculative_config=spec)
    got = llm.generate(PROMPTS, params)
    for a, b in zip(expected, got, strict=True):
        assert (b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason) == (
            a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason,
        )  # fmt: skip
        assert b.outputs[0].finish_reason == "stop"
    assert_no_leak(llm)


def test_streamed_deltas_add_up_to_the_text(tiny_target: str) -> None:
    spec = {"method": "draft_model", "model": tiny_target, "num_speculative_tokens": 4, **ALWAYS}
    llm = LLM(tiny_target, num_kv_blocks=256, speculative_config=spec)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, stop=["zz"])
    request_id = engine.add_request(None, PROMPTS[0], params)
    text, tokens, last = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].delta_text
            tokens += out.outputs[0].delta_token_ids
            last = out
    assert last is not None and last.request_id == request_id
    assert text == last.outputs[0].text and tokens == last.outputs[0].token_ids
    assert engine.stats().spec_decode.num_drafts > 0  # type: ignore[union-attr]


def test_speculation_is_off_above_the_batch_size_threshold(tiny_target: str) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    spec["disable_by_batch_size"] = 2
    llm = LLM(tiny_target, num_kv_blocks=256, speculative_config=spec)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.engine.stats().spec_decode.num_drafts == 0  # type: ignore[union-attr]
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.engine.stats().spec_decode.num_drafts > 0  # type: ignore[union-attr]


def test_by_default_a_quantized_target_speculates_only_alone(tiny_target: str, tiny_gguf_q8: str) -> None:
    """The default threshold follows the target's weights (SpeculativeConfig.batch_size_limit):
    a dense target speculates with four decoding sequences, a quantized one only with one."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    spec["min_acceptance_rate"] = 0.0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    dense = LLM(tiny_target, num_kv_blocks=256, speculative_config=spec)
    dense.generate(PROMPTS, params)
    assert dense.engine.stats().spec_decode.num_drafts > 0  # type: ignore[union-attr]
    quantized = LLM(tiny_gguf_q8, num_kv_blocks=256, speculative_config=spec)
    assert quantized.engine.model_info.quantization != "none"
    quantized.generate(PROMPTS[:2], params)
    assert quantized.engine.stats().spec_decode.num_drafts == 0  # type: ignore[union-attr]
    quantized.generate(PROMPTS[:1], params)
    assert quantized.engine.stats().spec_decode.num_drafts > 0  # type: ignore[union-attr]


@pytest.mark.parametrize(("beside", "drafts"), [(8, True), (MAX_CATCH_UP_TOKENS + 16, False)])
def test_a_sequence_far_behind_its_draft_drafts_no_more(tiny_target: str, beside: int, drafts: bool) -> None:
    """Two sequences decode together without drafts (above disable_by_batch_size); once the
    other ends, the long one drafts only if the draft model has little of it to catch up on."""
    spec = {"method": "draft_model", "model": tiny_target, "num_speculative_tokens": 3, **ALWAYS}
    spec["disable_by_batch_size"] = 1
    llm = LLM(tiny_target, num_kv_blocks=256, speculative_config=spec)
    long = SamplingParams(temperature=0, max_tokens=MAX_CATCH_UP_TOKENS + 48, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=beside, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:2], [long, short])
    assert (llm.engine.stats().spec_decode.num_drafts > 0) == drafts  # type: ignore[union-attr]
    plain = LLM(tiny_target, num_kv_blocks=256).generate(PROMPTS[:2], [long, short])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


def test_a_sequence_with_low_acceptance_stops_drafting(tiny_target: str, tiny_other: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = {"method": "draft_model", "model": tiny_other, "num_speculative_tokens": 2}
    counts = []
    for rate in (0.0, 0.5):
        llm = LLM(tiny_target, num_kv_blocks=256, speculative_config={**base, "min_acceptance_rate": rate})
        llm.generate(PROMPTS[:1], params)
        counts.append(llm.engine.stats().spec_decode.num_drafts)  # type: ignore[union-attr]
    assert counts[1] < counts[0]
