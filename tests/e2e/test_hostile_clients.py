"""Requests a hostile client would send, from issue #11: each is refused or contained on its
own, and the server (and the client's keep-alive connection) goes on serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.e2e_helpers import MODEL, Server, start_server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def local_port(response: httpx.Response) -> int:
    """The client's port of the connection that carried `response`."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


# A lone surrogate can only arrive as a JSON escape: it cannot be encoded as UTF-8.
SURROGATES = [
    ("prompt", COMPLETIONS, b'{"model": "smol", "prompt": "Hi \\ud800", "max_tokens": 2}'),
    ("prompt[1]", COMPLETIONS, b'{"model": "smol", "prompt": ["Hi", "\\udfff"], "max_tokens": 2}'),
    ("stop", COMPLETIONS, b'{"model": "smol", "prompt": "Hi", "stop": "\\ud800", "max_tokens": 2}'),
    (
        "messages[0].content",
        CHAT,
        b'{"model": "smol", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    ),
    ("prompt", "/tokenize", b'{"prompt": "\\ud800"}'),
    ("messages[0].content", "/tokenize", b'{"messages": [{"role": "user", "content": "a\\udbff"}]}'),
]


@pytest.mark.parametrize(
    ("param", "path", "body"), SURROGATES, ids=[f"{p} {path}" for p, path, _ in SURROGATES]
)
def test_lone_surrogate_is_a_400_and_the_connection_stays(
    server: Server, param: str, path: str, body: bytes
) -> None:
    with server.http() as http:
        refused = http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
        assert "lone surrogate" in refused.json()["error"]["message"]
        good = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert good.status_code == 200, good.text
        assert local_port(good) == local_port(refused)  # the same keep-alive connection


API_KEY = "test-secret"
MAX_REQUEST_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("hostile"),
        f"--max-request-bytes={MAX_REQUEST_BYTES}",
        "--max-seqs-per-request=8",
        "--max-waiting=6",
        "--default-max-tokens=5",
        api_key=API_KEY,
    )
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.log()


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)


def test_body_over_the_declared_limit_is_413(limited: Server) -> None:
    body = {"model": MODEL, "prompt": "a " * MAX_REQUEST_BYTES, "max_tokens": 1}
    with limited.http() as http:
        assert_error(http.post(COMPLETIONS, json=body), 413, None, "request_too_large")


def test_chunked_body_over_the_limit_is_413(limited: Server) -> None:
    """Without a Content-Length, the body is counted as it arrives."""

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "smol", "max_tokens": 1, "prompt": "'
        for _ in range(2 * MAX_REQUEST_BYTES // 1024):
            yield b"a " * 512
        yield b'"}'

    with limited.http() as http:
        assert_error(http.post(COMPLETIONS, content=chunks()), 413, None, "request_too_large")


@pytest.mark.parametrize(
    ("path", "field"), [(COMPLETIONS, "prompt"), ("/tokenize", "prompt"), (CHAT, "messages")]
)
def test_prompt_too_long_to_fit_is_refused_before_tokenizing(limited: Server, path: str, field: str) -> None:
    text = "a " * 70_000  # under the byte limit, over 16 characters per token of the 8192 context
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    body |= {"messages": [{"role": "user", "content": text}]} if field == "messages" else {"prompt": text}
    with limited.http() as http:
        response = http.post(path, json=body)
    assert_error(response, 400, field)
    assert "characters" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "Hi", "n": 9},
        {"prompt": ["Hi"] * 5, "n": 2},
        {"prompt": ["Hi"] * 9},
        {"prompt": "Hi", "n": 7},  # within the per-request cap, but more than may ever wait
    ],
)
def test_too_many_sequences_in_one_request_is_400(limited: Server, body: dict[str, Any]) -> None:
    with limited.http() as http:
        assert_error(http.post(COMPLETIONS, json={"model": MODEL, "max_tokens": 1, **body}), 400, "n")


def test_default_max_tokens(limited: Server) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True}
    with limited.http() as http:
        response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
    assert response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_bearer_scheme_is_case_insensitive(limited: Server, scheme: str) -> None:
    response = httpx.get(f"{limited.base_url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", API_KEY, f"Basic {API_KEY}"])
def test_401_says_how_to_authenticate(limited: Server, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.get(f"{limited.base_url}/v1/models", headers=headers)
    assert_error(response, 401, None, "invalid_api_key")
    assert response.headers["WWW-Authenticate"] == "Bearer"
