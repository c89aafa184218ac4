"""Admission counts sequences, not requests: one n=8 request is eight waiting sequences (issue
#11: with --max-waiting 4, one n=8 request pushed the waiting count to 6)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from yaie import LLM, SamplingParams
from yaie.engine.async_engine import AsyncEngine, EngineOverloadedError
from yaie.engine.engine import EngineStats

pytestmark = pytest.mark.slow


def test_admission_counts_every_sequence_of_a_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    stats = llm.engine.stats

    def two_waiting() -> EngineStats:  # as if two sequences already waited
        return dataclasses.replace(stats(), num_waiting=2)

    monkeypatch.setattr(llm.engine, "stats", two_waiting)
    params = SamplingParams(max_tokens=2)

    async def main(async_engine: AsyncEngine) -> None:
        prompt = await async_engine.encode("Hi")
        for requests, n in [([("a", prompt)], 3), ([("b", prompt), ("c", prompt)], 2)]:
            with pytest.raises(EngineOverloadedError):
                await async_engine.add_requests(requests, dataclasses.replace(params, n=n), max_waiting=4)
        # Exactly filling the room is allowed, and both prompts of a request go in together.
        streams = await async_engine.add_requests(
            [("d", prompt), ("e", prompt)], dataclasses.replace(params, n=1), max_waiting=4
        )
        for stream in streams:
            *_, final = [output async for output in stream]
            assert final.finished and len(final.outputs) == 1

    async_engine = AsyncEngine(lambda: llm.engine)
    try:
        asyncio.run(main(async_engine))
    finally:
        async_engine.shutdown()
    assert not llm.engine.has_unfinished_requests()
