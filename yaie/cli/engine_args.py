"""The engine's options, shared by `serve`, `generate` and `chat` (and the engine `bench` fits),
and the one place they become an EngineConfig."""

from __future__ import annotations

import argparse

from yaie.cli.options import EnvDefaults, json_object, non_negative_int, parse_bytes, positive_int
from yaie.config import GENERATION_CONFIGS, KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES, EngineConfig
from yaie.pooling_params import POOLING_TYPES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The options every EngineConfig field has, each also read from its YAIE_* variable."""
    defaults = EngineConfig()
    add = EnvDefaults(parser).add
    add(
        "--dtype",
        default=defaults.dtype,
        choices=("auto", "float32", "float16", "bfloat16"),
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    add(
        "--quantization",
        default=defaults.quantization,
        choices=QUANTIZATIONS,
        help="auto: a GGUF file's or an AWQ/GPTQ checkpoint's weights run as stored, a dense checkpoint in "
        "--dtype; none: dequantize to --dtype (exact transformers parity); int8, int4: quantize a dense "
        "checkpoint at load",
    )
    add(
        "--kv-cache-dtype",
        default=defaults.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores; auto: --dtype, or float16 under quantized weights (as llama.cpp). "
        "16 bits hold twice the tokens in the same memory",
    )
    add("--max-model-len", type=positive_int, help="context length (default: the model's)")
    add("--num-kv-blocks", type=positive_int, help="KV cache blocks (overrides --kv-cache-memory)")
    add(
        "--kv-cache-memory",
        type=parse_bytes,
        help="KV cache size, e.g. 2GiB (default: a share of free memory)",
    )
    add(
        "--threads",
        type=positive_int,
        help="CPU threads the model runs on (default: one per core). Where another program keeps a "
        "core busy, one thread fewer than cores decodes faster: every step waits for its slowest thread",
    )
    add(
        "--speculative-config",
        type=json_object,
        help='speculative decoding, as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    add(
        "--max-num-seqs",
        type=positive_int,
        default=defaults.max_num_seqs,
        help="most sequences decoding together",
    )
    add(
        "--max-num-batched-tokens",
        type=positive_int,
        default=defaults.max_num_batched_tokens,
        help="token budget of one step",
    )
    add(
        "--long-prefill-token-threshold",
        type=non_negative_int,
        default=defaults.long_prefill_token_threshold,
        help="most tokens one prompt computes in a step (0: what the budget leaves): a step beside a long "
        "prompt stays short for the streams decoding, and requests arriving meanwhile get in beside it",
    )
    add(
        "--scheduling-policy",
        default=defaults.scheduling_policy,
        choices=SCHEDULING_POLICIES,
        help="fcfs: first come, first served (a request's priority must be 0); priority: requests with a "
        "lower `priority` are admitted first and preempted last, arrival order among equals (as vLLM)",
    )
    add("--block-size", type=positive_int, default=defaults.block_size, help="tokens per KV cache block")
    add(
        "--no-prefix-caching", action="store_true", help="do not reuse the KV cache of shared prompt prefixes"
    )
    add(
        "--generation-config",
        default=defaults.generation_config,
        choices=GENERATION_CONFIGS,
        help="auto: the model's generation_config.json sampling defaults apply to requests that omit them "
        "(vLLM's --generation-config auto); vllm: the API's own defaults",
    )
    add(
        "--pooling",
        default=defaults.pooling,
        choices=POOLING_TYPES,
        help="how an embedding (/v1/embeddings, /api/embed) is made from the final hidden states: last, "
        "the last token's; mean, the average over every token",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the options of `add_engine_args` (and a model argument) describe."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        speculative_config=args.speculative_config,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        generation_config=args.generation_config,
        scheduling_policy=args.scheduling_policy,
        pooling=args.pooling,
    )
