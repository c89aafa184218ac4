"""Built-in model configs, kept as the fields of each model's published HF config.json.

Only the fields planning reads are kept (sizes, heads, tying, windows, experts); `model_type`
and `architectures` are as published, so presets go through the same reader as a user's file.
"""

from __future__ import annotations

from typing import Any

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}


def _config(
    model_type: str, sizes: tuple[int, int, int, int, int, int], context: int, **extra: Any
) -> dict[str, Any]:
    """sizes: vocab, hidden, intermediate, layers, attention heads, K/V heads."""
    vocab, hidden, intermediate, layers, heads, kv_heads = sizes
    return {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": context,
        **extra,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "Llama-3-8B": _config("llama", (128256, 4096, 14336, 32, 32, 8), 8192),
    "Llama-3-70B": _config("llama", (128256, 8192, 28672, 80, 64, 8), 8192),
    "Llama-3-405B": _config("llama", (128256, 16384, 53248, 126, 128, 8), 131072),
    "Llama-3.2-1B": _config(
        "llama", (128256, 2048, 8192, 16, 32, 8), 131072, head_dim=64, tie_word_embeddings=True
    ),
    "Llama-3.2-3B": _config(
        "llama", (128256, 3072, 8192, 28, 24, 8), 131072, head_dim=128, tie_word_embeddings=True
    ),
    "Mistral-7B": _config("mistral", (32000, 4096, 14336, 32, 32, 8), 32768, sliding_window=4096),
    "Mixtral-8x7B": _config(
        "mixtral", (32000, 4096, 14336, 32, 32, 8), 32768, num_local_experts=8, num_experts_per_tok=2
    ),
    "Qwen2.5-0.5B": _config("qwen2", (151936, 896, 4864, 24, 14, 2), 32768, tie_word_embeddings=True),
    "Qwen2.5-7B": _config("qwen2", (152064, 3584, 18944, 28, 28, 4), 32768),
    "Qwen2.5-72B": _config("qwen2", (152064, 8192, 29568, 80, 64, 8), 32768),
    "Qwen3-8B": _config("qwen3", (151936, 4096, 12288, 36, 32, 8), 40960, head_dim=128),
    "Qwen3-32B": _config("qwen3", (151936, 5120, 25600, 64, 64, 8), 40960, head_dim=128),
    "SmolLM2-135M": _config("llama", (49152, 576, 1536, 30, 9, 3), 8192, tie_word_embeddings=True),
    "SmolLM2-360M": _config("llama", (49152, 960, 2560, 32, 15, 5), 8192, tie_word_embeddings=True),
    "SmolLM2-1.7B": _config("llama", (49152, 2048, 8192, 24, 32, 32), 8192, tie_word_embeddings=True),
    "Gemma-2-9B": _config(
        "gemma2",
        (256000, 3584, 14336, 42, 16, 8),
        8192,
        head_dim=256,
        sliding_window=4096,
        tie_word_embeddings=True,
    ),
}
