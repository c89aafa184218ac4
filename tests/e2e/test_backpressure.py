"""A stream whose reader stops reading is bounded: past MAX_QUEUED_OUTPUTS unread outputs its
request is aborted (as if its client had disconnected), not queued without end. No model needed:
the engine behind the stream is a stub that records aborts."""

from __future__ import annotations

import asyncio

import pytest

from yaie.engine.async_engine import MAX_QUEUED_OUTPUTS, RequestStream
from yaie.outputs import CompletionOutput, RequestOutput


class StubEngine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def _abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def output(step: int) -> RequestOutput:
    choice = CompletionOutput(0, "", [step], delta_text="x", delta_token_ids=[step])
    return RequestOutput("r", None, [1], [choice], finished=False)


def stream_of(engine: StubEngine) -> RequestStream:
    return RequestStream("r", engine)  # type: ignore[arg-type]  # the stub has what a stream uses


def test_a_reader_that_keeps_up_gets_everything() -> None:
    async def main() -> list[int]:
        engine = StubEngine()
        stream = stream_of(engine)
        received = []
        for step in range(3 * MAX_QUEUED_OUTPUTS):
            stream._put(output(step))
            received.append((await anext(stream)).outputs[0].token_ids[0])
        assert not stream.overflowed and not engine.aborted
        return received

    assert asyncio.run(main()) == list(range(3 * MAX_QUEUED_OUTPUTS))


@pytest.mark.parametrize("unread_before", [0, 10])
def test_a_reader_that_stops_is_treated_as_gone(unread_before: int) -> None:
    async def main() -> None:
        engine = StubEngine()
        stream = stream_of(engine)
        for step in range(unread_before):
            stream._put(output(step))
            await anext(stream)
        for step in range(MAX_QUEUED_OUTPUTS):
            stream._put(output(step))
        assert not stream.overflowed and not engine.aborted  # full, not yet past the bound
        stream._put(output(MAX_QUEUED_OUTPUTS))
        assert stream.overflowed and stream.aborted
        assert engine.aborted == ["r"]  # the request is aborted, which frees its blocks
        stream._put(output(MAX_QUEUED_OUTPUTS + 1))  # late outputs are dropped, not queued
        assert stream._queue.qsize() == MAX_QUEUED_OUTPUTS
        with pytest.raises(StopAsyncIteration):
            await anext(stream)  # a reader that comes back learns the stream has ended
        assert engine.aborted == ["r"]

    asyncio.run(main())

