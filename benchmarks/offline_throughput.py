"""Offline generation throughput: yaie against transformers `generate`, same model, same run.

    python benchmarks/offline_throughput.py [--batch-sizes 1 8 32] [--hf-batch-sizes 1 8]
        [--repeats 3] [--max-tokens 128] [--threads N] [--quantization none]
        [--out benchmarks/results/offline_throughput.json]

Both engines run the bundled SmolLM2-135M-Instruct: transformers in fp32 from the dense copy that
benchmarks/dense_copy.py writes from the Q4_1 GGUF, yaie from the GGUF itself in --quantization
(default: the engine's, which runs the Q4_1 weights as stored; `none` dequantizes them on load to
the very weights transformers runs, and only then are the greedy tokens expected to agree). Every
request is a fixed prompt of 30-60 tokens and generates exactly `--max-tokens` tokens greedily
with EOS not ending it (yaie: ignore_eos; transformers: eos_token_id=None, left padding with an
attention mask), so both engines do the same work; the script reports how many leading tokens
they agree on. yaie's prefix cache is off, so repeated prompts are computed every time.

Per engine and batch size: one warm-up run, then `--repeats` timed runs, the two engines
alternating so that both see the same background load. Reported (medians over repeats):
  * aggregate tok/s: all new tokens / wall time from submitting the batch to the last token;
  * decode tok/s: tokens after the first one of every request / time after the last request
    got its first token (i.e. without prefill);
  * TTFT: time until every request of the batch has its first token.
The machines are shared and noisy, so read the yaie/transformers ratios, not absolute figures.
Each run also records how many cores other processes kept busy meanwhile ("bg cores"); contention
only ever slows a run down, so the best-of-repeats ratio is printed beside the median one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import transformers
from bench_utils import (  # benchmarks/ is the script's folder
    add_disturbance_args,
    add_quantization_arg,
    machine_info,
    make_console,
    run_undisturbed,
    write_report,
)
from dense_copy import DEFAULT_OUT as DEFAULT_DENSE_DIR
from dense_copy import make_dense_copy
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from yaie import LLM, SamplingParams
from yaie.model.loader import bundled_model_path

PROMPTS = [
    "The history of the printing press is a story of how ideas began to travel faster than ever before. "
    "Explain how Gutenberg's invention changed the way people in Europe learned, argued and worked, "
    "and what it meant for the churches and universities of the time.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy night, "
    "and describe what happens when she decides to answer it.",
    "Photosynthesis is the process that plants use to turn light into chemical energy. Describe the main "
    "steps of this process and explain why it matters for life on Earth.",
    "A small bakery wants to sell more bread in the mornings without hiring more staff. Suggest a practical "
    "plan with three concrete ideas, and explain the cost of each one.",
    "Compare trains and airplanes for a trip of about five hundred kilometres, looking at travel time, "
    "comfort, price and the effect on the environment. Which would you choose for a family of four with "
    "two small children and a lot of luggage, and why?",
    "In the programming language Python, a list comprehension builds a new list from an existing one. "
    "Show an example that keeps only the even numbers, and explain each part.",
    "The ocean covers most of the surface of our planet, yet much of it is still unexplored. Describe "
    "three creatures that live in the deep sea and how they survive there.",
    "Imagine you are a tour guide in an old European city. Welcome a group of visitors, tell them about "
    "the cathedral in the main square, and recommend a place for lunch.",
]

# The floors on a 2-vCPU machine: (batch size, metric, minimum yaie/transformers ratio).
FLOORS = [(1, "decode", 1.3), (8, "aggregate", 2.0)]


@dataclass
class Run:
    """One timed generation of a whole batch."""

    batch_size: int
    new_tokens: int
    total_s: float  # submit -> last token
    ttft_s: float  # submit -> every request has its first token
    decode_tokens: int  # tokens produced after ttft_s
    decode_s: float  # ttft_s -> last token
    token_ids: list[list[int]] = field(repr=False)  # what each request generated, in prompt order
    background_cores: float = 0.0  # CPU cores other processes kept busy during the run
    discarded: list[float] = field(default_factory=list)  # background cores of disturbed attempts redone

    @property
    def aggregate_tok_s(self) -> float:
        return self.new_tokens / self.total_s

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s

    def to_json(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if k != "token_ids"}
        return fields | {"aggregate_tok_s": self.aggregate_tok_s, "decode_tok_s": self.decode_tok_s}


class Runner(Protocol):
    name: str

    def run(self, prompts: list[list[int]], max_tokens: int) -> Run: ...


def batch_of(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(batch_size)]


class YaieRunner:
    name = "yaie"

    def __init__(self, max_num_seqs: int, threads: int, quantization: str) -> None:
        self.llm = LLM(
            enable_prefix_caching=False,
            max_num_seqs=max_num_seqs,
            num_threads=threads,
            quantization=quantization,
        )

    def run(self, prompts: list[list[int]], max_tokens: int) -> Run:
        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        request_ids = [engine.add_request(None, prompt, params) for prompt in prompts]
        waiting_for_first = set(request_ids)
        first_tokens_at: float | None = None
        new_tokens = decode_tokens = 0
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            produced = sum(len(o.outputs[0].delta_token_ids) for o in outputs)
            new_tokens += produced
            if first_tokens_at is None:
                waiting_for_first.difference_update(o.request_id for o in outputs)
                if not waiting_for_first:
                    first_tokens_at = now
            else:
                decode_tokens += produced
            finished.update((o.request_id, o.outputs[0].token_ids) for o in outputs if o.finished)
        end = time.perf_counter()
        assert first_tokens_at is not None
        return Run(
            batch_size=len(prompts),
            new_tokens=new_tokens,
            total_s=end - start,
            ttft_s=first_tokens_at - start,
            decode_tokens=decode_tokens,
            decode_s=end - first_tokens_at,
            token_ids=[finished[request_id] for request_id in request_ids],
        )


class FirstCallClock(LogitsProcessor):
    """Notes when generate first processes logits: right after the prefill forward."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = time.perf_counter()
        return scores


class HFRunner:
    name = "transformers"

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        config = self.model.generation_config
        self.pad_id: int = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id

    def run(self, prompts: list[list[int]], max_tokens: int) -> Run:
        longest = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (longest - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        clock = FirstCallClock()
        start = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                eos_token_id=None,  # like yaie's ignore_eos: EOS is a token like any other
                pad_token_id=self.pad_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        end = time.perf_counter()
        assert clock.first is not None
        generated = output[:, longest:]
        return Run(
            batch_size=len(prompts),
            new_tokens=generated.numel(),
            total_s=end - start,
            ttft_s=clock.first - start,
            decode_tokens=generated.numel() - len(prompts),
            decode_s=end - clock.first,
            token_ids=generated.tolist(),
        )


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def summarize(runs: list[Run]) -> dict[str, Any]:
    return {
        "aggregate_tok_s": statistics.median(r.aggregate_tok_s for r in runs),
        "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
        "best_aggregate_tok_s": max(r.aggregate_tok_s for r in runs),
        "best_decode_tok_s": max(r.decode_tok_s for r in runs),
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "total_s": statistics.median(r.total_s for r in runs),
        "background_cores": statistics.median(r.background_cores for r in runs),
        "discarded_runs": sum(len(r.discarded) for r in runs),
        "runs": [r.to_json() for r in runs],
    }


def ratios(entry: dict[str, Any]) -> dict[str, float]:
    """yaie / transformers for each metric, from medians and from the best runs."""
    yaie, hf = entry["yaie"], entry["transformers"]
    keys = ("aggregate_tok_s", "decode_tok_s", "best_aggregate_tok_s", "best_decode_tok_s")
    return {key.removesuffix("_tok_s"): yaie[key] / hf[key] for key in keys}


def render_table(
    results: dict[int, dict[str, Any]], batch_ratios: dict[int, dict[str, float]], max_tokens: int
) -> Table:
    table = Table(title=f"Offline throughput, fp32, {max_tokens} new tokens per request, medians")
    for column in ("batch", "engine", "agg tok/s", "decode tok/s", "TTFT s", "bg cores", "agg ×", "decode ×"):
        table.add_column(column, justify="right", no_wrap=column in ("engine", "agg ×", "decode ×"))
    for batch, entry in results.items():
        for engine, summary in entry.items():
            cells = ["", ""]
            if engine == "yaie" and batch in batch_ratios:
                r = batch_ratios[batch]
                cells = [f"{r[m]:.2f} ({r[f'best_{m}']:.2f})" for m in ("aggregate", "decode")]
            table.add_row(
                str(batch),
                engine,
                f"{summary['aggregate_tok_s']:.1f}",
                f"{summary['decode_tok_s']:.1f}",
                f"{summary['ttft_s']:.3f}",
                f"{summary['background_cores']:.2f}",
                *cells,
            )
        table.add_section()
    table.caption = "bg cores: CPU used by other processes; ×: yaie / transformers, median (best run)"
    return table


def check_floors(batch_ratios: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    checks = []
    for batch, metric, floor in FLOORS:
        if batch in batch_ratios:
            r = batch_ratios[batch]
            checks.append(
                {
                    "batch_size": batch,
                    "metric": metric,
                    "floor": floor,
                    "ratio": r[metric],
                    "best_ratio": r[f"best_{metric}"],
                    "passed": r[metric] >= floor,
                }
            )
    return checks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="yaie batch sizes")
    parser.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="*",
        default=[1, 8],
        help="those of the batch sizes also run with transformers",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine and batch size")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument(
        "--warmup-tokens", type=int, default=16, help="new tokens per request when warming up"
    )
    add_disturbance_args(parser)
    add_quantization_arg(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    parser.add_argument(
        "--dense-dir", type=Path, default=DEFAULT_DENSE_DIR, help="dense copy for transformers"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/offline_throughput.json"))
    return parser.parse_args()


def timed_run(runner: Runner, prompts: list[list[int]], args: argparse.Namespace, console: Console) -> Run:
    """One measured run, redone (up to --retries times) while other processes disturb it."""

    def report_retry(busy: float) -> None:
        console.log(f"{runner.name} run disturbed ({busy:.2f} cores busy elsewhere): running it again")

    kept = run_undisturbed(
        lambda: runner.run(prompts, args.max_tokens), args.max_bg_cores, args.retries, report_retry
    )
    run = kept.result
    run.background_cores, run.discarded = kept.background_cores, kept.discarded
    expected = len(prompts) * args.max_tokens
    if run.new_tokens != expected:
        raise RuntimeError(f"{runner.name} generated {run.new_tokens} tokens, not {expected}")
    return run


def main() -> int:
    args = parse_args()
    console = make_console()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()

    yaie = YaieRunner(max(args.batch_sizes), threads, args.quantization)
    runners: dict[str, Runner] = {"yaie": yaie}
    batch_sizes = {
        "yaie": set(args.batch_sizes),
        "transformers": set(args.hf_batch_sizes) & set(args.batch_sizes),
    }
    if batch_sizes["transformers"]:
        runners["transformers"] = HFRunner(make_dense_copy(bundled_model_path(), args.dense_dir))
    prompts = [yaie.llm.tokenizer(p).input_ids for p in PROMPTS]
    machine = machine_info()
    console.print(
        f"threads={threads}, prompt tokens {sorted(len(p) for p in prompts)}, "
        f"load average {machine['load_average'][0]:.2f}"
    )

    results: dict[int, dict[str, Any]] = {}
    batch_ratios: dict[int, dict[str, float]] = {}  # yaie / transformers, where both ran
    agreement: dict[int, list[int]] = {}  # per request: leading tokens on which both engines agree
    for batch in sorted(batch_sizes["yaie"]):
        engines = [name for name in runners if batch in batch_sizes[name]]
        batch_prompts = batch_of(prompts, batch)
        for name in engines:
            runners[name].run(batch_prompts, args.warmup_tokens)
        runs: dict[str, list[Run]] = {name: [] for name in engines}
        for repeat in range(args.repeats):
            for name in engines:  # alternate, so both engines share the same background load
                run = timed_run(runners[name], batch_prompts, args, console)
                runs[name].append(run)
                console.log(
                    f"batch {batch:3d} {name:12s} run {repeat + 1}: {run.aggregate_tok_s:7.1f} tok/s "
                    f"(decode {run.decode_tok_s:7.1f}, TTFT {run.ttft_s:.3f} s, "
                    f"{run.background_cores:.2f} cores busy elsewhere)"
                )
        results[batch] = {name: summarize(runs[name]) for name in engines}
        if len(engines) == 2:
            batch_ratios[batch] = ratios(results[batch])
            pairs = zip(runs["yaie"][-1].token_ids, runs["transformers"][-1].token_ids, strict=True)
            agreement[batch] = [common_prefix(a, b) for a, b in pairs]

    console.print(render_table(results, batch_ratios, args.max_tokens))
    for batch, agreed in agreement.items():
        console.print(
            f"batch {batch}: the engines' greedy tokens agree on the first {min(agreed)} "
            f"of {args.max_tokens} in every request (best request: {max(agreed)})"
        )
    floors = check_floors(batch_ratios)
    for check in floors:
        verdict = "[green]pass[/]" if check["passed"] else "[red]below floor[/]"
        console.print(
            f"batch {check['batch_size']} {check['metric']}: yaie/transformers {check['ratio']:.2f}x median, "
            f"{check['best_ratio']:.2f}x best (floor {check['floor']}x) {verdict}"
        )

    report = {
        "benchmark": "offline_throughput",
        "machine": machine | {"load_average_after": machine_info()["load_average"]},
        "config": {
            "threads": threads,
            "dtype": "float32",
            "quantization": args.quantization,
            "weight_types": yaie.llm.engine.model_info.quantization,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "warmup_tokens": args.warmup_tokens,
            "max_bg_cores": args.max_bg_cores,
            "retries": args.retries,
            "prompt_tokens": [len(p) for p in prompts],
            "transformers": transformers.__version__,
        },
        "results": {
            str(batch): entry | ({"ratios": batch_ratios[batch]} if batch in batch_ratios else {})
            for batch, entry in results.items()
        },
        "greedy_agreement_tokens": {str(batch): agreed for batch, agreed in agreement.items()},
        "floors": floors,
    }
    write_report(args.out, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
