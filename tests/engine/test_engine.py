"""The engine on the bundled SmolLM2-135M-Instruct: exactness, batching, memory pressure, bad input."""

from __future__ import annotations

import pytest

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, InvalidRequestError, ModelLoadError, SamplingParams, UnsupportedModelError
from yaie.cache.radix_cache import RadixCache

GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.mark.slow
def test_greedy_matches_transformers_reference(llm, reference):
    results = reference["results"]
    outputs = llm.generate([r["prompt_ids"] for r in results], GREEDY)
    for expected, output in zip(results, outputs, strict=True):
        assert output.prompt_token_ids == expected["prompt_ids"]
        assert output.outputs[0].token_ids == expected["generated_ids"], expected["prompt"]
        stopped = expected["generated_ids"][-1] == reference["eos_token_id"]
        assert output.outputs[0].finish_reason == ("stop" if stopped else "length")
    assert_no_leak(llm)


@pytest.mark.slow
def test_chat_template_and_text_prompts_match_reference_ids(llm, reference):
    for expected in reference["results"]:
        if expected["kind"] == "chat":
            ids = llm.encode_chat([{"role": "user", "content": expected["prompt"]}])
        else:
            ids = llm.tokenizer(expected["prompt"]).input_ids
        assert ids == expected["prompt_ids"]
    [chat] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert chat.outputs[0].text == "The capital of France is Paris."


PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "def add(a, b):",
    "List three colours:",
    "The capital of Italy is",
    "In 1969, astronauts",
    "Water boils at",
    "A haiku about autumn:\n",
    "Translate to French: good morning",
    "The meaning of life is",
    "SELECT * FROM",
    "My favourite recipe is",
    "Q: What is 2 + 2?\nA:",
    "The sun is a",
    "import numpy as np\n",
    "Roses are red,",
]


@pytest.mark.slow
def test_batched_requests_equal_each_request_alone(llm):
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(16)]
    together = llm.generate(PROMPTS, params)
    for prompt, p, output in zip(PROMPTS, params, together, strict=True):
        [alone] = llm.generate([prompt], p)
        assert output.outputs[0].token_ids == alone.outputs[0].token_ids, prompt
        assert len(output.outputs[0].token_ids) == p.max_tokens
    assert_no_leak(llm)


@pytest.mark.slow
def test_requests_join_a_running_batch_without_waiting(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("first", PROMPTS[0], params)
    for _ in range(5):
        engine.step()
    engine.add_request("second", PROMPTS[1], params)
    outputs = {o.request_id: o for o in engine.step()}
    # One step later the newcomer has its first token and the first request kept decoding.
    assert len(outputs["second"].outputs[0].token_ids) == 1
    assert len(outputs["first"].outputs[0].token_ids) == 6
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    [first_alone, second_alone] = llm.generate(PROMPTS[:2], params)
    assert done["first"].outputs[0].token_ids == first_alone.outputs[0].token_ids
    assert done["second"].outputs[0].token_ids == second_alone.outputs[0].token_ids


@pytest.mark.slow
def test_streaming_deltas_concatenate_to_the_final_text(llm):
    engine = llm.engine
    engine.add_request(
        "s",
        "Write a list of emoji and accented words: café, naïve, 🚀,",
        SamplingParams(max_tokens=40, seed=3),
    )
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.append(output.outputs[0].delta_text)
            final = output
    assert "".join(deltas) == final.outputs[0].text
    assert "\ufffd" not in "".join(deltas[:-1])


@pytest.mark.slow
def test_stop_strings_are_cut_and_never_streamed(llm):
    [free] = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=24))
    text = free.outputs[0].text
    stop = text[5:9]  # a stop string that spans tokens somewhere in the greedy continuation
    engine = llm.engine
    engine.add_request(
        "stop", "Count: one, two, three,", SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    )
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed += output.outputs[0].delta_text
            final = output
    assert final.outputs[0].text == text[: text.index(stop)] == streamed
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop


@pytest.mark.slow
def test_oversubscribed_pool_finishes_everything_identically():
    # 16 requests need ~4x these blocks at their peak.
    small = LLM(num_kv_blocks=24, max_num_seqs=16, quantization="none")
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in PROMPTS]
    outputs = small.generate(PROMPTS, params)
    assert small.engine.stats().num_preemptions > 0
    assert_no_leak(small)
    roomy = LLM(num_kv_blocks=24 * 8, max_num_seqs=16, quantization="none")
    expected = roomy.generate(PROMPTS, params)
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert roomy.engine.stats().num_preemptions == 0
    cache = small.engine.scheduler.prefix_cache
    assert isinstance(cache, RadixCache)
    cache.reset()
    assert small.engine.block_pool.num_free == 24


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([10**9], SamplingParams(), "token ids"),
        ("word " * 9000, SamplingParams(), "context"),
        ("hi", SamplingParams(max_tokens=9000), "max_tokens"),
        ("hi", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        ("hi", SamplingParams(stop_token_ids=[49152]), "stop_token_ids"),
    ],
)
def test_bad_requests_raise_and_leave_the_engine_usable(llm, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([prompt], params)
    assert llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "field", [{"max_tokens": 0}, {"max_tokens": -1}, {"temperature": -0.5}, {"top_p": 0}]
)
def test_bad_sampling_params_raise(field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**field)
    assert info.value.param == next(iter(field))


def test_unknown_model_path_and_unsupported_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nope.gguf"))
    (tmp_path / "config.json").write_text('{"architectures": ["BertForMaskedLM"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM"):
        LLM(model=str(tmp_path))


@pytest.mark.slow
def test_n_choices_share_one_prompt_prefill(llm):
    prompt = "Here is a long story about a dragon, a knight and a baker who met one rainy day. " * 4
    before = llm.engine.stats().num_computed_prompt_tokens
    [out] = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=16))
    computed = llm.engine.stats().num_computed_prompt_tokens - before
    num_prompt = len(out.prompt_token_ids)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 4
    # The prompt is computed once; each sibling recomputes at most its partial last block.
    block = llm.engine.config.block_size
    assert num_prompt <= computed <= num_prompt + 3 * block < 2 * num_prompt
    assert_no_leak(llm)


@pytest.mark.slow
def test_any_integer_seed_is_accepted_and_reproducible(llm):
    params = SamplingParams(n=2, seed=2**64 - 1, temperature=1.0, max_tokens=6)
    first, again = llm.generate(["Seeds"], params), llm.generate(["Seeds"], params)
    assert [o.token_ids for o in first[0].outputs] == [o.token_ids for o in again[0].outputs]


@pytest.mark.slow
def test_stop_token_text_is_kept_only_when_asked(llm):
    prompt = "Once upon a time"
    [free] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    ids = free.outputs[0].token_ids
    stop_at = ids.index(ids[3])
    params = {"temperature": 0, "max_tokens": 12, "stop_token_ids": [ids[stop_at]]}
    [cut] = llm.generate([prompt], SamplingParams(**params))
    [kept] = llm.generate([prompt], SamplingParams(**params, include_stop_str_in_output=True))
    assert cut.outputs[0].token_ids == kept.outputs[0].token_ids == ids[: stop_at + 1]
    assert cut.outputs[0].text == llm.tokenizer.decode(ids[:stop_at])
    assert kept.outputs[0].text == llm.tokenizer.decode(ids[: stop_at + 1])
