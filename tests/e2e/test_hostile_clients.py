"""Requests a hostile client would send, from issue #11: each is refused or contained on its
own, and the server (and the client's keep-alive connection) goes on serving."""

from __future__ import annotations

import httpx
import pytest
from e2e_helpers import MODEL, Server

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
