"""Fixtures: a client of the shared server for the structured-output tests, and the test schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.e2e_helpers import Server
from yaie.model.loader import bundled_model_path, load_tokenizer
from yaie.structured.backend import GrammarCompiler

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


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The bundled model's tokenizer, for the grammar tests."""
    return load_tokenizer(bundled_model_path())


@pytest.fixture(scope="session")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
