"""Time the sampler per decode step, greedy vs every control on, against a decode step's budget.

    python benchmarks/sampler.py [--batch-sizes 1 32 128] [--runs 30] [--decode-step-ms 80]

The issue's target: at batch 32 the sampler takes under 10% of a decode step. For scale, the
script also times a 576 x 49,152 fp32 matmul at batch 32, a proxy of the LM head's cost.

Times are wall-clock medians. On a machine shared with other busy processes, every
multi-threaded op can wait a scheduler tick (~4 ms) for its second thread, which swamps these
sub-millisecond ops; ``--threads 1`` gives steadier numbers there.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from yaie.sampling.sampler import Sampler, SamplerOutput
from yaie.sampling_params import SamplingParams

HIDDEN = 576  # the bundled model's hidden size, for the LM-head proxy
EOS_TOKEN_IDS = (0, 2)


@dataclass
class Row:
    """One row of the batch, with what the sampler reads from an engine sequence."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def step(sampler: Sampler, logits: torch.Tensor, rows: list[Row]) -> SamplerOutput:
    """One engine step's sampling: the batch is prepared and sampled."""
    return sampler.sample(logits, sampler.prepare(rows, logits.device))


def median_ms(fn: Callable[[], object], runs: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def greedy_seqs(batch: int, vocab: int, rng: random.Random) -> list[Row]:
    return [
        Row(SamplingParams(temperature=0.0), [rng.randrange(vocab) for _ in range(512)])
        for _ in range(batch)
    ]


def all_controls_seqs(batch: int, vocab: int, rng: random.Random) -> list[Row]:
    """Penalties over a 512-token prompt and 200 output tokens, top-k, top-p, min-p, logit_bias,
    min_tokens, a seed on every other row and 5 logprobs."""
    seqs = []
    for row in range(batch):
        seed = row if row % 2 == 0 else None
        params = SamplingParams(
            temperature=0.8,
            top_k=50,
            top_p=0.9,
            min_p=0.02,
            repetition_penalty=1.1,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(10)},
            min_tokens=300,
            max_tokens=512,
            stop_token_ids=[7, 9],
            logprobs=5,
            seed=seed,
        )
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        prompt = [rng.randrange(vocab) for _ in range(512)]
        output = [rng.randrange(vocab) for _ in range(200)]
        seqs.append(Row(params, prompt, output, generator))
    return seqs


def temperature_seqs(batch: int, vocab: int, rng: random.Random) -> list[Row]:
    """Plain sampling (the OpenAI defaults but for the temperature): drawn over full rows."""
    return [Row(SamplingParams(temperature=0.8)) for _ in range(batch)]


def top_p_only_seqs(batch: int, vocab: int, rng: random.Random) -> list[Row]:
    """top_p without top_k: the cut-off is looked for among TOP_P_PROBE candidates per row."""
    output = [rng.randrange(vocab) for _ in range(200)]
    return [Row(SamplingParams(temperature=0.8, top_p=0.9), [], list(output)) for _ in range(batch)]


def lm_like_logits(batch: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Random logits whose softmax falls off like a language model's (Zipf-like over ranks)
    rather than the near-uniform softmax of standard normal logits."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.1 * ranks.log()
    logits = torch.stack([base[torch.randperm(vocab, generator=generator)] for _ in range(batch)])
    return logits + 0.1 * torch.randn(batch, vocab, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--runs", type=int, default=30, help="timed runs per case; the median is shown")
    parser.add_argument("--decode-step-ms", type=float, default=80.0, help="measured decode step at batch 32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    sampler = Sampler(EOS_TOKEN_IDS)  # one sampler throughout, as in the engine
    cases = [
        ("greedy", greedy_seqs),
        ("temperature", temperature_seqs),
        ("all controls", all_controls_seqs),
        ("top-p only", top_p_only_seqs),
    ]
    threads = torch.get_num_threads()
    print(f"sampler, ms per step: vocab {args.vocab}, {threads} threads, median of {args.runs} runs")
    print(f"{'batch':>5}" + "".join(f"{name:>20}" for name, _ in cases))
    results: dict[tuple[int, str], float] = {}
    for batch in args.batch_sizes:
        logits = lm_like_logits(batch, args.vocab, generator)
        cells = []
        for name, make in cases:
            seqs = make(batch, args.vocab, rng)
            ms = median_ms(lambda s=seqs, x=logits: step(sampler, x, s), args.runs)
            results[batch, name] = ms
            ratio = ms / results[batch, "greedy"]
            cells.append(f"{ms:.3f}" if name == "greedy" else f"{ms:.3f} ({ratio:.1f}x)")
        print(f"{batch:>5}" + "".join(f"{cell:>20}" for cell in cells))
    print("(n.nx): over greedy at the same batch")

    hidden = torch.randn(32, HIDDEN, generator=generator)
    head = torch.randn(HIDDEN, args.vocab, generator=generator)
    matmul_ms = median_ms(lambda: hidden @ head, args.runs)
    print(f"\nreference: 32x{HIDDEN} @ {HIDDEN}x{args.vocab} fp32 matmul (LM-head proxy): {matmul_ms:.3f} ms")

    if (32, "all controls") in results:
        ms = results[32, "all controls"]
        share = ms / args.decode_step_ms
        verdict = "OK" if share < 0.10 else "OVER BUDGET"
        print(
            f"batch 32, all controls: {ms:.2f} ms = {share:.1%} of a {args.decode_step_ms:g} ms decode step"
            f" (target < 10%): {verdict}"
        )


if __name__ == "__main__":
    main()
