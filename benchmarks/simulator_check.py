"""Is `yaie simulate` right about this machine? The simulator against a measured `yaie bench`.

    python benchmarks/simulator_check.py [--concurrency 8,32] [--num-requests 64] [--max-tokens 128]
        [--prompt-set short] [--quantization none] [--out benchmarks/results/simulator_check.json]
        [-- SERVE OPTIONS]

In one run: `yaie bench --fit-cost-model` times the engine's steps and fits the cost model, then
`yaie bench` load-tests a server with the same options, then the simulator replays the very same
requests (the prompts tokenized with the model's chat template, so prefix sharing is exact; every
request generates exactly --max-tokens, as `--ignore-eos` makes the server do) from the same
number of closed-loop clients. It compares output tok/s and TTFT p50 per concurrency level and
fails (exit 1) when one differs from the measurement by more than --tolerance (15%).

Needs a quiet machine: the measurement and the fit must see the same CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_utils import add_quantization_arg  # benchmarks/ is the script's folder
from rich.console import Console
from rich.table import Table

from yaie.model.loader import load_tokenizer, resolve_model_path
from yaie.simulate import CostModel, EngineSettings, Request, Scenario, Traffic, simulate, summarize
from yaie_bench.cli import int_list
from yaie_bench.prompts import build_messages


def yaie(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "yaie.cli", *args], check=True)


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids the server builds from these messages (as Engine.encode_chat does)."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def level_prompts(tokenizer: Any, args: argparse.Namespace, level: int, count: int) -> list[list[int]]:
    """The prompts `yaie bench` sends at level number `level` (-1: its warm-up requests)."""
    return [chat_prompt(tokenizer, build_messages(args.prompt_set, i, level, 1000)) for i in range(count)]


def simulated_level(
    tokenizer: Any, args: argparse.Namespace, level: int, concurrency: int, cost: CostModel
) -> dict[str, Any]:
    prompts = level_prompts(tokenizer, args, level, args.num_requests)
    requests = [Request(f"{level}-{i}", prompt, args.max_tokens) for i, prompt in enumerate(prompts)]
    # The server has served its warm-up request and the levels before this one: its prefix cache
    # holds their prompts, and a repeated prompt costs a few tokens, not all of them.
    history = level_prompts(tokenizer, args, -1, 1)
    for earlier in range(level):
        history += level_prompts(tokenizer, args, earlier, args.num_requests)
    engine = cost.engine
    settings = EngineSettings(
        num_kv_blocks=int(engine["num_kv_blocks"]),
        block_size=int(engine["block_size"]),
        max_num_seqs=int(engine["max_num_seqs"]),
        max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
    )
    scenario = Scenario.parse("continuous+prefix" if engine.get("prefix_caching", True) else "continuous")
    traffic = Traffic(requests, clients=concurrency, history=history)
    return summarize(simulate(traffic, scenario, settings, cost))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-set", choices=("short", "long", "shared-prefix"), default="short")
    parser.add_argument("--tolerance", type=float, default=0.15)
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/simulator_check.json"))
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    levels = int_list(args.concurrency)
    model = next((a for a in serve_args if not a.startswith("-")), None)  # a model path, if any
    serve_args += ["--quantization", args.quantization]
    with tempfile.TemporaryDirectory() as scratch:
        cost_path, bench_path = Path(scratch) / "cost.json", Path(scratch) / "bench.json"
        yaie("bench", "--fit-cost-model", str(cost_path), *serve_args)
        yaie(
            "bench",
            "--concurrency",
            args.concurrency,
            "--num-requests",
            str(args.num_requests),
            "--prompt-set",
            args.prompt_set,
            "--max-tokens",
            str(args.max_tokens),
            "--out",
            str(bench_path),
            *serve_args,
        )
        cost = CostModel.load(cost_path)
        measured = json.loads(bench_path.read_text())["levels"]
    tokenizer = load_tokenizer(resolve_model_path(model))
    rows = []
    failed = False
    for level, (concurrency, real) in enumerate(zip(levels, measured, strict=True)):
        sim = simulated_level(tokenizer, args, level, concurrency, cost)
        row: dict[str, Any] = {"concurrency": concurrency}
        for key in ("output_tok_s", "ttft_p50_s"):
            error = (sim[key] - real[key]) / real[key]
            row[key] = {"measured": real[key], "simulated": sim[key], "error": error}
            failed |= abs(error) > args.tolerance
        rows.append(row)
    table = Table(
        title=f"simulator vs yaie bench ({args.prompt_set}, {args.max_tokens} tokens, tolerance "
        f"{args.tolerance:.0%})"
    )
    for header in (
        "clients",
        "tok/s measured",
        "simulated",
        "error",
        "TTFT p50 measured",
        "simulated",
        "error",
    ):
        table.add_column(header, justify="right")
    for row in rows:
        tput, ttft = row["output_tok_s"], row["ttft_p50_s"]
        table.add_row(
            str(row["concurrency"]),
            f"{tput['measured']:.1f}",
            f"{tput['simulated']:.1f}",
            f"{tput['error']:+.1%}",
            f"{ttft['measured']:.3f}",
            f"{ttft['simulated']:.3f}",
            f"{ttft['error']:+.1%}",
        )
    console = Console(width=150)
    console.print(cost.describe())
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "serve_args": serve_args,
        "quantization": args.quantization,
        "cost_model": cost.to_json(),
        "levels": rows,
        "within_tolerance": not failed,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
