"""`AsyncEngine`: the synchronous Engine behind an asyncio API, for the server.

The Engine is not thread-safe, so one background thread owns it, and nothing else calls it.
That thread loops: run the commands queued by the event loop (`AddRequests`, `Abort`,
`TakeSnapshot`, `Shutdown`: named dataclasses, below), `step()` if anything is unfinished,
and hand each output to its request's `asyncio.Queue` on the event loop. With nothing to do it
sleeps on a condition variable, so an idle server costs no CPU. The tokenizer's work on a
request (encoding, chat templates, grammar compiles, checks: the engine's `InputProcessor`,
which is thread-safe) runs on a small pool of threads of its own before the request is handed
to the engine thread.

That thread also builds the Engine, so every torch call of the server comes from it. This is
for speed, not safety: OpenMP keeps a pool of worker threads per calling thread, and once the
process has more OpenMP threads than cores, libgomp stops spin-waiting and wakes its workers
through the kernel at every parallel op: a model loaded on the main thread and run on this one
decodes markedly slower (benchmarks/thread_pools.py measures it).

Requests are streams: `add_request` returns a `RequestStream` once the engine has accepted the
request (so a refused request raises before anything is streamed), and closing that stream
before it finishes aborts the request, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from yaie.engine.engine import Engine, EngineStats
from yaie.engine.input_processor import ProcessedRequest
from yaie.engine.request import deadline_after
from yaie.engine.sequence import ANONYMOUS_TENANT
from yaie.engine.snapshot import EngineSnapshots
from yaie.errors import RequestFailedError, YaieError
from yaie.outputs import RequestOutput
from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
Prompt = str | list[int]
MAX_QUEUED_OUTPUTS = 1024  # per stream; each output is one step's tokens for every choice
TOKENIZER_THREADS = 2  # enough that one huge input does not hold up everyone else's


class EngineOverloadedError(YaieError):
    """More requests are already waiting than the server accepts; retry later (HTTP 429)."""


class EngineClosedError(YaieError):
    """The engine is shutting down and takes no more requests (HTTP 503)."""


class RequestStream:
    """The outputs of one request, in order, ending with the finished one.

    Lives on the event loop: iterate it from there, and `close()` it from there.

    At most MAX_QUEUED_OUTPUTS outputs wait to be read: a reader that falls that far behind (its
    client stopped reading, and the server's writes to it block) is treated as gone, and the
    request is aborted (`overflowed`), rather than letting one client grow the server's memory
    for as long as its request runs.
    """

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        # None is the wake-up sent by close(); an exception ends the stream with that error.
        self._queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue(MAX_QUEUED_OUTPUTS)
        self._done = False  # nothing more will be returned
        self.aborted = False  # closed before the request finished
        self.overflowed = False  # aborted because its reader fell MAX_QUEUED_OUTPUTS behind

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        """Stop early: abort the request in the engine, and end any iteration waiting on it."""
        if self._done:
            return
        self._done = self.aborted = True
        self._engine._abort(self.request_id)
        if not self._queue.full():  # a reader waits only on an empty queue
            self._queue.put_nowait(None)

    def _put(self, item: Outcome) -> None:
        if self._done:  # after close(), late outputs have no reader
            return
        if self._queue.full():
            self.overflowed = True
            self.close()
            return
        self._queue.put_nowait(item)


Outcome = RequestOutput | BaseException  # what a stream receives: an output, or its error
StreamEntry = tuple[asyncio.AbstractEventLoop, RequestStream]  # a stream and the loop it lives on
Delivery = tuple[str, StreamEntry, Outcome]  # for one request


# -- commands: what the event loop asks of the engine thread, run there between two steps -------


@dataclass(frozen=True)
class Admission:
    """Who sends a call's requests, and how many sequences may wait: `max_waiting` in all,
    `max_waiting_per_tenant` of `tenant`'s (sequences: every choice of every request). A call
    that would push either past its bound is refused with EngineOverloadedError."""

    tenant: str = ANONYMOUS_TENANT
    max_waiting: int | None = None
    max_waiting_per_tenant: int | None = None


@dataclass(frozen=True)
class AddRequests:
    """Queue processed requests, all or none, each with the stream that gets its outputs."""

    requests: list[tuple[str, ProcessedRequest]]
    streams: list[StreamEntry]
    admission: Admission
    priority: int  # Engine.add_processed_request's
    deadline: float | None  # a time.monotonic() instant, from when the call arrived
    cache_salt: str | None  # Engine.add_processed_request's
    reply: concurrent.futures.Future[None]


@dataclass(frozen=True)
class Abort:
    """Stop a request and forget its stream (closed early, or its reader fell behind)."""

    request_id: str


@dataclass(frozen=True)
class TakeSnapshot:
    """The engine's state for the engine view, as `viewer` (a tenant) may see it, and keep its
    step log recording for a while."""

    viewer: str
    reply: concurrent.futures.Future[dict[str, Any]]


@dataclass(frozen=True)
class Shutdown:
    """End every stream with EngineClosedError and stop the thread."""


Command = AddRequests | Abort | TakeSnapshot | Shutdown


class AsyncEngine:
    """Runs an Engine on a background thread it owns until `shutdown()`.

    `make_engine` is called on that thread (see the module docstring for why); the constructor
    returns once it has, and raises what it raised.
    """

    _engine: Engine  # set by the engine thread, before the constructor returns; used only there

    def __init__(self, make_engine: Callable[[], Engine]) -> None:
        self._wakeup = threading.Condition()
        self._commands: deque[Command] = deque()  # guarded by _wakeup
        self._closed = False  # event-loop side: refuse new requests
        self._streams: dict[str, StreamEntry] = {}  # engine thread only
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="yaie-tokenize"
        )
        built: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(make_engine, built), name="yaie-engine", daemon=True
        )
        self._thread.start()
        engine = built.result()
        # What the server needs to know about the model, fixed once the engine is built.
        self.model_info = engine.model_info
        self.model_path: Path = engine.model_info.path
        self.tokenizer = engine.tokenizer  # decoding from other threads only reads it
        self.max_model_len = engine.model_info.max_model_len
        self.vocab_size = engine.model_info.vocab_size
        # Thread-safe, and touches no engine state: the tokenizer threads run it.
        self._input_processor = engine.input_processor
        self._snapshots = EngineSnapshots(engine)  # engine thread only

    # -- the event loop's side ----------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        admission: Admission = Admission(),
        *,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; raises InvalidRequestError, EngineClosedError, or EngineOverloadedError
        (see add_requests). A text prompt is tokenized off the engine thread first."""
        deadline = deadline_after(timeout)  # tokenizing counts against it too
        token_ids = await self.encode(prompt) if isinstance(prompt, str) else prompt
        requests = [(request_id, token_ids)]
        (stream,) = await self._add_requests(requests, params, admission, priority, deadline, cache_salt)
        return stream

    async def add_requests(
        self,
        requests: Sequence[tuple[str, list[int]]],
        params: SamplingParams | PoolingParams,
        admission: Admission = Admission(),
        *,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """Queue (request id, prompt token ids) pairs together: all of them, or none. They are
        checked, and their structured outputs compiled, on the tokenizer threads first, so
        that a new schema holds up no step.

        `admission`: whose requests they are, and EngineOverloadedError (retry later) when they
        would push the sequences waiting past its bounds. `priority`, `timeout` (seconds from this
        call, checks and compiles included) and `cache_salt` apply to each request, as in
        Engine.add_request; the tenant is `admission`'s.
        """
        return await self._add_requests(
            requests, params, admission, priority, deadline_after(timeout), cache_salt
        )

    async def _add_requests(
        self,
        requests: Sequence[tuple[str, list[int]]],
        params: SamplingParams | PoolingParams,
        admission: Admission,
        priority: int,
        deadline: float | None,
        cache_salt: str | None,
    ) -> list[RequestStream]:
        if self._closed:
            raise EngineClosedError("the server is shutting down")
        processor = self._input_processor
        processed = await self._off_thread(
            lambda: [(request_id, processor.process(token_ids, params)) for request_id, token_ids in requests]
        )
        loop = asyncio.get_running_loop()
        streams = [RequestStream(request_id, self) for request_id, _ in requests]
        reply: concurrent.futures.Future[None] = concurrent.futures.Future()
        entries = [(loop, stream) for stream in streams]
        self._submit(AddRequests(processed, entries, admission, priority, deadline, cache_salt, reply))
        try:
            await asyncio.wrap_future(reply)
        except asyncio.CancelledError:
            for stream in streams:
                stream.close()  # the add may have happened just before the caller went away
            raise
        return streams

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        priority: int = 0,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses; stopping the iteration early aborts it.
        `priority` and `timeout` as in Engine.add_request."""
        stream = await self.add_request(request_id, prompt, params, priority=priority, timeout=timeout)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    # The tokenizer's work runs on a small pool of its own threads, never on the engine's or
    # the event loop's: the Rust tokenizer releases the GIL, so a huge input costs only its own
    # request. The input processor only reads the tokenizer, as the engine thread does when it
    # detokenizes.

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text`, exactly as the engine tokenizes a prompt string."""
        return await self._off_thread(lambda: self._input_processor.encode(text))

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the model's chat template (InputProcessor.encode_chat)."""
        return await self._off_thread(
            lambda: self._input_processor.encode_chat(messages, tools, chat_template_kwargs)
        )

    async def decode(self, token_ids: list[int]) -> str:
        return await self._off_thread(lambda: self._input_processor.decode(token_ids))

    async def _off_thread(self, fn: Callable[[], T]) -> T:
        if self._closed:
            raise EngineClosedError("the server is shutting down")
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn)

    async def snapshot(self, viewer: str) -> dict[str, Any]:
        """The engine's state for the engine view as tenant `viewer` may see it
        (yaie/engine/snapshot.py), taken between two steps. Asking for it keeps the engine's step
        log recording for a few seconds."""
        if self._closed:
            raise EngineClosedError("the server is shutting down")
        reply: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._submit(TakeSnapshot(viewer, reply))
        return await asyncio.wrap_future(reply)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (read without waiting for the engine)."""
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse new requests, end every stream with EngineClosedError, and stop the thread."""
        self._closed = True
        self._submit(Shutdown())
        self._thread.join(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def _abort(self, request_id: str) -> None:
        self._submit(Abort(request_id))

    def _submit(self, command: Command) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    # -- the engine thread --------------------------------------------------------------------

    def _run(self, make_engine: Callable[[], Engine], built: concurrent.futures.Future[Engine]) -> None:
        try:
            self._engine = make_engine()
            self._stats = self._engine.stats()  # replaced (never mutated) by this thread
        except BaseException as exc:
            built.set_exception(exc)
            return
        built.set_result(self._engine)
        try:
            self._loop()
        except Exception:
            # A bug outside step(): do not leave callers waiting forever on a dead thread.
            logger.exception("the engine thread died")
            self._closed = True
            self._fail_all(RequestFailedError("the engine thread died"))

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not (self._commands or self._engine.has_unfinished_requests()):
                    self._wakeup.wait()
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                try:
                    self._execute(command)
                except Exception:
                    logger.exception("engine command %s failed", type(command).__name__)
            if any(isinstance(command, Shutdown) for command in commands):
                return
            if self._engine.has_unfinished_requests():
                self._step()
            self._stats = self._engine.stats()

    def _execute(self, command: Command) -> None:
        """Run one command; one with a caller waiting hands its result or error to it."""
        if isinstance(command, Shutdown):
            self._fail_all(EngineClosedError("the server is shutting down"))
        elif isinstance(command, Abort):
            self._streams.pop(command.request_id, None)
            self._engine.abort(command.request_id)
        elif isinstance(command, AddRequests):
            _reply(command.reply, lambda: self._add(command))
        else:

            def take() -> dict[str, Any]:
                self._engine.step_log.watch()
                return self._snapshots.take(command.viewer)

            _reply(command.reply, take)

    def _add(self, command: AddRequests) -> None:
        engine = self._engine
        admission = command.admission
        num_seqs = sum(processed.num_seqs for _, processed in command.requests)
        # Checked here, between steps, so that concurrent arrivals cannot all slip past them.
        # The tenant's own bound first: a tenant that floods the queue is refused for itself,
        # while the others' requests still get in.
        limit = admission.max_waiting_per_tenant
        if limit is not None and engine.scheduler.num_waiting(admission.tenant) + num_seqs > limit:
            raise EngineOverloadedError(
                f"this API key already has sequences waiting, and at most {limit} may wait for one "
                "(--max-waiting-per-tenant); retry later"
            )
        limit = admission.max_waiting
        if limit is not None and engine.stats().num_waiting + num_seqs > limit:
            raise EngineOverloadedError(f"{limit} sequences are already waiting; retry later")
        added: list[str] = []
        try:
            for (request_id, processed), entry in zip(command.requests, command.streams, strict=True):
                engine.add_processed_request(
                    request_id, processed, priority=command.priority, deadline=command.deadline,
                    tenant=admission.tenant, cache_salt=command.cache_salt,
                )  # fmt: skip
                added.append(request_id)
                self._streams[request_id] = entry
        except BaseException:
            for request_id in added:
                self._streams.pop(request_id, None)
                engine.abort(request_id)
            raise

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            # The engine fails a request that breaks a step by itself (Engine._forward), so this
            # is a bug in the engine's own bookkeeping, and it may be left halfway through the
            # step: fail everything in flight, and serve the next requests afresh.
            logger.exception("engine step failed; failing %d in-flight request(s)", len(self._streams))
            self._fail_all(RequestFailedError(f"the engine failed: {exc!r}"))
            return
        deliveries: list[Delivery] = []
        for output in outputs:
            entry = self._streams.get(output.request_id)
            if entry is None:
                continue  # aborted while this step ran
            if output.finished:
                del self._streams[output.request_id]
            deliveries.append((output.request_id, entry, output.error or output))
        self._deliver(deliveries)

    def _deliver(
        self,
        deliveries: list[Delivery],
    ) -> None:
        """Hand each (request id, its stream's entry, output or error) to its stream: one call
        into each event loop for all of them, so that a step wakes the loop once, not once for
        every request it advanced."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, RequestStream, Outcome]]] = {}
        for request_id, (loop, stream), item in deliveries:
            by_loop.setdefault(loop, []).append((request_id, stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, [(stream, item) for _, stream, item in items])
            except RuntimeError:  # its event loop is closed: nobody is listening any more
                for request_id, _, _ in items:
                    logger.warning("dropping request %s: its event loop is closed", request_id)
                    self._streams.pop(request_id, None)
                    self._engine.abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id in streams:
            try:
                self._engine.abort(request_id)
            except Exception:  # keep failing the others; this one gets its error regardless
                logger.exception("could not abort request %s", request_id)
        self._deliver([(request_id, entry, error) for request_id, entry in streams.items()])


def _reply(future: concurrent.futures.Future[T], fn: Callable[[], T]) -> None:
    """Hand `fn()`, or what it raised, to the caller waiting on `future`, if it still waits."""
    if not future.set_running_or_notify_cancel():
        return  # the caller stopped waiting
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)


def _put_all(items: list[tuple[RequestStream, Outcome]]) -> None:
    """On the event loop: one step's outputs (or errors) into their streams."""
    for stream, item in items:
        stream._put(item)
