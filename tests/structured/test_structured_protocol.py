"""response_format, structured_outputs and tools onto SamplingParams, and tool-call chunks
joined: no model needed."""

from __future__ import annotations

from typing import Any

import pytest

from yaie.errors import InvalidRequestError
from yaie.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from yaie.structured.spec import StructuredOutputs

HELLO = [{"role": "user", "content": "Hello"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO, **fields})


def structured(request: ChatCompletionRequest | CompletionRequest) -> StructuredOutputs | None:
    return request.to_sampling_params().structured_outputs


def test_response_formats_and_extras_map_onto_structured_outputs() -> None:
    json_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert structured(chat(response_format=json_schema)) == StructuredOutputs(json=SCHEMA)
    assert structured(chat(response_format={"type": "json_object"})) == StructuredOutputs(json_object=True)
    assert structured(chat(response_format={"type": "text"})) is None
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": "Hi", "structured_outputs": {"choice": ["a", "b"]}}
    )
    assert structured(completion) == StructuredOutputs(choice=["a", "b"])
    assert structured(chat(structured_outputs={"json": SCHEMA})) == StructuredOutputs(json=SCHEMA)
    assert structured(chat(structured_outputs={"json_object": True})) == StructuredOutputs(json_object=True)


def test_tool_choice_sets_the_call_grammar() -> None:
    assert structured(chat(tools=[TOOL])) is None  # auto: the model chooses
    assert structured(chat(tools=[TOOL], tool_choice="none")) is None
    assert chat(tools=[TOOL], tool_choice="none").tool_definitions is None
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        spec = structured(chat(tools=[TOOL], tool_choice=choice))
        assert spec is not None and spec.grammar is not None and '"const": "f"' in spec.grammar


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
        (chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (chat(messages=[{"role": "assistant"}]), "messages[0].content"),
        (chat(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]), "messages[0].tool_calls"),
    ],
)
def test_refusals(request_: ChatCompletionRequest, param: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        request_.to_sampling_params()
    assert raised.value.param == param


def test_errors_of_compiling_name_the_field_the_constraint_came_from() -> None:
    error = InvalidRequestError("structured_outputs: regex is invalid", "structured_outputs")
    assert chat(response_format={"type": "json_object"}).translate_error(error).param == "response_format"
    assert chat(structured_outputs={"regex": "a"}).translate_error(error).param == "structured_outputs"
    assert chat(tools=[TOOL], tool_choice="required").translate_error(error).param == "tools"
