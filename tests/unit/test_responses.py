"""The Responses API without a model: a request's input as chat messages, its errors naming the
Responses fields, the response built from finished outputs and streamed as events, and the
bounded store of responses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from yaie.errors import InvalidRequestError
from yaie.outputs import CompletionOutput, RequestOutput
from yaie.server import protocol as p
from yaie.server import responses_protocol as rp
from yaie.server.errors import APIError
from yaie.server.responses import ResponseBuilder, ResponseStore
from yaie.server.streaming import Update, event_stream
from yaie.structured.tool_formats import HERMES

USAGE = p.Usage.of(prompt_tokens=7, completion_tokens=3, cached_tokens=2)
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def request(**fields: Any) -> rp.ResponsesRequest:
    return rp.ResponsesRequest.parse(json.dumps({"model": "m", **fields}).encode())


def template(body: rp.ResponsesRequest, history: list[p.ChatMessage] | None = None) -> list[dict[str, Any]]:
    return body.to_chat(history or []).template_messages()


def test_a_string_input_is_one_user_message() -> None:
    assert template(request(input="Hi", instructions="Be brief.")) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_input_items_become_chat_messages() -> None:
    body = request(
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
                "id": "msg_1",
                "status": "completed",
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}', "id": "fc_1"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
        ]
    )
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {}}},
    ]
    assert template(body) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},  # one turn
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rain", "tool_call_id": "c2"},
    ]
    # Calls without text before them are an assistant turn of their own.
    alone = request(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    [turn] = template(alone)
    assert (turn["role"], turn["content"], len(turn["tool_calls"])) == ("assistant", "", 1)


def test_instructions_come_before_the_previous_conversation() -> None:
    history = [p.ChatMessage(role="user", content="Hi"), p.ChatMessage(role="assistant", content="Hello")]
    assert template(request(input="And?", instructions="Be brief."), history) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "And?"},
    ]


def test_tools_choice_and_text_format_map_onto_the_chat_request() -> None:
    chat = request(input="x", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}).to_chat(
        []
    )
    assert chat.tool_definitions == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert chat.tool_choice == p.NamedToolChoice(
        type="function", function=p.NamedFunction(name="get_weather")
    )
    params = chat.to_sampling_params(HERMES)
    assert params.structured_outputs is not None and params.structured_outputs.grammar is not None

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = request(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    structured = body.to_chat([]).to_sampling_params().structured_outputs
    assert structured is not None and structured.json == schema
    as_object = request(input="x", text={"format": {"type": "json_object"}}).to_chat([]).to_sampling_params()
    assert as_object.structured_outputs is not None and as_object.structured_outputs.json_object
    assert request(input="x", text={"format": {"type": "text"}}).to_chat([]).response_format is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "computer_call"}]}, "input[0]"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ],
)
def test_validation_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request(**body)
    assert info.value.param == param, info.value.message
    assert info.value.message.startswith(f"{param}: ")


def test_a_body_that_is_not_json_is_a_request_error() -> None:
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        rp.ResponsesRequest.parse(b"{")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ],
)
def test_sampling_errors_name_the_responses_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request(input="x", **fields).to_chat([]).to_sampling_params(HERMES)
    assert info.value.param == param, info.value.message


def test_no_input_and_no_history_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        request().to_chat([])
    assert info.value.param == "input"


def test_engine_errors_about_structured_outputs_name_text_format() -> None:
    body = request(input="x", text={"format": {"type": "json_object"}}).to_chat([])
    error = body.translate_error(InvalidRequestError("structured_outputs: bad schema", "structured_outputs"))
    assert (error.param, error.message) == ("text.format", "text.format: bad schema")


# -- the response -----------------------------------------------------------------------------


def builder(body: rp.ResponsesRequest, store: ResponseStore | None = None) -> ResponseBuilder:
    chat = body.to_chat([])
    params = chat.to_sampling_params(HERMES)
    return ResponseBuilder(
        "resp_1", "m", body, chat, params, [], HERMES, ResponseStore() if store is None else store
    )


def finished(text: str, reason: str) -> RequestOutput:
    return RequestOutput(
        "resp_1", None, [1] * 7, [CompletionOutput(0, text, [5, 6, 7], reason)], finished=True
    )


def test_response_from_the_finished_output() -> None:
    store = ResponseStore()
    response = builder(request(input="Hi", metadata={"k": "v"}), store).response(
        [finished("Hello", "stop")], USAGE
    )
    assert (response.id, response.object, response.status, response.model) == (
        "resp_1",
        "response",
        "completed",
        "m",
    )
    [message] = response.output
    assert isinstance(message, rp.OutputMessage) and message.content[0].text == "Hello"
    assert response.usage == rp.ResponseUsage(
        input_tokens=7,
        input_tokens_details=rp.InputTokensDetails(cached_tokens=2),
        output_tokens=3,
        output_tokens_details=rp.OutputTokensDetails(reasoning_tokens=0),
        total_tokens=10,
    )
    assert (response.metadata, response.tool_choice, response.text) == (
        {"k": "v"},
        "auto",
        {"format": {"type": "text"}},
    )
    stored = store.get("resp_1")
    assert stored.response == response
    assert [m.to_template() for m in stored.conversation] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]

    cut = builder(request(input="Hi", max_output_tokens=3)).response([finished("Hel", "length")], USAGE)
    assert cut.status == "incomplete" and cut.incomplete_details == rp.IncompleteDetails(
        reason="max_output_tokens"
    )

    unstored = ResponseStore()
    builder(request(input="Hi", store=False), unstored).response([finished("Hello", "stop")], USAGE)
    assert len(unstored) == 0


def test_response_splits_calls_out_of_the_text() -> None:
    store = ResponseStore()
    body = request(input="Weather in Paris?", tools=[TOOL])
    response = builder(body, store).response([finished("\n" + CALL_TEXT, "stop")], USAGE)
    [call] = response.output  # a turn of calls alone has no message
    assert isinstance(call, rp.FunctionCallOutput)
    assert (call.name, json.loads(call.arguments), call.status) == (
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    [_, turn] = store.get("resp_1").conversation
    assert turn.tool_calls is not None and turn.tool_calls[0].id == call.call_id


class FakeGeneration:
    """What ResponseBuilder.events reads of a Generation: the choice's updates and the usage."""

    def __init__(self, deltas: list[str], reason: str) -> None:
        self.deltas, self.reason = deltas, reason

    async def updates(self) -> AsyncGenerator[Update, None]:
        text = ""
        for i, delta in enumerate(self.deltas):
            text += delta
            last = i == len(self.deltas) - 1
            choice = CompletionOutput(0, text, [1], self.reason if last else None, delta_text=delta)
            output = RequestOutput("resp_1", None, [1], [choice], finished=last)
            yield Update(0, 0, choice, output, i == 0, choice.finish_reason)

    def usage(self) -> p.Usage:
        return USAGE


def stream(body: rp.ResponsesRequest, deltas: list[str], reason: str = "stop") -> list[dict[str, Any]]:
    async def collect() -> list[dict[str, Any]]:
        generation = FakeGeneration(deltas, reason)
        return [event async for event in builder(body).events(generation)]  # type: ignore[arg-type]

    events = asyncio.run(collect())
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def test_streamed_text_events_in_openai_order() -> None:
    events = stream(request(input="Hi"), ["Hel", "lo"])
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert [event["delta"] for event in events[4:6]] == ["Hel", "lo"]
    assert events[6]["text"] == "Hello" and events[7]["part"]["text"] == "Hello"
    item_id = events[2]["item"]["id"]
    assert all(event["item_id"] == item_id for event in events[3:8])
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [events[8]["item"]]
    assert final["usage"]["total_tokens"] == 10


def test_a_stream_cut_short_ends_incomplete() -> None:
    events = stream(request(input="Hi", max_output_tokens=2), ["Hel"], "length")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_streamed_calls() -> None:
    events = stream(request(input="Weather?", tools=[TOOL]), ["\n", CALL_TEXT[:20], CALL_TEXT[20:]])
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2]["item"], events[5]["item"]
    assert (added["type"], added["status"], added["arguments"]) == ("function_call", "in_progress", "")
    assert json.loads(events[4]["arguments"]) == {"city": "Paris"} == json.loads(done["arguments"])
    assert events[-1]["response"]["output"] == [done]


def test_a_failure_mid_stream_is_an_error_event() -> None:
    class Failing(FakeGeneration):
        async def updates(self) -> AsyncGenerator[Update, None]:
            raise InvalidRequestError("input: too long", "input")
            yield  # an async generator

    async def collect() -> list[dict[str, Any]]:
        """The events as the stream writes them (the error event is written there)."""
        answer = builder(request(input="Hi"))
        stream = event_stream(answer.events(Failing([], "stop")), answer.event_format())  # type: ignore[arg-type]
        text = "".join([str(chunk) async for chunk in stream.body_iterator])
        lines = [line for line in text.splitlines() if line.startswith("data: ")]
        return [json.loads(line.removeprefix("data: ")) for line in lines]

    events = asyncio.run(collect())
    assert [event["type"] for event in events] == ["response.created", "response.in_progress", "error"]
    assert (events[-1]["param"], events[-1]["sequence_number"]) == ("input", 2)


# -- the store --------------------------------------------------------------------------------


def stored(store: ResponseStore, response_id: str) -> None:
    body = request(input="Hi")
    response = (
        builder(body).response([finished("Hello", "stop")], USAGE).model_copy(update={"id": response_id})
    )
    store.put(response, [])


def test_the_store_keeps_the_newest_entries() -> None:
    store = ResponseStore(max_entries=2)
    for response_id in ("a", "b", "c"):
        stored(store, response_id)
    assert len(store) == 2
    assert store.get("c").response.id == "c" and store.get("b").response.id == "b"
    with pytest.raises(APIError) as info:
        store.get("a", "previous_response_id")
    assert (info.value.status, info.value.info.param, info.value.info.code) == (
        404,
        "previous_response_id",
        "response_not_found",
    )


def test_stored_responses_expire() -> None:
    now = [0.0]
    store = ResponseStore(ttl_seconds=10, clock=lambda: now[0])
    stored(store, "a")
    now[0] = 5.0
    stored(store, "b")
    now[0] = 10.0
    with pytest.raises(APIError):
        store.get("a")
    assert store.get("b").response.id == "b"
    now[0] = 15.0
    assert len(store) == 0


def test_deleting_a_response() -> None:
    store = ResponseStore()
    stored(store, "a")
    store.delete("a")
    with pytest.raises(APIError) as info:
        store.delete("a")
    assert info.value.status == 404
