"""What a model's HF config says about its size: parameter count and per-layer KV shape.

Pure arithmetic over a config dict, no weights and no torch. The reader accepts any Llama-style
decoder (Llama, Mistral, Mixtral, Qwen2/2.5/3, SmolLM2, Gemma 2): attention with grouped K/V
heads, a gated MLP of three matrices (or a set of such experts behind a router), RMSNorms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yaie.errors import UnsupportedModelError

# The config fields without which a decoder's size cannot be known.
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
)  # fmt: skip


@dataclass(frozen=True)
class Architecture:
    name: str  # the HF architecture, e.g. LlamaForCausalLM
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of one expert, for MoE models
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2  # Gemma 2 also norms after attention and after the MLP
    num_experts: int = 1
    num_experts_per_token: int = 1
    # One entry per layer: the attention window in tokens, None for full attention.
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Architecture:
        name = (cfg.get("architectures") or [cfg.get("model_type") or "unknown"])[0]
        missing = [field for field in REQUIRED_FIELDS if cfg.get(field) is None]
        if missing:
            raise UnsupportedModelError(
                f"cannot plan {name}: its config has no {', '.join(missing)} "
                f"(plan reads Llama-style decoder configs, which need {', '.join(REQUIRED_FIELDS)})"
            )
        # GGUF-derived configs name only the architecture: Qwen2ForCausalLM -> qwen2.
        model_type = cfg.get("model_type") or name.removesuffix("ForCausalLM").lower()
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-style configs may ask for all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            qk_norm=model_type == "qwen3",
            norms_per_layer=4 if model_type == "gemma2" else 2,
            num_experts=int(cfg.get("num_local_experts") or 1),
            num_experts_per_token=int(cfg.get("num_experts_per_tok") or 1),
            layer_windows=_layer_windows(cfg, model_type, layers),
        )

    # -- parameters ---------------------------------------------------------------------------

    @property
    def embedding_parameters(self) -> int:
        """Input embeddings plus the LM head, which tied models share with them."""
        table = self.vocab_size * self.hidden_size
        return table if self.tie_word_embeddings else 2 * table

    def layer_parameters(self, experts: int | None = None) -> int:
        """One decoder layer, counting `experts` experts (default: all of them)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.o_bias:
            attention += h
        if self.qk_norm:
            attention += 2 * self.head_dim
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        router = h * self.num_experts if self.num_experts > 1 else 0
        return attention + mlp * (experts or self.num_experts) + router + self.norms_per_layer * h

    @property
    def num_parameters(self) -> int:
        return self.embedding_parameters + self.num_layers * self.layer_parameters() + self.hidden_size

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token goes through: MoE models route it to a few experts only."""
        per_layer = self.layer_parameters(self.num_experts_per_token)
        return self.embedding_parameters + self.num_layers * per_layer + self.hidden_size

    @property
    def num_vector_parameters(self) -> int:
        """Norm weights and biases: the 1-D tensors that stay unquantized."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = self.norms_per_layer * h
        per_layer += (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        return self.num_layers * per_layer + h

    # -- KV cache -----------------------------------------------------------------------------

    @property
    def sliding_window(self) -> int | None:
        windows = [w for w in self.layer_windows if w is not None]
        return min(windows) if windows else None

    def kv_tokens_per_layer(self, context: int) -> list[int]:
        """How many tokens of a `context`-token sequence each layer keeps K/V for."""
        return [context if w is None else min(context, w) for w in self.layer_windows]


def _layer_windows(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):  # newer configs spell the pattern out
        return tuple(window if kind == "sliding_attention" else None for kind in cfg["layer_types"])
    if window is None:
        return (None,) * layers
    if model_type == "gemma2":  # local and global attention alternate, starting with local
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return (None,) * layers
        first = int(cfg.get("max_window_layers", 0))
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers
