"""What an `EngineConfig` resolves to on this machine: the device, the compute and KV cache
dtypes, how many KV blocks the cache gets, and the context length they allow.

These are the engine's decisions made once, at start, from the configuration, the model's
config and the machine; `Engine.__init__` asks for them and builds with the answers.
"""

from __future__ import annotations

import logging
import os

import torch

from yaie.config import EngineConfig
from yaie.model.config import ModelConfig

logger = logging.getLogger(__name__)

# The KV cache's default share of the memory that is free: on a CPU a quarter of it, capped,
# because the whole cache is zeroed at start (a cost in start-up time that grows with it).
DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_CPU_KV_CAP = 2 << 30  # ~45k tokens of SmolLM2-135M in fp32
DEFAULT_GPU_KV_FRACTION = 0.85

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip


def resolve_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    if dtype == "auto":
        # On the CPU float32 is exact (transformers parity) and the path every kernel covers;
        # bf16 pays only on CPUs with bf16 instructions (AVX512-BF16, AMX), at bf16's precision,
        # so it is the user's choice (docs/performance.md, "bf16 on CPU", has both measured).
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return dev, DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The KV cache's element type for a KV_CACHE_DTYPES name (EngineConfig checked it).

    "auto" is `dtype`, the model's compute dtype, except under quantized weights computing in
    float32: there float16, as llama.cpp's default cache. The weights are rounded far more than
    16 bits round K/V (benchmarks/perplexity.py --kv-cache-dtype measures what a float16 cache
    moves the bundled Q4_1 model's perplexity by), and at many sequences decode attention
    reads the whole cache every step, so half the bytes make a faster step. float16 rather than
    bfloat16 for its three more significand bits. Dense weights keep their own dtype:
    `--quantization none` is exact transformers parity.
    """
    if kv_cache_dtype == "auto":
        return torch.float16 if quantized and dtype == torch.float32 else dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[kv_cache_dtype]


def default_kv_cache_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_GPU_KV_FRACTION)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(int(available * DEFAULT_CPU_KV_FRACTION), DEFAULT_CPU_KV_CAP)


def num_kv_blocks(config: EngineConfig, device: torch.device, block_bytes: int) -> int:
    """The KV cache's blocks: as configured, or as many as its memory budget holds."""
    num_blocks = (
        config.num_kv_blocks or (config.kv_cache_memory or default_kv_cache_memory(device)) // block_bytes
    )
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget is smaller than one block ({block_bytes} bytes)")
    return num_blocks


def max_model_len(config: EngineConfig, model_config: ModelConfig, num_blocks: int) -> int:
    """The longest sequence (prompt and output) the engine runs: the configured or the model's
    context, within a sliding window and within what the KV cache holds."""
    limit = config.max_model_len or model_config.max_position_embeddings
    if model_config.sliding_window:  # we attend to the whole context, which is exact only inside the window
        limit = min(limit, model_config.sliding_window)
    capacity = num_blocks * config.block_size
    if capacity < limit:
        logger.warning("KV cache holds %d tokens; limiting max_model_len from %d", capacity, limit)
    return min(limit, capacity)
