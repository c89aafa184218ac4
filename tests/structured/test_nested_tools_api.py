"""Tools made of pydantic models that nest others (so their parameters have `$defs` and `$ref`),
as the openai SDK's `pydantic_function_tool` makes them, through the official client against a
real server: a required or named call is valid and parses back into its model. (Calls of a
recursive tool that end are in test_nested_schemas.py: the small model here nests forever.)"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionNamedToolChoiceParam
from pydantic import BaseModel, Field

from tests.e2e.e2e_helpers import MODEL

pytestmark = pytest.mark.slow


class Address(BaseModel):
    street: str = Field(max_length=24)
    city: str = Field(max_length=16)


class Contact(BaseModel):
    """Save a person and their address as a contact."""

    name: str = Field(max_length=16)
    address: Address


class Task(BaseModel):
    """Add a task, and perhaps a subtask of it: a model that refers to itself."""

    title: str = Field(max_length=24)
    subtasks: list[Task] = Field(max_length=1)


MODELS: dict[str, type[BaseModel]] = {"Contact": Contact, "Task": Task}
TOOLS = [openai.pydantic_function_tool(Contact), openai.pydantic_function_tool(Task)]
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Save Alice, who lives at 12 Rue Cler in Paris, as a contact."}
]
MAX_TOKENS = 150


def named(name: str) -> ChatCompletionNamedToolChoiceParam:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("tool_choice", ["required", named("Contact")], ids=str)
def test_nested_pydantic_tools_give_valid_calls(sclient: openai.OpenAI, tool_choice: Any) -> None:
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        response = sclient.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=MAX_TOKENS,
            **sampling,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls or []
        assert call.type == "function"
        if tool_choice != "required":
            assert call.function.name == tool_choice["function"]["name"]
        MODELS[call.function.name].model_validate_json(call.function.arguments)


def test_a_recursive_tool_is_constrained(sclient: openai.OpenAI) -> None:
    # The small model tends to nest a Task in its subtasks for as long as it may (the grammar
    # allows any depth), so its call may be cut short: then it is the start of a Task call.
    response = sclient.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=named("Task"),
        temperature=0,
        max_tokens=40,
    )
    choice = response.choices[0]
    if choice.finish_reason == "tool_calls":
        [call] = choice.message.tool_calls or []
        assert call.type == "function"
        Task.model_validate_json(call.function.arguments)
    else:
        assert choice.finish_reason == "length" and choice.message.content is not None
        assert choice.message.content.startswith('<tool_call>\n{"name": "Task", "arguments": {"title": "')


def test_parse_gives_the_nested_model(sclient: openai.OpenAI) -> None:
    # `parse` checks the tools are strict and parses each call's arguments into its model.
    completion = sclient.chat.completions.parse(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=named("Contact"),
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    [call] = completion.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Contact)
    assert isinstance(call.function.parsed_arguments.address, Address)


def test_response_format_with_a_nested_model(sclient: openai.OpenAI) -> None:
    completion = sclient.chat.completions.parse(
        model=MODEL,
        messages=QUESTION,
        response_format=Contact,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Contact) and isinstance(message.parsed.address, Address)
