"""A request's priority and deadline through the engine on the bundled model: a request past its
deadline ends with finish_reason "timeout" whether it waits or runs, gives back every block at
once, and the others carry on as if it had never been there; priorities order admission."""

from __future__ import annotations

import pytest

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, InvalidRequestError, SamplingParams
from yaie.engine.sequence import SequenceStatus

PROMPT = "Tell me a very long story about a lighthouse keeper."
OTHER = "List the planets of the solar system."
# Far more tokens than the bundled model writes in a second on any CPU this runs on.
LONG = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(llm: LLM) -> dict[str, list]:
    """Step until every request is finished; each request's outputs, in order."""
    outputs: dict[str, list] = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


@pytest.mark.slow
def test_a_running_request_past_its_deadline_ends_with_timeout_and_frees_its_blocks(llm):
    engine = llm.engine
    engine.add_request("slow", PROMPT, LONG, timeout=0.5)
    engine.add_request("other", OTHER, SHORT)
    seqs = [choice.seq for choice in engine.requests["slow"].choices]
    outputs = run(llm)
    last = outputs["slow"][-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["timeout"]
    generated = last.outputs[0]
    assert len(generated.token_ids) < LONG.max_tokens
    assert "".join(o.outputs[0].delta_text for o in outputs["slow"]) == generated.text
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED_TIMEOUT and seq.block_table == []
    # The other request got exactly what it gets alone.
    [alone] = llm.generate([OTHER], SHORT)
    assert outputs["other"][-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outputs["other"][-1].outputs[0].finish_reason == "length"
    assert_no_leak(llm)


@pytest.mark.slow
def test_a_waiting_request_past_its_deadline_ends_before_it_runs(llm):
    engine = llm.engine
    # The deadline is taken before the prompt is even tokenized: it has passed by the first step.
    engine.add_request("late", PROMPT, SamplingParams(max_tokens=8, n=3), timeout=1e-6)
    engine.add_request("other", OTHER, SHORT)
    seqs = [choice.seq for choice in engine.requests["late"].choices]
    outputs = run(llm)
    [last] = outputs["late"]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["timeout"] * 3
    assert all(c.token_ids == [] and c.text == "" for c in last.outputs)
    assert all(seq.status is SequenceStatus.FINISHED_TIMEOUT and not seq.block_table for seq in seqs)
    assert outputs["other"][-1].outputs[0].finish_reason == "length"
    assert_no_leak(llm)


@pytest.mark.slow
def test_the_timeout_frees_every_block_the_moment_it_passes(llm):
    engine = llm.engine
    engine.add_request("slow", PROMPT, LONG, timeout=0.5)
    engine.add_request("other", OTHER, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    while "slow" in engine.requests:
        engine.step()
    # Right after the step that ended it: every block in use is the other request's (or cached).
    [other] = [choice.seq for choice in engine.requests["other"].choices]
    cached_only = engine.block_pool.num_cached_only
    assert engine.block_pool.num_used == len(other.block_table) + cached_only
    engine.abort("other")
    assert_no_leak(llm)


@pytest.mark.slow
def test_llm_generate_takes_a_timeout_and_fcfs_refuses_priorities(llm):
    [cut] = llm.generate([PROMPT], LONG, timeout=0.5)
    assert cut.outputs[0].finish_reason == "timeout"
    with pytest.raises(InvalidRequestError, match="priority scheduling is not enabled"):
        llm.generate([PROMPT, OTHER], SHORT, priority=[0, 1])
    assert not llm.engine.has_unfinished_requests()  # all or none: the first was taken back
    for timeout in (0, -1.0, float("inf")):
        with pytest.raises(InvalidRequestError, match="timeout"):
            llm.generate([OTHER], SHORT, timeout=timeout)
    assert_no_leak(llm)


@pytest.mark.slow
def test_priority_policy_admits_lower_priority_values_first():
    llm = LLM(num_kv_blocks=256, max_num_seqs=1, quantization="none", scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for name, priority in [("background", 5), ("normal", 0), ("urgent", -3), ("normal-later", 0)]:
        engine.add_request(name, OTHER, params, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [output.request_id for output in engine.step() if output.finished]
    assert order == ["urgent", "normal", "normal-later", "background"]
    outputs = llm.generate([OTHER, PROMPT], params, priority=[1, -1])
    assert all(output.outputs[0].finish_reason == "length" for output in outputs)
    assert_no_leak(llm)
