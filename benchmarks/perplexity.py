"""What quantized weights cost in quality: perplexity of the bundled model over a fixed English text.

    python benchmarks/perplexity.py [--text /usr/share/common-licenses/GPL-3] [--window 1024]
        [--dense DIR] [--kv-cache-dtype auto] [--max-num-batched-tokens 2048]
        [--out benchmarks/results/perplexity.json]

The text is the GPL-3 licence, present on every Debian machine. It is tokenized once with the
model's tokenizer, cut into non-overlapping windows of `--window` tokens (a shorter tail is left
out, so that every window gives its tokens the same context), and each window is scored on all
but its first token: mean negative log-likelihood over every scored token, and its exp, the
perplexity. Four ways of holding the same weights are scored on the same windows:

  fp32   the GGUF dequantized to float32 (`quantization="none"`): the baseline
  Q4_1   the GGUF's stored Q4_1 weights, run as stored (`quantization="auto"`)
  int8   quantized at load from the dense fp32 copy (`quantization="int8"`)
  int4   likewise (`quantization="int4"`)

int8 and int4 start from the fp32 copy benchmarks/dense_copy.py writes (made here if missing):
quantizing the GGUF's Q4_1 weights again is refused, as a second rounding on top of the first.

The quantized layers quantize their activations to int8 per 32 values for integer dot products at
any row count (yaie/ops/native_ops.py), so a prompt scored here carries the error every generated
token does.

What the KV cache stores (`--kv-cache-dtype`, auto: float16 under the quantized weights, float32
under the dense ones) only counts where attention reads it: a window prefilled in one step
attends to its own fresh K/V. `--max-num-batched-tokens 64` prefills each window in 64-token
chunks, so every later chunk reads the earlier ones back from the cache, as decoding does; run
it once with `--kv-cache-dtype float32` and once with `float16` (or `bfloat16`) to see what the
16-bit cache costs.

The log-probabilities come through the public API: `SamplingParams(prompt_logprobs=0)` returns
each prompt token's log_softmax of the raw logits (no temperature, penalties or bias applied).
Exit status 1 when a floor is missed: Q4_1 <= 1.01x the fp32 perplexity, int8 <= 1.005x.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_utils import machine_info, make_console, write_report  # benchmarks/ is the script's folder
from dense_copy import DEFAULT_OUT, make_dense_copy
from rich.table import Table

from yaie import LLM, SamplingParams
from yaie.config import KV_CACHE_DTYPES, EngineConfig
from yaie.model.loader import bundled_model_path, load_tokenizer

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
# The model's context is 8192 tokens, but the GPL-3 is ~7,700: one window would score the text
# once, at one context length. 1024-token windows score ~7 independent stretches, each with
# enough context that the loss has settled, at a fraction of the attention cost.
DEFAULT_WINDOW = 1024
# Perplexity of each weight format over the fp32 one, at most (issue #12's acceptance).
FLOORS = {"Q4_1": 1.01, "int8": 1.005}


@dataclass(frozen=True)
class Variant:
    name: str
    source: str  # "gguf" or "dense": which copy of the weights the engine loads
    quantization: str


VARIANTS = (
    Variant("fp32", "gguf", "none"),
    Variant("Q4_1", "gguf", "auto"),
    Variant("int8", "dense", "int8"),
    Variant("int4", "dense", "int4"),
)


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    """Non-overlapping `size`-token windows from the start; a shorter tail is dropped."""
    return [token_ids[start : start + size] for start in range(0, len(token_ids) - size + 1, size)]


def window_nlls(llm: LLM, prompts: list[list[int]], first: int = 1) -> list[list[float]]:
    """Per window, the negative log-likelihood of each token from position `first` (>= 1) on."""
    # One token is generated because a request must generate; only the prompt's logprobs count.
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    nlls = []
    for output in llm.generate(prompts, params):
        assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
        scored = output.prompt_logprobs[first:]
        ids = output.prompt_token_ids[first:]
        # The logprob reported must be that of the text's own next token.
        assert all(lp is not None and lp.token_id == t for lp, t in zip(scored, ids, strict=True))
        nlls.append([-lp.logprob for lp in scored if lp is not None])
    return nlls


def score(
    variant: Variant, model: str, prompts: list[list[int]], args: argparse.Namespace, first: int = 1
) -> dict[str, Any]:
    """Load `model` as `variant` says, with add_engine_args' options, and score each prompt's
    tokens from position `first` on."""
    llm = LLM(
        model, quantization=variant.quantization, kv_cache_memory=512 * 2**20,
        kv_cache_dtype=args.kv_cache_dtype, max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    info = llm.engine.model_info
    per_window = window_nlls(llm, prompts, first)
    del llm
    gc.collect()  # the next variant's weights replace these ones, not join them
    tokens = sum(len(w) for w in per_window)
    mean_nll = sum(sum(w) for w in per_window) / tokens
    return {
        "name": variant.name,
        "model": Path(model).name,
        "quantization": variant.quantization,
        "weight_types": info.quantization,
        "kernel_isa": info.kernel_isa,
        "kv_cache_dtype": info.kv_cache_dtype,
        "weight_bytes": info.weight_bytes,
        "scored_tokens": tokens,
        "mean_nll": mean_nll,
        "perplexity": math.exp(mean_nll),
        "window_mean_nll": [sum(w) / len(w) for w in per_window],
    }


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype and --max-num-batched-tokens: how `score` runs the engine."""
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="as `yaie serve`'s")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        help="prefill chunk budget; below the window, later chunks read K/V back from the cache",
    )


def render_table(rows: list[dict[str, Any]], window: int) -> Table:
    table = Table(title=f"perplexity over the GPL-3, {window}-token windows")
    columns = ("weights", "linear layers", "KV cache", "MiB resident", "mean NLL", "perplexity", "x fp32")
    for column in (*columns, "floor"):
        table.add_column(column, justify="right")
    for row in rows:
        floor = FLOORS.get(row["name"])
        met = floor is not None and row["ratio_to_fp32"] <= floor
        verdict = "" if floor is None else f"<= {floor}x " + ("ok" if met else "MISSED")
        table.add_row(
            row["name"], row["weight_types"], row["kv_cache_dtype"], f"{row['weight_bytes'] / 2**20:.0f}",
            f"{row['mean_nll']:.4f}", f"{row['perplexity']:.3f}", f"{row['ratio_to_fp32']:.4f}", verdict,
        )  # fmt: skip
    return table


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text to score")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per window")
    add_engine_args(parser)
    parser.add_argument("--dense", type=Path, default=DEFAULT_OUT, help="the fp32 copy (made if missing)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/perplexity.json"))
    args = parser.parse_args()
    console = make_console()
    if args.window < 2:
        parser.error("--window must be at least 2 tokens: the first of each is not scored")

    gguf = bundled_model_path()
    token_ids = load_tokenizer(gguf)(args.text.read_text(), add_special_tokens=False).input_ids
    prompts = windows(token_ids, args.window)
    if not prompts:
        parser.error(f"{args.text} has {len(token_ids)} tokens, fewer than one --window")
    dense = make_dense_copy(gguf, args.dense)
    console.print(f"{args.text}: {len(token_ids)} tokens, {len(prompts)} windows of {args.window}")

    rows = []
    for variant in VARIANTS:
        rows.append(score(variant, str(gguf if variant.source == "gguf" else dense), prompts, args))
        console.log(f"{variant.name}: perplexity {rows[-1]['perplexity']:.4f}")
    baseline = rows[0]["perplexity"]
    for row in rows:
        row["ratio_to_fp32"] = row["perplexity"] / baseline
    console.print(render_table(rows, args.window))

    missed = [r["name"] for r in rows if r["name"] in FLOORS and r["ratio_to_fp32"] > FLOORS[r["name"]]]
    report = {
        "benchmark": "perplexity",
        "machine": machine_info(),
        "config": {
            "text": str(args.text),
            "text_tokens": len(token_ids),
            "window": args.window,
            "kv_cache_dtype": args.kv_cache_dtype,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "windows": len(prompts),
            "tokens_left_out": len(token_ids) - len(prompts) * args.window,
            "floors": FLOORS,
        },
        "results": rows,
        "floors_missed": missed,
    }
    write_report(args.out, report, console)
    if missed:
        console.print(f"floor missed: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
