"""Quality per GGUF type against llama.cpp's: yaie's perplexity ratio to F16 beside llama-perplexity's.

    python benchmarks/perplexity_llamacpp.py [--types Q4_0 Q4_K_M ...] [--ctx 512] [--chunks 14]
        [--text /usr/share/common-licenses/GPL-3] [--kv-cache-dtype auto]
        [--threads N] [--gguf-dir ~/.cache/yaie/gguf] [--peers /tmp/peers]
        [--out benchmarks/results/perplexity_llamacpp.json]

The files: the bundled SmolLM2-135M's dense copy (benchmarks/dense_copy.py: its Q4_1 weights
dequantized to fp32) converted by llama.cpp's own `convert_hf_to_gguf.py --outtype f16`, and that
F16 file quantized by its `llama-quantize` into each type (benchmarks/make_gguf.py's
llama_gguf_files), cached as GGUF_DIR/smollm2-135m-<TYPE>.gguf and kept if present. The model's
hidden size, 576, is not a multiple of 256, so llama-quantize stores every tensor whose rows are
576 long in a fallback type wherever a K-quant or IQ4_XS was asked for (Q4_0, Q5_0, Q5_1, Q8_0,
IQ4_NL: llama.cpp's rules); the table's "tensor types" column says what each file holds (norms,
F32 in every file, left out): the Q2_K file holds no Q2_K tensor at all, the Q3_K_M and Q3_K_L
files no Q3_K (the table flags them).

Both engines score the same tokens the same way, llama-perplexity's way
(llama.cpp/tools/perplexity/perplexity.cpp, `perplexity()`):
  - the text less one trailing newline (`-f` drops it) is tokenized once, whole, by llama.cpp's
    tokenizer (`llama-tokenize --ids`, built beside llama-perplexity), BOS first only if the
    vocabulary asks for one (SmolLM2's does not);
  - it is cut into non-overlapping chunks of `--ctx` tokens from the start (the tail is dropped),
    at most `--chunks` of them; each chunk is one sequence with a fresh KV cache, its first token
    replaced by BOS where the vocabulary adds one;
  - in each chunk only the second half is scored: the tokens at positions ctx/2 + 1 .. ctx - 1,
    each from the log-softmax of the logits one position before (ctx/2 - 1 tokens a chunk);
  - the perplexity is exp of the mean negative log-likelihood over all scored tokens
    (llama-perplexity's `Final estimate: PPL = X +/- Y`).
yaie gets each chunk as a prompt of token ids through `LLM.generate` with
`SamplingParams(prompt_logprobs=0)` (benchmarks/perplexity.py's `score`), loading each file with
`quantization="auto"`: the stored types as stored, F16 dense. llama.cpp multiplies its quantized
weights by activations rounded to 8 bits (Q8_0 / Q8_K), as yaie's kernels do too.
Whether yaie's own tokenizer (transformers' conversion of the GGUF vocabulary) gives llama.cpp's
ids is checked and reported: on SmolLM2 it differs where spaces precede a digit (llama.cpp's
`smollm` pre-tokenizer splits the digits off first: "\\n\\n  0." is "\\n\\n  ", "0", "." to
llama.cpp, "\\n\\n ", " ", "0", "." to yaie; the GPL-3 is 7,638 ids to llama.cpp, 7,657 to
yaie), hence llama.cpp's ids for both engines.

Per type: ratio = perplexity(type) / perplexity(F16 of the same model), each engine's over its
own F16; agreement = yaie's ratio / llama.cpp's - 1. Exit status 1 when any type's |agreement|
exceeds 1%, or yaie (or llama.cpp) refuses a file: a refusal is reported with its error message
and counts as a miss. On 2 cores, at the defaults: ~30 s a file once the files exist (each
engine ~15 s), ~9 min for all 17 files with their quantizing the first time.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from bench_utils import machine_info, make_console, write_report  # benchmarks/ is the script's folder
from dense_copy import DEFAULT_OUT, make_dense_copy
from gguf import GGUFReader
from make_gguf import llama_gguf_files
from perplexity import DEFAULT_TEXT, Variant, add_engine_args, score
from rich.console import Console
from rich.table import Table

from yaie.model.loader import bundled_model_path, load_tokenizer

TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_S", "Q4_K_M",
         "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS")  # fmt: skip
STEM = "smollm2-135m"
AGREEMENT = 0.01  # |yaie's ratio / llama.cpp's - 1|, at most (the floor)
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


def type_mix(path: Path) -> dict[str, int]:
    """How many tensors of the file each GGML type holds, most first."""
    counts = Counter(tensor.tensor_type.name for tensor in GGUFReader(str(path)).tensors)
    return dict(counts.most_common())


def base_type(name: str) -> str:
    """The tensor type a llama-quantize type is named after: Q4_K for Q4_K_M, Q8_0 for Q8_0."""
    return re.sub(r"_[SML]$", "", name)


def llama_tokens(bin_dir: Path, gguf: Path, text: str) -> tuple[list[int], bool]:
    """`text` tokenized by llama.cpp as llama-perplexity does (add_special on, parse_special off),
    and whether the vocabulary adds a BOS (seen as the one id `--no-bos` leaves out)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
        file.write(text)
        file.flush()
        command = [str(bin_dir / "llama-tokenize"), "-m", str(gguf), "-f", file.name, "--ids",
                   "--log-disable", "--no-escape"]  # fmt: skip
        runs = [
            subprocess.run(command + extra, check=True, capture_output=True, text=True)
            for extra in ([], ["--no-bos"])
        ]
    ids, no_bos = (ast.literal_eval(run.stdout.strip().splitlines()[-1]) for run in runs)
    return ids, len(ids) == len(no_bos) + 1


def llama_perplexity(bin_dir: Path, gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """llama-perplexity's final estimate over `args.text`, or its error."""
    command = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(args.text), "-c", str(args.ctx),
               "--chunks", str(args.chunks), "-t", str(args.threads)]  # fmt: skip
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    final, chunks = FINAL.search(run.stderr + run.stdout), CHUNKS.search(run.stderr)
    if run.returncode != 0 or final is None or chunks is None:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        return {"error": f"llama-perplexity exited {run.returncode}: " + " | ".join(tail), "seconds": seconds}
    return {
        "perplexity": float(final[1]),
        "plus_minus": float(final[2]),
        "chunks": int(chunks[1]),
        "seconds": seconds,
    }


def yaie_perplexity(
    gguf: Path, prompts: list[list[int]], first: int, args: argparse.Namespace
) -> dict[str, Any]:
    """yaie's perplexity of the prompts' tokens from position `first` on, or why it refused the file."""
    start = time.perf_counter()
    try:
        row = score(Variant(gguf.stem, "gguf", "auto"), str(gguf), prompts, args, first)
    except Exception as exc:  # a refusal (UnsupportedModelError and kin) is a result, not a crash
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    kept = ("perplexity", "scored_tokens", "weight_types", "kernel_isa", "kv_cache_dtype", "weight_bytes")
    return {**{key: row[key] for key in kept}, "seconds": time.perf_counter() - start}


def render_table(rows: list[dict[str, Any]], args: argparse.Namespace, scored: int) -> Table:
    table = Table(title=f"perplexity over {args.text.name}, llama-perplexity's protocol: -c {args.ctx}, "
                        f"{scored} tokens scored")  # fmt: skip
    columns = ("type", "MiB", "tensor types (F32 aside)", "yaie", "llama.cpp", "yaie ×F16", "llama ×F16",
               "agreement", "")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column.startswith("tensor") else "right")
    for row in rows:
        yaie, llama = row["yaie"], row["llama"]
        mix = ", ".join(f"{name} {count}" for name, count in row["tensor_types"].items() if name != "F32")
        if not row["holds_own_type"]:
            mix += f" (no {base_type(row['type'])} tensor)"
        agreement = row.get("agreement")
        if "error" in yaie or "error" in llama:
            verdict = "refused by yaie" if "error" in yaie else "llama.cpp failed"
        else:
            verdict = "" if agreement is None else "ok" if abs(agreement) <= AGREEMENT else "MISSED"
        table.add_row(
            row["type"], f"{row['file_bytes'] / 2**20:.0f}", mix,
            f"{yaie['perplexity']:.4f}" if "perplexity" in yaie else "-",
            f"{llama['perplexity']:.4f}" if "perplexity" in llama else "-",
            f"{row['ratio_yaie']:.4f}" if "ratio_yaie" in row else "-",
            f"{row['ratio_llama']:.4f}" if "ratio_llama" in row else "-",
            "-" if agreement is None else f"{agreement:+.2%}", verdict,
        )  # fmt: skip
    return table


def report_refusals(rows: list[dict[str, Any]], console: Console) -> None:
    for row in rows:
        for engine in ("yaie", "llama"):
            if "error" in row[engine]:
                console.print(f"{row['type']}: {engine} failed: {row[engine]['error']}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", nargs="+", default=list(TYPES), help="llama-quantize's type names")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text to score")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    parser.add_argument(
        "--chunks", type=int, default=14, help="chunks scored, at most (the GPL-3 has 14 of 512)"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="llama.cpp's -t")
    add_engine_args(parser)
    parser.add_argument("--gguf-dir", type=Path, default=Path.home() / ".cache/yaie/gguf")
    parser.add_argument("--dense", type=Path, default=DEFAULT_OUT, help="the fp32 copy (made if missing)")
    parser.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS_DIR", "/tmp/peers")))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/perplexity_llamacpp.json"))
    args = parser.parse_args()
    console = make_console()
    begin = time.perf_counter()

    tree = args.peers / "llama.cpp"
    bin_dir = tree / "build/bin"
    for tool in ("llama-quantize", "llama-perplexity", "llama-tokenize"):
        if not (bin_dir / tool).exists():
            parser.error(f"{bin_dir / tool} is missing: run benchmarks/peers/install_llamacpp.sh first")
    gguf = bundled_model_path()
    files = llama_gguf_files(tree, args.gguf_dir, STEM, args.types, lambda: make_dense_copy(gguf, args.dense))

    text = args.text.read_text()
    text = text.removesuffix("\n")  # what llama-perplexity's -f reads
    token_ids, add_bos = llama_tokens(bin_dir, files["F16"], text)
    own_ids = load_tokenizer(files["F16"])(text, add_special_tokens=False).input_ids
    bos_id = int(GGUFReader(str(files["F16"])).fields["tokenizer.ggml.bos_token_id"].contents())
    chunks = min(args.chunks, len(token_ids) // args.ctx)
    if len(token_ids) < 2 * args.ctx or chunks < 1:
        parser.error(f"{args.text} has {len(token_ids)} tokens: llama-perplexity needs 2 x --ctx at least")
    prompts = [token_ids[i * args.ctx : (i + 1) * args.ctx] for i in range(chunks)]
    if add_bos:
        prompts = [[bos_id, *prompt[1:]] for prompt in prompts]
    first = args.ctx // 2  # llama-perplexity's `first`: logits from here on, each scoring the next token
    scored = chunks * (args.ctx - first - 1)
    same = "the same" if own_ids == token_ids else "different"
    console.print(f"{args.text}: {len(token_ids)} tokens by llama.cpp's tokenizer (yaie's: {len(own_ids)}, "
                  f"{same} ids), {chunks} chunks of {args.ctx}, {scored} tokens scored, "
                  f"BOS per chunk: {add_bos}")  # fmt: skip

    rows = []
    for name, path in files.items():
        mix = type_mix(path)
        own = base_type(name) in mix
        row: dict[str, Any] = {"type": name, "file": str(path), "file_bytes": path.stat().st_size,
                               "tensor_types": mix, "holds_own_type": own}  # fmt: skip
        row["llama"] = llama_perplexity(bin_dir, path, args)
        row["yaie"] = yaie_perplexity(path, prompts, first + 1, args)
        rows.append(row)
        found = {engine: row[engine].get("perplexity", "failed") for engine in ("yaie", "llama")}
        console.log(f"{name} ({mix}): yaie {found['yaie']}, llama.cpp {found['llama']}")
        if row["llama"].get("chunks", chunks) != chunks:
            console.print(f"llama-perplexity scored {row['llama']['chunks']} chunks, yaie {chunks}")
            return 1

    base = rows[0]
    missed = []
    for row in rows[1:]:
        for engine in ("yaie", "llama"):
            if "perplexity" in row[engine] and "perplexity" in base[engine]:
                row[f"ratio_{engine}"] = row[engine]["perplexity"] / base[engine]["perplexity"]
        if "ratio_yaie" in row and "ratio_llama" in row:
            row["agreement"] = row["ratio_yaie"] / row["ratio_llama"] - 1
        if not abs(row.get("agreement", math.inf)) <= AGREEMENT:
            missed.append(row["type"])
    console.print(render_table(rows, args, scored))
    report_refusals(rows, console)

    version = subprocess.run([str(bin_dir / "llama-perplexity"), "--version"], capture_output=True, text=True)
    report = {
        "benchmark": "perplexity_llamacpp",
        "machine": machine_info(),
        "config": {
            "text": str(args.text),
            "text_tokens": len(token_ids),
            "yaie_tokenizer_tokens": len(own_ids),
            "yaie_tokenizer_same_ids": own_ids == token_ids,
            "bos_per_chunk": add_bos,
            "ctx": args.ctx,
            "chunks": chunks,
            "scored_positions": [first + 1, args.ctx - 1],
            "scored_tokens": scored,
            "kv_cache_dtype": args.kv_cache_dtype,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "llama_threads": args.threads,
            "llama_cpp_version": (version.stdout + version.stderr).strip().splitlines()[0],
            "agreement_floor": AGREEMENT,
        },
        "results": rows,
        "missed": missed,
        "seconds": time.perf_counter() - begin,
    }
    write_report(args.out, report, console)
    console.print(f"{time.perf_counter() - begin:.0f} s in all")
    if missed:
        console.print(f"missed (|agreement| > {AGREEMENT:.0%}, or refused): {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
