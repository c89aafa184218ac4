"""Prefix caching through the real server and the official `openai` client (GitHub issue 5):
usage.prompt_tokens_details.cached_tokens, the prefix_cache_* metrics, and --no-prefix-caching.

The shared `server` runs with prefix caching on and yaie's default block size of 16 tokens. The
texts here are used by no other test, so the hits counted below come from these requests alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types import CompletionUsage
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.e2e_helpers import MODEL, Server, start_server

pytestmark = pytest.mark.slow

BLOCK = 16  # `yaie serve --block-size` default; the servers here keep it
MAX_TOKENS = 12

SYSTEM = (
    "You are the front desk of the Harbour View hostel. Check-in is from two in the afternoon until "
    "ten at night, check-out is by eleven in the morning. A bed in the eight-bed dorm costs twenty-two "
    "euros a night, in the four-bed dorm twenty-eight euros, and a private double room seventy euros. "
    "Breakfast is served from seven to ten and costs six euros. Towels can be rented for two euros. "
    "Lockers are free; bring your own padlock or buy one at reception for five euros. The kitchen is "
    "open to guests until eleven at night. Quiet hours start at midnight. Bicycles can be rented by the "
    "day. Answer guests in one or two friendly sentences."
)

Messages = list[dict[str, str]]


@pytest.fixture(scope="module")
def uncached_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with --no-prefix-caching. (The one in test_server_limits.py has it too, but it is
    module-scoped there and stopped by that module's last test.)"""
    server = start_server(tmp_path_factory.mktemp("no-prefix-caching"), "--no-prefix-caching")
    yield server
    assert server.stop() == 0, server.log()


def ask(client: openai.OpenAI, messages: Messages, stream: bool) -> tuple[str, CompletionUsage]:
    """One greedy chat completion: the answer's text and the usage the server reported."""
    args: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        response = client.chat.completions.create(**args)
        assert response.usage is not None
        return response.choices[0].message.content or "", response.usage
    text, usage = "", None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "no usage chunk despite include_usage"
    return text, usage


def cached_tokens(usage: CompletionUsage) -> int:
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None
    return usage.prompt_tokens_details.cached_tokens


def scrape(server: Server) -> dict[str, float]:
    """The server's unlabelled samples by name (counters with their `_total` suffix)."""
    with server.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if not sample.labels
    }


def growth(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before[name]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_second_turn_reuses_the_whole_first_turn(server: Server, client: openai.OpenAI, stream: bool) -> None:
    first_question = "When can I check in?" if stream else "How much is a dorm bed?"
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_question}]
    answer, usage1 = ask(client, turn1, stream)
    assert answer
    turn2 = [
        *turn1,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Is breakfast included?"},
    ]

    before = scrape(server)
    _, usage2 = ask(client, turn2, stream)
    after = scrape(server)

    cached = cached_tokens(usage2)
    # Turn 1's prompt and answer are the start of turn 2's prompt. All of it was computed but the
    # last answer token (sampled, never fed back to the model), so that much, rounded down to whole
    # blocks, comes from the cache.
    history = usage1.prompt_tokens + usage1.completion_tokens
    assert (history - 1) // BLOCK * BLOCK <= cached < usage2.prompt_tokens
    assert cached % BLOCK == 0
    # The metrics saw exactly this request: every prompt token queried, the reported ones hit.
    assert growth(before, after, "prefix_cache_queries_total") == usage2.prompt_tokens
    assert growth(before, after, "prefix_cache_hits_total") == cached


def test_completions_report_cached_tokens(server: Server, client: openai.OpenAI) -> None:
    prompt = f"{SYSTEM}\n\nGuest: Can I rent a bicycle for two days?\nFront desk:"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage is not None
    assert cached_tokens(first.usage) == 0  # nothing else starts with this text
    num_prompt = first.usage.prompt_tokens
    # The cache holds every full block of the prompt; the last prompt token is always recomputed.
    expected = (num_prompt - 1) // BLOCK * BLOCK

    before = scrape(server)
    again = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=4, temperature=0)
    after = scrape(server)

    assert again.usage is not None
    assert again.usage.prompt_tokens == 2 * num_prompt
    assert cached_tokens(again.usage) == 2 * expected  # the sum over the request's prompts
    assert growth(before, after, "prefix_cache_queries_total") == 2 * num_prompt
    assert growth(before, after, "prefix_cache_hits_total") == 2 * expected


def test_hit_rate_gauge_is_hits_over_queries(server: Server, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where do I leave bags?"}]
    for _ in range(2):  # so that this test alone makes the counters nonzero
        ask(client, messages, stream=False)
    samples = scrape(server)
    queries, hits = samples["prefix_cache_queries_total"], samples["prefix_cache_hits_total"]
    assert 0 < hits <= queries
    assert 0 <= samples["prefix_cache_hit_rate"] <= 1
    assert samples["prefix_cache_hit_rate"] == pytest.approx(hits / queries)


def test_no_prefix_caching_reports_no_cached_tokens(uncached_server: Server) -> None:
    client = uncached_server.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is there a kitchen?"}]
    usages = [ask(client, messages, stream) for stream in (False, True, False)]
    prompt = f"{SYSTEM}\n\nGuest: Is there a kitchen?\nFront desk:"
    completions = [
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0) for _ in range(2)
    ]

    assert [cached_tokens(usage) for _, usage in usages] == [0, 0, 0]
    for completion in completions:
        assert completion.usage is not None and cached_tokens(completion.usage) == 0
    samples = scrape(uncached_server)
    assert samples["prefix_cache_queries_total"] > 0
    assert samples["prefix_cache_hits_total"] == 0
    assert samples["prefix_cache_hit_rate"] == 0
