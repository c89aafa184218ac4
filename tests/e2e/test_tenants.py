"""Many clients on one server (issue #38), through the openai client: two API keys, two tenants.
A tenant that floods the queue gets 429s for itself while the other's requests are still taken
and admitted ahead of the flood; neither tenant's prompts hit the other's prefix cache, reads
the other's stored responses or its requests' ids in the engine view; and a key sent in the URL
is refused and kept out of the log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import CompletionUsage

from tests.e2e.e2e_helpers import MODEL, Server, start_server
from tests.e2e.test_server_limits import gauges, wait_for

pytestmark = pytest.mark.slow

FLOOD_KEY, OTHER_KEY = "sk-flood-0123", "sk-other-4567"
# Long enough that no flood request could finish while the test runs: one that was admitted
# before the other tenant's would hold the only slot.
ENDLESS = {"max_tokens": 8000, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("tenants")
    keys = directory / "keys.json"
    keys.write_text(json.dumps({FLOOD_KEY: "flood", OTHER_KEY: "other"}))
    server = start_server(
        directory,
        f"--api-keys-file={keys}",
        "--max-num-seqs=1",  # one request runs at a time...
        "--max-waiting=4",  # ...and each of the two tenants may have two waiting
    )
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=300)


def cached_tokens(usage: CompletionUsage | None) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0


def test_prefix_cache_hits_do_not_cross_tenants(server: Server) -> None:
    messages = [{"role": "user", "content": "Name the planets of the solar system, in order, " * 6}]

    def ask(key: str) -> int:
        answer = client(server, key).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
        return cached_tokens(answer.usage)

    assert ask(FLOOD_KEY) == 0
    assert ask(OTHER_KEY) == 0  # the same prompt, but the other tenant's: computed, not a hit
    assert ask(FLOOD_KEY) > 0


def test_a_tenant_cannot_read_anothers_stored_response(server: Server) -> None:
    flood, other = client(server, FLOOD_KEY), client(server, OTHER_KEY)
    response = flood.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    assert flood.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(
            model=MODEL, input="And?", max_output_tokens=2, previous_response_id=response.id
        )


def test_a_flooding_tenant_gets_429_while_the_other_is_admitted_first(server: Server) -> None:
    flood, other = client(server, FLOOD_KEY), client(server, OTHER_KEY)
    assert wait_for(
        server, lambda metrics: metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0
    )
    running = flood.completions.create(model=MODEL, prompt="Once upon a time", stream=True, **ENDLESS)  # type: ignore[call-overload]
    next(iter(running))  # it runs, in the only slot
    waiting = [
        flood.completions.create(model=MODEL, prompt=f"Chapter {i}", stream=True, **ENDLESS)  # type: ignore[call-overload]
        for i in range(2)
    ]
    assert wait_for(server, lambda metrics: metrics["num_requests_waiting"] == 2)
    # Its share of the queue (half of --max-waiting) is full: its next request is refused...
    with pytest.raises(openai.RateLimitError, match="--max-waiting-per-tenant"):
        flood.completions.create(model=MODEL, prompt="One more", max_tokens=1)
    # ...while the other tenant's is taken, though the queue is not empty.
    theirs = other.completions.create(model=MODEL, prompt="Hello", stream=True, **ENDLESS)  # type: ignore[call-overload]
    assert wait_for(server, lambda metrics: metrics["num_requests_waiting"] == 3)
    running.close()  # the slot frees up: the least-served tenant's request is admitted
    chunks = iter(theirs)
    next(chunks)
    next(chunks)
    # It runs in the only slot, and both flood requests that came before it still wait.
    assert (gauges(server)["num_requests_running"], gauges(server)["num_requests_waiting"]) == (1, 2)
    theirs.close()
    for stream in waiting:
        stream.close()
    assert wait_for(
        server, lambda metrics: metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0
    )


def test_the_engine_view_shows_a_tenant_only_its_own_request_ids(server: Server) -> None:
    flood = client(server, FLOOD_KEY)
    stream = flood.completions.create(model=MODEL, prompt="Once upon a time", stream=True, **ENDLESS)  # type: ignore[call-overload]
    request_id = next(iter(stream)).id
    try:
        states = {}
        for key in (FLOOD_KEY, OTHER_KEY):
            headers = {"Authorization": f"Bearer {key}"}
            states[key] = httpx.get(f"{server.base_url}/engine/state", headers=headers, timeout=60).json()
        assert request_id in {seq["request_id"] for seq in states[FLOOD_KEY]["sequences"]}
        assert request_id not in json.dumps(states[OTHER_KEY])
        assert len(states[OTHER_KEY]["sequences"]) == len(states[FLOOD_KEY]["sequences"])  # the load is shown
    finally:
        stream.close()


def test_a_key_in_the_url_is_refused_and_not_logged(server: Server, tmp_path: Path) -> None:
    response = httpx.get(f"{server.base_url}/v1/models?api_key={OTHER_KEY}", timeout=60)
    assert response.status_code == 401
    assert "not accepted" in response.json()["error"]["message"]
    assert OTHER_KEY not in server.log() and FLOOD_KEY not in server.log()
    assert "api_key=[redacted]" in server.log()
