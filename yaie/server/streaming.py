"""Following the engine requests behind one API call, and sending chunks as server-sent events.

`Generation` is the one place that follows a call's engine requests (one per prompt): it feeds
the metrics, aborts the requests when the client disconnects (freeing their KV cache at once,
whether the response streams or not), and counts usage. A streamed response reads its
`updates()`, one per choice per engine output, and sends deltas; any other waits for its
`final_outputs()` and builds the whole response from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from yaie.engine.async_engine import RequestStream
from yaie.errors import InvalidRequestError
from yaie.outputs import CompletionOutput, RequestOutput, TokenLogprob
from yaie.server import protocol as p
from yaie.server.errors import APIError, ClientDisconnected, api_error
from yaie.server.metrics import RequestTracker, ServerMetrics

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"
ChunkT = TypeVar("ChunkT")


def event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


@dataclass(frozen=True)
class EventFormat(Generic[ChunkT]):
    """How an API writes its event stream: each chunk, a failure once the stream has answered
    200, and the end of the stream ("" for none)."""

    chunk: Callable[[ChunkT], str]
    error: Callable[[APIError], str]
    done: str


OPENAI_EVENTS: EventFormat[BaseModel] = EventFormat(
    event, lambda error: event(p.ErrorResponse(error=error.info)), DONE_EVENT
)


def event_stream(chunks: AsyncGenerator[ChunkT, None], sse: EventFormat[ChunkT]) -> StreamingResponse:
    """`chunks` as a 200 response of server-sent events written as `sse` says."""
    # X-Accel-Buffering: proxies such as nginx would otherwise hold tokens back.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_events(chunks, sse), media_type="text/event-stream", headers=headers)


async def _events(chunks: AsyncGenerator[ChunkT, None], sse: EventFormat[ChunkT]) -> AsyncIterator[str]:
    # The stream has already answered 200, so a failure is sent as one last error event.
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse.chunk(chunk)
        except ClientDisconnected:
            return  # nobody is left to read the rest
        except Exception as exc:
            error = api_error(exc)
            if error.status == 500:
                logger.error("a streamed request failed", exc_info=exc)
            yield sse.error(error)
    if sse.done:
        yield sse.done


async def merge(streams: Sequence[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of several streams as they come, each with its stream's position."""
    if len(streams) == 1:  # one prompt, as most calls have: no task and no wait per output
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(stream.__anext__()): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()


@contextlib.asynccontextmanager
async def abort_on_exit(request: Request, streams: Sequence[RequestStream]) -> AsyncIterator[None]:
    """Abort the streams' requests if the client disconnects first, or on leaving the block
    (normally they have all finished by then, and closing them does nothing)."""

    async def watch() -> None:
        # The body has been read, so the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for stream in streams:
            stream.close()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        for stream in streams:
            stream.close()


@dataclass
class Update:
    """What one engine output brings to one choice of the response."""

    index: int  # the choice's place in the response: prompt * n + the choice's index
    prompt: int  # which of the call's prompts the choice answers
    choice: CompletionOutput
    output: RequestOutput  # the prompt's newest output, which `choice` belongs to
    first: bool  # in the prompt's first output
    finish_reason: str | None  # set on the one update that finishes the choice


class Generation:
    """The engine requests behind one API call, one per prompt, followed together.

    Read it once, either way: `updates()` or `final_outputs()`."""

    def __init__(
        self,
        request: Request,
        streams: list[RequestStream],
        trackers: list[RequestTracker],
        n: int,
        metrics: ServerMetrics,
        translate_error: Callable[[InvalidRequestError], InvalidRequestError] = lambda exc: exc,
    ) -> None:
        self._request = request
        self._metrics = metrics
        # A request refused while it runs (a grammar the library gave up on) names the engine's
        # field; this names the API's (SamplingRequest.translate_error), as a refusal at admission does.
        self._translate_error = translate_error
        self._streams = streams
        self._trackers = trackers
        self.n = n  # choices per prompt
        self._finals: list[RequestOutput | None] = [None] * len(streams)

    async def _outputs(self) -> AsyncGenerator[tuple[int, RequestOutput, bool], None]:
        """(prompt, output, whether it is the prompt's first) as they come. Raises
        ClientDisconnected at the end if the client left (which aborted the requests)."""
        streams = self._streams
        async with abort_on_exit(self._request, streams), contextlib.aclosing(merge(streams)) as outputs:
            try:
                async for i, output in outputs:
                    self._trackers[i].observe(output)
                    first, self._finals[i] = self._finals[i] is None, output
                    yield i, output, first
            except InvalidRequestError as exc:
                raise self._translate_error(exc) from exc
        if any(stream.aborted for stream in streams):
            self._metrics.requests_aborted_slow_client.inc(sum(stream.overflowed for stream in streams))
            raise ClientDisconnected()

    async def updates(self) -> AsyncGenerator[Update, None]:
        """Every choice of every output, as they come."""
        finished: set[int] = set()  # choices whose finish has been told
        async with contextlib.aclosing(self._outputs()) as outputs:
            async for i, output, first in outputs:
                for choice in output.outputs:
                    index = i * self.n + choice.index
                    finish_reason = None
                    if choice.finish_reason is not None and index not in finished:
                        finished.add(index)
                        finish_reason = choice.finish_reason
                    yield Update(index, i, choice, output, first, finish_reason)

    async def final_outputs(self) -> list[RequestOutput]:
        """Each prompt's finished output, once all of them have finished."""
        async with contextlib.aclosing(self._outputs()) as outputs:
            async for _ in outputs:
                pass
        finals = [final for final in self._finals if final is not None]
        assert len(finals) == len(self._finals), "every engine request ends with a finished output"
        return finals

    def usage(self) -> p.Usage:
        """The tokens of every output so far: all of them once the outputs have been read."""
        finals = [final for final in self._finals if final is not None]
        return p.Usage.of(
            prompt_tokens=sum(len(final.prompt_token_ids) for final in finals),
            completion_tokens=sum(len(choice.token_ids) for final in finals for choice in final.outputs),
            cached_tokens=sum(final.num_cached_tokens for final in finals),
        )


def new_logprobs(choice: CompletionOutput) -> list[TokenLogprob]:
    """The logprobs of the tokens this output added to the choice."""
    num_tokens = len(choice.token_ids)
    return (choice.logprobs or [])[num_tokens - len(choice.delta_token_ids) : num_tokens]
