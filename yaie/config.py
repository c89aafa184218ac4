"""Engine configuration: everything a user can tune, in one place, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yaie.pooling_params import POOLING_TYPES

# How linear layers hold their weights (yaie/model/quantization.py).
QUANTIZATIONS = ("none", "auto", "int8", "int4")
# What the KV cache stores; auto: the model's compute dtype, or float16 under quantized weights
# computing in float32 (yaie.engine.resources.resolve_kv_cache_dtype). A 16-bit cache holds twice
# the tokens in the same memory; attention still computes in the compute dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Where a request's omitted sampling parameters come from (vLLM's --generation-config): auto,
# the model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
# max_new_tokens); vllm, the API's own defaults (temperature 1.0 ...), ignoring the model's.
GENERATION_CONFIGS = ("auto", "vllm")
# How the scheduler orders waiting sequences and picks preemption victims (vLLM's
# --scheduling-policy; yaie/engine/scheduler.py): fcfs, arrival order, a request's priority must
# be 0; priority, a request's `priority` first (lower first), then arrival.
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineConfig:
    model: str | None = None  # a .gguf file or a HF directory; None = the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    kv_cache_memory: int | None = None  # bytes; None = a fraction of free memory, capped
    max_num_seqs: int = 64  # most requests decoding together
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    # The most tokens one prompt computes in a step (vLLM's name; 0: as many as the budget
    # leaves). A step beside a long prompt then takes at most this many of its tokens, which
    # bounds the time between a decoding stream's tokens, and leaves the rest of the budget to
    # the prompts of requests that arrive meanwhile (yaie/engine/scheduler.py).
    long_prefill_token_threshold: int = 512
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch CPU threads; None = torch's default
    # auto: a GGUF file's linear layers run as stored, a dense checkpoint in dtype; none: every
    # weight dequantized to dtype (exact transformers parity); int8/int4: quantized at load.
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # vLLM's speculative decoding settings, e.g. {"method": "ngram", "num_speculative_tokens": 4};
    # see yaie.spec.config.SpeculativeConfig. None: off.
    speculative_config: dict[str, Any] | None = None
    generation_config: str = "auto"  # one of GENERATION_CONFIGS
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES
    # How a pooling request (an embedding) that names no pooling_type makes its vector from the
    # final hidden states: "last" (the last token's) or "mean" (every token's), POOLING_TYPES.
    pooling: str = "last"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            threshold = self.long_prefill_token_threshold
            raise ValueError(f"long_prefill_token_threshold must be 0 (off) or positive, got {threshold}")
        if self.quantization not in QUANTIZATIONS:
            choices = ", ".join(QUANTIZATIONS)
            raise ValueError(f"quantization must be one of {choices}; got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            choices = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {choices}; got {self.kv_cache_dtype!r}")
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}; got {self.pooling!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            choices = ", ".join(GENERATION_CONFIGS)
            raise ValueError(f"generation_config must be one of {choices}; got {self.generation_config!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            choices = ", ".join(SCHEDULING_POLICIES)
            raise ValueError(f"scheduling_policy must be one of {choices}; got {self.scheduling_policy!r}")
