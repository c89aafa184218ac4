"""OpenAI tool calling through the official `openai` client against a real server, with the
bundled SmolLM2, whose ChatML template knows nothing of tools (so yaie renders them in the
Hermes style, yaie/structured/tools.py)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.e2e_helpers import MODEL, Server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}  # type: ignore[index]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 80


def create(client: openai.OpenAI, **args: Any) -> Any:
    return client.chat.completions.create(model=MODEL, tools=TOOLS, **{"max_tokens": MAX_TOKENS, **args})


def assert_valid_calls(message: Any, names: set[str]) -> None:
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_are_valid_and_stream_the_same(
    sclient: openai.OpenAI, tool_choice: Any
) -> None:
    names = {"add"} if isinstance(tool_choice, dict) else set(SCHEMAS)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        response = create(sclient, messages=QUESTION, tool_choice=tool_choice, **sampling)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert_valid_calls(choice.message, names)

    whole = create(sclient, messages=QUESTION, tool_choice=tool_choice, temperature=0).choices[0].message
    chunks = list(create(sclient, messages=QUESTION, tool_choice=tool_choice, temperature=0, stream=True))
    calls: list[dict[str, Any]] = []
    finish_reasons = []
    for chunk in chunks:
        for choice in chunk.choices:
            finish_reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.index == len(calls):  # a new call: id, type and name come first
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish_reasons[-1] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]


def test_two_turns_with_a_tool_result(sclient: openai.OpenAI, server: Server) -> None:
    first = (
        create(
            sclient,
            messages=QUESTION,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
        )
        .choices[0]
        .message
    )
    [call] = first.tool_calls
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    second = create(sclient, messages=conversation, tool_choice="none", temperature=0, max_tokens=40)
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content
    # The call and its result went through the template: the prompt holds both.
    with server.http() as http:
        body = {"model": MODEL, "messages": conversation}
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert "<tool_call>" in text and call.function.name in text
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in text


def test_auto_parses_calls_or_gives_content(sclient: openai.OpenAI) -> None:
    response = create(sclient, messages=QUESTION, tool_choice="auto", temperature=0)
    choice = response.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ],
)
def test_bad_tools_are_400s(server: Server, body: dict[str, Any], param: str) -> None:
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 4} | body
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
