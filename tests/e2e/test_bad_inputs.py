"""Every kind of bad request gets the right status and OpenAI's error body, and the server
keeps serving afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.e2e.e2e_helpers import MODEL, Server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


@dataclass
class Case:
    id: str
    path: str
    body: Any  # JSON-encoded unless it is bytes
    param: str | None
    status: int = 400
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"


CASES = [
    Case("max_tokens wrong type", CHAT, chat(max_tokens="10"), "max_tokens"),
    Case("temperature wrong type", CHAT, chat(temperature="hot"), "temperature"),
    Case("stream wrong type", CHAT, chat(stream="yes"), "stream"),
    Case("n=0", CHAT, chat(n=0), "n"),
    Case("n too large", CHAT, chat(n=1000), "n"),
    Case("temperature=-1", CHAT, chat(temperature=-1), "temperature"),
    Case("top_p=2", CHAT, chat(top_p=2), "top_p"),
    Case("top_k=-2", CHAT, chat(top_k=-2), "top_k"),
    Case("min_p=1.5", CHAT, chat(min_p=1.5), "min_p"),
    Case("presence_penalty=3", CHAT, chat(presence_penalty=3), "presence_penalty"),
    Case("frequency_penalty wrong type", CHAT, chat(frequency_penalty=[1]), "frequency_penalty"),
    Case("repetition_penalty=0", CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    Case("min_tokens > max_tokens", CHAT, chat(min_tokens=10), "min_tokens"),
    Case("seed=-1", CHAT, chat(seed=-1), "seed"),
    Case("top_logprobs=21", CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), "top_logprobs"),
    Case("completions logprobs=21", COMPLETIONS, completion(logprobs=21), "logprobs"),
    Case("17 stop strings", CHAT, chat(stop=[f"s{i}" for i in range(17)]), "stop"),
    Case("empty stop string", CHAT, chat(stop=[""]), "stop"),
    Case("stop_token_ids=[-1]", CHAT, chat(stop_token_ids=[-1]), "stop_token_ids"),
    Case("logit_bias key not a token id", CHAT, chat(logit_bias={"abc": 1}), "logit_bias"),
    Case("logit_bias key beyond the vocabulary", CHAT, chat(logit_bias={"99999999": 1}), "logit_bias"),
    Case("logit_bias value=200", CHAT, chat(logit_bias={"42": 200}), "logit_bias"),
    Case("empty messages", CHAT, chat(messages=[]), "messages"),
    Case("messages not a list", CHAT, chat(messages="Hello"), "messages"),
    Case("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    Case("message without content", CHAT, chat(messages=[{"role": "user"}]), "messages[0].content"),
    Case(
        "image content",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages[0].content[0].type",
    ),
    Case("model not a string", CHAT, chat(model=5), "model"),
    Case("unknown model", CHAT, chat(model="gpt-17"), "model", status=404),
    Case("max_tokens beyond the context", CHAT, chat(max_tokens=10**6), "max_tokens"),
    Case(
        "max_completion_tokens beyond the context",
        CHAT,
        chat(max_completion_tokens=10**6),
        "max_completion_tokens",
    ),
    Case("prompt beyond the context", COMPLETIONS, completion(prompt=[42] * 9000, max_tokens=None), "prompt"),
    Case("tools not a list", CHAT, chat(tools={"type": "function", "function": {"name": "f"}}), "tools"),
    Case("response_format unknown", CHAT, chat(response_format={"type": "yaml"}), "response_format.type"),
    Case(
        "stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), "stream_options"
    ),
    Case("best_of=3", COMPLETIONS, completion(best_of=3), "best_of"),
    Case("suffix", COMPLETIONS, completion(suffix="!"), "suffix"),
    Case("empty prompt", COMPLETIONS, completion(prompt=""), "prompt"),
    Case("empty prompt list", COMPLETIONS, completion(prompt=[]), "prompt"),
    Case("prompt of another type", COMPLETIONS, completion(prompt=5), "prompt"),
    Case("prompt token id beyond the vocabulary", COMPLETIONS, completion(prompt=[99999999]), "prompt"),
    Case("mixed prompt list", COMPLETIONS, completion(prompt=["a", 1]), "prompt[1]"),
    Case("malformed JSON", CHAT, b'{"model": "smol", "messages": [', None),
    Case("body not an object", CHAT, [1, 2, 3], None),
    Case("empty body", CHAT, b"", None),
    Case("wrong content type", CHAT, b"model=smol", None, headers={"Content-Type": "text/plain"}),
    Case("tokenize with neither prompt nor messages", "/tokenize", {"model": MODEL}, "prompt"),
    Case("detokenize a negative id", "/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens"),
    Case("unknown path", "/v1/engines", None, None, status=404, method="GET"),
    Case("wrong method", CHAT, None, None, status=405, method="GET"),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_request(server: Server, case: Case) -> None:
    kwargs: dict[str, Any] = {"headers": case.headers}
    if isinstance(case.body, bytes):
        kwargs["content"] = case.body
        kwargs["headers"] = {"Content-Type": "application/json", **case.headers}
    elif case.body is not None:
        kwargs["json"] = case.body
    with server.http() as http:
        response = http.request(case.method, case.path, **kwargs)
    assert response.status_code == case.status, response.text
    body = response.json()
    assert body.keys() == {"error"}
    error = body["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == case.param
    assert error["code"] == ("model_not_found" if case.status == 404 and case.param == "model" else None)


def test_server_still_serves_after_bad_requests(server: Server) -> None:
    with server.http() as http:
        response = http.post(CHAT, json=chat())
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
        assert http.get("/health").status_code == 200
