"""The same one-client decode step, in process and behind `yaie serve`, in turns.

    python benchmarks/server_step.py [--rounds 6] [--max-tokens 256] [--quantization auto]
        [--out benchmarks/results/server_step.json]

One greedy, ignore_eos generation of `--max-tokens` tokens from one chat prompt, alternately
through `LLM.generate` in this process and as one streamed chat completion from a `yaie serve`
started beside it (ABBA order, so a steady drift of the machine cancels). Each side reports
the mean time of its engine steps (`StepTotals.busy_s` in process, `engine_step_seconds` from
the server's /metrics): the same `Engine.step` with the same model, so what separates the two
is what the server adds around it on the same two cores — its event loop, and the client.
The ratio per round is server step time / in-process step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
from bench_utils import add_quantization_arg, machine_info, make_console, write_report

from yaie.llm import LLM
from yaie.sampling_params import SamplingParams
from yaie_bench.counters import counters_between
from yaie_bench.launcher import yaie_server

MESSAGES = [{"role": "user", "content": "Tell me a long story about a dragon."}]
COUNTERS = ("engine_step_seconds", "engine_steps")


def in_process(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    """Mean seconds of an engine step over one generation."""
    totals = llm.engine.step_totals
    busy, steps = totals.busy_s, totals.num_steps
    llm.generate([prompt], params)
    return (totals.busy_s - busy) / (totals.num_steps - steps)


def served(client: httpx.Client, base_url: str, body: dict) -> float:
    """Mean seconds of the server's engine steps over one streamed completion."""
    before = client.get(f"{base_url}/metrics").text
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass
    grown = counters_between(before, client.get(f"{base_url}/metrics").text, COUNTERS)
    assert grown is not None, "the server exports no step counters"
    return grown["engine_step_seconds"] / grown["engine_steps"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=256)
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/server_step.json"))
    args = parser.parse_args()
    console = make_console()

    llm = LLM(quantization=args.quantization)
    prompt = llm.encode_chat(MESSAGES)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    in_process(llm, prompt, params)  # warm-up
    times: dict[str, list[float]] = {"in_process": [], "server": []}
    serve_args = ["--quantization", args.quantization, "--log-level", "warning"]
    with yaie_server(serve_args) as (_, base_url), httpx.Client(timeout=None, trust_env=False) as client:
        model = client.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": MESSAGES, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        served(client, base_url, body)  # warm-up
        for number in range(args.rounds):
            for side in ("in_process", "server") if number % 2 == 0 else ("server", "in_process"):
                started = time.perf_counter()
                if side == "in_process":
                    step = in_process(llm, prompt, params)
                else:
                    step = served(client, base_url, body)
                times[side].append(step)
                console.print(f"round {number + 1} {side:10s}: step {step * 1e3:.2f} ms "
                              f"({time.perf_counter() - started:.1f} s)")  # fmt: skip

    ratios = [s / p for s, p in zip(times["server"], times["in_process"], strict=True)]
    report = {
        "machine": machine_info(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "step_s": times,
        "server_over_in_process": ratios,
        "median_ratio": statistics.median(ratios),
    }
    console.print(
        f"step: in process {statistics.median(times['in_process']) * 1e3:.2f} ms, served "
        f"{statistics.median(times['server']) * 1e3:.2f} ms (medians); served / in process per round: "
        + ", ".join(f"{r:.3f}" for r in ratios)
    )
    write_report(args.out, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
