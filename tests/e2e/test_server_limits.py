"""A second server, with flags the shared one lacks: an API key, a tiny admission queue, and no
prefix cache. Without the prefix cache an idle server holds no KV blocks at all, which makes
"the disconnected request's blocks were freed" a plain `kv_cache_used_bytes == 0` check
(with it, finished prompts stay cached on purpose, and the baseline would keep moving).

The last test stops this server with SIGTERM in the middle of streams.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.e2e_helpers import MODEL, Server, start_server

pytestmark = pytest.mark.slow

API_KEY = "test-secret"
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("limited"),
        "--no-prefix-caching",
        "--max-num-seqs=1",  # a second request waits while the first runs...
        "--max-waiting=1",  # ...and a third is refused
        api_key=API_KEY,
    )
    yield server
    server.stop()


def gauges(server: Server) -> dict[str, float]:
    with server.http() as http:
        text = http.get("/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_for(server: Server, condition: Callable[[dict[str, float]], bool], timeout: float = 20.0) -> bool:
    """Whether `condition` comes to hold for the metrics within `timeout`. The engine publishes
    its gauges after each step, so they lag a request's HTTP response by up to one step."""
    deadline = time.monotonic() + timeout
    while not condition(gauges(server)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def is_idle(metrics: dict[str, float]) -> bool:
    return (
        metrics["num_requests_running"]
        == metrics["num_requests_waiting"]
        == metrics["kv_cache_used_bytes"]
        == 0
    )


def events(response: httpx.Response) -> Iterator[Any]:
    """The parsed `data:` events of a server-sent event stream, "[DONE]" included."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def until_text(stream: Iterator[Any]) -> Iterator[Any]:
    """Read `stream` up to its first generated text (so the request is surely running), and
    return it to read on. Keep a reference to it: a discarded iterator closes the connection."""
    for event in stream:
        if event != "[DONE]" and event.get("choices") and event["choices"][0].get("text"):
            return stream
    pytest.fail("the stream ended before any text")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_is_required(limited: Server, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")]:
        response = httpx.request(method, limited.base_url + path, headers=headers, json={})
        assert response.status_code == 401
        assert response.json() == {
            "error": {
                "message": "missing or incorrect API key",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }


def test_public_endpoints_need_no_key(limited: Server) -> None:
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(limited.base_url + path).status_code == 200


def test_the_key_opens_the_api(limited: Server) -> None:
    response = limited.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert response.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key="wrong").models.list()


def test_the_key_opens_ollamas_api(limited: Server) -> None:
    # The ollama client sends OLLAMA_API_KEY as a Bearer token.
    keyed = ollama.Client(host=limited.base_url, headers={"Authorization": f"Bearer {API_KEY}"})
    assert keyed.list().models
    with pytest.raises(ollama.ResponseError) as info:
        ollama.Client(host=limited.base_url).list()
    assert info.value.status_code == 401


def test_disconnected_stream_frees_its_blocks(limited: Server) -> None:
    assert wait_for(limited, is_idle)
    with limited.http() as http, http.stream("POST", "/v1/completions", json=LONG) as response:
        stream = until_text(events(response))
        assert wait_for(limited, lambda metrics: metrics["kv_cache_used_bytes"] > 0)
        assert next(stream)  # still streaming
    # Leaving the block closed the connection mid-stream.
    assert wait_for(limited, is_idle)


def test_disconnected_non_streaming_request_frees_its_blocks(limited: Server) -> None:
    body = {**LONG, "stream": False}
    with limited.http() as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert wait_for(limited, is_idle)


def test_too_many_waiting_requests_get_429(limited: Server) -> None:
    with (
        limited.http() as http,
        http.stream("POST", "/v1/completions", json=LONG) as running,
        http.stream("POST", "/v1/completions", json=LONG) as waiting,
    ):
        running_events = until_text(events(running))
        assert waiting.status_code == 200  # accepted, and queued behind `running`
        assert wait_for(limited, lambda metrics: metrics["num_requests_waiting"] == 1)
        refused = http.post("/v1/completions", json={**LONG, "stream": False})
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error.keys() == {"message", "type", "param", "code"}
        assert error["type"] == "rate_limit_error" and error["code"] == "too_many_waiting_requests"
        assert next(running_events)  # the running one was not disturbed
    assert wait_for(limited, is_idle)


def test_sigterm_ends_streams_and_exits_cleanly(limited: Server) -> None:
    ends: list[Any] = []

    def consume(stream: Iterator[Any]) -> None:
        *_, last_event, done = stream
        ends.append((last_event, done))

    with (
        limited.http() as http,
        http.stream("POST", "/v1/completions", json=LONG) as running,
        http.stream("POST", "/v1/completions", json=LONG) as waiting,
    ):
        streams = [until_text(events(running)), events(waiting)]
        readers = [threading.Thread(target=consume, args=(stream,)) for stream in streams]
        for reader in readers:
            reader.start()
        start = time.monotonic()
        assert limited.stop() == 0
        assert time.monotonic() - start < 10
        for reader in readers:
            reader.join(10)
    # Each stream ended properly: an error event saying why, then [DONE].
    assert len(ends) == 2
    for last_event, done in ends:
        assert done == "[DONE]"
        assert last_event["error"]["code"] == "shutting_down"
    assert "Traceback" not in limited.log()
