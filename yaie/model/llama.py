"""The decoder-only transformer behind every supported architecture, read top to bottom: the
model, a layer, attention, the MLP, then the small pieces they are made of.

Llama, Mistral, Qwen2 and Qwen3 differ only in two switches (qkv bias, per-head q/k norm), so
one model covers them. Tokens arrive as one flat batch: a step's prompts, prompt chunks and
decode tokens are one [tokens] sequence, so linear layers never see padding. Only attention needs
to know where one sequence ends and the next begins; `AttentionMetadata` tells it.

Every op that has a native kernel goes through `ops`, the backend the model was built with
(yaie/ops); the model knows only its own parameter names, and the loaders map checkpoints onto
them (yaie/model/loader.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from yaie.model.attention import AttentionMetadata, paged_attention
from yaie.model.config import ModelConfig
from yaie.model.linear import DenseLinear, Linear
from yaie.ops import Ops

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin of each token's position: [tokens, 1, head_dim]


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, ops: Ops) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        # An Embedding, or the loader's QuantizedEmbedding where the file stores the table quantized.
        self.embed_tokens: nn.Module = Embedding(cfg.vocab_size, cfg.hidden_size)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, inv_freq)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        # With tied embeddings the loader fills this with a copy of the embedding table (or, if
        # the table is quantized, makes it the one table both use).
        self.lm_head: Linear = DenseLinear(cfg.hidden_size, cfg.vocab_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """[tokens] ids -> [tokens, hidden] final hidden states (normed)."""
        residual: torch.Tensor = self.embed_tokens(input_ids)  # [tokens, hidden]
        x = torch.zeros_like(residual)  # nothing to add before the first layer
        rope = self.rope(positions, residual.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm.add_forward(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32."""
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Give each layer its part of the KV cache, [layers, K/V, blocks, block_size, kv_heads,
        head_dim]."""
        for layer, kv in zip(self.layers, kv_cache, strict=True):
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv[0], kv[1]

    def pack(self) -> None:
        """Pack every dense projection for the CPU's fastest path (DenseLinear.pack); once,
        after loading."""
        for module in self.modules():
            if isinstance(module, DenseLinear):
                module.pack()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual` (the running sum of
        the embedding and every sublayer's output, updated in place). Returns this layer's pair."""
        h = self.input_layernorm.add_forward(x, residual)  # residual += x
        h = self.self_attn(h, rope, meta)
        h = self.post_attention_layernorm.add_forward(h, residual)  # residual += attention's output
        return self.mlp(h), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj: Linear = DenseLinear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj: Linear = DenseLinear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        # Views into the runner's KV tensor, assigned by CausalLM.bind_kv_cache.
        self.k_cache = torch.empty(0)  # [blocks, block_size, kv_heads, head_dim]
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(-1, heads + 2 * kv_heads, self.head_dim)  # [tokens, all heads, head_dim]
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: each head normed first
            q, k = self.q_norm(q), self.k_norm(k)
            self.ops.apply_rope_(q, *rope)
            self.ops.apply_rope_(k, *rope)
        else:  # q and k heads rotated in one go
            self.ops.apply_rope_(qkv[:, : heads + kv_heads], *rope)
        o = paged_attention(self.ops, q, k, v, self.k_cache, self.v_cache, meta)  # [tokens, heads, head_dim]
        out: torch.Tensor = self.o_proj(o.flatten(1))
        return out


class GatedMLP(nn.Module):
    """SwiGLU feed-forward, gate and up projections fused into one matmul: down(silu(gate) * up)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj: Linear = DenseLinear(hidden_size, 2 * intermediate_size)
        self.down_proj: Linear = DenseLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden]."""
        gate_up = self.gate_up_proj(x)  # [tokens, 2 * intermediate]
        return self.down_proj.silu_mul_forward(gate_up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Add a sublayer's output to the residual stream (in place), then normalise it."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF layout) with cos/sin precomputed for every position.

    The tables are full width, cos as [cos, cos] and sin as [-sin, sin], so that rotating is
    x * cos + swap_halves(x) * sin: three ops for all heads of q and k together.
    """

    cos: torch.Tensor  # [max_positions, head_dim]
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin of each token's position, [tokens, 1, head_dim]: looked up once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with the scalings HF configs name."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling["rope_type"] == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled).float()


class Embedding(nn.Module):
    """Token ids -> rows of a dense [vocab, hidden] table (quantized tables: QuantizedEmbedding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))  # filled by the loader

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
