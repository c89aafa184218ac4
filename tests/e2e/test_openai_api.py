"""The API through the official `openai` client (and raw HTTP where the exact JSON matters)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.e2e.e2e_helpers import MODEL, Server
from yaie import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL]
    assert models[0].object == "model"


def test_health_and_version(server: Server) -> None:
    with server.http() as http:
        assert http.get("/health").status_code == 200
        version = http.get("/version").json()
        assert version["version"] and version["weight_bytes"] > 0
        assert {"quantization", "kernel_isa"} <= version.keys()
        assert version["kv_cache_dtype"] == "float32"  # auto: the fp32 model's own dtype


def test_chat_response_shape(server: Server) -> None:
    with server.http() as http:
        body = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 8}
        ).json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice.keys() == {"index", "message", "logprobs", "finish_reason", "stop_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 8
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)


def test_requests_without_model_get_the_served_model(server: Server) -> None:
    """As vLLM and llama.cpp: a server has one model, which a request need not name."""
    chat = {"messages": QUESTION, "max_tokens": 8, "temperature": 0}
    text = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    with server.http() as http:
        for path, body, content in (
            ("/v1/chat/completions", chat, lambda choice: choice["message"]["content"]),
            ("/v1/completions", text, lambda choice: choice["text"]),
        ):
            unnamed = http.post(path, json=body)
            named = http.post(path, json={"model": MODEL, **body})
            assert unnamed.status_code == named.status_code == 200, unnamed.text
            assert unnamed.json()["model"] == MODEL
            assert content(unnamed.json()["choices"][0]) == content(named.json()["choices"][0])
        assert http.post("/tokenize", json={"prompt": "Hi"}).status_code == 200


def test_greedy_chat_matches_llm(client: openai.OpenAI, llm: LLM) -> None:
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)  # type: ignore[arg-type]
    [expected] = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 20}
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *content_chunks, usage_chunk = chunks
    assert (
        "".join(c.choices[0].delta.content or "" for c in content_chunks) == whole.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, stream=True))  # type: ignore[arg-type]
    assert all(chunk.choices and chunk.usage is None for chunk in chunks)


def test_completion_stream_equals_non_stream(client: openai.OpenAI, llm: LLM) -> None:
    args = {"model": MODEL, "prompt": "The sky is blue because", "temperature": 0, "max_tokens": 16}
    whole = client.completions.create(**args)  # type: ignore[call-overload]
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    [expected] = llm.generate("The sky is blue because", SamplingParams(temperature=0, max_tokens=16))
    assert whole.choices[0].text == expected.outputs[0].text
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage


@pytest.mark.parametrize(("stream", "as_token_ids"), [(False, False), (True, True)])
def test_completion_prompt_batch_and_n(
    server: Server, client: openai.OpenAI, stream: bool, as_token_ids: bool
) -> None:
    """A batch of prompts, as text or token ids; choice i*n+j is prompt i's j-th completion."""
    prompts = ["Hello, my name is", "One, two, three,"]
    single = [
        client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6).choices[0].text
        for prompt in prompts
    ]
    batch: list[str] | list[list[int]] = prompts
    if as_token_ids:
        with server.http() as http:
            batch = [
                http.post("/tokenize", json={"model": MODEL, "prompt": p}).json()["tokens"] for p in prompts
            ]
    args = {"model": MODEL, "prompt": batch, "temperature": 0, "max_tokens": 6, "n": 2}
    expected = [single[0], single[0], single[1], single[1]]
    if stream:
        texts = dict.fromkeys(range(4), "")
        for chunk in client.completions.create(**args, stream=True):  # type: ignore[call-overload]
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert list(texts.values()) == expected
    else:
        response = client.completions.create(**args)  # type: ignore[call-overload]
        assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
        assert [choice.text for choice in response.choices] == expected
        assert response.usage is not None and response.usage.completion_tokens == 4 * 6


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert response.usage is not None and len(content) == response.usage.completion_tokens
    for token in content:
        assert token.bytes == list(token.token.encode())
        assert len(token.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
    if choice.finish_reason == "length":
        assert "".join(token.token for token in content) == choice.message.content


def test_completion_logprobs_with_echo(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    response = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=5, logprobs=2, echo=True
    )
    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    assert logprobs is not None and response.usage is not None
    assert len(logprobs.tokens or []) == response.usage.prompt_tokens + response.usage.completion_tokens
    assert logprobs.token_logprobs is not None and logprobs.token_logprobs[0] is None  # nothing predicts it
    assert all(value is not None for value in logprobs.token_logprobs[1:])
    for token, offset in zip(logprobs.tokens or [], logprobs.text_offset or [], strict=True):
        assert choice.text[offset:].startswith(token)


def test_stop_string_is_cut_in_both_modes(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 30, "stop": [" is"]}
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**args, stream=True)  # type: ignore[call-overload]
    )
    assert whole.choices[0].finish_reason == "stop"
    assert " is" not in (whole.choices[0].message.content or "")
    assert streamed == whole.choices[0].message.content


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        response = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=1.0,
            max_tokens=12,
            seed=1234,
            n=2,  # type: ignore[arg-type]
        )
        return [choice.message.content or "" for choice in response.choices]

    assert sample() == sample()


def test_repeated_prompt_hits_prefix_cache(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about prefix caching. " * 8}]
    for _ in range(2):
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    assert response.usage.prompt_tokens_details.cached_tokens > 0


def test_tokenize_and_detokenize(server: Server, client: openai.OpenAI) -> None:
    with server.http() as http:
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
        text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
        assert text == {"prompt": "Hello world"}
        chat = http.post("/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)  # type: ignore[arg-type]
    assert response.usage is not None and chat["count"] == response.usage.prompt_tokens


def test_concurrent_streams_each_match_their_sequential_result(server: Server, client: openai.OpenAI) -> None:
    conversations = [[{"role": "user", "content": f"Say something about the number {i}."}] for i in range(16)]
    sequential = [
        client.chat.completions.create(model=MODEL, messages=c, temperature=0, max_tokens=16)
        .choices[0]
        .message.content  # type: ignore[arg-type]
        for c in conversations
    ]

    async def stream_one(aclient: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=16,
            stream=True,  # type: ignore[arg-type]
        )
        return "".join([chunk.choices[0].delta.content or "" async for chunk in stream])

    async def stream_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none") as aclient:
            return await asyncio.gather(*(stream_one(aclient, c) for c in conversations))

    assert asyncio.run(stream_all()) == sequential
