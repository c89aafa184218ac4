"""A request's `priority` and `timeout` through the official clients: under the default fcfs
policy a priority other than 0 is a 400 (as vLLM); under --scheduling-policy priority it is
accepted; a request past its timeout (its own, or the server's --request-timeout) ends with
finish_reason "timeout" in every API's terms; bad values are 400s in each API's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.e2e.e2e_helpers import MODEL, Server, start_server

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}]
# Far more tokens than the bundled model writes in half a second on any CPU this runs on.
LONG = 1500
CUT_SHORT = {"timeout": 0.5, "ignore_eos": True}


# -- the default server: fcfs, no --request-timeout ---------------------------------------------


def test_fcfs_refuses_a_priority(client: openai.OpenAI) -> None:
    for extra in ({"priority": 1}, {"priority": -2}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=4, extra_body=extra)
        error: Any = info.value.body
        assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4, extra_body=extra)
        assert info.value.body["param"] == "priority"  # type: ignore[index]
    zero = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=4, extra_body={"priority": 0}
    )
    assert zero.choices[0].finish_reason == "length"


def test_a_chat_completion_past_its_timeout_ends_with_timeout(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=LONG, extra_body=CUT_SHORT
    )
    [choice] = response.choices
    assert choice.finish_reason == "timeout"
    assert response.usage is not None and response.usage.completion_tokens < LONG


def test_a_streamed_completion_ends_with_a_timeout_chunk_then_done(server: Server) -> None:
    body = {"model": MODEL, "messages": STORY, "max_tokens": LONG, "stream": True, "n": 2, **CUT_SHORT}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    reasons = [(c["index"], c["finish_reason"]) for c in choices if c["finish_reason"]]
    assert sorted(reasons) == [(0, "timeout"), (1, "timeout")]
    for index in (0, 1):  # a choice's finish chunk is its last
        assert [c for c in choices if c["index"] == index][-1]["finish_reason"] == "timeout"


def test_completions_and_responses_report_the_timeout(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=LONG, extra_body=CUT_SHORT
    )
    assert completion.choices[0].finish_reason == "timeout"
    streamed = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=LONG, stream=True, extra_body=CUT_SHORT
    )
    assert [c.finish_reason for chunk in streamed for c in chunk.choices if c.finish_reason] == ["timeout"]
    response = client.responses.create(
        model=MODEL, input="Tell me a very long story.", max_output_tokens=LONG, extra_body={"timeout": 0.5}
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "timeout"


def test_anthropic_reports_a_timeout_as_max_tokens(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    message = client.messages.create(
        model=MODEL, max_tokens=LONG, messages=STORY, extra_body={"timeout": 0.5}
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens < LONG
    with client.messages.stream(
        model=MODEL, max_tokens=LONG, messages=STORY, extra_body={"timeout": 0.5}
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"


def test_ollama_reports_done_reason_timeout(server: Server) -> None:
    body = {
        "model": MODEL,
        "messages": STORY,
        "stream": False,
        "options": {"num_predict": LONG},
        "timeout": 0.5,
    }
    with server.http() as http:
        whole = http.post("/api/chat", json=body).json()
        lines = [
            json.loads(line)
            for line in http.post("/api/chat", json={**body, "stream": True}).text.splitlines()
        ]
    assert whole["done"] and whole["done_reason"] == "timeout"
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "timeout"


BAD = [
    ({"timeout": -1}, "timeout"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": "5"}, "timeout"),
    ({"priority": 1.5}, "priority"),
    ({"priority": "1"}, "priority"),
    ({"priority": True}, "priority"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_values_are_openai_400s(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    for path, body in [
        ("/v1/chat/completions", {"model": MODEL, "messages": STORY, "max_tokens": 4}),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4}),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4}),
    ]:
        response = http.post(path, json={**body, **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (path, error)


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_values_are_anthropic_and_ollama_400s(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    response = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": STORY, **fields})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(param)
    response = http.post("/api/chat", json={"model": MODEL, "messages": STORY, "stream": False, **fields})
    assert response.status_code == 400, response.text
    assert list(response.json()) == ["error"] and param in response.json()["error"]


# -- a server with --scheduling-policy priority and --request-timeout ----------------------------


@pytest.fixture(scope="module")
def ranked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("ranked"), "--scheduling-policy", "priority", "--request-timeout", "0.5"
    )
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()


def test_the_priority_policy_accepts_priorities(ranked: Server) -> None:
    client = ranked.client()
    for priority in (-10, 0, 3):
        # A timeout of its own replaces the server's default.
        extra = {"priority": priority, "timeout": 600, "ignore_eos": True}
        response = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=6, extra_body=extra)
        assert response.choices[0].finish_reason == "length"
        completion = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3, extra_body=extra)
        assert [c.finish_reason for c in completion.choices] == ["length", "length"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=STORY, max_tokens=4, extra_body={"priority": 0.5}
        )
    assert info.value.body["param"] == "priority"  # type: ignore[index]


def test_the_server_default_timeout_applies_to_requests_without_one(ranked: Server) -> None:
    response = ranked.client().chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=LONG, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].finish_reason == "timeout"
    reply = ollama.Client(host=ranked.base_url, timeout=120).chat(
        model=MODEL, messages=STORY, options={"num_predict": LONG}
    )
    assert reply.done and reply.done_reason == "timeout"
    with ranked.http() as http:
        state = http.get("/engine/state").json()
    assert state["config"]["scheduling_policy"] == "priority"
