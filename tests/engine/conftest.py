from __future__ import annotations

import json
from pathlib import Path

import pytest

from yaie import LLM

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "hf_greedy.json"


@pytest.fixture(scope="session")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The bundled model with a roomy KV pool, shared by every engine test, dense: the one
    transformers' reference outputs hold for, and the tests compare one run's greedy tokens with
    another's (cached or not, batched or alone), which only the dense path keeps equal
    (docs/quantization.md)."""
    return LLM(num_kv_blocks=1024, quantization="none")
