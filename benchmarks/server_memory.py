"""What a server holds in memory with quantized weights against dense fp32 ones.

    python benchmarks/server_memory.py [--quantizations auto none] [--num-kv-blocks 256]
        [--out benchmarks/results/server_memory.json] [-- serve args]

Each quantization gets its own `yaie serve` with the same KV pool (`--num-kv-blocks`), one after
the other. After one short chat completion (so that every lazily built part, the native kernels
and the sampler's buffers, exists) the script reads the server process's resident set (VmRSS
of /proc/PID/status) and what /version reports as the weights' resident bytes, and takes the KV
pool out of the RSS: the pool is allocated zero-filled, so all of it is resident, and it is
`--num-kv-blocks` x the bytes of one block (from the model's config and /version's KV dtype).
Reported: RSS, RSS less the pool, weights, and each quantization's ratios to the first one's
(by default auto's against none's: the issue's floors are <= 0.4x and <= 0.25x of fp32).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx
import torch
from bench_utils import machine_info, make_console, write_report

from yaie.bench import yaie_server
from yaie.config import QUANTIZATIONS, EngineConfig
from yaie.engine.model_runner import ModelRunner
from yaie.model.config import ModelConfig
from yaie.model.loader import open_checkpoint, resolve_model_path


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def measure(quantization: str, args: argparse.Namespace, config: ModelConfig) -> dict[str, Any]:
    serve_args = ["--quantization", quantization, "--num-kv-blocks", str(args.num_kv_blocks)]
    with yaie_server(serve_args + args.serve_args) as (server, base_url):
        with httpx.Client(base_url=base_url, timeout=300, trust_env=False) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
            client.post("/v1/chat/completions", json=body).raise_for_status()
            version = client.get("/version").json()
        rss = rss_bytes(server.pid)
    kv_dtype = getattr(torch, version["kv_cache_dtype"])
    pool = args.num_kv_blocks * ModelRunner.bytes_per_block(config, EngineConfig.block_size, kv_dtype)
    return {
        "quantization": quantization,
        "weights_as": version["quantization"],
        "rss_bytes": rss,
        "kv_pool_bytes": pool,
        "rss_less_pool_bytes": rss - pool,
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
            f"{row['quantization']:5} ({row['weights_as']}): RSS {row['rss_bytes'] / mib:7.1f} MiB, "
            f"less the {row['kv_pool_bytes'] / mib:.1f} MiB pool {row['rss_less_pool_bytes'] / mib:7.1f} MiB "
            f"({row['rss_less_pool_ratio']:.2f}x), weights {row['weight_bytes'] / mib:6.1f} MiB "
            f"({row['weight_ratio']:.2f}x)"
        )
    if args.out:
        report = {"args": sys.argv[1:], "machine": machine_info(), "results": rows}
        write_report(args.out, report, console)


if __name__ == "__main__":
    main()
