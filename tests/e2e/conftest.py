"""Fixtures: real servers with the bundled model, and the same model in-process.

Loading the model takes seconds, so one server is shared by the whole session (`server`); the
few tests that need other flags start one more per module.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from e2e_helpers import NUM_KV_BLOCKS, Server, start_server

from yaie import LLM


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: default flags (prefix caching on), dense weights (see start_server)."""
    server = start_server(tmp_path_factory.mktemp("server"))
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()  # every bad request was answered, none crashed


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The same model in this process, for reference outputs (dense, as the servers run it)."""
    return LLM(num_kv_blocks=NUM_KV_BLOCKS, quantization="none")
