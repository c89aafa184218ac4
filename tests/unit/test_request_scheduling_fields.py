"""`priority` and `timeout` on every API's request, without a model: each API's body carries them
onto the chat or completion request the server runs, bad values are refused naming the field,
and each API reports a timeout in its own terms."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from yaie.errors import InvalidRequestError
from yaie.outputs import CompletionOutput
from yaie.server import anthropic_protocol as a
from yaie.server import ollama_protocol as o
from yaie.server import protocol as p
from yaie.server import responses_protocol as rp
from yaie.server.anthropic_messages import stop_reason
from yaie.server.responses import _status

HELLO = [{"role": "user", "content": "Hello"}]
FIELDS = {"priority": -2, "timeout": 1.5}


def test_every_api_carries_priority_and_timeout_onto_the_request_it_runs() -> None:
    runs: list[p.SamplingRequest] = [
        p.ChatCompletionRequest.model_validate({"messages": HELLO, **FIELDS}),
        p.CompletionRequest.model_validate({"prompt": "Hi", **FIELDS}),
        a.parse(a.MessagesRequest, a_body(**FIELDS)).to_chat(),
        rp.ResponsesRequest.model_validate({"input": "Hi", **FIELDS}).to_chat([]),
        o.parse(o.ChatRequest, {"model": "m", "messages": HELLO, **FIELDS}).to_openai(),
        o.parse(o.GenerateRequest, {"model": "m", "prompt": "Hi", **FIELDS}).to_openai([1, 2]),
    ]
    for run in runs:
        assert (run.priority, run.timeout) == (-2, 1.5), type(run)
    left_out = p.ChatCompletionRequest.model_validate({"messages": HELLO})
    assert (left_out.priority, left_out.timeout) == (None, None)  # 0, and the server's default


def a_body(**fields: Any) -> bytes:
    """An Anthropic Messages request's body."""
    return json.dumps({"model": "m", "max_tokens": 8, "messages": HELLO, **fields}).encode()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"timeout": -1}, "timeout"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": "5"}, "timeout"),
        ({"priority": 1.5}, "priority"),
        ({"priority": True}, "priority"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        p.ChatCompletionRequest.model_validate({"messages": HELLO, **fields})
    assert info.value.errors()[0]["loc"] == (param,)
    with pytest.raises(InvalidRequestError) as refused:
        a.parse(a.MessagesRequest, a_body(**fields))
    assert refused.value.message.startswith(param)
    with pytest.raises(InvalidRequestError) as refused:
        o.parse(o.ChatRequest, {"model": "m", "messages": HELLO, **fields})
    assert refused.value.param == param
    with pytest.raises(InvalidRequestError) as refused:
        rp.ResponsesRequest.parse(json.dumps({"input": "Hi", **fields}).encode())
    assert refused.value.param == param


def test_each_api_reports_a_timeout_in_its_terms() -> None:
    timed_out = CompletionOutput(index=0, text="Once", token_ids=[1], finish_reason="timeout")
    assert stop_reason(timed_out, None) == ("max_tokens", None)  # Anthropic: the answer was cut short
    assert _status("timeout") == "incomplete" and _status("stop") == "completed"
