"""Stop strings against structured outputs, through the official `openai` client and the shared
server: no stop string or stop token cuts a constrained output, so every choice that finishes
"stop" is valid for its schema, streamed or not, chat or text completion, constrained through
`response_format` or vLLM's `structured_outputs`, n = 2; max_tokens still cuts it ("length").
And every choice, in every shape of response, carries vLLM's `stop_reason`: the stop string or
stop token id that ended it, or null (on a stream, with its finish_reason)."""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.e2e_helpers import MODEL

pytestmark = pytest.mark.slow

# Each can occur inside JSON: before stop strings stopped cutting constrained outputs, most
# choices asked for with them came back "stop" and invalid.
STOPS = ["}", ",", '"', ":", "{", "e", " "]
SCHEMAS = ("flag", "person", "tags_bounded")  # of tests/structured/data/schemas.json
N = 2
MAX_TOKENS = 48  # every test schema's output fits well within this, most of the time
ENDPOINTS, SOURCES = ("chat", "completions"), ("response_format", "structured_outputs")
CELLS = list(itertools.product(ENDPOINTS, (False, True), SOURCES))  # (endpoint, stream, source)


@dataclass
class Got:
    """One choice as the client saw it."""

    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    # On a stream, the stop_reason of the choice's chunks before its last (all null).
    earlier_stop_reasons: list[Any]


def create(client: openai.OpenAI, endpoint: str, stream: bool, prompt: str, **args: Any) -> dict[int, Got]:
    """One request; its choices by index, however the endpoint and `stream` shape them."""
    if endpoint == "chat":
        messages = [{"role": "user", "content": prompt}]
        response = client.chat.completions.create(model=MODEL, messages=messages, stream=stream, **args)  # type: ignore[call-overload]
    else:
        response = client.completions.create(model=MODEL, prompt=prompt, stream=stream, **args)  # type: ignore[call-overload]
    if not stream:
        return {
            choice.index: Got(
                choice.message.content if endpoint == "chat" else choice.text,
                choice.finish_reason,
                choice.stop_reason,
                [],
            )
            for choice in response.choices
        }
    got: dict[int, Got] = {}
    for chunk in response:
        for choice in chunk.choices:
            entry = got.setdefault(choice.index, Got("", None, None, []))
            entry.text += (choice.delta.content if endpoint == "chat" else choice.text) or ""
            if choice.finish_reason is None:
                entry.earlier_stop_reasons.append(getattr(choice, "stop_reason", None))
            else:
                entry.finish_reason, entry.stop_reason = choice.finish_reason, choice.stop_reason
    return got


def constrained(source: str, schema: dict[str, Any]) -> dict[str, Any]:
    if source == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    return {"structured_outputs": {"json": schema}}


def in_parallel(calls: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_no_stop_cuts_a_constrained_output(
    sclient: openai.OpenAI, schemas: list[dict[str, Any]], tokenizer: Any
) -> None:
    by_name = {entry["name"]: entry["schema"] for entry in schemas}
    stop_token_ids = [tokenizer.convert_tokens_to_ids(token) for token in (",", "}", '"')]

    def ask(cell: tuple[str, bool, str], name: str, seed: int) -> Any:
        endpoint, stream, source = cell
        extra_body = {**constrained(source, by_name[name]), "stop_token_ids": stop_token_ids}
        prompt = f"An example {name.replace('_', ' ')} as JSON:"
        args = {"n": N, "stop": STOPS, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed}
        return lambda: (name, create(sclient, endpoint, stream, prompt, extra_body=extra_body, **args))

    calls = [ask(cell, name, seed) for seed, (cell, name) in enumerate(itertools.product(CELLS, SCHEMAS))]
    choices = [(name, got) for name, answer in in_parallel(calls) for got in answer.values()]
    assert len(choices) == len(CELLS) * len(SCHEMAS) * N
    stopped = [(name, got) for name, got in choices if got.finish_reason == "stop"]
    for name, got in stopped:
        jsonschema.validate(json.loads(got.text), by_name[name])
        assert got.stop_reason is None  # the grammar ended it, not a stop string or token
    assert all(got.finish_reason == "length" for _, got in choices if got.finish_reason != "stop")
    assert all(reason is None for _, got in choices for reason in got.earlier_stop_reasons)
    assert len(stopped) >= len(choices) // 2  # enough complete outputs for the check to mean something


@pytest.mark.parametrize(("endpoint", "stream"), list(itertools.product(ENDPOINTS, (False, True))))
def test_max_tokens_still_cuts_a_constrained_output(
    sclient: openai.OpenAI, schemas: list[dict[str, Any]], endpoint: str, stream: bool
) -> None:
    schema = schemas[0]["schema"]
    got = create(
        sclient, endpoint, stream, "A person as JSON:", n=N, stop=STOPS, max_tokens=3,
        extra_body=constrained("structured_outputs", schema),
    )  # fmt: skip
    assert [(g.finish_reason, g.stop_reason) for g in got.values()] == [("length", None)] * N


COUNT = "Count: one, two, three,"  # the bundled model's greedy answers to both have a comma


@pytest.mark.parametrize(("endpoint", "stream"), list(itertools.product(ENDPOINTS, (False, True))))
def test_stop_reason_names_the_stop_string_or_token(
    sclient: openai.OpenAI, tokenizer: Any, endpoint: str, stream: bool
) -> None:
    """Free text, where stop strings and tokens apply: stop_reason names the one that ended each
    choice, in every shape of response."""
    prompt = COUNT if endpoint == "completions" else "Write a sentence about cats."
    args: dict[str, Any] = {"n": N, "temperature": 0, "max_tokens": 32}
    by_string = create(sclient, endpoint, stream, prompt, stop=[","], **args)
    comma = tokenizer.convert_tokens_to_ids(",")
    by_token = create(sclient, endpoint, stream, prompt, extra_body={"stop_token_ids": [comma]}, **args)
    for got, reason in [*((g, ",") for g in by_string.values()), *((g, comma) for g in by_token.values())]:
        assert (got.finish_reason, got.stop_reason) == ("stop", reason)
        assert "," not in got.text and got.earlier_stop_reasons == [None] * len(got.earlier_stop_reasons)
    assert len(by_string) == len(by_token) == N
