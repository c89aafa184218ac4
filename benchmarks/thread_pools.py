"""Why the server builds its Engine on the engine thread: decode speed vs which thread loads the model.

    python benchmarks/thread_pools.py [--batch-size 8] [--max-tokens 128] [--repeats 3] [--quantization none]

Each case runs in a fresh process (OpenMP's thread pools live as long as the process) and times
`LLM.generate` of a batch, greedy, ignore_eos:

  * main:         model loaded and run on the main thread (the offline `LLM` case);
  * same-thread:  loaded and run on one background thread (what `AsyncEngine` does);
  * cross-thread: loaded on the main thread, run on a background thread (the server before the fix).

libgomp keeps one worker pool per thread that calls into OpenMP. With two pools alive, the
process has more OpenMP threads than a 2-core machine has cores, and libgomp then stops
spin-waiting: every parallel op wakes its workers through the kernel. The report gives each
case's ms per decode step and its ratio to `main`, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

from bench_utils import (
    add_disturbance_args,
    add_quantization_arg,
    child_result,
    decode_ms_per_step,
    machine_info,
    make_console,
    run_undisturbed,
    write_report,
)
from rich.table import Table

CASES = ("main", "same-thread", "cross-thread")


def measure_case(case: str, batch_size: int, max_tokens: int, repeats: int, quantization: str) -> list[float]:
    """Runs inside the child process: ms per decode step of each repeat."""
    from yaie import LLM

    holder: dict[str, Any] = {}

    def load() -> None:
        holder["llm"] = LLM(quantization=quantization)

    def run() -> None:
        holder["times"] = decode_ms_per_step(holder["llm"], batch_size, max_tokens, repeats)

    def on_worker(fn: Any) -> None:
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()

    if case == "same-thread":
        on_worker(load)
    else:
        load()
    if case == "main":
        run()
    else:
        on_worker(run)
    return holder["times"]


def run_child(case: str, args: argparse.Namespace) -> list[float]:
    command = [
        sys.executable, __file__, "--child", case, "--batch-size", str(args.batch_size),
        "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
        "--quantization", args.quantization,
    ]  # fmt: skip
    times: list[float] = child_result(command)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/thread_pools.json"))
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    add_disturbance_args(parser)
    add_quantization_arg(parser)
    args = parser.parse_args()
    if args.child:
        times = measure_case(args.child, args.batch_size, args.max_tokens, args.repeats, args.quantization)
        print(json.dumps(times))
        return 0

    console = make_console()
    results: dict[str, dict[str, Any]] = {}
    for case in CASES:
        console.print(f"running {case} ...")
        kept = run_undisturbed(lambda case=case: run_child(case, args), args.max_bg_cores, args.retries)
        results[case] = {"ms_per_step": statistics.median(kept.result), "runs_ms": kept.result,
                         "bg_cores": round(kept.background_cores, 2)}  # fmt: skip
    base = results["main"]["ms_per_step"]
    table = Table(title=f"decode step, batch {args.batch_size}, {args.max_tokens} tokens")
    for column in ("case", "ms/step", "× main", "bg cores"):
        table.add_column(column, justify="right")
    for case, entry in results.items():
        entry["ratio_to_main"] = entry["ms_per_step"] / base
        table.add_row(
            case, f"{entry['ms_per_step']:.1f}", f"{entry['ratio_to_main']:.2f}", str(entry["bg_cores"])
        )
    console.print(table)
    write_report(
        args.out,
        {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
        console,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
