"""EngineSnapshots on the bundled model: what the engine view is told, step by step."""

from __future__ import annotations

import json

import pytest

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.engine.sequence import ANONYMOUS_TENANT
from yaie.engine.snapshot import LABEL_TOKENS, EngineSnapshots

pytestmark = pytest.mark.slow


def test_snapshot_follows_a_request_from_prefill_to_the_prefix_cache(llm: LLM) -> None:
    engine = llm.engine
    # The tree view lists at most TREE_NODES nodes: start from an empty cache, so the nodes other
    # tests left behind cannot crowd this request's node out of the view.
    assert engine.scheduler.prefix_cache is not None
    engine.scheduler.prefix_cache.reset()
    block_size = engine.config.block_size
    prompt = list(range(1000, 1000 + 3 * block_size + 5))  # 3 full blocks and a partial one
    engine.step_log.watch()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    request_id = engine.add_request(None, prompt, params)
    snapshots = EngineSnapshots(engine)

    waiting = snapshots.take(ANONYMOUS_TENANT)
    [seq] = [s for s in waiting["sequences"] if s["request_id"] == request_id]
    assert seq["phase"] == "waiting" and seq["blocks"] == [] and seq["num_tokens"] == len(prompt)

    engine.step()
    running = snapshots.take(ANONYMOUS_TENANT)
    [seq] = [s for s in running["sequences"] if s["request_id"] == request_id]
    assert seq["phase"] == "decode" and seq["num_computed_tokens"] == len(prompt)
    states = running["kv"]["states"]
    assert len(states) == running["kv"]["num_blocks"]
    # Its full prompt blocks were handed to the prefix cache when the prompt was done: shared.
    assert [states[b] for b in seq["blocks"]] == ["s", "s", "s", "u"]
    assert running["kv"]["num_used"] == sum(state in "us" for state in states)
    assert running["history"]["recent_steps"]["prefill_tokens"][-1] == len(prompt)

    while engine.has_unfinished_requests():
        engine.step()
    done = snapshots.take(ANONYMOUS_TENANT)
    assert not done["sequences"] and done["kv"]["num_used"] == 0
    [node] = [n for n in done["tree"] if n["blocks"] == seq["blocks"][:3]]
    assert node["parent"] == -1 and node["num_tokens"] == 3 * block_size and node["hits"] == 0
    assert {done["kv"]["states"][b] for b in node["blocks"]} == {"c"}
    # The label is decoded once, then kept: the next snapshot shows the same text.
    assert node["text"] == engine.tokenizer.decode(prompt[:LABEL_TOKENS])
    assert [n["text"] for n in snapshots.take(ANONYMOUS_TENANT)["tree"]] == [n["text"] for n in done["tree"]]
    assert sum(done["history"]["seconds"]["num_ttft"]) >= 1
    json.dumps(done)  # JSON-ready as it is
    assert_no_leak(llm)


def test_steps_are_not_recorded_while_nobody_watches(llm: LLM) -> None:
    engine = llm.engine
    engine.step_log.watch(lease_s=0)
    before = sum(engine.step_log.to_json()["seconds"]["steps"])
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert sum(engine.step_log.to_json()["seconds"]["steps"]) == before


def test_a_tenant_sees_the_load_but_not_another_tenants_text_or_ids(llm: LLM) -> None:
    engine = llm.engine
    block_size = engine.config.block_size
    prompt = list(range(2000, 2000 + 2 * block_size + 1))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    request_id = engine.add_request(None, prompt, params, tenant="alice")
    snapshots = EngineSnapshots(engine)
    engine.step()
    alice, bob = snapshots.take("alice"), snapshots.take("bob")
    [own] = [s for s in alice["sequences"] if s["request_id"] == request_id]
    [other] = [s for s in bob["sequences"] if s["num_tokens"] == own["num_tokens"] == len(prompt) + 1]
    assert other["request_id"].startswith("other-") and request_id not in json.dumps(bob)
    assert other["blocks"] == own["blocks"]  # the load and the pool are everyone's to see
    assert snapshots.take("bob")["sequences"] == bob["sequences"]  # the alias stays the same
    # The prefix cache's view is the viewer's own: alice's prompt blocks are not in bob's.
    assert any(node["blocks"] == own["blocks"][:2] for node in alice["tree"])
    assert not any(set(node["blocks"]) & set(own["blocks"]) for node in bob["tree"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(llm)
