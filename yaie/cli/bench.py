"""`yaie bench`: start a yaie server and load-test it, or fit the cost model `yaie simulate` runs on.

The tools themselves live outside the library, in the `yaie_bench` package, imported only when
this command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from yaie.cli import serve
from yaie.cli.engine_args import engine_config
from yaie.cli.terminal import console


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = commands.add_parser(
        "bench",
        help="start a yaie server with the given serve options and load-test it",
        description="Options not listed here (a model path, --max-num-seqs 32, --no-prefix-caching, ...) "
        "go to `yaie serve`. The load generator is yaie_bench's, which `python -m yaie_bench` (or "
        "benchmarks/serve_bench.py) points at any OpenAI-compatible server on loopback.",
    )
    bench.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    bench.add_argument("--num-requests", default="32", help="requests per level")
    bench.add_argument("--prompt-set", choices=("short", "long", "shared-prefix"), default="short")
    bench.add_argument("--max-tokens", default="128")
    bench.add_argument("--out", help="write the results as JSON here")
    bench.add_argument(
        "--fit-cost-model",
        metavar="PATH",
        help="instead of load-testing: time the engine's steps over a range of batch shapes and write "
        "the fitted step-time model for `yaie simulate --cost-model` here",
    )
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from yaie_bench import cli as load_test
    from yaie_bench.launcher import yaie_server

    quiet = [*args.serve_args, "--log-level", "warning"]
    if args.fit_cost_model:
        from yaie_bench.cost_fit import fit_cost_model, fit_front_end

        cost, error = fit_cost_model(engine_config(_serve_options(args.serve_args)))
        console.print(f"engine: {cost.describe()} (median step error {error:.1%})")
        with yaie_server(quiet) as (_, base_url):  # the same engine, behind the real front end
            cost = fit_front_end(base_url, cost, console)
        cost.save(Path(args.fit_cost_model))
        console.print(f"with the front end: {cost.describe()}; wrote {args.fit_cost_model}")
        return 0

    with yaie_server(quiet) as (_, base_url):
        bench_argv = ["--base-url", base_url, "--concurrency", args.concurrency, "--label", "yaie"]
        bench_argv += ["--num-requests", args.num_requests, "--prompt-set", args.prompt_set]
        bench_argv += ["--max-tokens", args.max_tokens, "--ignore-eos"]
        if args.out:
            bench_argv += ["--out", args.out]
        return load_test.main(bench_argv)


def _serve_options(serve_args: list[str]) -> argparse.Namespace:
    """`serve_args` read as `yaie serve` reads them, so a mistake shows before the fit, not after."""
    parser = argparse.ArgumentParser(prog="yaie")
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *serve_args])
