"""The chat page and the engine view in a real headless Chromium, driven by Playwright.

Chromium is Debian's (`apt-get install chromium`, as .ci/run does): Playwright's own browser
downloads are not used. The run also writes screenshots of both pages to docs/img/.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.e2e.e2e_helpers import MODEL, Server, start_server
from yaie.engine.snapshot import SCHEMA_VERSION

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "img"
ANSWER_TIMEOUT_MS = 400_000  # the machine may be busy: answers have come at 0.6 tok/s
API_KEY = "web-test-key"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page, with nothing in localStorage."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    yield page
    context.close()


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def engine_state(server: Server) -> dict[str, Any]:
    with server.http() as http:
        response = http.get("/engine/state")
        response.raise_for_status()
        return response.json()


def set_settings(page: Page, **fields: str) -> None:
    page.click("#settings summary")
    for field, value in fields.items():
        page.fill(f"#{field}", value)


def ask(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def last_answer(page: Page) -> Any:
    return page.locator(".message.assistant").last


class BackgroundStream:
    """A streamed completion read on another thread, so that the test can look at the engine
    while it runs; `close()` stops it (the server then aborts the request)."""

    def __init__(self, client: openai.OpenAI, prompt: str, max_tokens: int) -> None:
        self.stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        self.request_id: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with self.stream:  # leaving it closes the connection
            for chunk in self.stream:
                self.request_id = chunk.id
                if self._stop.is_set():
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


# -- the chat page -----------------------------------------------------------------------------


def test_chat_streams_the_greedy_answer_of_the_api(page: Page, server: Server, client: openai.OpenAI) -> None:
    question = "Write a short Python function that adds two numbers."
    page.goto(f"{server.base_url}/")
    set_settings(page, temperature="0", **{"max-tokens": "64"})
    ask(page, question)
    # Part of the answer shows before all of it: it streams.
    page.wait_for_function(
        "document.querySelector('.message.assistant.streaming')?.dataset.text.length > 0",
        timeout=ANSWER_TIMEOUT_MS,
    )
    answer = page.locator(".message.assistant.done").last
    expect(answer).to_be_visible(timeout=ANSWER_TIMEOUT_MS)
    expected = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=64
    )
    assert answer.get_attribute("data-text") == expected.choices[0].message.content
    if "```" in (expected.choices[0].message.content or ""):
        assert answer.locator("pre code").count() >= 1  # the code block is rendered as one
    stats = answer.locator(".stats").inner_text()
    assert "tok/s" in stats and "TTFT" in stats and "prompt tokens cached" in stats
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "chat.png")


def test_chat_keeps_the_conversation_and_sends_it_whole(page: Page, server: Server) -> None:
    page.goto(f"{server.base_url}/")
    set_settings(page, temperature="0", **{"max-tokens": "8", "system-prompt": "You are terse."})
    ask(page, "Say hello.")
    expect(page.locator(".message.assistant.done")).to_have_count(1, timeout=ANSWER_TIMEOUT_MS)
    ask(page, "Again.")
    expect(page.locator(".message.assistant.done")).to_have_count(2, timeout=ANSWER_TIMEOUT_MS)
    # The second request carried the first exchange: its prompt's start was in the prefix cache.
    stats = last_answer(page).locator(".stats").inner_text()
    cached = int(stats.split(" of ")[0].split("·")[-1])
    assert cached > 0, stats
    page.reload()  # conversations live in the browser
    expect(page.locator(".message")).to_have_count(4)
    expect(page.locator("#conversations li")).to_have_count(1)


def test_stop_aborts_the_request_on_the_server(page: Page, server: Server) -> None:
    page.goto(f"{server.base_url}/")
    set_settings(page, temperature="0", **{"max-tokens": "2000"})
    ask(page, "Write a very long story about a dragon who learns to cook.")
    page.wait_for_function(
        "document.querySelector('.message.assistant.streaming')?.dataset.text.length > 20",
        timeout=ANSWER_TIMEOUT_MS,
    )
    page.click("#stop")
    expect(last_answer(page).locator(".stats")).to_have_text("stopped")

    def idle() -> bool:
        state = engine_state(server)
        return not state["sequences"] and state["kv"]["num_used"] == 0

    wait_for(idle, "the aborted request to free its KV blocks")


# -- the engine view ---------------------------------------------------------------------------


def test_engine_view_shows_a_running_request_its_blocks_and_shared_prefixes(
    page: Page, server: Server, client: openai.OpenAI
) -> None:
    errors: list[str] = []  # a script error would leave the parts drawn after it stale
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{server.base_url}/engine")
    expect(page.locator("#connection")).to_have_text("live", timeout=30_000)
    # A prompt of its own (the nonce), long enough to fill whole blocks, run once to cache it.
    prefix = f"{uuid.uuid4().hex} " + " ".join(f"item {i}," for i in range(60))
    client.completions.create(model=MODEL, prompt=prefix + " first", max_tokens=1, temperature=0)
    running = BackgroundStream(client, prefix + " second", max_tokens=2000)
    try:
        request_id = wait_for(lambda: running.request_id, "the streamed request to start")
        row = page.locator(f'#requests tr[data-request-id="{request_id}"]')
        expect(row).to_have_attribute("data-phase", "decode", timeout=60_000)
        blocks = page.locator(f'.block[data-owners~="{request_id}"]')
        expect(blocks.first).to_be_visible()
        assert {blocks.nth(i).get_attribute("data-state") for i in range(blocks.count())} <= {"u", "s"}
        # The shared prefix: its blocks are in use and cached ("s"), the tree's node was hit.
        assert int(row.locator("td").nth(3).inner_text()) > 0  # cached prompt tokens
        expect(page.locator(f'.block.s[data-owners~="{request_id}"]').first).to_be_visible()
        node = page.locator("#tree .node", has_text=prefix[:8]).first
        expect(node).to_be_visible()
        assert int(node.get_attribute("data-hits") or 0) >= 1
        # The counters read the step history: steps were recorded while the page watched.
        expect(page.locator("#counters")).to_contain_text("% of a step")
        page.wait_for_timeout(2000)  # a few seconds of charts for the screenshot
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=SCREENSHOTS / "engine.png", full_page=True)
    finally:
        running.close()
    expect(page.locator(f'#requests tr[data-request-id="{request_id}"]')).to_have_count(0, timeout=30_000)
    # Finished, its prompt stays cached: blocks held by the prefix cache alone.
    expect(page.locator(".block.c").first).to_be_visible()
    assert not errors


def test_event_stream_pushes_snapshots(server: Server) -> None:
    with server.http() as http, http.stream("GET", "/engine/events") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first, second = next(lines), next(lines)
    assert first != second  # each event is a new snapshot (its time differs)
    snapshot = json.loads(first[len("data: ") :])
    assert snapshot["version"] == SCHEMA_VERSION and "kv" in snapshot
    # The history comes as columns: one list per field, all equally long.
    for columns in (snapshot["history"]["seconds"], snapshot["history"]["recent_steps"]):
        assert len({len(values) for values in columns.values()}) == 1


# -- behind an API key -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("web-key"), api_key=API_KEY)
    yield server
    assert server.stop() == 0, server.log()


def test_pages_ask_for_the_key_and_the_state_needs_it(page: Page, keyed_server: Server) -> None:
    base = keyed_server.base_url
    with keyed_server.http() as http:
        assert http.get("/engine/state").status_code == 200
        assert http.get("/engine/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with httpx.Client(base_url=base, timeout=60) as anonymous:
        assert anonymous.get("/engine/state").status_code == 401
        assert anonymous.get("/engine/events").status_code == 401
        assert anonymous.get("/").status_code == 200  # the pages load, then ask
        assert anonymous.get("/static/chat.js").status_code == 200

    page.goto(f"{base}/")
    expect(page.locator("#key-form")).to_be_visible(timeout=30_000)
    page.fill("#key-input", "wrong")
    page.click("#key-form button")
    expect(page.locator("#key-error")).to_be_visible()
    page.fill("#key-input", API_KEY)
    page.click("#key-form button")
    expect(page.locator("#key-form")).to_be_hidden()
    set_settings(page, temperature="0", **{"max-tokens": "8"})
    ask(page, "Hello!")
    answer = page.locator(".message.assistant.done").last
    expect(answer).to_be_visible(timeout=ANSWER_TIMEOUT_MS)
    expect(answer.locator(".error")).to_have_count(0)
    assert answer.get_attribute("data-text")

    page.goto(f"{base}/engine")  # the key is remembered
    expect(page.locator("#connection")).to_have_text("live", timeout=30_000)
    expect(page.locator("#key-form")).to_be_hidden()
