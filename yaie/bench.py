"""Load-test any OpenAI-compatible server (yaie, vLLM, llama.cpp's llama-server) over HTTP.

Used by `benchmarks/serve_bench.py` (any server) and `yaie bench` (starts a yaie server first):

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8080 --concurrency 1,8,32 \\
        --num-requests 64 --prompt-set short --max-tokens 128 --ignore-eos --label llama.cpp \\
        --out results/llamacpp-short.json

Each concurrency level sends exactly --num-requests streaming requests to /v1/chat/completions,
from --concurrency workers that each keep one request in flight, and reports per level:

- output tok/s: all output tokens of the level / the level's wall time (first send to last finish);
- TTFT (time to first token): from sending the request to the first chunk that carries text;
- TPOT (time per output token), per request: (e2e - ttft) / (output tokens - 1);
- e2e latency: from sending the request to the end of its stream;
- requests and errors (HTTP errors, error events in the stream, timeouts);
- with speculative decoding on the server: the acceptance rate (accepted / proposed draft
  tokens) and the mean accepted length (tokens a verifying step yields: 1 + accepted / drafts),
  from the server's spec_decode_* counters in /metrics before and after the level (vLLM's
  names, with or without its `vllm:` prefix).

Output tokens are the server's own count (usage.completion_tokens, asked for through
stream_options.include_usage); a server that sends no usage is counted in text chunks instead.
--ignore-eos makes every request produce exactly --max-tokens tokens, so engines are compared on the
same work; servers without an `ignore_eos` field get a -100 logit bias on the EOS id instead
(--eos-logit-bias 2 for the bundled SmolLM2, whose <|im_end|> is id 2).

The prompt sets are built deterministically, so every engine sees the same requests:

- short: ~20 varied short chat questions, cycled;
- long: distinct ~1,000-token prompts (records of made-up measurements + a question), a new one for
  every request of every level, so no prefix cache can reuse an earlier prompt;
- shared-prefix: one ~1,000-token system prompt shared by all requests + 16 different questions,
  the case a prefix cache is for.

Only loopback base URLs are accepted: this workplace forbids load tests against any other address.

`fit_cost_model` (`yaie bench --fit-cost-model`) measures the engine itself instead: it times
`Engine.step` over prefills of several lengths and decodes of several batch sizes and contexts,
and fits the step-time model `yaie simulate` runs on; `fit_front_end` then load-tests a server
running the same engine to price its front end (see yaie/simulate/cost_model.py).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from yaie.engine.step_shape import STEP_METRICS, StepShape, StepTotals

if TYPE_CHECKING:
    from yaie.config import EngineConfig
    from yaie.engine.engine import Engine
    from yaie.simulate.cost_model import CostModel

SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about autumn rain.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me three tips for better sleep.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "How does a binary search work?",
    "Suggest a name for a friendly robot.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.",
    "What are the main ingredients of a pancake?",
    "Describe the water cycle for a ten-year-old.",
    "What is a prime number? Give two examples.",
    "Write a short motivational sentence for a Monday.",
    "How many legs does a spider have, and why?",
    "What is the boiling point of water at sea level?",
    "Explain what an API is in simple terms.",
    "List four planets of the solar system.",
)

SHARED_PREFIX_QUESTIONS = (
    "Which city had the highest reading on day 3?",
    "What is the average of the first five values?",
    "Which instrument appears most often?",
    "Name one record measured in Oslo.",
    "What was the lowest value overall?",
    "How many records mention a humidity sensor?",
    "Which day had the most records?",
    "Summarize the records in two sentences.",
    "Is there any record with a value above 900?",
    "Which cities appear more than once?",
    "What is the unit used in the records?",
    "Describe a trend you notice in the values.",
    "Which record looks like an outlier?",
    "List three different instruments from the log.",
    "What was measured in Lima?",
    "Give the record number of the first entry.",
)

_CITIES = ("Oslo", "Lima", "Cairo", "Perth", "Quito", "Dakar", "Hanoi", "Tromso", "Austin", "Kyoto")
_INSTRUMENTS = ("thermometer", "barometer", "humidity sensor", "anemometer", "rain gauge", "lux meter")
_ADJECTIVES = ("calibrated", "portable", "rooftop", "backup", "coastal", "new", "older", "shaded")
_CHARS_PER_TOKEN = 2.9  # measured on these records with SmolLM2's tokenizer (one token per digit)


def records_text(rng: random.Random, approx_tokens: int) -> str:
    """Made-up measurement records, about approx_tokens long, fully determined by rng."""
    lines = []
    length = 0
    number = rng.randrange(1000, 9000)
    while length < approx_tokens * _CHARS_PER_TOKEN:
        line = (
            f"Record {number}: on day {rng.randrange(1, 31)} the {rng.choice(_ADJECTIVES)} "
            f"{rng.choice(_INSTRUMENTS)} in {rng.choice(_CITIES)} read {rng.randrange(0, 1000)} units."
        )
        lines.append(line)
        length += len(line) + 1
        number += 1
    return "\n".join(lines)


def build_messages(prompt_set: str, index: int, level: int, long_tokens: int) -> list[dict[str, str]]:
    """The chat messages of request `index` of concurrency level number `level`."""
    if prompt_set == "short":
        return [{"role": "user", "content": SHORT_QUESTIONS[index % len(SHORT_QUESTIONS)]}]
    if prompt_set == "long":
        rng = random.Random(f"long-{level}-{index}")
        text = records_text(rng, long_tokens)
        question = SHARED_PREFIX_QUESTIONS[index % len(SHARED_PREFIX_QUESTIONS)]
        return [{"role": "user", "content": f"Here is a log of measurements.\n{text}\n\n{question}"}]
    if prompt_set == "shared-prefix":
        system = "You answer questions about this log of measurements.\n" + records_text(
            random.Random("shared-prefix"), long_tokens
        )
        question = SHARED_PREFIX_QUESTIONS[index % len(SHARED_PREFIX_QUESTIONS)]
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]
    raise ValueError(f"unknown prompt set {prompt_set!r}")


@dataclass
class RequestResult:
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    duration_s: float
    requests: list[RequestResult] = field(default_factory=list)
    # The server's speculative-decoding counters (SPEC_COUNTERS) and the sums of its engine's
    # steps (STEP_COUNTERS) over the level, set by run_bench; None where the server keeps none.
    spec: dict[str, float] | None = None
    steps: dict[str, float] | None = None

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.requests if r.error is None]
        output_tokens = sum(r.output_tokens for r in ok)
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpots = [t for r in ok if (t := r.tpot_s) is not None]
        e2es = [r.e2e_s for r in ok if r.e2e_s is not None]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        return {
            "concurrency": self.concurrency,
            "num_requests": self.num_requests,
            "ok": len(ok),
            "errors": len(self.requests) - len(ok),
            "duration_s": self.duration_s,
            "output_tokens": output_tokens,
            "output_tok_s": output_tokens / self.duration_s if self.duration_s > 0 else 0.0,
            "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
            "mean_output_tokens": output_tokens / len(ok) if ok else None,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90),
            "ttft_p99_s": percentile(ttfts, 99),
            "tpot_p50_s": percentile(tpots, 50),
            "tpot_p99_s": percentile(tpots, 99),
            "e2e_p50_s": percentile(e2es, 50),
            "e2e_p99_s": percentile(e2es, 99),
            "error_samples": sorted({r.error for r in self.requests if r.error})[:5],
            "engine_steps": self.steps,
            **self.spec_summary(),
        }

    def spec_summary(self) -> dict[str, float | None]:
        drafts = self.spec["spec_decode_num_drafts"] if self.spec else 0
        if not self.spec or not drafts:
            return {"spec_acceptance_rate": None, "spec_mean_accepted_length": None}
        accepted = self.spec["spec_decode_num_accepted_tokens"]
        return {
            "spec_acceptance_rate": accepted / self.spec["spec_decode_num_draft_tokens"],
            "spec_mean_accepted_length": 1 + accepted / drafts,
        }


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
# The sums of yaie's engine steps, by metric name: the StepTotals field each counts.
STEP_COUNTERS = {name: attribute for attribute, name, _ in STEP_METRICS}


def server_counters(exposition: str, names: Iterable[str]) -> dict[str, float] | None:
    """The totals of the counters `names` in a Prometheus exposition (yaie's names, or vLLM's
    with `vllm:` before them); None if it lacks any of them."""
    wanted = set(names)
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:  # counters' samples end in _total (summed over labels)
            name = sample.name.removeprefix("vllm:")
            if name.endswith("_total") and (counter := name.removesuffix("_total")) in wanted:
                totals[counter] = totals.get(counter, 0.0) + sample.value
    return totals if len(totals) == len(wanted) else None


def spec_counters(metrics_text: str) -> dict[str, float] | None:
    """SPEC_COUNTERS' totals in a Prometheus exposition; None if it lacks any of them."""
    return server_counters(metrics_text, SPEC_COUNTERS)


def percentile(values: list[float], pct: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@contextmanager
def yaie_server(
    serve_args: list[str],
    log: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`yaie serve` with `serve_args` on a free loopback port, answering /health when yielded as
    (its process, its base URL); stopped with SIGTERM (killed after 30 s) on exit. Its output
    goes to `log` if given, else to ours; `env` replaces our environment if given."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "yaie.cli", "serve", *serve_args, "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    print(f"starting: {' '.join(command[2:])}", file=sys.stderr)
    if log is None:
        process = subprocess.Popen(command, env=env)
    else:
        with log.open("wb") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-4000:] if log else ""
                raise SystemExit(f"error: the server exited with code {process.returncode}\n{tail}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise SystemExit(f"error: the server did not answer /health within {timeout_s:.0f} s")
            time.sleep(0.25)
        yield process, base_url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


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


def counters_between(before: str | None, after: str | None, names: Iterable[str]) -> dict[str, float] | None:
    """How much the counters `names` grew from one exposition to the next; None without them."""
    first = None if before is None else server_counters(before, names)
    last = None if after is None else server_counters(after, names)
    if first is None or last is None:
        return None
    return {name: last[name] - first[name] for name in first}


def _fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def results_table(label: str, summaries: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{label}: streaming chat completions")
    speculating = any(s["spec_acceptance_rate"] is not None for s in summaries)
    spec_headers = ("accepted", "mean len") if speculating else ()
    for header in (
        "conc",
        "reqs",
        "errors",
        "out tok/s",
        "TTFT p50 s",
        "p90",
        "p99",
        "TPOT p50 ms",
        "p99",
        "e2e p50 s",
        "p99",
        "prompt tok",
        "out tok",
        *spec_headers,
    ):
        table.add_column(header, justify="right")
    for s in summaries:
        table.add_row(
            str(s["concurrency"]),
            str(s["num_requests"]),
            str(s["errors"]),
            f"{s['output_tok_s']:.1f}",
            _fmt(s["ttft_p50_s"]),
            _fmt(s["ttft_p90_s"]),
            _fmt(s["ttft_p99_s"]),
            _fmt(s["tpot_p50_s"], 1e3, 1),
            _fmt(s["tpot_p99_s"], 1e3, 1),
            _fmt(s["e2e_p50_s"], digits=2),
            _fmt(s["e2e_p99_s"], digits=2),
            _fmt(s["mean_prompt_tokens"], digits=0),
            _fmt(s["mean_output_tokens"], digits=1),
            *((_fmt(s["spec_acceptance_rate"], digits=2), _fmt(s["spec_mean_accepted_length"], digits=2))
              if speculating else ()),
        )  # fmt: skip
    return table


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark an OpenAI-compatible server on loopback with streaming chat completions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (loopback only)")
    parser.add_argument("--model", default="", help="model name to send; default: the first of /v1/models")
    parser.add_argument("--concurrency", type=int_list, default="1,8,32", help="comma-separated levels")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--prompt-set", choices=("short", "long", "shared-prefix"), default="short")
    parser.add_argument("--long-prompt-tokens", type=int, default=1000, help="approx. size of long prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true')
    parser.add_argument(
        "--eos-logit-bias",
        type=int_list,
        default=[],
        metavar="ID[,ID]",
        help="like --ignore-eos, but by sending logit_bias {ID: -100} (for servers without ignore_eos)",
    )
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token")
    parser.add_argument(
        "--extra-body",
        type=json_object,
        default={},
        help="merged into every body, e.g. '{\"cache_prompt\": false}'",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request limit in seconds")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first")
    parser.add_argument("--label", default="", help="engine name in the table and JSON; default: host:port")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.max_tokens < 1 or args.timeout <= 0 or args.warmup < 0:
        parser.error("--num-requests and --max-tokens must be >= 1, --timeout > 0, --warmup >= 0")
    return args


# Step shapes timed for the fit, chosen so that every coefficient of the cost model moves on its
# own: one prompt of each length (prefill: many tokens, one sample); batches of each size at each
# context (decode: one token and one sample per sequence; their prompts, several to a step, are
# prefills that sample several times, and the long ones are chunks that sample nothing); and
# decoding batches that prompts join one per step (mixed steps, as a server's are while requests
# come and go).
FIT_PROMPT_LENS = (16, 64, 256, 1024, 2048)
FIT_BATCHES = (1, 4, 8, 16, 32)
FIT_CONTEXTS = (32, 512)
FIT_DECODE_STEPS = 16
FIT_MIXED_BATCHES = (4, 16)
FIT_JOINING_PROMPT_LENS = (8, 32, 128, 512)


def fit_cost_model(config: EngineConfig) -> tuple[CostModel, float]:
    """Build the engine `config` describes, time its steps, and fit a cost model to them.

    Returns the model and its median relative error over the timed steps.
    """
    from yaie.engine.engine import Engine  # imports torch: only here, so `yaie simulate` need not
    from yaie.simulate.cost_model import CostModel  # yaie.simulate reuses this module's percentile

    engine = Engine(config)
    shapes, seconds = time_steps(engine)
    settings = {
        "model": str(engine.model_info.path),
        "block_size": config.block_size,
        "num_kv_blocks": engine.block_pool.num_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "prefix_caching": config.enable_prefix_caching,
    }
    cost = CostModel.fit(shapes, seconds, settings)
    errors = [abs(cost.step_time(shape) - t) / t for shape, t in zip(shapes, seconds, strict=True)]
    return cost, percentile(errors, 50) or 0.0


def time_steps(engine: Engine) -> tuple[list[StepShape], list[float]]:
    """The shapes and times of the steps the fit runs on `engine` (see FIT_PROMPT_LENS)."""
    config = engine.config
    budget = min(config.max_num_batched_tokens, engine.max_model_len - FIT_DECODE_STEPS)
    _run_timed(engine, [min(16, budget)], 4, [], [])  # warm-up: first-call costs are not step costs
    shapes: list[StepShape] = []
    seconds: list[float] = []
    for length in FIT_PROMPT_LENS:
        _run_timed(engine, [min(length, budget)], 1, shapes, seconds)
    for batch in FIT_BATCHES:
        for context in FIT_CONTEXTS:
            lengths = [min(context, budget)] * min(batch, config.max_num_seqs)
            _run_timed(engine, lengths, FIT_DECODE_STEPS, shapes, seconds)
    for batch in FIT_MIXED_BATCHES:
        lengths = [min(FIT_CONTEXTS[0], budget)] * min(batch, config.max_num_seqs - 1)
        joining = tuple(min(length, budget - batch) for length in FIT_JOINING_PROMPT_LENS)
        _run_timed(engine, lengths, FIT_DECODE_STEPS, shapes, seconds, joining)
    return shapes, seconds


def _run_timed(
    engine: Engine,
    prompt_lens: list[int],
    max_tokens: int,
    shapes: list[StepShape],
    seconds: list[float],
    joining: tuple[int, ...] = (),
) -> None:
    """Run requests of random (so uncached) prompts to the end, recording each step's shape and
    time (what the step added to the engine's StepTotals). Once they decode, a one-token request
    of each `joining` length joins, one per step."""
    from yaie.sampling_params import SamplingParams

    rng = random.Random(len(shapes))
    vocab = engine.model_config.vocab_size

    def add(length: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(None, [rng.randrange(vocab) for _ in range(length)], params)

    for length in prompt_lens:
        add(length, max_tokens)
    waiting = list(joining)
    while engine.has_unfinished_requests():
        before = replace(engine.step_totals)
        engine.step()
        after = engine.step_totals
        if after.num_steps == before.num_steps:
            continue  # the step computed nothing
        shape = StepShape(
            after.num_prefill_tokens - before.num_prefill_tokens,
            after.num_decode_tokens - before.num_decode_tokens,
            after.num_kv_tokens - before.num_kv_tokens,
            after.num_sampled - before.num_sampled,
        )
        shapes.append(shape)
        seconds.append(after.busy_s - before.busy_s)
        if waiting and shape.num_sampled:  # the batch is past its prompts: it decodes
            add(waiting.pop(0), 1)


# Load-test levels that price the front end (CostModel.with_front_end): (clients, requests, max
# tokens). One client measures a request's time outside the engine; the others, at two output
# lengths, how much the front end's work for requests and for outputs lengthens the steps.
FRONT_END_LEVELS = ((1, 8, 16), (4, 16, 64), (16, 32, 16), (16, 32, 64))


def fit_front_end(base_url: str, cost: CostModel, console: Console) -> CostModel:
    """`cost` with the front end's terms, from FRONT_END_LEVELS against the yaie server at
    `base_url` (running the engine `cost` was fitted on), short prompts, streamed."""
    from yaie.simulate.cost_model import ServedLevel

    served: list[ServedLevel] = []
    for clients, num_requests, max_tokens in FRONT_END_LEVELS:
        config = BenchConfig(
            base_url=base_url, model="", prompt_set="short", max_tokens=max_tokens, temperature=0.0,
            ignore_eos=True, eos_logit_bias=[], extra_body={}, api_key=None, timeout_s=300.0,
            long_prompt_tokens=1000,
        )  # fmt: skip
        [level] = asyncio.run(run_bench(config, [clients], num_requests, 1, console))
        summary = level.summary()
        if level.steps is None or summary["errors"]:
            raise SystemExit(f"the front-end level of {clients} clients failed: {summary['error_samples']}")
        totals = StepTotals()
        for name, attribute in STEP_COUNTERS.items():
            value = level.steps[name]
            setattr(totals, attribute, value if attribute == "busy_s" else round(value))
        served.append(ServedLevel(totals, num_requests, clients, level.duration_s))
    return cost.with_front_end(served)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_loopback(args.base_url)
    label = args.label or (urlsplit(args.base_url).netloc or args.base_url)
    config = BenchConfig(
        base_url=args.base_url,
        model=args.model,
        prompt_set=args.prompt_set,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        eos_logit_bias=args.eos_logit_bias,
        extra_body=args.extra_body,
        api_key=args.api_key,
        timeout_s=args.timeout,
        long_prompt_tokens=args.long_prompt_tokens,
    )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)  # the table is wide; keep it whole in logs and pipes
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    levels = asyncio.run(run_bench(config, args.concurrency, args.num_requests, args.warmup, console))
    summaries = [level.summary() for level in levels]
    console.print(results_table(label, summaries))
    for summary in summaries:
        for error in summary["error_samples"]:
            console.print(f"[red]concurrency {summary['concurrency']} error:[/red] {error}", markup=True)

    if args.out is not None:
        report = {
            "label": label,
            "started_utc": started,
            "base_url": args.base_url,
            "model": config.model,
            "prompt_set": args.prompt_set,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "eos_logit_bias": args.eos_logit_bias,
            "extra_body": args.extra_body,
            "num_requests": args.num_requests,
            "warmup": args.warmup,
            "levels": [
                {**summary, "requests": [asdict(r) for r in level.requests]}
                for summary, level in zip(summaries, levels, strict=True)
            ],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.out}")
    errors = sum(s["errors"] for s in summaries)
    return 1 if errors == len(levels) * args.num_requests else 0


if __name__ == "__main__":
    sys.exit(main())
