"""Anthropic's Messages API through the official `anthropic` client against a real server: whole
and streamed messages, the system prompt, stop sequences and max_tokens as stop reasons, tool
calls that validate against their schema (stop sequences never cut them) and a tool result that
continues the conversation, count_tokens, bad requests as Anthropic's errors, and the x-api-key
header."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import MessageParam, TextBlock, ToolUseBlock
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.e2e_helpers import MODEL, Server, start_server

pytestmark = pytest.mark.slow

API_KEY = "anthropic-secret"
# The client has no sampling parameters of its own any more (Anthropic's newer models fix them);
# the API still takes them, as older clients send them.
GREEDY = {"temperature": 0}
HELLO: list[MessageParam] = [{"role": "user", "content": "Write a short poem about the sea."}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "The current weather in a city.", "input_schema": WEATHER_SCHEMA},
    {
        "name": "get_time",
        "description": "The local time in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
]
WEATHER_QUESTION: list[MessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def aclient(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if isinstance(block, TextBlock))


def test_a_whole_message(aclient: anthropic.Anthropic) -> None:
    message = aclient.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    [block] = message.content
    assert isinstance(block, TextBlock) and block.text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert 0 < message.usage.output_tokens <= 24
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 5


def test_the_stream_gives_the_same_message(aclient: anthropic.Anthropic) -> None:
    whole = aclient.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY)
    with aclient.messages.stream(model=MODEL, max_tokens=24, messages=HELLO, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    total = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert total == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_the_raw_events_come_in_anthropics_order(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": HELLO, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        response = http.post("/v1/messages", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    names = []
    for event in response.text.strip().split("\n\n"):
        name_line, data_line = event.split("\n")
        name = name_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_the_system_prompt_reaches_the_model(aclient: anthropic.Anthropic) -> None:
    # (Without one, the template writes its own default system prompt: no count to compare.)
    counts = [
        aclient.messages.count_tokens(model=MODEL, messages=HELLO, system=system).input_tokens
        for system in (
            "You are a pirate.",
            [{"type": "text", "text": "You are a pirate."}],
            "You are a pirate who sails the seven seas.",
        )
    ]
    assert counts[0] == counts[1] < counts[2]
    plain = aclient.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body=GREEDY)
    pirate = aclient.messages.create(
        model=MODEL, max_tokens=16, messages=HELLO, extra_body=GREEDY, system="You are a pirate. Say arr."
    )
    assert text_of(plain) != text_of(pirate)


def test_a_stop_sequence_ends_the_message(aclient: anthropic.Anthropic) -> None:
    free = aclient.messages.create(model=MODEL, max_tokens=40, messages=HELLO, extra_body=GREEDY)
    text = text_of(free)
    words = text.split()
    assert len(words) > 3, text
    stop = words[3]
    stopped = aclient.messages.create(
        model=MODEL, max_tokens=40, messages=HELLO, extra_body=GREEDY, stop_sequences=["@@never@@", stop]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text.startswith(text_of(stopped)) and stop not in text_of(stopped)
    with aclient.messages.stream(
        model=MODEL, max_tokens=40, messages=HELLO, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == (
        "stop_sequence",
        stop,
        text_of(stopped),
    )


def test_max_tokens_ends_the_message(aclient: anthropic.Anthropic) -> None:
    message = aclient.messages.create(model=MODEL, max_tokens=3, messages=HELLO, extra_body=GREEDY)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=str)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_call_is_a_valid_tool_use(
    aclient: anthropic.Anthropic, tool_choice: Any, stream: bool
) -> None:
    for sampling in (GREEDY, {"temperature": 1.0, "top_p": 0.95, "top_k": 50}):
        request: dict[str, Any] = dict(
            model=MODEL,
            max_tokens=80,
            messages=WEATHER_QUESTION,
            tools=TOOLS,
            tool_choice=tool_choice,
            # Each occurs inside the call's JSON: no stop sequence cuts a constrained answer.
            stop_sequences=['"', ",", ":", "}", " "],
            extra_body=sampling,
        )
        if stream:
            with aclient.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = aclient.messages.create(**request)
        assert message.stop_reason == "tool_use", message
        [call] = [block for block in message.content if isinstance(block, ToolUseBlock)]
        assert call.id and call.type == "tool_use"
        if tool_choice["type"] == "tool":
            assert call.name == "get_weather"
        schema = next(tool["input_schema"] for tool in TOOLS if tool["name"] == call.name)
        jsonschema.validate(call.input, schema)


def test_a_tool_result_continues_the_conversation(aclient: anthropic.Anthropic) -> None:
    first = aclient.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    [call] = [block for block in first.content if isinstance(block, ToolUseBlock)]
    result: MessageParam = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 degrees."}],
    }
    conversation: list[MessageParam] = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},  # type: ignore[misc]
        result,
    ]
    without_result = aclient.messages.count_tokens(
        model=MODEL, messages=[*conversation[:2], {"role": "user", "content": "ok"}], tools=TOOLS
    )
    with_result = aclient.messages.count_tokens(model=MODEL, messages=conversation, tools=TOOLS)
    assert with_result.input_tokens > without_result.input_tokens
    answer = aclient.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=conversation,
        tools=TOOLS,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert text_of(answer).strip()
    assert not [block for block in answer.content if isinstance(block, ToolUseBlock)]


def test_count_tokens_counts_the_prompt_a_message_reads(aclient: anthropic.Anthropic) -> None:
    counted = aclient.messages.count_tokens(model=MODEL, messages=HELLO, system="Be brief.")
    message = aclient.messages.create(model=MODEL, max_tokens=4, messages=HELLO, system="Be brief.")
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    with_tools = aclient.messages.count_tokens(model=MODEL, messages=HELLO, system="Be brief.", tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
        ({"tool_choice": {"type": "required"}, "tools": TOOLS}, "tool_choice.type"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"extra_body": {"temperature": -2}}, "temperature"),
        ({"extra_body": {"top_k": "many"}}, "top_k"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
                ]
            },
            "messages[0].content[0].type",
        ),
    ],
)
def test_bad_requests_are_invalid_request_errors(
    aclient: anthropic.Anthropic, fields: Any, param: str
) -> None:
    request = {"model": MODEL, "max_tokens": 8, "messages": HELLO, **fields}
    with pytest.raises(anthropic.BadRequestError) as info:
        aclient.messages.create(**request)
    assert info.value.status_code == 400
    body: Any = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(param)


def test_missing_max_tokens_is_an_invalid_request_error(aclient: anthropic.Anthropic) -> None:
    # messages.create checks its required arguments itself: send the body as it is.
    with pytest.raises(anthropic.BadRequestError) as info:
        aclient.post(
            "/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": HELLO}
        )
    body: Any = info.value.body
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: missing required parameter"},
    }


def test_bad_bodies_get_anthropics_error_shape(server: Server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        missing = http.post("/v1/messages", json={"model": MODEL, "messages": HELLO})
        not_json = http.post(
            "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
        )
        count_bad = http.post("/v1/messages/count_tokens", json={"messages": "Hi"})
        wrong_method = http.get("/v1/messages")
    for response in (missing, not_json, count_bad):
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert missing.json()["error"]["message"] == "max_tokens: missing required parameter"
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"


def test_an_unknown_model_is_not_found(aclient: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        aclient.messages.create(model="claude-nope", max_tokens=8, messages=HELLO)
    body: Any = info.value.body
    assert body["error"]["type"] == "not_found_error" and "claude-nope" in body["error"]["message"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("anthropic-key"), api_key=API_KEY)
    yield server
    assert server.stop() == 0, server.log()


def test_x_api_key_is_accepted_like_bearer(keyed: Server) -> None:
    for client in (
        anthropic.Anthropic(base_url=keyed.base_url, api_key=API_KEY, max_retries=0),  # x-api-key
        anthropic.Anthropic(base_url=keyed.base_url, auth_token=API_KEY, max_retries=0),  # Bearer
    ):
        assert client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=keyed.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=HELLO
        )
    body: Any = info.value.body
    assert body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or incorrect API key"},
    }
    with httpx.Client(base_url=keyed.base_url, timeout=60) as http:  # and the OpenAI routes take it too
        models = http.get("/v1/models", headers={"x-api-key": API_KEY})
        refused = http.get("/v1/models", headers={"x-api-key": "wrong"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


# -- fuzz: every body, valid or not, gets a 2xx or a 4xx in Anthropic's error shape ---------------

texts = st.text(st.characters(codec=None), max_size=30)  # lone surrogates and control characters too
junk = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), texts)
schemas = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    st.just({"type": "nope"}),
    st.just({"$ref": "#/$defs/missing"}),
    st.dictionaries(texts, junk, max_size=2),
)
blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(texts, junk)}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": texts, "name": texts, "input": st.one_of(schemas, junk)}
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": texts},
        optional={
            "content": st.one_of(
                texts,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
                junk,
            ),
            "is_error": junk,
        },
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "video", 3])}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": texts, "signature": texts}),
)
anthropic_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "x"]),
            "content": st.one_of(texts, st.lists(blocks, max_size=3), junk),
        }
    ),
    max_size=3,
)
anthropic_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": anthropic_messages},
    optional={
        "max_tokens": st.one_of(st.integers(-1, 3), st.just(10**9), junk),
        "system": st.one_of(
            texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2), junk
        ),
        "temperature": st.one_of(st.floats(), junk),
        "top_p": st.one_of(st.floats(), junk),
        "top_k": st.one_of(st.integers(-2, 5), junk),
        "stop_sequences": st.one_of(st.lists(texts, max_size=2), junk),
        "stream": st.booleans(),
        "metadata": st.one_of(st.fixed_dictionaries({"user_id": texts}), junk),
        "thinking": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                optional={"budget_tokens": st.one_of(st.integers(-1, 2048), junk)},
            ),
            junk,
        ),
        "tools": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "name": st.one_of(st.sampled_from(["f", "get_weather"]), texts),
                        "input_schema": st.one_of(schemas, junk),
                    },
                    optional={"description": texts, "type": st.sampled_from(["custom", "bash_20250124"])},
                ),
                max_size=2,
            ),
            junk,
        ),
        "tool_choice": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "required"])},
                optional={"name": st.one_of(st.sampled_from(["f", "get_weather"]), texts)},
            ),
            junk,
        ),
    },
)


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=anthropic_bodies, count=st.booleans())
def test_no_messages_request_gets_a_5xx(server: Server, body: dict[str, Any], count: bool) -> None:
    path = "/v1/messages/count_tokens" if count else "/v1/messages"
    content = json.dumps(body).encode()  # NaN, Infinity and lone surrogates as sent
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] in (
            "invalid_request_error",
            "not_found_error",
        )
        assert error["error"]["message"]
    elif body.get("stream"):
        assert response.text.rstrip().endswith('data: {"type":"message_stop"}'), (body, response.text)
    elif not count:
        assert response.json()["type"] == "message"
