"""The comparison table (yaie against each peer, as ratios) and plots from compare_engines.sh results.

    python benchmarks/compare_report.py benchmarks/results/compare

Reads DIR/<engine>-short.json and DIR/<engine>-shared-prefix.json (serve_bench reports), prints a
markdown table and writes it to DIR/report.md, then draws DIR/plots/*.png with benchmarks/plots.py,
including KV-cache bytes against context length computed from each engine's KV layout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from yaie.model.loader import bundled_model_path
from yaie.model.loader_gguf import GGUFCheckpoint

# As benchmarks/peers/engines.sh labels them: yaie as served by default and with --quantization
# none (fp32), then the peers. The first yaie with results is "ours" in the ratio columns.
ENGINES = ("yaie", "yaie-fp32", "llama.cpp", "vllm-cpu-fp32", "vllm-cpu-bf16")
OURS = ("yaie", "yaie-fp32")
# Bytes per element of each engine's KV cache as run here: f16 for yaie by default (its `auto`
# under quantized weights, llama.cpp's default KV type too), fp32 for yaie and vLLM in fp32 (the
# KV cache takes the dense model's dtype), bf16 for vLLM in bf16.
KV_BYTES = {"yaie": 2, "yaie-fp32": 4, "llama.cpp": 2, "vllm-cpu-fp32": 4, "vllm-cpu-bf16": 2}
CONTEXTS = (512, 1024, 2048, 4096, 8192)


def level(report: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    return next((lv for lv in report["levels"] if lv["concurrency"] == concurrency), None)


def metric(reports: dict[str, dict[str, Any]], engine: str, key: str, concurrency: int) -> float | None:
    report = reports.get(engine)
    found = None if report is None else level(report, concurrency)
    return None if found is None else found.get(key)


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def ratio(ours: float | None, theirs: float | None, lower_is_better: bool) -> str:
    if not ours or not theirs:
        return "–"
    return f"{(theirs / ours if lower_is_better else ours / theirs):.2f}×"


def table(short: dict[str, dict[str, Any]], shared: dict[str, dict[str, Any]]) -> str:
    rows = []
    levels = sorted({lv["concurrency"] for r in short.values() for lv in r["levels"]})
    for c in levels:
        rows.append((f"{c} client(s) × 128 tokens: output tok/s", short, "output_tok_s", c, False, 1))
        rows.append((f"{c} client(s): TTFT p50 (s)", short, "ttft_p50_s", c, True, 3))
        if c > 1:
            rows.append((f"{c} clients: TTFT p99 (s)", short, "ttft_p99_s", c, True, 3))
    rows.append(("shared 1,000-token prefix: TTFT p50 (s)", shared, "ttft_p50_s", 1, True, 3))
    present = [e for e in ENGINES if e in short or e in shared]
    ours = next(e for e in OURS if e in short)
    peers = [e for e in present if e != ours]
    head = "| scenario | " + " | ".join(present) + "".join(f" | {ours} vs {p}" for p in peers) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for title, reports, key, c, lower, digits in rows:
        values = {e: metric(reports, e, key, c) for e in ENGINES}
        cells = [fmt(values[e], digits) for e in present]
        cells += [ratio(values[ours], values[p], lower) for p in peers]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Ratios are {ours}'s advantage: > 1× means it is faster (tok/s) or answers sooner (TTFT).")
    return "\n".join(lines)


def context_table(directory: Path) -> str:
    """Time per output token at each context length (compare_context.sh), and its growth."""
    tpot: dict[str, dict[int, float]] = {}
    prompt_tokens: dict[int, float] = {}  # what the server counted, chat template included
    for engine in ENGINES:
        for path in directory.glob(f"{engine}-ctx*.json"):
            found = level(json.loads(path.read_text()), 1)
            if found is None or found.get("tpot_p50_s") is None:
                continue
            context = int(path.stem.rsplit("ctx", 1)[1])
            tpot.setdefault(engine, {})[context] = found["tpot_p50_s"] * 1000
            prompt_tokens.setdefault(context, found["mean_prompt_tokens"])
    ours = next((e for e in OURS if e in tpot), None)
    if ours is None:
        return ""
    engines = [e for e in ENGINES if e in tpot]
    lines = ["| prompt tokens | " + " | ".join(f"{e} ms/token (× shortest)" for e in engines) + " |"]
    lines.append("|" + "---|" * (len(engines) + 1))
    for context in sorted(tpot[ours]):
        cells = []
        for e in engines:
            shortest = tpot[e][min(tpot[e])]
            value = tpot[e].get(context)
            cells.append("–" if value is None else f"{value:.1f} ({value / shortest:.2f}×)")
        lines.append(f"| {prompt_tokens[context]:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kv_memory() -> dict[str, list[list[int]]]:
    cfg = GGUFCheckpoint(str(bundled_model_path())).hf_config()
    per_element = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]  # K and V
    return {e: [[c, c * per_element * KV_BYTES[e]] for c in CONTEXTS] for e in ENGINES}


def load_reports(directory: Path, prompt_set: str) -> dict[str, dict[str, Any]]:
    paths = {e: directory / f"{e}-{prompt_set}.json" for e in ENGINES}
    return {e: json.loads(path.read_text()) for e, path in paths.items() if path.exists()}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dir", type=Path)
    args = parser.parse_args()
    load = lambda name: json.loads((args.dir / name).read_text())  # noqa: E731
    short = {e: load(f"{e}-short.json") for e in ENGINES if (args.dir / f"{e}-short.json").exists()}
    shared = {
        e: load(f"{e}-shared-prefix.json") for e in ENGINES if (args.dir / f"{e}-shared-prefix.json").exists()
    }
    if not any(e in short for e in OURS):
        raise SystemExit(f"no yaie-short.json or yaie-fp32-short.json in {args.dir}")
    report = table(short, shared)
    contexts = context_table(args.dir)
    if contexts:
        report += "\n\nDecode cost against context (one client, TPOT p50):\n\n" + contexts
    kv = kv_memory()
    per_token = {e: points[0][1] // points[0][0] for e, points in kv.items()}
    report += "\n\nKV cache bytes per token: " + ", ".join(f"{e} {b:,}" for e, b in per_token.items()) + "\n"
    (args.dir / "report.md").write_text(report + "\n")
    print(report)
    kv_path = args.dir / "kv_memory.json"
    kv_path.write_text(json.dumps(kv, indent=1) + "\n")
    runs = [str(args.dir / f"{e}-short.json") for e in short]
    plots = [sys.executable, str(Path(__file__).with_name("plots.py")), *runs]
    subprocess.run([*plots, "--out-dir", str(args.dir / "plots"), "--kv-json", str(kv_path)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
