"""The load generator: streaming chat completions against an OpenAI-compatible server on loopback.

Each concurrency level sends exactly `num_requests` streaming requests to /v1/chat/completions,
from `concurrency` workers that each keep one request in flight (results.py says what is
measured). Output tokens are the server's own count (usage.completion_tokens, asked for through
stream_options.include_usage); a server that sends no usage is counted in text chunks instead.
`ignore_eos` makes every request produce exactly `max_tokens` tokens, so engines are compared on
the same work; servers without an `ignore_eos` field get a -100 logit bias on the EOS id instead
(`eos_logit_bias`).

Only loopback base URLs are accepted: this workplace forbids load tests against any other address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from yaie_bench.counters import SPEC_COUNTERS, STEP_COUNTERS, counters_between
from yaie_bench.prompts import build_messages
from yaie_bench.results import LevelResult, RequestResult


def check_loopback(base_url: str) -> None:
    """Refuse any base URL whose host is not a loopback address."""
    host = urlsplit(base_url).hostname
    if host is None:
        raise SystemExit(f"--base-url {base_url!r} has no host")
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(
            f"refusing to load-test {host!r}: only loopback addresses (127.0.0.0/8, ::1, localhost) "
            "are allowed here"
        )


async def stream_one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> RequestResult:
    """Send one streaming chat completion and time it from its SSE `data:` lines."""
    result = RequestResult()
    text_chunks = 0
    finished = False
    start = time.perf_counter()
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            result.error = f"HTTP {response.status_code}: {detail}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                finished = True
                break
            event = json.loads(data)
            if event.get("error"):
                result.error = f"stream error: {json.dumps(event['error'])[:200]}"
                return result
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    text_chunks += 1
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
            usage = event.get("usage")
            if usage:
                result.usage_reported = True
                result.output_tokens = int(usage.get("completion_tokens") or 0)
                if usage.get("prompt_tokens") is not None:
                    result.prompt_tokens = int(usage["prompt_tokens"])
    result.e2e_s = time.perf_counter() - start
    if not finished:
        result.error = "stream ended without data: [DONE]"
    elif not result.usage_reported:
        result.output_tokens = text_chunks
    return result


@dataclass
class BenchConfig:
    base_url: str
    model: str
    prompt_set: str
    max_tokens: int
    temperature: float
    ignore_eos: bool
    eos_logit_bias: list[int]
    extra_body: dict[str, Any]
    api_key: str | None
    timeout_s: float
    long_prompt_tokens: int

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/chat/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, index: int, level: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": build_messages(self.prompt_set, index, level, self.long_prompt_tokens),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.eos_logit_bias:
            body["logit_bias"] = {str(token): -100 for token in self.eos_logit_bias}
        elif self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


async def timed_request(
    client: httpx.AsyncClient, config: BenchConfig, index: int, level: int
) -> RequestResult:
    try:
        return await asyncio.wait_for(
            stream_one(client, config.url, config.body(index, level), config.headers), config.timeout_s
        )
    except (asyncio.TimeoutError, httpx.TimeoutException):
        return RequestResult(error=f"timeout after {config.timeout_s:g}s")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(error=f"{type(exc).__name__}: {exc}"[:200])


async def run_level(
    client: httpx.AsyncClient,
    config: BenchConfig,
    concurrency: int,
    num_requests: int,
    level: int,
    progress: Progress,
) -> LevelResult:
    """Send exactly num_requests requests from `concurrency` workers; each worker keeps one in flight."""
    task = progress.add_task(f"concurrency {concurrency}", total=num_requests)
    next_index = iter(range(num_requests))
    results: list[RequestResult | None] = [None] * num_requests

    async def worker() -> None:
        for index in next_index:  # a shared iterator: every index is taken exactly once
            results[index] = await timed_request(client, config, index, level)
            progress.advance(task)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
    duration = time.perf_counter() - start
    done = [r for r in results if r is not None]
    return LevelResult(concurrency=concurrency, num_requests=num_requests, duration_s=duration, requests=done)


async def resolve_model(client: httpx.AsyncClient, config: BenchConfig) -> str:
    response = await client.get(config.base_url.rstrip("/") + "/v1/models", headers=config.headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise SystemExit("/v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def run_bench(
    config: BenchConfig, levels: list[int], num_requests: int, warmup: int, console: Console
) -> list[LevelResult]:
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        if not config.model:
            config.model = await resolve_model(client, config)
            console.print(f"model: {config.model}")
        for index in range(warmup):  # not measured: first-request costs (compilation, allocation)
            result = await timed_request(client, config, index, level=-1)
            if result.error:
                raise SystemExit(f"warm-up request failed: {result.error}")
        outcomes = []
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            for level, concurrency in enumerate(levels):
                before = await metrics_text(client, config)
                outcome = await run_level(client, config, concurrency, num_requests, level, progress)
                after = await metrics_text(client, config)
                outcome.spec = counters_between(before, after, SPEC_COUNTERS)
                outcome.steps = counters_between(before, after, STEP_COUNTERS)
                outcomes.append(outcome)
    return outcomes


async def metrics_text(client: httpx.AsyncClient, config: BenchConfig) -> str | None:
    """The server's /metrics now; None where it serves none."""
    response = await client.get(config.base_url.rstrip("/") + "/metrics", headers=config.headers)
    return response.text if response.status_code == 200 else None
