from __future__ import annotations

import json
from pathlib import Path

import pytest

from yaie import LLM

REFERENCE = Path(__file__).resolve().parents[2].parent / "shared" / "reference" / "hf_greedy.json"


@pytest.fixture(scope="session")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The bundled model with a roomy KV pool, shared by every engine test."""
    return LLM(num_kv_blocks=1024)


def assert_no_leak(llm: LLM) -> None:
    """Every used block is held by the prefix cache alone: nothing leaked from a request."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    pool, cache = engine.block_pool, engine.scheduler.prefix_cache
    cached = 0 if cache is None else cache.num_cached_blocks
    assert pool.num_used == cached
    if cache is not None:
        assert cache.num_evictable_blocks == cached
