"""What a server holds in memory with quantized weights against dense fp32 ones.

    python benchmarks/server_memory.py [--quantizations auto none] [--num-kv-blocks 256]
        [--out benchmarks/results/server_memory.json] [-- serve args]

Each quantization gets its own `yaie serve` with the same KV pool (`--num-kv-blocks`), one after
the other. After one short chat completion (so that every lazily built part, the native kernels
and the sampler's buffers, exists) the script reads the server process's resident set (Rss of
/proc/PID/smaps_rollup, the figure VmRSS gives) and what /version reports as the weights'
resident bytes, and takes the KV pool out of the RSS: the pool is allocated zero-filled, so all
of it is resident, and it is `--num-kv-blocks` x the bytes of one block (from the model's config
and /version's KV dtype).
Reported: RSS (and how much of it is anonymous memory, how much pages of mapped files: the
libraries' code), RSS less the pool, weights, and each quantization's ratios to the first one's
(by default auto's against none's: the issue's floors are <= 0.4x and <= 0.25x of fp32).

What a server holds besides weights and pool is then profiled in bare processes, one per line,
each adding a part of what `yaie serve` has before it loads the weights: `import torch`; the
modules `yaie serve` imports (yaie.cli: torch, transformers, FastAPI, uvicorn, ...); and the
model's tokenizer, loaded as the server loads it. With each server's weights on top, that is the
least the server could be, and the ratio of the two the least its RSS less the pool could reach.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import torch
from bench_utils import machine_info, make_console, write_report

from yaie.config import QUANTIZATIONS, EngineConfig
from yaie.engine.model_runner import ModelRunner
from yaie.model.config import ModelConfig
from yaie.model.loader import open_checkpoint, resolve_model_path
from yaie_bench.launcher import yaie_server


def parse_rollup(text: str) -> dict[str, int]:
    """RSS from /proc/PID/smaps_rollup, and its anonymous part (heap, stacks, tensors; the rest
    is pages of mapped files: the shared libraries' code and data), in bytes."""
    fields = {}
    for line in text.strip().splitlines()[1:]:  # the first names the range
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return {"rss_bytes": fields["Rss"], "anonymous_bytes": fields["Anonymous"]}


# Each bare process runs these lines in turn, up to its own. The tokenizer's loading frees much
# of what it allocates: handed back to the OS as the server does after loading (malloc_trim).
PARTS = [
    ("import torch", "import torch"),
    ("+ the server's imports (yaie.cli)", "import yaie.cli"),
    (
        "+ the model's tokenizer",
        "import ctypes\n"
        "from yaie.model.loader import load_tokenizer, resolve_model_path\n"
        "load_tokenizer(resolve_model_path({model!r}))\n"
        "ctypes.CDLL(None).malloc_trim(0)",
    ),
]


def profile_parts(model: str | None) -> list[dict[str, Any]]:
    rows = []
    for i, (part, _) in enumerate(PARTS):
        lines = [code.format(model=model) for _, code in PARTS[: i + 1]]
        lines.append("print(open('/proc/self/smaps_rollup').read())")
        command = [sys.executable, "-c", "\n".join(lines)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append({"part": part, **parse_rollup(done.stdout)})
    return rows


def measure(quantization: str, args: argparse.Namespace, config: ModelConfig) -> dict[str, Any]:
    serve_args = ["--quantization", quantization, "--num-kv-blocks", str(args.num_kv_blocks)]
    with yaie_server(serve_args + args.serve_args) as (server, base_url):
        with httpx.Client(base_url=base_url, timeout=300, trust_env=False) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
            client.post("/v1/chat/completions", json=body).raise_for_status()
            version = client.get("/version").json()
        memory = parse_rollup(Path(f"/proc/{server.pid}/smaps_rollup").read_text())
    kv_dtype = getattr(torch, version["kv_cache_dtype"])
    pool = args.num_kv_blocks * ModelRunner.bytes_per_block(config, EngineConfig.block_size, kv_dtype)
    return {
        "quantization": quantization,
        "weights_as": version["quantization"],
        **memory,
        "kv_pool_bytes": pool,
        "rss_less_pool_bytes": memory["rss_bytes"] - pool,
        "weight_bytes": version["weight_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--quantizations", nargs="+", choices=QUANTIZATIONS, default=["auto", "none"])
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--out", type=Path)
    parser.add_argument("serve_args", nargs="*", help="more `yaie serve` arguments, after --")
    args = parser.parse_args()
    if args.model:
        args.serve_args = [args.model, *args.serve_args]
    console = make_console()
    checkpoint = open_checkpoint(resolve_model_path(args.model))
    config = ModelConfig.from_hf(checkpoint.hf_config())
    rows = [measure(q, args, config) for q in args.quantizations]
    base = rows[-1] if "none" not in args.quantizations else rows[args.quantizations.index("none")]
    mib = 2**20
    for row in rows:
        row["rss_less_pool_ratio"] = row["rss_less_pool_bytes"] / base["rss_less_pool_bytes"]
        row["weight_ratio"] = row["weight_bytes"] / base["weight_bytes"]
        console.print(
            f"{row['quantization']:5} ({row['weights_as']}): RSS {row['rss_bytes'] / mib:7.1f} MiB "
            f"({row['anonymous_bytes'] / mib:.1f} anonymous), "
            f"less the {row['kv_pool_bytes'] / mib:.1f} MiB pool {row['rss_less_pool_bytes'] / mib:7.1f} MiB "
            f"({row['rss_less_pool_ratio']:.2f}x), weights {row['weight_bytes'] / mib:6.1f} MiB "
            f"({row['weight_ratio']:.2f}x)"
        )
    parts = profile_parts(args.model)
    console.print("bare processes, without weights or pool:")
    for part in parts:
        console.print(
            f"  {part['part']:36} RSS {part['rss_bytes'] / mib:6.1f} MiB "
            f"({part['anonymous_bytes'] / mib:.1f} anonymous)"
        )
    # The least each server could be: the bare process that has all a server needs but its
    # weights and pool, plus the weights. Their ratio is the least RSS less the pool can reach.
    bare = parts[-1]["rss_bytes"]
    for row in rows:
        row["least_bytes"] = bare + row["weight_bytes"]
        row["least_ratio"] = row["least_bytes"] / (bare + base["weight_bytes"])
        console.print(
            f"{row['quantization']:5}: bare process + weights {row['least_bytes'] / mib:6.1f} MiB "
            f"({row['least_ratio']:.2f}x)"
        )
    if args.out:
        report = {"args": sys.argv[1:], "machine": machine_info(), "results": rows, "parts": parts}
        write_report(args.out, report, console)


if __name__ == "__main__":
    main()
