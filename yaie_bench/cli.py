"""The load generator's command line (`python -m yaie_bench`, `benchmarks/serve_bench.py`):

    python -m yaie_bench --base-url http://127.0.0.1:8080 --concurrency 1,8,32 \\
        --num-requests 64 --prompt-set short --max-tokens 128 --ignore-eos --label llama.cpp \\
        --out results/llamacpp-short.json

reports per level output tok/s, TTFT, TPOT and end-to-end latency percentiles, errors, and with
speculative decoding on the server its acceptance (results.py), as a table and optionally JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console

from yaie_bench.load_generator import BenchConfig, check_loopback, run_bench
from yaie_bench.prompts import PROMPT_SETS
from yaie_bench.report import results_table


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
    parser.add_argument("--prompt-set", choices=PROMPT_SETS, default="short")
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
