"""Admission counts sequences, not requests: one n=8 request is eight waiting sequences (issue
#11: with --max-waiting 4, one n=8 request pushed the waiting count to 6). A tenant's own bound
refuses its flood while another tenant's requests still get in (issue #38)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import pytest

from yaie import LLM, SamplingParams
from yaie.engine.async_engine import Admission, AsyncEngine, EngineOverloadedError
from yaie.engine.engine import EngineStats

pytestmark = pytest.mark.slow


def run_on_engine(llm: LLM, main: Callable[[AsyncEngine], Awaitable[None]]) -> None:
    """Runs `main` against an AsyncEngine over `llm`'s engine, which it leaves with nothing unfinished."""
    async_engine = AsyncEngine(lambda: llm.engine)
    try:
        asyncio.run(main(async_engine))
    finally:
        async_engine.shutdown()
    assert not llm.engine.has_unfinished_requests()


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
                admission = Admission(max_waiting=4)
                await async_engine.add_requests(requests, dataclasses.replace(params, n=n), admission)
        # Exactly filling the room is allowed, and both prompts of a request go in together.
        streams = await async_engine.add_requests(
            [("d", prompt), ("e", prompt)], dataclasses.replace(params, n=1), Admission(max_waiting=4)
        )
        for stream in streams:
            *_, final = [output async for output in stream]
            assert final.finished and len(final.outputs) == 1

    run_on_engine(llm, main)


def test_a_tenant_at_its_bound_is_refused_while_another_gets_in(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = llm.engine.scheduler
    num_waiting = scheduler.num_waiting

    def flood_has_two(tenant: str | None = None) -> int:  # as if "flood" had two waiting
        return 2 if tenant == "flood" else num_waiting(tenant)

    monkeypatch.setattr(scheduler, "num_waiting", flood_has_two)
    params = SamplingParams(max_tokens=2)

    async def main(async_engine: AsyncEngine) -> None:
        prompt = await async_engine.encode("Hi")
        flood = Admission("flood", max_waiting=8, max_waiting_per_tenant=2)
        with pytest.raises(EngineOverloadedError, match="--max-waiting-per-tenant"):
            await async_engine.add_requests([("f", prompt)], params, flood)
        other = Admission("other", max_waiting=8, max_waiting_per_tenant=2)
        streams = await async_engine.add_requests([("o1", prompt), ("o2", prompt)], params, other)
        for stream in streams:
            *_, final = [output async for output in stream]
            assert final.finished

    run_on_engine(llm, main)
