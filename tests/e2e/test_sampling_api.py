"""Sampling controls through the official `openai` client against the shared server: stop
strings, seeds, n, logprobs, and vLLM's extra parameters (sent in `extra_body`)."""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import openai
import pytest

from tests.e2e.e2e_helpers import MODEL, Server
from yaie import LLM, SamplingParams

pytestmark = pytest.mark.slow

DRAGON = [{"role": "user", "content": "Tell me a story about a dragon."}]  # greedy: a long answer
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]  # greedy: 7 tokens, then EOS
STORY = "Once upon a time"
ENDPOINTS = ["chat", "completions"]


def create(client: openai.OpenAI, endpoint: str, **args: Any) -> Any:
    """A chat completion of DRAGON or a text completion of STORY, unless args say otherwise."""
    if endpoint == "chat":
        return client.chat.completions.create(**{"model": MODEL, "messages": DRAGON, **args})
    return client.completions.create(**{"model": MODEL, "prompt": STORY, **args})


def text_of(choice: Any) -> str:
    """A choice's text, or a streamed chunk's share of it, from either endpoint."""
    if hasattr(choice, "message"):
        return choice.message.content or ""
    if hasattr(choice, "delta"):
        return choice.delta.content or ""
    return choice.text


def token_pieces(choice: Any) -> list[str]:
    """The text of each generated token, from a choice's logprobs."""
    if hasattr(choice, "message"):
        return [token.token for token in choice.logprobs.content]
    return list(choice.logprobs.tokens)


@dataclass
class Streamed:
    deltas: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    finish_reasons: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))

    def text(self, index: int) -> str:
        return "".join(self.deltas[index])


def stream(client: openai.OpenAI, endpoint: str, **args: Any) -> Streamed:
    result = Streamed()
    for chunk in create(client, endpoint, stream=True, **args):
        for choice in chunk.choices:
            result.deltas[choice.index].append(text_of(choice))
            if choice.finish_reason is not None:
                result.finish_reasons[choice.index].append(choice.finish_reason)
    return result


# -- stop strings ---------------------------------------------------------------------------


def boundary_stop(pieces: list[str], text: str) -> str:
    """Four characters of `text` straddling a boundary between two of its tokens, whose first
    occurrence is there: as a stop string, it is only complete once the later token arrives."""
    assert "".join(pieces) == text
    for end in list(accumulate(len(piece) for piece in pieces))[3:-1]:
        candidate = text[end - 2 : end + 2]
        if len(candidate) == 4 and candidate.strip() and text.find(candidate) == end - 2:
            return candidate
    raise AssertionError(f"no stop string spans a token boundary in {text!r}")


@pytest.mark.parametrize("form", ["string", "list"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_stop_string_across_token_boundaries(client: openai.OpenAI, endpoint: str, form: str) -> None:
    logprobs: dict[str, Any] = {"logprobs": True} if endpoint == "chat" else {"logprobs": 0}
    free = create(client, endpoint, temperature=0, max_tokens=24, **logprobs).choices[0]
    assert free.finish_reason == "length"
    text = text_of(free)
    stop_string = boundary_stop(token_pieces(free), text)
    stop: str | list[str] = stop_string if form == "string" else ["never appears", stop_string]

    whole = create(client, endpoint, temperature=0, max_tokens=24, stop=stop).choices[0]
    assert text_of(whole) == text[: text.index(stop_string)]
    assert whole.finish_reason == "stop"
    streamed = stream(client, endpoint, temperature=0, max_tokens=24, stop=stop)
    assert all(stop_string not in delta for delta in streamed.deltas[0])
    assert streamed.text(0) == text_of(whole)
    assert streamed.finish_reasons[0] == ["stop"]


# -- seeds ----------------------------------------------------------------------------------


def test_seed_repeats_sequentially_and_among_concurrent_requests(client: openai.OpenAI) -> None:
    def sample(endpoint: str, **args: Any) -> str:
        return text_of(create(client, endpoint, **{"temperature": 1.0, "max_tokens": 16, **args}).choices[0])

    expected = {endpoint: sample(endpoint, seed=42) for endpoint in ENDPOINTS}
    assert sample("chat", seed=42) == expected["chat"]

    # Seeded requests batched with each other and with unseeded ones, in whatever order.
    jobs = [("chat", {"seed": 42}), ("completions", {"seed": 42})] * 3
    jobs += [(endpoint, {"max_tokens": 8 + i}) for i, endpoint in enumerate(ENDPOINTS * 2)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [(endpoint, args, pool.submit(sample, endpoint, **args)) for endpoint, args in jobs]
        for endpoint, args, future in futures:
            text = future.result()
            if "seed" in args:
                assert text == expected[endpoint], endpoint

    assert len({expected["chat"], sample("chat", seed=43), sample("chat", seed=44)}) == 3


# -- n --------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n_choices_are_distinct_and_counted(client: openai.OpenAI, endpoint: str) -> None:
    logprobs: dict[str, Any] = {"logprobs": True} if endpoint == "chat" else {"logprobs": 0}
    response = create(client, endpoint, n=4, temperature=1.0, seed=9, max_tokens=12, **logprobs)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert len({text_of(choice) for choice in response.choices}) == 4
    assert response.usage.completion_tokens == sum(len(token_pieces(c)) for c in response.choices)

    args = {"n": 2, "temperature": 1.0, "seed": 9, "max_tokens": 12}
    whole = create(client, endpoint, **args)
    streamed = stream(client, endpoint, **args)
    assert set(streamed.deltas) == {0, 1}
    for choice in whole.choices:
        assert streamed.text(choice.index) == text_of(choice)
        assert streamed.finish_reasons[choice.index] == [choice.finish_reason]


# -- logprobs -------------------------------------------------------------------------------


def test_chat_logprobs_shape_sorting_and_stream(server: Server, client: openai.OpenAI) -> None:
    args = {"temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 3}
    with server.http() as http:
        body = http.post("/v1/chat/completions", json={"model": MODEL, "messages": DRAGON, **args}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 12
    for token in content:
        assert token.keys() == {"token", "logprob", "bytes", "top_logprobs"}
        assert token["bytes"] == list(token["token"].encode())
        top = token["top_logprobs"]
        assert [alternative.keys() for alternative in top] == [{"token", "logprob", "bytes"}] * 3
        assert all(alternative["bytes"] == list(alternative["token"].encode()) for alternative in top)
        values = [alternative["logprob"] for alternative in top]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert (top[0]["token"], top[0]["logprob"]) == (token["token"], pytest.approx(token["logprob"]))

    streamed = []
    for chunk in create(client, "chat", stream=True, **args):
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs else []
    assert [(t.token, t.logprob) for t in streamed] == [(t["token"], t["logprob"]) for t in content]
    assert [[a.token for a in t.top_logprobs] for t in streamed] == [
        [a["token"] for a in t["top_logprobs"]] for t in content
    ]


def assert_consistent_columns(logprobs: Any, text: str) -> None:
    columns = (logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset)
    assert len({len(column) for column in columns}) == 1
    assert "".join(logprobs.tokens) == text
    assert logprobs.text_offset == [0, *accumulate(len(t) for t in logprobs.tokens[:-1])]


def test_completion_logprobs_columns(client: openai.OpenAI) -> None:
    response = create(client, "completions", temperature=0, max_tokens=12, logprobs=3)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert_consistent_columns(logprobs, choice.text)
    assert len(logprobs.tokens) == response.usage.completion_tokens == 12
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # Alternatives are keyed by their text, so two that decode alike would share a key.
        assert 1 <= len(top) <= 3
        assert top[token] == pytest.approx(logprob) == pytest.approx(max(top.values()))  # greedy


@pytest.mark.parametrize("streaming", [False, True])
def test_completion_echo_with_logprobs(client: openai.OpenAI, streaming: bool) -> None:
    plain = create(client, "completions", temperature=0, max_tokens=8).choices[0].text
    args = {"temperature": 0, "max_tokens": 8, "echo": True, "logprobs": 1}
    whole = create(client, "completions", **args)
    choice = whole.choices[0]
    assert choice.text == STORY + plain
    logprobs = choice.logprobs
    assert_consistent_columns(logprobs, choice.text)
    assert len(logprobs.tokens) == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value is not None and value <= 0 for value in logprobs.token_logprobs[1:])
    if not streaming:
        return
    text, tokens, values, offsets = "", [], [], []
    for chunk in create(client, "completions", stream=True, **args):
        for part in chunk.choices:
            text += part.text
            if part.logprobs is not None:
                tokens += part.logprobs.tokens
                values += part.logprobs.token_logprobs
                offsets += part.logprobs.text_offset
    assert text == choice.text
    assert (tokens, offsets) == (logprobs.tokens, logprobs.text_offset)
    assert values[0] is None and values[1:] == pytest.approx(logprobs.token_logprobs[1:])


# -- vLLM's extra parameters ----------------------------------------------------------------


def test_vllm_extras_in_extra_body_and_logit_bias(client: openai.OpenAI, llm: LLM) -> None:
    def ask(extra: dict[str, Any] | None = None, **args: Any) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens) of FRANCE from the server, after checking
        that the engine, given the same parameters as SamplingParams, returns the same."""
        args = {"temperature": 0, "max_tokens": 24, **args}
        response = client.chat.completions.create(model=MODEL, messages=FRANCE, extra_body=extra, **args)  # type: ignore[arg-type]
        choice = response.choices[0]
        assert response.usage is not None
        result = (choice.message.content or "", choice.finish_reason, response.usage.completion_tokens)
        fields = {**args, **(extra or {})}
        if "logit_bias" in fields:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        [local] = llm.chat(FRANCE, SamplingParams(**fields))
        assert result == (
            local.outputs[0].text,
            local.outputs[0].finish_reason,
            len(local.outputs[0].token_ids),
        )
        return result

    greedy = ask()
    assert greedy[:2] == ("The capital of France is Paris.", "stop")
    # Truncations that leave only the most likely token: sampling becomes greedy.
    assert ask({"top_k": 1}, temperature=1.5, seed=3) == greedy
    assert ask({"min_p": 1.0}, temperature=1.5, seed=3) == greedy
    assert ask({"repetition_penalty": 1.5})[0] != greedy[0]

    text, _, tokens = ask({"min_tokens": 12})
    assert tokens >= 12 and text.startswith(greedy[0]) and len(text) > len(greedy[0])
    assert ask({"ignore_eos": True}, max_tokens=16)[1:] == ("length", 16)

    [paris] = llm.tokenizer(" Paris").input_ids
    assert ask({"stop_token_ids": [paris]})[:2] == ("The capital of France is", "stop")

    [the] = llm.tokenizer("The").input_ids
    banned = ask(logit_bias={str(the): -100})
    assert not banned[0].startswith("The")
