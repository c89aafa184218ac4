"""The few architecture facts the model code needs, read from a HF-style config dict.

GGUF metadata is translated into the same dict shape by the GGUF loader, so there is one
path from "config" to "model" whatever the file format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yaie.errors import UnsupportedModelError

# HF architecture name -> (q/k/v projections always have a bias, q/k get a per-head RMSNorm).
# Llama and Qwen3 configs may also ask for biases on all four projections (`attention_bias`).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        architectures = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; yaie runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        o_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and bool(cfg.get("attention_bias", False))
        qkv_bias = qkv_bias or o_bias
        num_heads = cfg["num_attention_heads"]
        # transformers 5 keeps rope settings in `rope_parameters`; older configs use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        if rope_scaling is not None and rope_type not in ("linear", "llama3"):
            raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported")
        sliding_window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding_window = None
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            sliding_window=sliding_window,
            eos_token_ids=eos_ids,
        )
