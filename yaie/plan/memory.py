"""Bytes: of weights in a dtype or quantization, of K/V per token, and of the runtime around them.

Block-quantized formats store a group of weights plus a scale (and for some a minimum) per group,
so their bytes per weight are the block's bytes over its weights: Q4_1 keeps 32 4-bit weights
with an fp16 scale and an fp16 minimum, 16 + 2 + 2 = 20 bytes per 32 weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from yaie.plan.architecture import Architecture

GIB = 1 << 30

# Bytes per weight of each storage format.
WEIGHT_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "fp8": 1, "int8": 1, "int4": 0.5,
    "Q8_0": 34 / 32, "Q5_0": 22 / 32, "Q5_1": 24 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32,
    "Q6_K": 210 / 256, "Q5_K": 176 / 256, "Q4_K": 144 / 256, "Q3_K": 110 / 256, "Q2_K": 84 / 256,
    "IQ4_XS": 136 / 256, "IQ4_NL": 18 / 32,
}  # fmt: skip
FLOAT_DTYPES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
KV_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "fp8": 1, "int8": 1,
}  # fmt: skip


def weight_bytes_per_param(dtype: str) -> float:
    if dtype not in WEIGHT_BYTES:
        raise ValueError(f"unknown weight dtype {dtype!r}; known: {', '.join(WEIGHT_BYTES)}")
    return WEIGHT_BYTES[dtype]


def kv_itemsize(kv_dtype: str, weight_dtype: str) -> int:
    """Bytes of one K or V element. `auto` stores the cache in the weights' dtype, or in bf16 when
    the weights are quantized (engines dequantize into a float cache)."""
    if kv_dtype == "auto":
        return KV_BYTES[weight_dtype] if weight_dtype in FLOAT_DTYPES else 2
    if kv_dtype not in KV_BYTES:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; known: auto, {', '.join(KV_BYTES)}")
    return KV_BYTES[kv_dtype]


def weight_bytes(arch: Architecture, dtype: str) -> int:
    """All weights in `dtype`. Other than float formats keep norms and biases in 16 bits: they are
    tiny and quantizing them saves nothing."""
    per_param = weight_bytes_per_param(dtype)
    vectors = arch.num_vector_parameters
    if dtype in FLOAT_DTYPES:
        return math.ceil(arch.num_parameters * per_param)
    return math.ceil((arch.num_parameters - vectors) * per_param) + 2 * vectors


def kv_heads_per_gpu(arch: Architecture, tensor_parallel_size: int) -> int:
    """K/V heads are split across GPUs; with more GPUs than heads each GPU keeps a copy of one."""
    if arch.num_heads % tensor_parallel_size:
        raise ValueError(
            f"{arch.num_heads} attention heads do not split over {tensor_parallel_size} GPUs"
        )
    return math.ceil(arch.num_kv_heads / tensor_parallel_size)


def kv_bytes_per_token_per_layer(arch: Architecture, itemsize: int, tensor_parallel_size: int = 1) -> int:
    """K and V of one token in one full-attention layer, on one GPU."""
    return 2 * kv_heads_per_gpu(arch, tensor_parallel_size) * arch.head_dim * itemsize


@dataclass(frozen=True)
class Overhead:
    """Memory a running engine needs besides weights and KV cache, per GPU.

    `framework_bytes` covers the CUDA context, the allocator's slack and communication buffers;
    the rest is the peak activation memory of one step of `max_num_batched_tokens` tokens: the
    hidden states, the attention and MLP intermediates of one layer at a time (layers run one
    after another, so only one layer's are alive), and fp32 logits for `max_num_seqs` rows.
    """

    framework_bytes: int = GIB
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256

    def bytes(self, arch: Architecture, activation_itemsize: int, tensor_parallel_size: int = 1) -> int:
        tp = tensor_parallel_size
        q_kv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim // tp
        per_token = 2 * arch.hidden_size + q_kv + 2 * arch.intermediate_size // tp
        activations = self.max_num_batched_tokens * per_token * activation_itemsize
        logits = self.max_num_seqs * math.ceil(arch.vocab_size / tp) * 4
        return self.framework_bytes + activations + logits
