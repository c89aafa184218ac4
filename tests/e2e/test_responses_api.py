"""OpenAI's Responses API (/v1/responses) through the official `openai` client, and openai-agents'
default model, against the shared server."""

from __future__ import annotations

import json
from typing import Any

import agents
import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.e2e_helpers import MODEL, Server
from tests.e2e.test_fuzz import floats, ints, junk, texts

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
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
    "strict": True,
}
QUESTION = "What is the capital of France?"
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def rclient(server: Server) -> openai.OpenAI:
    return server.client(timeout=600)  # a grammar may take long to compile on a busy machine


def test_create(rclient: openai.OpenAI) -> None:
    response = rclient.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text.strip()
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0 and 0 < usage.output_tokens <= MAX_TOKENS
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # The same request as a chat completion gives the same greedy text.
    chat = rclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content == response.output_text


def test_instructions_are_a_system_message(rclient: openai.OpenAI) -> None:
    instructions = "Answer in one word."
    response = rclient.responses.create(
        model=MODEL, input=QUESTION, instructions=instructions, max_output_tokens=20, temperature=0
    )
    chat = rclient.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}],
        max_tokens=20,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == instructions


def test_max_output_tokens_makes_it_incomplete(rclient: openai.OpenAI) -> None:
    response = rclient.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=5)
    assert response.status == "incomplete"
    assert (
        response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.usage is not None and response.usage.output_tokens == 5


def test_streamed_events(rclient: openai.OpenAI) -> None:
    whole = rclient.responses.create(model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    events = list(
        rclient.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    types = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in deltas) == whole.output_text
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == whole.output_text and completed.response.usage == whole.usage


def test_stream_helper_final_response(rclient: openai.OpenAI) -> None:
    with rclient.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0
    ) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text and text.strip()


def test_json_schema_text_format(rclient: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    }
    response = rclient.responses.create(
        model=MODEL,
        input="Describe a user of a website as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def function_calls(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}], ids=str)
def test_tool_choice_gives_a_valid_call(rclient: openai.OpenAI, tool_choice: Any) -> None:
    response = rclient.responses.create(
        model=MODEL,
        input="What is the weather like in Paris today?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=tool_choice,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    [call] = function_calls(response)
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[arg-type]


def test_streamed_call(rclient: openai.OpenAI) -> None:
    events = list(
        rclient.responses.create(
            model=MODEL,
            input="What is the weather like in Paris today?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            max_output_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-2]
    assert done.type == "response.output_item.done" and done.item.type == "function_call"
    jsonschema.validate(json.loads(done.item.arguments), WEATHER["parameters"])  # type: ignore[arg-type]


def test_a_function_call_output_continues_the_tool_loop(rclient: openai.OpenAI) -> None:
    question: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = rclient.responses.create(
        model=MODEL,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=MAX_TOKENS,  # type: ignore[list-item]
    )
    [call] = function_calls(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    answer = rclient.responses.create(
        model=MODEL,
        input=[*question, call.model_dump(exclude_none=True), result],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert answer.output_text.strip() and not function_calls(answer)
    # The same conversation through previous_response_id gives the same answer.
    chained = rclient.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],  # type: ignore[list-item]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert chained.output_text == answer.output_text
    assert chained.usage is not None and answer.usage is not None
    assert chained.usage.input_tokens == answer.usage.input_tokens


def test_previous_response_id_continues_the_conversation(rclient: openai.OpenAI) -> None:
    first = rclient.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=20, temperature=0
    )
    second = rclient.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=20,
        temperature=0,
    )
    chat = rclient.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_tokens=20,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content


def test_stored_responses_can_be_read_and_deleted(rclient: openai.OpenAI, server: Server) -> None:
    response = rclient.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=10, metadata={"k": "v"}
    )
    fetched = rclient.responses.retrieve(response.id)
    assert fetched.id == response.id and fetched.output_text == response.output_text
    assert fetched.metadata == {"k": "v"}
    rclient.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve(response.id)
    with server.http() as http:
        error = http.delete(f"/v1/responses/{response.id}")
    assert error.status_code == 404 and error.json()["error"]["code"] == "response_not_found"
    # store=false keeps nothing to continue from.
    unstored = rclient.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5, store=False)
    with pytest.raises(openai.NotFoundError) as info:
        rclient.responses.create(
            model=MODEL, input="More.", previous_response_id=unstored.id, max_output_tokens=5
        )
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ],
)
def test_bad_requests_name_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    with server.http() as http:
        response = http.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param)


def test_not_json_and_unknown_model(server: Server) -> None:
    with server.http() as http:
        not_json = http.post("/v1/responses", content=b"{", headers={"Content-Type": "application/json"})
        unknown = http.post("/v1/responses", json={"model": "gpt-9", "input": "x"})
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_openai_agents_runs_a_function_tool(server: Server) -> None:
    """openai-agents' default model is the Responses API: an Agent calls its tool through it."""
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=600)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="weather",
        instructions="Use the tools to answer.",
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=0),
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
    )
    result = agents.Runner.run_sync(agent, "What is the weather like in Paris?", max_turns=2)
    [city] = calls
    assert result.final_output == f"sunny in {city}"


# -- fuzz: every answer a 2xx or a 4xx with OpenAI's error body (as tests/e2e/test_fuzz.py) -----

parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": texts}
    ),
    max_size=2,
)
items = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
            "content": st.one_of(texts, parts),
        },
        optional={"type": st.sampled_from(["message", "reasoning"])},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": texts, "name": texts, "arguments": texts}
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": texts, "output": st.one_of(texts, parts)}
    ),
    junk,
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "web_search"]),
            "name": st.sampled_from(["f", "get_weather", "bad name"]),
        },
        optional={"parameters": st.one_of(junk, st.just(WEATHER["parameters"])), "strict": junk},
    ),
    max_size=2,
)
text_formats = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "grammar"])},
    optional={"name": texts, "schema": st.one_of(junk, st.just({"type": "object"}), st.just({"type": 5}))},
)
responses_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_output_tokens": st.one_of(st.integers(-1, 3), st.text(max_size=2))},
    optional={
        "input": st.one_of(texts, st.lists(items, max_size=3), junk),
        "instructions": st.one_of(texts, junk),
        "temperature": floats,
        "top_p": floats,
        "stream": st.booleans(),
        "tools": st.one_of(tools, junk),
        "tool_choice": st.one_of(
            st.sampled_from(["auto", "none", "required", "sometimes"]),
            st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g"])}),
            junk,
        ),
        "text": st.one_of(st.fixed_dictionaries({"format": text_formats}), junk),
        "store": junk,
        "previous_response_id": st.one_of(texts, junk),
        "metadata": st.one_of(st.dictionaries(texts, st.one_of(texts, ints), max_size=2), junk),
        "parallel_tool_calls": junk,
        "user": junk,
    },
)


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=responses_bodies)
def test_no_responses_request_gets_a_5xx(http: httpx.Client, body: dict[str, Any]) -> None:
    content = json.dumps(body).encode()  # NaN, Infinity and lone surrogates as a client may send them
    response = http.post("/v1/responses", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    elif body.get("stream"):
        last = response.text.strip().split("\n\n")[-1]
        assert last.startswith(("event: response.completed", "event: response.incomplete")), (
            body,
            response.text,
        )
