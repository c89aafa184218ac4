"""Checks shared by the engine and speculation tests."""

from __future__ import annotations

from yaie import LLM


def assert_no_leak(llm: LLM) -> None:
    """Every used block is held by the prefix cache alone: nothing leaked from a request."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    pool, cache = engine.block_pool, engine.scheduler.prefix_cache
    cached = 0 if cache is None else cache.num_cached_blocks
    assert pool.num_used == cached
    if cache is not None:
        assert cache.num_evictable_blocks == cached
