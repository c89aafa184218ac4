"""Fixtures: a client of the shared server for the structured-output tests, and the test schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.e2e_helpers import Server

SCHEMAS = Path(__file__).resolve().parent / "data" / "schemas.json"


@pytest.fixture(scope="session")
def schemas() -> list[dict[str, Any]]:
    """[{"name", "schema"}]: the JSON schemas every output must validate against."""
    entries: list[dict[str, Any]] = json.loads(SCHEMAS.read_text())
    return entries


@pytest.fixture(scope="session")
def sclient(server: Server) -> openai.OpenAI:
    """A client of the shared server (tests/conftest.py) that waits as long as a grammar takes to
    compile on a busy machine."""
    return server.client(timeout=600)
