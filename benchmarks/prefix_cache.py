"""Prefix caching through a real server: time to first token when every request starts with the
same long system prompt, with the cache on and then off, in one run (GitHub issue 5).

    python benchmarks/prefix_cache.py [--prompt-tokens 1000] [--num-questions 16] [--max-tokens 32]
        [--concurrency 16] [--num-kv-blocks 1280] [--quantization none]
        [--out benchmarks/results/prefix_cache.json]

The script starts `yaie serve` on a free loopback port twice, once as is and once with
--no-prefix-caching. Each server first answers one warm-up request with the system prompt, which in
the "on" run leaves that prompt in the cache, as a long-lived server would have it. Then the same
questions (a ~1,000-token log of made-up measurements as the system prompt, 16 different short
questions) go through two variants:

- sequential: one request at a time, so TTFT is one request's own prefill;
- concurrent: `--concurrency` requests in flight (all 16 by default), so the uncached prefills
  queue behind each other in the engine's token budget, as they would under real traffic.

Every question carries a tag of its variant at the start of the user message, so the only thing a
request can find in the cache is the system prompt and the chat template around it, never an
earlier variant's question. Requests stream (temperature 0, stream_options.include_usage), and TTFT
runs from sending a request to the first chunk carrying text; `wall` is the variant's first send to
its last finish. The issue's floor: cached-request TTFT at most 0.2x uncached (checked on the
median of each variant).

The machine is shared, so **bg cores** says how many cores other processes kept busy during each
variant (everything but this script and its server); a figure measured with much more than ~0.3
is not to be trusted. The load average before and after is in the JSON report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_utils import (
    CpuSample,
    add_quantization_arg,
    cpu_sample,
    machine_info,
    make_console,
    write_report,
)  # benchmarks/ is the script's folder
from rich.table import Table

from yaie.simulate.report import percentile
from yaie_bench.launcher import yaie_server
from yaie_bench.prompts import SHARED_PREFIX_QUESTIONS, records_text

MODEL_NAME = "smol"
STARTUP_TIMEOUT_S = 300
FLOOR = 0.2  # the bound on cached / uncached TTFT
Messages = list[dict[str, str]]


# -- the server --------------------------------------------------------------------------------


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def cpu_seconds(self) -> float:
        """CPU time the server process has used so far (user + system, all threads)."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            # The command name (field 2) may hold spaces; utime and stime are fields 14 and 15.
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def serve(
    log_dir: Path, num_kv_blocks: int, quantization: str, prefix_caching: bool
) -> Iterator[ServerProcess]:
    """`yaie serve` on a free loopback port, healthy when yielded, stopped with SIGTERM after."""
    serve_args = ["--served-model-name", MODEL_NAME, "--num-kv-blocks", str(num_kv_blocks)]
    serve_args += ["--quantization", quantization, "--log-level", "warning"]
    if not prefix_caching:
        serve_args.append("--no-prefix-caching")
    env = {name: value for name, value in os.environ.items() if not name.startswith("YAIE_")}
    log_path = log_dir / f"server-{'on' if prefix_caching else 'off'}.log"
    with yaie_server(serve_args, log=log_path, env=env, timeout_s=STARTUP_TIMEOUT_S) as (process, base_url):
        yield ServerProcess(process, base_url, log_path)


# -- requests ----------------------------------------------------------------------------------


@dataclass
class Timed:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


async def timed_chat(client: httpx.AsyncClient, messages: Messages, max_tokens: int) -> Timed:
    """One streaming greedy chat completion, timed from the send to its first text and its end."""
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {detail[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # blank separators, the end marker
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            # The first chunk only announces the assistant role; TTFT waits for actual text.
            if ttft is None and any((c.get("delta") or {}).get("content") for c in event["choices"]):
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    end = time.perf_counter() - start
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    return Timed(
        ttft_s=end if ttft is None else ttft,  # no text at all: the whole request is the wait
        e2e_s=end,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        completion_tokens=usage["completion_tokens"],
    )


@dataclass
class Variant:
    mode: str  # "cache on" or "cache off"
    name: str  # "sequential" or "concurrent"
    concurrency: int
    wall_s: float
    background_cores: float
    requests: list[Timed] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ttfts = [r.ttft_s for r in self.requests]
        count = len(self.requests)
        return {
            "mode": self.mode,
            "variant": self.name,
            "concurrency": self.concurrency,
            "num_requests": count,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90),
            "wall_s": self.wall_s,
            "mean_prompt_tokens": sum(r.prompt_tokens for r in self.requests) / count,
            "mean_cached_tokens": sum(r.cached_tokens for r in self.requests) / count,
            "mean_completion_tokens": sum(r.completion_tokens for r in self.requests) / count,
            "background_cores": self.background_cores,
        }


def conversation(system: str, question: str) -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def run_variant(
    server: ServerProcess,
    mode: str,
    name: str,
    conversations: Sequence[Messages],
    concurrency: int,
    max_tokens: int,
) -> Variant:
    """Send every conversation, at most `concurrency` at a time, and time each one."""
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    timeout = httpx.Timeout(600.0, connect=10.0)
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, messages: Messages) -> Timed:
        async with gate:
            return await timed_chat(client, messages, max_tokens)

    async with httpx.AsyncClient(
        base_url=server.base_url, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        before, server_before = cpu_sample(), server.cpu_seconds()
        results = await asyncio.gather(*(one(client, messages) for messages in conversations))
        after, server_after = cpu_sample(), server.cpu_seconds()
    return Variant(
        mode,
        name,
        concurrency,
        wall_s=after.wall_s - before.wall_s,
        background_cores=others_busy(before, after, server_after - server_before),
        requests=list(results),
    )


def others_busy(start: CpuSample, end: CpuSample, server_cpu_s: float) -> float:
    """Cores that processes other than this script and its server kept busy between two samples."""
    others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s) - server_cpu_s
    return max(0.0, others) / max(end.wall_s - start.wall_s, 1e-9)


async def measure_server(
    server: ServerProcess, mode: str, system: str, args: argparse.Namespace
) -> list[Variant]:
    questions = [SHARED_PREFIX_QUESTIONS[i % len(SHARED_PREFIX_QUESTIONS)] for i in range(args.num_questions)]
    # Warm-up: first-request costs, and (cache on) the system prompt in the cache.
    await run_variant(
        server, mode, "warm-up", [conversation(system, "How many records are there?")], 1, args.max_tokens
    )
    variants = []
    for name, concurrency in (("sequential", 1), ("concurrent", args.concurrency)):
        # The tag leads the user message: a request can reuse the system prompt, not earlier questions.
        conversations = [conversation(system, f"[{name} {i}] {q}") for i, q in enumerate(questions)]
        variants.append(await run_variant(server, mode, name, conversations, concurrency, args.max_tokens))
    return variants


# -- report ------------------------------------------------------------------------------------


def ratios(on: Variant, off: Variant) -> dict[str, Any]:
    a, b = on.summary(), off.summary()
    result = {"variant": on.name, "concurrency": on.concurrency}
    for key in ("ttft_p50_s", "ttft_p90_s", "wall_s"):
        result[key.removesuffix("_s") + "_ratio"] = a[key] / b[key]
    result["meets_floor"] = result["ttft_p50_ratio"] <= FLOOR
    return result


def results_table(variants: Sequence[Variant], args: argparse.Namespace) -> Table:
    table = Table(
        title=f"Prefix cache: a ~{args.prompt_tokens}-token system prompt + {args.num_questions} questions, "
        f"{args.max_tokens} tokens each, streaming chat"
    )
    headers = ("variant", "conc", "cache", "TTFT p50 s", "TTFT p90 s", "wall s", "prompt tok", "cached tok")
    for header in (*headers, "bg cores"):
        table.add_column(header, justify="right")
    for variant in variants:
        s = variant.summary()
        table.add_row(
            s["variant"],
            str(s["concurrency"]),
            s["mode"].removeprefix("cache "),
            f"{s['ttft_p50_s']:.3f}",
            f"{s['ttft_p90_s']:.3f}",
            f"{s['wall_s']:.2f}",
            f"{s['mean_prompt_tokens']:.0f}",
            f"{s['mean_cached_tokens']:.0f}",
            f"{s['background_cores']:.2f}",
        )
    return table


def ratio_table(ratio_rows: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="cached / uncached (lower is better)")
    for header in ("variant", "conc", "TTFT p50", "TTFT p90", "wall", f"floor: TTFT p50 <= {FLOOR}"):
        table.add_column(header, justify="right")
    for row in ratio_rows:
        table.add_row(
            row["variant"],
            str(row["concurrency"]),
            f"{row['ttft_p50_ratio']:.3f}",
            f"{row['ttft_p90_ratio']:.3f}",
            f"{row['wall_ratio']:.3f}",
            "[green]met[/]" if row["meets_floor"] else "[red]missed[/]",
        )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="TTFT with a shared system prompt through yaie serve, prefix cache on vs off.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="approx. size of the system prompt")
    parser.add_argument("--num-questions", type=int, default=16, help="requests per variant")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight, concurrent variant")
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=1280,  # 20k tokens: the 16 uncached requests fit at once, so neither run preempts
        help="passed to yaie serve",
    )
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_cache.json"))
    args = parser.parse_args(argv)
    for name in ("prompt_tokens", "num_questions", "max_tokens", "concurrency", "num_kv_blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = make_console()
    machine = machine_info()
    system = "You answer questions about this log of measurements.\n" + records_text(
        random.Random("prefix-cache-benchmark"), args.prompt_tokens
    )
    variants: dict[str, list[Variant]] = {}
    with tempfile.TemporaryDirectory(prefix="yaie-prefix-bench-") as log_dir:
        for mode, caching in (("cache on", True), ("cache off", False)):
            console.print(f"{mode}: starting yaie serve ...")
            with serve(Path(log_dir), args.num_kv_blocks, args.quantization, caching) as server:
                variants[mode] = asyncio.run(measure_server(server, mode, system, args))
    ordered = [v for pair in zip(variants["cache on"], variants["cache off"], strict=True) for v in pair]
    ratio_rows = [
        ratios(on, off) for on, off in zip(variants["cache on"], variants["cache off"], strict=True)
    ]
    console.print(results_table(ordered, args))
    console.print(ratio_table(ratio_rows))
    load_after = machine_info()["load_average"]
    console.print(f"load average before {machine['load_average']}, after {load_after}")

    report = {
        "benchmark": "prefix_cache",
        "machine": machine | {"load_average_after": load_after},
        "config": {
            "prompt_tokens": args.prompt_tokens,
            "num_questions": args.num_questions,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "num_kv_blocks": args.num_kv_blocks,
            "quantization": args.quantization,
            "temperature": 0,
            "floor": FLOOR,
        },
        "results": [v.summary() | {"requests": [asdict(r) for r in v.requests]} for v in ordered],
        "ratios": ratio_rows,
        "meets_floor": all(row["meets_floor"] for row in ratio_rows),
    }
    write_report(args.out, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
