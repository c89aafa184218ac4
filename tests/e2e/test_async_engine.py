"""AsyncEngine over the real model, in this process: streaming, aborting, and failing safely;
and the HTTP app over it when the engine fails."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest

from yaie import LLM, InvalidRequestError, SamplingParams
from yaie.engine.async_engine import Admission, AsyncEngine, EngineClosedError, EngineOverloadedError
from yaie.engine.engine import Engine
from yaie.engine.sequence import ANONYMOUS_TENANT
from yaie.errors import RequestFailedError
from yaie.outputs import RequestOutput
from yaie.server.app import build_app
from yaie.structured.spec import StructuredOutputs

pytestmark = pytest.mark.slow

LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


@contextlib.contextmanager
def running(llm: LLM) -> Iterator[AsyncEngine]:
    """An AsyncEngine that owns `llm`'s engine until the block ends."""
    with running_engine(lambda: llm.engine) as async_engine:
        yield async_engine
    assert not llm.engine.has_unfinished_requests()


@contextlib.contextmanager
def running_engine(make_engine: Callable[[], Engine]) -> Iterator[AsyncEngine]:
    async_engine = AsyncEngine(make_engine)
    try:
        yield async_engine
    finally:
        async_engine.shutdown()


async def drain(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in outputs]


async def wait_idle(async_engine: AsyncEngine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while async_engine.stats().num_running or async_engine.stats().num_waiting:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_engine_is_built_and_run_on_one_thread(llm: LLM) -> None:
    # Building on the thread that runs the model keeps OpenMP to one worker pool; a second
    # pool makes every op ~40% slower on 2 cores (benchmarks/thread_pools.py).
    threads: list[threading.Thread] = []

    def make_engine() -> Engine:
        threads.append(threading.current_thread())
        return llm.engine

    original_step = llm.engine.step

    def step() -> list[RequestOutput]:
        threads.append(threading.current_thread())
        return original_step()

    llm.engine.step = step
    try:
        with running_engine(make_engine) as async_engine:
            asyncio.run(drain(async_engine.generate("r", "Hi", SamplingParams(max_tokens=2))))
    finally:
        del llm.engine.step
    assert len(threads) >= 2
    assert threading.main_thread() not in threads
    assert len(set(threads)) == 1


def test_nothing_calls_the_engine_off_its_thread(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine is not thread-safe: tokenizing, chat templates and grammar compiles run on the
    # tokenizer threads through the input processor, and only what they produce reaches the
    # engine, on its own thread.
    engine = llm.engine
    callers: dict[str, set[str]] = {}

    def recording(name: str, original: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            callers.setdefault(name, set()).add(threading.current_thread().name)
            return original(*args, **kwargs)

        return call

    for name in ("add_request", "add_processed_request", "abort", "step", "stats", "encode_chat",
                 "has_unfinished_requests"):  # fmt: skip
        monkeypatch.setattr(engine, name, recording(name, getattr(engine, name)))
    processor_threads: set[str] = set()
    original_process = engine.input_processor.process

    def process(*args: object) -> object:
        processor_threads.add(threading.current_thread().name)
        return original_process(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.input_processor, "process", process)
    structured = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(choice=["yes", "no"])
    )

    async def use_everything(async_engine: AsyncEngine) -> None:
        chat = await async_engine.encode_chat([{"role": "user", "content": "Is the sky blue?"}])
        await drain(async_engine.generate("chat", chat, structured))
        await drain(async_engine.generate("text", "Hi", SamplingParams(max_tokens=2)))
        stream = await async_engine.add_request("stopped", "Once upon a time", LONG)
        await anext(stream)
        stream.close()  # an abort
        await async_engine.snapshot(ANONYMOUS_TENANT)
        await async_engine.decode(chat)
        assert await wait_idle(async_engine)

    with running_engine(lambda: engine) as async_engine:
        asyncio.run(use_everything(async_engine))
    assert not engine.requests
    assert {"add_processed_request", "abort", "step"} <= set(callers)
    assert set().union(*callers.values()) == {"yaie-engine"}
    assert processor_threads and all(name.startswith("yaie-tokenize") for name in processor_threads)


def test_a_failing_build_raises_from_the_constructor() -> None:
    def make_engine() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(make_engine)


def test_generate_streams_what_llm_returns(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=16)
    [expected] = llm.generate("The sky is blue because", params)

    async def collect(async_engine: AsyncEngine) -> list[str]:
        return [
            o.outputs[0].delta_text
            async for o in async_engine.generate("r", "The sky is blue because", params)
        ]

    with running(llm) as async_engine:
        deltas = asyncio.run(collect(async_engine))
    assert len(deltas) > 1
    assert "".join(deltas) == expected.outputs[0].text


def test_refused_request_raises_before_streaming(llm: LLM) -> None:
    async def main(async_engine: AsyncEngine) -> None:
        with pytest.raises(InvalidRequestError) as refused:
            await async_engine.add_request("empty", "", SamplingParams())
        assert refused.value.param == "prompt"
        with pytest.raises(InvalidRequestError):
            await anext(async_engine.generate("long", "Hi", SamplingParams(max_tokens=10**7)))
        with pytest.raises(EngineOverloadedError):
            await async_engine.add_request("queued", "Hi", SamplingParams(), Admission(max_waiting=0))

    with running(llm) as async_engine:
        asyncio.run(main(async_engine))


def test_stopping_early_aborts_the_request(llm: LLM) -> None:
    async def main(async_engine: AsyncEngine) -> None:
        outputs = async_engine.generate("long", "Once upon a time", LONG)
        for _ in range(3):
            await anext(outputs)
        await outputs.aclose()  # what a disconnecting client amounts to
        assert await wait_idle(async_engine)
        # The same id is free again: the request is gone from the engine, not just from us.
        await async_engine.add_request("long", "Once upon a time", SamplingParams(max_tokens=2))

    with running(llm) as async_engine:
        asyncio.run(main(async_engine))


def test_idle_engine_does_not_spin(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = 0
    step = llm.engine.step

    def counting_step() -> list[RequestOutput]:
        nonlocal steps
        steps += 1
        return step()

    monkeypatch.setattr(llm.engine, "step", counting_step)
    with running(llm) as async_engine:
        asyncio.run(anext(async_engine.generate("r", "Hi", SamplingParams(max_tokens=1))))
        time.sleep(0.1)
        steps_before, cpu_before = steps, time.process_time()
        time.sleep(0.5)
        assert steps == steps_before
        assert time.process_time() - cpu_before < 0.1


def test_failing_step_fails_in_flight_requests_and_engine_goes_on(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    step = llm.engine.step

    def step_failing_once() -> list[RequestOutput]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected failure")
        return step()

    monkeypatch.setattr(llm.engine, "step", step_failing_once)

    async def run(async_engine: AsyncEngine, request_id: str, params: SamplingParams) -> str:
        return "".join(
            [o.outputs[0].delta_text async for o in async_engine.generate(request_id, "Hello", params)]
        )

    async def main(async_engine: AsyncEngine) -> None:
        first = await asyncio.gather(
            run(async_engine, "a", LONG), run(async_engine, "b", LONG), return_exceptions=True
        )
        assert [type(result) for result in first] == [RequestFailedError, RequestFailedError]
        assert await run(async_engine, "c", SamplingParams(temperature=0, max_tokens=4))

    with running(llm) as async_engine:
        asyncio.run(main(async_engine))


def test_shutdown_ends_streams(llm: LLM) -> None:
    async def main(async_engine: AsyncEngine) -> None:
        stream = await async_engine.add_request("long", "Once upon a time", LONG)
        await anext(stream)
        async_engine.shutdown()
        with pytest.raises(EngineClosedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineClosedError):
            await async_engine.add_request("late", "Hi", SamplingParams())

    with running(llm) as async_engine:
        asyncio.run(main(async_engine))


def test_engine_failure_fails_only_the_requests_in_flight_over_http(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = True
    step = llm.engine.step

    def step_failing_on_demand() -> list[RequestOutput]:
        if failing:
            raise RuntimeError("injected failure")
        return step()

    monkeypatch.setattr(llm.engine, "step", step_failing_on_demand)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    async def main(async_engine: AsyncEngine) -> None:
        nonlocal failing
        transport = httpx.ASGITransport(app=build_app(async_engine, "m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 500
            error = response.json()["error"]
            assert error.keys() == {"message", "type", "param", "code"}
            assert (error["type"], error["code"]) == ("server_error", "engine_error")

            streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
            assert streamed.status_code == 200  # sent before the failure
            *_, error_event, done = [line for line in streamed.text.splitlines() if line]
            assert '"code":"engine_error"' in error_event and done == "data: [DONE]"

            failing = False
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]

    with running(llm) as async_engine:
        asyncio.run(main(async_engine))
