"""`yaie simulate`: batching policies compared on the real scheduler, in virtual time."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from yaie.cli.options import parse_bytes, positive_int
from yaie.cli.terminal import console, widen_for_pipes
from yaie.plan import load_model_source, make_plan
from yaie.simulate import (
    CostModel,
    EngineSettings,
    Scenario,
    TrafficSpec,
    load_trace,
    plot,
    simulate,
    summarize,
    synthetic_traffic,
)


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        values = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token counts, got {text!r}") from None
    if not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return values


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = commands.add_parser(
        "simulate",
        help="compare batching policies on the real scheduler with a step-time cost model",
        description="Runs the engine's scheduler, block pool and prefix cache in virtual time. Step times "
        "come from --cost-model (fitted by `yaie bench --fit-cost-model`) or from a roofline of --model "
        "on a GPU of --bandwidth and --flops. Scenarios: static, continuous, continuous+prefix, and "
        "'+'-joined options chunk=N (token budget), pool=N (KV blocks), spec=K@A (speculative decoding).",
    )
    traffic = sim.add_argument_group("traffic")
    traffic.add_argument("--trace", type=Path, help="a JSONL trace instead of synthetic traffic")
    traffic.add_argument("--arrival", choices=("poisson", "bursty", "closed"), default="poisson")
    traffic.add_argument("--rate", type=float, default=4.0, help="requests per second (poisson, bursty)")
    traffic.add_argument("--burst-size", type=positive_int, default=8)
    traffic.add_argument("--clients", type=positive_int, default=8, help="closed loop: requests in flight")
    traffic.add_argument("--num-requests", type=positive_int, default=200, help="(sessions, with --turns)")
    traffic.add_argument("--prompt-len", type=_length_range, default=(512, 2048), help="LOW:HIGH tokens")
    traffic.add_argument("--output-len", type=_length_range, default=(128, 512), help="LOW:HIGH tokens")
    traffic.add_argument("--shared-prefix", type=float, default=0.0, help="share of each prompt in common")
    traffic.add_argument("--turns", type=positive_int, default=1, help="turns per multi-turn session")
    traffic.add_argument("--think-time", type=float, default=5.0, help="seconds between a session's turns")
    traffic.add_argument("--seed", type=int, default=0)
    cost = sim.add_argument_group("cost model and engine")
    cost.add_argument(
        "--cost-model", type=Path, help="a JSON cost model (e.g. from yaie bench --fit-cost-model)"
    )
    cost.add_argument(
        "--model", default="Llama-3-8B", help="roofline: a preset, config.json, folder or .gguf"
    )
    cost.add_argument("--memory", type=parse_bytes, default="80GiB", help="roofline: memory per GPU")
    cost.add_argument("--dtype", default="bfloat16", help="roofline: weight dtype")
    cost.add_argument("--kv-cache-dtype", default="auto")
    cost.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    cost.add_argument("--bandwidth", type=float, default=3.35e12, help="roofline: bytes/s per GPU (H100)")
    cost.add_argument("--flops", type=float, default=989e12, help="roofline: FLOP/s per GPU (H100 bf16)")
    cost.add_argument("--num-kv-blocks", type=positive_int, help="default: the cost model's or the plan's")
    cost.add_argument("--block-size", type=positive_int)
    cost.add_argument("--max-num-seqs", type=positive_int)
    cost.add_argument("--max-num-batched-tokens", type=positive_int)
    cost.add_argument("--draft-cost-ratio", type=float, default=0.05, help="spec=K@A: draft / target step")
    sim.add_argument(
        "--compare", default="static,continuous,continuous+prefix", help="comma-separated scenarios"
    )
    sim.add_argument("--json", action="store_true", help="print the summaries as JSON")
    sim.add_argument("--plot", type=Path, help="write TTFT / latency CDFs and KV use over time (PNG)")
    sim.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    scenarios = [Scenario.parse(text) for text in args.compare.split(",") if text.strip()]
    if args.cost_model:
        cost = CostModel.load(args.cost_model)
    else:
        planned = make_plan(
            load_model_source(args.model),
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            memory=args.memory,
            tensor_parallel_size=args.tensor_parallel_size,
            block_size=args.block_size or 16,
        )
        cost = CostModel.roofline(planned, args.bandwidth, args.flops)
    engine = cost.engine
    if args.num_kv_blocks is None and "num_kv_blocks" not in engine:
        raise ValueError("the cost model names no KV pool size: pass --num-kv-blocks")
    settings = EngineSettings(
        num_kv_blocks=args.num_kv_blocks or int(engine["num_kv_blocks"]),
        block_size=args.block_size or int(engine.get("block_size", 16)),
        max_num_seqs=args.max_num_seqs or int(engine.get("max_num_seqs", 64)),
        max_num_batched_tokens=args.max_num_batched_tokens or int(engine.get("max_num_batched_tokens", 2048)),
        long_prefill_token_threshold=int(
            engine.get("long_prefill_token_threshold", EngineSettings.long_prefill_token_threshold)
        ),
        draft_cost_ratio=args.draft_cost_ratio,
    )
    if args.trace:
        traffic = load_trace(
            args.trace, clients=args.clients if args.arrival == "closed" else None, seed=args.seed
        )
    else:
        traffic = synthetic_traffic(
            TrafficSpec(
                num_requests=args.num_requests,
                arrival=args.arrival,
                rate=args.rate,
                burst_size=args.burst_size,
                clients=args.clients,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                shared_prefix=args.shared_prefix,
                turns=args.turns,
                think_s=args.think_time,
                seed=args.seed,
            )
        )
    results = [simulate(traffic, scenario, settings, cost, seed=args.seed) for scenario in scenarios]
    summaries = [summarize(result) for result in results]
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print(
            json.dumps(
                {"settings": settings.__dict__, "cost_model": cost.to_json(), "scenarios": summaries},
                indent=2,
            )
        )
        return 0
    widen_for_pipes()
    table = Table(title=f"simulated: {len(traffic.requests)} requests, {settings.num_kv_blocks:,} KV blocks")
    for header in (
        "scenario",
        "out tok/s",
        "TTFT p50 s",
        "p99",
        "TPOT p50 ms",
        "e2e p50 s",
        "p99",
        "prefix hit",
        "KV peak",
        "preempt",
    ):
        table.add_column(header, justify="left" if header == "scenario" else "right")
    for s in summaries:
        table.add_row(
            escape(s["scenario"]),
            f"{s['output_tok_s']:,.1f}",
            f"{s['ttft_p50_s']:.3f}",
            f"{s['ttft_p99_s']:.3f}",
            f"{s['tpot_p50_s'] * 1e3:.2f}" if s["tpot_p50_s"] is not None else "-",
            f"{s['e2e_p50_s']:.2f}",
            f"{s['e2e_p99_s']:.2f}",
            f"{s['prefix_hit_rate']:.0%}",
            f"{s['kv_usage_peak']:.0%}",
            str(s["num_preemptions"]),
        )
    console.print(table)
    if args.plot:
        console.print(f"wrote {args.plot}")
    return 0
