"""Speculative decoding against plain decoding: speed-up, acceptance, and the batch size where
it stops paying (what `disable_by_batch_size` should be).

    python benchmarks/speculative.py [--model PATH] [--configs JSON ...] [--clients 1 8 32]
        [--max-tokens 256] [--repeats 3] [--as-configured] [--quantization none]
        [--out benchmarks/results/speculative.json]

For each speculative config and each number of clients, the same greedy chat requests (the
model's chat template, stopping at its end of turn; every prompt of a set at least once, in
waves of `clients` requests) run with speculation off and on,
alternating, in the same process (so both see the same machine load), and the script checks
that both give the same tokens. Two prompt sets: `grounded` (the answer quotes or edits a text
given in the prompt, where n-gram lookup should shine) and `chat` (open questions). Reported per
config, set and client count: output tok/s off and on (prompt time included), their ratio (read
the ratios, not absolute figures, on shared machines), the acceptance rate and the mean accepted
length (tokens per verifying step). By default speculation is forced on at every batch size
(disable_by_batch_size is set to the largest client count) so that the curve shows where it
stops paying; --as-configured keeps the config's own threshold (what a user gets).

`self` drafts with the model's quantized twin for the target run unquantized (both engines
here run quantization "none"), e.g. --configs '{"method": "self", "num_speculative_tokens": 4}'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_utils import add_quantization_arg, make_console, write_report  # benchmarks/ is the script's folder
from llama_bench import default_llama_bench, llama_bench

from yaie import LLM, SamplingParams
from yaie.model.loader import resolve_model_path

# Each answer mostly restates a text given in the prompt (the model copies it through its chat
# template), as in summarising, quoting or editing a document: where n-gram lookup should pay.
GROUNDED = [
    "Repeat the following text exactly, word for word:\n\n"
    "The river town wakes early. Before the sun clears the hills, the baker has lit his oven and the "
    "ferryman has checked the ropes on his small wooden boat. By six the market square fills with "
    "carts of apples, cabbages and fresh bread, and the smell of coffee drifts from the corner cafe. "
    "Children run to school along the towpath while their parents argue about the price of fish. "
    "At noon the bells of the old church ring twelve times, and everyone stops for lunch.",
    "Add type hints to this Python code and return the whole code:\n\n"
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for value in values:\n        total += (value - m) ** 2\n"
    "    return total / len(values)\n\n\ndef normalise(values):\n    m = mean(values)\n"
    "    s = variance(values) ** 0.5\n    return [(value - m) / s for value in values]\n",
    "Fix the spelling mistakes in this text and write out the corrected text:\n\n"
    "Our team meets every Monday morning to plan the week. We reveiw the open tasks, decide who "
    "takes each one, and write the plan on the whiteboard. On Friday afternoon we look at the "
    "board again, mark what was finished, and move the rest to the next week. This simple habbit "
    "keeps everyone informed and stops small problems from growing into big ones.",
]
# Open questions: the answer owes little to the prompt.
CHAT = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
]
DEFAULT_CONFIGS = ['{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}']


def run(llm: LLM, prompts: list[str], clients: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy answers to `prompts` through the chat template, `clients` at a time (each wave
    after the last); (seconds, tokens)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
    tokens = []
    start = time.perf_counter()
    for wave in range(0, len(conversations), clients):
        outputs = llm.chat(conversations[wave : wave + clients], params)
        tokens += [out.outputs[0].token_ids for out in outputs]
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="speculative configs, JSON")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--as-configured",
        action="store_true",
        help="keep each config's disable_by_batch_size (default: speculate at every batch size)",
    )
    parser.add_argument(
        "--llama-bench",
        type=Path,
        default=default_llama_bench(),
        help="report llama-bench's tg<max-tokens> on the same file beside ours (default: if installed)",
    )
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    console = make_console()
    results: list[dict[str, Any]] = []
    peer: list[float] = []
    model = resolve_model_path(args.model)

    def llama_cpp_tg() -> None:
        if args.llama_bench and model.suffix == ".gguf":
            figures = llama_bench(args.llama_bench, model, 0, args.max_tokens, args.repeats)
            peer.append(figures[f"tg{args.max_tokens}"])

    llama_cpp_tg()
    plain = LLM(args.model, enable_prefix_caching=False, quantization=args.quantization)
    for raw in args.configs:
        config = json.loads(raw)
        if not args.as_configured:
            config = {**config, "disable_by_batch_size": max(args.clients)}
        spec = LLM(
            args.model,
            enable_prefix_caching=False,
            quantization=args.quantization,
            speculative_config=config,
        )
        for clients in args.clients:
            for name, prompt_set in (("grounded", GROUNDED), ("chat", CHAT)):
                # Every prompt of the set at least once: one client answers them in turn.
                prompts = [prompt_set[i % len(prompt_set)] for i in range(max(clients, len(prompt_set)))]
                run(plain, prompts[:clients], clients, 8), run(spec, prompts[:clients], clients, 8)  # warm-up
                before = spec.engine.stats().spec_decode
                times_off, times_on = [], []
                same = True
                tokens = 0
                for _ in range(args.repeats):
                    t_off, tokens_off = run(plain, prompts, clients, args.max_tokens)
                    t_on, tokens_on = run(spec, prompts, clients, args.max_tokens)
                    times_off.append(t_off)
                    times_on.append(t_on)
                    same = same and tokens_off == tokens_on
                    tokens = sum(len(t) for t in tokens_off)
                after = spec.engine.stats().spec_decode
                assert before is not None and after is not None
                drafts = after.num_drafts - before.num_drafts
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                row = {
                    "config": config,
                    "prompt_set": name,
                    "clients": clients,
                    "output_tokens": tokens,
                    "tok_s_off": tokens / statistics.median(times_off),
                    "tok_s_on": tokens / statistics.median(times_on),
                    "acceptance_rate": accepted / drafted if drafted else 0.0,
                    "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
                    "identical_output": same,
                }
                row["speedup"] = row["tok_s_on"] / row["tok_s_off"]
                results.append(row)
                console.print(
                    f"{config['method']:12} {name:9} clients={clients:3}  off {row['tok_s_off']:7.1f} tok/s  "
                    f"on {row['tok_s_on']:7.1f} tok/s  x{row['speedup']:.2f}  "
                    f"acceptance {row['acceptance_rate']:.2f}  "
                    f"mean length {row['mean_accepted_length']:.2f}  identical={same}"
                )
        del spec  # its KV cache (and a draft's) goes before the next config's engine takes one
    llama_cpp_tg()
    if peer:
        console.print(
            f"llama.cpp on the same file, one sequence (llama-bench tg{args.max_tokens}, before and after): "
            + ", ".join(f"{tg:.1f}" for tg in peer) + " tok/s"
        )
    if args.out:
        report = {"args": sys.argv[1:], "quantization": args.quantization, "results": results,
                  "llama_cpp_tg": peer}  # fmt: skip
        write_report(args.out, report, console)


if __name__ == "__main__":
    main()
