"""The plan: weights, runtime overhead and KV cache on each GPU, and how many sequences fit.

Memory on one GPU = weights / tp + runtime overhead + KV cache. The KV cache is cut into blocks
of `block_size` tokens of every layer, the unit the engine allocates (so the numbers here are the
engine's: `kv_cache_memory // bytes_per_block` blocks). A sequence of C tokens needs C tokens of
K/V in full-attention layers and at most `window` tokens in sliding-window layers, rounded up to
whole blocks; the pool holds as many such sequences as its bytes allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from yaie.plan.architecture import Architecture
from yaie.plan.memory import (
    FLOAT_DTYPES,
    Overhead,
    kv_bytes_per_token_per_layer,
    kv_itemsize,
    weight_bytes,
)
from yaie.plan.sources import ModelSource, PlanError

DEFAULT_CONTEXTS = (2048, 4096, 8192, 32768, 131072)


@dataclass(frozen=True)
class Plan:
    model: str
    architecture: Architecture
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    num_parameters: int
    num_active_parameters: int
    weight_bytes: int  # all GPUs together
    weight_bytes_per_gpu: int
    overhead_bytes_per_gpu: int
    memory_per_gpu: int | None  # None when the KV cache size was given directly
    kv_cache_bytes_per_gpu: int
    kv_bytes_per_token: int  # full attention in every layer, all GPUs together
    kv_bytes_per_token_per_gpu: int
    bytes_per_block: int  # on one GPU
    kv_budget_blocks: int
    kv_budget_tokens: int
    # context -> most concurrent sequences of that length; None beyond the model's context.
    max_sequences: dict[int, int | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        arch = self.architecture
        return {
            "model": self.model,
            "architecture": arch.name,
            "dtype": self.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "block_size": self.block_size,
            "num_parameters": self.num_parameters,
            "num_active_parameters": self.num_active_parameters,
            "weight_bytes": self.weight_bytes,
            "weight_bytes_per_gpu": self.weight_bytes_per_gpu,
            "overhead_bytes_per_gpu": self.overhead_bytes_per_gpu,
            "memory_per_gpu": self.memory_per_gpu,
            "kv_cache_bytes_per_gpu": self.kv_cache_bytes_per_gpu,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
            "sliding_window": arch.sliding_window,
            "max_position_embeddings": arch.max_position_embeddings,
            "bytes_per_block": self.bytes_per_block,
            "kv_budget_blocks": self.kv_budget_blocks,
            "kv_budget_tokens": self.kv_budget_tokens,
            "max_sequences": {str(context): count for context, count in self.max_sequences.items()},
        }


def sequence_kv_bytes(arch: Architecture, context: int, block_size: int, per_layer_token_bytes: int) -> int:
    """K/V of one `context`-token sequence on one GPU, in whole blocks per layer."""
    blocks = sum(math.ceil(tokens / block_size) for tokens in arch.kv_tokens_per_layer(context))
    return blocks * block_size * per_layer_token_bytes


def make_plan(
    source: ModelSource,
    *,
    dtype: str | None = None,
    kv_cache_dtype: str = "auto",
    memory: int | None = None,
    kv_cache_memory: int | None = None,
    tensor_parallel_size: int = 1,
    block_size: int = 16,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    overhead: Overhead | None = None,
) -> Plan:
    """Plan `source` on GPUs of `memory` bytes each, or with `kv_cache_memory` bytes of KV cache per
    GPU (then weights and overhead are reported but not subtracted). With no `dtype`, a GGUF file's
    own tensor bytes count as the weights; other sources default to bfloat16."""
    if (memory is None) == (kv_cache_memory is None):
        raise PlanError("give either the memory per GPU or the KV cache memory, not both or neither")
    if tensor_parallel_size < 1 or block_size < 1:
        raise PlanError("tensor_parallel_size and block_size must be at least 1")
    arch = source.architecture
    tp = tensor_parallel_size
    if dtype is None and source.file_weight_bytes is not None:
        weights, dtype_name = source.file_weight_bytes, "file"
    else:
        dtype_name = dtype or "bfloat16"
        weights = weight_bytes(arch, dtype_name)
    itemsize = kv_itemsize(kv_cache_dtype, dtype_name if dtype_name in FLOAT_DTYPES else "bf16")
    per_layer_token = kv_bytes_per_token_per_layer(arch, itemsize, tp)
    weights_per_gpu = math.ceil(weights / tp)
    activation_itemsize = kv_itemsize("auto", dtype_name if dtype_name in FLOAT_DTYPES else "bf16")
    overhead_bytes = (overhead or Overhead()).bytes(arch, activation_itemsize, tp)
    if kv_cache_memory is None:
        assert memory is not None
        kv_cache_memory = memory - weights_per_gpu - overhead_bytes
        if kv_cache_memory <= 0:
            raise PlanError(
                f"{source.name} needs {_gib(weights_per_gpu)} of weights and {_gib(overhead_bytes)} of "
                f"runtime overhead per GPU, {_gib(-kv_cache_memory)} more than the {_gib(memory)} given, "
                "before any KV cache: add memory, GPUs (--tensor-parallel-size) or quantize"
            )
    bytes_per_block = arch.num_layers * block_size * per_layer_token
    num_blocks = kv_cache_memory // bytes_per_block
    max_sequences: dict[int, int | None] = {}
    for context in contexts:
        fits = context <= arch.max_position_embeddings
        sequence_bytes = sequence_kv_bytes(arch, context, block_size, per_layer_token)
        max_sequences[context] = kv_cache_memory // sequence_bytes if fits else None
    return Plan(
        model=source.name,
        architecture=arch,
        dtype=dtype_name,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=tp,
        block_size=block_size,
        num_parameters=arch.num_parameters,
        num_active_parameters=arch.num_active_parameters,
        weight_bytes=weights,
        weight_bytes_per_gpu=weights_per_gpu,
        overhead_bytes_per_gpu=overhead_bytes,
        memory_per_gpu=memory,
        kv_cache_bytes_per_gpu=kv_cache_memory,
        kv_bytes_per_token=arch.num_layers * kv_bytes_per_token_per_layer(arch, itemsize, 1),
        kv_bytes_per_token_per_gpu=arch.num_layers * per_layer_token,
        bytes_per_block=bytes_per_block,
        kv_budget_blocks=num_blocks,
        kv_budget_tokens=num_blocks * block_size,
        max_sequences=max_sequences,
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"
