"""Structured outputs through the official `openai` client against a real server: JSON schemas
(greedy and sampled, batched beside unconstrained requests), pydantic parsing, vLLM's extras,
and the 400s. One server for the module; the requests of a test run concurrently, so that the
engine batches them."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.e2e_helpers import MODEL, Server

pytestmark = pytest.mark.slow

MAX_TOKENS = 160  # every test schema bounds its output well below this
PLAIN = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


def ask_for(entry: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give me an example {entry['name'].replace('_', ' ')} as JSON."}]


def create(client: openai.OpenAI, **args: Any) -> Any:
    return client.chat.completions.create(model=MODEL, **args)


def in_parallel(calls: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_json_schemas_validate_beside_unconstrained_requests(
    sclient: openai.OpenAI, schemas: list[dict[str, Any]]
) -> None:
    def plain(messages: list[dict[str, str]]) -> Any:
        return lambda: create(sclient, messages=messages, temperature=0, max_tokens=24)

    solo = [plain(messages)() for messages in PLAIN]

    def constrained(entry: dict[str, Any], sampled: bool) -> Any:
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": entry["name"], "schema": entry["schema"]},
        }
        sampling = {"temperature": 0.8, "seed": 7} if sampled else {"temperature": 0}
        return lambda: create(
            sclient,
            messages=ask_for(entry),
            response_format=response_format,
            max_tokens=MAX_TOKENS,
            **sampling,
        )

    calls = [constrained(entry, sampled) for entry in schemas for sampled in (False, True)]
    results = in_parallel([*calls, *(plain(messages) for messages in PLAIN)])
    constrained_results, beside = results[: len(calls)], results[len(calls) :]

    failures = []
    for (entry, sampled), response in zip(
        [(entry, sampled) for entry in schemas for sampled in (False, True)], constrained_results, strict=True
    ):
        choice = response.choices[0]
        try:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), entry["schema"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((entry["name"], sampled, choice.finish_reason, choice.message.content, repr(exc)))
    assert not failures
    for alone, batched in zip(solo, beside, strict=True):
        assert batched.choices[0].message.content == alone.choices[0].message.content


def test_max_tokens_first_gives_length_with_the_partial_output(sclient: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    response = create(
        sclient,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": schema}},
        temperature=0,
        max_tokens=6,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith('{"story": ')
    assert response.usage.completion_tokens == 6


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user"]


def test_parse_with_pydantic(sclient: openai.OpenAI) -> None:
    completion = sclient.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a user of a website as JSON."}],
        response_format=Person,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert Person.model_validate_json(completion.choices[0].message.content or "") == parsed


def test_vllm_extras_and_json_object(sclient: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    completion_args = {
        "model": MODEL,
        "prompt": "The year the first moon landing happened was",
        "temperature": 0,
    }
    results = in_parallel(
        [
            lambda: create(
                sclient,
                messages=question,
                max_tokens=8,
                extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            ),
            lambda: create(
                sclient,
                messages=[{"role": "user", "content": "Give me a US phone number."}],
                max_tokens=30,
                extra_body={"structured_outputs": {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}},
            ),
            lambda: sclient.completions.create(
                **completion_args,
                max_tokens=8,
                extra_body={"structured_outputs": {"grammar": 'start: year\nyear: "19" /[0-9]/ /[0-9]/'}},
            ),
            lambda: sclient.completions.create(
                **completion_args,
                max_tokens=30,
                extra_body={"structured_outputs": {"json": YEAR}},
            ),
            lambda: create(
                sclient,
                messages=[{"role": "user", "content": "Describe a cat in JSON."}],
                max_tokens=MAX_TOKENS,
                response_format={"type": "json_object"},
                temperature=0,
            ),
        ]
    )
    choice, phone, year, year_json, obj = results
    assert choice.choices[0].message.content in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    assert phone.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", phone.choices[0].message.content)
    assert re.fullmatch(r"19[0-9]{2}", year.choices[0].text)
    assert 1900 <= json.loads(year_json.choices[0].text)["year"] <= 2100
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a free-form object may run to max_tokens: still an object's beginning
        assert obj.choices[0].message.content.startswith("{")


def test_stream_equals_non_stream(sclient: openai.OpenAI) -> None:
    args = {
        "messages": [{"role": "user", "content": "Pick a color."}],
        "temperature": 0,
        "max_tokens": 20,
        "extra_body": {"structured_outputs": {"choice": ["red", "green", "blue"]}},
    }
    whole = create(sclient, **args).choices[0]
    chunks = list(create(sclient, stream=True, **args))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content and whole.message.content in ("red", "green", "blue")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


YEAR = {
    "type": "object",
    "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
    "required": ["year"],
    "additionalProperties": False,
}
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"response_format": BAD_SCHEMA}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
        ("/v1/completions", {"response_format": BAD_SCHEMA}, "response_format"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"grammar": "start: (("}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"json": "{oops"}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_invalid_constraints_are_400s(
    server: Server, path: str, body: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
    base |= {"messages": PLAIN[0]} if "chat" in path else {"prompt": "Hello"}
    with server.http() as http:
        response = http.post(path, json=base | body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(f"{param}: ")
