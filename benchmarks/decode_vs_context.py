"""Decode cost against context length: how much slower a token gets as the KV cache grows.

    python benchmarks/decode_vs_context.py [--contexts 128 1024 2048 4096] [--batch8-contexts 128 1024]
        [--decode-steps 32] [--threads N] [--quantization none]
        [--out benchmarks/results/decode_vs_context.json]

For each (batch size, context) the script submits `batch` prompts of `context` tokens (natural text,
tiled; a different offset per sequence), lets yaie prefill them, then times `--decode-steps`
engine steps in which every sequence decodes one token. Reported: the median step time, the
median time per decoded token (step / batch) and its ratio to the same batch size at the
shortest context. Weights cost the same at every context, so the growth of that ratio is what
attention over the cache (gathering blocks, masking, softmax) adds per token. Prefix caching is
off, so every prompt is computed in full. Add 8192 to --contexts for the model's whole window
(the prompt is then shortened so that the decoded tokens still fit).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_utils import (  # benchmarks/ is the script's folder
    add_disturbance_args,
    add_quantization_arg,
    machine_info,
    make_console,
    run_undisturbed,
    write_report,
)
from offline_throughput import PROMPTS
from rich.console import Console
from rich.table import Table

from yaie import LLM, SamplingParams

DECODE_HEADROOM = 64  # tokens kept free beyond --decode-steps when a context is clamped to the window


@dataclass
class Measurement:
    batch_size: int
    context: int  # prompt tokens per sequence; decoding runs from here to context + decode steps
    prefill_s: float
    step_ms: list[float]  # one engine step = one new token for every sequence
    background_cores: float = 0.0  # CPU cores other processes kept busy during the measurement
    discarded: list[float] = field(default_factory=list)  # background cores of disturbed attempts redone

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def ms_per_token(self) -> float:
        return self.median_step_ms / self.batch_size

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"median_step_ms": self.median_step_ms, "ms_per_token": self.ms_per_token}


def make_prompts(text_ids: list[int], batch_size: int, length: int) -> list[list[int]]:
    """`batch_size` prompts of `length` tokens cut from `text_ids` tiled, each at its own offset."""
    repeats = -(-(length + batch_size * 97) // len(text_ids)) + 1
    tiled = text_ids * repeats
    return [tiled[i * 97 : i * 97 + length] for i in range(batch_size)]


def measure(llm: LLM, prompts: list[list[int]], decode_steps: int) -> Measurement:
    engine = llm.engine
    # With chunked prefill the first sequences start decoding while later ones still prefill;
    # give every sequence enough tokens to still be running after all of them are decoding.
    num_prefill_steps = -(-sum(len(p) for p in prompts) // engine.config.max_num_batched_tokens) + len(
        prompts
    )
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + num_prefill_steps, ignore_eos=True)
    start = time.perf_counter()
    request_ids = [engine.add_request(None, prompt, params) for prompt in prompts]
    waiting_for_first = set(request_ids)
    while waiting_for_first:  # prefill, in chunks of max_num_batched_tokens
        waiting_for_first.difference_update(output.request_id for output in engine.step())
    prefill_s = time.perf_counter() - start
    step_ms = []
    for _ in range(decode_steps):
        step_start = time.perf_counter()
        outputs = engine.step()
        step_ms.append((time.perf_counter() - step_start) * 1000)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"a decode step advanced {len(outputs)} of {len(prompts)} sequences")
    for request_id in request_ids:
        engine.abort(request_id)
    return Measurement(len(prompts), len(prompts[0]), prefill_s, step_ms)


def measure_undisturbed(
    llm: LLM, prompts: list[list[int]], args: argparse.Namespace, console: Console
) -> Measurement:
    """`measure`, redone (up to --retries times) while other processes disturb it."""

    def report_retry(busy: float) -> None:
        console.log(f"disturbed ({busy:.2f} cores busy elsewhere): measuring again")

    kept = run_undisturbed(
        lambda: measure(llm, prompts, args.decode_steps), args.max_bg_cores, args.retries, report_retry
    )
    kept.result.background_cores, kept.result.discarded = kept.background_cores, kept.discarded
    return kept.result


def render_table(measurements: list[Measurement], baselines: dict[int, Measurement]) -> Table:
    table = Table(title="yaie decode time against context length (median over decode steps)")
    for column in ("batch", "context", "prefill s", "step ms", "ms/token", "tok/s", "bg cores", "× shortest"):
        table.add_column(column, justify="right")
    for m in measurements:
        base = baselines[m.batch_size]
        table.add_row(
            str(m.batch_size),
            str(m.context),
            f"{m.prefill_s:.2f}",
            f"{m.median_step_ms:.1f}",
            f"{m.ms_per_token:.2f}",
            f"{1000 / m.ms_per_token:.1f}",
            f"{m.background_cores:.2f}",
            f"{m.ms_per_token / base.ms_per_token:.2f}",
        )
    table.caption = (
        "bg cores: CPU used by other processes; × shortest: ms/token / same batch's at its shortest context"
    )
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 2048, 4096], help="batch 1")
    parser.add_argument("--batch8-contexts", type=int, nargs="*", default=[128, 1024], help="batch 8")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per measurement")
    add_disturbance_args(parser)
    add_quantization_arg(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_vs_context.json"))
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    console = make_console()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    llm = LLM(
        enable_prefix_caching=False, max_num_seqs=8, num_threads=threads, quantization=args.quantization
    )
    # The longest prompt that leaves room for the decode steps (and the tokens decoded meanwhile).
    window = llm.engine.max_model_len - args.decode_steps - DECODE_HEADROOM
    text_ids = [token for prompt in PROMPTS for token in llm.tokenizer(prompt + "\n\n").input_ids]
    plan = [(1, c) for c in sorted(args.contexts)] + [(8, c) for c in sorted(args.batch8_contexts)]
    machine = machine_info()
    console.print(
        f"threads={threads}, max_model_len={llm.engine.max_model_len}, "
        f"load average {machine['load_average'][0]:.2f}"
    )

    measure(llm, make_prompts(text_ids, 8, 128), 8)  # warm-up: first-call costs, allocator
    measurements: list[Measurement] = []
    for batch, context in plan:
        prompts = make_prompts(text_ids, batch, min(context, window))
        m = measure_undisturbed(llm, prompts, args, console)
        measurements.append(m)
        console.log(
            f"batch {batch} context {m.context:5d}: prefill {m.prefill_s:6.2f} s, "
            f"step {m.median_step_ms:7.1f} ms (min {min(m.step_ms):.1f}, max {max(m.step_ms):.1f}), "
            f"{m.background_cores:.2f} cores busy elsewhere"
        )
    baselines = {}
    for m in measurements:  # the shortest context of each batch size is its reference
        if m.batch_size not in baselines or m.context < baselines[m.batch_size].context:
            baselines[m.batch_size] = m
    console.print(render_table(measurements, baselines))

    report = {
        "benchmark": "decode_vs_context",
        "machine": machine | {"load_average_after": machine_info()["load_average"]},
        "config": {
            "threads": threads,
            "dtype": str(llm.engine.dtype),
            "quantization": args.quantization,
            "weight_types": llm.engine.model_info.quantization,
            "decode_steps": args.decode_steps,
            "block_size": llm.engine.config.block_size,
            "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
            "prefix_caching": False,
            "max_bg_cores": args.max_bg_cores,
            "retries": args.retries,
        },
        "results": [
            m.to_json() | {"ratio_to_shortest_context": m.ms_per_token / baselines[m.batch_size].ms_per_token}
            for m in measurements
        ],
    }
    write_report(args.out, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
