"""Ollama's request models and their mapping onto the OpenAI requests (options, format, messages
with calls), its Go-template subset, and the NDJSON reply builder over a scripted generation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any, cast

import pytest

from yaie.errors import InvalidRequestError
from yaie.outputs import CompletionOutput, RequestOutput
from yaie.server import ollama_protocol as o
from yaie.server.ollama import OllamaReply, _lines
from yaie.server.streaming import Generation, Update
from yaie.structured.tool_formats import HERMES

PROMPT_IDS = [1, 2, 3]


def chat(**fields: Any) -> o.ChatRequest:
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], **fields}
    return cast(o.ChatRequest, o.parse(o.ChatRequest, body))


def test_options_map_onto_sampling_params() -> None:
    options = {
        "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 42, "stop": ["\n\n"],
        "num_predict": 12, "repeat_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.4,
        "num_ctx": 4096, "num_thread": 8, "mirostat": 2, "numa": True,  # Ollama's, no meaning here
    }  # fmt: skip
    params = chat(options=options).to_openai().to_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 7, 0.1)
    assert (params.seed, params.stop, params.max_tokens) == (42, ["\n\n"], 12)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.2, 0.3, 0.4)


def test_options_left_out_take_the_defaults() -> None:
    params = chat().to_openai().to_sampling_params(defaults={"temperature": 0.6})
    assert params.temperature == 0.6 and params.seed is None


def test_negative_num_predict_fills_the_context_and_negative_seed_is_random() -> None:
    body = chat(options={"num_predict": -1, "seed": -1})
    assert body.fills_context
    params = body.to_openai().to_sampling_params()
    assert params.seed is None and params.max_tokens is None  # the endpoint sets the room left
    assert not chat(options={"num_predict": 5}).fills_context


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"temperature": "hot"}, "options.temperature"),
        ({"num_predict": 1.5}, "options.num_predict"),
        ({"top_k": "3"}, "options.top_k"),
    ],
)
def test_mistyped_options_name_the_option(options: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(options=options)
    assert info.value.param == param and param in info.value.message


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"temperature": -1.0}, "options.temperature"),
        ({"num_predict": 0}, "options.num_predict"),
        ({"repeat_penalty": 0.0}, "options.repeat_penalty"),
        ({"seed": 2**64}, "options.seed"),
    ],
)
def test_out_of_range_options_name_the_option(options: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(options=options).to_openai().to_sampling_params()
    error = o.translate_error(info.value)
    assert error.param == param and error.message.startswith(param), error.message


def test_format_json_and_schema() -> None:
    assert chat(format="json").to_openai().to_sampling_params().structured_outputs.json_object  # type: ignore[union-attr]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = chat(format=schema).to_openai().to_sampling_params().structured_outputs
    assert spec is not None and spec.json == schema
    assert chat(format="").to_openai().to_sampling_params().structured_outputs is None
    with pytest.raises(InvalidRequestError) as info:
        chat(format="yaml")
    assert info.value.param == "format"


def test_messages_with_calls_become_openai_turns() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
                {"function": {"name": "weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "content": "20C", "tool_name": "weather"},
        {"role": "tool", "content": "25C", "tool_name": "weather"},
    ]
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    request = chat(messages=messages, tools=[tool]).to_openai()
    turns = request.template_messages()
    calls = turns[1]["tool_calls"]
    assert [call["function"]["arguments"] for call in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert [turn["tool_call_id"] for turn in turns[2:]] == [call["id"] for call in calls]
    assert request.calls_tools and request.tool_names == ["weather"]
    assert request.to_sampling_params().structured_outputs is None  # Ollama's way: the model chooses
    named = {"type": "function", "function": {"name": "weather"}}
    for choice in ("required", named):  # yaie's extension: the call's grammar
        required = chat(messages=messages, tools=[tool], tool_choice=choice).to_openai()
        assert required.to_sampling_params().structured_outputs is not None


# OpenAI's arguments are JSON text, Ollama's an object.
ARGUMENTS_AS_TEXT = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": ARGUMENTS_AS_TEXT}, "messages[0].tool_calls[0].function.arguments"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"stream": "yes"}, "stream"),
    ],
)  # fmt: skip
def test_bad_chat_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        o.parse(o.ChatRequest, {"model": "smol", **body})
    assert info.value.param == param, info.value.message


def test_model_is_required_and_the_body_an_object() -> None:
    with pytest.raises(InvalidRequestError) as info:
        o.parse(o.ChatRequest, {"messages": []})
    assert info.value.param == "model"
    with pytest.raises(InvalidRequestError):
        o.parse(o.ChatRequest, ["model"])


def test_unsupported_fields_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="--reasoning-parser"):
        chat(think=True).check(splits_thinking=False)
    chat(think=True).check(splits_thinking=True)
    chat(think=False).check(splits_thinking=False)  # not thinking needs no parser
    with pytest.raises(InvalidRequestError) as info:
        chat(messages=[{"role": "user", "content": "x", "images": ["aGk="]}]).to_openai()
    assert info.value.param == "messages[0].images"
    generate = o.parse(o.GenerateRequest, {"model": "smol", "prompt": "x", "raw": True, "system": "s"})
    with pytest.raises(InvalidRequestError) as info:
        generate.check(splits_thinking=False)
    assert info.value.param == "system"


def test_generate_becomes_a_completion_of_its_tokens() -> None:
    body = o.parse(o.GenerateRequest, {"model": "smol", "prompt": "x", "options": {"num_predict": 3}})
    request = body.to_openai(PROMPT_IDS)
    assert request.prompts() == [PROMPT_IDS]
    assert request.to_sampling_params().max_tokens == 3
    assert body.streams  # Ollama streams unless told not to


def test_go_template_subset() -> None:
    template = "{{ if .System }}<s>{{ .System }}</s>{{ end }}\nU: {{- .Prompt }}\nA: {{ .Response }}<end>"
    assert (
        o.render_template(template, {"System": "Be brief.", "Prompt": " hi"})
        == "<s>Be brief.</s>\nU: hi\nA: "
    )
    assert o.render_template(template, {"System": "", "Prompt": "hi"}) == "\nU:hi\nA: "
    for bad in ("{{ range .Messages }}x{{ end }}", "{{ .Tools }}"):
        with pytest.raises(InvalidRequestError) as info:
            o.render_template(bad, {"System": "", "Prompt": ""})
        assert info.value.param == "template"


def test_names_and_arguments() -> None:
    assert o.model_names("smol") == ("smol:latest", frozenset({"smol", "smol:latest"}))
    assert o.model_names("smol:q4") == ("smol:q4", frozenset({"smol:q4"}))
    assert o.call_arguments('{"a": 1}') == {"a": 1}
    assert o.call_arguments("[1]") == {"arguments": [1]}
    assert o.call_arguments("not json") == {"arguments": "not json"}
    assert o.parameters_text({"temperature": 0.6, "repetition_penalty": 1.1}).split("\n") == [
        f"{'temperature':<30} 0.6",
        f"{'repeat_penalty':<30} 1.1",
    ]


# -- the reply builder ------------------------------------------------------------------------


class ScriptedGeneration:
    """A Generation's updates() from a list of (text so far, token ids so far, finish reason)."""

    def __init__(
        self, steps: list[tuple[str, list[int], str | None]], error: Exception | None = None
    ) -> None:
        self.steps = steps
        self.error = error

    async def updates(self) -> AsyncGenerator[Update, None]:
        text, tokens = "", []
        for i, (new_text, new_tokens, finish) in enumerate(self.steps):
            choice = CompletionOutput(
                index=0, text=text + new_text, token_ids=tokens + new_tokens, finish_reason=finish,
                delta_text=new_text, delta_token_ids=new_tokens,
            )  # fmt: skip
            text, tokens = choice.text, choice.token_ids
            output = RequestOutput("r", None, PROMPT_IDS, [choice], finished=finish is not None)
            yield Update(0, 0, choice, output, i == 0, finish)
        if self.error is not None:
            raise self.error


def collect(reply: OllamaReply, generation: ScriptedGeneration) -> list[dict[str, Any]]:
    async def read() -> list[str]:
        return [line async for line in _lines(reply.chunks(cast(Generation, generation)))]

    lines = asyncio.run(read())
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in lines)  # one object a line
    return [json.loads(line) for line in lines]


STEPS: list[tuple[str, list[int], str | None]] = [
    ("Hel", [10], None),
    ("lo", [11], None),
    ("!", [12], "length"),
]


def test_generate_stream_lines() -> None:
    lines = collect(OllamaReply("smol", False, None, 0), ScriptedGeneration(STEPS))
    assert [line["response"] for line in lines] == ["Hel", "lo", "!", ""]
    assert [line["done"] for line in lines] == [False, False, False, True]
    final = lines[-1]
    assert final["done_reason"] == "length" and final["model"] == "smol"
    assert (final["prompt_eval_count"], final["eval_count"]) == (3, 3)
    assert final["context"] == [*PROMPT_IDS, 10, 11, 12]
    for field in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[field], int) and final[field] >= 0
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]
    assert final["created_at"].endswith("Z") and "message" not in final


def test_chat_whole_reply_with_calls() -> None:
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    steps: list[tuple[str, list[int], str | None]] = [("Sure. ", [5], None), (call, [6, 7], "stop")]
    reply = OllamaReply("smol:latest", True, HERMES.parser(["weather"]), 0)
    chunk = asyncio.run(reply.whole(cast(Generation, ScriptedGeneration(steps))))
    whole = chunk.model_dump(exclude_none=True)
    assert whole["message"]["content"] == "Sure. "
    assert whole["message"]["tool_calls"] == [
        {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
    ]
    assert (
        whole["done"]
        and whole["done_reason"] == "stop"
        and "context" not in whole
        and "response" not in whole
    )


def test_a_failure_mid_stream_is_a_last_error_line() -> None:
    generation = ScriptedGeneration(
        STEPS[:1], error=InvalidRequestError("max_tokens: too many", "max_tokens")
    )
    lines = collect(OllamaReply("smol", True, None, 0), generation)
    assert lines[0]["message"] == {"role": "assistant", "content": "Hel"} and not lines[0]["done"]
    assert lines[-1] == {"error": "options.num_predict: too many"}
