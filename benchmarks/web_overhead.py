"""What open engine pages cost: 8-client decode throughput with ten /engine/events streams open
vs none, in the same run, against the same server.

    python benchmarks/web_overhead.py [--pages 10] [--concurrency 8] [--num-requests 48]
        [--max-tokens 128] [--repeats 6] [--quantization none] [--out benchmarks/results/web_overhead.json]
        [-- serve args]

One `yaie serve` is started; the two modes then alternate (none, pages, none, pages, ...) so that
drift in the machine's speed hits both alike. Each round is one `yaie bench`-style level:
`--concurrency` clients streaming greedy, ignore_eos chat completions of the short prompt set.
In the `pages` mode, `--pages` clients read /engine/events the whole round, as open engine
views would. The report gives each mode's output tok/s (median over the rounds), the slowdown
(the median over the pairs of rounds of 1 - with pages / without, each pair run back to back, so
slow drift cancels), and what the snapshots cost the engine thread (`cost_ms` of the events).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx
from bench_utils import add_quantization_arg, machine_info, make_console, write_report

from yaie.bench import BenchConfig, run_bench, yaie_server


async def read_pages(base_url: str, num_pages: int, stop: asyncio.Event) -> list[float]:
    """Hold `num_pages` event streams open until `stop`; the snapshots' costs in ms.

    What is measured is what serving the pages costs the server, not what a browser spends
    drawing them (on another machine, or on this one, where it would be a cost of the browser):
    so one page parses its events (for their `cost_ms`) and the others only take in the bytes,
    which keeps the load generator's own share of these two cores small."""
    costs: list[float] = []

    async def page(client: httpx.AsyncClient, parse: bool) -> None:
        async with client.stream("GET", f"{base_url}/engine/events") as response:
            response.raise_for_status()
            if parse:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        costs.append(json.loads(line[6:])["cost_ms"])
                    if stop.is_set():
                        return
            async for _ in response.aiter_raw():
                if stop.is_set():
                    return

    async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
        await asyncio.gather(*(page(client, parse=index == 0) for index in range(num_pages)))
    return costs


async def measure(config: BenchConfig, args: argparse.Namespace, pages: int) -> dict[str, Any]:
    console = make_console()
    stop = asyncio.Event()
    readers = asyncio.create_task(read_pages(config.base_url, pages, stop)) if pages else None
    try:
        [level] = await run_bench(config, [args.concurrency], args.num_requests, 0, console)
    finally:
        stop.set()
    costs = await readers if readers else []
    summary = level.summary()
    if summary["errors"]:
        raise SystemExit(f"requests failed: {summary['error_samples']}")
    return {"pages": pages, "output_tok_s": summary["output_tok_s"], "tpot_p50_s": summary["tpot_p50_s"],
            "snapshot_cost_ms": costs}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6, help="rounds of each mode")
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/web_overhead.json"))
    parser.add_argument("serve_args", nargs="*", help="after --: options for `yaie serve`")
    args = parser.parse_args()
    console = make_console()

    serve_args = [*args.serve_args, "--quantization", args.quantization, "--log-level", "warning"]
    with yaie_server(serve_args) as (_, base_url):
        config = BenchConfig(
            base_url=base_url, model="", prompt_set="short", max_tokens=args.max_tokens, temperature=0.0,
            ignore_eos=True, eos_logit_bias=[], extra_body={}, api_key=None, timeout_s=600,
            long_prompt_tokens=1000,
        )  # fmt: skip
        asyncio.run(run_bench(config, [args.concurrency], args.concurrency, 1, console))  # warm up
        rounds = []
        for _ in range(args.repeats):
            for pages in (0, args.pages):
                rounds.append(asyncio.run(measure(config, args, pages)))
                console.print(f"{pages:>2} pages: {rounds[-1]['output_tok_s']:.1f} tok/s")

    def median_tok_s(pages: int) -> float:
        return statistics.median(r["output_tok_s"] for r in rounds if r["pages"] == pages)

    costs = [cost for r in rounds for cost in r["snapshot_cost_ms"]]
    pairs = [
        1 - paged["output_tok_s"] / plain["output_tok_s"]
        for plain, paged in zip(rounds[::2], rounds[1::2], strict=True)
    ]
    without, with_pages = median_tok_s(0), median_tok_s(args.pages)
    report = {
        "machine": machine_info(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rounds": [{k: v for k, v in r.items() if k != "snapshot_cost_ms"} for r in rounds],
        "output_tok_s_without_pages": without,
        "output_tok_s_with_pages": with_pages,
        # Each round with pages against the round without just before it: the spread shows
        # how much of the difference is the machine's noise.
        "slowdown_per_pair": pairs,
        "slowdown": statistics.median(pairs),
        "snapshot_cost_ms_median": statistics.median(costs) if costs else None,
        "snapshot_cost_ms_max": max(costs, default=None),
    }
    console.print(
        f"without pages {without:.1f} tok/s, with {args.pages}: {with_pages:.1f} tok/s "
        f"(medians); slowdown, median of {len(pairs)} pairs: {100 * report['slowdown']:.2f}% (pairs "
        f"{', '.join(f'{100 * p:+.1f}%' for p in pairs)}); snapshot cost median "
        f"{report['snapshot_cost_ms_median']} ms"
    )
    write_report(args.out, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
