"""Pooling requests (embeddings) through the engine, on a tiny random model: the vector is what
transformers' final hidden states give (last token or mean, normalised or not), whatever the
chunking, the prefix cache or a preemption; pooling requests share steps with generation
requests without changing their tokens; and no KV block outlives a pooling request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.engine.engine_helpers import assert_no_leak
from tests.model.tiny_models import make_tiny_model
from yaie import LLM, PoolingParams, SamplingParams
from yaie.errors import InvalidRequestError
from yaie.outputs import RequestOutput

ATOL = 1e-5
# Long enough to span several 16-token blocks and, with a small token budget, several chunks.
PROMPTS = [
    list(range(3, 50)),
    [7, 8, 9, 10, 11],
    [40 + (i * 7) % 150 for i in range(70)],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    path = tmp_path_factory.mktemp("tiny")
    return str(path), make_tiny_model("llama", Path(path), seed=3)


def expected(hf: torch.nn.Module, prompt: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """The vector from transformers' final hidden states (after the last norm)."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return F.normalize(vector, dim=0) if normalize else vector


def assert_close(actual: torch.Tensor, wanted: torch.Tensor) -> None:
    torch.testing.assert_close(actual, wanted, atol=ATOL, rtol=0)


def vector(output: RequestOutput) -> torch.Tensor:
    assert output.finished and output.outputs == [] and output.pooled is not None
    return torch.tensor(output.pooled.data)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_vectors_match_transformers(tiny, pooling, normalize):
    path, hf = tiny
    llm = LLM(path, quantization="none", num_kv_blocks=64)
    outputs = llm.embed(PROMPTS, PoolingParams(pooling_type=pooling, normalize=normalize))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.prompt_token_ids == prompt
        assert_close(vector(output), expected(hf, prompt, pooling, normalize))
        if normalize:
            assert vector(output).norm().item() == pytest.approx(1.0, abs=1e-6)
    assert_no_leak(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_engine_pooling_is_the_default(tiny, pooling):
    path, hf = tiny
    llm = LLM(path, quantization="none", num_kv_blocks=64, pooling=pooling)
    (output,) = llm.embed(PROMPTS[0])
    assert_close(vector(output), expected(hf, PROMPTS[0], pooling))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_prefill_gives_the_same_vector(tiny, pooling):
    path, hf = tiny
    # 7 tokens a step: every prompt but the shortest is computed over several steps.
    llm = LLM(
        path, quantization="none", num_kv_blocks=64, max_num_batched_tokens=7, enable_prefix_caching=False
    )
    steps = 0
    for prompt in PROMPTS:
        llm.engine.add_request(None, prompt, PoolingParams(pooling_type=pooling))
    done = {}
    while llm.engine.has_unfinished_requests():
        steps += 1
        for output in llm.engine.step():
            done[tuple(output.prompt_token_ids)] = output
    assert steps >= sum(len(p) for p in PROMPTS) // 7
    for prompt in PROMPTS:
        assert_close(vector(done[tuple(prompt)]), expected(hf, prompt, pooling))
    assert llm.engine.block_pool.num_used == 0


def test_mixed_with_generation_in_one_step(tiny):
    """An embedding and two generation requests prefill in the same step; the generation
    requests get exactly the tokens they get alone, and the embedding its vector."""
    path, hf = tiny
    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = LLM(path, quantization="none", num_kv_blocks=64).generate(PROMPTS[:2], greedy)
    llm = LLM(path, quantization="none", num_kv_blocks=64)
    engine = llm.engine
    gen_ids = [engine.add_request(None, prompt, greedy) for prompt in PROMPTS[:2]]
    embed_id = engine.add_request(None, PROMPTS[2], PoolingParams(pooling_type="mean"))
    first = engine.step()
    by_id = {output.request_id: output for output in first}
    assert set(by_id) == {*gen_ids, embed_id}, "all three computed their prompts in the first step"
    assert_close(vector(by_id[embed_id]), expected(hf, PROMPTS[2], "mean"))
    assert all(seq.pooling_params is None for seq in engine.scheduler.running), "the embedding is done"
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    for request_id, reference in zip(gen_ids, alone, strict=True):
        assert finals[request_id].outputs[0].token_ids == reference.outputs[0].token_ids
    assert_no_leak(llm)


def test_prefix_cache_serves_last_pooling_not_mean(tiny):
    """Last pooling may take a prompt's cached blocks (only the last token's state is needed);
    mean pooling needs every position, so it computes the whole prompt."""
    path, hf = tiny
    llm = LLM(path, quantization="none", num_kv_blocks=64)
    prompt = PROMPTS[2]
    first, second = (llm.embed(prompt, PoolingParams(pooling_type="last"))[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert_close(vector(second), expected(hf, prompt, "last"))
    (mean,) = llm.embed(prompt, PoolingParams(pooling_type="mean"))
    assert mean.num_cached_tokens == 0
    assert_close(vector(mean), expected(hf, prompt, "mean"))
    assert_no_leak(llm)


def test_preempted_mean_pooling_starts_its_sum_again(tiny):
    """An 8-block pool: a generation request holding half of it grows while a 90-token mean-pooling
    prompt is computed in chunks beside it, so the prompt is preempted mid-way (the newest goes
    first) and recomputed from its start; its vector is still exact."""
    path, hf = tiny
    llm = LLM(
        path, quantization="none", num_kv_blocks=8, max_num_batched_tokens=20, enable_prefix_caching=False
    )
    engine = llm.engine
    long_generation = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    gen_id = engine.add_request(None, PROMPTS[1], long_generation)
    generating = engine.requests[gen_id].choices[0].seq
    while generating.num_tokens < 60:  # 4 of the 8 blocks
        engine.step()
    prompt = list(range(3, 93))
    (output,) = llm.embed(prompt, PoolingParams(pooling_type="mean"))
    assert engine.scheduler.num_preemptions > 0
    assert_close(vector(output), expected(hf, prompt, "mean"))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_pool.num_used == 0


def test_refused_inputs(tiny):
    path, _ = tiny
    llm = LLM(path, quantization="none", num_kv_blocks=64, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed([[]])
    with pytest.raises(InvalidRequestError, match="context"):
        llm.embed([list(range(3, 68))])
    (output,) = llm.embed([list(range(3, 67))])  # exactly the context: nothing is generated
    assert len(output.pooled.data) == 64
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        PoolingParams(pooling_type="cls")
    with pytest.raises(ValueError, match="pooling"):
        LLM(path, pooling="max")
