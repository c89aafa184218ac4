"""Decode speed of `--dtype bfloat16` against the float32 default on this CPU, in one run.

    python benchmarks/cpu_dtype.py [--batch-sizes 1 8] [--max-tokens 128] [--rounds 4] [--quantization none]

Both engines live in this process (loaded one after the other, on this thread) and take turns:
each round times one greedy batch of `--max-tokens` tokens (EOS ignored) per dtype and batch
size. The table gives the median ms per decode step and bf16's speed-up over fp32. Where the CPU
has native bf16 dot products (AVX512-BF16, AMX), bf16 weights are packed for oneDNN and halve
the bytes every step streams; elsewhere bf16 goes through F.linear and is not expected to win.
The dtype is that of the dense weights: with `--quantization none` every linear layer is dense,
while the default runs the GGUF's quantized layers as stored, in either dtype.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_utils import add_quantization_arg, machine_info, make_console, write_report
from rich.table import Table

from yaie import LLM, SamplingParams

DTYPES = ("float32", "bfloat16")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_dtype.json"))
    args = parser.parse_args()
    console = make_console()

    engines = {
        dtype: LLM(dtype=dtype, quantization=args.quantization, kv_cache_memory=256 * 2**20)
        for dtype in DTYPES
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    times: dict[tuple[str, int], list[float]] = {(d, b): [] for d in DTYPES for b in args.batch_sizes}
    for llm in engines.values():  # warm-up
        llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8))
    for round_ in range(args.rounds):
        for batch in args.batch_sizes:
            prompts = [f"Tell me a story about the number {i}." for i in range(batch)]
            for dtype, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompts, params)
                times[dtype, batch].append((time.perf_counter() - start) / args.max_tokens * 1e3)
        console.print(f"round {round_ + 1}/{args.rounds} done")

    table = Table(title=f"ms per decode step (median of {args.rounds}), {args.max_tokens} tokens")
    for column in ("batch", "float32", "bfloat16", "bf16 speed-up"):
        table.add_column(column, justify="right")
    results = []
    for batch in args.batch_sizes:
        fp32, bf16 = (statistics.median(times[d, batch]) for d in DTYPES)
        table.add_row(str(batch), f"{fp32:.1f}", f"{bf16:.1f}", f"{fp32 / bf16:.2f}x")
        results.append({"batch_size": batch, "float32_ms": fp32, "bfloat16_ms": bf16, "speedup": fp32 / bf16,
                        "runs_ms": {d: times[d, batch] for d in DTYPES}})  # fmt: skip
    console.print(table)
    report = {
        "benchmark": "cpu_dtype",
        "machine": machine_info(),
        "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        "quantization": args.quantization,
        "results": results,
    }
    write_report(args.out, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
