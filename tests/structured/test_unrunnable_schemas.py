"""Schemas and grammars the grammar library cannot run: refused when compiled, before anything
reaches the engine, with a 400 that names the field and the limit in a sentence (never the
parser's state); and one that meets a limit only once it runs fails that request alone, with the
same kind of sentence, as the client's error (not a 500, no traceback in the server's log).

The compiler's own tests need only the tokenizer; the rest go through the shared server."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.e2e_helpers import MODEL, Server
from yaie.structured.backend import GrammarCompiler, GrammarError
from yaie.structured.spec import StructuredOutputs

STRING = {"type": "string"}


def optional(count: int, prefix: str = "p") -> dict[str, Any]:
    return {f"{prefix}{i}": STRING for i in range(count)}


def obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = obj({"a": schema}, ("a",))
    return schema


def anyof_objects(count: int, width: int) -> dict[str, Any]:
    return {"anyOf": [obj(optional(width, f"o{j}_")) for j in range(count)]}


# name -> (the structured_outputs field, its value, what the message must say of the limit)
ROW_LIMIT = r"expect [\d,]+ items at once, over the library's limit of 2,000"
CORPUS: dict[str, tuple[str, Any, str]] = {
    "2000 optional properties": ("json", obj(optional(2000)), ROW_LIMIT),
    "1000 optional properties": ("json", obj(optional(1000)), ROW_LIMIT),
    "anyOf of 50 objects x 40 properties": ("json", anyof_objects(50, 40), ROW_LIMIT),
    "after a required property": (
        "json", obj({"id": {"type": "integer"}, **optional(1000)}, ("id",)), ROW_LIMIT
    ),
    "an optional wide property": (
        "json",
        obj({"title": STRING, "extra": obj(optional(1000))}),
        rf"part at #/properties/extra .*{ROW_LIMIT}",
    ),
    "array items of a wide anyOf": (
        "json",
        obj({"list": {"type": "array", "items": anyof_objects(50, 40)}}, ("list",)),
        rf"part at #/properties/list/items .*{ROW_LIMIT}",
    ),
    "a wide definition": (
        "json",
        {
            "$defs": {"Big": obj(optional(800))},
            **obj({"n": {"type": "integer"}, "big": {"$ref": "#/$defs/Big"}}),
        },
        rf"part at #/\$defs/Big .*{ROW_LIMIT}",
    ),
    "nesting 70 deep": ("json", nested(70), "at most 128 levels deep"),
    "nesting 5000 deep, as text": (
        "json", '{"items": ' * 5000 + "{}" + "}" * 5000, "at most 128 levels deep"
    ),
    "17000 properties": (
        "json",
        obj({f"k{i}": {"type": "integer"} for i in range(17000)}, tuple(f"k{i}" for i in range(17000))),
        "more than the 50,000 parts",
    ),
    "a grammar of 3000 alternatives": (
        "grammar",
        "start: " + " | ".join(f"r{i}" for i in range(3000)) + "\n"
        + "\n".join(f'r{i}: "x" "{i}"' for i in range(3000)),
        ROW_LIMIT,
    ),
}  # fmt: skip
# What the library's errors carry besides their first line: the parser's state and statistics.
INTERNALS = ("<state>", "non-verbose", "compute_time_us", "Parser Error", "Current row", "lexer_cost", "\n")
# A limit the admission walk does not reach: the 40 characters of the required string come first
# (more tokens than the walk takes), and the optional properties' items pile up only after them.
MIDWAY = obj({"code": {"type": "string", "minLength": 40, "maxLength": 40}, **optional(1500)}, ("code",))


def assert_told(message: str, param: str, limit: str) -> None:
    """A sentence naming the field and the limit, with nothing of the library's internals."""
    assert message.startswith(f"{param}: ")
    assert re.search(limit, message), message
    assert not any(internal in message for internal in INTERNALS), message


# -- the compiler ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CORPUS)
def test_compiling_refuses_what_the_library_cannot_run(compiler: GrammarCompiler, name: str) -> None:
    field, value, limit = CORPUS[name]
    with pytest.raises(GrammarError) as info:
        compiler.compile(StructuredOutputs(**{field: value}), param="response_format")
    assert info.value.param == "response_format"
    assert_told(info.value.message, "response_format", limit)


@pytest.mark.parametrize(
    "schema",
    [obj(optional(100)), anyof_objects(10, 20), nested(40), MIDWAY],
    ids=["100 optional properties", "anyOf of 10 objects x 20", "nesting 40 deep", "midway"],
)
def test_wide_schemas_within_the_limits_compile(compiler: GrammarCompiler, schema: dict[str, Any]) -> None:
    compiler.compile(StructuredOutputs(json=schema))


def test_a_limit_met_midway_is_the_clients_error(compiler: GrammarCompiler, tokenizer: Any) -> None:
    matcher = compiler.compile(StructuredOutputs(json=MIDWAY)).matcher()
    text = '{"code": "' + "x" * 40 + '"'
    accepted = [matcher.accept(token) for token in tokenizer(text, add_special_tokens=False).input_ids]
    assert accepted[-1] is False and all(accepted[:-1])  # the closing quote meets the limit
    failure = matcher.failure()
    assert isinstance(failure, GrammarError) and failure.param == "structured_outputs"
    assert_told(failure.message, "structured_outputs", ROW_LIMIT)


# -- through the server ---------------------------------------------------------------------------


def engine_counters(http: httpx.Client) -> dict[str, float]:
    """The engine's step counters from /metrics, once nothing runs or waits."""
    deadline = time.monotonic() + 30
    while True:
        metrics = {}
        for line in http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                metrics[name] = float(value)
        if metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0:
            return {name: value for name, value in metrics.items() if name.startswith("engine_")}
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.1)


def bodies(field: str, value: Any) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, the field the error names): the constraint through each route to it."""
    routes = [("/v1/completions", {**COMPLETION, "structured_outputs": {field: value}}, "structured_outputs")]
    if field == "json" and isinstance(value, dict):  # response_format takes a schema as an object only
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}
        chat = {**CHAT, "response_format": response_format}
        routes.append(("/v1/chat/completions", chat, "response_format"))
    return routes


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 8}
# A tool whose call must be made: its parameters are the call's schema. (600 properties, so that
# the tool's definition still fits the prompt.)
WIDE_PARAMETERS = obj(optional(600))
WIDE_TOOL = {"type": "function", "function": {"name": "wide", "parameters": WIDE_PARAMETERS}}


def test_the_server_refuses_them_before_the_engine_sees_them(server: Server) -> None:
    log_before = len(server.log())
    requests = [
        (name, *route) for name, (field, value, _) in CORPUS.items() for route in bodies(field, value)
    ]
    with server.http() as http:
        before = engine_counters(http)
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda request: http.post(request[1], json=request[2]), requests))
            # A required call of a tool too wide to run, through OpenAI's API and Anthropic's.
            tool_call = http.post(
                "/v1/chat/completions", json={**CHAT, "tools": [WIDE_TOOL], "tool_choice": "required"}
            )
            anthropic_tool_use = http.post(
                "/v1/messages",
                json={
                    **CHAT,
                    "tools": [{"name": "wide", "input_schema": WIDE_PARAMETERS}],
                    "tool_choice": {"type": "any"},
                },
            )
        after = engine_counters(http)
    for (name, path, _, param), response in zip(requests, responses, strict=True):
        assert response.status_code == 400, (name, path, response.text)
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param), (name, path)
        assert_told(error["message"], param, CORPUS[name][2])
    assert tool_call.status_code == 400, tool_call.text
    assert tool_call.json()["error"]["param"] == "tools"
    assert_told(tool_call.json()["error"]["message"], "tools", ROW_LIMIT)
    assert anthropic_tool_use.status_code == 400, anthropic_tool_use.text
    assert anthropic_tool_use.json()["error"]["type"] == "invalid_request_error"
    assert_told(anthropic_tool_use.json()["error"]["message"], "tool_choice", ROW_LIMIT)
    assert after == before  # not one step: no request reached the engine
    added = server.log()[log_before:]
    assert "Traceback" not in added and "ERROR" not in added


def test_a_limit_met_midway_fails_the_request_as_the_clients(sclient: openai.OpenAI, server: Server) -> None:
    log_before = len(server.log())
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": MIDWAY}}
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A code, please."}],
        "response_format": response_format,
        "max_tokens": 100,
        # Sampled: a greedy choice happens to write the string's closing quote together with the
        # object's `}` as one token, which the library takes without meeting its limit.
        "temperature": 1.0,
        "seed": 2,
        "n": 2,
    }
    with pytest.raises(openai.BadRequestError) as refused:
        sclient.chat.completions.create(**args)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "response_format"
    assert_told(error["message"], "response_format", ROW_LIMIT)
    # Streamed, the failure comes after the 200, as the stream's last event.
    with (
        server.http() as http,
        http.stream("POST", "/v1/chat/completions", json={**args, "stream": True}) as stream,
    ):
        assert stream.status_code == 200
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed_error = json.loads(events[-2])["error"]
    assert (streamed_error["type"], streamed_error["param"]) == ("invalid_request_error", "response_format")
    assert_told(streamed_error["message"], "response_format", ROW_LIMIT)
    added = server.log()[log_before:]
    assert "Traceback" not in added and "ERROR" not in added
    assert "failed on its input" in added  # told once, as a warning
