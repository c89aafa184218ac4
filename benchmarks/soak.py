"""Soak a yaie server: many clients, random disconnects, a bounded time; then check that nothing
leaked.

    python benchmarks/soak.py --seconds 60 --clients 64             # starts its own server
    python benchmarks/soak.py --seconds 60 --quantization none      # ... with dense fp32 weights
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --pid 1234

Each client loops: a chat or text completion, streamed or not, with a random max_tokens; about
a third of them hang up part-way (a stream closed after a few events, or a read timeout on a
whole response). At the end, once the server is idle, it reports the errors (5xx and transport
errors other than our own hang-ups), the KV cache still held (`kv_cache_used_bytes` from
/metrics: with --no-prefix-caching every byte held by an idle server is a leak) and the growth
of the server process's resident memory over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from bench_utils import add_quantization_arg  # benchmarks/ is the script's folder
from prometheus_client.parser import text_string_to_metric_families

from yaie_bench.launcher import yaie_server

GRACE_S = 30.0  # for the requests under way when the time is up
PROMPTS = ["Hello", "Once upon a time", "Write a haiku about the sea.", "List three colors."]


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


async def one_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.6
    body: dict[str, object] = {"model": "soak", "max_tokens": rng.randint(1, 64), "stream": stream}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        path, body["prompt"] = "/v1/completions", rng.choice(PROMPTS)
    hang_up = rng.random() < 0.3
    try:
        if stream:
            async with http.stream("POST", path, json=body) as response:
                events = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events += 1
                    # An error event, not a completion whose text happens to say "error".
                    if "error" in json.loads(line[len("data: ") :]):
                        tally.errors.append(line[:200])
                    if hang_up and events >= rng.randint(1, 5):
                        tally.outcomes["hung up mid-stream"] += 1
                        return  # leaving the block closes the connection
                status = response.status_code
        else:
            timeout = httpx.Timeout(60, read=rng.uniform(0.05, 1.0)) if hang_up else None
            response = await http.post(path, json=body, **({"timeout": timeout} if timeout else {}))
            status = response.status_code
    except httpx.ReadTimeout:
        if hang_up:
            tally.outcomes["hung up waiting"] += 1
            return
        raise
    tally.outcomes[str(status)] += 1
    if status >= 500:
        tally.errors.append(f"{status} on {path}")


async def client(base_url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(GRACE_S * 4)) as http:
        while time.monotonic() < deadline:
            try:
                await one_request(http, rng, tally)
            except httpx.HTTPError as exc:
                tally.errors.append(f"{type(exc).__name__}: {exc}")


async def soak(base_url: str, clients: int, seconds: float) -> Tally:
    """`clients` clients for `seconds`; requests still running GRACE_S after that are cut off
    (their connections closed, one more disconnect for the server), so the run is bounded."""
    tally = Tally()
    deadline = time.monotonic() + seconds
    tasks = [asyncio.create_task(client(base_url, seed, deadline, tally)) for seed in range(clients)]
    _, late = await asyncio.wait(tasks, timeout=seconds + GRACE_S)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    tally.outcomes["cut off at the end"] += len(late)
    return tally


def wait_idle(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once nothing runs or waits (the gauges lag a step behind the responses)."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(base_url)
        if now["num_requests_running"] == now["num_requests_waiting"] == 0 or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", help="a running server (default: start one with --no-prefix-caching)")
    parser.add_argument("--pid", type=int, help="the running server's process, for its memory")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    add_quantization_arg(parser)  # of the server it starts
    args = parser.parse_args()
    started_here = args.base_url is None
    with contextlib.ExitStack() as stack:
        if started_here:
            serve_args = ["--served-model-name", "soak", "--no-prefix-caching"]
            serve_args += ["--num-kv-blocks", str(args.num_kv_blocks), "--quantization", args.quantization]
            process, args.base_url = stack.enter_context(yaie_server(serve_args, log=Path(os.devnull)))
            args.pid = process.pid
        server = psutil.Process(args.pid) if args.pid else None
        rss_before = server.memory_info().rss if server else None
        start = time.monotonic()
        tally = asyncio.run(soak(args.base_url, args.clients, args.seconds))
        elapsed = time.monotonic() - start
        idle = wait_idle(args.base_url)
        rss_after = server.memory_info().rss if server else None
    report = {
        "quantization": args.quantization if started_here else "the running server's",
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "requests": sum(tally.outcomes.values()),
        "outcomes": dict(tally.outcomes),
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "kv_cache_used_bytes_after": idle["kv_cache_used_bytes"],
        "aborted_slow_clients": idle.get("num_requests_aborted_slow_client_total", 0.0),
        "rss_growth_mib": None if rss_before is None else round((rss_after - rss_before) / 2**20, 1),
    }
    print(json.dumps(report, indent=2))
    return 1 if tally.errors or idle["kv_cache_used_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())
