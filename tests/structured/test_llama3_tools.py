"""Llama-3 tool calls: the parser alone, the format picked by the chat template, and the
server's chat completions with a tiny random Llama model whose template renders tools as
Llama-3.1's does (made on the spot, no download). A random model writes no call of its own, so
the calls here are made by grammars: tool_choice "required", or a response_format whose
schema is that of a call (with tool_choice "auto", the answer is then parsed as the model's)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.model.tiny_models import CHAT_TEMPLATE, make_tiny_model
from yaie import LLM
from yaie.engine.async_engine import AsyncEngine
from yaie.server.app import build_app
from yaie.structured import tool_formats
from yaie.structured.llama3_tools import Llama3ToolCallParser

# Llama-3.1's way, shortened: tools as JSON in a system turn with the format to answer in, a
# call as bare JSON with "parameters", a tool result as an "ipython" turn.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    'Respond with a JSON for a function call in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}.\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}"
    "<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|end_header_id|>\n\n"
    "{% if m.get('tool_calls') %}{% for call in m['tool_calls'] %}"
    '{"name": "{{ call["function"]["name"] }}", "parameters": {{ call["function"]["arguments"] | tojson }}}'
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|eot_id|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{%- endif %}{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{%- endfor %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
NAMES = ["get_weather", "add"]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}  # type: ignore[index]
QUESTION = [{"role": "user", "content": "Weather?"}]


# -- the parser ------------------------------------------------------------------------------------


def split(text: str, size: int, names: list[str] = NAMES) -> tuple[str, list[tuple[int, str, Any]], int]:
    """(content, [(index, name, arguments)], num_calls) of `text` fed `size` characters at a time."""
    parser = Llama3ToolCallParser(names)
    events = []
    for start in range(0, len(text), size):
        events += parser.feed(text[start : start + size])
    events += parser.finish()
    content = "".join(value for kind, value in events if kind == "content")
    calls = [(c.index, c.name, json.loads(c.arguments)) for kind, c in events if kind == "call"]
    return content, calls, parser.num_calls


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "add", "parameters": {"a": 1}}', "", [(0, "add", {"a": 1})]),
        (
            ' \n<|python_tag|>{"name": "get_weather", "parameters": {"unit": "{celsius}\\"", "days": 2}}; '
            '{"name": "add", "arguments": {"a": 2}}\n',
            "",
            [(0, "get_weather", {"unit": '{celsius}"', "days": 2}), (1, "add", {"a": 2})],
        ),
        # After its calls, a turn may go on in words.
        ('{"name": "add", "parameters": {}} Done.', "Done.", [(0, "add", {})]),
        # Not calls: words first, ordinary JSON, an unknown tool, other keys, a cut-short object.
        ('Sure: {"name": "add", "parameters": {}}', 'Sure: {"name": "add", "parameters": {}}', []),
        ('{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),
        ('{"name": "mul", "parameters": {}}', '{"name": "mul", "parameters": {}}', []),
        ('{"name": "add"}', '{"name": "add"}', []),
        ('{"name": "add", "parameters": {"a": ', '{"name": "add", "parameters": {"a": ', []),
        ("<|python", "<|python", []),
        ("  ", "  ", []),
        ('{"name": "add", "parameters": {}} {"x": 1}', '{"x": 1}', [(0, "add", {})]),
    ],
)
def test_parser_gives_the_same_events_at_any_chunking(text: str, content: str, calls: list[Any]) -> None:
    for size in (1, 2, 5, len(text)):
        assert split(text, size) == (content, calls, len(calls))


def test_calls_carry_fresh_ids() -> None:
    parser = Llama3ToolCallParser(NAMES)
    events = parser.feed('{"name": "add", "parameters": {}};{"name": "add", "parameters": {}}')
    ids = [call.id for _, call in events]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_the_format_is_picked_by_the_template() -> None:
    assert tool_formats.for_template(LLAMA3_TEMPLATE) is tool_formats.LLAMA3
    assert tool_formats.for_template(CHAT_TEMPLATE) is tool_formats.HERMES  # renders no tools
    assert tool_formats.for_template(QWEN_LIKE_TEMPLATE) is tool_formats.HERMES
    assert tool_formats.for_template(None) is tool_formats.HERMES
    # A Llama-3 template that renders no tools gets them in the Hermes style, and writes so.
    assert tool_formats.for_template("<|start_header_id|>{{ messages }}") is tool_formats.HERMES


# -- the server with a tiny Llama-3-template model ----------------------------------------------


def tiny_model(path: Path, template: str) -> str:
    """A tiny random Llama with `template`, and the context for tools spelled out byte by byte."""
    make_tiny_model("llama", path, seed=0)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama3_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(tiny_model(tmp_path_factory.mktemp("llama3"), LLAMA3_TEMPLATE), quantization="none")


@pytest.fixture(scope="module")
def chatml_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(tiny_model(tmp_path_factory.mktemp("chatml"), CHAT_TEMPLATE), quantization="none")


@contextlib.contextmanager
def serving(llm: LLM) -> Iterator[AsyncEngine]:
    async_engine = AsyncEngine(lambda: llm.engine)
    try:
        yield async_engine
    finally:
        async_engine.shutdown()


def post_all(llm: LLM, requests: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """Each (path, body) posted in turn to a server of `llm`."""

    async def main(async_engine: AsyncEngine) -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(async_engine, "m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as http:
            return [await http.post(path, json=body) for path, body in requests]

    with serving(llm) as async_engine:
        return asyncio.run(main(async_engine))


def chat(**fields: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": "m", "messages": QUESTION, "tools": TOOLS, "max_tokens": 120, "temperature": 0}
    return "/v1/chat/completions", body | fields


def streamed(response: httpx.Response) -> tuple[list[dict[str, Any]], list[str | None]]:
    """The tool calls a stream's deltas make up, and its finish reasons."""
    calls: list[dict[str, Any]] = []
    reasons = []
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            reasons.append(choice["finish_reason"])
            for delta in choice["delta"].get("tool_calls", []):
                if delta["index"] == len(calls):
                    calls.append({"name": delta["function"]["name"], "arguments": ""})
                calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls, reasons


def test_required_and_named_calls_come_as_llama3_json(llama3_llm: LLM) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    responses = post_all(
        llama3_llm,
        [
            chat(tool_choice="required", logprobs=True),
            chat(tool_choice="required", stream=True),
            chat(tool_choice=named, temperature=1.0, seed=5),
            chat(tool_choice=named, temperature=1.0, seed=5, stream=True),
        ],
    )
    assert all(response.status_code == 200 for response in responses), [r.text for r in responses]
    for whole, stream, names in ((responses[0], responses[1], NAMES), (responses[2], responses[3], ["add"])):
        [choice] = whole.json()["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["function"]["name"] in names
        jsonschema.validate(
            json.loads(calls[0]["function"]["arguments"]), SCHEMAS[calls[0]["function"]["name"]]
        )
        stream_calls, reasons = streamed(stream)
        assert reasons[-1] == "tool_calls"
        assert stream_calls == [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
        ]
    # What the model wrote (its tokens' logprobs tell): Llama-3's bare JSON, no tags.
    [choice] = responses[0].json()["choices"]
    written = "".join(entry["token"] for entry in choice["logprobs"]["content"])
    assert written.startswith('{"name": "') and "parameters" in json.loads(written)


def call_format(arguments_key: str) -> dict[str, Any]:
    """A response_format that makes the model write a call of `add`, arguments under `arguments_key`."""
    schema = {
        "type": "object",
        "properties": {"name": {"const": "add"}, arguments_key: ADD["function"]["parameters"]},  # type: ignore[index]
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}


def test_auto_parses_a_llama3_models_json_call(llama3_llm: LLM) -> None:
    [response] = post_all(llama3_llm, [chat(tool_choice="auto", response_format=call_format("parameters"))])
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["add"])


def test_a_chatml_models_json_answer_stays_content(chatml_llm: LLM) -> None:
    [response] = post_all(chatml_llm, [chat(tool_choice="auto", response_format=call_format("parameters"))])
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"].get("tool_calls") is None
    assert json.loads(choice["message"]["content"])["name"] == "add"


def test_calls_and_results_go_back_through_the_llama3_template(llama3_llm: LLM) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 4}'}}
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    tokenized, answered = post_all(
        llama3_llm,
        [("/tokenize", {"model": "m", "messages": messages}), chat(messages=messages, max_tokens=2)],
    )
    assert answered.status_code == 200, answered.text
    [detokenized] = post_all(
        llama3_llm, [("/detokenize", {"model": "m", "tokens": tokenized.json()["tokens"]})]
    )
    text = detokenized.json()["prompt"]
    assert '{"name": "add", "parameters": {"a": 4}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>" in text
    assert "<tool_call>" not in text and "<tool_response>" not in text  # the template's own format
