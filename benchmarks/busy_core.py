"""What a program busy on one core does to decoding, and what fewer threads do about it.

    python benchmarks/busy_core.py [--batch-sizes 1 8 32] [--max-tokens 64] [--repeats 3]
        [--quantization auto] [--out benchmarks/results/busy_core.json]

Every step of the model is a few hundred parallel regions (matmuls, attention), each split into
equal shares, one per thread, and each ends when its last share does. A program that keeps one
core busy takes that core's thread off the CPU for whole time slices, and every region waits for
it. On a laptop that is any other busy program; here it is a busy loop in a second process,
pinned to the last core (our threads are not pinned: the kernel places them as it would).

Each case runs `LLM(num_threads=t).generate` on batches of prompts in a fresh process (OpenMP's
thread pool is made once per process), greedy with EOS ignored, and reports ms per decode step
(generate's wall time over `--max-tokens`, after a warm-up; the median of `--repeats`). Cases:
t = every core, and one fewer, each on an idle machine and beside the busy loop. A measurement
during which other processes kept more cores busy than allowed (the busy loop, our own child,
is not counted) is redone, as in the other benchmarks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

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

BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def measure(threads: int, batch_sizes: list[int], max_tokens: int, repeats: int,
            quantization: str) -> dict[str, list[float]]:
    """Runs inside the child process: ms per decode step of each repeat, per batch size."""
    from yaie import LLM

    llm = LLM(quantization=quantization, num_threads=threads)
    return {str(b): decode_ms_per_step(llm, b, max_tokens, repeats) for b in batch_sizes}


def plural(threads: int) -> str:
    return f"{threads} thread{'s' if threads > 1 else ''}"


def run_child(threads: int, busy: bool, args: argparse.Namespace) -> dict[str, list[float]]:
    command = [
        sys.executable, __file__, "--child", str(threads), "--max-tokens", str(args.max_tokens),
        "--repeats", str(args.repeats), "--quantization", args.quantization,
        "--batch-sizes", *map(str, args.batch_sizes),
    ]  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(cores[-1])]) if busy else None
    try:
        result: dict[str, list[float]] = child_result(command)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/busy_core.json"))
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    add_disturbance_args(parser)
    add_quantization_arg(parser)
    args = parser.parse_args()
    if args.child:
        times = measure(args.child, args.batch_sizes, args.max_tokens, args.repeats, args.quantization)
        print(json.dumps(times))
        return 0

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        raise SystemExit("needs two cores or more: one for the busy loop, one for the model")
    console = make_console()
    results = []
    for threads in (cores, cores - 1):
        for busy in (False, True):
            console.print(f"running {plural(threads)}, {'beside the busy loop' if busy else 'idle'} ...")
            kept = run_undisturbed(
                lambda threads=threads, busy=busy: run_child(threads, busy, args),
                args.max_bg_cores, args.retries,  # the busy loop is our child: its time is ours
            )
            for batch_size, runs in kept.result.items():
                results.append({
                    "threads": threads, "busy_core": busy, "batch_size": int(batch_size),
                    "ms_per_step": statistics.median(runs), "runs_ms": runs,
                    "bg_cores": round(kept.background_cores, 2),
                })  # fmt: skip

    def ms(threads: int, busy: bool, batch_size: int) -> float:
        return next(r["ms_per_step"] for r in results
                    if (r["threads"], r["busy_core"], r["batch_size"]) == (threads, busy, batch_size))

    table = Table(title=f"ms per decode step, {args.max_tokens} tokens, {cores} cores")
    for column in ("batch", *(f"{plural(t)}{', busy core' if b else ''}" for t in (cores, cores - 1)
                              for b in (False, True)), f"busy: {cores - 1} vs {cores} threads"):
        table.add_column(column, justify="right")
    for batch_size in args.batch_sizes:
        cells = [f"{ms(t, b, batch_size):.1f}" for t in (cores, cores - 1) for b in (False, True)]
        gain = ms(cores, True, batch_size) / ms(cores - 1, True, batch_size)
        table.add_row(str(batch_size), *cells, f"{gain:.2f}x")
    console.print(table)
    write_report(
        args.out,
        {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
        console,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
