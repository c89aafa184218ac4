"""Plot serve_bench results of several engines side by side, and KV-cache memory per context length.

    python benchmarks/plots.py results/yaie.json results/vllm.json results/llamacpp.json \\
        --out-dir results/plots [--kv-json results/kv_memory.json]

Inputs are the JSON files written by `benchmarks/serve_bench.py --out` (one per engine, or per engine
and prompt set). Writes PNGs into --out-dir:

- throughput.png: aggregate output tok/s against concurrency, one line per engine;
- ttft_cdf.png: the distribution (CDF) of per-request TTFT, one panel per concurrency level;
- kv_memory.png (with --kv-json): KV-cache bytes against context length, from a JSON object
  {engine: [[context_tokens, bytes], ...]}.

Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def load_runs(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """serve_bench reports keyed by a display name: the label, plus the prompt set if labels repeat."""
    reports = [json.loads(path.read_text()) for path in paths]
    labels = [str(r.get("label") or path.stem) for r, path in zip(reports, paths, strict=True)]
    runs: dict[str, dict[str, Any]] = {}
    for report, label, path in zip(reports, labels, paths, strict=True):
        name = label if labels.count(label) == 1 else f"{label} ({report.get('prompt_set', path.stem)})"
        if name in runs:
            name = f"{name} [{path.stem}]"
        runs[name] = report
    return runs


def describe(runs: dict[str, dict[str, Any]]) -> str:
    """A subtitle with the workload, when all runs share it."""
    sets = {r.get("prompt_set") for r in runs.values()}
    max_tokens = {r.get("max_tokens") for r in runs.values()}
    parts = []
    if len(sets) == 1:
        parts.append(f"prompt set {sets.pop()}")
    if len(max_tokens) == 1:
        parts.append(f"max_tokens {max_tokens.pop()}")
    return ", ".join(parts)


def plot_throughput(runs: dict[str, dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    all_levels: set[int] = set()
    for name, report in runs.items():
        levels = sorted(report["levels"], key=lambda level: level["concurrency"])
        xs = [level["concurrency"] for level in levels]
        all_levels.update(xs)
        ax.plot(xs, [level["output_tok_s"] for level in levels], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(all_levels), [str(x) for x in sorted(all_levels)])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s (all requests)")
    ax.set_title("Throughput vs concurrency" + (f"\n{describe(runs)}" if describe(runs) else ""))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, out)


def save(fig: Any, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def request_ttfts(level: dict[str, Any]) -> list[float]:
    return sorted(
        r["ttft_s"]
        for r in level.get("requests", [])
        if r.get("error") is None and r.get("ttft_s") is not None
    )


def plot_ttft_cdf(runs: dict[str, dict[str, Any]], out: Path, only: list[int] | None) -> None:
    levels = sorted({level["concurrency"] for report in runs.values() for level in report["levels"]})
    if only:
        levels = [c for c in levels if c in only]
    if not levels:
        raise SystemExit("no concurrency level to plot TTFTs for")
    fig, axes = plt.subplots(1, len(levels), figsize=(4.5 * len(levels), 4), squeeze=False, sharey=True)
    for ax, concurrency in zip(axes[0], levels, strict=True):
        for name, report in runs.items():
            for level in report["levels"]:
                ttfts = request_ttfts(level) if level["concurrency"] == concurrency else []
                if ttfts:
                    fractions = [0.0] + [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                    ax.step([ttfts[0], *ttfts], fractions, where="post", label=name)
        ax.set_title(f"concurrency {concurrency}")
        ax.set_xlabel("time to first token (s)")
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("fraction of requests")
    subtitle = describe(runs)
    fig.suptitle("TTFT distribution" + (f" ({subtitle})" if subtitle else ""))
    save(fig, out)


def plot_kv_memory(kv: dict[str, list[list[float]]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine, points in kv.items():
        ordered = sorted((float(context), float(size)) for context, size in points)
        ax.plot([c for c, _ in ordered], [b / 2**20 for _, b in ordered], marker="o", label=engine)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache (MiB)")
    ax.set_title("KV-cache memory vs context length")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, out)


def load_kv(path: Path) -> dict[str, list[list[float]]]:
    kv = json.loads(path.read_text())
    if not isinstance(kv, dict) or not all(
        isinstance(points, list) and all(len(point) == 2 for point in points) for points in kv.values()
    ):
        raise SystemExit(f"{path}: expected {{engine: [[context, bytes], ...]}}")
    return kv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("results", nargs="*", type=Path, help="serve_bench JSON files, one per engine")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-plots"), help="where to write PNGs")
    parser.add_argument("--kv-json", type=Path, default=None, help="{engine: [[context, bytes], ...]}")
    parser.add_argument(
        "--ttft-concurrency",
        type=int,
        nargs="+",
        default=None,
        help="concurrency levels to draw TTFT CDFs for (default: all)",
    )
    args = parser.parse_args(argv)
    if not args.results and args.kv_json is None:
        parser.error("give serve_bench JSON files and/or --kv-json")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if args.results:
        runs = load_runs(args.results)
        plot_throughput(runs, args.out_dir / "throughput.png")
        plot_ttft_cdf(runs, args.out_dir / "ttft_cdf.png", args.ttft_concurrency)
        written += ["throughput.png", "ttft_cdf.png"]
    if args.kv_json is not None:
        plot_kv_memory(load_kv(args.kv_json), args.out_dir / "kv_memory.png")
        written.append("kv_memory.png")
    for name in written:
        print(args.out_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
