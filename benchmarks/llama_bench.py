"""yaie's answer to `llama-bench -p 512 -n 128`, in process, beside llama-bench itself in the same run.

    python benchmarks/llama_bench.py [--model PATH.gguf] [--prompt 512] [--gen 128] [--repeats 5]
        [--quantization auto] [--llama-bench PATH] [--out benchmarks/results/llama_bench.json]

The two figures llama-bench reports, measured the same way on yaie's engine (`LLM`, one
sequence, prefix cache off):
  * pp<prompt>: prompt tokens per second of prefilling a prompt of `--prompt` random tokens (the
    step also samples one token, which llama-bench's prompt test does not: ours is the harder test);
  * tg<gen>: tokens per second of generating `--gen` tokens after a one-token prompt, EOS
    ignored, the first step (the prompt's) left out of the time.
With `--llama-bench` (default: $PEERS_DIR/llama.cpp/build/bin/llama-bench if it exists, see
benchmarks/peers/install_llamacpp.sh) the same tests run through llama-bench on the same file
with as many threads as torch uses, before and after yaie's (so drift hits both), and the
report gives yaie / llama.cpp for each. Medians over `--repeats`; read the ratios on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from bench_utils import add_quantization_arg, machine_info, make_console, write_report

from yaie import LLM, SamplingParams
from yaie.model.loader import resolve_model_path


def yaie_tests(llm: LLM, prompt_len: int, gen: int, repeats: int) -> dict[str, float]:
    vocab = llm.engine.model_info.vocab_size
    generator = torch.Generator().manual_seed(0)
    pp, tg = [], []
    for _ in range(repeats + 1):  # the first round warms up
        prompt = torch.randint(0, vocab, (prompt_len,), generator=generator).tolist()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        pp.append(prompt_len / (time.perf_counter() - start))
        one = [int(torch.randint(0, vocab, (1,), generator=generator))]
        start = time.perf_counter()
        llm.generate([one], SamplingParams(temperature=0, max_tokens=1))
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([one], SamplingParams(temperature=0, max_tokens=gen + 1, ignore_eos=True))
        tg.append(gen / (time.perf_counter() - start - first))
    return {f"pp{prompt_len}": statistics.median(pp[1:]), f"tg{gen}": statistics.median(tg[1:])}


def default_llama_bench() -> Path | None:
    """Where benchmarks/peers/install_llamacpp.sh puts llama-bench, if it is there."""
    binary = Path(os.environ.get("PEERS_DIR", "/tmp/peers")) / "llama.cpp/build/bin/llama-bench"
    return binary if binary.exists() else None


def llama_bench(binary: Path, model: Path, prompt_len: int, gen: int, repeats: int) -> dict[str, float]:
    """llama-bench's pp<prompt_len> and tg<gen> tok/s (a length of 0 skips that test), with as
    many threads as torch uses."""
    threads = torch.get_num_threads()
    command = [str(binary), "-m", str(model), "-t", str(threads), "-p", str(prompt_len), "-n", str(gen),
               "-r", str(repeats), "-o", "json"]  # fmt: skip
    results = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    figures = {}
    for test in results:
        name = f"pp{test['n_prompt']}" if test["n_prompt"] else f"tg{test['n_gen']}"
        figures[name] = float(test["avg_ts"])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--llama-bench", type=Path, default=default_llama_bench())
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    console = make_console()
    model = resolve_model_path(args.model)
    llm = LLM(str(model), quantization=args.quantization, enable_prefix_caching=False)
    peer_runs = []
    if args.llama_bench:
        peer_runs.append(llama_bench(args.llama_bench, model, args.prompt, args.gen, args.repeats))
    ours = yaie_tests(llm, args.prompt, args.gen, args.repeats)
    if args.llama_bench:
        peer_runs.append(llama_bench(args.llama_bench, model, args.prompt, args.gen, args.repeats))
    rows: dict[str, dict[str, Any]] = {}
    for test, value in ours.items():
        row: dict[str, Any] = {"yaie": value}
        if peer_runs:
            row["llama.cpp"] = statistics.mean(run[test] for run in peer_runs)
            row["ratio"] = value / row["llama.cpp"]
        rows[test] = row
        peer = f"  llama.cpp {row['llama.cpp']:7.1f}  yaie/llama.cpp {row['ratio']:.2f}x" if peer_runs else ""
        console.print(f"{test:6}  yaie {value:7.1f} tok/s{peer}")
    if args.out:
        report = {"args": vars(args) | {"llama_bench": str(args.llama_bench), "out": str(args.out)},
                  "model": str(model), "machine": machine_info(), "results": rows,
                  "llama_bench_runs": peer_runs}  # fmt: skip
        write_report(args.out, report, console)


if __name__ == "__main__":
    main()
