"""Fixtures every test directory shares, each made once per run: the bundled model in this
process (`llm`) and one `yaie serve` of it with the default flags (`server`, `client`).

Loading the model takes seconds and starting a server more, so every test that uses either is
marked slow here (tests that load the model or start a server of their own say so themselves):
`python -m pytest -m "not slow"` leaves them all out.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.e2e_helpers import Server, start_server
from yaie import LLM

# A test's fixturenames lists what it uses transitively, so `client` counts through `server`.
SLOW_FIXTURES = frozenset({"llm", "server"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The bundled model with a roomy KV pool, dense: the one transformers' reference outputs hold
    for, and the tests compare one run's greedy tokens with another's (cached or not, batched or
    alone, in this process or served), which only the dense path keeps equal
    (docs/quantization.md)."""
    return LLM(num_kv_blocks=1024, quantization="none")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: default flags (prefix caching on), dense weights (see start_server).
    Tests that need other flags start a server of their own."""
    server = start_server(tmp_path_factory.mktemp("server"))
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()  # every bad request was answered, none crashed


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    """Raw HTTP to the shared server, for requests no client library would send; the server must
    still be healthy after them."""
    with server.http() as client:
        yield client
    assert httpx.get(f"{server.base_url}/health").status_code == 200
