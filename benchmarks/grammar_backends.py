"""xgrammar vs llguidance on the bundled model's tokenizer (49,152 tokens): the numbers behind
the choice of grammar library in docs/structured-outputs.md ("Why llguidance").

For each library:
- compile: the time from a JSON schema to a matcher that has filled its first mask, over the
  schemas of tests/structured/data/schemas.json (a fresh compiler per schema, so no cache helps;
  llguidance builds its lexer lazily, so its first mask is part of its "compile");
- mask: the time to fill one step's bitmasks for batch 1, 8 and 32 constrained rows, each
  row a matcher walking its schema by tokens drawn at random among those its mask allows;
- apply: the time to apply those bitmasks to float32 logits [B, V] in place;
- and what a step of yaie pays with the chosen library: the sampler's GrammarMask processor
  built (every constrained row's mask filled, the rows in parallel) and applied, at the same
  batch sizes;
- with --throughput, the bundled model in the engine's default quantization serving 1, 8 and 32
  clients in a closed loop (each sends its next request when the last one ends): the tokens/s
  of a run where every request has a JSON schema of the test set against a run of the same
  work unconstrained, the mean step time of the unconstrained run, and GrammarMask's cost above
  as a share of that step. The same work: a constrained answer ends when its grammar is
  complete (often well before max_tokens), where an unconstrained one would run on, so the
  unconstrained run replays the constrained one's requests in the same order, each with the
  same prompt and max_tokens set to the length the constrained answer had, ignoring EOS. Both
  runs then prefill the same prompts and decode the same number of tokens in the same batches;
  what differs is the grammar's work alone (masks, the sampler's cut of banned tokens, the
  matcher's advance). Each constrained run is followed by its unconstrained twin; the ratio
  printed is the median of the pairs' ratios.

xgrammar is not one of yaie's dependencies; for this comparison install it without the triton
it asks for (CPU only): pip install --no-deps xgrammar apache-tvm-ffi

    nice -n 19 python benchmarks/grammar_backends.py [--steps 40] [--threads 1]
        [--throughput] [--repeats 5] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch
import xgrammar as xgr

from yaie import LLM
from yaie.model.loader import bundled_model_path, load_tokenizer
from yaie.sampling.processors import GrammarMask
from yaie.sampling_params import SamplingParams
from yaie.structured.backend import GrammarCompiler
from yaie.structured.spec import StructuredOutputs

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "structured" / "data" / "schemas.json"
BATCHES = (1, 8, 32)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size

    def matcher(self, schema: str) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return self.xgr.GrammarMatcher(compiler.compile_json_schema(schema))

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def matcher(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        matcher.compute_bitmask()  # the lexer is built lazily: count it here
        return matcher

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llg.torch.apply_token_bitmask_inplace(logits, bitmask)


def allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    bits = bitmask[row].view(torch.uint8).numpy()
    ids = np.flatnonzero(np.unpackbits(bits, bitorder="little"))
    return [int(i) for i in ids if i < vocab_size]


def time_compile(backend: Any, schemas: list[str]) -> list[float]:
    times = []
    for schema in schemas:
        started = time.perf_counter()
        backend.matcher(schema)
        times.append(time.perf_counter() - started)
    return times


def time_masks(
    backend: Any, schemas: list[str], batch: int, steps: int, rng: random.Random
) -> tuple[float, float]:
    """Mean seconds per step to fill `batch` rows' masks, and to apply them."""
    matchers = [backend.matcher(schemas[i % len(schemas)]) for i in range(batch)]
    bitmask = backend.bitmask(batch)
    logits = torch.randn(batch, backend.vocab_size)
    backend.apply(logits.clone(), bitmask)  # a first call may compile its kernel
    fill_s = apply_s = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        for row, matcher in enumerate(matchers):
            backend.fill(matcher, bitmask, row)
        fill_s += time.perf_counter() - started
        started = time.perf_counter()
        backend.apply(logits, bitmask)
        apply_s += time.perf_counter() - started
        for row in range(batch):
            if backend.done(matchers[row]):
                matchers[row] = backend.matcher(schemas[(row + 1) % len(schemas)])
                continue
            choices = allowed(bitmask, row, backend.vocab_size)
            assert backend.accept(matchers[row], rng.choice(choices))
    return fill_s / steps, apply_s / steps


@dataclass
class Row:
    """A constrained sequence as the sampler sees it."""

    sampling_params: SamplingParams
    grammar: Any
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def time_yaie_mask(tokenizer: Any, vocab_size: int, schemas: list[str], batch: int, steps: int) -> float:
    """Mean seconds per step of GrammarMask.build + apply over `batch` constrained rows, each
    row advancing by its greedy token under the mask."""
    compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    specs = [StructuredOutputs(json=schemas[i % len(schemas)]) for i in range(batch)]
    rows = [Row(SamplingParams(structured_outputs=spec), compiler.compile(spec).matcher()) for spec in specs]
    device = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    total = 0.0
    for step in range(steps + 1):  # step 0 warms up
        logits = torch.randn(batch, vocab_size, generator=generator)
        started = time.perf_counter()
        mask = GrammarMask.build(rows, device)
        assert mask is not None
        mask.apply(logits)
        total += (time.perf_counter() - started) if step else 0.0
        for row, spec, token in zip(rows, specs, logits.argmax(dim=-1).tolist(), strict=True):
            if row.grammar.is_terminated():
                row.grammar = compiler.compile(spec).matcher()
            else:
                assert row.grammar.accept(token)
    return total / steps


Request = tuple[list[int], SamplingParams]


@dataclass
class Run:
    rate: float  # output tokens a second
    step_s: float  # mean seconds a step
    lengths: list[int]  # output tokens of each request sent, in the order sent


def closed_loop(llm: LLM, requests: list[Request], clients: int, tokens: int) -> Run:
    """`clients` clients in a closed loop until `tokens` tokens are out: each sends the next of
    `requests` (cycling) when its last one ends. The requests still running then are drained,
    untimed, so that every request sent has its length."""
    engine, out, steps = llm.engine, 0, 0
    ids: list[str] = []
    lengths: dict[str, int] = {}  # by request id, once finished

    def send() -> None:
        prompt, params = requests[len(ids) % len(requests)]
        ids.append(engine.add_request(None, prompt, params))

    def step() -> int:
        """One engine step; the tokens it put out."""
        produced = 0
        for output in engine.step():
            produced += len(output.outputs[0].delta_token_ids)
            if output.finished:
                lengths[output.request_id] = len(output.outputs[0].token_ids)
        return produced

    for _ in range(clients):
        send()
    started = time.perf_counter()
    while out < tokens:
        finished = len(lengths)
        out += step()
        for _ in range(len(lengths) - finished):
            send()
        steps += 1
    elapsed = time.perf_counter() - started
    while engine.has_unfinished_requests():
        step()
    return Run(out / elapsed, elapsed / steps, [lengths[request_id] for request_id in ids])


def same_work(prompts: list[list[int]], lengths: list[int]) -> list[Request]:
    """Unconstrained requests doing what a constrained run did: request i has the prompt of the
    constrained run's request i and as many output tokens as that one had (ignoring EOS)."""
    return [
        (prompts[i % len(prompts)], SamplingParams(max_tokens=length, ignore_eos=True))
        for i, length in enumerate(lengths)
    ]


def time_throughput(
    schemas: list[str], names: list[str], masks: dict[int, float], repeats: int, tokens: int
) -> None:
    llm = LLM()  # the engine's defaults: quantized weights as the GGUF stores them
    prompts = [
        llm.encode_chat([{"role": "user", "content": f"Write a JSON object for this: {name}"}])
        for name in names
    ]
    constrained = [
        (prompt, SamplingParams(max_tokens=64, structured_outputs=StructuredOutputs(json=schema)))
        for prompt, schema in zip(prompts, schemas, strict=True)
    ]
    closed_loop(llm, constrained, 8, tokens // 2)  # warm-up: grammars compiled, kernels built
    print(
        f"\n{tokens} tokens a run, {repeats} runs each; each JSON run is followed by an unconstrained"
        " one\nwith the same requests' prompts and output lengths (ignore_eos); medians of the runs:"
    )
    for clients in BATCHES:
        runs: dict[str, list[Run]] = {"json": [], "free": []}
        for _ in range(repeats):
            run = closed_loop(llm, constrained, clients, tokens)
            runs["json"].append(run)
            runs["free"].append(closed_loop(llm, same_work(prompts, run.lengths), clients, tokens))
        rate = {kind: statistics.median(run.rate for run in values) for kind, values in runs.items()}
        # Each pair ran back to back, so its ratio is the least exposed to the machine's drift.
        ratio = statistics.median(j.rate / f.rate for j, f in zip(runs["json"], runs["free"], strict=True))
        step = statistics.median(run.step_s for run in runs["free"])
        mean_length = statistics.mean(length for run in runs["json"] for length in run.lengths)
        print(
            f"  {clients:2d} clients: JSON schema {rate['json']:6.1f} tok/s, none {rate['free']:6.1f} tok/s,"
            f" pairs' median ratio {ratio:.2f}x; {mean_length:4.1f} tokens a request;"
            f" unconstrained step {step * 1e3:6.2f} ms,"
            f" GrammarMask {masks[clients] * 1e3:5.2f} ms = {masks[clients] / step:4.0%} of it"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--throughput", action="store_true", help="also serve clients (see above)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens out per throughput run")
    parser.add_argument("--skip-xgrammar", action="store_true", help="measure yaie's path only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(bundled_model_path())
    vocab_size = len(tokenizer)
    entries = json.loads(SCHEMAS.read_text())
    schemas = [json.dumps(entry["schema"]) for entry in entries]
    names = [entry["name"].replace("_", " ") for entry in entries]
    print(f"vocabulary: {vocab_size} tokens; {len(schemas)} schemas; {args.threads} torch thread(s)")
    makers: list[Callable[[Any, int], Any]] = [Llguidance] if args.skip_xgrammar else [Xgrammar, Llguidance]
    for make in makers:
        started = time.perf_counter()
        backend = make(tokenizer, vocab_size)
        setup = time.perf_counter() - started
        compile_times = time_compile(backend, schemas)
        print(f"\n{backend.name}: tokenizer setup {setup * 1e3:.0f} ms")
        print(
            f"  compile  p50 {statistics.median(compile_times) * 1e3:7.2f} ms   "
            f"p99 {percentile(compile_times, 0.99) * 1e3:7.2f} ms"
        )
        for batch in BATCHES:
            fill, apply = time_masks(backend, schemas, batch, args.steps, random.Random(0))
            print(
                f"  batch {batch:2d}: fill {fill * 1e3:7.3f} ms/step ({fill / batch * 1e6:6.1f} us/row)"
                f"   apply {apply * 1e3:6.3f} ms/step"
            )
    print("\nyaie's GrammarMask (llguidance), build + apply per step:")
    masks = {}
    for batch in BATCHES:
        masks[batch] = time_yaie_mask(tokenizer, vocab_size, schemas, batch, args.steps)
        print(f"  batch {batch:2d}: {masks[batch] * 1e3:7.3f} ms/step")
    if args.throughput:
        torch.set_num_threads(os.cpu_count() or 1)  # the model runs on every core, as served
        time_throughput(schemas, names, masks, args.repeats, args.tokens)


if __name__ == "__main__":
    main()
