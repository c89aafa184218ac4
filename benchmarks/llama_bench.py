"""yaie's answer to `llama-bench -p 512 -n 128`, in process, beside llama-bench itself in the same run.

    python benchmarks/llama_bench.py [--model PATH.gguf] [--prompt 512] [--gen 128] [--repeats 5]
        [--quantization auto] [--llama-bench PATH] [--ik-llama-bench PATH] [--out FILE.json]

The two figures llama-bench reports, measured the same way on yaie's engine (`LLM`, one
sequence, prefix cache off):
  * pp<prompt>: prompt tokens per second of prefilling a prompt of `--prompt` random tokens (the
    step also samples one token, which llama-bench's prompt test does not: ours is the harder test);
  * tg<gen>: tokens per second of generating `--gen` tokens after a one-token prompt, EOS
    ignored, the first step (the prompt's) left out of the time.
With `--llama-bench` (default: $PEERS_DIR/llama.cpp/build/bin/llama-bench if it exists, see
benchmarks/peers/install_llamacpp.sh) the same tests run through llama-bench on the same file
with as many threads as torch uses, before and after yaie's (so drift hits both), and the
report gives yaie / llama.cpp for each; `--ik-llama-bench` (default: $PEERS_DIR/ik_llama.cpp/...,
benchmarks/peers/install_ik_llamacpp.sh) adds ik_llama.cpp, at its best setting per test.
Medians over `--repeats`; read the ratios on a shared machine.
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


def default_binary(tree: str) -> Path | None:
    """Where benchmarks/peers/install_llamacpp.sh (tree "llama.cpp") or install_ik_llamacpp.sh
    ("ik_llama.cpp") puts llama-bench, if it is there."""
    binary = Path(os.environ.get("PEERS_DIR", "/tmp/peers")) / tree / "build/bin/llama-bench"
    return binary if binary.exists() else None


def optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def llama_bench(binary: Path, model: Path, prompt_len: int, gen: int, repeats: int,
                extra: tuple[str, ...] = ()) -> dict[str, float]:  # fmt: skip
    """llama-bench's pp<prompt_len> and tg<gen> tok/s (a length of 0 skips that test), with as
    many threads as torch uses."""
    threads = torch.get_num_threads()
    command = [str(binary), "-m", str(model), "-t", str(threads), "-p", str(prompt_len), "-n", str(gen),
               "-r", str(repeats), "-o", "json", *extra]  # fmt: skip
    results = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    figures = {}
    for test in results:
        name = f"pp{test['n_prompt']}" if test["n_prompt"] else f"tg{test['n_gen']}"
        figures[name] = float(test["avg_ts"])
    return figures


def peer_settings(args: argparse.Namespace) -> dict[str, tuple[Path, list[tuple[str, ...]]]]:
    """Each peer's llama-bench and the settings it runs under; a test's figure is the peer's best
    setting for it. ik_llama.cpp's run-time repacking (-rtr 1) makes its decode faster and its
    prefill slower, so it runs both ways."""
    peers: dict[str, tuple[Path, list[tuple[str, ...]]]] = {}
    if args.llama_bench:
        peers["llama.cpp"] = (args.llama_bench, [()])
    if args.ik_llama_bench:
        peers["ik_llama.cpp"] = (args.ik_llama_bench, [("-rtr", "0"), ("-rtr", "1")])
    return peers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    # An empty path leaves that peer out.
    parser.add_argument("--llama-bench", type=optional_path, default=default_binary("llama.cpp"))
    parser.add_argument("--ik-llama-bench", type=optional_path, default=default_binary("ik_llama.cpp"))
    add_quantization_arg(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    console = make_console()
    model = resolve_model_path(args.model)
    llm = LLM(str(model), quantization=args.quantization, enable_prefix_caching=False)
    peers = peer_settings(args)

    def run_peers() -> dict[str, list[dict[str, float]]]:
        lengths = (args.prompt, args.gen, args.repeats)
        return {
            name: [llama_bench(binary, model, *lengths, extra) for extra in settings]
            for name, (binary, settings) in peers.items()
        }

    before = run_peers()
    ours = yaie_tests(llm, args.prompt, args.gen, args.repeats)
    after = run_peers()
    rows: dict[str, dict[str, Any]] = {}
    for test, value in ours.items():
        row: dict[str, Any] = {"yaie": value}
        line = f"{test:6}  yaie {value:7.1f} tok/s"
        for name in peers:
            # Best setting, each averaged over the runs before and after yaie's (drift hits both).
            runs = zip(before[name], after[name], strict=True)
            best = max(statistics.mean([b[test], a[test]]) for b, a in runs)
            row[name], row[f"yaie/{name}"] = best, value / best
            line += f"  {name} {best:7.1f} ({value / best:.2f}x)"
        rows[test] = row
        console.print(line)
    if args.out:
        paths = {"llama_bench": str(args.llama_bench), "ik_llama_bench": str(args.ik_llama_bench),
                 "out": str(args.out)}  # fmt: skip
        report = {"args": vars(args) | paths, "model": str(model), "machine": machine_info(), "results": rows,
                  "peer_runs": {"before": before, "after": after}}  # fmt: skip
        write_report(args.out, report, console)


if __name__ == "__main__":
    main()
