"""`yaie serve` as a user starts it: the bundled GGUF's Q4_1 weights run as stored (the other e2e
tests run dense weights, see start_server), over the OpenAI API, streamed and not. A small step
budget splits every prompt into chunks, so steps in which no sequence samples occur too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.e2e_helpers import MODEL, Server, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("default")
    server = start_server(log_dir, "--max-num-batched-tokens", "16", quantization=None)
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()


def test_weights_run_as_the_file_stores_them(default_server: Server) -> None:
    with default_server.http() as http:
        version = http.get("/version").json()
    assert version["quantization"] == "Q4_1, Q8_0"  # the bundled file: Q4_1 layers, a Q8_0 LM head
    assert version["kernel_isa"] not in ("none", "")
    assert "quantized kernels" in default_server.log()


def test_chat_streamed_and_not(default_server: Server) -> None:
    client = default_server.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True
        )
        if chunk.choices
    ]
    assert "".join(pieces)
