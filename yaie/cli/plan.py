"""`yaie plan`: a model's weights, KV cache and concurrent sequences on a GPU, without loading it."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape
from rich.table import Table

from yaie.cli.options import parse_bytes, positive_int
from yaie.cli.terminal import console
from yaie.plan import Overhead, load_model_source, make_plan
from yaie.plan.memory import KV_BYTES, WEIGHT_BYTES
from yaie.plan.planner import DEFAULT_CONTEXTS


def _context_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(parse_bytes(part) for part in text.split(",") if part.strip())
    except argparse.ArgumentTypeError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected context lengths like 2048,8k,32k; got {text!r}")
    return values


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = commands.add_parser(
        "plan",
        help="weights, KV cache and concurrent sequences of a model on a GPU",
        description="MODEL is a preset (Llama-3-8B, Mixtral-8x7B, ...), a config.json, a HF folder or a "
        ".gguf file (default: the bundled SmolLM2-135M). Sizes: 80GiB, 24GB, 512MiB.",
    )
    plan.add_argument("model", nargs="?", help="preset name, config.json, HF folder or .gguf file")
    budget = plan.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory", type=parse_bytes, help="memory of each GPU")
    budget.add_argument(
        "--kv-cache-memory", type=parse_bytes, help="KV cache size per GPU, as `yaie serve` takes it"
    )
    plan.add_argument(
        "--dtype", choices=list(WEIGHT_BYTES), help="weights (default: bfloat16, or a GGUF file's own)"
    )
    plan.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_BYTES])
    plan.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    plan.add_argument("--block-size", type=positive_int, default=16)
    plan.add_argument(
        "--context",
        type=_context_list,
        default=DEFAULT_CONTEXTS,
        help="comma-separated context lengths to count sequences at (default 2k,4k,8k,32k,128k)",
    )
    plan.add_argument("--max-num-seqs", type=positive_int, default=256, help="for the activation estimate")
    plan.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="likewise")
    plan.add_argument(
        "--framework-overhead", type=parse_bytes, default="1GiB", help="CUDA context, allocator slack"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(run=run)


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    return (
        f"{num_bytes / (1 << 30):,.2f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):,.1f} MiB"
    )


def run(args: argparse.Namespace) -> int:
    result = make_plan(
        load_model_source(args.model),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        memory=args.memory,
        kv_cache_memory=args.kv_cache_memory,
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        contexts=args.context,
        overhead=Overhead(args.framework_overhead, args.max_num_batched_tokens, args.max_num_seqs),
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    arch = result.architecture
    tp = result.tensor_parallel_size
    table = Table(
        title=f"{escape(result.model)} ({arch.name}), {result.dtype} weights, tp={tp}", show_header=False
    )
    table.add_column(style="bold")
    table.add_column(justify="right")
    params = f"{result.num_parameters / 1e9:,.2f} B"
    if result.num_active_parameters != result.num_parameters:
        params += f" ({result.num_active_parameters / 1e9:,.2f} B active per token)"
    kv_token = f"{result.kv_bytes_per_token / 1024:,.1f} KiB ({result.kv_cache_dtype})"
    if arch.sliding_window:
        kv_token += (
            f", sliding window {arch.sliding_window} on {sum(w is not None for w in arch.layer_windows)}"
        )
        kv_token += f"/{arch.num_layers} layers"
    rows = [
        ("parameters", params),
        ("weights", f"{_size(result.weight_bytes)} ({_size(result.weight_bytes_per_gpu)} per GPU)"),
        ("KV per token", kv_token),
        ("memory per GPU", _size(result.memory_per_gpu)),
        ("runtime overhead per GPU", _size(result.overhead_bytes_per_gpu)),
        ("KV cache per GPU", _size(result.kv_cache_bytes_per_gpu)),
        (
            "KV budget",
            f"{result.kv_budget_tokens:,} tokens = {result.kv_budget_blocks:,} blocks of {result.block_size}",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for context, count in result.max_sequences.items():
        shown = "beyond the model's context" if count is None else f"{count:,}"
        table.add_row(f"sequences at {context:,} tokens", shown)
    console.print(table)
    return 0
