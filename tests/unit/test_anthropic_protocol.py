"""Anthropic's Messages API without a model: a request's mapping onto the chat completion request
(and so onto the prompt's messages and SamplingParams), its errors naming Anthropic's fields, and
the stream of events adding up to the whole message."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from yaie.errors import InvalidRequestError
from yaie.outputs import CompletionOutput, RequestOutput
from yaie.server import anthropic_protocol as a
from yaie.server import protocol as p
from yaie.server.anthropic_messages import ANTHROPIC_EVENTS, AnthropicMessage, ContentBlocks
from yaie.server.errors import APIError
from yaie.server.streaming import Update
from yaie.structured.tool_formats import HERMES

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def parse(
    body: dict[str, Any], model: type[a.CountTokensRequest] = a.MessagesRequest
) -> a.CountTokensRequest:
    return a.parse(model, json.dumps(body).encode())


def request(**fields: Any) -> a.MessagesRequest:
    body = {"max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **fields}
    parsed = parse(body)
    assert isinstance(parsed, a.MessagesRequest)
    return parsed


def test_a_conversation_with_tools_becomes_the_chat_messages_that_say_the_same() -> None:
    body = request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    chat = body.to_chat()
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tool_definitions == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]


def test_a_tool_error_and_a_call_alone() -> None:
    chat = request(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "no", "is_error": True}],
            },
        ]
    ).to_chat()
    messages = chat.template_messages()
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["name"] == "f"
    assert messages[2] == {"role": "tool", "content": "Error: no", "tool_call_id": "t"}
    assert len(messages) == 3


def test_sampling_fields_map_onto_sampling_params() -> None:
    body = request(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["END"], metadata={"user_id": "u"})
    params = body.to_sampling_params(body.to_chat())
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 0.5, 0.9, 40)
    assert params.stop == ["END"]
    assert params.structured_outputs is None


@pytest.mark.parametrize(
    ("tool_choice", "name"),
    [({"type": "any"}, None), ({"type": "tool", "name": "get_weather"}, "get_weather")],
)
def test_any_and_a_named_tool_constrain_the_output_to_a_call(
    tool_choice: dict[str, Any], name: str | None
) -> None:
    body = request(tools=[WEATHER, {**WEATHER, "name": "other"}], tool_choice=tool_choice)
    params = body.to_sampling_params(body.to_chat(), HERMES)
    assert params.structured_outputs is not None and params.structured_outputs.grammar is not None
    grammar = params.structured_outputs.grammar
    assert '"get_weather"' in grammar
    assert ('"other"' in grammar) == (name is None)


def test_tool_choice_none_hides_the_tools_and_auto_leaves_the_output_free() -> None:
    assert request(tools=[WEATHER], tool_choice={"type": "none"}).to_chat().tool_definitions is None
    body = request(tools=[WEATHER], tool_choice={"type": "auto"})
    chat = body.to_chat()
    assert chat.calls_tools and body.to_sampling_params(chat).structured_outputs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "assistant", "content": "prefill"}]}, "messages[0].role"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
                ]
            },
            "messages[0].content[0].type",
        ),
        ({"tool_choice": {"type": "required"}, "tools": [WEATHER]}, "tool_choice.type"),
        ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_requests_name_their_field(fields: dict[str, Any], param: str) -> None:
    body = {"max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **fields}
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(InvalidRequestError) as info:
        parsed = parse(body)
        assert isinstance(parsed, a.MessagesRequest)
        parsed.to_sampling_params(parsed.to_chat())
    assert info.value.param == param, info.value.message
    assert info.value.message.startswith(param)


def test_count_tokens_needs_no_max_tokens() -> None:
    body = parse({"messages": [{"role": "user", "content": "Hi"}], "system": "S"}, a.CountTokensRequest)
    assert body.chat_request().template_messages() == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
    ]


def test_errors_take_anthropics_shape_on_its_routes_only() -> None:
    error = APIError(400, "max_tokens: missing required parameter", param="max_tokens")
    assert error.body("/v1/messages") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: missing required parameter"},
    }
    assert error.body("/v1/chat/completions")["error"]["param"] == "max_tokens"
    kinds = {
        status: APIError(status, "m").body("/v1/messages/count_tokens")["error"]["type"]
        for status in (401, 404, 405, 429, 500, 503)
    }
    assert kinds == {
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        429: "rate_limit_error",
        500: "api_error",
        503: "overloaded_error",
    }
    event = ANTHROPIC_EVENTS.error(APIError(503, "shutting down"))
    assert event.startswith("event: error\ndata: ")
    assert json.loads(event.split("data: ", 1)[1])["error"]["type"] == "overloaded_error"


# -- responses --------------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_content_blocks_hold_back_whitespace_around_calls() -> None:
    blocks = ContentBlocks()
    events = blocks.add([("content", "\n")])
    assert events == []  # perhaps the space before a call: no block yet
    parser = HERMES.parser(["get_weather"])
    events = blocks.add(parser.feed("  " + CALL + "\n") + parser.finish()) + blocks.close()
    assert [e.type for e in events] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert [block.model_dump() for block in blocks.blocks] == [
        {
            "type": "tool_use",
            "id": blocks.blocks[0].model_dump()["id"],
            "name": "get_weather",
            "input": {"city": "Paris"},
        }
    ]


class FakeGeneration:
    """The parts of a Generation the builder reads: updates as a model's tokens come."""

    def __init__(self, pieces: list[str], finish_reason: str, stop_reason: int | str | None = None) -> None:
        self.pieces, self.finish_reason, self.stop_reason = pieces, finish_reason, stop_reason
        self.n = 1
        self.seen = 0

    async def updates(self) -> AsyncGenerator[Update, None]:
        text = ""
        for i, piece in enumerate(self.pieces):
            text += piece
            last = i == len(self.pieces) - 1
            choice = CompletionOutput(
                index=0,
                text=text,
                token_ids=list(range(i + 1)),
                finish_reason=self.finish_reason if last else None,
                stop_reason=self.stop_reason if last else None,
                delta_text=piece,
                delta_token_ids=[i],
            )
            output = RequestOutput("msg_1", None, [1, 2, 3], [choice], finished=last, num_cached_tokens=1)
            self.seen = i + 1
            yield Update(0, 0, choice, output, i == 0, choice.finish_reason)

    def usage(self) -> p.Usage:
        return p.Usage.of(prompt_tokens=3, completion_tokens=self.seen, cached_tokens=1)

    def final(self) -> RequestOutput:
        text = "".join(self.pieces)
        tokens = list(range(len(self.pieces)))
        choice = CompletionOutput(0, text, tokens, self.finish_reason, self.stop_reason)
        return RequestOutput("msg_1", None, [1, 2, 3], [choice], finished=True, num_cached_tokens=1)


def stream(message: AnthropicMessage, generation: FakeGeneration) -> list[a.StreamEvent]:
    async def collect() -> list[a.StreamEvent]:
        return [event async for event in message.events(generation)]  # type: ignore[arg-type]

    return asyncio.run(collect())


def add_up(events: list[a.StreamEvent]) -> dict[str, Any]:
    """The message a client builds from the events, as the anthropic SDK does."""
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for event in events:
        data = event.model_dump()
        if data["type"] == "message_start":
            message = data["message"]
        elif data["type"] == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(data["content_block"])
        elif data["type"] == "content_block_delta":
            delta = data["delta"]
            if delta["type"] == "text_delta":
                message["content"][data["index"]]["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                message["content"][data["index"]]["thinking"] += delta["thinking"]
            else:
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif data["type"] == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = json.loads(partial[data["index"]])
        elif data["type"] == "message_delta":
            message.update(data["delta"])
            message["usage"]["output_tokens"] = data["usage"]["output_tokens"]
    return message


@pytest.mark.parametrize(
    ("pieces", "finish", "stop", "tools", "reason", "sequence"),
    [
        (["Hel", "lo", " there"], "stop", 2, False, "end_turn", None),
        (["Hel", "lo"], "length", None, False, "max_tokens", None),
        (["Hel", "lo"], "stop", "END", False, "stop_sequence", "END"),
        (["Sure.", "\n", CALL[:20], CALL[20:], "\n"], "stop", 2, True, "tool_use", None),
        (["\n", CALL, "\n", CALL], "stop", 2, True, "tool_use", None),
    ],
)
def test_the_stream_is_in_anthropics_order_and_adds_up_to_the_whole_message(
    pieces: list[str], finish: str, stop: int | str | None, tools: bool, reason: str, sequence: str | None
) -> None:
    body = request(tools=[WEATHER]) if tools else request()
    message = AnthropicMessage("msg_1", "smol", body.to_chat(), HERMES)
    events = stream(message, FakeGeneration(pieces, finish, stop))
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    blocks = types[2:-2]
    while blocks:  # each block: its start, its deltas, its stop
        assert blocks[0] == "content_block_start"
        end = blocks.index("content_block_stop")
        assert set(blocks[1:end]) == {"content_block_delta"}
        blocks = blocks[end + 1 :]
    for event in events:  # each one as the anthropic SDK reads it (it skips pings)
        if event.type != "ping":
            TypeAdapter(RawMessageStreamEvent).validate_python(event.model_dump())

    generation = FakeGeneration(pieces, finish, stop)
    generation.seen = len(pieces)  # all of it, as once the outputs have been read
    whole = message.response([generation.final()], generation.usage())
    added = add_up(events)
    assert (whole.stop_reason, whole.stop_sequence) == (reason, sequence)
    assert added["stop_reason"] == reason and added["stop_sequence"] == sequence
    assert (
        whole.usage.model_dump()
        == added["usage"]
        == {
            "input_tokens": 2,
            "output_tokens": len(pieces),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 1,
        }
    )
    ids = [block.get("id") for block in added["content"]]
    assert [
        {**b.model_dump(), "id": None} if b.type == "tool_use" else b.model_dump() for b in whole.content
    ] == [{**block, "id": None} if block["type"] == "tool_use" else block for block in added["content"]]
    assert all(i is None or i.startswith("call_") for i in ids)
    Message.model_validate(whole.model_dump())  # as the anthropic SDK reads it
    if tools:
        calls = [block for block in whole.content if block.type == "tool_use"]
        assert [call.model_dump()["input"] for call in calls] == [{"city": "Paris"}] * len(calls)
        assert all(block.text.strip() for block in whole.content if isinstance(block, a.TextContent))
    else:
        assert [block.model_dump() for block in whole.content] == [{"type": "text", "text": "".join(pieces)}]


def test_named_events_carry_their_type() -> None:
    assert ANTHROPIC_EVENTS.chunk(a.MessageStop()) == 'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert ANTHROPIC_EVENTS.done == ""


@pytest.mark.parametrize("thinks", [True, False])
def test_thinking_comes_first_as_its_own_block_when_the_request_enables_it(thinks: bool) -> None:
    pieces = ["<th", "ink>\nLet me", " see.</th", "ink>\n\nSure.", "\n", CALL, "\n"]
    body = request(tools=[WEATHER])
    chat = body.to_chat()
    message = AnthropicMessage("msg_1", "smol", chat, HERMES, starts_in_reasoning=False, thinks=thinks)
    events = stream(message, FakeGeneration(pieces, "stop", 2))
    for event in events:
        if event.type != "ping":
            TypeAdapter(RawMessageStreamEvent).validate_python(event.model_dump())
    generation = FakeGeneration(pieces, "stop", 2)
    whole = message.response([generation.final()], generation.usage())
    added = add_up(events)
    assert [block["type"] for block in added["content"]] == [block.type for block in whole.content]
    thinking = [{"type": "thinking", "thinking": "Let me see.", "signature": ""}] if thinks else []
    assert [block.model_dump() for block in whole.content][: len(thinking) + 1] == [
        *thinking,
        {"type": "text", "text": "Sure.\n"},
    ]
    assert added["content"][: len(thinking) + 1] == [*thinking, {"type": "text", "text": "Sure.\n"}]
    assert whole.content[-1].type == "tool_use" and whole.stop_reason == "tool_use"
    Message.model_validate(whole.model_dump())
