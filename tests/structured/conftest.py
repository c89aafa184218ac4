"""Fixtures: one real server for the structured-output tests, and the test schemas."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

# The e2e tests' helpers start and stop real servers; these tests use them too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from e2e_helpers import Server, start_server

SCHEMAS = Path(__file__).resolve().parent / "data" / "schemas.json"


@pytest.fixture(scope="session")
def schemas() -> list[dict[str, Any]]:
    """[{"name", "schema"}]: the JSON schemas every output must validate against."""
    entries: list[dict[str, Any]] = json.loads(SCHEMAS.read_text())
    return entries


@pytest.fixture(scope="session")
def structured_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("structured"))
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()  # every bad request was answered, none crashed


@pytest.fixture(scope="session")
def sclient(structured_server: Server) -> openai.OpenAI:
    return structured_server.client(timeout=600)
